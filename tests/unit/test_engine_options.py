"""geerlingguy.docker's variables through gpuprov (issue 28 item 14): `--engine-option KEY=JSON` (the role's
gpuprov_engine_options) merged into daemon.json by gpuprov's own merge, never written whole; `--engine-user` (the
role's gpuprov_engine_users) added to the docker group by a planned step. The real fleet run is
tests/integration/test_fleet_ansible.py::test_4d_engine_options_and_users_go_through_gpuprov."""
from __future__ import annotations

import json

import pytest

from provision.engines import docker
from provision.engines.docker import DockerEngine
from provision.errors import UsageError
from provision.plan.options import Options
from provision.values import BadValue, engine_option, engine_option_text
from tests.conftest import REPO, run_cli

RT = "/usr/local/bin/gpuprov-runtime"
MINE = {"data-root": "/srv/docker", "log-driver": "json-file", "dns": ["192.0.2.53"]}
FIXTURE = str(REPO / "tests/fixtures/hosts/h200-vm")


def test_options_are_merged_beside_gpuprovs_keys_and_the_operators():
    opts = (("log-driver", '"local"'), ("max-concurrent-downloads", "4"), ("dns", '["192.0.2.53"]'))
    m = docker.merge(json.dumps(MINE), runtime_path=RT, default=True, options=opts)
    doc = json.loads(m.text)
    assert list(doc) == ["data-root", "log-driver", "dns", "runtimes", "default-runtime", "max-concurrent-downloads"]
    assert doc["log-driver"] == "local" and doc["max-concurrent-downloads"] == 4 and doc["data-root"] == "/srv/docker"
    # only what differs is a change; dockerd reloads max-concurrent-downloads on SIGHUP, log-driver only at start
    by_key = {c.key: c for c in m.changes}
    assert set(by_key) == {"runtimes.nvidia", "default-runtime", "log-driver", "max-concurrent-downloads"}
    assert by_key["max-concurrent-downloads"].reload and not by_key["log-driver"].reload
    again = docker.merge(m.text, runtime_path=RT, default=True, options=opts)
    assert not again.changed and again.text == m.text


def test_uninstall_keeps_the_operators_options():
    """They are the operator's settings (asked for through the role): gpuprov's undo takes out its own keys only."""
    old = json.dumps(MINE, indent=2) + "\n"
    written = docker.merge(old, runtime_path=RT, default=True, options=(("log-driver", '"local"'),)).text
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "daemon.json"
        cfg.write_text(written)
        plan = DockerEngine().unplan(cfg, {"files": {str(cfg): {"old": old, "written": written}}})
    assert json.loads(plan.edits[0].new) == {**MINE, "log-driver": "local"}


@pytest.mark.parametrize("bad", ['runtimes={"x":{"path":"/bin/true"}}', 'default-runtime="runc"', 'features={}',
                                 "log-driver=local", "Log-Driver=\"x\"", "=1", "log-driver"])
def test_a_key_gpuprov_sets_or_a_malformed_option_is_refused(bad):
    with pytest.raises(BadValue):
        engine_option(bad)
    r = run_cli("plan", "--root", FIXTURE, "--engine-option", bad)
    assert r.returncode == 2 and "--engine-option" in r.stderr and "KEY=JSON" in r.stderr, r.stderr


def test_the_module_passes_each_entry_as_json():
    assert engine_option_text("log-opts", {"max-size": "10m", "max-file": "3"}) == \
        'log-opts={"max-file":"3","max-size":"10m"}'
    assert engine_option(engine_option_text("live-restore", True)) == "live-restore=true"


def test_options_and_users_are_dockers():
    for kw in ({"engine_option": ['log-driver="local"']}, {"engine_user": ["alice"]}):
        with pytest.raises(UsageError, match="is for --engine docker"):
            Options.parse(engine="containerd", **kw)


