#!/usr/bin/env bash
# Issue 41 on a lent GPU host, one batched call: gpuprov's own part of a create against BEFORE (bench/create_split.py),
# the container-start benchmark against the limit
# (bench/runtime_bench.py: shuffled rounds, configs compared first, phases, by predecessor, a burst of 32), then the
# docker-level ratio (bench/docker_bench.py: a dockerd of our own whose default runtime is gpuprov-runtime, n=100 per
# case, shuffled, bootstrap interval). Carry .gpu-kit (gpu-host-kit.sh, with its docker/ from gpu-docker-kit.sh).
# Results under $OUT: host.txt, install.json, create-split.json, bench-runtime.json, bench-docker.json,
# dockerd.log.
# Optional: HOP=PATH (bench/exec_hop.c built static: runtime_bench's hop_sleep/hop_spin cases, a wait of HOP_US
# before runc alone); VARIANT=NAME=FRONT_END.bin (a front-end built from a patched shim.c, slots empty: installed
# beside gpuprov's as /tmp/rt-NAME, sharing its warm editor, and timed as one more --runtime); SETTLE_MS (runtime_bench
# --settle-ms); SETTLED_N=N: runtime_bench once more, N rounds with a 50 ms settle (bench-runtime-settled.json);
# SKIP_SPLIT=1, SKIP_DOCKER=1; SPLIT_GAP_MS=G: create_split once more, each create G ms after the one before
# (create-split-gap.json: the warm editor's caches gone cold, as between real starts).
set -uo pipefail
out=${OUT:-/tmp/gpuprov-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 GPUPROV_RUNTIME_CONFIG=/tmp/rt/runtime.json
source .gpu-kit/env.sh
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; uname -r; nproc; python3 --version
  runc --version | head -1; } > "$out/host.txt" 2>&1
droot=/; [ -x /usr/local/nvidia/bin/nvidia-smi ] && droot=/usr/local/nvidia
python3 -I -S - "$droot" > "$out/install.json" 2>&1 <<'PY'
import json, sys
sys.path.insert(0, ".")
from provision.inject.install import install_runtime
r = install_runtime("/tmp/rt", driver_root=sys.argv[1])
print(json.dumps({"runtime": r.runtime_path, "compiled": r.compiled, "origin": r.origin, "notes": r.notes}))
PY
cat "$out/install.json"
variant=()
if [ -n "${VARIANT:-}" ]; then
  vname=${VARIANT%%=*}; vbin=${VARIANT#*=}
  GPUPROV_RUNTIME_CONFIG=/tmp/rt-$vname/runtime.json python3 -I -S - "$droot" "$vbin" "/tmp/rt-$vname" \
    >> "$out/install.json" 2>&1 <<'PY'
import json, sys
sys.path.insert(0, ".")
from pathlib import Path
import provision.inject.install as install
install.SHIPPED = Path(sys.argv[2])  # the variant's front-end in the wheel's place; no compiling here
r = install.install_runtime(sys.argv[3], driver_root=sys.argv[1], compile_shim=False)
print(json.dumps({"variant": sys.argv[3], "runtime": r.runtime_path, "origin": r.origin, "notes": r.notes}))
PY
  variant=(--runtime "$vname=/tmp/rt-$vname/bin/gpuprov-runtime")
fi
hop=(); [ -n "${HOP:-}" ] && hop=(--hop "$HOP" --hop-us "${HOP_US:-1500}")
# gpuprov's own part of a create (runc replaced by true), this checkout against BEFORE (default: issue 41 round 2's
# starting commit) in the same shuffled rounds, each side with its own editor copy, front-end, settings and editor
# (the lent machine's copy has no .git: prepare the tree here, in the carried .gpu-kit:
#  mkdir -p .gpu-kit/before-3bd3e3f && git archive 3bd3e3f provision | tar -x -C .gpu-kit/before-3bd3e3f)
if [ -z "${SKIP_SPLIT:-}" ]; then
  before=${BEFORE:-3bd3e3f}; [ -d ".gpu-kit/before-$before" ] && before=".gpu-kit/before-$before"
  timeout 300 python3 bench/create_split.py --driver-root "$droot" --before "$before" -n "${SPLIT_N:-150}" \
    --json > "$out/create-split.json" 2> "$out/create-split.err"
  echo "create split rc=$?"; tail -3 "$out/create-split.err"
  if [ -n "${SPLIT_GAP_MS:-}" ]; then  # the same with the editor cold: each create SPLIT_GAP_MS after the one before
    timeout 200 python3 bench/create_split.py --driver-root "$droot" -n 100 --gap-ms "$SPLIT_GAP_MS" \
      --json > "$out/create-split-gap.json" 2> "$out/create-split-gap.err"
    echo "create split (gap $SPLIT_GAP_MS ms) rc=$?: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["gpuprov_part_ms"])' "$out/create-split-gap.json" 2>&1)"
  fi
  python3 - "$out/create-split.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"no create split result: {exc}")
print(f"create split: seed {r['seed']} n={r['n']} before={r['before']}")
print("  gpuprov's own part (ms):", r["gpuprov_part_ms"])
print("  after - before (ms):", r.get("after_minus_before_ms"), " part ratio:", r.get("part_ratio_after_before"))
PY
fi
summary() {  # per case: median (p10-p90), then each phase's median; then over the limit
  python3 - "$1" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"no runtime bench result: {exc}")
print(f"seed {r['seed']} n={r['n']} settle {r.get('settle_ms')} ms")
for k, v in r["cases"].items():
    print(f"  {k:18} {v['median_ms']:7.2f} ({v['p10_ms']:.2f}-{v['p90_ms']:.2f})  "
          + "  ".join(f"{p} {s['median_ms']:.2f}" for p, s in r["phases"][k].items()))
print("over the reference (ms):", r["over_reference_ms"], "ok:", r["ok"])
print("round by round, median [95% interval] (ms):", r.get("over_reference_paired_ms"))
for k, v in r.get("create_by_predecessor_ms", {}).items():
    print(f"  create of {k} after:", v)
print("burst:", json.dumps(r.get("burst")))
PY
}
timeout 400 python3 bench/runtime_bench.py --runtime gpuprov=/tmp/rt/bin/gpuprov-runtime "${variant[@]}" "${hop[@]}" \
  -n "${BENCH_N:-40}" --settle-ms "${SETTLE_MS:-0}" \
  --by-predecessor --burst 32 --bursts "${BURSTS:-3}" --json > "$out/bench-runtime.json" 2> "$out/bench-runtime.err"
