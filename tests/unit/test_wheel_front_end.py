"""The wheel carries the runtime's compiled front-end (setup.py's build hook), so hosts with no compiler get it:
`pip wheel .` where a compiler exists gives a platform wheel holding a static binary with empty path slots, which
`runtime install`'s patch_slots fills and which then runs; without a compiler the wheel stays pure (py3-none-any)."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from provision.inject.install import SLOTS, patch_slots
from tests.conftest import REPO, needs


def _wheel(tmp_path: Path, path_env: str) -> Path:
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", ".gpu-*", ".whl", "build", "*.egg-info",
                                                             "__pycache__", "tests"))
    out = tmp_path / "wh"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                        "-w", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PATH": path_env})
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("gpuprov-*.whl")
    return whl


def _has_interpreter(elf: bytes) -> bool:
    """An ELF64 program header of type PT_INTERP (3) names the dynamic loader a binary needs."""
    import struct

    phoff, = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    return any(struct.unpack_from("<I", elf, phoff + i * phentsize)[0] == 3 for i in range(phnum))


@needs("cc")
def test_wheel_carries_a_static_front_end_that_install_can_fill(tmp_path):
    whl = _wheel(tmp_path, os.environ["PATH"])
    assert whl.name.endswith(f"-py3-none-manylinux2014_{platform.machine()}.whl"), whl.name
    with zipfile.ZipFile(whl) as z:
        raw = z.read("provision/inject/gpuprov-runtime.bin")
        assert b"Root-Is-Purelib: false" in z.read("gpuprov-0.1.0.dist-info/WHEEL")
    assert not _has_interpreter(raw), "statically linked: no dynamic loader needed on the host"
    with pytest.raises(ValueError):
        patch_slots(raw, runc="x" * 5000, python="/usr/bin/python3", modify="/m.py")
    exe = tmp_path / "gpuprov-runtime"
    exe.write_bytes(patch_slots(raw, runc="/bin/true", python=sys.executable, modify="/m.py"))
    exe.chmod(0o755)
    r = subprocess.run([str(exe), "--gpuprov-front-end"], capture_output=True, text=True)
    assert r.returncode == 0 and "runc /bin/true" in r.stdout
    with pytest.raises(ValueError):  # filled slots cannot be filled twice (install always starts from the wheel's)
        patch_slots(exe.read_bytes(), **{s: "/x" for s in SLOTS})


def test_wheel_without_a_compiler_stays_pure(tmp_path):
    bindir = tmp_path / "bin"  # a PATH with Python but no C compiler
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    whl = _wheel(tmp_path, str(bindir))
    assert whl.name.endswith("-py3-none-any.whl"), whl.name
    with zipfile.ZipFile(whl) as z:
        assert "provision/inject/gpuprov-runtime.bin" not in z.namelist()
