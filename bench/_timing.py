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


def quantile(v: list[float], q: float) -> float:
    """The sample at fraction q of the sorted values (nearest rank): p10, p90, p99 of a bench's runs."""
    s = sorted(v)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000


def report(res: dict, lines: list[str], as_json: bool) -> int:
    """Print the result (JSON, or the human lines) and return the exit code: 0 when every target was met."""
    import json

    print(json.dumps(res) if as_json else "\n".join(lines))
    return 0 if res["ok"] else 1
