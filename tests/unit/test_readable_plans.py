"""Issue 39 item 5: a dry run prints what a person can read. `uninstall --dry-run` with a container running printed
1 MB, an 8,352-line diff of the runtime's ELF binary (the pass-through that replaces it), and the same plan filled
the terminal at the prompt. Now a binary file is named with its size and SHA-256, never diffed, and a plan step is a
few lines (its title, the check that skips it, one line of what it does); the commands and diffs are -v's and
--json's."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

from provision.output import print_steps
from provision.plan.build import build_plan
from provision.plan.options import Options
from provision.plan.steps import Command, Step, WriteFile
from provision.report import detect_host
from tests.conftest import DISTROS, REPO, make_host
from tests.unit.test_golden_plans import KERNELS, LEGACY_GPU

RUNTIME = "/usr/local/bin/gpuprov-runtime"
SHIM = "#!/bin/sh\n# gpuprov pass-through\nexec /usr/sbin/runc \"$@\"\n"


def _elf(size: int = 700_000) -> bytes:
    """An executable's bytes: NULs, newlines and high bytes, as a compiled front-end has (~700 KB)."""
    block = b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) + b"\n" * 40
    return (block * (size // len(block) + 1))[:size]


def _printed(steps: list[dict], verbose: bool = False) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_steps("Uninstall plan", steps, verbose=verbose)
    return buf.getvalue()


def test_a_binary_file_is_named_with_its_size_and_hash_never_diffed(tmp_path):
    """On main: the diff held every 'line' of the ELF (here 16,400 lines, 1.4 MB printed)."""
    data = _elf()
    (tmp_path / "usr/local/bin").mkdir(parents=True)
    (tmp_path / RUNTIME.lstrip("/")).write_bytes(data)
    step = Step("uninstall.runtime", "runtime", "Remove gpuprov-runtime; it becomes a pass-through to runc",
                actions=(WriteFile(RUNTIME, SHIM, mode=0o755, backup=False),))
    d = step.to_dict(tmp_path)
    diff = d["diffs"][RUNTIME]
    assert diff.splitlines() == [
        f"Binary file {RUNTIME}: not diffed",
        f"  current: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}",
        f"  gpuprov: {len(SHIM)} bytes, sha256 {hashlib.sha256(SHIM.encode()).hexdigest()}"]
    assert d["effect"] == f"replaces {RUNTIME} (binary)"
    short, full = _printed([d]), _printed([d], verbose=True)
    assert len(short) < 600 and len(full) < 900 and "\x00" not in full and "\ufffd" not in full
    assert len(json.dumps(d)) < 1500  # --json too
    # a text file is still diffed, line by line
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/x.conf").write_text("a\nb\n")
    text = WriteFile("/etc/x.conf", "a\nc\n").diff(tmp_path)
    assert "-b\n" in text and "+c\n" in text and text.startswith("--- /etc/x.conf (current)")
    # a binary file gpuprov would write where none is
    assert "current: none" in WriteFile("/usr/bin/new", "\x00").diff(tmp_path)


def _plan(tmp_path, name: str):
    root = make_host(tmp_path, name, LEGACY_GPU.get(name, "datacenter"),
                     kernel=KERNELS.get(name.split("-")[0], "5.14.0-427.13.1.el9_4.x86_64"))
    (root / "run/systemd/system").mkdir(parents=True, exist_ok=True)
    return root, [s.to_dict(root) for s in build_plan(detect_host(root, engines=False), Options())]


@pytest.mark.parametrize("name", sorted(p.name for p in DISTROS.iterdir() if p.name != "centos-7-legacy"))
def test_a_plan_step_is_a_few_lines_and_verbose_has_every_command(tmp_path, name):
    """On main a step ran to 8-40 lines (Debian 12's plan: 162 lines, 11 KB; now 52 lines, 3.7 KB). The longest
    now (7 lines) are the driver's, whose title and check name every package."""
    _, steps = _plan(tmp_path, name)
    short, full = _printed(steps), _printed(steps, verbose=True)
    lines = short.splitlines()
    starts = [i for i, ln in enumerate(lines) if re.match(r" ?\d+\. ", ln)] + [len(lines) - 1]
    assert len(starts) - 1 == len(steps)
    assert max(b - a for a, b in zip(starts, starts[1:])) <= 7, short
    assert not any(ln.lstrip().startswith(("$ ", "--- ", "+++ ", "@@ ")) for ln in lines), short
    for s in steps:  # each step's effect is in the short plan, and each of its commands in the verbose one
        assert " ".join(s["effect"].split()[:3]) in " ".join(short.split())
        for c in s["commands"]:
            assert c.split()[-1] in full
    assert len(full) > 2 * len(short)


def test_the_effect_line_names_programs_files_in_process_work_and_exits():
    step = Step("x", "engine", "Install the engine", actions=(
        Command(("apt-get", "update"), env=(("DEBIAN_FRONTEND", "noninteractive"),)),
        Command(("/usr/bin/apt-get", "install", "-y", "docker.io")), Command(("dkms", "status"))))
    assert step.effect() == "runs 3 commands (apt-get, dkms)"
    assert Step("y", "engine", "t").effect() == "done by gpuprov itself (-v: how)"
    assert Step("z", "engine", "t", actions=(WriteFile("/etc/a", "x\n"),)).effect() == "writes /etc/a"


def _gpuprov(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "provision", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)


def test_plan_and_bootstrap_dry_run_print_commands_only_with_verbose(tmp_path):
    root, _ = _plan(tmp_path, "debian-12")
    short = _gpuprov("plan", "--root", str(root))
    full = _gpuprov("plan", "-v", "--root", str(root))
    dry = _gpuprov("bootstrap", "--dry-run", "--verbose", "--root", str(root))
    assert short.returncode == full.returncode == dry.returncode == 0, short.stderr + full.stderr + dry.stderr
    assert "$ " not in short.stdout and "--- /etc/docker/daemon.json (current)" not in short.stdout
    assert "      $ DEBIAN_FRONTEND=noninteractive" in full.stdout and "+++ /etc/docker/daemon.json" in full.stdout
    assert dry.stdout == full.stdout
    assert len(short.stdout.splitlines()) < 60 < 150 < len(full.stdout.splitlines())
