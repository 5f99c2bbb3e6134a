"""einsum against PyTorch (CPU) on every available device: implicit and explicit outputs,
diagonals, ellipsis broadcasting, sums, several operands, the operand-list and sublist forms,
gradients, integer operands, and PyTorch's errors for malformed equations."""

from __future__ import annotations

import numpy as np
import pytest

import anygpu as ag

torch = pytest.importorskip("torch")

CASES = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("ij,kj", [(3, 4), (5, 4)]),
    ("ij->ji", [(3, 4)]),
    ("ij->", [(3, 4)]),
    ("ij->j", [(3, 4)]),
    ("ii->i", [(4, 4)]),
    ("ii", [(4, 4)]),
    ("iij->j", [(3, 3, 2)]),
    ("iji->ij", [(3, 2, 3)]),
    ("i,i->", [(5,), (5,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("i,i->i", [(5,), (5,)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (4, 5)]),
    ("...ij,...jk", [(2, 1, 3, 4), (3, 4, 2)]),
    ("...ii->...i", [(2, 3, 3)]),
    ("i...->...", [(3, 2, 4)]),
    ("...ij->ij", [(5, 2, 3)]),
    ("ab,bc,cd->ad", [(2, 3), (3, 4), (4, 5)]),
    ("ab,bc,cd", [(2, 3), (3, 4), (4, 2)]),
    ("ijk,ikl,ilm->ijm", [(2, 3, 4), (2, 4, 5), (2, 5, 3)]),
    ("bhqd,bhkd->bhqk", [(2, 3, 5, 8), (2, 3, 7, 8)]),
    ("bi,bi->b", [(1, 3), (4, 3)]),
    ("i,i->", [(1,), (4,)]),
    ("ij,ij->ij", [(3, 1), (3, 4)]),
    ("ijk,jl->kil", [(2, 3, 4), (3, 5)]),
    ("Ab,bC->CA", [(2, 3), (3, 4)]),
    (" i j , j k -> i k ", [(2, 3), (3, 4)]),
    (",i->i", [(), (4,)]),
    ("i,->", [(4,), ()]),
    ("ij,jk->ik", [(0, 3), (3, 4)]),
    ("ij,jk->ik", [(2, 0), (0, 4)]),
]


def _inputs(shapes: list[tuple[int, ...]], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) + 0.3).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("equation,shapes", CASES, ids=[c[0] for c in CASES])
def test_matches_torch(device: str, equation: str, shapes: list[tuple[int, ...]]) -> None:
    arrays = _inputs(shapes, len(equation))
    got = ag.einsum(equation, *[ag.tensor(a, device=device) for a in arrays])
    want = torch.einsum(equation, *[torch.tensor(a) for a in arrays])
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation,shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]), ("ii->i", [(4, 4)]), ("...ij,...jk", [(2, 3, 4), (4, 5)]),
    ("ab,bc,cd->", [(2, 3), (3, 4), (4, 5)]), ("bi,bi->b", [(1, 3), (4, 3)]),
    ("iij->ji", [(3, 3, 2)])])
def test_gradients(device: str, equation: str, shapes: list[tuple[int, ...]]) -> None:
    arrays = _inputs(shapes, 3)
    ours = [ag.tensor(a, device=device, requires_grad=True) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    weight = np.random.default_rng(4).standard_normal(
        tuple(torch.einsum(equation, *theirs).shape)).astype(np.float32)
    (ag.einsum(equation, *ours) * ag.tensor(weight, device=device)).sum().backward()
    (torch.einsum(equation, *theirs) * torch.tensor(weight)).sum().backward()
    for a, b in zip(ours, theirs):
        assert a.grad is not None and b.grad is not None
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_forms_and_dtypes(device: str) -> None:
    a, b = _inputs([(3, 4), (4, 5)], 6)
    ta, tb = ag.tensor(a, device=device), ag.tensor(b, device=device)
    want = (torch.tensor(a) @ torch.tensor(b)).numpy()
    np.testing.assert_allclose(ag.einsum("ij,jk", [ta, tb]).numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ag.einsum(ta, [0, 1], tb, [1, 2], [0, 2]).numpy(), want,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ag.einsum(ta, [Ellipsis, 1], tb, [1, 2]).numpy(), want,
                               rtol=1e-5, atol=1e-5)
    ints = np.random.default_rng(7).integers(-9, 9, (3, 3)).astype(np.int32)
    got = ag.einsum("ij,jk->ik", ag.tensor(ints, device=device), ag.tensor(ints, device=device))
    assert got.dtype == ag.int32 and got.tolist() == (ints @ ints).tolist()
    assert ag.einsum("ii", ag.tensor(ints, device=device)).item() == int(np.trace(ints))
    # a non-contiguous operand (a transposed, strided view)
    big, c = _inputs([(6, 8), (5, 6)], 8)
    got = ag.einsum("ij,jk->ik", ag.tensor(big, device=device).t()[::2],
                    ag.tensor(c, device=device).t())
    np.testing.assert_allclose(got.numpy(), big.T[::2] @ c.T, rtol=1e-5, atol=1e-5)


ERRORS = [
    ("ij,jk", [(2, 3)], "fewer operands were provided"),
    ("ij", [(2, 3), (3, 4)], "more operands were provided"),
    ("ij,jk->ik", [(2, 3), (2, 3)], "subscript j has size 2 for operand 1 which does not "
                                    "broadcast with previously seen size 3"),
    ("i1,jk", [(2, 3), (3, 4)], "invalid subscript given at index 1"),
    ("ij.,jk", [(2, 3), (3, 4)], "found '.' for operand 0 that is not part of any ellipsis"),
    ("...i...j", [(2, 3)], "for which an ellipsis was already found"),
    ("ijk,jk", [(2, 3), (3, 4)], r"the number of subscripts in the equation \(3\) does not "
                                 r"match the number of dimensions \(2\) for operand 0"),
    ("...ijk", [(2, 3)], r"is more than the number of dimensions \(2\) for operand 0"),
    ("ij,jk->ii", [(2, 3), (3, 4)], "output subscript i appears more than once"),
    ("ij,jk->iz", [(2, 3), (3, 4)], "output subscript z does not appear in the equation"),
    ("ii", [(2, 3)], "subscript i is repeated for operand 0 but the sizes don't match, 3 != 2"),
    ("ij->i.", [(2, 3)], "found '.' for output that is not part of any ellipsis"),
    ("...i,...i", [(2, 3), (4, 3)], "dimension 0 covered by ellipsis in operand 1"),
]


@pytest.mark.parametrize("equation,shapes,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_as_torch(equation: str, shapes: list[tuple[int, ...]], message: str) -> None:
    arrays = _inputs(shapes, 1)
    with pytest.raises(RuntimeError, match=message):
        torch.einsum(equation, *[torch.tensor(a) for a in arrays])
    with pytest.raises(RuntimeError, match=message):
        ag.einsum(equation, *[ag.tensor(a) for a in arrays])


def test_no_operands() -> None:
    with pytest.raises(ValueError, match="must specify the equation string"):
        ag.einsum("ij")
    with pytest.raises(ValueError, match="must specify the equation string"):
        ag.einsum()
