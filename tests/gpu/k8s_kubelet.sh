#!/usr/bin/env bash
# On a lent GPU host: carry .gpu-kubelet (tests/gpu/kubelet_kit.sh). Runs tests/gpu/k8s_kubelet.py; results in $OUT.
set -uo pipefail
export OUT=${OUT:-/tmp/k8s-kubelet}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-kubelet/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/kkit && tar -xJf .gpu-kubelet/bin.tar.xz -C /tmp/kkit
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m provision "$@"\n' > /tmp/bin/gpuprov && chmod +x /tmp/bin/gpuprov
export PATH=/tmp/bin:/tmp/kkit/bin:$PATH KIT=/tmp/kkit/bin LD_LIBRARY_PATH=/tmp/kkit/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{ nvidia-smi -L; uname -r; python3 --version; } > "$OUT/host.txt" 2>&1
timeout 480 python3 tests/gpu/k8s_kubelet.py 2>&1 | tee "$OUT/proof-log.txt" | tail -60
