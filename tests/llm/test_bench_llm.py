"""``anygpu bench llm``: the ``tiny`` shape on every backend (a short prompt, a few decode
steps), its JSON row's numbers and how they relate, the roofline's bytes, the refusal of
quantized formats, and the comparison with transformers on the cpu."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import pytest

import anygpu as ag
from anygpu.cli import bench
from anygpu.llm import bench as llm_bench
from anygpu.llm.config import ModelConfig

SMALL = ("--config", "tiny", "--prompt-len", "16", "--decode-tokens", "4", "--copy-mib", "4")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", "llm", *argv])


def _rows(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_tiny_row_is_positive_and_consistent(device: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    quant = "f16" if ag.get_device(device).supports(ag.float16) else "f32"
    args = _args(*SMALL, "--quant", quant, "--device", device, "--json")
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert "first prefill" in captured.err
    (row,) = _rows(captured.out)
    assert (row["framework"], row["device"], row["config"], row["quant"]) == \
        ("anygpu", device, "tiny", quant)
    assert (row["prompt_len"], row["decode_tokens"]) == (16, 4)
    assert row["max_seq_len"] == 16 + llm_bench.DECODE_WARMUP + 4
    for key in ("params", "first_prefill_s", "prefill_s", "prefill_tokens_per_s", "decode_ms",
                "decode_tokens_per_s", "weight_bytes", "kv_cache_bytes", "bytes_per_token",
                "copy_gb_per_s", "roofline_tokens_per_s", "roofline_share"):
        assert row[key] > 0, key
    assert row["prefill_tokens_per_s"] == pytest.approx(16 / row["prefill_s"])
    assert row["decode_tokens_per_s"] == pytest.approx(1e3 / row["decode_ms"])
    assert row["bytes_per_token"] == row["weight_bytes"] + row["kv_cache_bytes"]
    assert row["roofline_tokens_per_s"] == pytest.approx(
        row["copy_gb_per_s"] * 1e9 / row["bytes_per_token"])
    assert row["roofline_share"] == pytest.approx(
        row["decode_tokens_per_s"] / row["roofline_tokens_per_s"])
    assert row["prefill_ratio"] is None and row["decode_ratio"] is None


def test_roofline_bytes_follow_the_shape() -> None:
    cfg = ModelConfig.from_dict(llm_bench.CONFIGS["llama-2-7b"])
    from anygpu.llm.weights import expected_shapes

    shapes = expected_shapes(cfg)
    params = sum(int(np.prod(s)) for s in shapes.values())
    assert params == 6_738_415_616  # Llama 2 7B's published count

    class Shaped:  # stands in for a device tensor: only the shape is read
        def __init__(self, shape: tuple[int, ...]) -> None:
            self.shape = shape

    weights = {name: Shaped(shape) for name, shape in shapes.items()}
    weight_bytes, kv_bytes = llm_bench.traffic(cfg, weights, ag.float16, 1024)
    # one row of the embedding table, every other weight once, in two bytes each
    assert weight_bytes == 2 * (params - 32000 * 4096 + 4096)
    # per layer two caches of (32, 1024, 128), read by attention, and one new row (32, 128)
    assert kv_bytes == 2 * 32 * (32 * 1025 * 128) * 2


def test_random_weights_have_the_shapes_and_scale() -> None:
    cfg = ModelConfig.from_dict(llm_bench.CONFIGS["tiny"])
    weights = llm_bench.random_weights(cfg, "cpu:0", ag.float32)
    from anygpu.llm.weights import expected_shapes

    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_shapes(cfg)
    embed = weights["model.embed_tokens.weight"].numpy()
    assert abs(embed.std() - llm_bench.INIT_STD) < 0.002 and abs(embed.mean()) < 0.002
    assert (weights["model.norm.weight"].numpy() == 1).all()
    # each tensor draws its own numbers
    q, k = (weights[f"model.layers.0.self_attn.{n}_proj.weight"].numpy() for n in "qk")
    assert not np.array_equal(q[:k.shape[0]], k)


@pytest.mark.parametrize("quant", ["q4", "q8"])
def test_packed_rows_read_their_packed_bytes(quant: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(*SMALL, "--quant", quant, "--device", "cpu", "--json")
    assert args.func(args) == 0
    (row,) = _rows(capsys.readouterr().out)
    assert row["quant"] == quant and row["decode_tokens_per_s"] > 0
    cfg = ModelConfig.from_dict(llm_bench.CONFIGS["tiny"])
    from anygpu.llm.weights import expected_shapes

    # projections: 1 or 1/2 byte a value and a 2-byte scale per 32; one embedding row, norms
    per_value = {"q8": 1, "q4": 0.5}[quant]
    compute = 2 if ag.get_device("cpu").supports(ag.float16) else 4
    want = 0.0
    for name, shape in expected_shapes(cfg).items():
        n = int(np.prod(shape))
        if name == "model.embed_tokens.weight":
            want += cfg.hidden_size * compute
        elif name.endswith("norm.weight"):
            want += n * compute
        else:
            want += n * per_value + n // 32 * 2
    assert row["weight_bytes"] == int(want)


def test_random_packed_weights_have_the_spread_of_float_ones() -> None:
    cfg = ModelConfig.from_dict(llm_bench.CONFIGS["tiny"])
    weights = llm_bench.random_weights(cfg, "cpu:0", ag.float32, packed="q4")
    w = weights["model.layers.0.mlp.up_proj.weight"]
    values = w.dequantize().numpy()
    assert values.shape == (128, 64)
    assert 0.3 * llm_bench.INIT_STD < values.std() < 3 * llm_bench.INIT_STD


def test_a_cache_too_short_is_refused() -> None:
    args = _args(*SMALL, "--device", "cpu", "--max-seq-len", "8")
    with pytest.raises(SystemExit, match="--max-seq-len 8 is shorter"):
        args.func(args)


def test_compare_torch_on_cpu_prints_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    args = _args(*SMALL, "--device", "cpu", "--compare", "torch")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "ratio: anygpu's time over PyTorch's" in out
    lines = out.splitlines()
    ours = next(line for line in lines if line.startswith("anygpu"))
    theirs = next(line for line in lines if line.startswith("torch"))
    assert "x/" in ours.split()[-1] and "float32" in theirs  # float32 on the processor
    args = _args(*SMALL, "--device", "cpu", "--compare", "torch", "--json")
    assert args.func(args) == 0
    ours_row, torch_row = _rows(capsys.readouterr().out)
    assert torch_row["framework"] == "torch" and torch_row["device"] == "cpu"
    assert torch_row["params"] == ours_row["params"]  # the same shape
    assert ours_row["decode_ratio"] == pytest.approx(ours_row["decode_ms"]
                                                     / torch_row["decode_ms"])
    assert ours_row["prefill_ratio"] == pytest.approx(ours_row["prefill_s"]
                                                      / torch_row["prefill_s"])
