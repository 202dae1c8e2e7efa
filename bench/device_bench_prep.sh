#!/usr/bin/env bash
# Prepare bench/device_bench.sh's carry folder (run here, from the checkout): this tree, runc + rootfs from
# /work/main/.gpu-kit (not its docker kit), the wheel's front-end binary as provision/inject/gpuprov-runtime.bin,
# and two dynamic builds with the device's paths (/tmp/g): "before" (shim.c at REV) and "after_dyn" (this shim.c).
set -euo pipefail
rev=${1:-24708ce}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=/work/main/.gpu-h-runtime
rm -rf "$dest" && mkdir -p "$dest/kit"
git -C "$here" ls-files -co --exclude-standard -z | (cd "$here" && xargs -0 cp --parents -a -t "$dest" 2>/dev/null || true)
cp -a /work/main/.gpu-kit/{bin,lib,rootfs,env.sh} "$dest/kit/"
tmp=$(mktemp -d)
python3 -m pip wheel -q --no-deps --no-build-isolation "$here" -w "$tmp" 2>/dev/null || python3 -m pip wheel -q --no-deps "$here" -w "$tmp"
unzip -p "$tmp"/gpuprov-*.whl provision/inject/gpuprov-runtime.bin > "$dest/provision/inject/gpuprov-runtime.bin"
git -C "$here" show "$rev:provision/inject/shim.c" > "$tmp/before.c"
cc -O2 -s -DRUNC='"/tmp/g/kit/bin/runc"' -DPYTHON='"/usr/bin/python3"' \
  -DMODIFY='"/tmp/g/provision/inject/modify_main.py"' "$tmp/before.c" -o "$dest/before"
cc -O2 -s "$here/provision/inject/shim.c" -o "$tmp/after_dyn.raw"
python3 -I -S - "$here" "$tmp/after_dyn.raw" "$dest/after_dyn" <<'PY'
import os, sys
sys.path.insert(0, sys.argv[1])
from provision.inject.install import patch_slots
data = patch_slots(open(sys.argv[2], "rb").read(), runc="/tmp/g/kit/bin/runc", python="/usr/bin/python3",
                   modify="/tmp/g/provision/inject/modify_main.py")
open(sys.argv[3], "wb").write(data)
os.chmod(sys.argv[3], 0o755)
PY
rm -rf "$tmp"
du -sh "$dest"
