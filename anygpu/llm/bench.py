"""``anygpu bench llm``: prefill and decode speed of a language model of a real model's shape,
with random weights made on the device, against the memory-bandwidth roofline.

    anygpu bench llm --config llama-2-7b --quant f16 --device cuda --compare torch
    anygpu bench llm --config tiny --device cpu --prompt-len 32 --decode-tokens 8 --json

Nothing is read from files or downloaded: the weights are drawn on the device with anygpu's
random functions (normal, standard deviation 0.02, as the models' own initialization; norms
one, biases zero) into the same ``Transformer`` and ``LanguageModel`` that ``anygpu.llm.load``
builds. A row reports:

- prefill: tokens per second over a prompt of ``--prompt-len`` random ids (the median of
  ``PREFILL_RUNS`` runs after a warm-up; the first run, which compiles, on its own line);
- decode: the median time of one step of the captured decode step (token in, logits back on
  the host) over ``--decode-tokens`` steps after a warm-up, and its tokens per second;
  ``--batch N`` prefills N prompts together and decodes them together, and counts the tokens
  of all N (``--page-size`` and ``--cache-tokens`` set up the paged cache as ``load`` does);
- the roofline: the bytes a decode step moves (every weight read once, the embedding table
  one row of it, and the key/value cache as the current implementation touches it: attention
  reads the whole preallocated cache, and one row is written per layer and cache) over the
  device's copy rate, measured in the same run with a large device-to-device copy (bytes read
  plus bytes written, per second). The achieved share is the decode tokens/s over the
  roofline's.

``--compare torch`` runs transformers' model of the same configuration, randomly initialized,
on the same device (float16 on a GPU, float32 on the processor) with its own growing cache.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from anygpu import dtype as dt

# the shapes of the published configurations (config.json), sizes only
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096,
                       intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, rope_theta=10000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=4096),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=8192),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, rope_theta=10000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=32768, sliding_window=4096),
    "qwen2-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                     intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     max_position_embeddings=32768, use_sliding_window=False),
    "tinyllama-1.1b": dict(model_type="llama", vocab_size=32000, hidden_size=2048,
                           intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, rope_theta=10000.0,
                           rms_norm_eps=1e-5, max_position_embeddings=2048),
    # a few kernels' worth of model, for tests
    "tiny": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256),
}
QUANTS = {"f16": dt.float16, "bf16": dt.bfloat16, "f32": dt.float32}
# packed formats (anygpu/llm/quant.py), group 32, computing in float16 where the device has it
PACKED = ("q8", "q4")
INIT_STD = 0.02
PREFILL_RUNS = 3  # timed prefills after the warm-up one
DECODE_WARMUP = 3  # the first step runs plainly, the second is captured, the third replays
COPY_REPEATS = 5


@dataclass
class Row:
    framework: str  # "anygpu" or "torch"
    device: str
    config: str
    quant: str
    dtype: str  # what the products compute in (PyTorch on the processor: float32)
    params: int
    prompt_len: int
    decode_tokens: int
    max_seq_len: int
    first_prefill_s: float  # compiling included
    prefill_s: float  # median of the timed prefills
    prefill_tokens_per_s: float
    decode_ms: float  # median time of one decode step
    decode_tokens_per_s: float
    # the roofline (anygpu's rows): bytes one decode step moves, over the copy rate
    weight_bytes: int | None = None
    kv_cache_bytes: int | None = None  # cache traffic of one step (reads and the new row)
    bytes_per_token: int | None = None
    copy_gb_per_s: float | None = None  # bytes read plus written per second, 1e9
    roofline_tokens_per_s: float | None = None
    roofline_share: float | None = None
    # anygpu's time over PyTorch's (above 1: slower), on anygpu's rows with --compare torch
    prefill_ratio: float | None = None
    decode_ratio: float | None = None
    batch: int = 1  # sequences prefilled and decoded together (tokens/s counts them all)


# ---- the model on the device -------------------------------------------------------------------
def random_weights(cfg: Any, device: str, dtype: dt.DType, seed: int = 0,
                   packed: str | None = None) -> dict[str, Any]:
    """Every tensor the model reads, drawn on ``device``: N(0, 0.02) for matrices, ones for
    norms, zeros for biases. Each tensor has its own generator, so the counter of one never
    wraps around over a 7B model. With ``packed`` ("q8" or "q4") the projections are random
    packed values with scales of the same spread, made on the device."""
    import anygpu as ag
    from anygpu.llm.weights import expected_shapes

    out: dict[str, Any] = {}
    for i, (name, shape) in enumerate(expected_shapes(cfg).items()):
        gen = ag.Generator().manual_seed(seed * 100003 + i)
        if name.endswith("norm.weight"):
            out[name] = ag.ones(shape, dtype=dtype, device=device).contiguous().realize()
        elif name.endswith(".bias"):
            out[name] = ag.zeros(shape, dtype=dtype, device=device).contiguous().realize()
        elif packed is not None and name != "model.embed_tokens.weight":
            out[name] = _random_packed(packed, shape, device, dtype, gen)
        else:
            w = ag.randn(*shape, dtype=dtype, device=device, generator=gen)
            out[name] = w.assign(w * INIT_STD)  # in place: no second copy of the matrix
    return out


def _random_packed(kind: str, shape: tuple[int, ...], device: str, dtype: dt.DType,
                   gen: Any) -> Any:
    """A ``(out, in)`` projection of random ``kind`` values (group 32): int32 words of random
    bytes and scales that give the values a spread like INIT_STD's."""
    import anygpu as ag
    from anygpu.llm.quant import QuantizedWeight

    rows, cols = shape
    group = 32
    per_word = 4 if kind == "q8" else 8  # values in one int32 word
    words = ag.randint(0, 2**31 - 1, (rows, cols // per_word), dtype=ag.int32, device=device,
                       generator=gen).realize()
    top = 127 if kind == "q8" else 8
    scale_dtype = dt.float16 if ag.get_device(device).supports(dt.float16) else dt.float32
    scales = (ag.rand(rows, cols // group, device=device, generator=gen) * (2 * INIT_STD / top)
              ).cast(scale_dtype).realize()
    return QuantizedWeight(kind, (rows, cols), {"values": words, "scales": scales}, dtype,
                           group)


def traffic(cfg: Any, weights: dict[str, Any], dtype: dt.DType, max_seq_len: int
            ) -> tuple[int, int]:
    """(weight bytes, cache bytes) one decode step moves. The embedding table gives one row
    (unless it is the output projection too); packed projections their packed bytes and
    scales; each layer's two caches are read whole by attention and take one new row."""
    size = dt.to_dtype(dtype).itemsize
    weight_bytes = sum(t.nbytes if hasattr(t, "parts") else int(np.prod(t.shape)) * size
                       for t in weights.values())
    if not cfg.tie_word_embeddings:
        weight_bytes -= (cfg.vocab_size - 1) * cfg.hidden_size * size
    row = cfg.num_kv_heads * cfg.head_dim * size
    return weight_bytes, 2 * cfg.num_layers * (max_seq_len + 1) * row


def copy_rate(device: str, mib: int) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy of ``mib`` MiB
    (the median of a few, after a warm-up), as STREAM's copy counts them."""
    import anygpu as ag

    dev = ag.get_device(device)
    n = mib * 2**20 // 4
    src = ag.rand(n, device=dev.name)
    dst = ag.zeros(n, device=dev.name).contiguous().realize()
    dst.assign(src)
    dev.synchronize()
    times = []
    for _ in range(COPY_REPEATS):
        start = time.perf_counter()
        dst.assign(src)
        dev.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * n * 4 / statistics.median(times)


def _copy_mib(dev: Any, wanted: int) -> int:
    """``wanted`` MiB, less where the device cannot hold one buffer of it (WebGPU's binding
    size, OpenCL's largest allocation) or two in an eighth of its memory."""
    extra = dev.info.extra
    limits = [wanted * 2**20, dev.info.memory // 16, int(extra.get("max_alloc") or 0),
              int(extra.get("limits", {}).get("max_storage_buffer_binding_size") or 0)]
    limits = [n for n in limits if n > 0]
    return max(1, min(limits) // 2**20)


def _measure(prefill: Callable[[], Any], step: Callable[[Any], Any], decode_tokens: int
             ) -> tuple[float, list[float], list[float]]:
    """(the first prefill's seconds, the timed prefills', the timed decode steps'). ``prefill``
    runs the prompt from an empty cache and returns what decoding continues from; ``step``
    takes that and returns the next. Both end with the chosen token on the host, so the
    device has finished when they return."""
    start = time.perf_counter()
    prefill()
    first = time.perf_counter() - start
    prefill()  # the warm-up
    prefill_times = []
    for _ in range(PREFILL_RUNS):
        start = time.perf_counter()
        state = prefill()
        prefill_times.append(time.perf_counter() - start)
    decode_times = []
    for i in range(DECODE_WARMUP + decode_tokens):
        start = time.perf_counter()
        state = step(state)
        if i >= DECODE_WARMUP:
            decode_times.append(time.perf_counter() - start)
    return first, prefill_times, decode_times


def _measure_anygpu(lm: Any, prompts: list[list[int]], decode_tokens: int,
                    profile: str | None = None) -> tuple[float, list[float], list[float]]:
    """``_measure`` of ``lm`` on one prompt per slot: prefilled together, then decoded
    together, each step choosing every slot's next token greedily on the host, as generation
    does."""
    def prefill() -> dict[int, int]:
        lm.reset()
        logits = lm.prefill_batch(dict(enumerate(prompts)))
        return {slot: int(np.argmax(row)) for slot, row in logits.items()}

    def step(tokens: dict[int, int]) -> dict[int, int]:
        return {slot: int(np.argmax(row)) for slot, row in lm.decode_batch(tokens).items()}

    times = _measure(prefill, step, decode_tokens)
    if profile:
        import anygpu as ag

        captured = lm._decode
        for part, run in (("prefill", prefill), ("decode", None)):
            with ag.profile() as prof:
                if run is not None:
                    tokens = run()
                else:
                    # run plainly, not replayed as one graph, so that each kernel is timed
                    lm._decode = lm.model.forward
                    try:
                        for _ in range(3):
                            tokens = step(tokens)
                    finally:
                        lm._decode = captured
            print(f"{part} ({'one prompt run' if run else 'three decode steps, not captured'}):")
            print(prof.summary())
            path = profile.replace(".json", f"-{part}.json")
            prof.export_chrome_trace(path)
            print(f"trace written to {path} (open it in ui.perfetto.dev)")
    return times


def run_anygpu(config: str, quant: str, device: str, prompt_len: int, decode_tokens: int,
               max_seq_len: int, copy_mib: int, batch: int = 1, page_size: int | None = None,
               cache_tokens: int | None = None, profile: str | None = None) -> Row:
    import anygpu as ag
    from anygpu.llm.config import ModelConfig
    from anygpu.llm.engine import LanguageModel
    from anygpu.llm.model import Transformer

    dev = ag.get_device(device)
    packed = quant if quant in PACKED else None
    if packed is not None:
        dtype = dt.float16 if dev.supports(dt.float16) else dt.float32
    else:
        dtype = QUANTS[quant]
    if not dev.supports(dtype):
        raise SystemExit(f"anygpu bench llm: {dev.name} does not support {dtype.name} "
                         f"(--quant {quant})")
    cfg = ModelConfig.from_dict(CONFIGS[config], f"--config {config}")
    weights = random_weights(cfg, dev.name, dtype, packed=packed)
    params = sum(int(np.prod(t.shape)) for t in weights.values())
    weight_bytes, kv_bytes = traffic(cfg, weights, dtype, max_seq_len)
    lm = LanguageModel(Transformer(cfg, weights, dev.name, dtype, max_seq_len, max_batch=batch,
                                   page_size=page_size, cache_tokens=cache_tokens),
                       None, cfg, f"random {config}")
    del weights
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
    label = f"anygpu llm {config} {quant} on {dev.name}"
    before = len(dev._programs)
    first, prefill_times, decode_times = _measure_anygpu(lm, prompts, decode_tokens,
                                                         profile)
    print(f"{label}: first prefill {first:.2f} s, {len(dev._programs) - before} kernels "
          "compiled (prefill and decode)", file=sys.stderr)
    del lm
    gc.collect()
    dev.allocator.empty_cache()
    rate = copy_rate(dev.name, _copy_mib(dev, copy_mib))
    prefill_s = statistics.median(prefill_times)
    decode_s = statistics.median(decode_times)
    decode_tps = batch / decode_s
    # a step reads the weights once and each sequence's cache
    step_bytes = weight_bytes + batch * kv_bytes
    roofline = batch * rate / step_bytes
    return Row("anygpu", dev.name, config, quant, dtype.name, params, prompt_len, decode_tokens,
               max_seq_len, first, prefill_s, batch * prompt_len / prefill_s, decode_s * 1e3,
               decode_tps, weight_bytes, batch * kv_bytes, step_bytes, rate / 1e9,
               roofline, decode_tps / roofline, batch=batch)


# ---- PyTorch -----------------------------------------------------------------------------------
def run_torch(config: str, quant: str, device: str, prompt_len: int, decode_tokens: int,
              max_seq_len: int) -> Row:
    """transformers' model of ``config``, randomly initialized on ``device`` (a torch device
    name), float16 on a GPU and float32 on the processor: the same prefill and decode timings,
    its cache growing with the tokens (it attends over the tokens so far)."""
    try:
        import torch
        import transformers
    except ImportError as err:
        raise SystemExit(f"anygpu bench llm --compare torch needs torch and transformers "
                         f"({err})") from err
    tdev = torch.device(device)
    cuda = tdev.type == "cuda"
    tdtype = {"f16": torch.float16, "bf16": torch.bfloat16, "q8": torch.float16,
              "q4": torch.float16}.get(quant, torch.float32) \
        if cuda else torch.float32
    raw = dict(CONFIGS[config])
    hf_config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(0)
    with torch.device(tdev):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=tdtype).eval()
    params = sum(p.numel() for p in model.parameters())
    # transformers 5 names the cache argument ``cache``; earlier versions ``past_key_values``
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    rng = np.random.default_rng(0)
    prompt = torch.tensor(rng.integers(0, hf_config.vocab_size, (1, prompt_len)), device=tdev)
    try:
        first, prefill_times, decode_times = _measure_torch(model, prompt, cache_arg,
                                                            decode_tokens)
    finally:
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    prefill_s = statistics.median(prefill_times)
    decode_s = statistics.median(decode_times)
    return Row("torch", str(tdev), config, quant, str(tdtype).removeprefix("torch."), params,
               prompt_len, decode_tokens, max_seq_len, first, prefill_s, prompt_len / prefill_s,
               decode_s * 1e3, 1.0 / decode_s)


def _measure_torch(model: Any, prompt: Any, cache_arg: str, decode_tokens: int
                   ) -> tuple[float, list[float], list[float]]:
    """``_measure`` of transformers' ``model`` (greedy, its own cache), under inference mode."""
    import torch

    def run(inputs: Any, cache: Any = None) -> tuple[Any, Any]:
        extra = {cache_arg: cache} if cache is not None else {}
        out = model(inputs, use_cache=True, logits_to_keep=1, **extra)
        token = out.logits[:, -1:].argmax(-1)
        token.cpu()  # the token on the host (waits for the device), as anygpu's logits are
        return token, out.get(cache_arg, out.get("past_key_values"))

    with torch.inference_mode():
        return _measure(lambda: run(prompt), lambda state: run(*state), decode_tokens)


# ---- the command -------------------------------------------------------------------------------
def format_table(rows: list[Row]) -> str:
    head = (f"{'framework':9s} {'device':9s} {'config':14s} {'dtype':8s} {'first s':>8s} "
            f"{'prefill tok/s':>13s} {'decode tok/s':>12s} {'ms/step':>9s} "
            f"{'roofline tok/s':>14s} {'share':>6s} {'ratio p/d':>11s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        roof = f"{r.roofline_tokens_per_s:14.1f}" if r.roofline_tokens_per_s else " " * 14
        share = f"{r.roofline_share:6.1%}" if r.roofline_share is not None else " " * 6
        ratio = (f"{r.prefill_ratio:4.2f}x/{r.decode_ratio:4.2f}x"
                 if r.prefill_ratio is not None and r.decode_ratio is not None else "")
        config = r.config if r.batch == 1 else f"{r.config} x{r.batch}"
        lines.append(f"{r.framework:9s} {r.device:9s} {config:14s} {r.dtype:8s} "
                     f"{r.first_prefill_s:8.2f} {r.prefill_tokens_per_s:13.1f} "
                     f"{r.decode_tokens_per_s:12.1f} {r.decode_ms:9.2f} {roof} {share} "
                     f"{ratio:>11s}")
    for r in rows:
        if r.bytes_per_token is None or r.weight_bytes is None or r.kv_cache_bytes is None:
            continue
        each = "" if r.batch == 1 else f" for each of {r.batch} sequences"
        lines.append(f"{r.config} on {r.device}: {r.params / 1e9:.3g}B parameters; a decode "
                     f"step moves {_bytes(r.bytes_per_token)} (weights "
                     f"{_bytes(r.weight_bytes)}, key/value cache "
                     f"{_bytes(r.kv_cache_bytes)}: attention reads the whole preallocated "
                     f"cache of {r.max_seq_len} tokens and writes one row{each}); copy rate "
                     f"{r.copy_gb_per_s:.1f} GB/s")
    if any(r.prefill_ratio is not None for r in rows):
        lines.append("ratio: anygpu's time over PyTorch's, prefill/decode (above 1: slower); "
                     "PyTorch's cache holds only the tokens so far")
    return "\n".join(lines)


def _bytes(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def add_parser(modes: Any) -> None:
    """Register ``llm`` on ``anygpu bench``'s modes."""
    p = modes.add_parser("llm", help="time a language model's prefill and decode (random "
                         "weights of a real shape) against the bandwidth roofline",
                         description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=tuple(CONFIGS), default="tinyllama-1.1b")
    p.add_argument("--quant", choices=(*QUANTS, *PACKED), default="f16",
                   help="weight format: f16, bf16, f32, or q8 / q4 (packed projections, "
                   "group 32, computing in float16 where the device has it)")
    p.add_argument("--device", default=None,
                   help="an anygpu device (default: ANYGPU_DEVICE, else cpu)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64, help="timed decode steps")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="the key/value cache's length (default: the prompt, the warm-up and "
                   "the decode steps)")
    p.add_argument("--batch", type=int, default=1,
                   help="sequences prefilled and decoded together (tokens/s counts them all)")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per page of the key/value cache (default: a page per sequence)")
    p.add_argument("--cache-tokens", type=int, default=None,
                   help="tokens the cache holds in all (default: every sequence full)")
    p.add_argument("--copy-mib", type=int, default=256,
                   help="size of the copy that measures the copy rate")
    p.add_argument("--compare", choices=("torch",), help="run transformers beside, same device")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--profile", metavar="TRACE",
                   help="profile a prefill and three decode steps: print the summaries, write "
                        "Chrome traces (TRACE with -prefill and -decode before .json)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import anygpu as ag

    if min(args.prompt_len, args.decode_tokens, args.copy_mib, args.batch) < 1:
        raise SystemExit("anygpu bench llm: --prompt-len, --decode-tokens, --copy-mib and "
                         "--batch must be at least 1")
    needed = args.prompt_len + DECODE_WARMUP + args.decode_tokens
    max_seq_len = args.max_seq_len or needed
    if max_seq_len < needed:
        raise SystemExit(f"anygpu bench llm: --max-seq-len {max_seq_len} is shorter than the "
                         f"prompt, {DECODE_WARMUP} warm-up steps and the decode steps "
                         f"({needed})")
    device = ag.get_device(args.device).name
    row = run_anygpu(args.config, args.quant, device, args.prompt_len, args.decode_tokens,
                     max_seq_len, args.copy_mib, args.batch, args.page_size, args.cache_tokens,
                     args.profile)
    rows = [row]
    if args.compare == "torch" and args.batch > 1:
        raise SystemExit("anygpu bench llm: --compare torch runs one sequence; leave --batch "
                         "at 1 for it")
    if args.compare == "torch":
        from anygpu.cli.bench import torch_device

        peer = run_torch(args.config, args.quant, torch_device(device), args.prompt_len,
                         args.decode_tokens, max_seq_len)
        row.prefill_ratio = row.prefill_s / peer.prefill_s
        row.decode_ratio = row.decode_ms / peer.decode_ms
        rows.append(peer)
    if args.json:
        for r in rows:
            print(json.dumps(asdict(r)), flush=True)
    else:
        print(format_table(rows))
    return 0


__all__ = ["CONFIGS", "QUANTS", "Row", "random_weights", "traffic", "copy_rate", "run_anygpu",
           "run_torch", "format_table", "add_parser", "main"]
