"""Round three of "nobody in", uninstall's classes (issue 27: 1-3, 5-10; issue 28: 1-4), each failing on the main
before it: the install record is trusted only when root alone could have written it and only in gpuprov's shape; a
purge is simulated first and stops at anything gpuprov did not install; only gpuprov's own process is signalled,
by os.kill; the host lock file survives uninstall; the operator's lines in gpuprov's drop-ins survive it (Podman,
CRI-O, containerd); gpuprov's backups beside a linked config's target go with it. The live dockerd cases (reload
without restart, a re-run after a kill, containers that outlive uninstall) are in
tests/integration/test_day_two.py."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from provision import paths, record
from provision.engines import containerd as ctd
from provision.engines import crio, podman, validate
from provision.engines.configure import configure
from provision.engines.docker import DockerEngine
from provision.errors import HostBusy
from provision.hostlock import host_lock
from provision.plan import apply as ap
from provision.plan import uninstall as un
from tests.conftest import needs, run_cli
from tests.faults.conftest import CONFIG_INVALID, CONFLICT, HOST_BUSY, root_only

RT = "/usr/local/bin/gpuprov-runtime"
LIVE = Path("/")
EVIL = {"runtimes": {"nvidia": {"path": "/tmp/evil"}}, "default-runtime": "nvidia"}


def env_for(tmp: Path) -> dict[str, str]:
    return {"GPUPROV_STATE_DIR": str(tmp / "state"), "GPUPROV_RUN_DIR": str(tmp / "run"),
            "GPUPROV_CACHE_DIR": str(tmp / "cache"), "GPUPROV_LOG": str(tmp / "log/bootstrap.log"),
            "GPUPROV_RUNTIME_CONFIG": str(tmp / "rt.json"), "GPUPROV_LOCK_DIR": str(tmp / "lock")}


def planted_record(tmp: Path, doc: dict) -> Path:
    cfg = tmp / "daemon.json"
    cfg.write_text(json.dumps(EVIL) + "\n")
    rec = {"schema": record.SCHEMA, "configs": {str(cfg): {
        "engine": "docker", "runtime_name": "nvidia", "runtime_paths": ["/tmp/evil"], "made_dirs": [],
        "files": {str(cfg): {"old": json.dumps(EVIL), "written": json.dumps({"x": 1})}}}}, **doc}
    (tmp / "state").mkdir(exist_ok=True)
    p = tmp / "state/installed.json"
    p.write_text(json.dumps(rec))
    return p


# ---------------------------------------------------------------- 27.1: one trusted reader


@root_only
@pytest.mark.parametrize("how", ["file owned by a user", "file group-writable", "directory writable by others"])
def test_record_another_user_could_write_is_refused(tmp_path, how):
    p = planted_record(tmp_path, {})
    if how == "file owned by a user":
        os.chown(p, 65534, 65534)
    elif how == "file group-writable":
        os.chmod(p, 0o664)
    else:
        os.chmod(p.parent, 0o777)
    r = run_cli("uninstall", "--dry-run", "--json", env=env_for(tmp_path))
    assert r.returncode == CONFIG_INVALID, r.stdout[-500:] + r.stderr
    assert "installed.json" in r.stderr and "/tmp/evil" not in r.stdout


# ---------------------------------------------------------------- 27.2: the record's shape


@pytest.mark.parametrize("doc, field", [
    ({"configs": "x"}, "configs"),
    ({"packages": {"engine": "docker.io"}}, "packages.engine"),
    ({"packages": {"engine": [7]}}, "packages.engine[0]"),
    ({"holds": ["-y", "--allow-remove-essential"]}, "holds[0]"),
    ({"packages": {"kernel": ["x"]}}, "packages.kernel"),
])
def test_record_of_the_wrong_shape_is_exit_6_naming_the_field(tmp_path, doc, field):
    planted_record(tmp_path, doc)
    r = run_cli("uninstall", "--dry-run", "--json", env=env_for(tmp_path))
    assert r.returncode == CONFIG_INVALID, r.stdout[-500:] + r.stderr
    assert "installed.json" in r.stderr and f"'{field}'" in r.stderr and "Traceback" not in r.stderr


def test_record_entry_of_the_wrong_shape_names_the_field(tmp_path):
    p = planted_record(tmp_path, {})
    rec = json.loads(p.read_text())
    next(iter(rec["configs"].values()))["files"] = ["x"]
    p.write_text(json.dumps(rec))
    r = run_cli("uninstall", "--dry-run", "--json", env=env_for(tmp_path))
    assert r.returncode == CONFIG_INVALID and ".files' must be an object" in r.stderr, r.stderr


# ---------------------------------------------------------------- 27.3: purges simulate first


@pytest.fixture
def apt_host(tmp_path, monkeypatch):
    """Real apt over a dpkg status of this test's own: gp-engine (gpuprov's) and gp-tool, the operator's, which
    depends on it. Only simulations run against it."""
    d = tmp_path / "apt"
    (d / "lists/partial").mkdir(parents=True)
    (d / "parts").mkdir()
    stanza = ("Package: {n}\nStatus: install ok installed\nPriority: optional\nSection: admin\nInstalled-Size: 1\n"
              "Maintainer: t <t@t.invalid>\nArchitecture: all\nVersion: 1.0\n{dep}Description: {n}\n")
    (d / "status").write_text(stanza.format(n="gp-engine", dep="") + "\n"
                              + stanza.format(n="gp-tool", dep="Depends: gp-engine\n"))
    (d / "sources.list").write_text("")
    (d / "apt.conf").write_text("".join(f'{k} "{v}";\n' for k, v in (
        ("Dir::State::status", d / "status"), ("Dir::State::Lists", d / "lists"), ("Dir::Cache::pkgcache", ""),
        ("Dir::Cache::srcpkgcache", ""), ("Dir::Etc::SourceList", d / "sources.list"),
        ("Dir::Etc::SourceParts", d / "parts"))))
    monkeypatch.setenv("APT_CONFIG", str(d / "apt.conf"))
    return d


@needs("apt-get")
def test_purge_that_would_remove_the_operators_package_stops(apt_host):
    purge = un.Purge("apt", ("gp-engine",), (), allow_remove=False)
    ran = []
    real = purge.purge

    with pytest.raises(Exception) as exc:
        object.__setattr__(purge, "purge", lambda: ran.append(1) or real())
        purge.execute()
    assert getattr(exc.value, "exit_code", None) == CONFLICT and "gp-tool" in str(exc.value), exc.value
    assert not ran  # the purge itself never ran
    assert [c.argv[:3] for c in purge.commands()] == [("apt-get", "-s", "purge"), ("apt-get", "purge", "-y")]


def test_purge_step_prints_the_simulation_and_the_option(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "INSTALL_RECORD", str(tmp_path / "installed.json"))
    monkeypatch.setattr(un, "packages_installed", lambda pm, pkgs, root=LIVE: True)
    monkeypatch.setattr(DockerEngine, "stored", lambda self, root: None)  # no data root: this machine's is not ours
    record.note_packages("engine", ["docker.io"])
    (step,) = un.package_steps(LIVE, record.read(), un.UninstallOptions(purge_engine=True))
    lines = "\n".join(step.lines())
    assert "$ DEBIAN_FRONTEND=noninteractive NEEDRESTART_MODE=a apt-get -s purge docker.io" in lines
    assert "--allow-remove" in lines


# ---------------------------------------------------------------- 28.4: the packages record survives


def test_uninstall_that_keeps_the_packages_keeps_their_record(tmp_path, monkeypatch):
    for name, value in (("STATE_DIR", tmp_path / "state"), ("RUN_DIR", tmp_path / "run"),
                        ("INSTALL_RECORD", tmp_path / "state/installed.json")):
        monkeypatch.setattr(paths, name, str(value))
    monkeypatch.setattr(un, "lock_dirs", lambda: (str(tmp_path / "lock"),))
    monkeypatch.setattr(un, "LOG_FILE", tmp_path / "log/x.log")
    monkeypatch.setenv("GPUPROV_CACHE_DIR", str(tmp_path / "cache"))
    record.note_packages("engine", ["docker.io"])
    (tmp_path / "state/state.json").write_text("{}")
    steps = un.state_steps(LIVE, record.read(), un.UninstallOptions())
    ap.apply_plan(steps, quiet=True, logged=False)
    assert record.read().packages == {"engine": ["docker.io"]} and not (tmp_path / "state/state.json").exists()
    assert un.state_steps(LIVE, record.read(), un.UninstallOptions()) == []  # and a second run leaves it be
    (step,) = un.state_steps(LIVE, record.read(), un.UninstallOptions(purge_engine=True))
    ap.apply_plan([step], quiet=True, logged=False)
    assert not (tmp_path / "state").exists()


def test_purge_options_are_named_for_what_they_do():
    r = run_cli("uninstall", "--help", env={"COLUMNS": "200"})
    assert "--purge-driver" in r.stdout and "--purge-engine" in r.stdout and "--restart-engine" in r.stdout
    assert "--driver " not in r.stdout and "--engine " not in r.stdout  # the old names still parse, unlisted


# ---------------------------------------------------------------- 27.7 / 28.2: signals only to gpuprov's process


@pytest.fixture
def editor_lock(tmp_path, monkeypatch):
    """The warm editor's lock file (GPUPROV_RUNTIME_CONFIG moves it into tmp), held by this test as the editor would
    hold it; the runtime's files under a tmp prefix."""
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(tmp_path / "etc/runtime.json"))
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/runtime.json").write_text("{}\n")
    monkeypatch.setattr(paths, "INSTALL_STAMP", str(tmp_path / "stamp"))
    (tmp_path / "stamp").write_text(json.dumps({"prefix": str(tmp_path / "usr")}))
    lock = tmp_path / "etc/runtime.json.sock.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield lock
    os.close(fd)


