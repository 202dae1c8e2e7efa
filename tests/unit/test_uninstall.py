"""`gpuprov uninstall` is bootstrap's inverse: each adapter's undo takes out gpuprov's keys and only them (the
operator's edits since bootstrap kept, their exact bytes where gpuprov's own line changes come out cleanly), from
its own record or, without one, by what the keys are; and the uninstall plan runs what it prints (printed argvs and
file contents == executed ones), leaves the files as they were, and plans nothing the second time."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest

from provision import effects, paths, record
from provision.engines import containerd as ctd
from provision.engines import validate
from provision.engines.base import undo_text
from provision.engines.configure import configure
from provision.engines.crio import CrioEngine, render
from provision.engines.docker import DockerEngine
from provision.inject import devchar
from provision.plan import apply as ap
from provision.plan import steps as st
from provision.plan import uninstall as un
from tests.conftest import needs

RT = "/usr/local/bin/gpuprov-runtime"
LIVE = Path("/")


@pytest.fixture(autouse=True)
def private_record(tmp_path, monkeypatch):
    """Each test its own install record (record.py reads paths.INSTALL_RECORD at call time)."""
    monkeypatch.setattr(paths, "INSTALL_RECORD", str(tmp_path / "state" / "installed.json"))


def edit_json(path: Path, **keys) -> None:
    """An operator's edit with the usual tool: load, set, write back 2-space JSON."""
    doc = json.loads(path.read_text())
    doc.update(keys)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def undo(engine, path: Path) -> str | None:
    """What the adapter's undo leaves in `path` (None: the file is removed)."""
    plan = engine.unplan(path, record.read().configs.get(str(path)))
    if path in plan.removals:
        return None
    return next((e.new for e in plan.edits if e.path == path), path.read_text())


# ---------------------------------------------------------------- the three-way merge


def test_undo_text_gives_back_the_operators_bytes():
    old = "a\nb\nc\nd\n"
    written = "a\nb\nGPUPROV\nc\nd\n"
    assert undo_text(old, written, written) == old
    assert undo_text(old, written, "a\nb\nGPUPROV\nc\nd\nmine\n") == old + "mine\n"  # an edit away from ours
    assert undo_text(old, written, "x\nb\nGPUPROV\nc\nd\n") == "x\nb\nc\nd\n"
    assert undo_text(old, written, "a\nmine\nGPUPROV\nc\nd\n") is None  # next to ours: not guessed
    assert undo_text(old, written, "a\nb\nGPUPROV changed\nc\nd\n") is None
    assert undo_text(None, written, written) is None and undo_text(None, written, written + "x\n") is None


# ---------------------------------------------------------------- docker


OPERATOR = {"log-driver": "json-file", "log-opts": {"max-size": "10m"}, "registry-mirrors": ["https://m.invalid"]}


@pytest.mark.parametrize("indent", [2, 4, None])
@pytest.mark.parametrize("cdi", [False, True])
def test_docker_round_trip_keeps_the_operators_edit(tmp_path, indent, cdi):
    cfg = tmp_path / "daemon.json"
    original = json.dumps(OPERATOR, indent=indent) + "\n"
    cfg.write_text(original)
    configure("docker", config=str(cfg), runtime_path=RT, default=True, cdi=cdi, restart=False)
    assert json.loads(cfg.read_text())["default-runtime"] == "nvidia"
    eng = DockerEngine()
    assert undo(eng, cfg) == original  # no edit since: the very bytes
    edit_json(cfg, **{"log-level": "warn"})
    after = undo(eng, cfg)
    assert json.loads(after) == {**OPERATOR, "log-level": "warn"}
    assert list(json.loads(after)) == [*OPERATOR, "log-level"]
    if indent == 2:  # the operator's format is the one written back: byte for byte
        assert after == json.dumps({**OPERATOR, "log-level": "warn"}, indent=2) + "\n"


def test_docker_replace_runtime_gives_the_operators_runtime_back(tmp_path):
    cfg = tmp_path / "daemon.json"
    mine = {"runtimes": {"nvidia": {"path": "/usr/bin/runc", "runtimeArgs": ["--debug"]}}, "default-runtime": "runc"}
    cfg.write_text(json.dumps(mine, indent=2) + "\n")
    configure("docker", config=str(cfg), runtime_path=RT, default=True, replace=True, restart=False)
    edit_json(cfg, debug=True)
    assert json.loads(undo(DockerEngine(), cfg)) == {**mine, "debug": True}


