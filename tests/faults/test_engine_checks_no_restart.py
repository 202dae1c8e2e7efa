"""An engine's own check reads files and needs no daemon, so `--no-restart` never skips it: on containerd 1.6 (the
real binary here) a later glob import that defines the CRI section shadows gpuprov's drop-in, and `config dump`
shows it with or without a restart; the edit is rolled back (exit 5, both files as they were). A `version = 3`
config, which containerd 1.x reads without a word and then ignores, is refused (exit 6) saying which containerd
reads which version."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import needs, run_cli
from tests.faults.conftest import CONFIG_INVALID, RT, snapshot

pytestmark = needs("containerd")
STEP_FAILED = 5


def configure(main: Path, *args: str):
    return run_cli("engine", "configure", "containerd", "--config", str(main), "--runtime-path", RT, *args,
                   env={"GPUPROV_LOCK_DIR": str(main.parent / ".lock")}, timeout=120)


def tree(d: Path) -> dict:
    """Every directory's snapshot (names, bytes, modes, owners), the private lock directory left out."""
    return {p.relative_to(d).as_posix(): {k: v for k, v in snapshot(p).items() if k != ".lock"}
            for p in [d, *d.rglob("*")] if p.is_dir() and ".lock" not in p.parts}


@pytest.mark.parametrize("restart", [[], ["--no-restart"]], ids=["restart", "no-restart"])
def test_shadowing_glob_import_rolled_back_with_or_without_restart(tmp_path, restart):
    """config.toml imports local.d/*.toml; local.d/zz.toml defines the CRI plugin and sorts after nothing gpuprov
    controls: containerd 1.6 replaces the drop-in's whole CRI section with it."""
    (tmp_path / "local.d").mkdir()
    (tmp_path / "local.d/zz.toml").write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n'
                                              '  sandbox_image = "registry.local/pause:3.9"\n')
    main = tmp_path / "config.toml"
    main.write_text(f'version = 2\nimports = ["{tmp_path}/conf.d/*.toml", "{tmp_path}/local.d/*.toml"]\n')
    before = tree(tmp_path)
    r = configure(main, *restart)
    assert r.returncode == STEP_FAILED, (r.returncode, r.stdout, r.stderr)
    assert "rolled back" in r.stderr and "import gpuprov's drop-in last" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert tree(tmp_path) == before  # main byte-identical, no drop-in, no backup, no conf.d left


def test_no_restart_checked_and_verified_when_containerd_reads_it(tmp_path):
    main = tmp_path / "config.toml"
    main.write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "x/pause:1"\n')
    r = configure(main, "--no-restart", "--json")
    assert r.returncode == 0, r.stderr
    assert '"verified": true' in r.stdout  # `config dump` ran and showed the runtime


def test_version_3_on_containerd_1_6_is_exit_6(tmp_path):
    main = tmp_path / "config.toml"
    main.write_text('version = 3\n[plugins."io.containerd.cri.v1.runtime"]\n  enable_selinux = false\n')
    before = tree(tmp_path)
    r = configure(main, "--no-restart")
    assert r.returncode == CONFIG_INVALID, (r.returncode, r.stderr)
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "version-3" in err and "containerd 2.0 and later" in err and "1.6" in err and "versions 1 and 2" in err
    assert tree(tmp_path) == before
