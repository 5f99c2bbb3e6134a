"""ONNX models on anygpu beside PyTorch eager on the same GPU and ONNX Runtime on the processor,
in one run: ResNet-50 at batch 1 and 16 (224x224) and a BERT-base-shape encoder at batch 8 x 128
tokens, exported from PyTorch with random weights.

    python benchmarks/bench_onnx.py --device cuda opencl webgpu cpu
    python benchmarks/bench_onnx.py --device cpu --models resnet50:1 --reps 5

Each row is the median latency of a call after warm-up. On a GPU the inputs and outputs stay on
the device on both sides (anygpu: Tensors in and out, then the device synchronized; PyTorch:
CUDA tensors under ``no_grad``, then ``torch.cuda.synchronize``), and the ratio is anygpu's time
over PyTorch-CUDA's. On ``cpu`` a call is NumPy in and out on both sides, beside ONNX Runtime's
CPU provider, and the ratio is over ONNX Runtime's. Outputs are compared with ONNX Runtime's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

MODELS = ("resnet50:1", "resnet50:16", "bert:8")


def _export(name: str, batch: int, folder: str) -> tuple[str, dict[str, np.ndarray], Any]:
    """The model exported to ONNX (opset 17), its random inputs and the PyTorch module."""
    import torch

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    if name == "resnet50":
        try:
            from torchvision.models import resnet50
        except ImportError:  # the same architecture written out (the model tests' reference)
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
            from torch_reference import resnet50
        module = resnet50().eval()
        feed = {"image": rng.standard_normal((batch, 3, 224, 224)).astype(np.float32)}
        outputs = ["logits"]
    elif name == "bert":
        module = _bert_base().eval()
        feed = {"input_ids": rng.integers(0, 30522, (batch, 128)).astype(np.int64),
                "attention_mask": np.ones((batch, 128), np.int64)}
        outputs = ["hidden"]
    else:
        raise SystemExit(f"bench_onnx: no model {name!r} (resnet50, bert)")
    path = os.path.join(folder, f"{name}-{batch}.onnx")
    args = tuple(torch.from_numpy(v) for v in feed.values())
    kwargs: dict[str, Any] = {"dynamo": False} if "dynamo" in \
        torch.onnx.export.__code__.co_varnames else {}
    torch.onnx.export(module, args, path, input_names=list(feed), output_names=outputs,
                      opset_version=17, **kwargs)
    return path, feed, module


def _bert_base() -> Any:
    """BERT-base (12 layers of 768, 12 heads, 3,072 wide feed-forward, the last hidden state
    out) from transformers, or where it is missing the same encoder written out in PyTorch:
    embeddings of words, positions and token types with LayerNorm, then post-norm layers of
    attention under the padding mask and erf's GELU."""
    import torch

    try:
        from transformers import BertConfig, BertModel
    except ImportError:
        BertModel = None
        print("bench_onnx: transformers is not installed; BERT-base written out in PyTorch",
              file=sys.stderr)

    class Layer(torch.nn.Module):
        def __init__(self, width: int = 768, heads: int = 12, ff: int = 3072) -> None:
            super().__init__()
            self.heads = heads
            self.q, self.k, self.v, self.o = (torch.nn.Linear(width, width) for _ in range(4))
            self.norm1, self.norm2 = (torch.nn.LayerNorm(width, eps=1e-12) for _ in range(2))
            self.up, self.down = torch.nn.Linear(width, ff), torch.nn.Linear(ff, width)

        def forward(self, x: Any, mask: Any) -> Any:
            b, t, width = x.shape

            def heads(y: Any) -> Any:
                return y.view(b, t, self.heads, width // self.heads).transpose(1, 2)

            q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
            scores = q @ k.transpose(-1, -2) / (width // self.heads) ** 0.5 + mask
            a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, width)
            x = self.norm1(self.o(a) + x)
            return self.norm2(self.down(torch.nn.functional.gelu(self.up(x))) + x)

    class Encoder(torch.nn.Module):  # BERT-base's shape; the last hidden state out
        def __init__(self) -> None:
            super().__init__()
            if BertModel is not None:
                self.bert = BertModel(BertConfig(), add_pooling_layer=False)
                return
            self.words, self.positions = torch.nn.Embedding(30522, 768), \
                torch.nn.Embedding(512, 768)
            self.types, self.norm = torch.nn.Embedding(2, 768), torch.nn.LayerNorm(768, eps=1e-12)
            self.layers = torch.nn.ModuleList(Layer() for _ in range(12))

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            if BertModel is not None:
                return self.bert(input_ids=input_ids,
                                 attention_mask=attention_mask).last_hidden_state
            t = input_ids.shape[1]
            positions = torch.arange(t, device=input_ids.device)
            x = self.norm(self.words(input_ids) + self.positions(positions)[None] +
                          self.types(torch.zeros_like(input_ids)))
            mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
            for layer in self.layers:
                x = layer(x, mask)
            return x

    return Encoder()


def _median(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _torch_cuda(module: Any, feed: dict[str, np.ndarray], reps: int) -> float:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    m = module.cuda()
    args = [torch.from_numpy(v).cuda() for v in feed.values()]

    def call() -> None:
        with torch.no_grad():
            m(*args)
        torch.cuda.synchronize()

    ms = _median(call, reps)
    module.cpu()
    return ms


def _anygpu(path: str, feed: dict[str, np.ndarray], device: str, reps: int,
            reference: list[np.ndarray]) -> tuple[float, float, float]:
    """First call (s), median ms and the largest difference from ONNX Runtime."""
    import anygpu as ag
    import anygpu.onnx as agx
    from anygpu.runtime.registry import get_device

    model = agx.load(path, device=device)
    dev = get_device(device)
    start = time.perf_counter()
    got = model.run(None, feed)
    first = time.perf_counter() - start
    err = max(float(np.abs(g.astype(np.float64) - r).max()) for g, r in zip(got, reference))
    if device == "cpu":
        ms = _median(lambda: model.run(None, feed), reps)
    else:
        inputs = {k: ag.tensor(v, device=device) for k, v in feed.items()}

        def call() -> None:
            for out in model(**inputs):
                out.realize()
            dev.synchronize()

        ms = _median(call, reps)
    return first, ms, err


def _profile(path: str, feed: dict[str, np.ndarray], device: str) -> str:
    """anygpu.profile's table of one call without jit (each kernel on its own line)."""
    import anygpu as ag
    import anygpu.onnx as agx

    model = agx.load(path, device=device, jit=False)
    inputs = {k: ag.tensor(v, device=device) for k, v in feed.items()}
    for out in model(**inputs):  # compiles
        out.realize()
    with ag.profile() as prof:
        for out in model(**inputs):
            out.realize()
    return prof.summary()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", nargs="+", default=["cpu"])
    parser.add_argument("--models", nargs="+", default=list(MODELS),
                        help="NAME:BATCH pairs (resnet50, bert)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--profile", action="store_true",
                        help="after each row, anygpu.profile's table of one call without jit")
    args = parser.parse_args(argv)

    # the processor's kernels set how their OpenMP threads wait (runtime/cpu.py) when the
    # OpenMP runtime loads; PyTorch loads the same runtime, so anygpu's first kernel runs first
    import anygpu as ag
    (ag.ones(2, device="cpu") + 1).numpy()
    import onnxruntime as ort
    import torch

    cuda = torch.cuda.is_available()
    print(f"{'model':12s} {'device':8s} {'first s':>8s} {'anygpu ms':>10s} {'peer':>18s} "
          f"{'peer ms':>9s} {'ratio':>6s} {'max diff':>9s}")
    with tempfile.TemporaryDirectory() as folder:
        for spec in args.models:
            name, _, batch = spec.partition(":")
            path, feed, module = _export(name, int(batch or 1), folder)
            session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            reference = [np.asarray(r, np.float64) for r in session.run(None, feed)]
            ort_ms = torch_ms = None
            for device in args.device:
                label = f"{name}:{batch}"
                try:
                    first, ms, err = _anygpu(path, feed, device, args.reps, reference)
                except Exception as failure:  # one device's failure must not hide the others
                    print(f"{label:12s} {device:8s} FAILED: {type(failure).__name__}: "
                          f"{failure}")
                    continue
                if device == "cpu":
                    if ort_ms is None:
                        ort_ms = _median(lambda s=session, f=feed: s.run(None, f), args.reps)
                    peer, peer_ms = "onnxruntime cpu", ort_ms
                elif cuda:
                    if torch_ms is None:
                        torch_ms = _torch_cuda(module, feed, args.reps)
                    peer, peer_ms = "torch cuda eager", torch_ms
                else:
                    peer, peer_ms = "none", float("nan")
                print(f"{label:12s} {device:8s} {first:8.1f} {ms:10.2f} {peer:>18s} "
                      f"{peer_ms:9.2f} {ms / peer_ms:5.2f}x {err:9.2e}")
                if args.profile:
                    print(_profile(path, feed, device))
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
