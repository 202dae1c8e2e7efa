"""Exit codes that do not depend on what else is installed: usage errors are 2 with a standalone click beside
typer's own copy (the [test] extra installs one, as CI does); N at bootstrap's prompt is 12."""
from __future__ import annotations

import os
import pty
import select
import subprocess
import time

import pytest

from tests.conftest import gpuprov_bin, run_cli
from tests.faults.conftest import DECLINED, root_only


def test_standalone_click_is_installed_beside_typer():
    import click  # noqa: F401  (the premise of the next test: a second click next to typer's)


@pytest.mark.parametrize("argv", [("detect", "--bogus"), ("engine", "configure"), ("bootstrap", "--driver-source"),
                                  ("no-such-command",), ("share", "enable", "--max-clients", "many")])
def test_usage_errors_exit_2(argv):
    r = run_cli(*argv)
    assert r.returncode == 2, (argv, r.returncode, r.stderr[-300:])
    assert "internal error" not in r.stderr


@root_only
def test_declined_prompt_exits_12(tmp_path):
    """`gpuprov bootstrap` on a terminal, answered N: exit 12 and nothing changed (driver and engine left out so that
    the plan is small; the prompt is the same)."""
    pid, fd = pty.fork()
    if pid == 0:  # child: the terminal's side
        os.environ["GPUPROV_LOCK_DIR"] = str(tmp_path / "lock")
        os.execv(gpuprov_bin()[0], [*gpuprov_bin(), "bootstrap", "--driver", "skip", "--engine", "none"])
    out = b""
    deadline = time.monotonic() + 120
    while b"Apply this plan?" not in out and time.monotonic() < deadline:
        if select.select([fd], [], [], 1)[0]:
            try:
                out += os.read(fd, 4096)
            except OSError:
                break
    assert b"Apply this plan?" in out, out[-500:]
    os.write(fd, b"n\n")
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == DECLINED, out[-500:]
    assert b"declined" in out and b"internal error" not in out


def test_no_tty_without_yes_is_a_usage_error():
    r = subprocess.run([*gpuprov_bin(), "bootstrap", "--driver", "skip", "--engine", "none"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--yes" in r.stderr
