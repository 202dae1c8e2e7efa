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


def paired_diff_ci(a: list[float], b: list[float], seed: int, reps: int = 2000) -> tuple[float, float, float]:
    """(median, 95% bootstrap interval) of the per-round differences a[i] - b[i]: each round ran both cases once, in
    a shuffled order, so a round's pair shares that moment's host state (the noise a difference of medians keeps)."""
    import random

    d = [x - y for x, y in zip(a, b)]
    rng = random.Random(seed)
    return (statistics.median(d), *interval95([statistics.median(rng.choices(d, k=len(d))) for _ in range(reps)]))


def interval95(replicates: list[float]) -> tuple[float, float]:
    """The 2.5% and 97.5% points of a bootstrap's replicates."""
    s = sorted(replicates)
    return s[int(len(s) * 0.025)], s[int(len(s) * 0.975) - 1]


def revision_tree(repo, rev: str, work):
    """`rev` of the checkout at `repo`, unpacked under `work` (git archive): the other side of a same-run comparison."""
    d = work / f"tree-{rev}"
    d.mkdir()
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(d)], input=archive, check=True)
    return d


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000


def report(res: dict, lines: list[str], as_json: bool) -> int:
    """Print the result (JSON, or the human lines) and return the exit code: 0 when every target was met."""
    import json

    print(json.dumps(res) if as_json else "\n".join(lines))
    return 0 if res["ok"] else 1


def bundle_dir() -> str | None:
    """Where the start benchmarks keep their bundles: a tmpfs, as engines keep theirs (containerd's
    /run/containerd/io.containerd.runtime.v2.task/…, /run being a tmpfs on a real host). On ext4 the rename that
    replaces an edited config.json (fsutil.write_file) starts the new file's writeback first (auto_da_alloc): 0.2-1 ms
    here that no engine's bundle pays, and the limit, whose config is written before timing, never pays. None: the
    default temporary directory (no tmpfs found)."""
    import os

    for d in ("/run", "/dev/shm"):
        try:
            with open("/proc/self/mounts") as fh:
                if any(line.split()[1] == d and line.split()[2] == "tmpfs" for line in fh):
                    if os.access(d, os.W_OK):
                        return d
        except OSError:
            return None
    return None