def test_docker_runtime_replaced_by_a_later_run_is_given_back(tmp_path):
    """bootstrap, then the operator registers their own `nvidia`, then a run with --replace-runtime: uninstall gives
    the operator's entry back (the latest one gpuprov replaced)."""
    cfg = tmp_path / "daemon.json"
    configure("docker", config=str(cfg), runtime_path=RT, default=False, restart=False)
    theirs = {"path": "/usr/bin/runc", "runtimeArgs": ["--debug"]}
    edit_json(cfg, runtimes={"nvidia": theirs})
    configure("docker", config=str(cfg), runtime_path=RT, default=False, replace=True, restart=False)
    assert json.loads(cfg.read_text())["runtimes"]["nvidia"]["path"] == RT
    assert json.loads(undo(DockerEngine(), cfg)) == {"runtimes": {"nvidia": theirs}}


def test_docker_file_gpuprov_created_is_removed_unless_the_operator_added_to_it(tmp_path):
    cfg = tmp_path / "daemon.json"
    configure("docker", config=str(cfg), runtime_path=RT, default=True, restart=False)
    assert undo(DockerEngine(), cfg) is None
    edit_json(cfg, debug=True)
    assert json.loads(undo(DockerEngine(), cfg)) == {"debug": True}


def test_docker_without_a_record_finds_gpuprovs_keys_by_what_they_are(tmp_path):
    cfg = tmp_path / "daemon.json"
    doc = {"debug": True, "runtimes": {"runc2": {"path": "/usr/bin/runc"}, "nvidia": {"path": RT, "runtimeArgs": []}},
           "default-runtime": "nvidia", "features": {"cdi": True}}
    cfg.write_text(json.dumps(doc, indent=2) + "\n")
    plan = DockerEngine().unplan(cfg, None)
    assert json.loads(plan.edits[0].new) == {"debug": True, "runtimes": {"runc2": {"path": "/usr/bin/runc"}},
                                             "features": {"cdi": True}}  # cdi: nobody can tell it was gpuprov's
    assert not plan.needs_restart  # default-runtime taken out: reloaded live (DockerEngine.reload_live), no restart
    still = tmp_path / "still.json"
    still.write_text(json.dumps({"runtimes": {"runc2": {"path": "/usr/bin/runc"}, "nvidia": {"path": RT}}}))
    assert not DockerEngine().unplan(still, None).needs_restart  # `runtimes` stays in the file: a reload
    theirs = tmp_path / "theirs.json"
    theirs.write_text(json.dumps({"runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime"}},
                                  "default-runtime": "nvidia"}))
    assert not DockerEngine().unplan(theirs, None).changed  # NVIDIA's own runtime is the operator's


# ---------------------------------------------------------------- containerd


MAINS = {
    "imports and tables": 'version = 2\nimports = ["/etc/containerd/other.toml"]\n\n[plugins."io.containerd.grpc.v1.cri"]\n'
                          '  sandbox_image = "registry.lab.internal/pause:3.9"\n',
    "no imports": '# the operator\'s\nversion = 2\nroot = "/var/lib/containerd"\n\n[grpc]\n  max_recv_message_size = 16777216\n',
}


@needs("containerd")
@pytest.mark.parametrize("name", sorted(MAINS))
def test_containerd_round_trip_keeps_the_operators_edit(tmp_path, name):
    main = tmp_path / "config.toml"
    text = MAINS[name].replace("/etc/containerd/other.toml", str(tmp_path / "other.toml"))
    (tmp_path / "other.toml").write_text("")
    main.write_text(text)
    configure("containerd", config=str(main), runtime_path=RT, default=True, restart=False)
    dropin = ctd.dropin_path(main)
    assert dropin.exists() and str(dropin) in main.read_text()
    eng = ctd.ContainerdEngine()
    plan = eng.unplan(main, record.read().configs[str(main)])
    assert plan.removals == [dropin] and plan.needs_restart
    assert plan.edits[0].new == text
    main.write_text(main.read_text() + "\n[debug]\n  level = \"info\"\n")  # the operator's edit
    plan = eng.unplan(main, record.read().configs[str(main)])
    assert plan.edits[0].new == text + "\n[debug]\n  level = \"info\"\n"


