#!/usr/bin/env bash
# Builds, HERE (Debian 12 with Debian's archive reachable), what tests/gpu/device_caps.sh needs on a bare GPU host,
# into DEST (git-ignored; name it in the device tool's `carry`; about 60 MB):
#   docker-cdi.tar.xz   dockerd/CLI 26 + containerd (tests/gpu/docker_kit.sh)
#   runc.xz, lib/       runc and libseccomp from this machine's packages
#   tiny.tar.xz         busybox + glibc rootfs (Debian 12) for test containers
#   gfx.tar.xz          tiny + Debian 12's libEGL/libGLESv2/libvulkan loaders (glvnd) + probes + H.264 sample
#   nvidia-ctk.xz       NVIDIA's nvidia-ctk built from its public source (reference only, for the CDI comparison)
#   whl/                wheels the GPU host's Python lacks (distro, jsonschema and its needs)
# Usage: GPU_KIT_ROOTFS=… prepare_caps_kit.sh DEST APT_OPTS_FILE NVIDIA_CTK_SOURCE_DIR
#   APT_OPTS_FILE: apt-get options naming a sources list with bookworm, trixie and sid (own lists/cache dirs).
#   NVIDIA_CTK_SOURCE_DIR: a checkout of github.com/NVIDIA/nvidia-container-toolkit (its vendor/ is used).
set -euo pipefail
dest=${1:?usage: prepare_caps_kit.sh DEST APT_OPTS_FILE NVIDIA_CTK_SOURCE_DIR}; opts=$(cat "${2:?}"); nct=${3:?}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$dest"; dest=$(cd "$dest" && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# shellcheck disable=SC2086
apt_dl() { (cd "$work" && apt-get $opts download "$@" >/dev/null 2>&1); }

rm -f "$dest/gfx.tar.xz"
[ -s "$dest/docker-cdi.tar.xz" ] || bash "$here/docker_kit.sh" "$dest" "$2"

# runc + libseccomp (runc is dynamically linked against it)
xz -T0 -9 -c "$(command -v runc)" > "$dest/runc.xz"
mkdir -p "$dest/lib"; cp -L /lib/x86_64-linux-gnu/libseccomp.so.2 "$dest/lib/"

# the tiny rootfs: gpu-host-kit.sh's busybox + glibc tree (Debian 12), GPU_KIT_ROOTFS
r=$work/tiny; cp -a "${GPU_KIT_ROOTFS:?source .gpu-kit/env.sh first}" "$r"
for a in grep sleep head; do [ -e "$r/bin/$a" ] || ln -s busybox "$r/bin/$a"; done
tar -C "$r" -cJf "$dest/tiny.tar.xz" .

# the graphics/video image: Debian 12's loaders (glvnd EGL + GLES, Vulkan loader) and the probes, plus the X client
# libraries NVIDIA's Vulkan ICD (libGLX_nvidia.so.0) links against even when rendering headless
apt_dl libegl1/bookworm libglvnd0/bookworm libgles2/bookworm libvulkan1/bookworm libx11-6/bookworm \
  libxext6/bookworm libxcb1/bookworm libxau6/bookworm libxdmcp6/bookworm libbsd0/bookworm libmd0/bookworm
for d in "$work"/*.deb; do dpkg -x "$d" "$r"; done
mkdir -p "$r/probes"
gcc -O2 -Wall -o "$r/probes/gfx_probe" "$here/probes/gfx_probe.c" -ldl
gcc -O2 -Wall -o "$r/probes/nvdec_probe" "$here/probes/nvdec_probe.c" -ldl
cp "$here/probes/gray320x240.h264" "$r/probes/"
tar -C "$r" -cJf "$dest/gfx.tar.xz" .

# nvidia-ctk from source: Go from Debian sid, vendored modules, no network
if [ ! -s "$dest/nvidia-ctk.xz" ]; then
  apt_dl golang-1.26-go golang-1.26-src
  for d in "$work"/golang-*.deb; do dpkg -x "$d" "$work/go"; done
  goroot=$work/go/usr/lib/go-1.26
  (cd "$nct" && GOROOT=$goroot PATH=$goroot/bin:$PATH GOFLAGS=-mod=vendor GOPROXY=off CGO_ENABLED=1 GOTOOLCHAIN=local \
     GOCACHE=$work/gocache go build -o "$work/nvidia-ctk" ./cmd/nvidia-ctk 2>/dev/null)
  xz -T0 -9 -c "$work/nvidia-ctk" > "$dest/nvidia-ctk.xz"
  git -C "$nct" log -1 --format='nvidia-container-toolkit %H %cd' > "$dest/nvidia-ctk.version"
fi

# wheels for the GPU host's Python 3.12 (it has typer, PyYAML, pytest; not these)
mkdir -p "$dest/whl"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest/whl" \
  distro jsonschema jsonschema-specifications referencing rpds-py tomlkit 2>/dev/null
du -sh "$dest"/* | sort -h
