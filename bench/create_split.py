#!/usr/bin/env python3
"""Where a GPU create's milliseconds go (issue 41): gpuprov-runtime's own part, without runc's. A runtime whose
low-level runtime is /bin/true (so `create` is the front-end, the warm editor's edit and the config write, then an
exec of true) is timed against /bin/true exec'd directly, on a no-GPU bundle, a default GPU bundle and an `all`
capabilities bundle, shuffled per round (seed printed), each create with runc's `--log`/`--log-format json` as engines
pass them (a warning goes to that file, not back through the front-end). What is left of runtime_bench's
gpuprov-over-limit after this is runc's own work on the edited config (it should be none: the limit runs the same
config).

Each side is built as `runtime install` builds it (inject/install.py: the editor's copy, the front-end compiled from
that tree's shim.c with its slots filled), with its own runtime.json, discovery cache and warm editor:
- `after`: this checkout; `--before REV`: that revision too, interleaved in the same shuffled rounds (same-run
  comparison: `after_minus_before_ms`); REV may be a directory holding that revision's provision/ (a lent machine's
  copy of the checkout has no .git: `git archive REV provision | tar -x -C DIR`);
- `--fake-driver`: no GPU needed: the fake H200 driver root (tests/fixtures, real device nodes made with mknod) and a
  Debian-like image with this host's /etc/ld.so.cache; else the host's driver (`--driver-root`) and GPU_KIT_ROOTFS.

--gap-ms G: sleep G ms before each create (untimed). Back to back, the warm editor runs with its code and data in
the CPU's caches; between real starts (seconds apart) it does not: here an in-process edit took 583 us back to back
and ~1000 us 10 ms after the one before, even with the CPU kept busy meanwhile.

--no-log: no --log/--log-format, as an engine that passes none: the editor's warnings then come back to the front-end
and go to its stderr (the fake driver warns on every `all` create: nvidia-modeset cannot load there).

Usage (root): python3 bench/create_split.py [-n 200] [--before REV] [--fake-driver | --driver-root /] [--no-log]
  [--gap-ms 20] [--json]"""
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

from _timing import bundle_dir, quantile, revision_tree  # noqa: E402

from tests.oci import make_config, write_bundle  # noqa: E402

ALL = "NVIDIA_DRIVER_CAPABILITIES=all"
# Run with the side's own tree first on sys.path: its editor copy and its compiled front-end, as its install made them.
BUILD = r'''
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from provision.inject.install import front_end, install_editor
assert __import__("provision").__file__.startswith(sys.argv[1])
editor = install_editor(sys.argv[2], [])
shim, origin, notes = front_end(sys.argv[3], sys.executable, True, editor)
if shim is None:
    raise SystemExit(f"no compiled front-end: {notes}")
exe = Path(sys.argv[2]) / "bin/gpuprov-runtime"
exe.parent.mkdir(parents=True, exist_ok=True)
exe.write_bytes(shim)
exe.chmod(0o755)
print(exe)
'''