@needs("containerd")
def test_containerd_config_gpuprov_created_goes_with_its_directory(tmp_path):
    main = tmp_path / "etc" / "config.toml"
    configure("containerd", config=str(main), runtime_path=RT, restart=False)
    entry = record.read().configs[str(main)]
    assert set(entry["made_dirs"]) >= {str(main.parent / "conf.d")}
    plan = ctd.ContainerdEngine().unplan(main, entry)
    assert plan.removals == [main, ctd.dropin_path(main)] and not plan.edits


def test_containerd_operators_glob_import_stays(tmp_path):
    main = tmp_path / "config.toml"
    main.write_text('version = 2\nimports = ["conf.d/*.toml"]\n')
    (tmp_path / "conf.d").mkdir()
    ctd.dropin_path(main).write_text(ctd.HEADER + "version = 2\n")
    (tmp_path / "conf.d" / "10-mine.toml").write_text("version = 2\n")
    plan = ctd.ContainerdEngine().unplan(main, None)
    assert not plan.edits and plan.removals == [ctd.dropin_path(main)]


# ---------------------------------------------------------------- CRI-O


def test_crio_dropin_removed_only_when_gpuprovs(tmp_path):
    ours = tmp_path / "99-gpuprov.conf"
    ours.write_text(render(runtime_path=RT))
    assert CrioEngine().unplan(ours, None).removals == [ours]
    ours.write_text("[crio.runtime]\n")  # the operator's file under that name
    assert not CrioEngine().unplan(ours, None).changed