def _apply_runtime_steps():
    steps = un.runtime_steps(LIVE)
    ap.apply_plan(steps, quiet=True, logged=False)
    return steps


@pytest.mark.parametrize("content", ["{pid}\n", "{pid} 1 sleep\n", "{pid} {start} python3\n"])
def test_a_process_that_got_the_editors_pid_is_never_signalled(editor_lock, content):
    """The editor exited; an operator's process got its pid. Whatever the lock file says (an old pid only, a wrong
    start time, a wrong name), it keeps running, and no step runs `kill` (a minimal host has none)."""
    op = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.1)
        start = open(f"/proc/{op.pid}/stat").read().rsplit(")", 1)[1].split()[19]
        editor_lock.write_text(content.format(pid=op.pid, start=start))
        steps = _apply_runtime_steps()
        assert op.poll() is None, "the operator's process was signalled"
        assert not any(c.argv[0] == "kill" for s in steps for c in s.commands)
    finally:
        op.kill()
        op.wait()


def test_the_editor_itself_is_stopped_by_os_kill(editor_lock):
    op = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.1)
        start = open(f"/proc/{op.pid}/stat").read().rsplit(")", 1)[1].split()[19]
        editor_lock.write_text(f"{op.pid} {start} sleep\n")  # what server._write_pid records for this process
        steps = _apply_runtime_steps()
        assert op.wait(timeout=10) == -15
        assert "SIGTERM" in "\n".join(steps[0].lines()) and not any(c.argv[0] == "kill" for c in steps[0].commands)
    finally:
        op.kill()


