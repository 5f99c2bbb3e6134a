"""The `anygpu` command: the demo trains to high accuracy on the cpu, devices lists backends."""

from __future__ import annotations

import pytest

from anygpu.cli.main import main


def test_demo_reaches_95_percent(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sklearn")
    assert main(["demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("test accuracy"))
    assert float(line.split()[-1]) >= 0.95
    assert "images/s" in out and "cpu:0" in out


def test_devices_lists_every_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices", "--no-test"]) == 0
    out = capsys.readouterr().out
    for backend in ("cpu", "opencl", "cuda", "webgpu", "hip"):
        assert backend in out
    assert "cpu:0" in out


def test_demo_prefers_a_real_gpu_to_the_processor() -> None:
    """OpenCL or Vulkan running on the processor (PoCL, lavapipe) is not picked over `cpu`."""
    from anygpu.cli.demo import best_device
    from anygpu.runtime.registry import get_device

    chosen = get_device(best_device())
    assert chosen.backend == "cpu" or not chosen.info.is_cpu
