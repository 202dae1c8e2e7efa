#!/usr/bin/env bash
# One batched run on a lent GPU host (bare: no engine, no registry): a real dockerd with gpuprov-runtime as its
# default runtime and CDI on, then tests/gpu/test_gpu_docker.py (docker --gpus, NVIDIA_VISIBLE_DEVICES, CDI names,
# CUDA, EGL/Vulkan headless, NVDEC decode, refusals, gpuprov verify, CDI spec vs nvidia-ctk's) and the start-cost
# benchmark (bare runc vs no-GPU vs compute vs all capabilities). Results under $OUT.
# Carry CAPS_KIT (default .gpu-caps, from tests/gpu/prepare_caps_kit.sh). Rehearse: CAPS_DRY=1 stops before dockerd.
set -uo pipefail
# Everything goes to $out; $OUT gets the key files and one archive of all (the device tool returns 8 files at most).
OUT=${OUT:-/tmp/gpuprov-out}; out=/tmp/caps-results; mkdir -p "$OUT" "$out"; K=${CAPS_KIT:-.gpu-caps}
finish() {
  cp /tmp/dockerd.log "$out/dockerd.log" 2>/dev/null
  tar -C "$out" -czf "$OUT/caps-results.tgz" .
  for f in pytest-docker.txt docker-results.json bench-runtime.txt nvidia-ctk-spec.yaml gpuprov-cdi.yaml; do
    cp "$out/$f" "$OUT/" 2>/dev/null; done
}
trap finish EXIT
log() { echo "[$(date +%T)] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$K"/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GPUPROV_LOCK_DIR=/tmp/gpuprov-lock
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m provision "$@"\n' > /tmp/bin/gpuprov && chmod +x /tmp/bin/gpuprov
export PATH=/tmp/bin:/usr/local/bin:$PATH
xz -dc "$K/runc.xz" > /usr/sbin/runc && chmod 755 /usr/sbin/runc && cp -L "$K"/lib/* /usr/local/lib/ && ldconfig
tar -xJf "$K/docker-cdi.tar.xz" -C /
# A dockerd of our own (own socket, data, exec root, config): a warm machine may still run someone else's.
export DOCKER_HOST=unix:///tmp/caps-docker.sock; cfg=/tmp/caps-daemon.json; mkdir -p /tmp/tiny
echo '{"iptables": false, "ip6tables": false, "bridge": "none", "ip-masq": false, "userland-proxy": false}' > $cfg  # no docker-proxy in the kit
{ nvidia-smi -L; uname -r; ldd /usr/local/nvidia/lib64/libGLX_nvidia.so.0; runc --version | head -1; dockerd --version; docker --version; } > "$out/host.txt" 2>&1
log "gpuprov runtime install / engine configure docker --default --cdi / cdi refresh"
gpuprov runtime install --json > "$out/install.json" 2>&1; echo "runtime install rc=$?"
gpuprov engine configure docker --config $cfg --default --cdi --no-restart > "$out/engine.txt" 2>&1; echo "engine configure rc=$?"
gpuprov cdi refresh > "$out/cdi-refresh.txt" 2>&1; echo "cdi refresh rc=$?"; cat "$out/cdi-refresh.txt"
cp $cfg "$out/daemon.json"; cp /var/run/cdi/nvidia.yaml "$out/gpuprov-cdi.yaml" 2>/dev/null
[ -n "${CAPS_DRY:-}" ] && exit 0
log "dockerd"
(setsid dockerd --config-file $cfg -H $DOCKER_HOST --data-root /var/lib/caps-docker --exec-root /tmp/caps-exec \
   --pidfile /tmp/caps-docker.pid > /tmp/dockerd.log 2>&1 &)
for _ in $(seq 60); do docker info > /dev/null 2>&1 && break; sleep 0.5; done
docker info 2>&1 | grep -iE "server version|runtimes|default runtime|cdi" > "$out/docker-info.txt"
cat "$out/docker-info.txt"
tar -xJf "$K/tiny.tar.xz" -C /tmp/tiny
tar -C /tmp/tiny -c . | docker import - caps-tiny > /dev/null
docker tag caps-tiny "$(python3 -c 'from provision.engines.validate import IMAGE; print(IMAGE)')"
docker import "$K/gfx.tar.xz" caps-gfx > /dev/null
log "CUDA image (nvcc here)"
cp -a /tmp/tiny /tmp/cuda-rootfs
GPU_KIT_ROOTFS=/tmp/tiny python3 -c "
from pathlib import Path; import tempfile
from tests.gpu.test_gpu_runtime import VADD, build_cuda
build_cuda(Path('/tmp/cuda-rootfs'), VADD, 'vadd', Path(tempfile.mkdtemp()))" && \
  tar -C /tmp/cuda-rootfs -c . | docker import - caps-cuda > /dev/null
log "nvidia-ctk cdi generate (reference)"
xz -dc "$K/nvidia-ctk.xz" > /tmp/nvidia-ctk && chmod +x /tmp/nvidia-ctk
/tmp/nvidia-ctk cdi generate --output "$out/nvidia-ctk-spec.yaml" > "$out/nvidia-ctk.log" 2>&1
echo "nvidia-ctk rc=$? ($(cat "$K/nvidia-ctk.version" 2>/dev/null))"
log "pytest tests/gpu/test_gpu_docker.py"
GPUPROV_GPU_OUT=$out/docker-results.json CAPS_NVIDIA_CTK_SPEC=$out/nvidia-ctk-spec.yaml \
  timeout 300 python3 -m pytest -p no:cacheprovider -m gpu -rs -v tests/gpu/test_gpu_docker.py 2>&1 \
  | tee "$out/pytest-docker.txt" | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed|assert" | head -60
log "start-cost benchmark"
GPU_KIT_ROOTFS=/tmp/tiny timeout 200 python3 bench/runtime_bench.py --runtime /usr/local/bin/gpuprov-runtime \
  -n "${BENCH_N:-30}" 2>&1 | tee "$out/bench-runtime.txt"
log done
