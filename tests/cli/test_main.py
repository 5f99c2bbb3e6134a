"""The `anygpu` command: the demo trains to high accuracy on the cpu, devices lists backends."""

from __future__ import annotations

import types

import pytest

from anygpu import config
from anygpu.cli.main import main


def test_demo_reaches_95_percent(capsys: pytest.CaptureFixture[str]) -> None:
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


def test_devices_says_why_an_opengl_adapter_is_not_used(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where wgpu finds only its OpenGL fallback, `devices` names it and how to opt in."""
    from anygpu.runtime import webgpu

    info = {"device": "llvmpipe (LLVM 15.0.6, 256 bits)", "backend_type": "OpenGL",
            "adapter_type": "CPU"}
    found = [types.SimpleNamespace(info=info)]
    fake_gpu = types.SimpleNamespace(enumerate_adapters_sync=lambda: found)
    monkeypatch.setattr(webgpu, "wgpu", types.SimpleNamespace(gpu=fake_gpu))
    monkeypatch.delenv("ANYGPU_WEBGPU_OPENGL", raising=False)
    config.reload()
    webgpu._adapter.cache_clear()
    try:
        assert main(["devices", "--no-test"]) == 0
    finally:
        monkeypatch.undo()
        config.reload()
        webgpu._adapter.cache_clear()
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("webgpu "))
    assert "unavailable" in line and "llvmpipe (LLVM 15.0.6, 256 bits) (OpenGL)" in line
    assert "ANYGPU_WEBGPU_OPENGL=1" in line and "mesa-vulkan-drivers" in line


def test_demo_prefers_a_real_gpu_to_the_processor() -> None:
    """OpenCL or Vulkan running on the processor (PoCL, lavapipe) is not picked over `cpu`."""
    from anygpu.cli.demo import best_device
    from anygpu.runtime.registry import get_device

    chosen = get_device(best_device())
    assert chosen.backend == "cpu" or not chosen.info.is_cpu
