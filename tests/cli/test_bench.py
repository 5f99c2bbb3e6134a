"""``anygpu bench``: the seed benchmark's small configuration (batch 2, 64x64, two steps) of
every model as a smoke test, its JSON rows, and the profiler's Chrome trace of the steps."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from anygpu.cli import bench


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


# every model on every device but WebGPU's (the seed benchmark's smoke test): on a processor's
# OpenCL (PoCL) the five cold steps compile and run in about six minutes of processor time
# (AlexNet 36 s, VGG-16 86, ResNet-50 111, MobileNetV2 131; ResNet-18's beside)


@pytest.mark.parametrize("model", bench.MODELS)
def test_small_training_step_of_every_model(device: str, model: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    if device.startswith("webgpu"):
        pytest.skip("the smoke test runs on cpu, opencl and GPUs (webgpu: the model tests)")
    code = bench.main(_args("train", "--model", model, "--batch", "2", "--size", "64",
                            "--steps", "2", "--device", device, "--json"))
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    assert len(rows) == 1
    row = rows[0]
    assert (row["framework"], row["mode"], row["model"], row["batch"], row["size"]) == \
        ("anygpu", "train", model, 2, 64)
    assert row["device"].startswith(device.split(":")[0]) and row["jit"]
    assert 0 < row["ms"] and row["first_step_s"] > 0
    assert row["images_per_s"] == pytest.approx(2 / row["ms"] * 1e3)
    assert row["peak_mib"] > 0  # the weights and Adam's state at the least


def test_profile_writes_a_chrome_trace(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    trace_path = tmp_path / "trace.json"
    code = bench.main(_args("infer", "--model", "resnet18", "--batch", "2", "--size", "64",
                            "--steps", "1", "--device", "cpu", "--no-jit", "--profile",
                            str(trace_path)))
    assert code == 0
    out = capsys.readouterr().out
    launches = int(re.search(r"(\d+) kernel launches", out).group(1))  # type: ignore[union-attr]
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    # one complete event per launch, with the fields Perfetto needs
    assert len(kernels) == launches > 0
    for e in kernels:
        assert e["ph"] == "X" and e["name"] and e["dur"] >= 0 and e["ts"] >= 0
        assert "pid" in e and "tid" in e


def test_without_jit_the_host_time_per_kernel_is_reported(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = bench.main(_args("train", "--model", "resnet18", "--batch", "2", "--size", "32",
                            "--steps", "2", "--device", "cpu", "--no-jit", "--json"))
    assert code == 0
    row = json.loads(next(line for line in capsys.readouterr().out.splitlines()
                          if line.startswith("{")))
    assert not row["jit"] and row["kernels"] > 100  # ResNet-18's forward, backward and Adam
    # less than the whole step per kernel (measured over other steps: twice, for noise)
    assert 0 < row["host_us_per_kernel"] < 2 * row["ms"] * 1e3 / row["kernels"]
    table = bench.format_table([bench.Row(**row)])
    assert f"resnet18 {row['host_us_per_kernel']:.0f} us ({row['kernels']} kernels" in table


def test_compare_runs_pytorch_eager_and_compiled_beside(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    import sys
    import types

    # a stand-in for torchvision's model (not installed with the tests): the rows' plumbing
    # is what is checked here, the models' equality in tests/models
    def resnet18(weights: object = None) -> object:
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                   torch.nn.Linear(8, 1000))

    monkeypatch.setitem(sys.modules, "torchvision",
                        types.SimpleNamespace(models=types.SimpleNamespace(resnet18=resnet18)))
    code = bench.main(_args("infer", "--model", "resnet18", "--batch", "2", "--size", "32",
                            "--steps", "2", "--device", "cpu", "--compare", "torch",
                            "torch-compile", "--json"))
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    assert [r["framework"] for r in rows] == ["anygpu", "torch", "torch.compile"]
    ours, eager, compiled = rows
    assert ours["ratio"] == pytest.approx(ours["ms"] / eager["ms"])
    assert ours["ratio_compiled"] == pytest.approx(ours["ms"] / compiled["ms"])
    assert all(r["ms"] > 0 and r["first_step_s"] > 0 for r in rows)
    table = bench.format_table([bench.Row(**r) for r in rows])
    assert "/compile" in table and "torch.compile" in table


def _drawn(monkeypatch: pytest.MonkeyPatch) -> list:
    """The figures ``bench.plot`` saves, kept for inspection (they are written all the same)."""
    from matplotlib.figure import Figure

    figures: list = []
    save = Figure.savefig

    def keep(self: Figure, *args: object, **kwargs: object) -> None:
        figures.append(self)
        save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def test_plot_draws_the_rows_of_several_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs' --json output (a training step and an inference pass on the processor), drawn
    as one chart by ``anygpu bench plot``: a panel per mode, a bar per row at its time."""
    pytest.importorskip("matplotlib")
    files = []
    for mode in ("train", "infer"):
        assert bench.main(_args(mode, "--model", "resnet18", "--batch", "2", "--size", "32",
                                "--steps", "1", "--device", "cpu", "--json")) == 0
        path = tmp_path / f"{mode}.json"
        path.write_text(capsys.readouterr().out)
        files.append(str(path))
    figures = _drawn(monkeypatch)
    png = tmp_path / "seed.png"
    assert bench.plot_main(_args("plot", *files, "--plot", str(png))) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = bench.read_rows(files)
    assert [(r.mode, r.framework) for r in rows] == [("train", "anygpu"), ("infer", "anygpu")]
    (fig,) = figures
    heights = [[bar.get_height() for bar in ax.patches] for ax in fig.axes]
    assert heights == [[rows[0].ms], [rows[1].ms]]
    table = capsys.readouterr().out
    assert "train" in table and "infer" in table and f"plot written to {png}" in table