def test_the_plan_shows_the_merge_and_the_users_step(tmp_path):
    r = run_cli("plan", "--root", FIXTURE, "--json", "--engine-option", 'log-driver="local"', "--engine-option",
                "max-concurrent-downloads=4")
    assert r.returncode == 0, r.stderr
    (step,) = [s for s in json.loads(r.stdout)["steps"] if s["id"] == "engine.config"]
    diff = "".join(step["diffs"].values())
    assert '+  "log-driver": "local"' in diff and '+  "max-concurrent-downloads": 4' in diff, diff
    assert "and set log-driver, max-concurrent-downloads" in step["title"], step["title"]
    assert any("restart dockerd" in ln for ln in step["actions"]), step["actions"]  # log-driver: read at start only
    r = run_cli("plan", "--root", FIXTURE, "--engine-user", "nosuchuser")
    assert r.returncode == 2 and "--engine-user nosuchuser: no such user on this host" in r.stderr, r.stderr


# ---------------------------------------------------------------- restarts that stop containers (issue 28 item 1)


@pytest.fixture
def live_dockerd(tmp_path, monkeypatch):
    """A dockerd that reads tmp_path/daemon.json and runs 3 containers without live-restore (the count stands in for
    `docker info`; the fleet test restarts a real one): what configure and the plan's notes ask of it."""
    import os
    import shutil

    from provision.engines.base import Daemon

    cfg = tmp_path / "daemon.json"
    cfg.write_text('{"debug": true}\n')
    daemon = Daemon(os.getpid(), ("dockerd", "--config-file", str(cfg)), str(cfg))
    monkeypatch.setattr(DockerEngine, "live_daemon", lambda self, path: daemon)
    monkeypatch.setattr(DockerEngine, "restart_stops", lambda self, d: 3)
    # swarm mode: live-restore cannot be held on for the restart (test_a_restart_keeps_… lifts it)
    monkeypatch.setattr(DockerEngine, "hold_blocker",
                        lambda self, d: "dockerd is in swarm mode (active), where live-restore is refused")
    monkeypatch.setattr(DockerEngine, "running", lambda self: {"a" * 64: ("web", "t1"), "b" * 64: ("db", "t2"),
                                                               "c" * 64: ("cache", "t3")})
    monkeypatch.setattr(shutil, "which", lambda name, path=None: None)  # no --gpus hook yet
    done = []
    monkeypatch.setattr(DockerEngine, "apply", lambda self, d, plan, restart: done.append(plan.needs_restart) or "x")
    monkeypatch.setattr(DockerEngine, "verify", lambda self, d, req, wait=True: None)
    monkeypatch.setattr(DockerEngine, "check", lambda self, path, req: None)
    return cfg, done


def _action(cfg, options=(), restart_engine=False):
    from provision.plan.steps import ConfigureEngine

    return ConfigureEngine("docker", "nvidia", RT, True, False, config=str(cfg), options=options,
                           restart_engine=restart_engine)


def _notes(cfg, options=()):
    from types import SimpleNamespace

    from provision.plan.build import restart_notes

    return restart_notes(SimpleNamespace(root="/"), DockerEngine(), _action(cfg, options))


def test_the_plan_names_the_containers_a_restart_stops(live_dockerd, monkeypatch):
    """bootstrap's plan says when engine.config will restart dockerd, why, and how many containers that stops: for
    the --gpus hook this run installs (dockerd finds it only at start), for a key it reads only at start; a key it
    reloads (SIGHUP) or a host with no running container gets no such note."""
    cfg, _ = live_dockerd
    (hook,) = _notes(cfg)
    assert "looks for the --gpus hook this run installs only when it starts" in hook and "3 running container(s)" in hook, hook
    assert "without --restart-engine the step stops before writing anything, exit 14" in hook
    monkeypatch.setattr(DockerEngine, "pending_restart", lambda self, d, installing=False: None)  # hook there, older
    (key,) = _notes(cfg, options=(("log-driver", '"local"'),))
    assert "dockerd reads log-driver only when it starts" in key and "3 running container(s)" in key, key
    assert _notes(cfg, options=(("max-concurrent-downloads", "4"),)) == ()
    assert _notes(cfg) == ()
    monkeypatch.setattr(DockerEngine, "restart_stops", lambda self, d: 0)
    assert _notes(cfg, options=(("log-driver", '"local"'),)) == ()


