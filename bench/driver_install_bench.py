#!/usr/bin/env python3
"""What gpuprov adds to a driver install: `gpuprov bootstrap --for-gpu 10de:2330` (an H100, the open module built by
DKMS) on a fresh systemd Debian 12 host, against a plain `apt-get install` of the very package set its plan names on a
second fresh host from the same image, started at the same instant, each host on its own half of this machine's CPUs:
both see the same load, archive and caches, and neither's DKMS build waits on the other's, so the difference is what
gpuprov adds. (Run one after the other, the 200 s DKMS build varied by 15-30 s between two hosts on a 2-core machine;
side by side on shared CPUs, by up to 13 s.) Noise is met as benchmarks meet it: --rounds pairs of fresh hosts, the
best time of each side compared.

It prints both sides and the difference, and exits 1 when the difference is over --bound seconds (default 10). The
hosts are those of tests/integration/test_driver_install.py (tests/integration/driver_hosts.py: image built once).

Usage (root, docker running): python3 bench/driver_install_bench.py [--rounds 2] [--bound 10] [--json]"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.driver_hosts import KernelHost, kernel_image  # noqa: E402

GPU = "10de:2330"
BOOT = f"gpuprov bootstrap --yes --for-gpu {GPU} --engine none --no-validate --json"
COMPONENTS = r"sed -i -E 's/^(deb .*) main$/\1 main contrib non-free non-free-firmware/' /etc/apt/sources.list"


def cpu_halves() -> tuple[str | None, str | None]:
    """Two disjoint, equal sets of this machine's CPUs (docker's --cpuset-cpus form), or no pinning on one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    k = len(cpus) // 2
    if not k:
        return None, None
    return ",".join(map(str, cpus[:k])), ",".join(map(str, cpus[k:2 * k]))


def _timed(host: KernelHost, script: str, timeout: float = 2400):
    t = time.monotonic()
    r = host.exec(script, timeout=timeout)
    return r, time.monotonic() - t


def planned_packages(host: KernelHost) -> list[str]:
    r = host.exec(f"gpuprov plan --for-gpu {GPU} --engine none --json")
    assert r.returncode == 0, r.stdout + r.stderr
    step = next(s for s in json.loads(r.stdout)["steps"] if s["id"] == "driver.packages")
    cmd = next(a for a in step["actions"] if "apt-get install" in a)
    return cmd.split("--no-install-recommends", 1)[1].split()


def one_round(cpus: tuple[str | None, str | None]) -> tuple[float, float, int]:
    """(gpuprov's seconds, plain apt's seconds, the number of packages) on two fresh hosts, side by side."""
    h = KernelHost("bookworm", "bench-gpuprov", cpus=cpus[0], share_builds=False)  # both sides build
    ref = KernelHost("bookworm", "bench-apt", cpus=cpus[1], share_builds=False)
    try:
        h.install_gpuprov()
        packages = planned_packages(h)
        ref.exec(COMPONENTS, check=True)
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(_timed, ref, "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y "
                                "--no-install-recommends " + " ".join(packages))
            r, took = _timed(h, BOOT)
            rr, apt_took = plain.result()
        if rr.returncode != 0 or r.returncode != 7:  # 7: installed, the reboot recorded
            raise SystemExit(f"a side failed: apt exit {rr.returncode}, gpuprov exit {r.returncode}\n"
                             + rr.stderr[-1500:] + r.stderr[-1500:])
        return took, apt_took, len(packages)
    finally:
        h.remove()
        ref.remove()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bound", type=float, default=10.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    kernel_image("bookworm")  # built once, before any timing starts
    cpus = cpu_halves()
    rounds = [one_round(cpus) for _ in range(args.rounds)]
    took, apt_took = min(r[0] for r in rounds), min(r[1] for r in rounds)
    res = {"gpuprov_s": round(took, 1), "apt_s": round(apt_took, 1), "difference_s": round(took - apt_took, 1),
           "bound_s": args.bound, "packages": rounds[0][2], "cpus": list(cpus),
           "rounds": [[round(g, 1), round(a, 1)] for g, a, _ in rounds]}
    res["ok"] = res["difference_s"] <= args.bound
    if args.json:
        print(json.dumps(res))
    else:
        print(f"gpuprov bootstrap {took:.1f} s, plain apt-get install of the same {res['packages']} packages "
              f"{apt_took:.1f} s: difference {took - apt_took:+.1f} s (bound {args.bound:.0f} s; best of "
              f"{args.rounds} rounds {res['rounds']}, side by side on CPUs {cpus[0]} and {cpus[1]})")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
