#!/usr/bin/env python3
"""Where a GPU create's milliseconds go (issue 41): gpuprov-runtime's own part, without runc's. A second install of
the runtime whose low-level runtime is /bin/true (so `create` is the front-end, the warm editor's edit and the config
write, then an exec of true) is timed against /bin/true exec'd directly, on a no-GPU bundle, a default GPU bundle and
an `all` capabilities bundle, shuffled per round (seed printed). What is left of runtime_bench's gpuprov-over-limit
after this is runc's own work on the edited config (it should be none: the limit runs the same config).

Usage (root, on a GPU host, GPU_KIT_ROOTFS set): python3 bench/create_split.py [-n 200] [--json]"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _timing import bundle_dir, quantile  # noqa: E402

from tests.oci import make_config, write_bundle  # noqa: E402

ALL = "NVIDIA_DRIVER_CAPABILITIES=all"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--driver-root", default="/")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)
    prefix = Path(tempfile.mkdtemp(prefix="gpuprov-split-"))
    os.environ["GPUPROV_RUNTIME_CONFIG"] = str(prefix / "runtime.json")
    from provision.inject.install import install_runtime

    true = shutil.which("true")
    rt = install_runtime(str(prefix), runc=true, driver_root=args.driver_root).runtime_path
    work = Path(tempfile.mkdtemp(prefix="gpuprov-split-b-", dir=bundle_dir()))
    image = Path(tempfile.mkdtemp(prefix="gpuprov-split-img-")) / "rootfs"
    shutil.copytree(os.environ["GPU_KIT_ROOTFS"], image, symlinks=True)
    envs = {"true_direct": [], "nogpu": [], "gpu_default": ["NVIDIA_VISIBLE_DEVICES=all"],
            "gpu_all": ["NVIDIA_VISIBLE_DEVICES=all", ALL]}
    pristine = {k: json.dumps(make_config(str(image), ["/bin/true"], v)) for k, v in envs.items()}
    times: dict[str, list[float]] = {k: [] for k in envs}

    def once(case: str, i: int) -> float:
        b = write_bundle(work / f"{case}-{i}", json.loads(pristine[case]))
        argv = [true if case == "true_direct" else rt, "create", "--bundle", str(b), f"s{case[:3]}{i}"]
        t0 = time.perf_counter()
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            raise SystemExit(f"{case}: exit {r.returncode}: {r.stderr.decode(errors='replace')[-500:]}")
        shutil.rmtree(b)
        return dt

    for i in range(5):  # warm-up: the warm editor starts on the first GPU create
        for case in envs:
            once(case, -1 - i)
    for i in range(args.n):
        order = list(envs)
        rng.shuffle(order)
        for case in order:
            times[case].append(once(case, i))
    med = {k: quantile(v, 0.5) * 1e3 for k, v in times.items()}
    out = {"seed": seed, "n": args.n, "runtime": rt,
           "median_ms": {k: round(v, 3) for k, v in med.items()},
           "p10_p90_ms": {k: [round(quantile(v, 0.1) * 1e3, 3), round(quantile(v, 0.9) * 1e3, 3)]
                          for k, v in times.items()},
           "gpuprov_part_ms": {k: round(med[k] - med["true_direct"], 3) for k in envs if k != "true_direct"}}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"seed {seed} n={args.n}")
        for k in envs:
            print(f"  {k:12} {med[k]:7.3f} ms  (p10-p90 {out['p10_p90_ms'][k][0]}-{out['p10_p90_ms'][k][1]})")
        print("gpuprov's own part over exec'ing the runtime directly (ms):", out["gpuprov_part_ms"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
