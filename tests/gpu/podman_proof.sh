#!/usr/bin/env bash
# On a lent GPU host with no container engine and no registry: carry .gpu-podman (podman_kit.sh's
# podman-kit.tar.xz; site.tar.xz: gpuprov's Python dependencies, pure Python, for the host's python3).
# The kit goes to / (podman, conmon, crun, uidmap; its libraries under /opt/podman-kit/lib, after the host's own in
# the loader's search); Podman's store is a tmpfs (the VM's root may itself be an overlay). Results under $OUT.
set -uo pipefail
export OUT=${OUT:-/tmp/podman-proof}; mkdir -p "$OUT"
tar -xJpf .gpu-podman/podman-kit.tar.xz -C / && echo /opt/podman-kit/lib > /etc/ld.so.conf.d/zz-podman-kit.conf && ldconfig
mkdir -p /var/lib/containers && mount -t tmpfs -o size=16g tmpfs /var/lib/containers
mkdir -p /tmp/site && tar -xJf .gpu-podman/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m provision "$@"\n' > /tmp/bin/gpuprov && chmod +x /tmp/bin/gpuprov
export PATH=/tmp/bin:$PATH
timeout 270 python3 tests/gpu/podman_proof.py 2>&1 | tee "$OUT/proof-log.txt" | tail -150
