#!/usr/bin/env bash
# Install what the tests need (Docker engine, debootstrap, runc, Python test deps in .venv), start dockerd if it
# is not running, then run the whole suite: unit + integration (real dockerd, real apt, real containers).
# GPU tests (marked `gpu`) skip here with a reason; run them on a GPU host (see README).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
export DEBIAN_FRONTEND=noninteractive
need=()
# gcc: the tests build the runtime's compiled front-end (shim.c) and the wheel that carries it; strace: a test tells
# the front-end's path before the C library from main() by its system calls (tests/faults/test_runtime_round2.py)
for b in dockerd:docker.io debootstrap:debootstrap runc:runc containerd:containerd gcc:gcc strace:strace; do
  command -v "${b%%:*}" >/dev/null || need+=("${b##*:}")
done
python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  (dockerd >/tmp/gpuprov-test-dockerd.log 2>&1 &)
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start; see /tmp/gpuprov-test-dockerd.log" >&2; exit 1; }
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
export PATH="$PWD/.venv/bin:$PATH"  # the tests call ansible-playbook, ruff, ansible-lint, gpuprov from here
.venv/bin/pip install -q -e '.[test,fleet]'
# With arguments, they replace the default selection when one names a test path (`./run-tests.sh tests/unit/x.py -q`
# runs that file only, in one process); options alone (`./run-tests.sh -x`) apply to the whole suite.
for a in "$@"; do case "$a" in tests/*|./tests/*) exec .venv/bin/python -m pytest -rs --durations=25 "$@";; esac; done
# The whole suite, in two passes (issue 37; tests/conftest.py says how the work is split and ordered):
# 1. the tests marked `alone` (a time bound is their point), one at a time, with nothing beside them;
# 2. everything else on GPUPROV_TEST_WORKERS workers (default 4 on 2 cores: most integration time is waiting on
#    apt, DKMS and containers), each file (its hosts and their ordered stages) on one worker.
workers=${GPUPROV_TEST_WORKERS:-4}
rc=0
.venv/bin/python -m pytest -rs -m alone tests "$@" || rc=$?
[ "$rc" -eq 5 ] && rc=0  # none selected (options like -k)
.venv/bin/python -m pytest -rs --durations=25 -n "$workers" --dist loadfile -m "not alone" tests "$@" || rc2=$?
[ "$rc" -eq 0 ] && rc=${rc2:-0}
exit "$rc"