echo "runtime bench rc=$?"; tail -5 "$out/bench-runtime.err"; summary "$out/bench-runtime.json"
if [ -n "${SETTLED_N:-}" ]; then  # the same without the variant, each start after a 50 ms settle
  timeout 400 python3 bench/runtime_bench.py --runtime gpuprov=/tmp/rt/bin/gpuprov-runtime "${hop[@]}" -n "$SETTLED_N" \
    --settle-ms 50 --json > "$out/bench-runtime-settled.json" 2> "$out/bench-runtime-settled.err"
  echo "settled runtime bench rc=$?"; tail -5 "$out/bench-runtime-settled.err"; summary "$out/bench-runtime-settled.json"
fi
[ -n "${SKIP_DOCKER:-}" ] && exit 0
# docker: the kit's binaries, gpuprov-runtime as the default runtime, its --gpus hook first on dockerd's PATH
tar -xJf .gpu-kit/docker/docker-min.tar.xz -C / && cp .gpu-kit/bin/runc /usr/sbin/runc
cp -P .gpu-kit/lib/* /usr/local/lib/ 2>/dev/null; ldconfig
export DOCKER_HOST=unix:///tmp/sc-docker.sock
cat > /tmp/sc-daemon.json <<JSON
{"iptables": false, "ip6tables": false, "bridge": "none", "ip-masq": false, "userland-proxy": false,
 "runtimes": {"gpuprov": {"path": "/tmp/rt/bin/gpuprov-runtime"}}, "default-runtime": "gpuprov"}
JSON
(PATH=/tmp/rt/bin:$PATH setsid dockerd --config-file /tmp/sc-daemon.json -H $DOCKER_HOST --data-root /var/lib/sc-docker \
   --exec-root /tmp/sc-exec --pidfile /tmp/sc-docker.pid > "$out/dockerd.log" 2>&1 &)
for _ in $(seq 60); do docker info > /dev/null 2>&1 && break; sleep 0.5; done
tar -C "$GPU_KIT_ROOTFS" -c . | docker import - sc-tiny > /dev/null
docker run --rm --network none --gpus all sc-tiny nvidia-smi -L > "$out/docker-smi.txt" 2>&1; cat "$out/docker-smi.txt"
timeout 500 python3 bench/docker_bench.py --image sc-tiny -n "${DOCKER_N:-100}" --decompose --state-root /tmp/sc-exec \
  --json > "$out/bench-docker.json" \
  2> "$out/bench-docker.err"
echo "docker bench rc=$?"; cat "$out/bench-docker.json"; tail -3 "$out/bench-docker.err"
kill "$(cat /tmp/sc-docker.pid)" 2>/dev/null
