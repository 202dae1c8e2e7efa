#!/usr/bin/env python3
"""What the front-end's safety costs on the hot path, here (no GPU needed): the compiled front-end of an older
revision (default: before the timeouts, socket checks and editor lock) against this checkout's, same run, in a
shuffled order each round (seeded, printed), on the fake H200 driver root. runc is /bin/true, so only the front-end
(and the warm editor) is timed:

- nogpu: `create` of a bundle that asks for no GPU (read config.json, exec runc);
- gpu_warm: `create` of a bundle with NVIDIA_VISIBLE_DEVICES=all, answered by the warm editor (socket checks, peer
  check, deadline-bound exchange, the edit itself).

Usage (root, from a git checkout): python3 bench/frontend_bench.py [--before 24708ce] [-n 300] [--json]"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.inject_helpers import compiled_front_end, gpu_bundle, stop_editors, write_settings  # noqa: E402


def build_before(rev: str, work: Path) -> Path:
    """The older shim.c, compiled the way that revision's `runtime install` did (paths as -D macros)."""
    src = work / "shim-before.c"
    src.write_text(subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:provision/inject/shim.c"],
                                  capture_output=True, text=True, check=True).stdout)
    exe = work / "gpuprov-runtime-before"
    modify = REPO / "provision/inject/modify_main.py"
    subprocess.run(["cc", "-O2", "-s", '-DRUNC="/bin/true"', f'-DPYTHON="{sys.executable}"', f'-DMODIFY="{modify}"',
                    str(src), "-o", str(exe)], check=True)
    return exe


def build_dynamic(work: Path) -> Path:
    """This checkout's shim.c linked dynamically like the reference: separates the safety's cost from the static
    link's gain (no dynamic loader at each exec)."""
    from provision.inject.install import patch_slots

    out = work / "dynamic.raw"
    subprocess.run(["cc", "-O2", "-s", str(REPO / "provision/inject/shim.c"), "-o", str(out)], check=True)
    exe = work / "gpuprov-runtime-dynamic"
    exe.write_bytes(patch_slots(out.read_bytes(), runc="/bin/true", python=sys.executable,
                                modify=str(REPO / "provision/inject/modify_main.py")))
    exe.chmod(0o755)
    return exe


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="24708ce", help="git revision whose shim.c is the reference")
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="gpuprov-frontend-bench-"))
    settings = write_settings(work, runc="/bin/true")
    env = {"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(settings)}
    exes = {"before": build_before(args.before, work), "after": compiled_front_end(work, "/bin/true"),
            "after_dynamic": build_dynamic(work)}
    nogpu = work / "nogpu"
    nogpu.mkdir()
    (nogpu / "config.json").write_text(json.dumps({"process": {"env": ["PATH=/bin"]}, "root": {"path": "rootfs"}}))
    gpu_config = (gpu_bundle(work, "gpu-template") / "config.json").read_text()
    gpu = gpu_bundle(work, "gpu")
    times: dict[str, list[float]] = {f"{k}_{c}": [] for k in exes for c in ("nogpu", "gpu_warm")}
    try:
        for i in range(args.n + 5):  # 5 warm-ups (the first GPU create leaves the warm editor behind)
            order = [(name, exe, case, bundle) for name, exe in exes.items()
                     for case, bundle in (("nogpu", nogpu), ("gpu_warm", gpu))]
            rng.shuffle(order)  # a fresh order each round: a rotation keeps each case's neighbour (issue 41)
            for name, exe, case, bundle in order:
                if case == "gpu_warm":
                    (gpu / "config.json").write_text(gpu_config)  # a fresh, unedited config each time
                t = time.perf_counter()
                r = subprocess.run([str(exe), "--root", "/run/x", "--log", str(work / "log.json"),
                                    "--log-format", "json", "create", "--bundle", str(bundle), "id"], env=env)
                dt = time.perf_counter() - t
                if r.returncode != 0:
                    print(f"{name} {case}: exit {r.returncode}", file=sys.stderr)
                    return 2
                if i >= 5:
                    times[f"{name}_{case}"].append(dt)
    finally:
        stop_editors(settings)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    res = {"seed": seed, "n": args.n, "before": args.before, "median_ms": {k: round(v, 3) for k, v in med.items()},
           "p25_p75_ms": {k: [round(q * 1000, 3) for q in statistics.quantiles(v, n=4)[::2]] for k, v in times.items()},
           "after_minus_before_ms": {f"{k}_{c}": round(med[f"{k}_{c}"] - med[f"before_{c}"], 3)
                                 for k in ("after", "after_dynamic") for c in ("nogpu", "gpu_warm")}}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"medians of {args.n}, shuffled each round (seed {seed}); ms")
        for c in ("nogpu", "gpu_warm"):
            print(f"{c:9} before {med[f'before_{c}']:7.3f}   after (static) {med[f'after_{c}']:7.3f} "
                  f"({res['after_minus_before_ms'][f'after_{c}']:+.3f})   after (dynamic, as before) "
                  f"{med[f'after_dynamic_{c}']:7.3f} ({res['after_minus_before_ms'][f'after_dynamic_{c}']:+.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