def side(name: str, src: Path, work: Path, settings: dict) -> tuple[str, dict[str, str]]:
    """(the side's gpuprov-runtime, the environment its creates run with)."""
    prefix = work / f"prefix-{name}"
    prefix.mkdir()
    cfg = prefix / "runtime.json"
    cfg.write_text(json.dumps({**settings, "cache": str(prefix / "discovery.json")}))
    r = subprocess.run([sys.executable, "-I", "-S", "-c", BUILD, str(src), str(prefix), settings["runc"]],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{name}: cannot build its runtime from {src}: {r.stderr[-800:]}")
    return r.stdout.strip(), {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "GPUPROV_RUNTIME_CONFIG": str(cfg)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--before", default=None, help="git revision (or a directory holding its provision/) to time in "
                    "the same rounds")
    ap.add_argument("--driver-root", default="/")
    ap.add_argument("--fake-driver", action="store_true", help="the fake H200 driver root (no GPU needed)")
    ap.add_argument("--no-log", action="store_true", help="no --log: warnings come back on stderr")
    ap.add_argument("--gap-ms", type=float, default=0, help="sleep before each create, untimed")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)
    true = shutil.which("true")
    work = Path(tempfile.mkdtemp(prefix="gpuprov-split-", dir=bundle_dir()))  # bundles on a tmpfs, as engines'
    image = work / "image/rootfs"
    if args.fake_driver:
        from tests.inject_helpers import settings_dict

        settings = {**settings_dict(work), "runc": true}
        for d in ("usr/lib/x86_64-linux-gnu", "usr/bin", "etc", "dev", "tmp"):
            (image / d).mkdir(parents=True, exist_ok=True)
        (image / "etc/debian_version").write_text("12.0\n")
        if Path("/etc/ld.so.cache").is_file():
            shutil.copyfile("/etc/ld.so.cache", image / "etc/ld.so.cache")
    else:
        settings = {"runc": true, "driver_root": args.driver_root, "dev_root": "/", "proc_root": "/",
                    "accept_env_unprivileged": True}
        shutil.copytree(os.environ["GPU_KIT_ROOTFS"], image, symlinks=True)
    before = None
    if args.before:  # a directory holding that revision's provision/ (a lent machine's copy has no .git), or a rev
        before = Path(args.before).resolve() if Path(args.before).is_dir() else revision_tree(REPO, args.before, work)
    sides = {"after": REPO, **({"before": before} if before else {})}
    built = {k: side(k, src, work, settings) for k, src in sides.items()}
    envs = {"nogpu": [], "gpu_default": ["NVIDIA_VISIBLE_DEVICES=all"], "gpu_all": ["NVIDIA_VISIBLE_DEVICES=all", ALL]}
    pristine = {k: json.dumps(make_config(str(image), ["/bin/true"], v)) for k, v in envs.items()}
    cases = [("true_direct", "nogpu", None)] + [(f"{s}_{c}", c, s) for s in sides for c in envs]
    times: dict[str, list[float]] = {k: [] for k, _, _ in cases}
    log = work / "log.json"

    def once(key: str, bundle_case: str, s: str | None, i: int) -> float:
        b = write_bundle(work / f"{key}-{i}", json.loads(pristine[bundle_case]))
        exe, env = built[s] if s else (true, built["after"][1])
        logging = [] if args.no_log else ["--log", str(log), "--log-format", "json"]
        argv = [exe, "--root", str(work / "state"), *logging, "create", "--bundle", str(b), f"s{i}"]
        if args.gap_ms:
            time.sleep(args.gap_ms / 1e3)
        t0 = time.perf_counter()
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, env=env)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            raise SystemExit(f"{key}: exit {r.returncode}: {r.stderr.decode(errors='replace')[-500:]}")
        shutil.rmtree(b)
        return dt

    try:
        for i in range(5):  # warm-up: each side's warm editor starts on its first GPU create
            for key, c, s in cases:
                once(key, c, s, -1 - i)
        for i in range(args.n):
            order = list(cases)
            rng.shuffle(order)  # a fresh order each round: a rotation keeps each case's neighbour (issue 41)
            for key, c, s in order:
                times[key].append(once(key, c, s, i))
    finally:
        from tests.inject_helpers import stop_editors

        for _, env in built.values():
            stop_editors(Path(env["GPUPROV_RUNTIME_CONFIG"]))
    med = {k: quantile(v, 0.5) * 1e3 for k, v in times.items()}
    out = {"seed": seed, "n": args.n, "before": args.before, "fake_driver": args.fake_driver, "log": not args.no_log,
           "gap_ms": args.gap_ms,
           "runtime": {k: v[0] for k, v in built.items()},
           "median_ms": {k: round(v, 3) for k, v in med.items()},
           "p10_p90_ms": {k: [round(quantile(v, 0.1) * 1e3, 3), round(quantile(v, 0.9) * 1e3, 3)]
                          for k, v in times.items()},
           "gpuprov_part_ms": {k: round(med[k] - med["true_direct"], 3) for k in med if k != "true_direct"}}
    if args.before:
        out["after_minus_before_ms"] = {c: round(med[f"after_{c}"] - med[f"before_{c}"], 3) for c in envs}
        out["part_ratio_after_before"] = {c: round(out["gpuprov_part_ms"][f"after_{c}"]
                                                   / out["gpuprov_part_ms"][f"before_{c}"], 3) for c in envs}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"seed {seed} n={args.n}" + (f" before={args.before}" if args.before else ""))
        for k in med:
            print(f"  {k:18} {med[k]:7.3f} ms  (p10-p90 {out['p10_p90_ms'][k][0]}-{out['p10_p90_ms'][k][1]})")
        print("gpuprov's own part over exec'ing the runtime directly (ms):", out["gpuprov_part_ms"])
        if args.before:
            print("after - before (ms):", out["after_minus_before_ms"], " part ratio:", out["part_ratio_after_before"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
