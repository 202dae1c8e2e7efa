#!/usr/bin/env python3
"""What the GPU editor costs per container, this checkout against an older revision, same run, here (no GPU
needed: the fake H200 driver root; root, for its mknod device nodes). CPU time, not wall time, so a busy shared
machine moves both sides alike:

- warm: one GPU container's edit in the warm editor (modify_bundle on a fresh config.json, in a process that has
  imported everything and read the discovery cache before, as the warm editor has), time.thread_time;
- cold: `python3 -I -S modify_main.py BUNDLE` as a process (what the compiled front-end runs when no warm editor
  answers yet, and what the Python front-end does in-process on every GPU start), the child's user+sys time.

Each bundle's image carries this machine's /etc/ld.so.cache (a real one, as every glibc image has; the editor reads
it since the image-cache override): --no-image-cache leaves it out.

Usage: python3 bench/editor_bench.py [--before REV] [-n 200] [--rounds 8] [--cold 60] [--no-image-cache] [--caps all] [--json]"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.inject_helpers import gpu_bundle, write_settings  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from _timing import bundle_dir, revision_tree  # noqa: E402

WARM = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import provision.inject.modify as m
import provision.inject.settings as st
assert m.__file__.startswith(sys.argv[1]), m.__file__
os.environ["GPUPROV_RUNTIME_CONFIG"] = sys.argv[2]
settings, bundle = st.load_settings(), sys.argv[3]  # each side's own form: a dict before 'values', Settings after
cfg = open(bundle + "/config.json").read()
out = []
for i in range(int(sys.argv[4]) + 20):  # 20 warm-ups: the first one reads (and caches) discovery
    with open(bundle + "/config.json", "w") as fh:
        fh.write(cfg)
    t = time.thread_time()
    m.modify_bundle(bundle, settings)
    if i >= 20:
        out.append((time.thread_time() - t) * 1e6)
print(json.dumps(out))
'''


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="91c31ef", help="git revision to compare with (default: before typed records)")
    ap.add_argument("-n", type=int, default=200, help="warm edits per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cold", type=int, default=60, help="cold editor runs per side")
    ap.add_argument("--no-image-cache", action="store_true", help="images without /etc/ld.so.cache")
    ap.add_argument("--caps", default=None, help="NVIDIA_DRIVER_CAPABILITIES of the request (default: the image's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cache = None if args.no_image_cache else Path("/etc/ld.so.cache")

    def bundle(name: str) -> Path:
        b = gpu_bundle(work, name, env=[f"NVIDIA_DRIVER_CAPABILITIES={args.caps}"] if args.caps else None)
        if cache is not None and cache.is_file():
            (b / "rootfs/etc/ld.so.cache").write_bytes(cache.read_bytes())
        return b

    work = Path(tempfile.mkdtemp(prefix="gpuprov-editor-bench-", dir=bundle_dir()))  # bundles on a tmpfs
    sides = {"before": revision_tree(REPO, args.before, work), "after": REPO}
    settings = {k: _mk(work / k) for k in sides}
    warm: dict[str, list[float]] = {k: [] for k in sides}
    cold: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.rounds):
        for k in (list(sides) if r % 2 else list(sides)[::-1]):
            b = bundle(f"warm-{k}")
            p = subprocess.run([sys.executable, "-I", "-S", "-c", WARM, str(sides[k]), str(settings[k]), str(b),
                                str(args.n)], capture_output=True, text=True, check=True)
            warm[k] += json.loads(p.stdout)
    template = (bundle("template") / "config.json").read_text()
    for i in range(args.cold + 3):
        for k in (list(sides) if i % 2 else list(sides)[::-1]):
            b = bundle(f"cold-{k}")
            (b / "config.json").write_text(template)
            env = {"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(settings[k])}
            p = subprocess.Popen([sys.executable, "-I", "-S", str(sides[k] / "provision/inject/modify_main.py"), str(b)],
                                 env=env)
            _, status, ru = os.wait4(p.pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                print(f"{k}: the editor failed", file=sys.stderr)
                return 2
            if i >= 3:
                cold[k].append((ru.ru_utime + ru.ru_stime) * 1000)
    med = {f"{case}_{k}": statistics.median(v[k]) for case, v in (("warm_us", warm), ("cold_ms", cold)) for k in sides}
    res = {"before": args.before, "median": {k: round(v, 2) for k, v in med.items()},
           "ratio_after_before": {c: round(med[f"{c}_after"] / med[f"{c}_before"], 3) for c in ("warm_us", "cold_ms")},
           "n": {"warm": args.n * args.rounds, "cold": args.cold}, "image_cache": cache is not None}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"CPU time, medians; before = {args.before}")
        print(f"warm editor, one GPU edit   before {med['warm_us_before']:8.0f} us  after {med['warm_us_after']:8.0f} us"
              f"  {res['ratio_after_before']['warm_us']:.3f}x")
        print(f"cold editor process         before {med['cold_ms_before']:8.2f} ms  after {med['cold_ms_after']:8.2f} ms"
              f"  {res['ratio_after_before']['cold_ms']:.3f}x")
    return 0


def _mk(base: Path) -> Path:
    base.mkdir()
    return write_settings(base)


if __name__ == "__main__":
    raise SystemExit(main())
