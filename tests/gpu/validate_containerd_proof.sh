#!/usr/bin/env bash
# On a lent GPU host: carry .gpu-ctrval (bin/runc + lib/libseccomp from .gpu-kit, containerd-min.tar.xz from .gpu-k8s,
# whl/ distro + tomlkit, src/ this checkout). Results: $OUT/validate-containerd.json.
set -uo pipefail
export OUT=${OUT:-/tmp/validate-proof}; mkdir -p "$OUT"
K=$PWD/.gpu-ctrval
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$K"/whl/*.whl
export PYTHONPATH=/tmp/site:$K/src PYTHONUNBUFFERED=1 GPUPROV_RUN_DIR=/tmp/gpuprov-run GPUPROV_STATE_DIR=/tmp/gpuprov-state
export PATH=$K/bin:$PATH LD_LIBRARY_PATH=$K/lib
mkdir -p /tmp/ckit && tar -xJf "$K/containerd-min.tar.xz" -C /tmp/ckit
export CKIT=/tmp/ckit/usr/bin
cd "$K/src" && timeout 300 python3 tests/gpu/validate_containerd_proof.py 2>&1 | tee "$OUT/log.txt" | tail -70
