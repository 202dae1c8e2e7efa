#!/usr/bin/env bash
# Build bench/detect_device.sh's wheels here: .bench-whl/this (this checkout) and .bench-whl/before (REV, default
# the revision before issue 20's start-up work), gpuprov alone (its dependencies come from .whl).
set -euo pipefail
rev=${1:-57cd648}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rm -rf "$here/.bench-whl" && mkdir -p "$here/.bench-whl/this" "$here/.bench-whl/before"
tmp=$(mktemp -d)
git -C "$here" archive "$rev" | tar -x -C "$tmp"
python3 -m pip wheel -q --no-deps "$here" -w "$here/.bench-whl/this"
python3 -m pip wheel -q --no-deps "$tmp" -w "$here/.bench-whl/before"
rm -rf "$tmp"
ls -l "$here"/.bench-whl/*/
