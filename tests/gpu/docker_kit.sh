#!/usr/bin/env bash
# Builds a CDI-capable Docker engine kit for a GPU host with no package registry (Ubuntu 24.04-like, glibc >= 2.34):
#   DEST/docker-cdi.tar.xz  dockerd + docker CLI (Debian trixie: 26.1.x, the first suite whose docker has
#                           daemon.json `features.cdi`), containerd + shim, tini as docker-init; dockerd's shared
#                           libraries under /opt/dklibs (its RUNPATH), so the host's own libraries are not needed.
# Bookworm's docker.io is 20.10: it has --gpus but no CDI (`--device vendor.com/class=name` needs docker >= 25).
# Usage: docker_kit.sh DEST SUITE_APT_OPTS_FILE   (apt options naming a sources list that has trixie; needs patchelf)
set -euo pipefail
dest=${1:?usage: docker_kit.sh DEST APT_OPTS_FILE}; opts=$(cat "${2:?apt options file}")
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$dest"; dest=$(cd "$dest" && pwd)
# shellcheck disable=SC2086
(cd "$work" && apt-get $opts download docker.io/trixie docker-cli/trixie containerd/trixie tini/trixie >/dev/null 2>&1)
for deb in "$work"/*.deb; do dpkg -x "$deb" "$work/x"; done
cd "$work/x"
mkdir -p opt/dklibs
for lib in $(ldd usr/sbin/dockerd | awk '$3 ~ /^\// {print $3}' | grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so'); do cp -L "$lib" opt/dklibs/; done
patchelf --set-rpath /opt/dklibs usr/sbin/dockerd
strip -s usr/bin/containerd usr/bin/containerd-shim-runc-v2 usr/bin/docker usr/sbin/dockerd 2>/dev/null || true
ln -sf tini-static usr/bin/docker-init 2>/dev/null || true
XZ_OPT=-9e tar -cJf "$dest/docker-cdi.tar.xz" usr/bin/containerd usr/bin/containerd-shim-runc-v2 usr/bin/docker \
  usr/bin/docker-init usr/bin/tini-static usr/sbin/dockerd opt/dklibs
echo "docker kit ready: $dest/docker-cdi.tar.xz ($(du -h "$dest/docker-cdi.tar.xz" | cut -f1))"
