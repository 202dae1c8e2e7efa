#!/usr/bin/env python3
"""Per-container-start cost on a GPU host: bare runc vs gpuprov-runtime (no GPU) vs gpuprov-runtime
(NVIDIA_VISIBLE_DEVICES=all). Medians of N full lifecycles (create/start/wait/delete), interleaved, one run.

Targets (issue 4): no-GPU start <= 1.15x bare runc; GPU start <= 2.0x bare runc.
Usage (on the GPU host, after `source .gpu-kit/env.sh`):
  python3 bench/runtime_bench.py --runtime PREFIX/bin/gpuprov-runtime [-n 30] [--json]
Several front-ends in the same run (e.g. before/after a change): --runtime NAME=PATH, repeated; the first one's
ratios are the headline (bench/device_bench.sh does this on a lent GPU host).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.oci import lifecycle, make_config, write_bundle  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", required=True, action="append", help="PATH or NAME=PATH; repeat to compare")
    ap.add_argument("-n", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpuprov-bench-"))
    rootfs = work / "rootfs"
    shutil.copytree(os.environ["GPU_KIT_ROOTFS"], rootfs, symlinks=True)
    runtimes = dict(r.split("=", 1) if "=" in r else ("gpuprov", r) for r in args.runtime)
    first = next(iter(runtimes))
    cases = {"runc": ("runc", [])}
    for name, path in runtimes.items():
        cases[f"{name}_nogpu"] = (path, [])
        cases[f"{name}_gpu"] = (path, ["NVIDIA_VISIBLE_DEVICES=all"])
    # every capability (graphics, video, display…): ~60 more read-only mounts than compute-only (first runtime only)
    cases[f"{first}_gpu_allcaps"] = (runtimes[first], ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=all"])
    # Breakdown of the GPU path: bare runc on a config already edited once (the mounts' cost inside runc),
    # and the editor alone (python3 -I -S modify_main.py on a fresh config).
    from provision.inject.modify import modify_bundle
    from provision.inject.settings import load_settings

    pre = write_bundle(work / "pre", make_config(str(rootfs), ["/bin/true"], ["NVIDIA_VISIBLE_DEVICES=all"]))
    modify_bundle(str(pre), load_settings())
    edited = json.loads((pre / "config.json").read_text())
    cases["runc_preedited_gpu"] = ("runc", None)
    editor = Path(__file__).resolve().parents[1] / "provision/inject/modify_main.py"
    times: dict[str, list[float]] = {k: [] for k in cases}
    times["editor_only"] = []
    phases: dict[str, dict[str, list[float]]] = {}
    for i in range(args.n + 3):  # 3 warm-ups, then interleaved measurements
        names = list(cases)
        names = names[i % len(names):] + names[:i % len(names)]  # rotate: no case always runs first
        for name in names:
            rt, env = cases[name]
            cfg = edited if env is None else make_config(str(rootfs), ["/bin/true"], env)
            bundle = write_bundle(work / f"{name}-{i}", cfg)
            t = time.perf_counter()
            rc, out = lifecycle(rt, bundle, phases=phases.setdefault(name, {}) if i >= 3 else None)
            dt = time.perf_counter() - t
            if rc != 0:
                print(f"{name}: create failed: {out}", file=sys.stderr)
                return 2
            if i >= 3:
                times[name].append(dt)
        eb = write_bundle(work / f"ed-{i}", make_config(str(rootfs), ["/bin/true"], ["NVIDIA_VISIBLE_DEVICES=all"]))
        t = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", str(editor), str(eb)], check=True)
        if i >= 3:
            times["editor_only"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    res = {f"{k}_ms": round(v, 2) for k, v in med.items()}
    res["nogpu_ratio"] = round(med[f"{first}_nogpu"] / med["runc"], 3)
    res["gpu_ratio"] = round(med[f"{first}_gpu"] / med["runc"], 3)
    res["allcaps_ratio"] = round(med[f"{first}_gpu_allcaps"] / med["runc"], 3)
    res["ratios"] = {f"{n}_{c}": round(med[f"{n}_{c}"] / med["runc"], 3) for n in runtimes for c in ("nogpu", "gpu")}
    res["n"] = args.n
    res["p25_p75_ms"] = {k: [round(statistics.quantiles(v, n=4)[0] * 1000, 2), round(statistics.quantiles(v, n=4)[2] * 1000, 2)]
                         for k, v in times.items()}
    res["ok"] = res["nogpu_ratio"] <= 1.15 and res["gpu_ratio"] <= 2.0
    res["phases_ms"] = {c: {p: round(statistics.median(v) * 1000, 2) for p, v in ph.items()} for c, ph in phases.items()}
    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"bare runc            {med['runc']:7.2f} ms (reference)")
        for n in runtimes:
            print(f"{n}, no GPU {med[f'{n}_nogpu']:7.2f} ms  {res['ratios'][f'{n}_nogpu']:.3f}x  (target <= 1.15x)")
            print(f"{n}, GPU (all) {med[f'{n}_gpu']:7.2f} ms  {res['ratios'][f'{n}_gpu']:.3f}x  (target <= 2.0x)")
        print(f"{first}, GPU, caps=all {med[f'{first}_gpu_allcaps']:5.2f} ms  {res['allcaps_ratio']:.2f}x")
        for c, ph in res["phases_ms"].items():
            print(f"  {c:20} " + "  ".join(f"{p} {v:6.2f}" for p, v in ph.items()))
        print(f"  of which: runc with the same edits {med['runc_preedited_gpu']:7.2f} ms; "
              f"editor alone {med['editor_only']:7.2f} ms")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
