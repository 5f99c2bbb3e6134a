"""How far a model's gradients after one backward pass on a device lie from PyTorch's on the
processor: the median and largest relative error over its parameters, and the largest of each
block, on one batch of the weights and inputs ``tests/models/test_models.py`` uses (train mode,
cross entropy). ``--torch-device cuda`` compares PyTorch's own run on that device the same way.

    python scripts/model_grads.py --device cuda --model resnet101
    ANYGPU_CHECK=1 python scripts/model_grads.py --device cuda --model resnet101
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def errors(grads: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> dict[str, float]:
    return {k: float(np.linalg.norm(g - want[k]) / (np.linalg.norm(want[k]) + 1e-30))
            for k, g in grads.items()}


def report(who: str, rel: dict[str, float]) -> None:
    values = np.array(list(rel.values()))
    worst = max(rel, key=rel.__getitem__)
    print(f"{who}: median {np.median(values):.2e}, largest {values.max():.2e} ({worst})")
    blocks: dict[str, float] = {}
    for k, e in rel.items():
        match = re.match(r"(layer\d\.\d+|features\.\d+|[a-z]+\d*)", k)
        block = match.group(1) if match else k
        blocks[block] = max(blocks.get(block, 0.0), e)
    print("   by block, output end first: " +
          " ".join(f"{b}:{e:.0e}" for b, e in reversed(blocks.items())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="resnet101")
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--torch-device", default="", help="also PyTorch's run on this device")
    args = parser.parse_args()

    import torch

    import anygpu as ag
    from anygpu import models
    from tests.models import test_models as tm

    theirs = tm.make_reference(args.model, {}, seed=len(args.model) + args.side, side=args.side)
    path = tm.save_weights(theirs, Path(tempfile.mkdtemp()) / "weights.safetensors")
    ours = getattr(models, args.model)(weights=path).to(args.device).train()
    path.unlink()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, args.side, args.side)).astype(np.float32)
    y = rng.integers(0, tm.CLASSES, 2)

    def torch_grads(model: Any, device: str) -> dict[str, np.ndarray]:
        model = model.to(device).train()
        loss = torch.nn.CrossEntropyLoss()(model(torch.tensor(x, device=device)),
                                           torch.tensor(y, device=device))
        loss.backward()
        return {k: p.grad.double().cpu().numpy() for k, p in model.named_parameters()}

    other = copy.deepcopy(theirs) if args.torch_device else None
    want = torch_grads(theirs, "cpu")
    loss = ag.nn.CrossEntropyLoss()(ours(ag.tensor(x, device=args.device)),
                                    ag.tensor(y, device=args.device))
    loss.backward()
    grads = {k: p.grad.numpy().astype(np.float64) for k, p in ours.named_parameters()}
    report(f"anygpu on {args.device}", errors(grads, want))
    if other is not None:
        report(f"torch on {args.torch_device}", errors(torch_grads(other, args.torch_device),
                                                       want))
    return 0


if __name__ == "__main__":
    sys.exit(main())
