#!/usr/bin/env bash
# On a lent GPU host (2+ GPUs): carry .gpu-kit/{bin,lib,env.sh} and .gpu-k8s (containerd-min.tar.xz: Debian's
# containerd, shim and ctr; whl/: grpcio, grpcio-tools, protobuf, distro, tomlkit wheels for the host's Python).
set -uo pipefail
export OUT=${OUT:-/tmp/k8s-proof}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-k8s/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
source .gpu-kit/env.sh
mkdir -p /tmp/ckit && tar -xJf .gpu-k8s/containerd-min.tar.xz -C /tmp/ckit
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m provision "$@"\n' > /tmp/bin/gpuprov && chmod +x /tmp/bin/gpuprov
export PATH=/tmp/bin:/tmp/ckit/usr/bin:$PATH CKIT=/tmp/ckit/usr/bin
timeout 300 python3 tests/gpu/k8s_proof.py 2>&1 | tee "$OUT/proof-log.txt" | tail -80