def test_plot_sets_pytorch_beside_each_row(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch eager's and torch.compile's times stand beside the anygpu row of the same model,
    mode, precision, batch and size, whatever its device (opencl against PyTorch on CUDA), with
    the ratio written above anygpu's bar."""
    pytest.importorskip("matplotlib")

    def row(framework: str, device: str, ms: float, ratio: float | None = None,
            model: str = "vgg16", batch: int = 16) -> bench.Row:
        return bench.Row(framework, device, "train", model, "fp32", batch, 224, 5, True, 1.0,
                         ms, batch * 1000 / ms, 100.0, ratio)

    rows = [row("anygpu", "opencl:0", 60.0, 1.5), row("torch", "cuda:0", 40.0),
            row("torch.compile", "cuda:0", 30.0), row("anygpu", "cuda:0", 44.0, 1.1),
            row("anygpu", "cuda:0", 2.0, model="alexnet"),  # no peer: no bars beside it
            row("torch", "cuda:0", 0.5, model="alexnet", batch=2)]  # (another configuration)
    figures = _drawn(monkeypatch)
    bench.plot(rows, str(tmp_path / "rows.png"))
    (fig,) = figures
    (ax,) = fig.axes
    heights = [bar.get_height() for bar in ax.patches]
    assert heights[:3] == [60.0, 44.0, 2.0] and heights[3:5] == [40.0, 40.0] and \
        heights[6:8] == [30.0, 30.0] and np.isnan(heights[5]) and np.isnan(heights[8])
    assert ax.get_yscale() == "log"  # 0.5 to 60 ms: each readable
    assert [t.get_text() for t in ax.texts] == ["1.50x", "1.10x"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == \
        ["anygpu", "PyTorch eager", "torch.compile"]


def test_plot_takes_each_rows_peers_from_its_own_run(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of several files: PyTorch's bar beside an anygpu row is its own run's (the one its
    ratio came from), and an anygpu row that a later run repeats is drawn once, the first."""
    pytest.importorskip("matplotlib")

    def line(framework: str, device: str, ms: float, ratio: float | None = None) -> str:
        return json.dumps(dataclasses.asdict(bench.Row(
            framework, device, "train", "alexnet", "fp32", 16, 224, 5, True, 1.0, ms,
            16000 / ms, 100.0, ratio)))

    runs = [[line("anygpu", "cuda:0", 3.0, 0.75), line("torch", "cuda:0", 4.0)],
            [line("anygpu", "cuda:0", 3.2), line("torch.compile", "cuda:0", 2.5)],
            [line("anygpu", "opencl:0", 5.0, 1.25), line("torch", "cuda:0", 4.4)]]
    files = []
    for i, lines in enumerate(runs):
        files.append(tmp_path / f"run{i}.json")
        files[-1].write_text("\n".join(lines) + "\n")
    figures = _drawn(monkeypatch)
    png = tmp_path / "runs.png"
    assert bench.plot_main(_args("plot", *map(str, files), "--plot", str(png))) == 0
    (fig,) = figures
    (ax,) = fig.axes
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == [3.0, 5.0, 4.0, 4.4, 2.5, 2.5]
    assert [t.get_text() for t in ax.texts] == ["0.75x", "1.25x"]


def test_plot_names_what_it_cannot_read(tmp_path: Path) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text("anygpu infer resnet18 on cpu:0: first step 0.4 s\n")
    with pytest.raises(SystemExit, match="no rows in"):
        bench.read_rows([str(empty)])
    broken = tmp_path / "broken.json"
    broken.write_text('{"framework": "anygpu", "mode": "train"}\n')
    with pytest.raises(SystemExit, match="broken.json, line 1: not a row"):
        bench.read_rows([str(broken)])
    with pytest.raises(SystemExit, match="cannot read"):
        bench.read_rows([str(tmp_path / "missing.json")])
