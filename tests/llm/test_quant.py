"""Quantized weights: the device's dequantization of each format against a NumPy dequantizer
written here, the decode step's matrix-vector products reading the packed bytes (one kernel,
no dequantized copy), and q8 / q4 models' logits near the float reference."""

from __future__ import annotations

import numpy as np
import pytest

import anygpu as ag
from anygpu import llm
from anygpu.graph import schedule as S
from anygpu.llm import quant
from anygpu.profile import profile

PROMPT = [1, 9, 23, 14, 40, 7]


def _weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # rows of different scales, and an outlier in some groups
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 1, (rows, 1))
    w[::3, 5] *= 20
    return w.astype(np.float32)


def _numpy_dequantize(kind: str, values: np.ndarray, scales: np.ndarray, group: int,
                      shape: tuple[int, int]) -> np.ndarray:
    """The formats' documented meaning, in NumPy: q8 ``q * scale``; q4 ``(n - 8) * scale``
    with byte j of a group holding value j (low nibble) and j + group/2 (high)."""
    rows, cols = shape
    s = np.repeat(scales.astype(np.float32), group, axis=1)
    if kind == "q8":
        return values.view(np.int8).astype(np.float32) * s
    packed = values.reshape(rows, cols // group, group // 2)
    n = np.concatenate([packed & 15, packed >> 4], axis=2).reshape(rows, cols)
    return (n.astype(np.float32) - 8) * s


@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("group", [32, 128])
def test_dequantization_matches_numpy(device, kind, group):
    w = _weights(24, 256)
    qw = quant.quantize(w, kind, group, device)
    if kind == "q8":
        q, scales = quant.pack_q8(w, group)
        values = q.view(np.uint8)
    else:
        values, scales = quant.pack_q4(w, group)
    want = _numpy_dequantize(kind, values, scales, group, w.shape)
    got = qw.dequantize().numpy()
    np.testing.assert_array_equal(got, want)
    # the rounding error: half a step for q8, one step for q4 (the value opposite the one put
    # on -8 may be clipped at 7)
    step = np.repeat(np.abs(scales.astype(np.float32)), group, axis=1)
    bound = step * (0.5 if kind == "q8" else 1.0) + 1e-6 * np.abs(w)
    assert (np.abs(got - w) <= bound).all()
    assert qw.nbytes == w.size * (1 if kind == "q8" else 0.5) + scales.size * \
        qw.parts["scales"].dtype.itemsize


def test_bad_formats_and_group_sizes_raise():
    w = _weights(4, 64)
    with pytest.raises(ValueError, match="quant must be"):
        quant.quantize(w, "q3", 32, "cpu")
    with pytest.raises(ValueError, match="group_size must be 32 or 128"):
        quant.quantize(w, "q8", 64, "cpu")
    with pytest.raises(ValueError, match="groups of 128"):
        quant.quantize(w, "q8", 128, "cpu")


def _random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes in GGUF's block layout, with small positive float16 scales."""
    size, per = quant.BLOCKS[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    where = {"Q8_0": (0, 1), "Q4_0": (0, 1), "Q4_K": (0, 2), "Q6_K": (208, 1)}[fmt]
    first, count = where
    scales = rng.uniform(0.002, 0.02, (rows, cols // per, count)).astype(np.float16)
    raw[:, :, first:first + 2 * count] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def _decode_kernels(qw: quant.QuantizedWeight, x: ag.Tensor) -> list[S.Item]:
    return S.schedule([qw.linear(x).lazy])


@pytest.mark.parametrize("fmt", ["q8", "q4", "Q4_K", "Q6_K"])
def test_the_matrix_vector_product_reads_the_packed_weight(device, fmt):
    rows, cols = 48, 512
    if fmt in ("q8", "q4"):
        qw = quant.quantize(_weights(rows, cols), fmt, 32, device)
    else:
        qw = quant.from_blocks(fmt, _random_blocks(fmt, rows, cols), (rows, cols), device)
    rng = np.random.default_rng(1)
    x = ag.tensor(rng.standard_normal((1, cols)).astype(np.float32), device=device).realize()
    items = _decode_kernels(qw, x)
    # one kernel, reading the input and the packed parts: nothing dequantized is stored
    assert len(items) == 1, [i.output.shape for i in items]
    inputs = {id(n.buffer) for n in items[0].ast.inputs}
    assert inputs == {id(x.lazy.buffer)} | {id(t.lazy.buffer) for t in qw.parts.values()}
    want = x.numpy() @ qw.dequantize().numpy().T
    np.testing.assert_allclose(qw.linear(x).numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("cols", [1024, 4192])
def test_a_decode_product_of_long_rows(device, kind, dtype, cols):
    # 512 outputs of 1024 inputs (whole runs of 128 per lane's 16-byte reads of 4-bit weights),
    # or of 4192 (131 groups of 32: runs of 32, some lanes one more than others); the activation
    # normalized before the product. 16-bit models' products run on tensor cores on CUDA, their
    # weights unpacked in pairs in 16-bit arithmetic: the dequantized reference to rounding
    if not ag.get_device(device).supports(getattr(ag, dtype)):
        pytest.skip(f"{device} has no {dtype}")
    rows = 512
    qw = quant.quantize(_weights(rows, cols, seed=5), kind, 32, device, getattr(ag, dtype))
    rng = np.random.default_rng(6)
    h = ag.tensor(rng.standard_normal((1, cols)).astype(np.float32), device=device).realize()
    x = (h * ((h * h).mean(-1, keepdim=True) + 1e-5).rsqrt()).to(getattr(ag, dtype))
    got = qw.linear(x).float().numpy()
    w = qw.dequantize().float().numpy()  # rounded to the dtype, as the product reads it
    want = x.float().numpy() @ w.T
    tol = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


def _forced(reference: list[int], seen: list[np.ndarray]):
    """A logits hook that records the logits and makes the next token the reference's."""

    def hook(ids, logits):
        seen.append(logits.copy())
        out = np.full_like(logits, -np.inf)
        out[reference[len(seen) - 1]] = 0.0
        return out

    return hook


def _float_logits(model, steps: int, forced: list[int] | None = None
                  ) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens after PROMPT and their logits (or the logits along the
    tokens ``forced``)."""
    import torch

    seq, logits = list(PROMPT), []
    with torch.no_grad():
        for step in range(steps):
            out = model(torch.tensor([seq])).logits[0, -1].float().numpy()
            logits.append(out)
            seq.append(int(out.argmax()) if forced is None else forced[step])
    return seq[len(PROMPT):], np.stack(logits)


def _with_weights_of(model, lm):
    """A copy of the transformers ``model`` holding ``lm``'s dequantized projections."""
    import copy

    import torch

    out = copy.deepcopy(model)
    parts = {"o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
    with torch.no_grad():
        for i, layer in enumerate(lm.model.layers):
            weights = {name: getattr(layer, field)[0].dequantize().numpy()
                       for field, name in parts.items()}
            # the query, key and value weights, stacked by rows
            stacked = layer.qkv[0][0].dequantize().numpy()
            for name, rows in zip("qkv", np.split(stacked, np.cumsum(layer.qkv_widths)[:2])):
                weights[f"self_attn.{name}_proj"] = rows
            for name, w in weights.items():
                out.get_parameter(f"model.layers.{i}.{name}.weight").copy_(torch.from_numpy(w))
        if isinstance(lm.model.lm_head, quant.QuantizedWeight):
            w = lm.model.lm_head.dequantize().numpy()
            out.get_parameter("lm_head.weight").copy_(torch.from_numpy(w))
    return out


# the largest logit difference from the float model, as a share of the largest logit, on these
# random tiny models (measured: q8 up to 0.025, q4 up to 0.40)
BOUNDS = {"q8": 0.05, "q4": 0.6}


@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "tied"])
def test_quantized_logits_stay_near_the_float_model(device, kind, variant, tiny):
    pytest.importorskip("transformers")
    folder, model = tiny(variant)
    tokens, want = _float_logits(model, 8)
    lm = llm.load(folder, device=device, max_seq_len=32, quant=kind)
    projections = [lm.model.layers[0].qkv[0][0], lm.model.layers[1].down[0]]
    assert len(lm.model.layers[0].qkv) == 1  # the query, key and value weights stacked
    assert all(isinstance(w, quant.QuantizedWeight) and w.kind == kind for w in projections)
    assert isinstance(lm.model.lm_head, quant.QuantizedWeight) == (variant != "tied")
    seen: list[np.ndarray] = []
    lm.generate(PROMPT, max_new_tokens=8, ignore_eos=True,
                logits_processor=_forced(tokens, seen))
    got = np.stack(seen)
    error = np.abs(got - want).max() / np.abs(want).max()
    assert 1e-6 < error < BOUNDS[kind], error
    # and exactly what transformers computes over the dequantized weights
    _, same = _float_logits(_with_weights_of(model, lm), 8, tokens)
    np.testing.assert_allclose(got, same, rtol=1e-4, atol=1e-4)


def test_bad_quant_arguments_of_load(tiny):
    folder, _ = tiny("llama")
    with pytest.raises(ValueError, match="quant must be"):
        llm.load(folder, quant="int4")
    with pytest.raises(ValueError, match="group_size must be 32 or 128"):
        llm.load(folder, quant="q8", group_size=16)
    # the tiny model's projections have 64 inputs
    with pytest.raises(ValueError, match="do not split into groups of 128"):
        llm.load(folder, quant="q4", group_size=128)


def _decode_steps(lm) -> tuple[int, int]:
    """(kernel launches, bytes they move at the least) of one-token steps: the prompt's last
    token again (the rest is in the cache) and two decode steps, after a warm-up."""
    lm.reset()
    lm.generate(PROMPT, max_new_tokens=3, ignore_eos=True)
    with profile() as prof:
        lm.generate(PROMPT, max_new_tokens=3, ignore_eos=True)
    events = [e for e in prof.events if e.kind in ("kernel", "graph")]
    return len(events), sum(e.nbytes for e in events)


def test_a_quantized_decode_step_launches_the_same_kernels_and_reads_fewer_bytes(device, tiny):
    folder, _ = tiny("llama")
    plain = llm.load(folder, device=device, max_seq_len=32, dtype="float32")
    launches, nbytes = _decode_steps(plain)
    for kind, at_most in (("q8", 0.8), ("q4", 0.7)):
        lm = llm.load(folder, device=device, max_seq_len=32, dtype="float32", quant=kind)
        q_launches, q_bytes = _decode_steps(lm)
        # no kernel of its own dequantizes a weight: the products read the packed bytes
        assert q_launches == launches, (kind, q_launches, launches)
        assert q_bytes < at_most * nbytes, (kind, q_bytes, nbytes)
