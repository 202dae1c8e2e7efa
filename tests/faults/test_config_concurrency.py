"""One host lock: concurrent writers lose nothing; --no-wait fails fast with exit 11; a waiter says whom it waits for."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import gpuprov_bin
from tests.faults.conftest import HOST_BUSY, RT, root_only, user_daemon_json

pytestmark = root_only


def _start(p, name, lock, *extra):
    return subprocess.Popen([*gpuprov_bin(), *extra, "engine", "configure", "docker", "--config", str(p),
                             "--runtime-path", RT, "--runtime-name", name, "--no-restart"],
                            env={**os.environ, "GPUPROV_LOCK_DIR": str(lock)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_concurrent_writers_lose_nothing(tmp_path):
    """20 rounds of two concurrent `engine configure` adding different runtimes to one daemon.json: both exit 0 and
    both runtimes (and the operator's keys) are there every time."""
    p = tmp_path / "daemon.json"
    p.write_bytes(user_daemon_json())
    lost = []
    for i in range(20):
        a, b = _start(p, f"a{i}", tmp_path / "lock"), _start(p, f"b{i}", tmp_path / "lock")
        ra, rb = a.wait(60), b.wait(60)
        assert (ra, rb) == (0, 0), (a.stderr.read(), b.stderr.read())
        doc = json.loads(p.read_text())
        lost += [n for n in (f"a{i}", f"b{i}") if n not in doc["runtimes"]]
    assert lost == []
    doc = json.loads(p.read_text())
    assert len(doc["runtimes"]) == 41 and doc["runtimes"]["kata"] == {"path": "/opt/kata/bin/kata-runtime"}
    assert doc["data-root"] == "/srv/docker"


@pytest.mark.alone  # a time bound: run with nothing beside it (conftest)
def test_no_wait_fails_fast_and_waiter_waits(tmp_path, monkeypatch):
    from provision.hostlock import host_lock

    monkeypatch.setenv("GPUPROV_LOCK_DIR", str(tmp_path / "lock"))
    p = tmp_path / "daemon.json"
    old = user_daemon_json()
    p.write_bytes(old)
    with host_lock("test holder"):
        t = time.monotonic()
        fast = _start(p, "x", tmp_path / "lock", "--no-wait")
        assert fast.wait(30) == HOST_BUSY
        err = fast.stderr.read()
        assert time.monotonic() - t < 10 and f"pid {os.getpid()}: gpuprov test holder" in err
        assert len(err.strip().splitlines()) == 1 and p.read_bytes() == old
        waiter = _start(p, "y", tmp_path / "lock")
        time.sleep(3)
        assert waiter.poll() is None  # still waiting for us
    assert waiter.wait(30) == 0
    assert "waiting for pid" in waiter.stderr.read()
    assert "y" in json.loads(p.read_text())["runtimes"]


def test_lock_falls_back_when_run_is_unusable(tmp_path, monkeypatch, mount_tmpfs):
    """/run/gpuprov read-only (or missing): the lock lives in the next directory (/var/lib/gpuprov in production), and
    two holders still exclude each other."""
    from provision import hostlock

    ro = mount_tmpfs("1m", "run")
    subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
    monkeypatch.delenv("GPUPROV_LOCK_DIR", raising=False)
    monkeypatch.setattr(hostlock, "LOCK_DIRS", (str(ro / "gpuprov"), str(tmp_path / "var-lib-gpuprov")))
    with hostlock.host_lock("fallback holder"):
        assert (tmp_path / "var-lib-gpuprov" / "host.lock").exists()
        r = subprocess.run([sys.executable, "-c", "from provision import hostlock; import sys; "
                            f"hostlock.LOCK_DIRS = {hostlock.LOCK_DIRS!r}\n"
                            "with hostlock.host_lock('second', wait=False): pass"],
                           env={k: v for k, v in os.environ.items() if k != "GPUPROV_LOCK_DIR"},
                           capture_output=True, text=True)
        assert r.returncode != 0 and "HostBusy" in r.stderr and "fallback holder" in r.stderr


def test_killed_holder_never_leaves_the_host_locked(tmp_path):
    """A run killed with SIGKILL while it holds the lock: the next `--no-wait` run goes through at once."""
    lock = tmp_path / "lock"
    holder = subprocess.Popen([sys.executable, "-c", "from provision.hostlock import host_lock; import time\n"
                               "with host_lock('doomed'):\n    print('held', flush=True); time.sleep(600)"],
                              env={**os.environ, "GPUPROV_LOCK_DIR": str(lock)}, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    p = tmp_path / "daemon.json"
    p.write_bytes(user_daemon_json())
    assert _start(p, "x", lock, "--no-wait").wait(30) == HOST_BUSY  # it really held the lock
    holder.kill()
    holder.wait()
    r = _start(p, "x", lock, "--no-wait")
    assert r.wait(30) == 0, r.stderr.read()
    assert "x" in json.loads(p.read_text())["runtimes"]
