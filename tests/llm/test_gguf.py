"""GGUF files written here from the tiny transformers models (as llama.cpp's converter writes
them: its names, its reordering of the query and key rows, its quantizers) and loaded back: the
same greedy tokens as transformers, each block format's dequantization against gguf's own, the
tokenizer from the metadata, and errors for malformed files."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from anygpu import llm
from anygpu.llm import ModelFolderError, quant
from anygpu.llm.gguf_file import GLOBAL_NAMES, LAYER_NAMES

from .conftest import MERGES, PROMPT, SPECIALS, STEPS, TEMPLATE, VOCAB, greedy_reference

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TYPES = gguf.GGMLQuantizationType


def _gguf_names() -> dict[str, str]:
    """Hugging Face's layer names -> GGUF's, the inverse of the loader's tables."""
    return {v: k for k, v in LAYER_NAMES.items()}


def _llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    """The rows of a query or key projection as llama.cpp's converter writes them: per head,
    row 2i from the first half's row i, row 2i + 1 from the second half's row i."""
    per = w.shape[0] // heads
    return w.reshape(heads, 2, per // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_level(token: str) -> str:
    return {" ": "\u0120", "\n": "\u010a"}.get(token, token)


def write_gguf(path: str, model: Any, fmt: str = "F16", tokenizer: str = "gpt2",
               drop: tuple[str, ...] = (), arch: str | None = None,
               odd: dict[str, Any] | None = None, extra: Any = None) -> None:
    """``model`` (a tiny transformers model) as a GGUF file: projections and embeddings in
    ``fmt`` (F32, F16, BF16, Q8_0, Q4_0), norms and biases in F32. ``drop``: GGUF tensor names
    left out; ``odd``: GGUF tensor names written as other arrays (raw_dtype, data); ``extra``:
    a function given the writer before the tensors are added."""
    cfg = model.config
    arch = arch or ("qwen2" if cfg.model_type == "qwen2" else "llama")
    w = gguf.GGUFWriter(path, arch)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None)
                               or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // heads)
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in VOCAB]
    if tokenizer == "gpt2":
        w.add_tokenizer_model("gpt2")
        w.add_token_list([_byte_level(t) for t in VOCAB])
        w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    else:
        w.add_tokenizer_model(tokenizer)
        w.add_token_list(VOCAB)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template(TEMPLATE)
    if extra is not None:  # more metadata or tensors
        extra(w)
    names = _gguf_names()
    odd = odd or {}
    for name, p in model.state_dict().items():
        parts = name.split(".")
        if parts[0] == "model" and parts[1] == "layers":
            inner = ".".join(parts[3:-1])
            key = f"blk.{parts[2]}.{names[inner]}.{parts[-1]}"
        else:
            key = {v: k for k, v in GLOBAL_NAMES.items()}[".".join(parts[:-1])] + "." + parts[-1]
        if key in drop or (key == "output.weight" and cfg.tie_word_embeddings):
            continue
        arr = p.detach().float().numpy()
        if arch == "llama" and key.split(".")[2:3] in (["attn_q"], ["attn_k"]):
            arr = _llama_cpp_order(arr, heads if "attn_q" in key else kv_heads)
        if key in odd:
            raw_dtype, data = odd[key]
            w.add_tensor(key, data, raw_dtype=raw_dtype)
        elif arr.ndim == 1:
            w.add_tensor(key, arr.astype(np.float32))
        elif fmt == "F32":
            w.add_tensor(key, arr.astype(np.float32))
        elif fmt == "F16":
            w.add_tensor(key, arr.astype(np.float16))
        elif fmt == "BF16":
            bits = (arr.view(np.uint32) >> 16).astype(np.uint16)  # truncated: exact in bf16
            w.add_tensor(key, bits.view(np.uint8), raw_dtype=TYPES.BF16)
        else:
            w.add_tensor(key, gguf.quants.quantize(arr, TYPES[fmt]), raw_dtype=TYPES[fmt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _as_stored(model: Any, fmt: str) -> Any:
    """A copy of ``model`` whose projections and embeddings hold the values ``fmt`` stores
    (rounded to float16, truncated to bfloat16, or quantized and dequantized by gguf)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            if p.ndim != 2:
                continue
            arr = p.float().numpy()
            if fmt == "F16":
                arr = arr.astype(np.float16).astype(np.float32)
            elif fmt == "BF16":
                arr = ((arr.view(np.uint32) >> 16) << 16).view(np.float32)
            elif fmt in ("Q8_0", "Q4_0"):
                arr = gguf.quants.dequantize(gguf.quants.quantize(arr, TYPES[fmt]), TYPES[fmt])
            p.copy_(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)))
    return out


@pytest.fixture(scope="module")
def gguf_file(tiny, tmp_path_factory):
    """``gguf_file(variant, fmt) -> (path, transformers model holding the stored values)``."""
    made: dict[tuple[str, str], tuple[str, Any]] = {}

    def get(variant: str, fmt: str) -> tuple[str, Any]:
        if (variant, fmt) not in made:
            _, model = tiny(variant)
            path = str(tmp_path_factory.mktemp("gguf") / f"{variant}-{fmt}.gguf")
            write_gguf(path, model, fmt)
            made[variant, fmt] = (path, _as_stored(model, fmt))
        return made[variant, fmt]

    return get


@pytest.mark.parametrize("variant,fmt", [("llama", "F16"), ("llama", "Q8_0"),
                                         ("qwen2", "F16"), ("tied", "Q8_0"),
                                         ("llama", "BF16"), ("llama", "F32")])
def test_greedy_tokens_match_transformers(device, variant, fmt, gguf_file):
    path, model = gguf_file(variant, fmt)
    want_tokens, want_logits = greedy_reference(model)
    top2 = np.sort(want_logits, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-3  # no near tie that rounding could flip
    # computed in float32 over the stored values: transformers over the same values
    lm = llm.load(path, device=device, dtype="float32", max_seq_len=64)
    lm.eos_token_ids = (2,)
    seen: list[np.ndarray] = []

    def record(ids, logits):
        seen.append(logits.copy())
        return logits

    tokens = lm.generate(PROMPT, max_new_tokens=STEPS, ignore_eos=True, logits_processor=record)
    assert tokens == want_tokens
    np.testing.assert_allclose(np.stack(seen), want_logits, rtol=1e-4, atol=1e-4)
    if fmt == "Q8_0":  # carried as q8 without a float detour
        q = lm.model.layers[0].qkv[0][0]  # the query, key and value weights stacked
        assert isinstance(q, quant.QuantizedWeight) and q.kind == "q8"


def test_float16_file_computes_in_float16_by_default(gguf_file):
    path, _ = gguf_file("llama", "F16")
    lm = llm.load(path, device="cpu", max_seq_len=16)
    assert lm.dtype.name == "float16"
    q8 = llm.load(path, device="cpu", max_seq_len=16, quant="q8")
    assert isinstance(q8.model.layers[1].gate[0], quant.QuantizedWeight)


def _random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    size, per = quant.BLOCKS[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    first, count = {"Q8_0": (0, 1), "Q4_0": (0, 1), "Q4_K": (0, 2), "Q6_K": (208, 1)}[fmt]
    scales = rng.uniform(0.002, 0.02, (rows, cols // per, count)).astype(np.float16)
    raw[:, :, first:first + 2 * count] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_block_formats_dequantize_as_gguf_does(device, fmt):
    rows, cols = 12, 512
    raw = _random_blocks(fmt, rows, cols)
    want = gguf.quants.dequantize(raw, TYPES[fmt])
    qw = quant.from_blocks(fmt, raw, (rows, cols), device)
    np.testing.assert_array_equal(qw.dequantize().numpy(), want)


def test_gpt2_tokenizer_from_the_metadata(gguf_file, tiny):
    path, _ = gguf_file("llama", "F16")
    folder, _ = tiny("llama")
    lm = llm.load(path, device="cpu", max_seq_len=16)
    ref = llm.Tokenizer.from_folder(folder)
    text = "the cat sat there, all in.\nhello!"
    assert lm.tokenizer.encode(text) == ref.encode(text)
    assert lm.tokenizer.encode(text)[0] == 1  # BOS
    assert lm.tokenizer.decode(lm.tokenizer.encode(text)) == text
    assert lm.tokenizer.encode("<|user|>", add_special_tokens=False) == [VOCAB.index("<|user|>")]
    chat = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|user|>\nhi</s>\n<|assistant|>\n"
    assert lm.eos_token_ids == (2,)


def test_sentencepiece_tokenizer_from_the_metadata(tmp_path):
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "\u2581hello",
         "\u2581w", "or", "\u2581wor", "ld", "\u2581world"]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 259)
    path = str(tmp_path / "spm.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    from anygpu.llm.gguf_file import _File, read_tokenizer

    tok = read_tokenizer(_File(path))
    ids = tok.encode("hello world")
    assert [pieces[i] for i in ids] == ["<s>", "\u2581hello", "\u2581world"]
    assert tok.decode(ids) == "hello world"
    # a character outside the vocabulary falls back to its UTF-8 bytes
    ids = tok.encode("hello \u00e9", add_special_tokens=False)
    assert [pieces[i] for i in ids][-2:] == ["<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hello \u00e9"


# ---- malformed files --------------------------------------------------------------------------
def test_a_missing_file_and_a_file_that_is_not_gguf(tmp_path):
    with pytest.raises(ModelFolderError, match="nothing.gguf: not found"):
        llm.load(tmp_path / "nothing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf file at all")
    with pytest.raises(ModelFolderError, match="bad.gguf: not a GGUF file"):
        llm.load(bad)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(ModelFolderError, match="truncated.gguf: not a GGUF file gguf can read"):
        llm.load(truncated)


def test_an_unsupported_architecture(tiny, tmp_path):
    _, model = tiny("llama")
    path = str(tmp_path / "phi.gguf")
    write_gguf(path, model, "F32", arch="phi3")
    with pytest.raises(ModelFolderError, match="phi.gguf: architecture 'phi3' is not supported"):
        llm.load(path)


def test_a_missing_tensor(tiny, tmp_path):
    _, model = tiny("llama")
    path = str(tmp_path / "missing.gguf")
    write_gguf(path, model, "F32", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelFolderError, match=r"missing.gguf: the tensor 'blk.1.ffn_up.weight' "
                                               "is missing"):
        llm.load(path)


def test_an_unsupported_tensor_type(tiny, tmp_path):
    _, model = tiny("llama")
    # Q5_0: blocks of 32 values in 22 bytes; (128, 64) values
    blocks = np.random.default_rng(0).integers(0, 256, (128, 2 * 22), dtype=np.uint8)
    path = str(tmp_path / "q5.gguf")
    write_gguf(path, model, "F32", odd={"blk.0.ffn_up.weight": (TYPES.Q5_0, blocks)})
    with pytest.raises(ModelFolderError, match="'blk.0.ffn_up.weight' is of type Q5_0, which is "
                                               "not supported"):
        llm.load(path)


def test_a_tensor_of_the_wrong_shape(tiny, tmp_path):
    _, model = tiny("llama")
    path = str(tmp_path / "shape.gguf")
    wrong = np.zeros((64, 64), np.float32) + 0.5
    write_gguf(path, model, "F32", odd={"blk.0.ffn_up.weight": (None, wrong)})
    with pytest.raises(ModelFolderError, match=r"'blk.0.ffn_up.weight' has shape \[64, 64\], "
                                               r"expected \[128, 64\]"):
        llm.load(path)


def test_the_row_order_of_llama_cpp_is_undone():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    assert np.array_equal(quant.permute_rows(_llama_cpp_order(w, 4), 4), w)
    assert not np.array_equal(_llama_cpp_order(w, 4), w)


def test_rope_scaling_from_the_metadata_and_rope_freqs(tiny, tmp_path):
    from anygpu.llm.gguf_file import _File, read_config

    _, model = tiny("llama")
    factors = np.linspace(1.0, 8.0, 8).astype(np.float32)  # one per pair of a 16-wide head

    def extra(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)
        w.add_tensor("rope_freqs.weight", factors)

    path = str(tmp_path / "rope.gguf")
    write_gguf(path, model, "F32", extra=extra)
    cfg = read_config(_File(path))
    assert cfg.rope_type == "linear" and cfg.rope_params["factor"] == 4.0
    plain = 1.0 / (10000.0 ** (np.arange(0, 16, 2) / 16))
    np.testing.assert_allclose(cfg.inverse_frequencies(), plain / factors / 4.0, rtol=1e-6)
    yarn = str(tmp_path / "yarn.gguf")
    write_gguf(yarn, model, "F32", extra=lambda w: w.add_rope_scaling_type(
        gguf.RopeScalingType.YARN))
    with pytest.raises(ModelFolderError, match="yarn.gguf: RoPE scaling 'yarn' is not supported"):
        llm.load(yarn)
