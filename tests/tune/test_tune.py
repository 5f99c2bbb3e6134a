"""The autotuner: every configuration it may pick computes the right result, the winner lands
on disk and is used again without timing, a damaged record is tuned anew, and ``anygpu tune``
reports what it did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

import anygpu as ag
from anygpu import config, tune
from anygpu.cli.main import main
from anygpu.codegen import lower
from anygpu.codegen.render.cstyle import render
from anygpu.codegen.render.wgsl import launch_groups
from anygpu.graph import schedule as sched
from anygpu.nn import functional as F
from anygpu.nn.convolution import unfold2d
from anygpu.runtime.registry import get_device


@pytest.fixture(name="cache")
def cache_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache directory, and no winners remembered from earlier tests."""
    monkeypatch.setenv("ANYGPU_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_memory", {})
    monkeypatch.setattr(tune, "records", [])
    monkeypatch.setattr(sched, "_compiled", {})
    config.reload()
    yield tmp_path
    monkeypatch.undo()
    config.reload()


def _gpu(device: str) -> None:
    if get_device(device).dialect == "c":
        pytest.skip("the processor's products go through BLAS: nothing to tune")


def _rand(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _every_candidate(out: ag.Tensor, want: np.ndarray, level: int, rtol: float,
                     which: Callable[[Any], bool] | None = None) -> int:
    """Run the last kernel of ``out`` in each configuration the tuner may time at ``level``
    (those ``which`` takes, where given) and compare each result with ``want``; the number of
    configurations."""
    items = sched.schedule([out.lazy])
    sched.run(items[:-1])  # the inputs of the product
    item = items[-1]
    assert isinstance(item, sched.KernelItem)
    dev = get_device(out.device)
    features = {"cc": dev.info.extra.get("cc", (0, 0)),
                "tf32": ag.get_float32_matmul_precision() != "highest",
                "max_shared": dev.info.extra.get("max_shared", 48 * 1024),
                "local_memory": dev.info.local_memory}
    options = lower.template_options(item.ast, dev.dialect, dev.info.max_local_size, features,
                                     level)
    options = [o for o in options if which is None or which(o)]
    assert options, "no template configuration for a product this large"
    buffers = [sched.alloc_for(dev, out.numel(), out.dtype)] + \
        [inp.buffer for inp in item.ast.inputs]
    scale = float(np.abs(want).max())
    for opts in options:
        kernel = lower.to_ir(item.ast, dev.dialect, dev.info.max_local_size, features, opts)
        program = dev.program(render(kernel, dev.dialect), kernel.name)
        groups = launch_groups(kernel.groups) if dev.dialect == "wgsl" else (kernel.groups,)
        program(buffers, groups, (kernel.local,))
        got = sched.buffer_to_host(buffers[0], dev, out.numel(), out.dtype).reshape(want.shape)
        err = float(np.abs(got.astype(np.float64) - want).max())
        assert err <= rtol * scale, f"{opts.describe()}: error {err:.3g} of {scale:.3g}"
    return len(options)


@pytest.mark.parametrize("m,k,n", [(150, 70, 230), (128, 64, 256)])  # the latter unguarded
def test_every_configuration_is_correct_matmul(device: str, m: int, k: int, n: int) -> None:
    _gpu(device)
    a, b = _rand((m, k), 1), _rand((k, n), 2)
    x, y = ag.tensor(a, device=device), ag.tensor(b, device=device)
    level = 2 if device.startswith("cuda") else 1  # level 2 is many compiles on slow compilers
    assert _every_candidate(x.T.contiguous().T @ y, a @ b, level, 1e-4) >= 2


def test_every_configuration_is_correct_few_rows(device: str) -> None:
    """A linear layer of 16 rows (its weights read along k): the few-row tile with longer
    k-steps and more groups an SM, those the device's local memory holds."""
    _gpu(device)
    a, w = _rand((16, 512), 1), _rand((1024, 512), 2)
    out = F.linear(ag.tensor(a, device=device), ag.tensor(w, device=device))
    few = lambda o: min(o.block_m, o.block_n) == 16  # noqa: E731
    assert _every_candidate(out, a @ w.T, 1, 1e-4, few) >= 3


def test_every_configuration_is_correct_conv(device: str) -> None:
    _gpu(device)
    x_h, w_h = _rand((2, 8, 19, 17), 3), _rand((40, 8, 3, 3), 4)
    out = F.conv2d(ag.tensor(x_h, device=device), ag.tensor(w_h, device=device), padding=1)
    want = torch.nn.functional.conv2d(torch.from_numpy(x_h), torch.from_numpy(w_h), padding=1)
    _every_candidate(out, want.numpy().astype(np.float64), 1, 1e-4)


def test_windows_staged_either_way_are_correct(device: str) -> None:
    """A 3x3 convolution's windows run in memory along the filter's row and the image's: the
    tuner's level 2 stages them along each (the forward's windows, then the weight gradient's,
    whose product sums over the pixels)."""
    _gpu(device)
    x_h, w_h = _rand((2, 8, 19, 17), 5), _rand((40, 8, 3, 3), 6)
    g_h = _rand((2, 40, 19, 17), 7)
    flipped = lambda o: bool(o.x_along or o.y_along)  # noqa: E731
    x = ag.tensor(x_h, device=device)
    out = F.conv2d(x, ag.tensor(w_h, device=device), padding=1)
    want = torch.nn.functional.conv2d(torch.from_numpy(x_h), torch.from_numpy(w_h), padding=1)
    assert _every_candidate(out, want.numpy().astype(np.float64), 2, 1e-4, flipped) >= 4
    # the weight gradient as the windows' product with the output's gradient
    win = unfold2d(x.pad([1, 1, 1, 1]), (3, 3), (1, 1), (1, 1))  # N C H W KH KW
    grad = ag.tensor(g_h, device=device)
    dw = (grad.reshape(2, 40, 1, 19, 17, 1, 1) * win.unsqueeze(1)).sum((0, 3, 4))
    xt = torch.from_numpy(x_h).requires_grad_()
    wt = torch.from_numpy(w_h).requires_grad_()
    torch.nn.functional.conv2d(xt, wt, padding=1).backward(torch.from_numpy(g_h))
    assert wt.grad is not None
    assert _every_candidate(dw, wt.grad.numpy().astype(np.float64), 2, 1e-4, flipped) >= 4


@pytest.mark.parametrize("dtype", [ag.float16, ag.bfloat16, "tf32"])
def test_every_tensor_core_configuration_is_correct(dtype: object) -> None:
    """On GPUs with tensor cores: each tile shape, warp layout, k-step and pipeline depth."""
    try:
        dev = get_device("cuda")
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"no cuda device: {err}")
    if dev.info.extra.get("cc", (0, 0)) < (8, 0):
        pytest.skip("no tensor cores")
    a, b = _rand((300, 200), 5), _rand((200, 260), 6)
    stored = ag.float32 if dtype == "tf32" else dtype
    x, y = ag.tensor(a, device="cuda", dtype=stored), ag.tensor(b, device="cuda", dtype=stored)
    want = x.float().numpy().astype(np.float64) @ y.float().numpy().astype(np.float64)
    ag.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
    try:
        # rows along k and rows along m (a transposed view read in place)
        assert _every_candidate(x @ y, want, 2, 2e-2) >= 8
        _every_candidate(x.T.contiguous().T @ y, want, 2, 2e-2)
    finally:
        ag.set_float32_matmul_precision("highest")


