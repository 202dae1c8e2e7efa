#!/usr/bin/env python3
"""Time `gpuprov detect --json` on this machine's own / against `python3 -c pass` in the same run.

Targets (issue 2): detect median <= 150 ms wall; 100 --pci-id lookups in one call <= 250 ms.
Usage: python3 bench/detect_bench.py [-n 20] [--json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import median_ms, report, wall  # noqa: E402

IDS = ["10de:2330", "10de:1db4", "10de:2335:10de:18bf", "10de:0fc0", "10de:2901"] * 20  # 100 lookups


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    exe = Path(sys.executable).with_name("gpuprov")
    gp = [str(exe)] if exe.exists() else [sys.executable, "-m", "provision"]
    wall(gp + ["detect", "--json"], 2)  # warm the page cache and the engine-version cache
    ref = median_ms(wall([sys.executable, "-c", "pass"], args.n))
    det = median_ms(wall(gp + ["detect", "--json"], args.n))
    look = median_ms(wall(gp + ["detect", "--json", "--target", "debian-12"] +
                          [a for i in IDS for a in ("--pci-id", i)], args.n))
    res = {"python_pass_ms": round(ref, 1), "detect_json_ms": round(det, 1), "lookup100_ms": round(look, 1),
           "detect_vs_python": round(det / ref, 2), "lookup100_vs_python": round(look / ref, 2),
           "targets": {"detect_json_ms": 150, "lookup100_ms": 250}}
    res["ok"] = det <= 150 and look <= 250
    return report(res, [f"python3 -c pass        {ref:7.1f} ms (reference)",
                        f"gpuprov detect --json  {det:7.1f} ms  ({det / ref:.2f}x python; target <= 150 ms)",
                        f"100 --pci-id lookups   {look:7.1f} ms  ({look / ref:.2f}x python; target <= 250 ms)"], args.json)


if __name__ == "__main__":
    raise SystemExit(main())
