"""Random programs against PyTorch (CPU): values, dtypes and gradients of short chains of ops.

Hypothesis draws one to three input tensors (shapes that broadcast together, any public dtype
the device has, random values with or without edge values: nan, +-inf, -0.0, tiny numbers and
the integer extremes) and a chain of one to four steps, each an elementwise, reduction or
movement op on earlier values. A step is only drawn where PyTorch accepts it, so each program
runs to the end in PyTorch; anygpu must then give the same dtype, shape and values at every
step, and for float32 programs the same gradients under a random upstream gradient.

The examples are derandomized (CI runs the same programs every time) and their number comes from
the hypothesis profile of ``conftest.py`` (``HYPOTHESIS_PROFILE=thorough`` for more). Huge finite
values are left out of the inputs: sums over them depend on the order of the additions, which
is not part of either library's contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import deadline
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import anygpu as ag
from anygpu import dtype as dt
from anygpu.dtype import DType
from anygpu.runtime.registry import get_device

torch = pytest.importorskip("torch")

TORCH_DTYPE = {
    dt.float32: torch.float32,
    dt.float16: torch.float16,
    dt.bfloat16: torch.bfloat16,
    dt.int8: torch.int8,
    dt.uint8: torch.uint8,
    dt.int32: torch.int32,
    dt.int64: torch.int64,
    dt.bool_: torch.bool,
}
FROM_TORCH = {v: k for k, v in TORCH_DTYPE.items()}
# a few roundings to the dtype, each after float32 math
TOLERANCE = {dt.float32: (1e-4, 1e-5), dt.float16: (4e-3, 4e-3), dt.bfloat16: (3e-2, 3e-2)}
GRAD_TOLERANCE = (1e-4, 1e-5)

FLOAT_EDGES = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-30, -1e-8, 1.0]
BASE_SHAPES = [(3, 4), (2, 3, 4)]
MAX_STEPS = 4


def _variants(base: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Shapes that broadcast against ``base``."""
    return [base, base[1:], (1,) + base[1:], base[:-1] + (1,), ()]