def test_winner_is_stored_and_reused(device: str, cache: Path, monkeypatch) -> None:
    _gpu(device)
    a, b = _rand((96, 136), 7), _rand((136, 112), 8)
    monkeypatch.setenv("ANYGPU_TUNE", "1")
    config.reload()
    out = (ag.tensor(a, device=device) @ ag.tensor(b, device=device)).relu()
    np.testing.assert_allclose(out.numpy(), np.maximum(a @ b, 0), rtol=1e-4, atol=1e-4)
    assert len(tune.records) == 1
    record = tune.records[0]
    assert record.configurations >= 2 and record.best_s <= record.default_s
    files = list((cache / "tuning").rglob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["best"] == record.best

    # a new process (nothing in memory) with tuning off: the winner from disk, nothing timed;
    # the same product under another epilogue shares it
    monkeypatch.setattr(tune, "_memory", {})
    monkeypatch.setattr(sched, "_compiled", {})
    monkeypatch.setenv("ANYGPU_TUNE", "0")
    config.reload()
    out = ag.tensor(a, device=device) @ ag.tensor(b, device=device) * 2.0
    items = sched.schedule([out.lazy])
    launch = sched.prepare(items[-1])
    assert launch.template == f"gemm {record.best}"
    np.testing.assert_allclose(out.numpy(), 2 * (a @ b), rtol=1e-4, atol=1e-4)
    assert len(tune.records) == 1


def test_damaged_record_is_tuned_again(device: str, cache: Path, monkeypatch) -> None:
    _gpu(device)
    a, b = _rand((72, 100), 9), _rand((100, 88), 10)
    monkeypatch.setenv("ANYGPU_TUNE", "1")
    config.reload()
    (ag.tensor(a, device=device) @ ag.tensor(b, device=device)).numpy()
    (path,) = list((cache / "tuning").rglob("*.json"))
    path.write_text("{not json")
    monkeypatch.setattr(tune, "_memory", {})
    monkeypatch.setattr(sched, "_compiled", {})
    out = ag.tensor(a, device=device) @ ag.tensor(b, device=device)
    np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-4, atol=1e-4)
    assert len(tune.records) == 2
    assert json.loads(path.read_text())["configurations"] >= 1


def test_tuning_off_times_nothing(device: str, cache: Path) -> None:
    _gpu(device)
    a, b = _rand((80, 90), 11), _rand((90, 100), 12)
    out = ag.tensor(a, device=device) @ ag.tensor(b, device=device)
    np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-4, atol=1e-4)
    assert tune.records == [] and not (cache / "tuning").exists()


def test_cli_tunes_targets(device: str, cache: Path, capsys) -> None:
    _gpu(device)
    assert main(["tune", "--device", device, "matmul:64x72x96", "conv:4,8,3,1,12",
                 "--batch", "2"]) == 0
    text = capsys.readouterr().out
    assert "2/2 conv 4->8 3x3 s1 @12" in text
    assert f"tuned {len(tune.records)} kernels of 2 target(s)" in text
    assert len(tune.records) >= 3  # the product's three kernels at least


def test_cli_names_a_bad_target(capsys) -> None:
    assert main(["tune", "--device", "cpu", "matmul:12x3"]) == 2
    assert "'matmul:12x3': expected 3 positive integers" in capsys.readouterr().err
    assert main(["tune", "--device", "cpu", "missing.py"]) == 2
    assert "'missing.py': no such file" in capsys.readouterr().err
    assert main(["tune", "--device", "cpu", "matmul:12x3x4"]) == 0
    assert "nothing to tune" in capsys.readouterr().out
