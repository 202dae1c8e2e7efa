#!/usr/bin/env bash
# One batched run on a lent GPU host: detect, the gpu-marked tests, the runtime benchmark. Results under $OUT.
# Carry .gpu-kit (gpu-host-kit.sh) and .whl (distro, typer wheels).
set -uo pipefail
out=${OUT:-/tmp/gpuprov-out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
source .gpu-kit/env.sh
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m provision "$@"\n' > /tmp/bin/gpuprov && chmod +x /tmp/bin/gpuprov
export PATH=/tmp/bin:$PATH
{ nvidia-smi -L; uname -r; python3 --version; runc --version | head -1; } > "$out/host.txt" 2>&1
python3 -m provision detect > "$out/detect.txt" 2>&1; python3 -m provision detect --json > "$out/detect.json" 2>&1
GPUPROV_GPU_OUT=$out/gpu-results.json python3 -m pytest -m gpu -rs -v tests/gpu 2>&1 | tee "$out/pytest-gpu.txt" | tail -30
export GPUPROV_RUNTIME_CONFIG=/tmp/rt/runtime.json
python3 -m provision runtime install --prefix /tmp/rt --json > "$out/install.json" 2>&1
python3 - <<'PY'
import json; p="/tmp/rt/runtime.json"; c=json.load(open(p)); c["cache"]="/tmp/rt/discovery.json"; json.dump(c, open(p,"w"))
PY
python3 bench/runtime_bench.py --runtime /tmp/rt/bin/gpuprov-runtime -n ${BENCH_N:-30} 2>&1 | tee "$out/bench-runtime.txt"
