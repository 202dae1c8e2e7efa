#!/usr/bin/env python3
"""docker-level start cost (issue 41 item 3): `docker run --gpus all` against `docker run --runtime runc`, same
dockerd, same image, same run. n runs per case, every round in a freshly shuffled order (seeded, printed); the
ratio of medians with a bootstrap 95% confidence interval (resampling each case's runs; and `ci95_paired`, resampling
whole rounds, each of which ran every case once), and p10/p90 per case.

Cases: runc (`--runtime runc`), gpu (`--gpus all`, through the default runtime gpuprov-runtime), nogpu (the default
runtime, no GPU asked). Target: gpu/runc <= 1.03 (the interval says whether the data can decide it).
--decompose adds gpu_env and limit (see EXTRA): whether what is over runc is dockerd's --gpus work, runc's own work
on the driver's files, or gpuprov's edit.
Usage: python3 bench/docker_bench.py --image IMAGE [-n 100] [--seed S] [--decompose [--state-root DIR]] [--json]
(DOCKER_HOST as docker reads it)"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

from _timing import interval95, quantile

CASES = {"runc": ["--runtime", "runc"], "gpu": ["--gpus", "all"], "nogpu": []}
# --decompose: where a GPU start's extra milliseconds are at this level. gpu_env asks for the GPU through the runtime
# alone (no --gpus: none of dockerd's device-request work, no hook in the spec); limit is plain runc handed the same
# devices and read-only binds through docker's own flags (read from a --gpus container's edited config.json): what
# any runtime that mounts the driver file by file costs here, gpuprov's edit aside.
EXTRA = {"gpu_env": ["-e", "NVIDIA_VISIBLE_DEVICES=all"]}


def limit_flags(image: str, state_roots: list[str], dev_root: str = "/") -> list[str]:
    """`--runtime runc` with the devices and binds that gpuprov gave a `--gpus all` container: the container is
    started (sleeping), its bundle's config.json read from the engine's state and compared with a plain container's
    (what is extra is gpuprov's), then both are removed."""
    import glob

    def config_of(*flags: str) -> dict:
        cid = subprocess.run(["docker", "run", "-d", "--network", "none", *flags, image, "/bin/busybox", "sleep", "60"],
                             capture_output=True, text=True, check=True).stdout.strip()
        try:
            for root in state_roots:
                for path in glob.glob(f"{root}/**/{cid}/config.json", recursive=True):
                    with open(path) as fh:
                        return json.load(fh)
            raise SystemExit(f"no config.json of {cid[:12]} under {', '.join(state_roots)}")
        finally:
            subprocess.run(["docker", "rm", "-f", cid], capture_output=True)

    return extra_flags(config_of("--gpus", "all"), config_of(), dev_root)


def extra_flags(gpu: dict, plain: dict, dev_root: str = "/") -> list[str]:
    """docker flags for what `gpu`'s config has over `plain`'s: its binds (read-only) and its devices (each from
    `dev_root` on the host: the runtime's dev_root)."""
    have = {m["destination"] for m in plain.get("mounts", [])}
    flags = ["--runtime", "runc"]
    for m in gpu.get("mounts", []):
        if m["destination"] not in have and m.get("type", "bind") == "bind":
            flags += ["--mount", f"type=bind,src={m['source']},dst={m['destination']},readonly"]
    plain_dev = {d["path"] for d in plain.get("linux", {}).get("devices", [])}
    for d in gpu.get("linux", {}).get("devices", []):
        if d["path"] not in plain_dev:
            flags += ["--device", f"{dev_root.rstrip('/')}{d['path']}:{d['path']}"]
    return flags


def ratio_ci(a: list[float], b: list[float], rng: random.Random, reps: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of median(a) / median(b)."""
    return interval95([statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
                       for _ in range(reps)])


def ratio_ci_paired(a: list[float], b: list[float], rng: random.Random, reps: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of median(a) / median(b), resampling whole rounds (a[i] and b[i] ran in the same
    round): the host's drift over the run moves both sides of a round alike."""
    rs = []
    for _ in range(reps):
        idx = rng.choices(range(len(a)), k=len(a))
        rs.append(statistics.median(a[i] for i in idx) / statistics.median(b[i] for i in idx))
    return interval95(rs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", required=True)
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--decompose", action="store_true", help="also the cases gpu_env and limit (see EXTRA)")
    ap.add_argument("--state-root", action="append", default=None,
                    help="where the engine's containerd keeps bundles (for --decompose; default /run/containerd and /run/docker)")
    ap.add_argument("--dev-root", default="/", help="where the runtime's device nodes are on the host (--decompose)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)
    cases = dict(CASES)
    if args.decompose:
        cases.update(EXTRA)
        try:
            cases["limit"] = limit_flags(args.image, args.state_root or ["/run/containerd", "/run/docker"],
                                         args.dev_root)
        except (subprocess.CalledProcessError, OSError, ValueError, KeyError, SystemExit) as exc:
            print(f"no docker-level limit: {exc}", file=sys.stderr)  # the other cases still run
    times: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(args.n + args.warmup):
        order = list(cases)
        rng.shuffle(order)
        for case in order:
            argv = ["docker", "run", "--rm", "--network", "none", *cases[case], args.image, "/bin/true"]
            t = time.perf_counter()
            r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            dt = time.perf_counter() - t
            if r.returncode != 0:
                print(f"{case}: {' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}", file=sys.stderr)
                return 2
            if i >= args.warmup:
                times[case].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    lo, hi = ratio_ci(times["gpu"], times["runc"], rng)
    plo, phi = ratio_ci_paired(times["gpu"], times["runc"], rng)
    res = {"seed": seed, "n": args.n, "cases": {k: {"median_ms": round(med[k] * 1e3, 1),
                                                    "p10_ms": round(quantile(v, 0.1) * 1e3, 1),
                                                    "p90_ms": round(quantile(v, 0.9) * 1e3, 1)}
                                                for k, v in times.items()},
           "gpu_over_runc": round(med["gpu"] / med["runc"], 4), "ci95": [round(lo, 4), round(hi, 4)],
           "ci95_paired": [round(plo, 4), round(phi, 4)], "nogpu_over_runc": round(med["nogpu"] / med["runc"], 4)}
    if args.decompose:  # each extra case over runc, and gpu over the docker-level limit (the same devices and binds)
        res["over_runc"] = {k: round(med[k] / med["runc"], 4) for k in cases if k != "runc"}
    if "limit" in cases:
        res["gpu_over_limit"] = round(med["gpu"] / med["limit"], 4)
        res["gpu_over_limit_ci95_paired"] = [round(x, 4) for x in ratio_ci_paired(times["gpu"], times["limit"], rng)]
        res["limit_binds"] = sum(1 for f in cases["limit"] if f == "--mount")
    res["ok"] = res["gpu_over_runc"] <= 1.03
    res["decided"] = hi <= 1.03 or lo > 1.03
    if args.json:
        print(json.dumps(res))
    else:
        print(f"seed {seed}, n={args.n} per case, shuffled each round; ms median (p10-p90)")
        for k, v in res["cases"].items():
            print(f"  {k:6} {v['median_ms']:7.1f} ({v['p10_ms']:.1f}-{v['p90_ms']:.1f})")
        print(f"  --gpus all / --runtime runc = {res['gpu_over_runc']:.4f} (95% CI {lo:.4f}-{hi:.4f}, rounds resampled "
              f"{plo:.4f}-{phi:.4f}; target <= 1.03)")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
