#!/usr/bin/env python3
"""The README's two commands in either order on fresh Debian 12 servers (systemd host containers, no compiler, no
pip, no gpuprov), each leaving the host as the first one left it:

  A: ./run-tests.sh TESTS  then  ./install.sh --yes
  B: ./install.sh --yes    then  ./run-tests.sh TESTS

Checks: both commands exit 0 in both orders; in B, the tests leave the installed gpuprov (tests/conftest.py's
HOST_GPUPROV: /usr/local/bin/gpuprov*, the hook, /etc/gpuprov, /opt/gpuprov, /var/lib/gpuprov, daemon.json, …)
byte-identical; in A, install.sh works on the host the tests left.
The checkout is copied into each host (run-tests.sh makes its .venv there); pip inside reaches the same package
index as this machine (its CA bundle, find-links and index directories mounted read-only, as `pip config` names
them here). A whole `./run-tests.sh` nests hosts three deep and takes long: TESTS (default: the unit and fault
tests plus tests/integration/test_runtime_docker.py, the module that used to change the host) says what runs.

How each host reaches the outside is this machine's own settings, nothing more: pip's (above), and apt's `Acquire::`
settings (from /etc/apt/apt.conf.d here, e.g. the archive snapshot's dates not checked) written into the host's
/etc/apt/apt.conf.d before the first command; the host is otherwise as debootstrap and systemd left it.

The orders run one after the other (2 cores here), or one of them: `--order A|B`.

Every image the tests use is built inside the host, as on a fresh server (the Debian kernel images of the driver
test included: the longest part).

Usage (root): python3 bench/host_orders.py [--tests 'tests/unit tests/faults …'] [--order A|B] [--json]"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.conftest import HOST_GPUPROV  # noqa: E402
from tests.integration.hosts import Host  # noqa: E402

DEFAULT_TESTS = "tests/unit tests/faults tests/integration/test_runtime_docker.py"
# What the installed gpuprov is, by the suite's own list (tests/conftest.py: HOST_GPUPROV): every file's hash, every
# entry's type, mode, owner and link target.
WATCH = " ".join(["find", *HOST_GPUPROV, "-printf '%p %y %m %U:%G %l\\n'", "2>/dev/null | sort;",
                  "find", *HOST_GPUPROV, "-type f -exec sha256sum {} + 2>/dev/null | sort"])
# This machine's CA bundle goes in beside the host's own (its ca-certificates package must stay writable).
CA = os.environ.get("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt")
PIP_DIRS = {p: p for p in ("/opt/wheels", "/opt/pypi", "/opt/pypi-more") if os.path.exists(p)}
PIP_DIRS.update({CA: "/opt/ci-ca.crt"} if os.path.exists(CA) else {})
PIP_ENV = " ".join(f"{k}={v!r}" for k, v in (
    ("PIP_CERT", "/opt/ci-ca.crt" if os.path.exists(CA) else ""),
    ("PIP_FIND_LINKS", os.environ.get("PIP_FIND_LINKS", "")),
    ("PIP_EXTRA_INDEX_URL", "file:///opt/pypi/simple file:///opt/pypi-more/simple"
     if os.path.exists("/opt/pypi") else ""), ("PIP_DEFAULT_TIMEOUT", "180")) if v)
LOG_DIR: Path | None = None  # --log-dir
ORDERS = {"A": ("A-tests-then-install", ["tests", "install"]), "B": ("B-install-then-tests", ["install", "tests"])}


def apt_acquire_settings() -> str:
    """This machine's apt settings for reaching the archive: the one-line `Acquire::…;` statements of
    /etc/apt/apt.conf{,.d/*} (blocks spread over lines are left out: they would need apt's own parser)."""
    files = [Path("/etc/apt/apt.conf"), *sorted(Path("/etc/apt/apt.conf.d").glob("*"))]
    lines = []
    for f in files:
        try:
            lines += [ln.strip() for ln in f.read_text().splitlines() if ln.strip().startswith("Acquire::")
                      and ln.strip().endswith(";") and ln.count("{") == ln.count("}")]
        except OSError:
            continue
    return "\n".join(lines) + "\n" if lines else ""


def ignores(tests: str) -> str:
    """run-tests.sh always collects `tests`: leave out, with --ignore, every test directory and integration module
    that TESTS does not name."""
    repo = Path(__file__).resolve().parents[1]
    wanted = [w.rstrip("/") for w in tests.split()]
    if "tests" in wanted:
        return ""
    out = []
    for d in sorted((repo / "tests").iterdir()):
        rel = f"tests/{d.name}"
        if not d.is_dir() or d.name in ("fixtures", "golden", "__pycache__") or rel in wanted:
            continue
        inside = [w for w in wanted if w.startswith(rel + "/")]
        if not inside:
            out.append(rel)
            continue
        out += [f"{rel}/{f.name}" for f in sorted(d.glob("test_*.py")) if f"{rel}/{f.name}" not in inside]
    return " ".join(f"--ignore={p}" for p in out)


def step(h: Host, name: str, script: str, log: dict, timeout: float = 4 * 3600) -> bool:
    """One command in the host. The whole suite nested under a loaded machine's 2 cores took over an hour (a 3600 s
    limit here cut one run off): the limit is for hangs only."""
    t = time.monotonic()
    r = h.exec(script, timeout=timeout)
    if LOG_DIR:  # the whole output, for what the summary lines do not say
        (LOG_DIR / f"{h.name}-{name}.log").write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
    summary = [ln for ln in r.stdout.splitlines() if ln.startswith(("FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"))
               or " passed" in ln or " failed" in ln or "host untouched" in ln]
    log[name] = {"rc": r.returncode, "seconds": round(time.monotonic() - t, 1), "summary": summary[-40:],
                 "stdout_tail": r.stdout[-1500:], "stderr_tail": r.stderr[-800:]}
    return r.returncode == 0


def order(key: str, tests: str, results: dict) -> None:
    name, seq = ORDERS[key]
    log: dict = {}
    results[name] = log
    h = Host(name=f"orders-{key}-{os.getpid()}", systemd=True, wheelhouse=False, volumes=PIP_DIRS)
    try:
        h.exec("mkdir -p /root/gpuprov && tar -C /src --exclude=./.venv --exclude=./.git --exclude=./.gpu-kit "
               "--exclude=./.whl -cf - . | tar -C /root/gpuprov -xf -", check=True)
        bare = h.exec("for t in gcc cc pip pip3 gpuprov docker dockerd; do command -v $t; done").stdout
        log["bare"] = bare == ""
        if apt_acquire_settings():
            h.write("/etc/apt/apt.conf.d/99this-machines-archive", apt_acquire_settings())
        cmds = {"tests": f"cd /root/gpuprov && env {PIP_ENV} CI=true ./run-tests.sh -q -p no:cacheprovider -rfEs "
                         f"--durations=25 {ignores(tests)}",
                "install": f"cd /root/gpuprov && env {PIP_ENV} ./install.sh --yes"}
        ok = step(h, seq[0], cmds[seq[0]], log)
        before = h.exec(WATCH).stdout
        ok = step(h, seq[1], cmds[seq[1]], log) and ok
        after = h.exec(WATCH).stdout
        if seq[0] == "install":
            log["gpuprov_untouched_by_tests"] = before == after and "gpuprov-runtime" in before
            log["watched"] = before
        log["ok"] = ok and log["bare"] and log.get("gpuprov_untouched_by_tests", True)
    finally:
        h.remove()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tests", default=DEFAULT_TESTS)
    ap.add_argument("--order", choices=("A", "B", "both"), default="both")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--log-dir", type=Path, help="keep each step's whole output there")
    args = ap.parse_args()
    global LOG_DIR
    LOG_DIR = args.log_dir
    if LOG_DIR:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
    results: dict = {"tests": args.tests}
    t = time.monotonic()
    for key in ("A", "B") if args.order == "both" else (args.order,):
        order(key, args.tests, results)
    results["total_seconds"] = round(time.monotonic() - t, 1)
    ok = all(v.get("ok") for v in results.values() if isinstance(v, dict))
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for k, v in results.items():
            if isinstance(v, dict):
                print(k, "ok" if v.get("ok") else "FAILED",
                      {s: (v[s]["rc"], v[s]["seconds"]) for s in ("tests", "install") if s in v})
                print("\n".join(v.get("tests", {}).get("summary", [])[-3:]))
                if not v.get("ok"):
                    for s in ("tests", "install"):
                        print("\n".join(v.get(s, {}).get("summary", [])), v.get(s, {}).get("stdout_tail", ""))
        print("total", results["total_seconds"], "s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
