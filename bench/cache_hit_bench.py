#!/usr/bin/env python3
"""What discovery's cache costs a container start, this checkout against another revision of discover.py.

- the warm cache hit: discover.load_cached on a current cache, the warm editor's case (its parse is memoised, so
  this is the host key: ~4 procfs reads, the MIG listdirs, one stat per watched path, and the cache file's
  open + fstat); timeit, min and median of 7 repeats, per call;
- with --host, on a machine with a driver: the same on the host's own /proc, /dev and driver root, and a refresh
  (a whole discovery: the driver's answers from nvidia-smi included), median of --refreshes, interleaved.

Without --host: the H200 capture's /proc, and two driver roots: the capture's (/usr/local/nvidia, one library
directory) and this machine's / (every candidate library directory that exists here is watched).

Usage: .venv/bin/python bench/cache_hit_bench.py [-n 20000] [--before REV|FILE] [--host [--driver-root /]] [--json]
  --before: a git revision (its provision/inject/discover.py) or a discover.py file, measured in the same rounds.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def load_before(spec: str, work: Path):
    path = Path(spec)
    if not path.is_file():
        path = work / "discover_before.py"
        path.write_bytes(subprocess.run(["git", "-C", str(REPO), "show", f"{spec}:provision/inject/discover.py"],
                                        check=True, capture_output=True).stdout)
    mod_spec = importlib.util.spec_from_file_location("discover_before", path)
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules["discover_before"] = mod  # dataclasses look their module up
    mod_spec.loader.exec_module(mod)
    return mod


def per_call_us(fn, n: int) -> list[float]:
    return [t / n * 1e6 for t in timeit.repeat(fn, number=n, repeat=7)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--before")
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--driver-root", default="/")
    ap.add_argument("--refreshes", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from provision.inject import discover

    work = Path(tempfile.mkdtemp(prefix="gpuprov-cachehit-"))
    sides = {"this": discover}
    if args.before:
        sides["before"] = load_before(args.before, work)
    if args.host:
        cases = {"host": (args.driver_root, "/", "/")}
    else:
        from tests.conftest import H200

        (work / "dev/dev").mkdir(parents=True)
        cases = {"h200_capture": (str(H200 / "usr/local/nvidia"), str(H200), str(work / "dev")),
                 "this_root": ("/", str(H200), str(work / "dev"))}
    res: dict = {}
    for case, (root, proc, dev) in cases.items():
        out: dict = {}
        refresh_s: dict[str, list[float]] = {s: [] for s in sides}
        for i in range(args.refreshes if args.host else 1):  # interleaved, the first side alternating
            for side in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                t = time.perf_counter()
                sides[side].refresh(root, str(work / f"{case}-{side}" / "discovery.json"), proc, dev)
                refresh_s[side].append(time.perf_counter() - t)
        hits: dict[str, list[float]] = {s: [] for s in sides}
        for _ in range(3):
            for side, mod in sides.items():
                cache = str(work / f"{case}-{side}" / "discovery.json")
                assert mod.load_cached(cache, proc) is not None, f"{side}: the cache must hit"
                hits[side] += per_call_us(lambda m=mod, c=cache, p=proc: m.load_cached(c, p), args.n)
        for side, mod in sides.items():
            disc = mod.load_cached(str(work / f"{case}-{side}" / "discovery.json"), proc)
            out[side] = {"hit_min_us": round(min(hits[side]), 1), "hit_median_us": round(statistics.median(hits[side]), 1),
                         "watched_paths": len(getattr(disc, "watch", ())),
                         "gpus": [(g.arch, g.brand) for g in disc.gpus]}
            if args.host:
                out[side]["refresh_median_ms"] = round(statistics.median(refresh_s[side]) * 1000, 1)
                out[side]["refresh_min_ms"] = round(min(refresh_s[side]) * 1000, 1)
        res[case] = out
    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(res))
    else:
        for case, out in res.items():
            for side, r in out.items():
                extra = f", refresh {r['refresh_median_ms']} ms (min {r['refresh_min_ms']})" if args.host else ""
                print(f"{case} [{side}]: warm hit {r['hit_min_us']} us (median {r['hit_median_us']}), "
                      f"{r['watched_paths']} watched paths{extra}; GPUs (arch, brand): {r['gpus']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