# ---------------------------------------------------------------- the whole uninstall plan


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A bootstrapped host's gpuprov files under tmp: a daemon.json configured through the record, the runtime, its
    hook stand-in and settings, state, cache, log and run directories. The machine's own engines are not touched:
    its default configs are read only (they hold nothing of gpuprov's) and the image listing is stubbed."""
    state, run, prefix = tmp_path / "state", tmp_path / "run", tmp_path / "usr/local"
    for name, value in (("STATE_DIR", state), ("RUN_DIR", run), ("INSTALL_RECORD", state / "installed.json"),
                        ("INSTALL_STAMP", state / "runtime/install.stamp"), ("SHARE_STATE", run / "share.json")):
        monkeypatch.setattr(paths, name, str(value))
    monkeypatch.setattr(un, "LOG_FILE", tmp_path / "log/bootstrap.log")
    monkeypatch.setenv("GPUPROV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(tmp_path / "etc/gpuprov/runtime.json"))
    monkeypatch.setattr(un, "lock_dirs", lambda: (str(tmp_path / "lock"),))
    # the /dev/char record and udev rule live at absolute paths: this host's own (if any) are not the plan's
    monkeypatch.setattr(devchar, "RECORD", str(run / "dev-char-links"))
    monkeypatch.setattr(devchar, "UDEV_RULE", str(tmp_path / "etc/udev/rules.d/71-gpuprov-dev-char.rules"))
    monkeypatch.setattr(validate, "leftover_image_argvs", lambda: [])
    cfg = tmp_path / "daemon.json"
    original = json.dumps(OPERATOR, indent=2) + "\n"
    cfg.write_text(original)
    configure("docker", config=str(cfg), runtime_path=RT, default=True, restart=False)
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin/gpuprov-runtime").write_text("#!/bin/sh\n")
    (prefix / "bin/nvidia-container-runtime-hook").write_text("#!/bin/sh\n# gpuprov-hook\n")
    (prefix / "bin/keep-me").write_text("the operator's\n")
    (tmp_path / "etc/gpuprov").mkdir(parents=True)
    (tmp_path / "etc/gpuprov/runtime.json").write_text("{}\n")
    (state / "runtime").mkdir(parents=True)
    (state / "runtime/install.stamp").write_text(json.dumps({"prefix": str(prefix)}))
    for d in ("log", "cache", "run/mps"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "log/bootstrap.log").write_text("x\n")
    (tmp_path / "lock").mkdir()
    (tmp_path / "lock/host.lock").write_text("")
    return tmp_path, cfg, original


def test_uninstall_runs_what_it_prints(host, monkeypatch):
    """Every argv the steps run and every file they write, recorded instead of done, is the one printed."""
    tmp, cfg, original = host
    steps = un.uninstall_steps(LIVE, un.UninstallOptions())
    ran, wrote = [], []
    monkeypatch.setattr(effects, "run", lambda argv, **kw: ran.append(tuple(argv)) or effects.CommandResult(
        list(argv), 0, "", ""))
    monkeypatch.setattr(st, "write_file", lambda path, text, **kw: wrote.append((str(path), text)))
    for s in steps:
        s.apply()
    printed = [tuple(c.argv) for s in steps for c in s.commands]
    assert ran == printed
    assert wrote == [(a.path, a.content) for s in steps for a in s.actions if isinstance(a, st.WriteFile)]
    assert wrote == [(str(cfg), original)]
    assert [s.id for s in steps] == ["uninstall.engine.docker", "uninstall.runtime", "uninstall.state"]
    rm = [a for a in ran if a[0] == "rm"]
    assert rm[1][3:] == (str(tmp / "usr/local/bin/gpuprov-runtime"), str(tmp / "etc/gpuprov/runtime.json"),
                         str(tmp / "usr/local/bin/nvidia-container-runtime-hook"))
    assert str(tmp / "usr/local/bin/keep-me") not in {p for a in ran for p in a}


def test_uninstall_applied_leaves_the_files_as_they_were_and_a_second_plan_is_empty(host):
    tmp, cfg, original = host
    steps = un.uninstall_steps(LIVE, un.UninstallOptions())
    res = ap.apply_plan(steps, quiet=True, logged=False)
    assert res.changed == 3
    assert cfg.read_text() == original and not list(tmp.glob("daemon.json.gpuprov-*.bak"))
    assert sorted(p.name for p in (tmp / "usr/local/bin").iterdir()) == ["keep-me"]
    for gone in ("etc/gpuprov", "state", "log", "cache", "run/mps"):
        assert not (tmp / gone).exists(), gone
    assert (tmp / "lock/host.lock").exists()  # never removed: another run may hold it
    again = un.uninstall_steps(LIVE, un.UninstallOptions())
    assert [s.id for s in again] == []
    assert ap.check_plan(again)["would_change"] == 0


def test_packages_only_from_the_record_and_only_when_asked(host, monkeypatch):
    monkeypatch.setattr(un, "packages_installed", lambda pm, pkgs, root=LIVE: True)
    monkeypatch.setattr(DockerEngine, "stored", lambda self, root: None)  # no data root (tests/unit/test_engine_data.py)
    record.note_packages("driver", ["nvidia-driver", "firmware-misc-nonfree"], held=["nvidia-driver"])
    record.note_packages("engine", ["docker.io"])
    ids = lambda opt: {s.id: s for s in un.uninstall_steps(LIVE, opt)}  # noqa: E731
    assert not {"uninstall.driver.packages", "uninstall.engine.packages"} & set(ids(un.UninstallOptions()))
    steps = ids(un.UninstallOptions(purge_driver=True, purge_engine=True))
    # the dry run first: a purge it refuses (exit 14) leaves gpuprov's holds in place (dnf's order, one Purge)
    assert [c.argv for c in steps["uninstall.driver.packages"].commands] == [
        ("apt-get", "-s", "purge", "nvidia-driver", "firmware-misc-nonfree"), ("apt-mark", "unhold", "nvidia-driver"),
        ("apt-get", "purge", "-y", "nvidia-driver", "firmware-misc-nonfree")]
    assert [c.argv for c in steps["uninstall.engine.packages"].commands] == [("apt-get", "-s", "purge", "docker.io"),
                                                                             ("apt-get", "purge", "-y", "docker.io")]


def test_cli_dry_run_json_changes_nothing(tmp_path):
    env = {"GPUPROV_STATE_DIR": str(tmp_path / "s"), "GPUPROV_RUN_DIR": str(tmp_path / "r"),
           "GPUPROV_CACHE_DIR": str(tmp_path / "c"), "GPUPROV_LOG": str(tmp_path / "l/b.log"),
           "GPUPROV_RUNTIME_CONFIG": str(tmp_path / "rt.json"), "GPUPROV_LOCK_DIR": str(tmp_path / "lock")}
    from tests.conftest import run_cli
    (tmp_path / "s").mkdir()
    r = run_cli("uninstall", "--dry-run", "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "gpuprov.uninstall-plan/v1"
    assert [s["id"] for s in doc["steps"]][-1:] == ["uninstall.state"]
    assert (tmp_path / "s").is_dir() and not (tmp_path / "lock").exists()
    r = run_cli("uninstall", env=env)
    assert r.returncode == 2 and "without --yes" in r.stderr
    shutil.rmtree(tmp_path / "lock", ignore_errors=True)
    assert os.path.isdir(tmp_path / "s")


def test_dnf_purge_names_the_record_and_unlocks_only_gpuprov_locks(tmp_path, monkeypatch):
    """On a dnf host the purge is dnf's: its dry run of the very removal first (no unused dependencies taken
    along: the record names them), then gpuprov's version locks off, then the removal. The versionlock plugin
    gpuprov installed stays while the lock list keeps a lock of the operator's (it would stop holding without it)."""
    (tmp_path / "etc/dnf/plugins").mkdir(parents=True)
    shutil.copy(Path(__file__).parents[1] / "fixtures/el-repos/host/os-release-9", tmp_path / "etc/os-release")
    locks = tmp_path / "etc/dnf/plugins/versionlock.list"
    locks.write_text("# Added lock on Sat Nov 28\nkmod-nvidia-open-0:570.133.07-1.el9_5.elrepo.*\n"
                     "nvidia-x11-drv-libs-0:570.133.07-1.el9_5.elrepo.*\n")
    monkeypatch.setattr(un, "packages_installed", lambda pm, pkgs, root=LIVE: pm == "dnf")
    rec = record.Record(packages={"driver": ["elrepo-release", "kmod-nvidia-open", "nvidia-x11-drv-libs",
                                             "python3-dnf-plugin-versionlock"]}, holds=["kmod-nvidia-open"])
    opt = un.UninstallOptions(purge_driver=True)
    pkgs = ("elrepo-release", "kmod-nvidia-open", "nvidia-x11-drv-libs", "python3-dnf-plugin-versionlock")
    [step] = un.package_steps(tmp_path, rec, opt)
    assert [c.argv for c in step.commands] == [
        ("dnf", "remove", "--assumeno", "--setopt=clean_requirements_on_remove=0", *pkgs),
        ("dnf", "versionlock", "delete", "kmod-nvidia-open", "nvidia-x11-drv-libs"),
        ("dnf", "remove", "-y", "--setopt=clean_requirements_on_remove=0", *pkgs)]
    with locks.open("a") as f:
        f.write("podman-5:5.2.2-1.el9.*\n")  # the operator's own lock
    [step] = un.package_steps(tmp_path, rec, opt)
    assert "python3-dnf-plugin-versionlock kept" in step.title
    assert step.commands[-1].argv == ("dnf", "remove", "-y", "--setopt=clean_requirements_on_remove=0", *pkgs[:3])


def test_dnf_purge_resets_only_the_module_stream_gpuprov_enabled(tmp_path, monkeypatch):
    """The `nvidia-driver` stream bootstrap enabled (the record's `streams`) is reset after the purge, in the same
    step and printed there; a stream the record does not name (the operator's own) stays; once reset, a second
    uninstall plans nothing for it. The record keeps `streams` through an uninstall that keeps the driver."""
    (tmp_path / "etc/dnf/modules.d").mkdir(parents=True)
    shutil.copy(Path(__file__).parents[1] / "fixtures/el-repos/host/os-release-9", tmp_path / "etc/os-release")
    state = tmp_path / "etc/dnf/modules.d/nvidia-driver.module"
    state.write_text("[nvidia-driver]\nname=nvidia-driver\nstream=570-open\nprofiles=default\nstate=enabled\n")
    monkeypatch.setattr(un, "packages_installed", lambda pm, pkgs, root=LIVE: pm == "dnf")
    rec = record.Record(packages={"driver": ["nvidia-driver", "kmod-nvidia-open-dkms"]}, streams=["nvidia-driver"])
    opt = un.UninstallOptions(purge_driver=True)
    [step] = un.package_steps(tmp_path, rec, opt)
    assert step.commands[-1].argv == ("dnf", "module", "reset", "-y", "nvidia-driver")
    assert "reset the module stream gpuprov enabled: nvidia-driver" in step.title
    assert "dnf module reset -y nvidia-driver" in "\n".join(step.lines())
    [step] = un.package_steps(tmp_path, dataclasses.replace(rec, streams=[]), opt)  # the operator enabled it
    assert all(c.argv[1:2] != ("module",) for c in step.commands)
    monkeypatch.setattr(un, "packages_installed", lambda pm, pkgs, root=LIVE: False)  # purged: only the reset left
    [step] = un.package_steps(tmp_path, rec, opt)
    assert [c.argv for c in step.commands] == [("dnf", "module", "reset", "-y", "nvidia-driver")]
    state.write_text("[nvidia-driver]\nname=nvidia-driver\nstream=\nprofiles=\nstate=\n")  # what reset leaves
    assert un.package_steps(tmp_path, rec, opt) == []
    assert un.kept_packages(rec, un.UninstallOptions()).streams == ["nvidia-driver"]
    assert un.kept_packages(rec, opt).streams == []
    assert record.Record.from_json(rec.to_json(), "r").streams == ["nvidia-driver"]


def test_the_apt_driver_steps_packages_are_recorded_for_purge():
    """The apt driver step's check is DriverBuilt (packages and each kernel's module), not PackagesInstalled: its
    packages must still reach the install record, or `uninstall --purge-driver` purges nothing (seen for real on
    tests/integration/test_ubuntu_apt.py's host: "Purge the driver packages gpuprov installed: none")."""
    from provision.options import Stage
    from provision.plan.driver import DriverBuilt

    absent = ("gpuprov-test-absent-headless", "gpuprov-test-absent-utils")  # no such packages on this machine
    step = st.Step("driver.packages", Stage.DRIVER, "Install the driver",
                   check=DriverBuilt("apt", absent, ("6.8.0-49-generic",), False))
    assert ap.missing_packages([step]) == {"driver.packages": st.PackagesInstalled("apt", absent)}


def test_dnf_records_a_side_by_side_kernel_package_by_its_version(monkeypatch):
    """kernel-devel is installed per kernel, side by side: recorded by name, `uninstall --purge-driver` ran `dnf
    remove kernel-devel`, which took the operator's kernel-devel of a later kernel along, and its dry run named
    nothing extra (both are `kernel-devel`). The record keeps the version gpuprov installed; the dry run's rows of
    that name are ours, a row of another name is not."""
    from provision import package_managers

    dnf = package_managers.get("dnf")
    monkeypatch.setattr(type(dnf), "installonly", lambda self: {"kernel-devel", "kernel-core"})
    before = {"kernel-core-5.14.0-503.14.1.el9_5.x86_64": "kernel-core", "podman-5.2.2-1.el9.x86_64": "podman"}
    after = {**before, "kernel-devel-5.14.0-503.14.1.el9_5.x86_64": "kernel-devel", "dkms-3.1.6-1.el9.noarch": "dkms",
             "kernel-core-5.14.0-503.40.1.el9_5.x86_64": "kernel-core", "gpg-pubkey-d42d0685-62f3f5a4.(none)":
             "gpg-pubkey"}
    assert dnf.added(before, after) == ["kernel-devel-5.14.0-503.14.1.el9_5.x86_64", "dkms",
                                        "kernel-core-5.14.0-503.40.1.el9_5.x86_64"]
    ours = ("kernel-devel-5.14.0-503.14.1.el9_5.x86_64", "dkms")
    dry = ("Removing:\n kernel-devel   x86_64  5.14.0-503.14.1.el9_5  @appstream  1 M\n"
           " dkms           noarch  3.1.6-1.el9             @epel       1 M\n"
           "Removing dependent packages:\n site-kmod      noarch  1.0-1                   @System     1 k\n\n")
    assert dnf.purged_too(dry, ours) == ["site-kmod"]
    assert dnf.purge(ours)[-2:] == ours  # the purge names that version, never the operator's others


def test_no_ctr_call_without_containerds_socket(tmp_path, monkeypatch):
    """Without containerd's socket every ctr command waits out its 10 s dial timeout: uninstall asks ctr nothing
    then (20 s on a docker-only host before); with the socket there, it asks."""
    import socket

    from provision.engines import validate

    calls = tmp_path / "calls"
    fake = tmp_path / "bin/ctr"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    monkeypatch.setenv("CONTAINERD_ADDRESS", str(tmp_path / "containerd.sock"))
    validate.leftover_image_argvs()
    assert not calls.exists()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "containerd.sock"))
    try:
        validate.leftover_image_argvs()
    finally:
        sock.close()
    assert "namespaces ls -q" in calls.read_text()
