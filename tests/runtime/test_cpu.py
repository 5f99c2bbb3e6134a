"""The cpu runtime: kernels compiled together into shared libraries, their cache notes, and the
fallback when a library has gone from the cache."""

from __future__ import annotations

import numpy as np
import pytest

from anygpu.runtime import cpu
from anygpu.runtime.base import SHARED_MARK

SCALE = """#include <math.h>
void scale(float* restrict out, const float* restrict a) {
  for (int i = 0; i < 64; i++) out[i] = a[i] * FACTOR;
}
"""


# every test compiles into its own program cache (conftest.py), never the user's
pytestmark = pytest.mark.usefixtures("cache_dir")


def _kernels(count: int) -> list[tuple[str, str]]:
    # the same kernel name with different bodies, as a graph's kernels often have
    return [(SCALE.replace("FACTOR", f"{k + 2}.0f"), "scale") for k in range(count)]


def _run(dev: cpu.CPUDevice, source: str, name: str, a: np.ndarray) -> np.ndarray:
    out, inp = dev.alloc(a.nbytes), dev.alloc(a.nbytes)
    inp.copy_in(a)
    dev.program(source, name)([out, inp])
    return out.copy_out(np.empty_like(a))


def test_prebuilt_kernels_share_libraries_and_compute_their_own_results(cache_dir, monkeypatch):
    dev = cpu.CPUDevice()
    # more kernels than twice the compile threads (at most 8), so that libraries share kernels
    # on a machine of any number of cores
    kernels = _kernels(17)
    dev.prebuild(kernels)
    folder = cache_dir / "programs" / "cpu"
    libraries = sorted(folder.glob("*.lib"))
    assert 1 <= len(libraries) < len(kernels)
    notes = [p for p in folder.iterdir() if p.suffix != ".lib"]
    assert len(notes) == len(kernels)
    assert all(p.read_bytes().startswith(SHARED_MARK) for p in notes)

    calls: list[object] = []  # loading must not compile anything
    monkeypatch.setattr(dev, "compile", lambda *args: calls.append(args))
    a = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    for k, (source, name) in enumerate(kernels):
        np.testing.assert_array_equal(_run(dev, source, name, a), a * np.float32(k + 2))
    assert calls == []


def test_a_deleted_library_is_compiled_again(cache_dir):
    dev = cpu.CPUDevice()
    kernels = _kernels(3)
    dev.prebuild(kernels)
    for lib in (cache_dir / "programs" / "cpu").glob("*.lib"):
        lib.unlink()
    a = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    source, name = kernels[2]
    np.testing.assert_array_equal(_run(cpu.CPUDevice(), source, name, a), a * np.float32(4))


def test_a_kernel_that_does_not_compile_reports_its_error(cache_dir):
    dev = cpu.CPUDevice()
    bad = ("void broken(float* restrict out) { out[0] = undefined_name; }", "broken")
    dev.prebuild([*_kernels(2), bad])  # the library fails; nothing is cached for the batch
    with pytest.raises(cpu.DeviceError, match="undefined_name"):
        dev.program(*bad)
    a = np.random.default_rng(2).standard_normal(64).astype(np.float32)
    source, name = _kernels(2)[1]
    np.testing.assert_array_equal(_run(dev, source, name, a), a * np.float32(3))