# ---------------------------------------------------------------- 27.8: the host lock file stays


def test_uninstall_never_removes_the_host_lock(tmp_path, monkeypatch):
    for name, value in (("STATE_DIR", tmp_path / "state"), ("RUN_DIR", tmp_path / "run"),
                        ("INSTALL_RECORD", tmp_path / "state/installed.json")):
        monkeypatch.setattr(paths, name, str(value))
    monkeypatch.setenv("GPUPROV_LOCK_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(un, "LOG_FILE", tmp_path / "log/x.log")
    monkeypatch.setattr(validate, "leftover_image_argvs", lambda: [])
    (tmp_path / "run/mps").mkdir(parents=True)
    with host_lock("uninstall"):
        ino = os.stat(tmp_path / "run/host.lock").st_ino
        steps = un.uninstall_steps(LIVE, un.UninstallOptions())
        ap.apply_plan(steps, quiet=True, logged=False)
    for s in steps:  # and whatever runs after the lock is released (main had a step for that)
        ap.apply_plan([s], quiet=True, logged=False)
    assert os.stat(tmp_path / "run/host.lock").st_ino == ino and not (tmp_path / "run/mps").exists()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR);"
                               " fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(30)",
                               str(tmp_path / "run/host.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(HostBusy) as exc, host_lock("third", wait=False):
            pass
        assert exc.value.exit_code == HOST_BUSY
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------- 27.9: drop-ins keep the operator's edits


@pytest.fixture
def rec(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "INSTALL_RECORD", str(tmp_path / "state/installed.json"))


def _recorded(config: Path, dropin: Path, engine: str, text: str) -> dict:
    """What `engine configure` records for a drop-in it created (engines/configure.py: note_config)."""
    dropin.parent.mkdir(parents=True, exist_ok=True)
    dropin.write_text(text)
    record.note_config(str(config), engine, "nvidia", RT, [(str(dropin), None, text)], [])
    return record.read().configs[str(config)]


DROPINS = {
    "podman": (podman.PodmanEngine, lambda: podman.render(runtime_path=RT, default=True),
               '\n[containers]\nlog_size_max = 1048576\n', {"containers": {"log_size_max": 1048576}}),
    "crio": (crio.CrioEngine, lambda: crio.render(runtime_path=RT, default=True, cdi=True),
             '\n[crio.runtime.runtimes.kata]\nruntime_path = "/opt/kata/bin/kata-runtime"\n',
             {"crio": {"runtime": {"runtimes": {"kata": {"runtime_path": "/opt/kata/bin/kata-runtime"}}}}}),
}


@pytest.mark.parametrize("engine", sorted(DROPINS))
def test_dropin_keeps_the_operators_lines(tmp_path, rec, engine):
    import tomlkit

    cls, render, edit, left = DROPINS[engine]
    dropin = tmp_path / "conf.d/99-gpuprov.conf"
    entry = _recorded(dropin, dropin, cls.name, render())
    eng = cls()
    plan = eng.unplan(dropin, entry)
    assert plan.removals == [dropin]  # untouched since: removed
    dropin.write_text(dropin.read_text() + edit)  # the operator's edit
    plan = eng.unplan(dropin, record.read().configs[str(dropin)])
    assert not plan.removals and len(plan.edits) == 1, plan
    assert tomlkit.parse(plan.edits[0].new).unwrap() == left
    assert "gpuprov" not in plan.edits[0].new and RT not in plan.edits[0].new


@needs("containerd")
def test_containerd_dropin_keeps_the_operators_lines_and_its_import(tmp_path, rec):
    import tomlkit

    main = tmp_path / "config.toml"
    main.write_text('version = 2\n\n[grpc]\n  max_recv_message_size = 16777216\n')
    configure("containerd", config=str(main), runtime_path=RT, default=True, restart=False)
    dropin = ctd.dropin_path(main)
    dropin.write_text(dropin.read_text() + '\n[debug]\n  level = "info"\n')
    plan = ctd.ContainerdEngine().unplan(main, record.read().configs[str(main)])
    assert dropin not in plan.removals and main not in plan.removals, plan
    (edit,) = [e for e in plan.edits if e.path == dropin]
    doc = tomlkit.parse(edit.new).unwrap()
    assert doc.get("debug") == {"level": "info"} and RT not in edit.new
    assert not [e for e in plan.edits if e.path == main]  # still imported: the operator's keys still apply


# ---------------------------------------------------------------- 27.10: backups beside a linked config


@root_only
def test_backups_beside_a_linked_configs_target_go(tmp_path, rec):
    ops = tmp_path / "ops"
    ops.mkdir()
    target = ops / "daemon.json"
    target.write_text('{"debug": true}\n')
    link = tmp_path / "etc-docker/daemon.json"
    link.parent.mkdir()
    link.symlink_to(target)
    configure("docker", config=str(link), runtime_path=RT, default=True, restart=False)
    assert list(ops.glob("daemon.json.gpuprov-*.bak"))
    steps = un.engine_steps(LIVE, record.read())
    ap.apply_plan(steps, quiet=True, logged=False)
    assert sorted(p.name for p in ops.iterdir()) == ["daemon.json"] and link.is_symlink()
    assert target.read_text() == '{"debug": true}\n'


# ---------------------------------------------------------------- 28.1: a restart that stops containers is asked for


def test_restart_that_stops_containers_needs_restart_engine(tmp_path, rec, monkeypatch):
    """A dockerd that reads this config and runs containers without live-restore (its count stands in for `docker
    info`, which the integration test asks for real: test_day_two.py::test_uninstall_keeps_containers_…): --cdi,
    which dockerd reads only at start, is exit 14 naming --restart-engine, with the file untouched; with the
    option the restart is consented to."""
    from provision.engines.base import Daemon
    from provision.engines.docker import DockerEngine

    cfg = tmp_path / "daemon.json"
    cfg.write_text('{"debug": true}\n')
    daemon = Daemon(os.getpid(), ("dockerd", "--config-file", str(cfg)), str(cfg))
    monkeypatch.setattr(DockerEngine, "live_daemon", lambda self, path: daemon)
    monkeypatch.setattr(DockerEngine, "restart_stops", lambda self, d: 3)
    # where live-restore can be held on, the restart keeps them instead (tests/unit/test_engine_options.py)
    monkeypatch.setattr(DockerEngine, "hold_blocker", lambda self, d: "dockerd is in swarm mode (active)")
    restarted = []
    monkeypatch.setattr(DockerEngine, "apply", lambda self, d, plan, restart: restarted.append(restart) or "x")
    monkeypatch.setattr(DockerEngine, "verify", lambda self, d, req, wait=True: None)
    with pytest.raises(Exception) as exc:
        configure("docker", config=str(cfg), runtime_path=RT, cdi=True)
    assert getattr(exc.value, "exit_code", None) == CONFLICT and "--restart-engine" in str(exc.value)
    assert "3 running container(s)" in str(exc.value) and cfg.read_text() == '{"debug": true}\n' and not restarted
    configure("docker", config=str(cfg), runtime_path=RT, cdi=True, restart_engine=True)
    assert json.loads(cfg.read_text())["features"] == {"cdi": True} and restarted


# ---------------------------------------------------------------- 28.3: resumable


def test_a_failed_step_does_not_stop_the_others_and_the_next_run_finishes(tmp_path, monkeypatch, capsys):
    """The check image cannot go (in use by a stopped container: a real command that fails stands for it): every
    other step still runs, the summary names what is left and why, gpuprov's record stays for the next run, and
    that run (the image free now) finishes."""
    from provision.commands.uninstall import uninstall_cmd
    from provision.errors import StepFailed
    from tests.unit.test_uninstall import host as host_fixture

    tmp, cfg, original = host_fixture.__wrapped__(tmp_path, monkeypatch)
    monkeypatch.setenv("GPUPROV_LOCK_DIR", str(tmp / "lock"))
    monkeypatch.setattr(un, "is_live", lambda root: True)
    busy = [(("sh", "-c", "echo 'image is being used by stopped container 1f2e'; exit 1"), False)]
    monkeypatch.setattr(validate, "leftover_image_argvs", lambda: busy)
    kw = dict(yes=True, dry_run=False, json_out=True, purge_driver=False, purge_engine=False, old_driver=False,
              old_engine=False, allow_remove=False, restart_engine=False, root=LIVE, keep_engine_data=False,
              delete_engine_data=False)
    with pytest.raises(StepFailed) as exc:
        uninstall_cmd(**kw)
    assert "uninstall.images" in str(exc.value) and "stopped container" in str(exc.value)
    doc = json.loads(capsys.readouterr().out)
    assert [s["id"] for s in doc["steps"] if s["status"] == "failed"] == ["uninstall.images"]
    assert doc["left"] and "stopped container" in doc["left"][0]
    assert cfg.read_text() == original and not (tmp / "usr/local/bin/gpuprov-runtime").exists()  # the rest is done
    assert (tmp / "state/installed.json").exists()  # kept for the run that finishes
    monkeypatch.setattr(validate, "leftover_image_argvs", lambda: [])
    uninstall_cmd(**kw)
    assert not (tmp / "state").exists() and (tmp / "lock/host.lock").exists()
    assert json.loads(capsys.readouterr().out)["left"] == []
