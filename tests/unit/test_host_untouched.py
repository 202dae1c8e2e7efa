"""The run-wide check in tests/conftest.py (the host's own gpuprov untouched by the tests) really fails a run that
changes a watched path, and passes one that does not. Driven on scratch paths through GPUPROV_TEST_WATCH."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def _run(tmp_path, body: str) -> subprocess.CompletedProcess:
    watched = tmp_path / "etc-gpuprov"
    watched.mkdir(exist_ok=True)
    (watched / "runtime.json").write_text("{}\n")
    (tmp_path / "test_inner.py").write_text(f"from pathlib import Path\nW = Path({str(watched)!r})\n\n"
                                           f"def test_inner():\n    {body}\n")
    env = {**os.environ, "GPUPROV_TEST_WATCH": f"{watched}:{tmp_path}/bin-gpuprov*"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_run_that_leaves_the_host_alone_passes(tmp_path):
    r = _run(tmp_path, "assert (W / 'runtime.json').read_text() == '{}\\n'")
    assert r.returncode == 0, r.stdout + r.stderr


def test_run_that_edits_a_watched_file_fails_naming_it(tmp_path):
    r = _run(tmp_path, "(W / 'runtime.json').write_text('{\"runc\": \"x\"}')")
    assert r.returncode == 1 and "host untouched" in r.stdout and "runtime.json" in r.stdout, r.stdout


def test_run_that_adds_a_watched_file_fails(tmp_path):
    r = _run(tmp_path, "(W.parent / 'bin-gpuprov-runtime').write_text('#!/bin/sh')")
    assert r.returncode == 1 and "bin-gpuprov-runtime: absent =>" in r.stdout, r.stdout
