"""Issue 27 item 14: `GPUPROV_WHEELHOUSE=DIR ./install.sh` upgrades. The newest gpuprov in DIR replaces the one
installed and says which replaced which; an older one is refused (exit 14) unless GPUPROV_ALLOW_DOWNGRADE=1. Real
install.sh, real venv and pip; the wheels are minimal gpuprov distributions whose `gpuprov` command only prints its
version and arguments, so the script's closing `gpuprov bootstrap …` changes nothing (the venv and the command's
link live under tmp_path through GPUPROV_PREFIX and GPUPROV_BIN_DIR)."""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.conftest import needs
from tests.faults.conftest import root_only

REPO = Path(__file__).resolve().parents[2]
CONFLICT = 14


def fake_wheel(d: Path, version: str) -> Path:
    """A pure-Python wheel of `gpuprov` VERSION (RECORD with hashes, as pip writes them)."""
    dist = f"gpuprov-{version}.dist-info"
    files = {
        "gpuprov_fake.py": f"import sys\ndef main():\n    print('fake gpuprov {version}', *sys.argv[1:])\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: gpuprov\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}/entry_points.txt": "[console_scripts]\ngpuprov = gpuprov_fake:main\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    path = d / f"gpuprov-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path


def install(tmp_path: Path, wheelhouse: Path, arg: str = "--check", **env) -> subprocess.CompletedProcess:
    (tmp_path / "bin").mkdir(exist_ok=True)
    e = {**os.environ, "GPUPROV_WHEELHOUSE": str(wheelhouse), "GPUPROV_PREFIX": str(tmp_path / "venv"),
         "GPUPROV_BIN_DIR": str(tmp_path / "bin"), "PIP_DISABLE_PIP_VERSION_CHECK": "1", **env}
    # A private mount namespace with a tmpfs over /usr/local/bin: whatever this install.sh does (an older one links
    # there unasked), the host's commands stay as they were.
    # (--check: a bootstrap argument passed through; --dry-run would install nothing, issue 28 item 13)
    script = 'mount -t tmpfs gpuprov-test /usr/local/bin && exec bash "$0" "$1"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                           str(REPO / "install.sh"), arg], capture_output=True, text=True, env=e, timeout=600)


@needs("python3", "unshare")
@root_only
@pytest.mark.slow
def test_wheelhouse_upgrades_and_refuses_a_downgrade(tmp_path):
    wh = tmp_path / "wh"
    wh.mkdir()
    fake_wheel(wh, "0.9.0")
    r = install(tmp_path, wh)
    assert r.returncode == 0, r.stderr
    assert "installed gpuprov 0.9.0" in r.stderr and r.stdout.strip() == "fake gpuprov 0.9.0 bootstrap --check"
    assert [w.name.split("-")[1] for w in (tmp_path / "venv/wheels").glob("gpuprov-*.whl")] == ["0.9.0"]  # kept

    fake_wheel(wh, "0.10.0")  # newer (and sorted after 0.9.0 only as a version, not as text)
    r = install(tmp_path, wh)
    assert r.returncode == 0, r.stderr
    assert "gpuprov 0.10.0 replaced gpuprov 0.9.0" in r.stderr and r.stdout.startswith("fake gpuprov 0.10.0")
    assert [w.name.split("-")[1] for w in (tmp_path / "venv/wheels").glob("gpuprov-*.whl")] == ["0.10.0"]

    r = install(tmp_path, wh)  # the same again: nothing to replace, said so
    assert r.returncode == 0 and "0.10.0 is installed already" in r.stderr

    old = tmp_path / "old"
    old.mkdir()
    fake_wheel(old, "0.9.0")
    r = install(tmp_path, old)
    assert r.returncode == CONFLICT and "refusing to downgrade gpuprov 0.10.0 to 0.9.0" in r.stderr
    assert "GPUPROV_ALLOW_DOWNGRADE=1" in r.stderr and r.stdout == ""  # bootstrap never ran
    version = [str(tmp_path / "venv/bin/python"), "-I", "-c", "import importlib.metadata as m; print(m.version('gpuprov'))"]
    assert subprocess.run(version, capture_output=True, text=True).stdout.strip() == "0.10.0"

    r = install(tmp_path, old, GPUPROV_ALLOW_DOWNGRADE="1")
    assert r.returncode == 0 and "gpuprov 0.9.0 replaced gpuprov 0.10.0" in r.stderr
    assert subprocess.run(version, capture_output=True, text=True).stdout.strip() == "0.9.0"

    empty = tmp_path / "empty"
    empty.mkdir()
    r = install(tmp_path, empty)
    assert r.returncode == 2 and "no gpuprov wheel" in r.stderr


@needs("python3", "unshare")
@root_only
@pytest.mark.slow
def test_dry_run_installs_nothing(tmp_path):
    """`install.sh --dry-run` (issue 28 item 13): gpuprov's plan from a throwaway virtualenv, nothing installed or
    linked, nothing left in its scratch directory ($TMPDIR, else /tmp). (Before: it installed gpuprov into the prefix
    and linked it, then ran the plan.)"""
    wh = tmp_path / "wh"
    wh.mkdir()
    fake_wheel(wh, "0.9.0")
    tmp = tmp_path / "tmp"  # install.sh's scratch lives under $TMPDIR: its own here (another run's /tmp is not read)
    tmp.mkdir()
    r = install(tmp_path, wh, "--dry-run", TMPDIR=str(tmp))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "fake gpuprov 0.9.0 bootstrap --dry-run" and "would install gpuprov into" in r.stderr
    assert not (tmp_path / "venv").exists() and list((tmp_path / "bin").iterdir()) == []
    assert list(tmp.iterdir()) == []
