"""containerd: gpuprov's runtime as a drop-in (conf.d/99-gpuprov.toml) plus one `imports` entry, checked by the real
`containerd config dump` (bookworm's 1.6 here; the newer containerd in tests/cri/), rolled back when containerd does
not read it as intended, refused (nothing written) for configs containerd would reject and for hostile names."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import tomllib

from provision.engines import containerd
from provision.engines.configure import configure
from provision.errors import GpuprovError
from tests.conftest import needs, run_cli

RT = "/usr/local/bin/gpuprov-runtime"
CRI2 = "io.containerd.grpc.v1.cri"
pytestmark = needs("containerd")

USER_MAIN = """# the operator's containerd config
version = 2
root = "{root}"
oom_score = -999

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.local/pause:3.9"   # theirs
  max_container_log_line_size = 4321
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = true
"""


def dump(main: Path, binary: str = "containerd") -> dict:
    p = subprocess.run([binary, "--config", str(main), "config", "dump"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return tomllib.loads(p.stdout)


def cri(d: dict) -> dict:
    return d["plugins"][CRI2]


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def cli(*args: str):
    return run_cli("engine", "configure", "containerd", "--runtime-path", RT, "--json", *args)


def test_dropin_and_one_imports_line(tmp_path):
    main = tmp_path / "config.toml"
    main.write_text(USER_MAIN.format(root=tmp_path / "root"))
    before = dump(main)
    r = cli("--config", str(main), "--cdi")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    dropin = tmp_path / "conf.d/99-gpuprov.toml"
    assert res["changed"] and res["verified"] is True and dropin.exists()
    # The operator's file: their bytes, plus exactly one line (the imports entry), comments included.
    new_lines = main.read_text().splitlines()
    assert [ln for ln in new_lines if not ln.startswith("imports")] == USER_MAIN.format(root=tmp_path / "root"
                                                                                       ).splitlines()
    assert f'imports = ["{dropin}"]' in new_lines
    after = dump(main)
    nv = cri(after)["containerd"]["runtimes"]["nvidia"]
    assert nv["options"]["BinaryName"] == RT and nv["runtime_type"] == "io.containerd.runc.v2"
    assert nv["options"]["SystemdCgroup"] is True  # the runc entry's options carried over
    assert cri(after)["sandbox_image"] == "registry.local/pause:3.9" and after["oom_score"] == -999
    assert cri(after)["containerd"]["runtimes"]["runc"] == cri(before)["containerd"]["runtimes"]["runc"]
    assert containerd.lost_settings(before, after, runtime_name="nvidia", default=False, cdi=True) == []
    # containerd 1.6 has no CDI: said, not written.
    assert "enable_cdi" not in dropin.read_text() and any("no CDI support" in w for w in res["warnings"])
    snapshot = files(tmp_path)
    again = cli("--config", str(main), "--cdi")
    assert again.returncode == 0 and json.loads(again.stdout)["changed"] is False
    assert files(tmp_path) == snapshot  # idempotent: not one byte, no new backup


def test_imported_file_defines_cri_section(tmp_path):
    """The operator keeps the CRI settings in an imported file: that file and the main config keep their bytes
    (but the imports line), and containerd's merged config has the runtime *and* every setting it had."""
    cri_file = tmp_path / "cri.toml"
    cri_file.write_text(USER_MAIN.split("\n", 4)[4].replace("oom_score = -999\n", ""))
    cri_file.write_text('version = 2\n' + cri_file.read_text())
    main = tmp_path / "config.toml"
    main.write_text(f'version = 2\nimports = ["{cri_file}"]  # mine\nroot = "{tmp_path / "root"}"\n')
    cri_bytes, before = cri_file.read_bytes(), dump(main)
    assert cri(before)["sandbox_image"] == "registry.local/pause:3.9"
    r = cli("--config", str(main), "--default")
    assert r.returncode == 0, r.stderr
    assert cri_file.read_bytes() == cri_bytes
    assert main.read_text().startswith(f'version = 2\nimports = ["{cri_file}", "{tmp_path}/conf.d/99-gpuprov.toml"]'
                                       "  # mine\n")
    after = dump(main)
    assert cri(after)["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == RT
    assert cri(after)["containerd"]["default_runtime_name"] == "nvidia"
    assert containerd.lost_settings(before, after, runtime_name="nvidia", default=True, cdi=False) == []


def test_no_main_config_keeps_the_default_runc(tmp_path):
    """An explicit runtimes table replaces containerd's default one: without a runc entry in the drop-in, the CRI
    plugin's default handler (runc) would vanish and the plugin would not start."""
    main = tmp_path / "etc/config.toml"
    r = cli("--config", str(main))
    assert r.returncode == 0, r.stderr
    assert main.read_text() == f'version = 2\nimports = ["{tmp_path}/etc/conf.d/99-gpuprov.toml"]\n'
    rts = cri(dump(main))["containerd"]["runtimes"]
    assert set(rts) == {"runc", "nvidia"} and cri(dump(main))["containerd"]["default_runtime_name"] == "runc"


def test_rolled_back_when_containerd_does_not_read_it(tmp_path):
    """containerd 1.x: a file imported after the drop-in that defines the CRI plugin replaces the drop-in's section.
    The check (`config dump`) sees it; both files are put back: the main config byte-identical, the drop-in gone."""
    late, later = tmp_path / "late.toml", tmp_path / "later.toml"
    late.write_text(f'version = 2\nimports = ["{later}"]\n')
    later.write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "x/pause:1"\n')
    main = tmp_path / "config.toml"
    main.write_text(f'version = 2\nimports = ["{late}"]\n')
    snapshot = files(tmp_path)
    r = cli("--config", str(main))
    assert r.returncode == 5 and "rolled back" in r.stderr and "import gpuprov's drop-in last" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert files(tmp_path) == snapshot  # main byte-identical, no drop-in, no backup left
    assert not (tmp_path / "conf.d").exists()  # nor the directory made for it


@pytest.mark.parametrize("bad", ['version = "2"\n', "version = 2.0\n", "version = 4\n", "version = true\n",
                                 "version = 2\nimports = \"/etc/x.toml\"\n", "version = 2\n[plugins.\n",
                                 "version = 2\nversion = 3\n",
                                 'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes]\nnvidia = 1\n'])
def test_invalid_config_refused_untouched(tmp_path, bad):
    main = tmp_path / "config.toml"
    main.write_text(bad)
    with pytest.raises(GpuprovError) as e:
        configure("containerd", config=str(main), runtime_path=RT)
    assert e.value.exit_code == 6 and "\n" not in str(e.value) and "not changed" in str(e.value)
    assert files(tmp_path) == {"config.toml": bad.encode()}


def test_cli_version_not_an_integer(tmp_path):
    main = tmp_path / "config.toml"
    main.write_bytes(b'version = "2"\n[plugins]\n')
    r = cli("--config", str(main))
    assert r.returncode == 6 and "is not a containerd config version" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and files(tmp_path) == {"config.toml": b'version = "2"\n[plugins]\n'}


def test_missing_import_refused(tmp_path):
    main = tmp_path / "config.toml"
    main.write_text(f'version = 2\nimports = ["{tmp_path}/gone.toml"]\n')
    r = cli("--config", str(main))
    assert r.returncode == 6 and "does not exist" in r.stderr
    assert files(tmp_path) == {"config.toml": main.read_bytes()}


def test_operators_runtime_and_default_are_theirs(tmp_path):
    main = tmp_path / "config.toml"
    theirs = ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n  default_runtime_name = "crun"\n'
              '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.crun]\n    runtime_type = "io.containerd.runc.v2"\n'
              '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n    runtime_type = "io.containerd.runc.v2"\n'
              '    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
              '      BinaryName = "/usr/bin/nvidia-container-runtime"\n')
    main.write_text(theirs)
    r = cli("--config", str(main))
    assert r.returncode == 14 and "nvidia-container-runtime" in r.stderr and main.read_text() == theirs
    assert not (tmp_path / "conf.d").exists()
    r = cli("--config", str(main), "--runtime-name", "gpu", "--default")
    assert r.returncode == 14 and "'crun'" in r.stderr and main.read_text() == theirs
    r = cli("--config", str(main), "--replace-runtime", "--default")
    assert r.returncode == 0, r.stderr
    after = cri(dump(main))["containerd"]
    assert after["runtimes"]["nvidia"]["options"]["BinaryName"] == RT and after["default_runtime_name"] == "nvidia"
    assert "crun" in after["runtimes"]  # replaced only what was asked


