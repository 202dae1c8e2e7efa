#!/usr/bin/env bash
# bench/detect_bench.py on a lent GPU host, where detect reads a real NVIDIA driver and GPU (and the GPU table): this
# checkout against a reference revision, each pip-installed (not editable) into its own venv from the carried
# wheels, as an operator's host has it. Prepare here with `bash bench/detect_device_prep.sh [REV]`; carry .whl and
# .bench-whl. Results under $OUT.
set -uo pipefail
out=${OUT:-/tmp/gpuprov-out}; mkdir -p "$out"
unset PYTHONPATH  # the checkout on the path would shadow each venv's own gpuprov
for side in this before; do
  v=/tmp/v-$side
  python3 -m venv "$v" 2>/dev/null || python3 -m venv --without-pip "$v" || exit 1
  if [ -x "$v/bin/pip" ]; then pip=("$v/bin/pip"); else pip=(python3 -m pip --python "$v/bin/python"); fi
  "${pip[@]}" install -q --no-index --find-links .whl .bench-whl/"$side"/gpuprov-*.whl || exit 1
done
{ nvidia-smi -L; uname -r; python3 --version; nproc; } > "$out/host.txt" 2>&1
/tmp/v-this/bin/gpuprov detect > "$out/detect-this.txt" 2>&1
python3 bench/detect_bench.py -n "${BENCH_N:-40}" --gpuprov /tmp/v-this/bin/gpuprov \
  --before /tmp/v-before/bin/gpuprov 2>&1 | tee "$out/detect-bench.txt"
