#!/usr/bin/env python3
"""Time a no-change `gpuprov bootstrap` re-run on a bootstrapped fresh Debian 12 host (a host container, as in
tests/integration/test_bootstrap_e2e.py), against references measured in the same host in the same run: `docker
info` (the engine query any re-run has to make) and a bare start of the interpreter gpuprov runs on.

Target (issue 5): a re-run that changes nothing takes at most 2 s. Printed as a ratio; never asserted in the suite.
Usage: python3 bench/rerun_bench.py [-n 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import report  # noqa: E402

from tests.integration.hosts import Host  # noqa: E402

BOOT = "gpuprov bootstrap --yes --driver skip --json"
PY = "/opt/gpuprov/bin/python"


def timed(host: Host, script: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.monotonic()
        r = host.exec(script)
        out.append(time.monotonic() - t)
        if r.returncode != 0:
            raise SystemExit(f"{script!r} failed: {r.stderr.strip()[-400:]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    host = Host()
    try:
        r = host.exec("GPUPROV_WHEELHOUSE=/wh /src/install.sh --yes --driver skip", timeout=1800)
        if r.returncode != 0:
            raise SystemExit("install.sh failed: " + r.stderr.strip()[-600:])
        changed = json.loads(host.exec(BOOT).stdout)["changed"]
        rerun = statistics.median(timed(host, BOOT, args.n))
        ref = statistics.median(timed(host, "docker info >/dev/null", args.n))
        py = statistics.median(timed(host, f"{PY} -c pass", args.n))
    finally:
        host.remove()
    res = {"rerun_s": round(rerun, 2), "docker_info_s": round(ref, 2), "python_pass_s": round(py, 3),
           "rerun_vs_docker_info": round(rerun / ref, 2), "changed": changed, "target_s": 2.0}
    res["ok"] = changed == 0 and rerun <= 2.0
    return report(res, [f"docker exec … docker info     {ref:6.2f} s (reference)",
                        f"docker exec … python -c pass  {py:6.3f} s",
                        f"bootstrap re-run (0 changes)  {rerun:6.2f} s  ({rerun / ref:.2f}x docker info; "
                        f"target <= 2 s; changes: {changed})"], args.json)


if __name__ == "__main__":
    raise SystemExit(main())
