"""Shared timing helpers for the bench scripts: medians of wall time, reference measured in the same run."""
from __future__ import annotations

import statistics
import subprocess
import time


def wall(argv: list[str], n: int = 20, **kw) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, **kw)
        times.append(time.perf_counter() - t)
    return times


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000
