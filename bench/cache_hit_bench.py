#!/usr/bin/env python3
"""A warm container start's discovery cost: discover.load_cached on a current cache, the warm editor's case (the
parse is memoised, so this is the host key's reads and stats and the cache file's open + fstat). Also host_key alone.
Two driver roots: the H200 capture's (/usr/local/nvidia, one library directory) and this machine's own / (the
driver root of a distro-packaged driver: every candidate library directory that exists here is watched).

Usage: .venv/bin/python bench/cache_hit_bench.py [-n 20000] [--json]   (min and median of 7 repeats, per call)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from provision.inject import discover
    from tests.conftest import H200

    work = Path(tempfile.mkdtemp(prefix="gpuprov-cachehit-"))
    (work / "dev/dev").mkdir(parents=True)
    res = {}
    for name, root in (("h200_capture", str(H200 / "usr/local/nvidia")), ("this_host_root", "/")):
        cache = str(work / f"{name}.json")
        disc = discover.refresh(root, cache, str(H200), str(work / "dev"))
        assert discover.load_cached(cache, str(H200)) == disc, "the cache must hit"
        watch = getattr(disc, "watch", ())
        key_args = (str(H200), watch) if watch else (str(H200),)
        runs = {}
        for what, fn in (("load_cached", lambda c=cache: discover.load_cached(c, str(H200))),
                         ("host_key", lambda a=key_args: discover.host_key(*a))):
            per = [t / args.n * 1e6 for t in timeit.repeat(fn, number=args.n, repeat=7)]
            runs[what] = {"min_us": round(min(per), 2), "median_us": round(sorted(per)[3], 2)}
        runs["watched_paths"] = len(watch)
        res[name] = runs
    lines = [f"{n}: load_cached {r['load_cached']['min_us']} us (median {r['load_cached']['median_us']}), "
             f"host_key {r['host_key']['min_us']} us, {r['watched_paths']} watched paths" for n, r in res.items()]
    print(json.dumps(res) if args.json else "\n".join(lines))
    for p in work.rglob("*"):
        if p.is_file():
            os.unlink(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
