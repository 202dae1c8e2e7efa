"""CRI-O's merged configuration is the proof: CRI-O reads crio.conf, then crio.conf.d/* in name order, later keys
winning. A drop-in that sorts after gpuprov's `99-gpuprov.conf` and sets one of gpuprov's keys (`zz-local.conf`
with `default_runtime = "crun"` under --default, a handler of the same name, `cdi_spec_dirs` under --cdi) would
override what gpuprov reports as configured: exit 14 naming that file, nothing written. The same settings in a file
read *before* gpuprov's are overridden by gpuprov's and stay fine."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.faults.conftest import CONFLICT, RT, snapshot


def configure(d: Path, *args: str):
    return run_cli("engine", "configure", "crio", "--config", str(d), "--runtime-path", RT, "--no-restart", *args,
                   env={"GPUPROV_LOCK_DIR": str(d.parent / "lock")}, timeout=60)


LATE = {
    "default": ('[crio.runtime]\ndefault_runtime = "crun"\n', ["--default"], "crio.runtime.default_runtime"),
    "handler": ('[crio.runtime.runtimes.nvidia]\nruntime_path = "/usr/bin/crun"\n', [],
                "crio.runtime.runtimes.nvidia.runtime_path"),
    "handler-extra-key": ('[crio.runtime.runtimes.nvidia]\nruntime_root = "/run/elsewhere"\n', [],
                          "crio.runtime.runtimes.nvidia.runtime_root"),
    "cdi": ('[crio.runtime]\ncdi_spec_dirs = ["/opt/cdi"]\n', ["--cdi"], "crio.runtime.cdi_spec_dirs"),
}


@pytest.mark.parametrize("case", sorted(LATE))
def test_later_dropin_overriding_gpuprov_is_a_conflict(tmp_path, case):
    text, args, key = LATE[case]
    d = tmp_path / "crio.conf.d"
    d.mkdir()
    (d / "zz-local.conf").write_text(text)
    before = snapshot(d)
    r = configure(d, *args)
    assert r.returncode == CONFLICT, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(d / "zz-local.conf") in err and key in err
    assert snapshot(d) == before  # no 99-gpuprov.conf written, zz-local.conf as it was
    # --replace-runtime cannot help: gpuprov never edits the operator's file, so it would still lose
    assert configure(d, *args, "--replace-runtime").returncode == CONFLICT and snapshot(d) == before


def test_same_settings_read_before_gpuprov_are_overridden_by_it(tmp_path):
    d = tmp_path / "crio.conf.d"
    d.mkdir()
    (d / "10-local.conf").write_text('[crio.runtime]\ndefault_runtime = "crun"\ncdi_spec_dirs = ["/opt/cdi"]\n')
    r = configure(d, "--default", "--cdi", "--json")
    assert r.returncode == 0, r.stderr
    assert '"verified": true' in r.stdout and (d / "99-gpuprov.conf").exists()


def test_later_dropin_on_other_keys_is_fine(tmp_path):
    d = tmp_path / "crio.conf.d"
    d.mkdir()
    (d / "zz-local.conf").write_text('[crio.runtime]\nlog_level = "debug"\n[crio.runtime.runtimes.kata]\n'
                                     'runtime_path = "/usr/bin/kata-runtime"\n')
    r = configure(d, "--default", "--json")
    assert r.returncode == 0, r.stderr
    assert '"verified": true' in r.stdout
