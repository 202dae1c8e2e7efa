#!/usr/bin/env bash
# Builds a Podman kit for a GPU host that has an NVIDIA driver but no container engine and no package registry
# (tests/gpu/podman_proof.sh unpacks it there):
#   DEST/podman-kit.tar.xz  Debian 12's podman 4.3, conmon, crun, catatonit and uidmap (newuidmap/newgidmap, for
#                           the rootless run), containers-common's default configs (policy.json, containers.conf,
#                           seccomp.json), and the shared libraries they need that a host may lack (conmon: glib), under
#                           opt/podman-kit/lib (the proof adds that directory to ld.so.conf.d, after the host's own).
# Usage: podman_kit.sh DEST   (run it where Debian 12's package registry is reachable: apt-get download)
set -euo pipefail
dest=${1:?usage: podman_kit.sh DEST}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$dest"; dest=$(cd "$dest" && pwd)
(cd "$work" && apt-get download podman conmon crun catatonit uidmap golang-github-containers-common libgpgme11 \
   libglib2.0-0 libassuan0 libgpg-error0 libsubid4 libdevmapper1.02.1 libyajl2 libseccomp2 >/dev/null 2>&1) || {
  echo "apt-get download failed: run 'apt-get update' first" >&2; exit 1; }
for deb in "$work"/*.deb; do dpkg -x "$deb" "$work/x"; done
cd "$work/x"
mkdir -p opt/podman-kit/lib
cp -P usr/lib/x86_64-linux-gnu/lib{yajl,subid,gpgme,seccomp,assuan,glib-2.0}.so.* lib/x86_64-linux-gnu/lib{devmapper,gpg-error}.so.* \
  opt/podman-kit/lib/
strip -s usr/bin/podman usr/bin/conmon usr/bin/crun 2>/dev/null || true
XZ_OPT=-9e tar -cJf "$dest/podman-kit.tar.xz" usr/bin/podman usr/bin/conmon usr/bin/crun usr/bin/catatonit \
  usr/bin/newuidmap usr/bin/newgidmap usr/lib/podman usr/share/containers etc/containers/policy.json opt/podman-kit
echo "podman kit ready: $dest/podman-kit.tar.xz ($(du -h "$dest/podman-kit.tar.xz" | cut -f1))"
