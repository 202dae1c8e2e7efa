#!/usr/bin/env python3
"""What handing runc gpuprov's own copy of an image's CUDA compat libraries costs per container start (issue 38
item 1), against a reference measured in the same run: the same edit of the same image without a compat directory
(the container then gets the host's libraries, as before the compat feature).

Measured in-process, as the warm editor runs it (modify_bundle on a fresh config.json; wall time, since the cost is
reading, hashing and writing files): the fake H200 driver root (580.159.04), an image whose compat libcuda is a
real ELF built here, padded with random bytes to the sizes of real cuda-compat libraries (libcuda of CUDA 12/13's
cuda-compat is ~30-100 MB). Cases, each in a shuffled order per round:
- ref: no compat directory;
- first: the first container of an image (the copy is made: read, hashed, written, fsync'ed);
- other: another container of the same image (the copy exists: the image's file is read and hashed);
- restart: the same container again in the warm editor (its file's identity is remembered: a stat).

Usage: sudo python3 bench/compat_stage_bench.py [-n 15] [--sizes 30,100] [--json]
Results: bench/results/<date>-compat-stage-<commit>.json"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from provision.inject import compat  # noqa: E402
from provision.inject.modify import modify_bundle  # noqa: E402
from tests import oci  # noqa: E402
from tests.inject_helpers import settings  # noqa: E402
from tests.unit.test_compat import build_lib  # noqa: E402

VERSION = "590.44.01"


def image(base: Path, mib: int | None) -> Path:
    rootfs = base / f"rootfs-{mib}"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc/debian_version").write_text("12.8\n")
    if mib:
        d = rootfs / "usr/local/cuda/compat"
        d.mkdir(parents=True)
        lib = d / f"libcuda.so.{VERSION}"
        build_lib(lib)
        with open(lib, "ab") as fh:
            fh.write(os.urandom(mib << 20))
    return rootfs


def one(base: Path, s, rootfs: Path, cfg: dict, name: str) -> float:
    bundle = oci.write_bundle(base / f"bundle-{name}", cfg)
    t = time.perf_counter()
    modify_bundle(str(bundle), s, lambda _msg: None)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=15)
    ap.add_argument("--sizes", default="30,100", help="compat libcuda sizes in MiB")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    base = Path(tempfile.mkdtemp(prefix="gpuprov-compat-bench-"))
    try:
        s = settings(base)
        store = compat.store_dir(s.cache)
        sizes = [int(x) for x in args.sizes.split(",")]
        roots = {None: image(base, None), **{m: image(base, m) for m in sizes}}
        cfgs = {m: oci.make_config(str(r), ["true"], ["NVIDIA_VISIBLE_DEVICES=0"]) for m, r in roots.items()}
        cases = [("ref", None)] + [(k, m) for m in sizes for k in ("first", "other", "restart")]
        times: dict[str, list[float]] = {}
        for m in sizes:  # warm-up: every file in the page cache, the copy made once
            one(base, s, roots[m], cfgs[m], "warm")
        for _ in range(args.n):
            rng.shuffle(cases)
            for kind, m in cases:
                if kind == "first":
                    shutil.rmtree(store, ignore_errors=True)
                if kind in ("first", "other"):
                    compat._staged.clear()  # a new container's overlay: another identity
                if kind == "restart":
                    one(base, s, roots[m], cfgs[m], "prime")  # the copy and its identity as a first start left them
                times.setdefault(f"{kind}-{m}" if m else kind, []).append(one(base, s, roots[m], cfgs[m], kind))
        ref = statistics.median(times["ref"])
        res = {"seed": seed, "n": args.n, "ref_ms": round(ref * 1e3, 2),
               "cases": {k: {"median_ms": round(statistics.median(v) * 1e3, 2),
                             "p90_ms": round(sorted(v)[int(len(v) * 0.9) - 1] * 1e3, 2),
                             "over_ref_ms": round((statistics.median(v) - ref) * 1e3, 2),
                             "ratio": round(statistics.median(v) / ref, 2)} for k, v in sorted(times.items())}}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    out = REPO / "bench/results" / f"{time.strftime('%Y-%m-%d')}-compat-stage-{commit}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    if args.json:
        print(json.dumps(res))
    else:
        print(f"seed {seed}, n={args.n}; reference (no compat directory): {res['ref_ms']} ms")
        for k, v in res["cases"].items():
            print(f"{k:14s} median {v['median_ms']:8.2f} ms  p90 {v['p90_ms']:8.2f} ms  "
                  f"+{v['over_ref_ms']:.2f} ms over the reference ({v['ratio']}x)")
        print(f"written to {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