def host_values(shape: tuple[int, ...], d: DType, seed: int, edges: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if d == dt.bool_:
        return rng.random(shape) < 0.5
    if d.is_float:
        x = rng.uniform(-3, 3, shape)
        if edges:
            x = np.where(rng.random(shape) < 0.35, rng.choice(FLOAT_EDGES, shape), x)
        t = torch.tensor(x, dtype=torch.float64).to(TORCH_DTYPE[d])
        return t.float().numpy() if d == dt.bfloat16 else t.numpy()
    info = np.iinfo(d.np)
    x = rng.integers(max(info.min, -5), 6, shape)
    if edges:
        extremes = [info.min, info.max, info.max - 1, 0]
        x = np.where(rng.random(shape) < 0.35, rng.choice(extremes, shape), x)
    return x.astype(d.np)


# ---- the ops a program is made of: name -> f(L, *values) ------------------------------------
def _where(L: Any, x: Any, y: Any) -> Any:
    return L.where(x > 0, x, y)


UNARY: dict[str, Callable[..., Any]] = {
    "neg": lambda L, x: -x,
    "abs": lambda L, x: x.abs(),
    "exp": lambda L, x: x.exp(),
    "log": lambda L, x: x.log(),
    "sqrt": lambda L, x: x.sqrt(),
    "sin": lambda L, x: x.sin(),
    "tanh": lambda L, x: x.tanh(),
    "sigmoid": lambda L, x: x.sigmoid(),
    "relu": lambda L, x: x.relu(),
    "floor": lambda L, x: x.floor(),
    "round": lambda L, x: x.round(),
    "square": lambda L, x: x.square(),
    "reciprocal": lambda L, x: x.reciprocal(),
    "sign": lambda L, x: x.sign(),
    "clamp": lambda L, x: x.clamp(-1.5, 2),
    "isnan": lambda L, x: x.isnan(),
    "logical_not": lambda L, x: x.logical_not(),
    "float": lambda L, x: x.float(),
    "mul-scalar": lambda L, x: x * 3,
    "add-float-scalar": lambda L, x: x + 0.5,
    "rsub-scalar": lambda L, x: 2 - x,
    "pow-2": lambda L, x: x**2,
    "gelu": lambda L, x: L.F.gelu(x),
    "silu": lambda L, x: L.F.silu(x),
}
BINARY: dict[str, Callable[..., Any]] = {
    "add": lambda L, x, y: x + y,
    "sub": lambda L, x, y: x - y,
    "mul": lambda L, x, y: x * y,
    "div": lambda L, x, y: x / y,
    "maximum": lambda L, x, y: x.maximum(y),
    "minimum": lambda L, x, y: x.minimum(y),
    "pow": lambda L, x, y: x**y,
    "where": _where,
    "lt": lambda L, x, y: x < y,
    "eq": lambda L, x, y: x == y,
    "logical_and": lambda L, x, y: x.logical_and(y),
    "float-floor-divide": lambda L, x, y: x.float() // y.float(),
}
REDUCE: dict[str, Callable[..., Any]] = {
    "sum": lambda L, x, d, k: x.sum(d, keepdim=k),
    "mean": lambda L, x, d, k: x.mean(d, keepdim=k),
    "amax": lambda L, x, d, k: x.amax(d, keepdim=k),
    "amin": lambda L, x, d, k: x.amin(d, keepdim=k),
    "argmax": lambda L, x, d, k: x.argmax(d, keepdim=k),
    "prod": lambda L, x, d, k: x.prod(d, keepdim=k),
    "max-values": lambda L, x, d, k: x.max(d, keepdim=k)[0],
    "softmax": lambda L, x, d, k: x.softmax(d),
    "log_softmax": lambda L, x, d, k: x.log_softmax(d),
    "logsumexp": lambda L, x, d, k: x.logsumexp(d, keepdim=k),
    "cumsum": lambda L, x, d, k: x.cumsum(d),
    "any": lambda L, x, d, k: x.any(d, keepdim=k),
}
MOVE: dict[str, Callable[..., Any]] = {
    "transpose": lambda L, x: x.transpose(0, -1),
    "flip": lambda L, x: x.flip(0),
    "flatten": lambda L, x: x.reshape(-1),
    "unsqueeze": lambda L, x: x.unsqueeze(0),
    "permute-reversed": lambda L, x: x.permute(*reversed(range(x.ndim))),
    "every-second": lambda L, x: x[::2],
    "drop-first": lambda L, x: x[1:],
    "last-column": lambda L, x: x[..., -1],
    "index-list": lambda L, x: x[[0, -1, 0]],
    "expand": lambda L, x: x.unsqueeze(0).expand(2, *x.shape),
    "pad": lambda L, x: L.F.pad(x, (1, 0)),
    "cat-self": lambda L, x: L.cat([x, x.flip(0)], 0),
}

AG = type(
    "AG", (), {"where": staticmethod(ag.where), "cat": staticmethod(ag.cat), "F": ag.nn.functional}
)
TORCH = type(
    "TORCH",
    (),
    {"where": staticmethod(torch.where), "cat": staticmethod(torch.cat), "F": torch.nn.functional},
)


class Program:
    """Inputs (host values and dtypes) and steps ``(kind, name, operand indices, arguments)``;
    value k of the program is input k, then step results in order."""

    def __init__(self) -> None:
        self.inputs: list[tuple[np.ndarray, DType]] = []
        self.steps: list[tuple[str, str, tuple[int, ...], tuple]] = []

    def __repr__(self) -> str:
        ins = ", ".join(
            f"x{k}: {d.name}{tuple(v.shape)} {v.reshape(-1)[:6].tolist()}"
            for k, (v, d) in enumerate(self.inputs)
        )
        n = len(self.inputs)
        steps = "; ".join(
            f"v{n + k} = {name}({', '.join(f'v{i}' for i in ops)}"
            f"{''.join(f', {a!r}' for a in args)})"
            for k, (_, name, ops, args) in enumerate(self.steps)
        )
        return f"Program({ins} | {steps})"


def _apply(L: Any, kind: str, name: str, operands: list, args: tuple) -> Any:
    table = {"unary": UNARY, "binary": BINARY, "reduce": REDUCE, "move": MOVE}[kind]
    return table[name](L, *operands, *args)


def _torch_input(host: np.ndarray, d: DType) -> Any:
    return torch.from_numpy(np.array(host)).to(TORCH_DTYPE[d])


@st.composite
def programs(draw: Any, device: str) -> Program:
    dev = get_device(device)
    dtypes = [d for d in dt.PUBLIC if dev.supports(d)]
    # float32 more often than the others: its programs check gradients too
    dtype_choice = st.sampled_from([dt.float32] * len(dtypes) + dtypes)
    prog = Program()
    base = draw(st.sampled_from(BASE_SHAPES))
    for _ in range(draw(st.integers(1, 3))):
        shape = draw(st.sampled_from(_variants(base)))
        d = draw(dtype_choice)
        prog.inputs.append(
            (host_values(shape, d, draw(st.integers(0, 2**16)), draw(st.booleans())), d)
        )
    values = [_torch_input(v, d) for v, d in prog.inputs]
    for _ in range(draw(st.integers(1, MAX_STEPS))):
        options = _valid_steps(values, dev)
        if not options:
            break
        kind, name, ops, args, out = draw(st.sampled_from(options))
        prog.steps.append((kind, name, ops, args))
        values.append(out)
    return prog


def _valid_steps(values: list, dev: Any) -> list[tuple]:
    """Every step PyTorch accepts on the last value (with a partner for binary ops, and a dim
    for reductions), with a result of a dtype the device has."""
    last = len(values) - 1
    x = values[last]
    candidates: list[tuple[str, str, tuple[int, ...], tuple]] = []
    candidates += [("unary", n, (last,), ()) for n in UNARY]
    candidates += [("move", n, (last,), ()) for n in MOVE]
    for d in range(x.ndim):
        candidates += [("reduce", n, (last,), (d, d % 2 == 1)) for n in REDUCE]
    for k in range(len(values)):
        candidates += [("binary", n, (last, k), ()) for n in BINARY]
        candidates += [("binary", n, (k, last), ()) for n in BINARY if k != last]
    valid = []
    for kind, name, ops, args in candidates:
        try:
            out = _apply(TORCH, kind, name, [values[i] for i in ops], args)
        except Exception:
            continue
        if (
            out.numel() > 512
            or out.dtype not in FROM_TORCH  # a dtype anygpu does not offer (int16)
            or not dev.supports(FROM_TORCH[out.dtype])
        ):
            continue
        valid.append((kind, name, ops, args, out))
    return valid


def _mismatch(got: Any, exp: Any, rtol: float, atol: float) -> Any:
    if exp.dtype.is_floating_point:
        g, e = got.double(), exp.double()
        close = ((g - e).abs() <= atol + rtol * e.abs()) | (g == e)
        # an infinite value matches only itself (rtol * inf had let anything but NaN match it)
        close = torch.where(e.isinf() | g.isinf(), g == e, close)
        return ~((close & ~(g.isnan() | e.isnan())) | (g.isnan() & e.isnan()))
    return got.long() != exp.long()


def _read(tensors: list, device: str) -> list[np.ndarray]:
    """The values of ``tensors``, read through one fused kernel per kind where it works."""
    int_dtype = dt.int64 if get_device(device).supports(dt.int64) else dt.int32
    out: list[Any] = [None] * len(tensors)
    for is_float in (True, False):
        idx = [k for k, t in enumerate(tensors) if t.dtype.is_float == is_float and t.numel()]
        if not idx:
            continue
        try:
            flat = ag.cat(
                [
                    tensors[k].detach().cast(dt.float32 if is_float else int_dtype).reshape(-1)
                    for k in idx
                ]
            ).numpy()
        except Exception:
            flat = None
        start = 0
        for k in idx:
            n = tensors[k].numel()
            out[k] = flat[start : start + n] if flat is not None else tensors[k].detach().numpy()
            start += n
    return [np.zeros(0) if o is None else o for o in out]


def _compare(label: str, got: Any, exp: Any, tol: tuple[float, float]) -> str | None:
    exp = exp.detach()
    got = torch.from_numpy(np.array(got).reshape(tuple(exp.shape)))
    if got.dtype.is_floating_point == exp.dtype.is_floating_point:
        got = got.to(exp.dtype)
    bad = _mismatch(got, exp, *tol)
    if not bool(bad.any()):
        return None
    at = [tuple(int(i) for i in row) for row in bad.nonzero()[:3]]
    where = "; ".join(f"at {i}: anygpu {got[i].item()!r}, torch {exp[i].item()!r}" for i in at)
    return f"{label}: {int(bad.sum())} of {bad.numel()} values differ; {where}"


def run_program(prog: Program, device: str) -> list[str]:
    failures: list[str] = []
    grad = all(d == dt.float32 for _, d in prog.inputs)
    tvals = [_torch_input(v, d).requires_grad_(grad) for v, d in prog.inputs]
    avals = [ag.tensor(v, dtype=d, device=device, requires_grad=grad) for v, d in prog.inputs]
    # a float value computed from 16-bit ones is held to the loosest of their tolerances: a
    # fused kernel keeps 16-bit intermediates in float32, where PyTorch rounds each
    loosest = [TOLERANCE.get(d, (0.0, 0.0)) for _, d in prog.inputs]
    for kind, name, ops, args in prog.steps:
        tvals.append(_apply(TORCH, kind, name, [tvals[i] for i in ops], args))
        avals.append(_apply(AG, kind, name, [avals[i] for i in ops], args))
        own = TOLERANCE.get(avals[-1].dtype, (0.0, 0.0))
        loosest.append(max([loosest[i] for i in ops] + [own]))
    n = len(prog.inputs)
    checks = []
    for k in range(n, len(tvals)):
        a, t = avals[k], tvals[k]
        label = f"v{k}"
        if a.dtype != FROM_TORCH[t.dtype] or tuple(a.shape) != tuple(t.shape):
            failures.append(
                f"{label}: anygpu {a.dtype.name}{tuple(a.shape)}, torch "
                f"{str(t.dtype).replace('torch.', '')}{tuple(t.shape)}"
            )
            continue
        own = TOLERANCE.get(a.dtype, (0.0, 0.0))
        checks.append((label, a, t, loosest[k] if a.dtype.is_float else own))
    final_a, final_t = avals[-1], tvals[-1]
    if grad and final_t.requires_grad and not failures:
        up = (
            np.random.default_rng(len(prog.steps))
            .standard_normal(tuple(final_t.shape))
            .astype(np.float32)
        )
        try:
            final_t.backward(torch.from_numpy(up))
        except RuntimeError:  # an op PyTorch does not differentiate
            pass
        else:
            final_a.backward(ag.tensor(up, device=device))
            for k in range(n):
                exp = tvals[k].grad if tvals[k].grad is not None else torch.zeros_like(tvals[k])
                got = avals[k].grad
                if got is None:
                    if bool((exp != 0).any()):
                        failures.append(f"grad of x{k}: anygpu has none, torch {exp}")
                    continue
                checks.append((f"grad of x{k}", got, exp, GRAD_TOLERANCE))
    values = _read([a for _, a, _, _ in checks], device)
    for (label, _, t, tol), got in zip(checks, values):
        problem = _compare(label, got, t, tol)
        if problem:
            failures.append(problem)
    return failures


DEADLINE_S = 60  # one program; far above what any takes when all is well




# no shrinking: each smaller program is new kernels to compile; the one found is printed whole
@settings(derandomize=True, database=None, phases=[Phase.explicit, Phase.generate])
@given(data=st.data())
def test_random_program(device: str, data: Any) -> None:
    prog = data.draw(programs(device), label="program")
    with deadline(DEADLINE_S):
        failures = run_program(prog, device)
    assert not failures, f"{prog}\n  " + "\n  ".join(failures)