def test_a_product_in_the_outputs_transposed_order_needs_no_transposing_copy(monkeypatch) -> None:
    """A 1x1 convolution's product runs M (pixels) by N (channels) while its output runs
    channels by pixels: BLAS computes y.T @ x.T, which comes out in the output's order, so no
    transposed copy of the product is made before the epilogue. Checked against NumPy."""
    import anygpu as ag
    from anygpu.nn import functional as F

    rng = np.random.default_rng(7)
    xs, ws = rng.standard_normal((1, 64, 40, 40), np.float32), \
        rng.standard_normal((128, 64, 1, 1), np.float32)
    copies: list[tuple[int, ...]] = []
    contiguous = np.ascontiguousarray

    def spy(a, *args, **kwargs):  # noqa: ANN001, ANN202
        if not a.flags.c_contiguous:
            copies.append(a.shape)
        return contiguous(a, *args, **kwargs)

    monkeypatch.setattr(cpu.np, "ascontiguousarray", spy)
    out = F.conv2d(ag.tensor(xs), ag.tensor(ws)).relu().numpy()
    assert copies == []
    want = np.maximum(np.einsum("oc,chw->ohw", ws[:, :, 0, 0], xs[0]), 0)[None]
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.fixture
def blas_calls(monkeypatch) -> list[str]:  # noqa: ANN001
    """The names of the contractions that go through BLAS from here on, in order."""
    calls: list[str] = []
    call = cpu.HostContraction.__call__

    def spy(self, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(self.name)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(cpu.HostContraction, "__call__", spy)
    return calls


def test_both_products_of_a_residual_sum_of_convolutions_go_through_blas(
        blas_calls: list[str]) -> None:
    """ResNet's block end: relu(conv1x1(a) + conv1x1(b)). Each product is one BLAS call (not a
    stage of a compiled reduction, which ran ResNet-50's at under 1 GFLOP/s). Checked against
    NumPy."""
    import anygpu as ag
    from anygpu.nn import functional as F

    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((1, 64, 56, 56), np.float32), \
        rng.standard_normal((1, 128, 56, 56), np.float32)
    wa, wb = rng.standard_normal((256, 64, 1, 1), np.float32), \
        rng.standard_normal((256, 128, 1, 1), np.float32)
    out = (F.conv2d(ag.tensor(a).relu(), ag.tensor(wa)) +
           F.conv2d(ag.tensor(b).relu(), ag.tensor(wb))).relu().numpy()
    assert len(blas_calls) == 2
    want = np.maximum(np.einsum("oc,chw->ohw", wa[:, :, 0, 0], np.maximum(a[0], 0)) +
                      np.einsum("oc,chw->ohw", wb[:, :, 0, 0], np.maximum(b[0], 0)), 0)[None]
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_a_pooled_input_two_convolutions_read_is_pooled_once(blas_calls: list[str]) -> None:
    """ResNet's stem: max pooling feeds the first block's 1x1 convolution and its downsampling
    one. It is computed once and both products go through BLAS (a copy of it for each had
    computed the pooling twice). Against PyTorch."""
    import torch

    import anygpu as ag
    from anygpu.graph.schedule import KernelItem, schedule
    from anygpu.nn import functional as F

    rng = np.random.default_rng(9)
    xs = rng.standard_normal((2, 64, 128, 128), np.float32)
    w1s, w2s = rng.standard_normal((64, 64, 1, 1), np.float32), \
        rng.standard_normal((256, 64, 1, 1), np.float32)
    pooled = F.max_pool2d(ag.tensor(xs).relu(), 3, 2, 1)
    outs = [F.conv2d(pooled, ag.tensor(w1s)), F.conv2d(pooled, ag.tensor(w2s))]
    items = [i for i in schedule([o.lazy for o in outs]) if isinstance(i, KernelItem)]
    assert sum(any(red and size == 9 for _, size, red in i.ast.dims) for i in items) == 1
    got = [o.numpy() for o in outs]
    assert len(blas_calls) == 2
    tp = torch.nn.functional.max_pool2d(torch.from_numpy(xs).relu(), 3, 2, 1)
    for g, w in zip(got, (w1s, w2s)):
        want = torch.nn.functional.conv2d(tp, torch.from_numpy(w)).numpy()
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_max_pooling_of_a_computed_input_stores_its_padding() -> None:
    """ResNet's stem pools its convolution's bias and ReLU over windows that reach into the
    padding: the padded input is stored by a kernel of its own, so the pooling's loops read
    plain memory (with the padding in its windows the bounds were checked for every element
    of every window, 3x slower). NaN and -inf in the input propagate as PyTorch's do."""
    import torch

    import anygpu as ag
    from anygpu.graph.schedule import KernelItem, schedule
    from anygpu.nn import functional as F

    rng = np.random.default_rng(10)
    xs = rng.standard_normal((2, 16, 64, 64), np.float32)
    xs[0, 1, 0, 0], xs[1, 2, 5, 7] = np.nan, -np.inf
    bs = rng.standard_normal(16, np.float32)
    out = F.max_pool2d((ag.tensor(xs) + ag.tensor(bs).reshape(1, 16, 1, 1)).relu(), 3, 2, 1)
    items = [i for i in schedule([out.lazy]) if isinstance(i, KernelItem)]
    pooling = [i for i in items if any(red and size == 9 for _, size, red in i.ast.dims)]
    assert len(items) == 2 and len(pooling) == 1 and len(pooling[0].ast.inputs) == 1
    assert items[0].ast.output.shape[-2:] in ((65, 65), (66, 66))  # the padded input
    want = torch.nn.functional.max_pool2d(
        (torch.from_numpy(xs) + torch.from_numpy(bs).reshape(1, 16, 1, 1)).relu(), 3, 2, 1)
    np.testing.assert_array_equal(out.numpy(), want.numpy())


def test_every_product_of_attention_goes_through_blas(blas_calls: list[str]) -> None:
    """BERT's self-attention over 128 tokens of 12 heads: the query, key and value projections
    (bias added), each head's scores and weighted values, and the output projection, which reads
    the heads' output with its head and feature axes swapped (written out in order first): six
    BLAS calls. The heads' products and the output projection had run as compiled reductions
    at 2.5 GFLOP/s (61 ms of BERT-base's 123-token call). Against PyTorch."""
    import torch

    import anygpu as ag

    rng = np.random.default_rng(11)
    xs = rng.standard_normal((1, 128, 768), np.float32)
    ws = [(rng.standard_normal((768, 768)) * 0.03).astype(np.float32) for _ in range(4)]
    bs = [rng.standard_normal(768).astype(np.float32) for _ in range(4)]

    def attention(x, w, b):  # noqa: ANN001, ANN202
        def heads(y):  # noqa: ANN001, ANN202
            return y.reshape(1, 128, 12, 64).permute(0, 2, 1, 3)

        q, k, v = (heads(x @ w[i] + b[i]) for i in range(3))
        scores = (q @ k.permute(0, 1, 3, 2) * 0.125).softmax(-1)
        a = (scores @ v).permute(0, 2, 1, 3).reshape(1, 128, 768)
        return a @ w[3] + b[3]

    got = attention(ag.tensor(xs), [ag.tensor(w) for w in ws], [ag.tensor(b) for b in bs]).numpy()
    assert len(blas_calls) == 6, blas_calls
    want = attention(torch.from_numpy(xs), [torch.from_numpy(w) for w in ws],
                     [torch.from_numpy(b) for b in bs]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_a_linear_layer_on_more_computed_rows_than_weights_goes_through_blas(
        blas_calls: list[str]) -> None:
    """Query, key and value projections of embeddings (gathered rows and positions, then a
    LayerNorm) at 8 x 128 tokens: the computed activations outnumber the 256 x 256 weights and
    are stored for BLAS (they had been summed as a compiled reduction that computed the norm
    again for every output: BERT-base at 8 x 128 tokens took 14 s a call). Against PyTorch."""
    import torch

    import anygpu as ag

    rng = np.random.default_rng(12)
    table = rng.standard_normal((500, 256)).astype(np.float32)
    positions = rng.standard_normal((128, 256)).astype(np.float32)
    ids = rng.integers(0, 500, (8, 128))
    ws = [(rng.standard_normal((256, 256)) * 0.05).astype(np.float32) for _ in range(3)]

    def projections(lib, table, positions, ids, ws):  # noqa: ANN001, ANN202
        x = lib.nn.functional.layer_norm(table[ids] + positions, (256,), eps=1e-12)
        return lib.stack([x @ w for w in ws])

    got = projections(ag, ag.tensor(table), ag.tensor(positions), ag.tensor(ids),
                      [ag.tensor(w) for w in ws]).numpy()
    assert len(blas_calls) == 3, blas_calls
    want = projections(torch, torch.from_numpy(table), torch.from_numpy(positions),
                       torch.from_numpy(ids), [torch.from_numpy(w) for w in ws]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_a_mask_broadcast_over_heads_is_computed_once() -> None:
    """An attention mask from a padding mask (a gather of int64 positions, a comparison)
    added to every head's scores before softmax: computed once into a buffer of its own, not
    again for each head in each of softmax's three passes. Against PyTorch."""
    import torch

    import anygpu as ag
    from anygpu.graph import schedule

    rng = np.random.default_rng(13)
    scores = rng.standard_normal((2, 12, 32, 32)).astype(np.float32)
    keep = rng.integers(0, 2, (2, 32)).astype(np.int64)
    keep[:, 0] = 1
    order = rng.permutation(32).astype(np.int64)

    def masked_softmax(lib, scores, keep, order):  # noqa: ANN001, ANN202
        mask = (keep[:, order] != 0)[:, None, None, :]
        return (scores + lib.where(mask, 0.0, -10000.0)).softmax(-1)

    out = masked_softmax(ag, ag.tensor(scores), ag.tensor(keep), ag.tensor(order))
    items = [i for i in schedule.schedule([out.lazy]) if isinstance(i, schedule.KernelItem)]
    got = out.numpy()
    # the mask's own kernel, then softmax reading it as a buffer
    assert len(items) == 2, [i.ast.output.shape for i in items]
    assert all(n.dtype.is_float for n in items[-1].ast.inputs)
    want = masked_softmax(torch, torch.from_numpy(scores), torch.from_numpy(keep),
                          torch.from_numpy(order)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
