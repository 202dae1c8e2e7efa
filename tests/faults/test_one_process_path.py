"""One process path: every process gpuprov starts goes through provision/effects.py, with a timeout, and a command
that cannot start, hangs or fails is a StepFailed (exit 5, one message naming the command), never a traceback.
The runtime's hot path is the one exception, each place named here with its measured reason (and commented there)."""
from __future__ import annotations

import ast
import os
import time

import pytest

from provision import effects
from provision.errors import STEP_FAILED, StepFailed
from tests.conftest import REPO

PROCESS_MODULES = {"subprocess", "multiprocessing", "pty", "popen2"}
OS_PROCESS_CALLS = {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execl", "execle", "execlp",
                    "execlpe", "execv", "execve", "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
                    "spawnv", "spawnve", "spawnvp", "spawnvpe"}
# path -> the os calls it may make, and why (the comment beside each call gives the measurement)
HOT_PATH = {
    "provision/inject/shim.py": ({"execv"}, "runc must become the front-end's process; no subprocess import (12 ms) "
                                 "on a cold GPU create"),
    "provision/inject/server.py": ({"fork"}, "the warm editor is this process's code, holding the inherited lock; a "
                                   "new interpreter costs a Python start-up"),
}


def _process_uses(path) -> tuple[set[str], set[str]]:
    """(process modules imported, os process calls made) by one source file."""
    mods, calls = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names} & PROCESS_MODULES
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods |= {node.module.split(".")[0]} & PROCESS_MODULES
            if node.module == "os":
                calls |= {a.name for a in node.names} & OS_PROCESS_CALLS
            if node.module == "asyncio" and any(a.name.startswith("create_subprocess") for a in node.names):
                mods.add("asyncio.subprocess")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "os" and node.attr in OS_PROCESS_CALLS:
                calls.add(node.attr)
            if node.attr.startswith("create_subprocess"):
                mods.add("asyncio.subprocess")
    return mods, calls


def test_only_effects_starts_processes():
    imports, calls = {}, {}
    for p in sorted((REPO / "provision").rglob("*.py")):
        rel = str(p.relative_to(REPO))
        mods, os_calls = _process_uses(p)
        if mods and rel != "provision/effects.py":
            imports[rel] = sorted(mods)
        if os_calls:
            calls[rel] = os_calls
    assert imports == {}, f"start processes through provision.effects, not {imports}"
    assert calls == {k: c for k, (c, _why) in HOT_PATH.items()}
    assert _process_uses(REPO / "provision/effects.py")[0] == {"subprocess"}  # the guard sees what it looks for


def test_hot_path_exceptions_say_why_where_they_are():
    for rel, (names, _why) in HOT_PATH.items():
        lines = (REPO / rel).read_text().splitlines()
        for name in names:
            at = next(i for i, ln in enumerate(lines) if f"os.{name}(" in ln)
            comment = " ".join(lines[max(0, at - 4):at])
            assert "effects" in comment and " ms" in comment, f"{rel}: os.{name} needs its measured reason above it"


@pytest.mark.alone  # a time bound: run with nothing beside it (conftest)
def test_failures_are_step_failed_never_a_traceback(tmp_path):
    with pytest.raises(StepFailed, match="command not found: gpuprov-no-such-binary") as e:
        effects.run(["gpuprov-no-such-binary", "x"])
    assert e.value.exit_code == STEP_FAILED
    noexec = tmp_path / "noexec"
    noexec.write_text("#!/bin/sh\n")
    noexec.chmod(0o644)
    with pytest.raises(StepFailed, match="cannot run"):  # PermissionError: once an internal error
        effects.run([str(noexec)], check=False)
    t = time.monotonic()
    with pytest.raises(StepFailed, match=r"timed out after 0.5 s: sleep 30"):
        effects.run(["sleep", "30"], check=False, timeout=0.5)
    assert time.monotonic() - t < 10
    with pytest.raises(StepFailed, match=r"`sh -c 'echo boom >&2; exit 3'` failed with exit code 3:\nboom"):
        effects.run(["sh", "-c", "echo boom >&2; exit 3"])
    r = effects.run(["sh", "-c", "echo out; echo err >&2; exit 4"], check=False)
    assert (r.returncode, r.stdout, r.stderr, r.output) == (4, "out\n", "err\n", "out\nerr\n")
    assert effects.run(["cat"], input_text=b"\x00\xffbytes").stdout == "\x00\ufffdbytes"
    assert effects.run(["cat"]).stdout == ""  # stdin is /dev/null: nothing waits on a terminal


@pytest.mark.alone  # a time bound: run with nothing beside it (conftest)
def test_try_run_and_run_parallel():
    assert effects.try_run(["gpuprov-no-such-binary"], timeout=5) is None
    assert effects.try_run(["sleep", "30"], timeout=0.3) is None
    assert effects.try_run(["sh", "-c", "exit 2"], timeout=5).returncode == 2
    t = time.monotonic()
    res = effects.run_parallel({"a": ["sh", "-c", "echo 1.2.3 >&2"], "gone": ["gpuprov-no-such-binary"],
                                "slow": ["sleep", "30"], "b": ["sh", "-c", "sleep 0.3; echo b"]}, timeout=1.5)
    assert time.monotonic() - t < 10  # one deadline for all, the hung one killed
    assert res["a"].output == "1.2.3\n" and res["b"].output == "b\n"
    assert res["gone"] is None and res["slow"] is None


def test_pipe(tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(1 << 20))
    r = effects.pipe(["tar", "-C", str(tmp_path), "-c", "f"], ["tar", "-t"])
    assert r.stdout == "f\n"
    with pytest.raises(StepFailed, match=r"`tar -C .* -c missing` failed"):
        effects.pipe(["tar", "-C", str(tmp_path), "-c", "missing"], ["cat"])
    with pytest.raises(StepFailed, match=r"`sh -c 'cat >/dev/null; exit 7'` failed with exit code 7"):
        effects.pipe(["tar", "-C", str(tmp_path), "-c", "f"], ["sh", "-c", "cat >/dev/null; exit 7"])
    with pytest.raises(StepFailed, match="command not found: gpuprov-no-such-binary"):
        effects.pipe(["tar", "-C", str(tmp_path), "-c", "f"], ["gpuprov-no-such-binary"])
    with pytest.raises(StepFailed, match="timed out after 0.5 s"):
        effects.pipe(["sleep", "30"], ["cat"], timeout=0.5)


def test_spawn(tmp_path):
    log = tmp_path / "d.log"
    script = 'echo up; echo err >&2; cut -d" " -f6 /proc/$$/stat > "$1.tmp"; mv "$1.tmp" "$1"'
    pid = effects.spawn(["sh", "-c", script, "sh", str(tmp_path / "sid")], log)
    assert effects.wait_for(lambda: (tmp_path / "sid").exists(), 10)
    assert int((tmp_path / "sid").read_text()) == pid  # its own session: it outlives gpuprov's terminal
    assert log.read_text() == "up\nerr\n"
    with pytest.raises(StepFailed, match="command not found: gpuprov-no-such-binary"):
        effects.spawn(["gpuprov-no-such-binary"], log)
