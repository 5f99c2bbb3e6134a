"""Timing shared by the benchmarks: launches queued back to back, the median of several rounds."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def median_time(fn: Callable[[], Any], sync: Callable[[], None], reps: int,
                rounds: int = 5) -> float:
    """Seconds per call of ``fn``: one warm-up call, then ``rounds`` rounds of ``reps`` calls
    between two synchronizations; the median round."""
    fn()
    sync()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)
