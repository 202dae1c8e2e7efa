"""`gpuprov metrics` on a real GPU host, READ ONLY (issues 28.15 and 30): NVML through the real pynvml, the text through
prometheus_client, parsed back with prometheus_client's parser. Never changes MIG mode or layout: it reads
`mig.mode.current`, and on a GPU with MIG off also asks NVML for MIG devices (nvmlDeviceGetMaxMigDeviceCount,
nvmlDeviceGetMigDeviceHandleByIndex: reads), to show that the real library's refusals give no MIG device and no
failure. Needs python3, the repository on PYTHONPATH and nvidia-ml-py + prometheus-client importable.
    OUT=/tmp/m PYTHONPATH=$PWD:<deps> python3 tests/gpu/metrics_readonly.py"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pynvml
from prometheus_client.parser import text_string_to_metric_families

from provision.metrics import nvml, prom, usage

out = os.environ.get("OUT", "/tmp/gpuprov-metrics-out")
os.makedirs(out, exist_ok=True)
modes = subprocess.run(["nvidia-smi", "--query-gpu=index,name,mig.mode.current", "--format=csv,noheader"],
                       capture_output=True, text=True).stdout.strip().splitlines()
t0 = time.perf_counter()
snap = nvml.snapshot()
t1 = time.perf_counter()
text = prom.render(snap, usage.by_container(snap), "gpu-host")
t2 = time.perf_counter()
open(f"{out}/metrics.prom", "w").write(text)
fams = {f.name: f for f in text_string_to_metric_families(text)}
checks = {
    "every GPU has DCGM_FI_DEV_FB_TOTAL": len(fams["DCGM_FI_DEV_FB_TOTAL"].samples) >= len(snap.gpus) > 0,
    "counters keep DCGM-exporter's names": "_total{" not in text and "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL" in fams,
}
pynvml.nvmlInit()
try:
    for g in snap.gpus:
        if not g.mig_enabled:  # MIG off: the real NVML's answers to the MIG reads give no device and raise nothing
            h = pynvml.nvmlDeviceGetHandleByIndex(g.index)
            checks[f"GPU {g.index} MIG off: no MIG device read"] = nvml._mig_devices(pynvml, h, g.index) == [] \
                and g.mig_devices == [] and "gpuprov_mig_device_info" not in fams
finally:
    pynvml.nvmlShutdown()
report = {"mig.mode.current": modes, "snapshot_s": round(t1 - t0, 4), "render_s": round(t2 - t1, 4),
          "checks": checks, "gpus": [(g.name, g.mig_capable, g.mig_enabled, len(g.mig_devices)) for g in snap.gpus]}
json.dump(report, open(f"{out}/metrics-check.json", "w"), indent=1)
print(json.dumps(report, indent=1))
sys.exit(0 if all(checks.values()) else 1)