@pytest.mark.parametrize("name,path", [('nv"idia', RT), ("../../etc/x", RT), ("NVIDIA", RT), ("a" * 64, RT),
                                       ("nvidia", "gpuprov-runtime"), ("nvidia", "/usr/../tmp/x"),
                                       ("nvidia", '/usr/bin/x"\n[evil]')])
def test_hostile_names_refused(tmp_path, name, path):
    main = tmp_path / "config.toml"
    main.write_text("version = 2\n")
    with pytest.raises(GpuprovError) as e:
        configure("containerd", config=str(main), runtime_name=name, runtime_path=path)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    assert files(tmp_path) == {"config.toml": b"version = 2\n"}


@pytest.mark.parametrize("name,said", [("../x", "'../x': a name of letters"),  # no engine takes it (the option's rule)
                                       ("Nvidia_GPU", "not a CRI handler name")])  # Docker would, CRI engines not
def test_cli_hostile_name(tmp_path, name, said):
    main = tmp_path / "config.toml"
    main.write_text("version = 2\n")
    r = cli("--config", str(main), "--runtime-name", name)
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert files(tmp_path) == {"config.toml": b"version = 2\n"}


def test_dry_run_writes_nothing(tmp_path):
    main = tmp_path / "config.toml"
    main.write_text("version = 2\n")
    r = cli("--config", str(main), "--dry-run")
    assert r.returncode == 0 and json.loads(r.stdout)["changed"] is True
    assert "99-gpuprov.toml" in json.loads(r.stdout)["diff"]
    assert files(tmp_path) == {"config.toml": b"version = 2\n"}


