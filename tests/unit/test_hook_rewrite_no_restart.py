"""Issue 39 item 2: "SIGHUP in the plan means SIGHUP in the run". dockerd looks the --gpus hook up once, at start; a
hook that gpuprov rewrites in place (an upgrade of gpuprov's own hook) after dockerd started is still found, so it
needs no restart. The plan (before runtime.install) saw the old hook, older than dockerd, and said SIGHUP; on 112b38f
the run then saw the rewritten hook's new mtime and restarted dockerd. A real process stands in for dockerd (its
start time is what pending_restart compares); the hook is gpuprov's own, written by runtime install's code."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from provision import paths
from provision.engines.base import Daemon
from provision.engines.docker import DockerEngine
from provision.inject import install


@pytest.fixture
def dockerd(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "HOOK_SINCE", str(tmp_path / "state/hook-present-since.json"))
    p = subprocess.Popen(["sleep", "60"])
    time.sleep(0.1)  # start times are in clock ticks (10 ms): the hook written next is clearly newer
    yield Daemon(p.pid, ("dockerd",), "/etc/docker/daemon.json")
    p.kill()
    p.wait()


def _old_hook(bindir, age: float = 100) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    hook = bindir / "nvidia-container-runtime-hook"
    hook.write_text("#!/bin/sh\n# gpuprov-hook, an older version\n")
    hook.chmod(0o755)
    t = time.time() - age
    os.utime(hook, (t, t))


def test_a_hook_rewritten_in_place_needs_no_restart(tmp_path, dockerd):
    bindir = tmp_path / "bin"
    _old_hook(bindir)
    eng = DockerEngine()
    assert eng.pending_restart(dockerd, installing=True, search=str(bindir)) is None  # what the plan says
    changed: list[str] = []
    install._write_hook(bindir / "nvidia-container-runtime-hook", changed)
    assert changed == [str(bindir / "nvidia-container-runtime-hook")]  # it was rewritten: newer than dockerd now
    assert os.stat(bindir / "nvidia-container-runtime-hook").st_mtime > dockerd.started_at()
    assert eng.pending_restart(dockerd, search=str(bindir)) is None  # what the run does: the same


def test_without_the_record_the_rewrite_would_look_new(tmp_path, dockerd):
    """The control: the record is what keeps the run's answer the plan's."""
    bindir = tmp_path / "bin"
    _old_hook(bindir)
    install._write_hook(bindir / "nvidia-container-runtime-hook", [])
    os.unlink(paths.HOOK_SINCE)
    assert "looks for it only when it starts" in DockerEngine().pending_restart(dockerd, search=str(bindir))


def test_a_hook_that_appears_after_dockerd_started_still_restarts_it(tmp_path, dockerd):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    changed: list[str] = []
    eng = DockerEngine()
    assert "this run installs" in eng.pending_restart(dockerd, installing=True, search=str(bindir))
    install._write_hook(bindir / "nvidia-container-runtime-hook", changed)
    assert "looks for it only when it starts" in eng.pending_restart(dockerd, search=str(bindir))
    install._write_hook(bindir / "nvidia-container-runtime-hook", [])  # idempotent: unchanged, no record
    assert not os.path.exists(paths.HOOK_SINCE)


def test_a_hook_placed_after_dockerd_then_rewritten_still_restarts_it(tmp_path, dockerd):
    bindir = tmp_path / "bin"
    _old_hook(bindir, age=0)  # newer than dockerd: it appeared after dockerd started
    install._write_hook(bindir / "nvidia-container-runtime-hook", [])
    assert "looks for it only when it starts" in DockerEngine().pending_restart(dockerd, search=str(bindir))
