#!/usr/bin/env bash
# Builds the kit for tests/gpu/k8s_kubelet.sh (a GPU host with no engine, no registry, Python 3.12): DEST/
#   bin.tar.xz   kubelet + nvidia-device-plugin (tests/k8s/build.py's cached builds), Debian bookworm's containerd,
#                containerd-shim-runc-v2, ctr and runc (+ libseccomp under lib/)
#   whl/         gpuprov's and the CRI/PodResources clients' wheels for the host's Python (PyPI, binary only)
# Usage: kubelet_kit.sh DEST   (after `python -m tests.k8s.build`; apt lists updated)
set -euo pipefail
dest=${1:?usage: kubelet_kit.sh DEST}; py=${KIT_PYTHON:-3.12}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$dest"; dest=$(cd "$dest" && pwd)
repo=$(cd "$(dirname "$0")/../.." && pwd)
bins=$(cd "$repo" && python3 - <<'PY'
from tests.k8s import build
print(build.cached(build.KUBELET), build.cached(build.DEVICE_PLUGIN))
PY
)
(cd "$work" && apt-get download containerd runc libseccomp2 >/dev/null)
for deb in "$work"/*.deb; do dpkg -x "$deb" "$work/x"; done
mkdir -p "$work/k/bin" "$work/k/lib"
cp $bins "$work/x/usr/bin/containerd" "$work/x/usr/bin/containerd-shim-runc-v2" "$work/x/usr/bin/ctr" \
   "$work/x/usr/sbin/runc" "$work/k/bin/"
cp -P "$work"/x/usr/lib/x86_64-linux-gnu/libseccomp.so.2* "$work/k/lib/" 2>/dev/null \
  || cp -P "$work"/x/lib/x86_64-linux-gnu/libseccomp.so.2* "$work/k/lib/"
strip -s "$work"/k/bin/containerd* "$work/k/bin/ctr" 2>/dev/null || true
XZ_OPT="-6 -T2" nice -n 10 tar -C "$work/k" -cJf "$dest/bin.tar.xz" bin lib
rm -rf "$dest/whl"
pip download -q --only-binary=:all: --python-version "$py" --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --implementation cp -d "$dest/whl" \
  "typer>=0.12,<0.29" distro jinja2 tomlkit PyYAML nvidia-ml-py grpcio-tools prometheus-client
echo "kubelet kit ready in $dest ($(du -sh "$dest" | cut -f1))"
