"""`gpuprov cdi refresh` never hangs or lies: a FIFO or a directory where a CDI spec goes (/etc/cdi/nvidia.yaml) is
refused with exit 6 and one line, in bounded time (a FIFO once made it block forever holding the host lock, and
its boot unit runs before the engine); the other spec directory is not touched, and
the host lock is free afterwards. Driven through the CLI against the fake driver host built from the H200 capture."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from tests.conftest import H200, run_cli
from tests.faults.conftest import CONFIG_INVALID
from tests.inject_helpers import write_settings

ROOT = str(H200 / "usr/local/nvidia")
DEADLINE = 60  # never-hang bound, far above a normal refresh


def refresh(base: Path, lock: Path):
    env = {"GPUPROV_RUNTIME_CONFIG": str(write_settings(base)), "GPUPROV_LOCK_DIR": str(lock),
           "GPUPROV_STATE_DIR": str(base / "state")}
    return run_cli("cdi", "refresh", "--driver-root", ROOT, "--spec-dirs", f"{base / 'etc-cdi'}:{base / 'run-cdi'}",
                   env=env, timeout=DEADLINE)


def lock_is_free(lock: Path) -> bool:
    fd = os.open(lock / "host.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_non_regular_spec_refused_in_bounded_time(tmp_path, kind):
    (tmp_path / "etc-cdi").mkdir()
    spec = tmp_path / "etc-cdi/nvidia.yaml"
    os.mkfifo(spec) if kind == "fifo" else spec.mkdir()
    lock = tmp_path / "lock"
    r = refresh(tmp_path, lock)  # subprocess.TimeoutExpired (a test failure) if it blocks
    assert r.returncode == CONFIG_INVALID, (r.returncode, r.stderr)
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(spec) in err and "not a regular file" in err and "nothing was changed" in err
    # nothing else touched: the spec in the other directory not written, the FIFO or directory still what it was
    assert not (tmp_path / "run-cdi").exists()
    assert (spec.is_fifo() if kind == "fifo" else spec.is_dir() and not any(spec.iterdir()))
    assert lock_is_free(lock)


def test_control_regular_spec_is_refreshed(tmp_path):
    """The same set-up with nothing hostile writes both specs (the refusal above is the FIFO's, not the set-up's)."""
    r = refresh(tmp_path, tmp_path / "lock")
    assert r.returncode == 0, r.stderr
    assert "GPUPROV_DRIVER_VERSION" in (tmp_path / "etc-cdi/nvidia.yaml").read_text()
    assert (tmp_path / "run-cdi/nvidia.yaml").read_text() == (tmp_path / "etc-cdi/nvidia.yaml").read_text()
