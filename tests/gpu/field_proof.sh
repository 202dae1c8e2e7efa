#!/usr/bin/env bash
# Issue 26 on a lent GPU host, one batched run (the lead runs it; never changes the host's settings: the only writes
# are /dev/char links, which go with /dev at reboot, and files under /tmp). Carry .gpu-kit and .whl as device_run.sh.
#   1. `gpuprov runtime install` (loads nvidia-uvm if it is not, makes missing nodes and their /dev/char links)
#   2. every node a GPU container gets has /dev/char/MAJ:MIN (tests/gpu/field_proof.py), brand read from the driver
#   3. CUDA through runc on this host's cgroup (v2 on the lent hosts) with them (test_gpu_runtime's vadd)
#   4. start cost: plain runc vs gpuprov-runtime, same run (bench/runtime_bench.py)
# Results under $OUT: field-proof.json, pytest-cuda.txt, bench-runtime.txt, host.txt.
set -uo pipefail
out=${OUT:-/tmp/gpuprov-out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GPUPROV_RUNTIME_CONFIG=/tmp/rt/runtime.json
source .gpu-kit/env.sh
{ nvidia-smi -L; uname -r; stat -fc %T /sys/fs/cgroup; ls -la /dev/char 2>&1 | head -3; grep -c nvidia /proc/modules
  nvidia-smi --query-gpu=pci.bus_id,brand --format=csv,noheader; } > "$out/host.txt" 2>&1
python3 -m provision runtime install --prefix /tmp/rt --json > "$out/install.json" 2>&1
python3 - <<'PY'
import json; p="/tmp/rt/runtime.json"; c=json.load(open(p)); c["cache"]="/tmp/rt/discovery.json"; json.dump(c, open(p,"w"))
PY
python3 tests/gpu/field_proof.py > "$out/field-proof.json" 2>&1; echo "field_proof rc=$?" | tee -a "$out/host.txt"
python3 -m pytest -m gpu -rs -v tests/gpu/test_gpu_runtime.py -k "cuda_program or nvidia_smi_in" 2>&1 | tee "$out/pytest-cuda.txt" | tail -5
python3 bench/runtime_bench.py --runtime /tmp/rt/bin/gpuprov-runtime -n ${BENCH_N:-30} 2>&1 | tee "$out/bench-runtime.txt"
