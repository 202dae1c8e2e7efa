#!/usr/bin/env python3
"""Per-container-start cost on a GPU host against the limit (issue 41): what runc costs with gpuprov's edits already
applied. gpuprov can only add to that; both exec the same runc with the same config.

Cases (full lifecycles: create, state+start, wait, delete, each phase timed):
- runc: bare runc, no GPU;
- limit_default / limit_all: runc on a config that gpuprov's editor has already edited (default capabilities, and
  NVIDIA_DRIVER_CAPABILITIES=all: ~60 more read-only mounts with a full driver);
- NAME_nogpu, NAME_gpu, NAME_gpu_all: each front-end given with --runtime (no GPU asked; the two GPU requests).

Order: each round runs every case once, in a freshly shuffled order (seeded; the seed is printed and stored, so a run
can be repeated with --seed). A rotation (what this script did before) keeps every case's predecessor the same each
round, so the after-effects of a heavy start (its mount namespace, its device cgroup program, page-cache teardown)
land on the same neighbour every time and n does not average them out. `--by-predecessor` splits each case's create
median by the case that ran just before it, so a neighbour effect shows.

Bundles live on a tmpfs (_timing.bundle_dir: /run or /dev/shm), as engines' do under /run/containerd.

Before timing, the config each front-end hands runc is compared with the limit's (mounts, devices, cgroup rules,
hooks, env, masked paths): a difference stops the run (exit 3), since the limit would not be the limit.

--burst K: also K starts at once per case (threads), p50/p99 of the single start's wall time under the burst;
--bursts R: R such bursts per case (the cases shuffled each time), p50/p99 over all R*K starts (one burst's p99 is
nearly its slowest start: at R=1 it moves by 20 ms between runs).

Besides the difference of medians (the targets' measure), each comparison is also taken round by round
(over_reference_paired_ms: the median of case - reference within each round, with a bootstrap 95% interval): a
round's two starts share that moment's host state, which a difference of medians keeps as noise.

--hop PATH (bench/exec_hop.c, built static): two more cases on the default limit's config, hop_sleep and hop_spin:
runc exec'd after --hop-us of nanosleep or of a busy CPU. Each over limit_default against --hop-us says whether a
wait of the front-end's length costs that much on this host, or more (over_reference_ms; not in the targets).

--settle-ms S: sleep S ms before each start (outside its timing), so that no start overlaps the kernel's deferred
teardown of the one before (its cgroup's and mount namespace's release after RCU grace periods, a few ms after the
delete). Back to back (S=0), runc started at once after the previous delete runs ahead of that teardown, and any
wait before runc lands in it: on this 2-core machine a 1.5 ms hop then cost +2.45 ms of create (95% +1.12 to
+3.24), and +1.55 (+0.53 to +2.71) after a 50 ms settle (bench/settle_bench.py). An engine's own work between
two starts (~200 ms for docker run) leaves every real start settled.

--own-config: each --runtime is run with its own install's runtime.json (PREFIX/bin/gpuprov-runtime ->
PREFIX/runtime.json), so two installs (this checkout's and an older one's) are timed in the same rounds, each with its
own warm editor (the editor's socket is named after GPUPROV_RUNTIME_CONFIG).

Targets: NAME_gpu and NAME_gpu_all <= their limit + 2 ms; NAME_nogpu <= runc + 1 ms (medians, same run).
Usage (on the GPU host, after `source .gpu-kit/env.sh`):
  python3 bench/runtime_bench.py --runtime [NAME=]PATH [--runtime ...] [-n 40] [--seed S] [--burst 32]
    [--hop exec_hop [--hop-us 1500]] [--settle-ms 50] [--own-config] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import bundle_dir, paired_diff_ci, quantile  # noqa: E402

from tests.oci import lifecycle, make_config, write_bundle  # noqa: E402

ALL = "NVIDIA_DRIVER_CAPABILITIES=all"
COMPARED = (("mounts",), ("linux", "devices"), ("linux", "resources", "devices"), ("hooks",), ("process", "env"),
            ("linux", "maskedPaths"), ("linux", "namespaces"))


def pick(cfg: dict, path: tuple[str, ...]):
    for k in path:
        cfg = cfg.get(k, {}) if isinstance(cfg, dict) else {}
    return cfg


def summary(v: list[float]) -> dict:
    return {"median_ms": round(statistics.median(v) * 1e3, 2), "p10_ms": round(quantile(v, 0.1) * 1e3, 2),
            "p90_ms": round(quantile(v, 0.9) * 1e3, 2)}


def edited_by(runtime: str, work: Path, rootfs: Path, env: list[str], name: str, environ: dict | None = None) -> dict:
    """The config.json the front-end hands runc: its create on a bundle (runc then runs it; deleted again)."""
    bundle = write_bundle(work / f"check-{name}", make_config(str(rootfs), ["/bin/true"], env))
    rc, out = lifecycle(runtime, bundle, env=environ)
    if rc != 0:
        raise SystemExit(f"{name}: create failed: {out}")
    return json.loads((bundle / "config.json").read_text())


def same_config(a: dict, b: dict) -> list[str]:
    """The compared parts that differ (the bundle path and container id aside, they must be equal)."""
    return [".".join(p) for p in COMPARED if pick(a, p) != pick(b, p)]


def burst(rt: str, cfg: dict, env: dict | None, work: Path, name: str, k: int) -> list[float]:
    bundles = [write_bundle(work / f"burst-{name}-{j}", cfg) for j in range(k)]
    times: list[float] = [0.0] * k
    go = threading.Event()

    def one(j: int) -> None:
        go.wait()
        t = time.perf_counter()
        rc, out = lifecycle(rt, bundles[j], env=env)
        times[j] = time.perf_counter() - t if rc == 0 else float("nan")

    threads = [threading.Thread(target=one, args=(j,)) for j in range(k)]
    for th in threads:
        th.start()
    go.set()
    for th in threads:
        th.join()
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", required=True, action="append", help="PATH or NAME=PATH; repeat to compare")
    ap.add_argument("-n", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--burst", type=int, default=0, help="K starts at once per case, after the rounds")
    ap.add_argument("--bursts", type=int, default=1, help="how many bursts per case (cases shuffled each time); "
                    "p50/p99 over all their starts")
    ap.add_argument("--by-predecessor", action="store_true")
    ap.add_argument("--hop", default=None, help="bench/exec_hop.c built: adds hop_sleep and hop_spin")
    ap.add_argument("--hop-us", type=int, default=1500, help="the hop's delay before runc create (us)")
    ap.add_argument("--settle-ms", type=float, default=0, help="sleep before each start, untimed (see above)")
    ap.add_argument("--own-config", action="store_true", help="each --runtime with its own install's runtime.json "
                    "(PREFIX/bin/gpuprov-runtime -> PREFIX/runtime.json): its own settings and warm editor")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)
    # Bundles (config.json only) on a tmpfs, as engines keep theirs (_timing.bundle_dir); the image where it fits.
    work = Path(tempfile.mkdtemp(prefix="gpuprov-bench-", dir=bundle_dir()))
    image_dir = Path(tempfile.mkdtemp(prefix="gpuprov-bench-image-"))
    rootfs = image_dir / "rootfs"
    shutil.copytree(os.environ["GPU_KIT_ROOTFS"], rootfs, symlinks=True)
    runtimes = dict(r.split("=", 1) if "=" in r else ("gpuprov", r) for r in args.runtime)
    # Two installs compared in the same rounds (--own-config) each need their own editor: its socket is named after
    # GPUPROV_RUNTIME_CONFIG. Otherwise every front-end runs with this process's environment.
    environs = {name: {**os.environ, "GPUPROV_RUNTIME_CONFIG": str(Path(path).resolve().parents[1] / "runtime.json")}
                if args.own_config else None for name, path in runtimes.items()}
    from provision.inject.modify import modify_bundle
    from provision.inject.settings import load_settings

    def limit_config(env: list[str], name: str) -> dict:
        pre = write_bundle(work / f"limit-{name}", make_config(str(rootfs), ["/bin/true"], env))
        modify_bundle(str(pre), load_settings())
        return json.loads((pre / "config.json").read_text())

    requests = {"default": ["NVIDIA_VISIBLE_DEVICES=all"], "all": ["NVIDIA_VISIBLE_DEVICES=all", ALL]}
    limits = {k: limit_config(env, k) for k, env in requests.items()}
    for name, path in runtimes.items():  # the limit is the limit only when the configs are the same
        for k, env in requests.items():
            diff = same_config(edited_by(path, work, rootfs, env, f"{name}-{k}", environs[name]), limits[k])
            if diff:
                print(f"{name} ({k}): the config it hands runc differs from the limit's in {', '.join(diff)}",
                      file=sys.stderr)
                return 3
    # case -> (the runtime, the config, its environment: None = this one)
    cases: dict[str, tuple[str, dict, dict | None]] = {"runc": ("runc", make_config(str(rootfs), ["/bin/true"]), None),
                                                       "limit_default": ("runc", limits["default"], None),
                                                       "limit_all": ("runc", limits["all"], None)}
    for name, path in runtimes.items():
        cases[f"{name}_nogpu"] = (path, make_config(str(rootfs), ["/bin/true"]), environs[name])
        cases[f"{name}_gpu"] = (path, make_config(str(rootfs), ["/bin/true"], requests["default"]), environs[name])
        cases[f"{name}_gpu_all"] = (path, make_config(str(rootfs), ["/bin/true"], requests["all"]), environs[name])
    if args.hop:
        hop_env = {**os.environ, "HOP_RUNC": shutil.which("runc") or "runc", "HOP_US": str(args.hop_us)}
        for mode in ("sleep", "spin"):
            cases[f"hop_{mode}"] = (args.hop, limits["default"], {**hop_env, "HOP_MODE": mode})
    times: dict[str, list[float]] = {k: [] for k in cases}
    phases: dict[str, dict[str, list[float]]] = {k: {} for k in cases}
    after: dict[str, dict[str, list[float]]] = {k: {} for k in cases}  # case -> predecessor -> create times
    prev = None
    for i in range(args.n + args.warmup):
        names = list(cases)
        rng.shuffle(names)
        for name in names:
            rt, cfg, env = cases[name]
            bundle = write_bundle(work / f"{name}-{i}", cfg)
            ph: dict[str, list[float]] = {}
            if args.settle_ms:
                time.sleep(args.settle_ms / 1e3)
            t = time.perf_counter()
            rc, out = lifecycle(rt, bundle, env=env, phases=ph)
            dt = time.perf_counter() - t
            shutil.rmtree(bundle, ignore_errors=True)
            if rc != 0:
                print(f"{name}: create failed: {out}", file=sys.stderr)
                return 2
            if i >= args.warmup:
                times[name].append(dt)
                for p, v in ph.items():
                    phases[name].setdefault(p, []).extend(v)
                after[name].setdefault(prev or "-", []).extend(ph.get("create", []))
            prev = name
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    res: dict = {"seed": seed, "n": args.n, "warmup": args.warmup, "settle_ms": args.settle_ms,
                 "cases": {k: summary(v) for k, v in times.items()},
                 "phases": {c: {p: summary(v) for p, v in ph.items()} for c, ph in phases.items()}}
    over = {}
    for name in runtimes:
        over[f"{name}_gpu"] = round(med[f"{name}_gpu"] - med["limit_default"], 2)
        over[f"{name}_gpu_all"] = round(med[f"{name}_gpu_all"] - med["limit_all"], 2)
        over[f"{name}_nogpu"] = round(med[f"{name}_nogpu"] - med["runc"], 2)
    for mode in ("sleep", "spin") if args.hop else ():  # a wait of hop_us alone, over the limit it runs
        over[f"hop_{mode}"] = round(med[f"hop_{mode}"] - med["limit_default"], 2)
    res["over_reference_ms"] = over  # GPU cases over their limit, no-GPU over bare runc
    paired = {}  # the same comparisons, round by round (both ran in that round): median and 95% interval, ms
    for name in runtimes:
        for case, ref in ((f"{name}_gpu", "limit_default"), (f"{name}_gpu_all", "limit_all"), (f"{name}_nogpu", "runc")):
            paired[case] = [round(x * 1e3, 2) for x in paired_diff_ci(times[case], times[ref], seed)]
    for mode in ("sleep", "spin") if args.hop else ():
        paired[f"hop_{mode}"] = [round(x * 1e3, 2) for x in paired_diff_ci(times[f"hop_{mode}"],
                                                                           times["limit_default"], seed)]
    res["over_reference_paired_ms"] = paired
    if args.hop:
        res["hop_us"] = args.hop_us
    res["ratios"] = {k: round(med[k] / med["runc"], 3) for k in cases}
    first = next(iter(runtimes))
    res["ok"] = (over[f"{first}_gpu"] <= 2 and over[f"{first}_gpu_all"] <= 2 and over[f"{first}_nogpu"] <= 1)
    if args.by_predecessor:
        res["create_by_predecessor_ms"] = {c: {p: round(statistics.median(v) * 1e3, 2) for p, v in sorted(ps.items())}
                                           for c, ps in after.items()}
    if args.burst:
        pooled: dict[str, list[float]] = {k: [] for k in cases}
        for r in range(args.bursts):
            for name in rng.sample(list(cases), len(cases)):
                rt, cfg, env = cases[name]
                pooled[name] += [x for x in burst(rt, cfg, env, work, f"{name}-{r}", args.burst) if x == x]
        b = {name: {"p50_ms": round(quantile(v, 0.5) * 1e3, 1), "p99_ms": round(quantile(v, 0.99) * 1e3, 1),
                    "ok_starts": len(v)} for name, v in pooled.items()}
        res["burst"] = {"k": args.burst, "bursts": args.bursts, "cases": b}
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(image_dir, ignore_errors=True)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"seed {seed}, n={args.n} after {args.warmup} warm-up rounds, shuffled each round, {args.settle_ms} ms "
              "settle before each start; medians (p10-p90) ms")
        for k, v in res["cases"].items():
            print(f"  {k:22} {v['median_ms']:7.2f} ({v['p10_ms']:.2f}-{v['p90_ms']:.2f})  {res['ratios'][k]:.3f}x runc  "
                  + "  ".join(f"{p} {s['median_ms']:.2f}" for p, s in res["phases"][k].items()))
        for k, v in over.items():
            lo_hi = paired[k]
            print(f"  {k:22} {v:+.2f} ms over its reference ({'runc' if k.endswith('_nogpu') else 'limit'}); "
                  f"round by round {lo_hi[0]:+.2f} (95% {lo_hi[1]:+.2f} to {lo_hi[2]:+.2f})")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