def test_check_mode_stops_where_the_real_run_would_refuse_the_restart(live_dockerd):
    """Item 5 for restarts: `bootstrap --check` (and the role's check mode) reports the exit 14 the real run stops
    with, naming --restart-engine; with it, the step is only a change."""
    from pathlib import Path

    from provision.plan import apply as ap
    from provision.plan.steps import EngineConfigured, Step

    cfg, _ = live_dockerd
    for consent in (False, True):
        action = _action(cfg, restart_engine=consent)
        doc = ap.check_plan([Step("engine.config", "runtime", "Register", actions=(action,),
                                  check=EngineConfigured(action))], Path("/"))
        if consent:
            assert doc["stop"] is None and doc["would_change"] == 1, doc
        else:
            assert doc["stop"]["exit_code"] == 14 and "--restart-engine" in doc["stop"]["error"], doc
            assert "3 running container(s)" in doc["stop"]["error"] and "--gpus hook" in doc["stop"]["error"]
    assert cfg.read_text() == '{"debug": true}\n'


def test_a_start_only_option_is_exit_14_without_restart_engine(live_dockerd):
    from provision.engines.configure import configure
    from provision.errors import CONFLICT

    cfg, done = live_dockerd
    with pytest.raises(Exception) as exc:
        configure("docker", config=str(cfg), runtime_path=RT, options=(("log-driver", '"local"'),))
    assert getattr(exc.value, "exit_code", None) == CONFLICT and "--restart-engine" in str(exc.value)
    assert "log-driver" in str(exc.value) and cfg.read_text() == '{"debug": true}\n' and not done
    configure("docker", config=str(cfg), runtime_path=RT, options=(("max-concurrent-downloads", "4"),))
    assert done == [False]  # reloadable: SIGHUP, no restart, no consent needed
    configure("docker", config=str(cfg), runtime_path=RT, options=(("log-driver", '"local"'),), restart_engine=True)
    assert done == [False, True] and json.loads(cfg.read_text())["log-driver"] == "local"


# ---------------------------------------------------------------- restarts that keep containers (issue 39 item 2)


def test_a_restart_keeps_the_containers_by_holding_live_restore_on(live_dockerd, monkeypatch):
    """Where live-restore can be turned on by a reload, the restart the --gpus hook needs keeps the running
    containers: the plan says so in the words of what runs (restart with live-restore on, back off by a reload), its
    note names no exit 14, check mode does not stop, and the run calls restart_keeping, not a plain restart."""
    from pathlib import Path
    from types import SimpleNamespace

    from provision.engines.configure import configure
    from provision.plan import apply as ap
    from provision.plan.build import restart_plan
    from provision.plan.steps import EngineConfigured, Step

    cfg, done = live_dockerd
    monkeypatch.setattr(DockerEngine, "hold_blocker", lambda self, d: None)
    how, (note,) = restart_plan(SimpleNamespace(root="/"), DockerEngine(), _action(cfg))
    assert how == ("restart dockerd with live-restore on for the restart (your 3 running container(s) keep "
                   "running), then live-restore back off by a reload"), how
    assert "--gpus hook" in note and "turned on by a reload" in note and "exit 14" not in note, note
    action = _action(cfg).__class__(**{**_action(cfg).__dict__, "how": how})
    assert action.lines()[1].startswith(f"then {how}: the running dockerd")
    assert action.brief() == "then restart dockerd with live-restore on for the restart where it runs"
    doc = ap.check_plan([Step("engine.config", "runtime", "Register", actions=(action,),
                              check=EngineConfigured(action))], Path("/"))
    assert doc["stop"] is None and doc["would_change"] == 1, doc
    monkeypatch.setattr(DockerEngine, "pending_restart",  # the run: runtime.install has put the hook in by now
                        lambda self, d, installing=False: "dockerd started before its --gpus hook was installed")
    kept = []
    monkeypatch.setattr(DockerEngine, "restart_keeping", lambda self, d, path: kept.append(path) or "kept")
    res = configure("docker", config=str(cfg), runtime_path=RT)
    assert kept == [cfg] and not done and res.restart == "kept"


