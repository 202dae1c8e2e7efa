#!/usr/bin/env bash
# MIG on a real GPU host, READ ONLY (issue 30): never changes MIG mode or layout (no `nvidia-smi -mig`, no
# `nvidia-smi mig -cgi/-dgi/-cci/-dci`). Captures what the host shows (mig.mode.current, /proc caps, nvidia-caps nodes)
# under $OUT, then checks that a host with MIG disabled behaves as before gpuprov read MIG: discovery records no
# layout, the cache key carries no MIG layout, a whole-GPU container's edits have no caps node, and a
# MIG selector is refused in one line. Needs only python3 and the repository (PYTHONPATH=$PWD); no engine.
#   Run from the repository root on the GPU host: OUT=/tmp/mig-out bash tests/gpu/mig_readonly.sh
# With MIG enabled and instances present it still only reads: the check then prints the layout it found instead.
set -uo pipefail
OUT=${OUT:-/tmp/gpuprov-mig-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD
{ nvidia-smi --query-gpu=index,pci.bus_id,name,mig.mode.current,mig.mode.pending --format=csv; } > "$OUT/mig-mode.csv" 2>&1
nvidia-smi -L > "$OUT/nvidia-smi-L.txt" 2>&1
nvidia-smi mig -lgi > "$OUT/mig-lgi.txt" 2>&1   # lists only; "No GPU instances found" or an error when MIG is off
grep -E "nvidia" /proc/devices > "$OUT/proc-devices.txt"
( cd /proc/driver/nvidia && find capabilities -print -type f -exec sed 's/^/    /' {} \; ) > "$OUT/proc-caps.txt" 2>&1
cat /proc/driver/nvidia-caps/mig-minors > "$OUT/mig-minors.txt" 2>&1
ls -la /dev/nvidia-caps/ > "$OUT/dev-nvidia-caps.txt" 2>&1
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/mig-check.txt"
import json, subprocess, sys
from provision.inject import discover, edits, mig
out = sys.argv[1]
modes = subprocess.run(["nvidia-smi", "--query-gpu=mig.mode.current", "--format=csv,noheader"],
                       capture_output=True, text=True).stdout.split()
root = "/usr/local/nvidia" if __import__("os").path.isdir("/usr/local/nvidia/lib64") else "/"
disc = discover.discover(root, arch=True)
json.dump(disc.to_dict(), open(f"{out}/discovery.json", "w"), indent=1)
print("mig.mode.current:", modes, "| discovered MIG devices:", len(disc.mig.devices) if disc.mig else 0)
ok = True
if all(m == "Disabled" for m in modes):
    first = open("/proc/driver/nvidia/version").read().split("\n")[0]
    checks = {
        "no MIG devices recorded": disc.mig is None or not disc.mig.devices,
        "cache key has no MIG layout (MIG off)": discover.host_key().startswith(first + "|")
                                                and mig.layout_key("/") == "",
        "whole-GPU edits have no caps node": not any("nvidia-caps" in d.path for d in
                                                     edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "all"}).devices),
    }
    try:
        edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "0:0"})
        checks["MIG selector refused"] = False
    except edits.Refused as exc:
        checks["MIG selector refused"] = "\n" not in str(exc)
        print("refusal:", exc)
    for name, good in checks.items():
        print("PASS" if good else "FAIL", name)
        ok &= good
else:
    for d in disc.mig.devices if disc.mig else ():
        print(" ", d.names(), d.profile, [n.path for n in d.nodes])
sys.exit(0 if ok else 1)
PY
echo "mig_readonly rc=${PIPESTATUS[0]}"
