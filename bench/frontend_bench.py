#!/usr/bin/env python3
"""What the front-end costs on the hot path, here (no GPU needed): the compiled front-end of an older revision
(default 112b38f: before it handed runc the calls that need no edit before the C library starts, issue 41) against
this checkout's, same run, in a shuffled order each round (seeded, printed), on the fake H200 driver root. runc is
/bin/true, so only the front-end (and the warm editor) is timed:

- runc_nogpu: the reference, /bin/true itself with the same argv (what an engine pays without gpuprov);
- nogpu: `create` of a bundle that asks for no GPU (read config.json, exec runc): over runc_nogpu it is the whole
  no-GPU cost of the front-end;
- gpu_warm / gpu_warm_all: `create` of a bundle with NVIDIA_VISIBLE_DEVICES=all (default capabilities, and `all`),
  answered by the warm editor (socket checks, peer check, deadline-bound exchange, the edit itself).
Bundles live on a tmpfs (_timing.bundle_dir), as engines' do.

Usage (root, from a git checkout): python3 bench/frontend_bench.py [--before 112b38f] [-n 300] [--json]"""
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

sys.path.insert(0, str(REPO / "bench"))
from _timing import bundle_dir  # noqa: E402


def build_before(rev: str, work: Path) -> Path:
    """The older shim.c, compiled the way that revision's `runtime install` did: static with path slots filled
    (install.patch_slots) since the wheel carries it, paths as -D macros before that."""
    from provision.inject.install import patch_slots

    src = work / "shim-before.c"
    text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:provision/inject/shim.c"],
                          capture_output=True, text=True, check=True).stdout
    src.write_text(text)
    exe = work / "gpuprov-runtime-before"
    modify = REPO / "provision/inject/modify_main.py"
    if "@@GPUPROV-SLOT" not in text:
        subprocess.run(["cc", "-O2", "-s", '-DRUNC="/bin/true"', f'-DPYTHON="{sys.executable}"',
                        f'-DMODIFY="{modify}"', str(src), "-o", str(exe)], check=True)
        return exe
    raw = work / "before.raw"
    entry = ["-Wl,-e,gpuprov_entry"] if "gpuprov_entry" in text else []  # as that revision's frontend_build linked it
    subprocess.run(["cc", "-O2", "-s", "-static", *entry, str(src), "-o", str(raw)], check=True)
    exe.write_bytes(patch_slots(raw.read_bytes(), runc="/bin/true", python=sys.executable, modify=str(modify)))
    exe.chmod(0o755)
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
    ap.add_argument("--before", default="112b38f", help="git revision whose shim.c is the reference")
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="gpuprov-frontend-bench-", dir=bundle_dir()))
    settings = write_settings(work, runc="/bin/true")
    env = {"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(settings)}
    exes = {"before": build_before(args.before, work), "after": compiled_front_end(work, "/bin/true"),
            "after_dynamic": build_dynamic(work)}
    nogpu = work / "nogpu"
    nogpu.mkdir()
    (nogpu / "config.json").write_text(json.dumps({"process": {"env": ["PATH=/bin"]}, "root": {"path": "rootfs"}}))
    gpu, gpu_all = gpu_bundle(work, "gpu"), gpu_bundle(work, "gpu-all", ["NVIDIA_DRIVER_CAPABILITIES=all"])
    fresh = {b: (b / "config.json").read_text() for b in (gpu, gpu_all)}
    cases = (("nogpu", nogpu), ("gpu_warm", gpu), ("gpu_warm_all", gpu_all))
    times: dict[str, list[float]] = {f"{k}_{c}": [] for k in exes for c, _ in cases}
    times["runc_nogpu"] = []
    try:
        for i in range(args.n + 5):  # 5 warm-ups (the first GPU create leaves the warm editor behind)
            order = [(name, exe, case, bundle) for name, exe in exes.items() for case, bundle in cases]
            order.append(("runc", Path("/bin/true"), "nogpu", nogpu))
            rng.shuffle(order)  # a fresh order each round: a rotation keeps each case's neighbour (issue 41)
            for name, exe, case, bundle in order:
                if bundle in fresh:
                    (bundle / "config.json").write_text(fresh[bundle])  # a fresh, unedited config each time
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
                                     for k in ("after", "after_dynamic") for c, _ in cases},
           "nogpu_over_runc_ms": {k: round(med[f"{k}_nogpu"] - med["runc_nogpu"], 3) for k in exes}}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"medians of {args.n}, shuffled each round (seed {seed}); ms")
        print(f"runc itself (no GPU) {med['runc_nogpu']:7.3f}; no-GPU create over it: "
              + ", ".join(f"{k} {v:+.3f}" for k, v in res["nogpu_over_runc_ms"].items()))
        for c, _ in cases:
            print(f"{c:12} before {med[f'before_{c}']:7.3f}   after (static) {med[f'after_{c}']:7.3f} "
                  f"({res['after_minus_before_ms'][f'after_{c}']:+.3f})   after (dynamic, as before) "
                  f"{med[f'after_dynamic_{c}']:7.3f} ({res['after_minus_before_ms'][f'after_dynamic_{c}']:+.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
