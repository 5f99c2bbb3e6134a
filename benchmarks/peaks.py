"""A GPU's peak arithmetic rate, to print achieved TFLOP/s beside it: streaming multiprocessors x
the clock the driver reports (its highest) x what one multiprocessor does per clock, per
compute capability (dense, float32 accumulation, from NVIDIA's architecture whitepapers). The
driver's highest clock is above the one NVIDIA's datasheets quote tensor-core peaks at (an H100
SXM: 1.98 GHz, 989 TFLOP/s float16 quoted at 1.83 GHz), so these peaks are upper bounds."""

from __future__ import annotations

# compute capability -> FLOP per clock per multiprocessor: float32 (SIMT), tf32, float16/bfloat16
_PER_SM_CLOCK = {
    (8, 0): {"float32": 128, "tf32": 1024, "float16": 2048, "bfloat16": 2048},
    (8, 6): {"float32": 256, "tf32": 512, "float16": 1024, "bfloat16": 1024},
    (8, 9): {"float32": 256, "tf32": 512, "float16": 1024, "bfloat16": 1024},
    (9, 0): {"float32": 256, "tf32": 2048, "float16": 4096, "bfloat16": 4096},
}


def peak_tflops(precision: str) -> float | None:
    """The peak of the machine's first CUDA GPU for ``precision`` ("float32", "tf32",
    "float16", "bfloat16"), or None where it is not known (no CUDA device, another
    architecture). OpenCL and WebGPU run on that same GPU here."""
    try:
        from anygpu.runtime.registry import get_device

        info = get_device("cuda").info
    except Exception:  # noqa: BLE001 (no CUDA driver: no peak to print)
        return None
    rate = _PER_SM_CLOCK.get(info.extra.get("cc", (0, 0)), {}).get(precision)
    clock = info.extra.get("clock_khz", 0)
    if rate is None or not clock:
        return None
    return info.compute_units * clock * 1e3 * rate / 1e12
