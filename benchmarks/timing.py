"""Timing shared by the CPU micro-benchmarks (run as scripts from this folder)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``runs`` calls, in milliseconds, after ``warmup``
    untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3
