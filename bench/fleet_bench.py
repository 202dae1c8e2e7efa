#!/usr/bin/env python3
"""Wall time of `ansible-playbook site.yml` for 1 fresh host vs 3 fresh hosts, and of the no-change re-run,
all in one run on this machine (hosts are containers reached through `docker exec`).

Target (issue 5): 3 hosts <= 1.5x one host.  Usage: python3 bench/fleet_bench.py [--json]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import report  # noqa: E402

from tests.integration.fleet import playbook, write_inventory  # noqa: E402
from tests.integration.hosts import Host, ensure_image, ensure_wheelhouse  # noqa: E402


def timed(inv: Path) -> tuple[float, dict]:
    t = time.monotonic()
    rc, out, recap = playbook(inv)
    if rc != 0:
        raise SystemExit(f"playbook failed:\n{out[-2000:]}")
    return time.monotonic() - t, recap


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ensure_image()
    ensure_wheelhouse()
    work = Path(tempfile.mkdtemp(prefix="gpuprov-fleet-bench-"))
    hosts: list[Host] = []
    try:
        one = [Host()]
        hosts += one
        t1, _ = timed(write_inventory(work / "one.yml", one))
        three = [Host() for _ in range(3)]
        hosts += three
        inv3 = write_inventory(work / "three.yml", three)
        t3, _ = timed(inv3)
        tr, recap = timed(inv3)
    finally:
        for h in hosts:
            h.remove()
    res = {"one_host_s": round(t1, 1), "three_hosts_s": round(t3, 1), "ratio": round(t3 / t1, 2),
           "rerun_three_hosts_s": round(tr, 1), "rerun_changed": sum(r["changed"] for r in recap.values()),
           "target_ratio": 1.5}
    res["ok"] = res["ratio"] <= 1.5 and res["rerun_changed"] == 0
    return report(res, [f"1 fresh host        {t1:6.1f} s (reference)",
                        f"3 fresh hosts       {t3:6.1f} s  {t3 / t1:.2f}x  (target <= 1.5x)",
                        f"re-run, 3 hosts     {tr:6.1f} s  changed={res['rerun_changed']}"], args.json)


if __name__ == "__main__":
    raise SystemExit(main())
