"""The ReLU inputs of a ResNet (bottleneck blocks) that lie on the other side of zero from float64
PyTorch's, for anygpu's float32 forward pass and for float32 PyTorch's, in train mode on one
batch of the weights and inputs ``tests/models/test_models.py`` uses.

A ReLU input within float32 rounding of zero may land on either side; where it does, the ReLU
passes (or stops) that element's gradient, and the gradients of every layer below move by
percents. Deep networks have millions of ReLU inputs, so some flip in any float32 run.

    python scripts/relu_flips.py --device cuda --model resnet152
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def capture(model: Any) -> dict[tuple[str, str], Any]:
    """Forward hooks on each bottleneck block: its three batch norms' outputs, its input and its
    projection's output (where it has one), keyed by (block, part)."""
    vals: dict[tuple[str, str], Any] = {}

    def held(t: Any) -> Any:
        # a copy: torchvision's blocks add the shortcut to bn3's output and apply their ReLU
        # in place, which would change the kept tensors after the hook
        return t.clone() if hasattr(t, "clone") else t

    def keep(key: tuple[str, str]) -> Any:
        return lambda mod, args, out: vals.__setitem__(key, held(out))

    for name, m in model.named_modules():
        if not hasattr(m, "bn3"):
            continue
        for part in ("bn1", "bn2", "bn3"):
            getattr(m, part).register_forward_hook(keep((name, part)))
        m.register_forward_pre_hook(
            lambda mod, args, n=name: vals.__setitem__((n, "in"), held(args[0])))
        if m.downsample is not None:
            m.downsample.register_forward_hook(keep((name, "ds")))
    return vals


def relu_inputs(vals: dict[tuple[str, str], Any], block: str, host: Any) -> dict[str, np.ndarray]:
    """The block's three ReLU inputs as float64 arrays (``host`` reads a tensor)."""
    out = {"bn1": host(vals[(block, "bn1")]), "bn2": host(vals[(block, "bn2")])}
    shortcut = vals[(block, "ds")] if (block, "ds") in vals else vals[(block, "in")]
    out["add"] = host(vals[(block, "bn3")]) + host(shortcut)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--side", type=int, default=64)
    args = parser.parse_args()

    import torch

    import anygpu as ag
    from anygpu import models
    from tests.models import test_models as tm

    theirs = tm.make_reference(args.model, {}, seed=len(args.model) + args.side, side=args.side)
    path = tm.save_weights(theirs, Path(tempfile.mkdtemp()) / "weights.safetensors")
    ours = getattr(models, args.model)(weights=path).to(args.device).train()
    path.unlink()
    x = np.random.default_rng(7).standard_normal((2, 3, args.side, args.side)).astype(np.float32)
    exact = copy.deepcopy(theirs).double().train()
    single = theirs.train()
    v64, v32, v_ours = capture(exact), capture(single), capture(ours)
    with torch.no_grad():
        exact(torch.tensor(x).double())
        single(torch.tensor(x))
    with ag.no_grad():
        ours(ag.tensor(x, device=args.device))

    def from_torch(t: Any) -> np.ndarray:
        return t.detach().double().numpy()

    def from_ours(t: Any) -> np.ndarray:
        return t.numpy().astype(np.float64)

    flips = {"anygpu": 0, "torch float32": 0}
    for block in [key[0] for key in v64 if key[1] == "bn1"]:
        want = relu_inputs(v64, block, from_torch)
        runs = {"anygpu": relu_inputs(v_ours, block, from_ours),
                "torch float32": relu_inputs(v32, block, from_torch)}
        for part, ref in want.items():
            scale = float(np.abs(ref).max())
            for who, got in runs.items():
                other = np.flatnonzero((ref > 0).ravel() != (got[part] > 0).ravel())
                flips[who] += len(other)
                for i in other:
                    print(f"{who:13s} {block}.{part}[{i}]: float64 {ref.ravel()[i] / scale:+.1e}, "
                          f"{who} {got[part].ravel()[i] / scale:+.1e} (of the largest)")
    print(f"{args.model} on {args.device}: ReLU inputs on the other side of zero from float64's: "
          + ", ".join(f"{who} {n}" for who, n in flips.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