def test_the_plan_says_restart_where_this_run_installs_the_hook(monkeypatch, tmp_path):
    """A fresh host (no dockerd yet: this run installs it, and it starts before runtime.install puts the --gpus hook
    in): the plan says restart, as the run does, not SIGHUP; with the hook already there, a reload."""
    import shutil
    from types import SimpleNamespace

    from provision.plan.build import restart_plan

    cfg = tmp_path / "daemon.json"
    monkeypatch.setattr(DockerEngine, "live_daemon", lambda self, path: None)
    monkeypatch.setattr(shutil, "which", lambda name, path=None: None)
    how, notes = restart_plan(SimpleNamespace(root="/"), DockerEngine(), _action(cfg))
    assert how == "restart dockerd (dockerd looks for the --gpus hook this run installs only when it starts)"
    assert notes == ()
    action = _action(cfg).__class__(**{**_action(cfg).__dict__, "how": how})
    assert action.brief() == "then restart dockerd where it runs" and "SIGHUP" not in " ".join(action.lines())
    monkeypatch.setattr(shutil, "which", lambda name, path=None: "/usr/local/bin/nvidia-container-runtime-hook")
    assert restart_plan(SimpleNamespace(root="/"), DockerEngine(), _action(cfg)) == ("", ())
    assert _action(cfg).brief() == "then SIGHUP to dockerd where it runs"


def test_a_swarm_host_is_exit_14_naming_its_containers(live_dockerd, monkeypatch):
    """live-restore cannot be held on (swarm mode): the run stops before writing anything, exit 14 naming the
    containers and why; --restart-engine goes on with a plain restart."""
    from provision.engines.configure import configure

    cfg, done = live_dockerd
    monkeypatch.setattr(DockerEngine, "pending_restart",  # the run: runtime.install has put the hook in by now
                        lambda self, d, installing=False: "dockerd started before its --gpus hook was installed")
    with pytest.raises(Exception) as exc:
        configure("docker", config=str(cfg), runtime_path=RT)
    msg = str(exc.value)
    assert getattr(exc.value, "exit_code", None) == 14 and "3 running container(s) (cache, db, web)" in msg, msg
    assert "swarm mode" in msg and "--restart-engine" in msg and cfg.read_text() == '{"debug": true}\n'
    configure("docker", config=str(cfg), runtime_path=RT, restart_engine=True)
    assert done == [False]  # DockerEngine.apply with restart=True (the hook), no hold


def _held_host(tmp_path, monkeypatch, text):
    """A dockerd (this process's pid, signals recorded) whose `docker info` live-restore follows the file at each
    SIGHUP, with running containers that a restart keeps; restart_keeping's outside world."""
    import os

    from provision.engines.base import Daemon

    cfg = tmp_path / "daemon.json"
    cfg.write_text(text)
    os.chmod(cfg, 0o640)
    state = {"live": False, "signals": 0, "at_restart": None}

    def hup(pid, sig):  # as dockerd's reload: live-restore changes only where the file sets it
        state["signals"] += 1
        state["live"] = json.loads(cfg.read_text()).get("live-restore", state["live"]) is True

    monkeypatch.setattr(docker.os, "kill", hup)
    monkeypatch.setattr(docker, "HOLD_STATE", str(tmp_path / "hold.json"))
    monkeypatch.setattr(DockerEngine, "live_restore", lambda self: state["live"])
    monkeypatch.setattr(DockerEngine, "running", lambda self: {"a" * 64: ("web", "t1")})
    monkeypatch.setattr(DockerEngine, "live_daemon", lambda self, path: Daemon(os.getpid(), ("dockerd",), str(cfg)))

    def restart(self, d):
        state["at_restart"] = (state["live"], cfg.read_text(), json.loads((tmp_path / "hold.json").read_text()))
        return "systemctl restart docker.service"

    monkeypatch.setattr(DockerEngine, "restart", restart)
    return cfg, state, Daemon(os.getpid(), ("dockerd",), str(cfg))


def test_restart_keeping_holds_live_restore_and_gives_the_operators_file_back(tmp_path, monkeypatch):
    """restart_keeping: live-restore true in the file and live (a reload) before the restart, the held state recorded
    for a killed run; after it, the file's exact bytes and mode as they were, a reload, the state gone."""
    import os

    text = '{\n    "log-driver":  "json-file",\n  "runtimes": {"nvidia": {"path": "/x"}}\n}\n'  # odd spacing
    cfg, state, daemon = _held_host(tmp_path, monkeypatch, text)
    out = DockerEngine().restart_keeping(daemon, cfg)
    live, during, hold = state["at_restart"]
    assert live is True and json.loads(during)["live-restore"] is True and list(json.loads(during))[0] == "log-driver"
    assert hold == {"config": str(cfg), "final": text, "temp": during}
    assert cfg.read_text() == text and oct(os.stat(cfg).st_mode & 0o777) == "0o640"
    assert state["signals"] == 2 and state["live"] is False and not (tmp_path / "hold.json").exists()
    assert out == ("systemctl restart docker.service with live-restore on for the restart (1 running container(s) "
                   "kept: web), then live-restore back off by a reload")


