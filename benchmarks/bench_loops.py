"""Plain PyTorch loops, without jit and without realize(): the time of each step, the kernels
compiled after the first step, and PyTorch running the same program text in the same process.

    python benchmarks/bench_loops.py --device cpu [cuda ...] [--steps 20]

Two loops, each written once against a module ``T`` that is either ``torch`` or ``anygpu``:
- train: nanoGPT's pattern: windows of a token sequence stacked into a batch at random offsets
  each step, causal self-attention with its mask as a buffer, a statistic updated by
  reassignment inside the forward pass, AdamW, ``loss.item()``;
- generate: greedy generation with ``cat``, each new token read as it comes (each step is one
  token longer, so each step compiles the kernels of its new length on anygpu).
Printed per loop: step 2 and the last step (ms), the median step, the kernels compiled after
the first step, and PyTorch's median step beside.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anygpu as ag  # noqa: E402
from anygpu.runtime.registry import get_device  # noqa: E402

VOCAB, WIDTH, BLOCK, BATCH = 65, 64, 32, 16


def build(T: ModuleType, nn: Any, F: Any, device: str) -> Any:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.key = nn.Linear(WIDTH, WIDTH, bias=False)
            self.query = nn.Linear(WIDTH, WIDTH, bias=False)
            self.value = nn.Linear(WIDTH, WIDTH, bias=False)
            self.register_buffer("tril", T.tril(T.ones(BLOCK, BLOCK)))

        def forward(self, x: Any) -> Any:
            _, t, c = x.shape
            wei = self.query(x) @ self.key(x).transpose(-2, -1) * c ** -0.5
            wei = wei.masked_fill(self.tril[:t, :t] == 0, float("-inf"))
            return F.softmax(wei, dim=-1) @ self.value(x)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(VOCAB, WIDTH)
            self.pos = nn.Embedding(BLOCK, WIDTH)
            self.head = Head()
            self.ln = nn.LayerNorm(WIDTH)
            self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                     nn.Linear(4 * WIDTH, WIDTH))
            self.out = nn.Linear(WIDTH, VOCAB)
            self.register_buffer("seen", T.zeros(WIDTH))

        def forward(self, idx: Any) -> Any:
            _, t = idx.shape
            x = self.tok(idx) + self.pos(T.arange(t, device=idx.device))
            if self.training:
                self.seen = self.seen * 0.9 + x.detach().mean((0, 1)) * 0.1
            x = x + self.head(x)
            x = x + self.mlp(self.ln(x))
            return self.out(x)

    return LM().to(device)


def loops(T: ModuleType, device: str, steps: int) -> dict[str, Callable[[], Callable[[], Any]]]:
    nn, F = T.nn, T.nn.functional
    T.manual_seed(0)
    data = T.tensor(np.random.default_rng(0).integers(0, VOCAB, 20000), device=device)
    offsets = np.random.default_rng(1).integers(0, len(data) - BLOCK - 1, (steps, BATCH))

    def train() -> Callable[[], Any]:
        model = build(T, nn, F, device)
        opt = T.optim.AdamW(model.parameters(), lr=1e-3)
        state = {"step": 0}

        def step() -> Any:
            ix = T.tensor(offsets[state["step"] % steps])
            state["step"] += 1
            x = T.stack([data[i:i + BLOCK] for i in ix])
            y = T.stack([data[i + 1:i + BLOCK + 1] for i in ix])
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.item()
        return step

    def generate() -> Callable[[], Any]:
        model = build(T, nn, F, device).eval()
        state = {"idx": data[:4].reshape(1, 4)}

        def step() -> Any:
            with T.no_grad():
                idx = state["idx"]
                logits = model(idx[:, -BLOCK:])[:, -1, :]
                nxt = logits.argmax(-1, keepdim=True)
                state["idx"] = T.cat((idx, nxt), dim=1)
                return nxt.item()
        return step

    return {"train": train, "generate": generate}


def run(T: ModuleType, device: str, steps: int, sync: Callable[[], None]) -> dict[str, list]:
    results = {}
    for name, make in loops(T, device, steps).items():
        step = make()
        times, compiled = [], []
        for _ in range(steps):
            before = len(get_device(device)._programs) if T is ag else 0
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
            compiled.append((len(get_device(device)._programs) if T is ag else 0) - before)
        results[name] = [times, compiled]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", nargs="+", default=["cpu"])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        torch = None
    for device in args.device:
        dev = get_device(device)
        ours = run(ag, dev.name, args.steps, dev.synchronize)
        theirs = {}
        kind = dev.name.split(":")[0]
        if torch is not None and kind in ("cpu", "cuda"):
            sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
            theirs = run(torch, "cuda" if kind == "cuda" else "cpu", args.steps, sync)
        for name, (times, compiled) in ours.items():
            ms = [t * 1e3 for t in times]
            line = (f"{dev.name:10s} {name:9s} first {ms[0]:8.1f} ms  step 2 {ms[1]:7.2f}  "
                    f"last {ms[-1]:7.2f}  median {statistics.median(ms[1:]):7.2f} ms  "
                    f"compiled after the first step: {sum(compiled[1:])}")
            if name in theirs:
                peer = statistics.median(t * 1e3 for t in theirs[name][0][1:])
                line += f"   PyTorch median {peer:7.2f} ms"
            print(line, flush=True)


if __name__ == "__main__":
    main()
