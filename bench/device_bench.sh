#!/usr/bin/env bash
# One batched run on a lent GPU host: the container-start benchmark (bench/runtime_bench.py) with three front-ends
# in the same run, interleaved: "after" = the wheel's static binary installed by install_runtime (this checkout),
# "before" = the shim.c of the reference revision (built here by bench/device_bench_prep.sh, dynamic, -D paths),
# "after_dyn" = this shim.c linked dynamically like "before" (separates the safety's cost from the static link's
# gain). Then one GPU container running nvidia-smi -L through "after". Results under $OUT.
# Prepared by bench/device_bench_prep.sh into /work/main/.gpu-h-runtime (carried); runs from /tmp/g there.
set -uo pipefail
out=${OUT:-/tmp/gpuprov-out}; mkdir -p "$out"
rm -rf /tmp/g && cp -a .gpu-h-runtime /tmp/g && cd /tmp/g || exit 1
source kit/env.sh
export PYTHONUNBUFFERED=1 GPUPROV_RUNTIME_CONFIG=/tmp/rt/runtime.json
{ nvidia-smi -L; uname -r; python3 --version; runc --version | head -1; command -v cc gcc; } > "$out/host.txt" 2>&1
droot=/; [ -x /usr/local/nvidia/bin/nvidia-smi ] && droot=/usr/local/nvidia
python3 -I -S - "$droot" > "$out/install.json" 2>&1 <<'PY'
import json, sys
sys.path.insert(0, ".")
from provision.inject.install import install_runtime
r = install_runtime("/tmp/rt", driver_root=sys.argv[1])
print(json.dumps({"runtime": r.runtime_path, "compiled": r.compiled, "origin": r.origin, "notes": r.notes}))
PY
cat "$out/install.json"
python3 bench/runtime_bench.py --runtime after=/tmp/rt/bin/gpuprov-runtime --runtime before=/tmp/g/before \
  --runtime after_dyn=/tmp/g/after_dyn -n "${BENCH_N:-60}" --json 2>&1 | tee "$out/bench-runtime.json"
python3 -I -S - > "$out/nvidia-smi-in-container.txt" 2>&1 <<'PY'
import os, sys
from pathlib import Path
sys.path.insert(0, ".")
from tests.oci import lifecycle, make_config, write_bundle
b = write_bundle(Path("/tmp/smi"), make_config(os.environ["GPU_KIT_ROOTFS"], ["nvidia-smi", "-L"],
                                                ["NVIDIA_VISIBLE_DEVICES=all"]))
rc, text = lifecycle("/tmp/rt/bin/gpuprov-runtime", b)
print(rc, text)
PY
cat "$out/nvidia-smi-in-container.txt"