def test_a_container_lost_in_the_restart_fails_the_step(tmp_path, monkeypatch):
    from provision.errors import StepFailed

    cfg, state, daemon = _held_host(tmp_path, monkeypatch, '{"live-restore": false}\n')
    seen = iter([{"a" * 64: ("web", "t1")}, {}])
    monkeypatch.setattr(DockerEngine, "running", lambda self: next(seen))
    with pytest.raises(StepFailed, match="web"):
        DockerEngine().restart_keeping(daemon, cfg)
    assert cfg.read_text() == '{"live-restore": false}\n' and not (tmp_path / "hold.json").exists()


def test_a_reload_that_does_not_take_is_exit_14_and_the_file_goes_back(tmp_path, monkeypatch):
    cfg, state, daemon = _held_host(tmp_path, monkeypatch, '{"debug": true}\n')
    monkeypatch.setattr(DockerEngine, "live_restore", lambda self: False)
    with pytest.raises(Exception) as exc:
        DockerEngine().restart_keeping(daemon, cfg)
    assert getattr(exc.value, "exit_code", None) == 14 and "web" in str(exc.value) and state["at_restart"] is None
    assert cfg.read_text() == '{"debug": true}\n' and not (tmp_path / "hold.json").exists()


def test_a_run_killed_while_holding_is_finished_by_the_next(tmp_path, monkeypatch):
    """Killed after the held file was written: the next run writes the file as that run meant to leave it and
    reloads; a file the operator saved since is left as theirs. The step is not 'already done' meanwhile."""
    from provision.fsutil import write_file

    cfg, state, daemon = _held_host(tmp_path, monkeypatch, '{"debug": true}\n')
    held = '{\n  "debug": true,\n  "live-restore": true\n}\n'
    write_file(docker.HOLD_STATE, json.dumps({"config": str(cfg), "final": '{"debug": true}\n', "temp": held}),
               mode=0o600, keep_mode=False, backup=False)
    cfg.write_text(held)
    eng = DockerEngine()
    assert eng.held(cfg)
    state["live"] = True
    assert "live-restore put back" in eng.finish_hold(daemon, cfg)
    assert cfg.read_text() == '{"debug": true}\n' and state["signals"] == 1 and eng.held(cfg) is None
    assert state["live"] is False  # the reload's file said false once (the operator's has no such key)
    write_file(docker.HOLD_STATE, json.dumps({"config": str(cfg), "final": "{}\n", "temp": held}),
               mode=0o600, keep_mode=False, backup=False)
    assert eng.finish_hold(daemon, cfg) is None and cfg.read_text() == '{"debug": true}\n'
    assert not (tmp_path / "hold.json").exists()


def test_the_run_stops_before_its_first_step_where_the_restart_would_stop_containers(live_dockerd, tmp_path):
    """The issue's half-done run: runtime.install ran, then engine.config was exit 14. Now the refusal (live-restore
    cannot be held: swarm mode) comes before the first step changes anything."""
    from provision.plan import apply as ap
    from provision.plan.steps import Command, EngineConfigured, Step

    cfg, done = live_dockerd
    marker = tmp_path / "runtime-installed"
    action = _action(cfg)
    steps = [Step("runtime.install", "runtime", "Install", actions=(Command(("touch", str(marker))),)),
             Step("engine.config", "runtime", "Register", actions=(action,), check=EngineConfigured(action))]
    with pytest.raises(Exception) as exc:
        ap.apply_plan(steps, logged=False, quiet=True)
    assert getattr(exc.value, "exit_code", None) == 14 and "swarm mode" in str(exc.value), exc.value
    assert not marker.exists() and cfg.read_text() == '{"debug": true}\n' and not done
