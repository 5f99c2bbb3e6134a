"""Adam and AdamW, as ``torch.optim.Adam`` / ``torch.optim.AdamW``. The bias corrections are
computed in the kernel from the device step count."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from anygpu.optim.optimizer import Bucket, Optimizer, ParamGroup
from anygpu.tensor import Tensor


class Adam(Optimizer):
    decoupled = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, maximize: bool = False):
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"invalid betas {betas}")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"invalid hyperparameters lr={lr} eps={eps} "
                             f"weight_decay={weight_decay}")
        if amsgrad:
            raise NotImplementedError("amsgrad is not implemented")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, maximize=maximize))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """As ``Optimizer.load_state_dict``; refuses a torch.optim state this class would not
        follow (amsgrad, or Adam's coupled weight decay loaded into AdamW and the reverse)."""
        for saved in state_dict["param_groups"]:
            if saved.get("amsgrad"):
                raise NotImplementedError("amsgrad is not implemented")
            if bool(saved.get("decoupled_weight_decay", self.decoupled)) != self.decoupled:
                other = "AdamW" if saved["decoupled_weight_decay"] else "Adam"
                raise ValueError(f"the loaded state is {other}'s (decoupled_weight_decay="
                                 f"{saved['decoupled_weight_decay']}); load it into {other}")
        super().load_state_dict(state_dict)

    def _update(self, group: ParamGroup, bucket: Bucket, lr: Tensor, count: Tensor) -> None:
        p = bucket.flat
        g = bucket.grad()
        if group["maximize"]:
            g = -g
        b1, b2 = group["betas"]
        wd = group["weight_decay"]
        if wd and not self.decoupled:
            g = g + wd * p
        m, v = bucket.buffer("exp_avg"), bucket.buffer("exp_avg_sq")
        m.assign(m * b1 + g * (1 - b1))
        v.assign(v * b2 + g * g * (1 - b2))
        # 1 - beta**t with t on the device: exp2(t * log2(beta))
        bc1 = 1 - (count * math.log2(b1)).exp2() if b1 > 0 else count * 0 + 1
        bc2 = 1 - (count * math.log2(b2)).exp2() if b2 > 0 else count * 0 + 1
        denom = v.sqrt() / bc2.sqrt() + group["eps"]
        base = p * (1 - lr * wd) if wd and self.decoupled else p
        p.assign(base - (lr / bc1) * m / denom)


class AdamW(Adam):
    """Adam with decoupled weight decay (default 0.01, as PyTorch)."""

    decoupled = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize)