def test_plan_for_containerd_2_holds_only_gpuprovs_keys(tmp_path):
    """containerd 2.x merges imported plugin sections key by key (tests/cri proves it on a real 2.x): the drop-in
    carries gpuprov's keys only, so the operator's later edits of their own CRI settings keep working."""
    main = tmp_path / "config.toml"
    main.write_text('version = 3\n[plugins."io.containerd.cri.v1.runtime"]\n  max_container_log_line_size = 4321\n'
                    '  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]\n'
                    '    SystemdCgroup = true\n')
    p = containerd.plan(main, runtime_name="nvidia", runtime_path=RT, cdi=True,
                        binary=containerd.Binary(None, (2, 1)))
    doc = tomllib.loads(p.dropin_new)
    assert doc == {"version": 3, "plugins": {"io.containerd.cri.v1.runtime": {
        "containerd": {"runtimes": {"nvidia": {"runtime_type": "io.containerd.runc.v2",
                                               "options": {"SystemdCgroup": True, "BinaryName": RT}}}},
        "enable_cdi": True, "cdi_spec_dirs": ["/etc/cdi", "/var/run/cdi"]}}}
    with pytest.raises(Exception, match="version-1"):
        main.write_text("[plugins.cri]\n")
        containerd.plan(main, runtime_name="nvidia", runtime_path=RT, binary=containerd.Binary(None, (2, 1)))


def test_version_1_config_on_containerd_1_6(tmp_path):
    main = tmp_path / "config.toml"
    main.write_text('[plugins.cri]\n  sandbox_image = "registry.local/pause:3.9"\n')
    r = cli("--config", str(main))
    assert r.returncode == 0, r.stderr
    after = cri(dump(main))
    assert after["sandbox_image"] == "registry.local/pause:3.9"
    assert after["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == RT


@needs("chattr")
def test_failed_write_midway_leaves_nothing(tmp_path):
    """The drop-in is written first; when the main config then cannot be written (here: immutable), the drop-in and
    the conf.d directory made for it are removed again: exit 13, the operator's file as it was."""
    main = tmp_path / "config.toml"
    main.write_text("version = 2\n")
    subprocess.run(["chattr", "+i", str(main)], check=True)
    try:
        with pytest.raises(GpuprovError) as e:
            configure("containerd", config=str(main), runtime_path=RT)
    finally:
        subprocess.run(["chattr", "-i", str(main)], check=True)
    assert e.value.exit_code == 13
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"] and main.read_text() == "version = 2\n"


def test_operator_edit_after_configure_is_picked_up_by_a_rerun(tmp_path):
    """containerd 1.x: the drop-in holds a copy of the CRI section, so an edit of the operator's own CRI settings is
    shadowed until gpuprov runs again; `--dry-run`/`--check` shows it, and the re-run carries the new value over."""
    main = tmp_path / "config.toml"
    main.write_text(USER_MAIN.format(root=tmp_path / "root"))
    assert cli("--config", str(main)).returncode == 0
    main.write_text(main.read_text().replace("registry.local/pause:3.9", "registry.local/pause:3.10"))
    assert cri(dump(main))["sandbox_image"] == "registry.local/pause:3.9"  # shadowed by the drop-in's copy
    r = cli("--config", str(main), "--dry-run")
    assert json.loads(r.stdout)["changed"] is True and "pause:3.10" in json.loads(r.stdout)["diff"]
    assert cli("--config", str(main)).returncode == 0
    assert cri(dump(main))["sandbox_image"] == "registry.local/pause:3.10"


@pytest.mark.parametrize("main_pid, restarts", [("4242", True), ("17", False), ("0", False)])
def test_systemctl_restarts_only_the_units_own_daemon(monkeypatch, main_pid, restarts):
    """On a systemd host, `systemctl restart containerd` only when the daemon that reads the edited config is that
    unit's main process; a private containerd (its own --config, pid 4242 here) is named instead, and the system's
    left alone (seen in a systemd host container: a CI containerd's edit restarted the host's containerd)."""
    from provision import effects
    from provision.engines.base import Daemon, EnginePlan

    ran: list[list[str]] = []

    def fake_run(argv, **kw):
        ran.append(argv)
        return effects.CommandResult(argv, 0, main_pid + "\n" if "show" in argv else "")

    monkeypatch.setattr(effects, "has_systemd", lambda: True)
    monkeypatch.setattr(effects, "run", fake_run)
    monkeypatch.setattr(Daemon, "in_our_mount_namespace", lambda self: True)
    daemon = Daemon(4242, ("containerd", "--config", "/tmp/x/config.toml"), "/tmp/x/config.toml")
    said = containerd.ContainerdEngine().apply(daemon, EnginePlan([], []), restart=True)
    assert (["systemctl", "restart", "containerd"] in ran) is restarts
    assert said == "systemctl restart containerd" if restarts else "pid 4242" in said
