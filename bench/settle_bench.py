#!/usr/bin/env python3
"""Whether a wait before runc costs its own length, or more (issue 41): runc's create on a no-GPU bundle through
bench/exec_hop.c (built static) with a delay of H us before runc (sleeping), each start preceded by an untimed
sleep of G ms, for every G in --gaps and H in --hops, shuffled per round (seeded). Reported per gap: each delay's
create over no delay, round by round (median and bootstrap 95% interval).

Back to back (G=0) runc starts right after the previous start's delete, ahead of the kernel's deferred teardown of
that container (its cgroup's and mount namespace's release after RCU grace periods); a delay moves runc into it,
and costs more than itself. After a settle (G=50) the delay costs its length plus the hop's exec. runtime_bench's
--settle-ms and its hop cases measure gpuprov against its limit in both regimes.

Usage (root, after `source .gpu-kit/env.sh`):
  python3 bench/settle_bench.py --hop EXEC_HOP [-n 200] [--gaps 0,50] [--hops 0,1500] [--seed S] [--json]"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import bundle_dir, paired_diff_ci  # noqa: E402

from tests.oci import lifecycle, make_config, write_bundle  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hop", required=True, help="bench/exec_hop.c, built")
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--gaps", default="0,50", help="ms slept before each start, untimed")
    ap.add_argument("--hops", default="0,1500", help="us the hop waits before runc create; the first is the base")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    gaps = [float(x) for x in args.gaps.split(",")]
    hops = [int(x) for x in args.hops.split(",")]
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="gpuprov-settle-", dir=bundle_dir()))
    image = Path(tempfile.mkdtemp(prefix="gpuprov-settle-image-"))
    shutil.copytree(os.environ["GPU_KIT_ROOTFS"], image / "rootfs", symlinks=True)
    cfg = make_config(str(image / "rootfs"), ["/bin/true"])
    runc = shutil.which("runc") or "runc"
    cases = {(g, h): {**os.environ, "HOP_RUNC": runc, "HOP_US": str(h), "HOP_MODE": "sleep"} for g in gaps for h in hops}
    create: dict[tuple[float, int], list[float]] = {k: [] for k in cases}
    try:
        for i in range(args.n + 3):
            order = list(cases)
            rng.shuffle(order)
            for g, h in order:
                bundle = write_bundle(work / f"g{g}-h{h}-{i}", cfg)
                phases: dict[str, list[float]] = {}
                time.sleep(g / 1e3)
                rc, out = lifecycle(args.hop, bundle, env=cases[(g, h)], phases=phases)
                shutil.rmtree(bundle, ignore_errors=True)
                if rc != 0:
                    print(f"gap {g} hop {h}: create failed: {out}", file=sys.stderr)
                    return 2
                if i >= 3:
                    create[(g, h)].append(phases["create"][0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(image, ignore_errors=True)
    res: dict = {"seed": seed, "n": args.n, "runc": runc, "gaps_ms": gaps, "hops_us": hops, "by_gap": {}}
    for g in gaps:
        base = create[(g, hops[0])]
        res["by_gap"][str(g)] = {
            str(h): {"create_median_ms": round(statistics.median(create[(g, h)]) * 1e3, 2),
                     "over_base_paired_ms": [round(x * 1e3, 2) for x in paired_diff_ci(create[(g, h)], base, seed)]}
            for h in hops}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"seed {seed}, n={args.n}; runc create through the hop, medians ms; over a {hops[0]} us hop, round by round")
        for g, by_hop in res["by_gap"].items():
            for h, v in by_hop.items():
                p = v["over_base_paired_ms"]
                print(f"  gap {g:>5} ms  hop {h:>5} us  create {v['create_median_ms']:6.2f}  "
                      f"{p[0]:+.2f} (95% {p[1]:+.2f} to {p[2]:+.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
