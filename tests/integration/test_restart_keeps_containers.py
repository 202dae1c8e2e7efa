"""Issue 39 item 2: a running Docker host gets GPUs without a stopped container and without a half-done run. A fresh
Debian 12 systemd host (a container) with Debian's docker.io, the operator's daemon.json (no live-restore key: off),
one container running. dockerd must restart (it looks for the --gpus hook only when it starts), so bootstrap holds
live-restore on for that restart by a reload and gives the operator's setting back by a reload after it:

- the plan (`bootstrap --dry-run`, `--check`) says exactly that, with no exit 14;
- the run exits 0: dockerd restarted (new pid), the container still runs (same id, same start time, same pid),
  daemon.json is the file the plan's diff showed (gpuprov's keys, no live-restore key, the operator's keys in
  their order) with the operator's mode; `docker info` shows live-restore off;
- a re-run changes nothing.
"""
from __future__ import annotations

import json

import pytest

from provision.effects import unified_diff
from tests.conftest import needs
from tests.integration.hosts import Host

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]

DAEMON = "/etc/docker/daemon.json"
# the operator's file: 4-space indent, their key order, mode 0640, no live-restore (dockerd's default: off)
OPERATOR = json.dumps({"log-driver": "json-file", "log-opts": {"max-size": "10m", "max-file": "3"},
                       "registry-mirrors": ["https://mirror.lab.invalid"]}, indent=4) + "\n"
BOOT = "gpuprov bootstrap --yes --driver skip"
KEEP = ("restart dockerd with live-restore on for the restart (your 1 running container(s) keep running), then "
        "live-restore back off by a reload")
# A local image with nothing in it but the merged-/usr links: its container runs the host's /usr (read-only).
BASE_IMAGE = ("rm -rf /tmp/base && mkdir -p /tmp/base/usr && cd /tmp/base && ln -s usr/bin bin && ln -s usr/lib lib "
              "&& ln -s usr/lib64 lib64 && tar -c . | docker import - keep-base >/dev/null")
SLEEPER = "-v /usr:/usr:ro keep-base /bin/sh -c 'trap \"exit 0\" TERM; sleep 100000 & wait'"
STATE = "{{.Id}} {{.State.Running}} {{.State.StartedAt}} {{.State.Pid}}"


@pytest.fixture(scope="module")
def host():
    h = Host(systemd=True, tmpfs=("/var/lib/containerd",))
    try:
        r = h.exec("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                   "--no-install-recommends docker.io >/dev/null", timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr
        h.write(DAEMON, OPERATOR)
        h.exec(f"chmod 640 {DAEMON} && systemctl restart docker && {BASE_IMAGE}", check=True)
        r = h.exec(f"docker run -d --name keeper {SLEEPER}")
        assert r.returncode == 0, r.stderr
        r = h.install_gpuprov()
        assert r.returncode == 0, r.stdout + r.stderr
        yield h
    finally:
        h.remove()


def _json(h: Host, cmd: str) -> dict:
    r = h.exec(cmd, timeout=900)
    assert r.returncode == 0, cmd + "\n" + r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout)


def _engine_config(doc: dict) -> dict:
    [step] = [s for s in doc["steps"] if s["id"] == "engine.config"]
    return step


def test_a_running_container_outlives_the_restart_the_hook_needs(host):
    h = host
    before = h.exec(f"docker inspect -f '{STATE}' keeper").stdout.split()
    assert before[1] == "true", before
    assert h.exec("docker info -f '{{.LiveRestoreEnabled}}'").stdout.strip() == "false"
    dockerd = h.exec("systemctl show -p MainPID --value docker").stdout.strip()

    # the plan, the dry run and check mode say what the run will do: the held restart, no exit 14
    plan = _engine_config(_json(h, f"{BOOT} --dry-run --json"))
    assert any(a.startswith(f"then {KEEP}: the running dockerd") for a in plan["actions"]), plan["actions"]
    assert "SIGHUP" not in " ".join(plan["actions"]) and "exit 14" not in " ".join(plan["notes"]), plan
    assert any("turned on by a reload for the restart" in n for n in plan["notes"]), plan["notes"]
    text = h.exec(f"{BOOT} --dry-run")
    assert text.returncode == 0 and "then restart dockerd with live-restore on for the restart where it runs" in \
        " ".join(text.stdout.split()), \
        text.stdout[-3000:] + text.stderr[-2000:]
    check = _json(h, f"{BOOT} --check --json")
    assert check["stop"] is None, check["stop"]
    assert any(a.startswith(f"then {KEEP}") for a in _engine_config(check)["actions"])
    assert h.read(DAEMON).decode() == OPERATOR  # none of these changed anything

    # the run: exit 0, dockerd restarted, the container kept
    res = _json(h, f"{BOOT} --json")
    ran = {s["id"]: s for s in res["steps"]}
    assert ran["engine.config"]["status"] == "changed", ran["engine.config"]
    detail = ran["engine.config"]["detail"]
    assert "with live-restore on for the restart (1 running container(s) kept: keeper), then live-restore back " \
           "off by a reload" in detail, detail
    assert h.exec("systemctl show -p MainPID --value docker").stdout.strip() != dockerd  # it did restart
    after = h.exec(f"docker inspect -f '{STATE}' keeper").stdout.split()
    assert after == before, (before, after)  # same id, running, same start time, same process

    # the operator's file again, with gpuprov's keys: no live-restore, their bytes and mode otherwise
    doc = json.loads(h.read(DAEMON))
    assert "live-restore" not in doc and doc["runtimes"]["nvidia"]["path"], doc
    # exactly the file the plan's diff showed (the held live-restore left no trace) and gpuprov recorded writing
    final = h.read(DAEMON).decode()
    assert plan["diffs"][DAEMON] == unified_diff(OPERATOR, final, DAEMON), (plan["diffs"][DAEMON], final)
    assert json.loads(h.read("/var/lib/gpuprov/installed.json"))["configs"][DAEMON]["files"][DAEMON]["written"] \
        == final
    assert list(doc)[:3] == list(json.loads(OPERATOR)) and {k: doc[k] for k in json.loads(OPERATOR)} \
        == json.loads(OPERATOR)
    assert h.exec(f"stat -c %a {DAEMON}").stdout.strip() == "640"
    assert h.exec("docker info -f '{{.LiveRestoreEnabled}}'").stdout.strip() == "false"
    assert h.exec("test -e /var/lib/gpuprov/docker-live-restore.json").returncode == 1
    assert "nvidia" in json.loads(h.exec("docker info -f '{{json .Runtimes}}'").stdout)

    # a re-run changes nothing
    pid = h.exec("systemctl show -p MainPID --value docker").stdout.strip()
    again = _json(h, f"{BOOT} --json")
    assert again["changed"] == 0, [s for s in again["steps"] if s["status"] == "changed"]
    assert h.exec("systemctl show -p MainPID --value docker").stdout.strip() == pid
    assert h.exec(f"docker inspect -f '{STATE}' keeper").stdout.split() == before


def test_a_run_killed_while_it_holds_live_restore_is_finished_by_the_next(host):
    """A restart pending again (the hook newer than dockerd), `engine configure docker` killed (SIGKILL) as soon as
    it has recorded the hold: live-restore is on in the file and in dockerd. The next bootstrap exits 0 and leaves
    the operator's setting (no key, dockerd's live-restore off) and the container running; then nothing to change."""
    h = host
    before = h.exec(f"docker inspect -f '{STATE}' keeper").stdout.split()
    final = h.read(DAEMON)
    hold = "/var/lib/gpuprov/docker-live-restore.json"
    r = h.exec("touch /usr/local/bin/nvidia-container-runtime-hook && (gpuprov engine configure docker --default "
               f">/tmp/killed.log 2>&1 & pid=$!; for i in $(seq 400); do test -e {hold} && break; sleep 0.05; done; "
               f"kill -9 $pid; wait $pid; test -e {hold})")
    assert r.returncode == 0, r.stdout + r.stderr + h.exec("cat /tmp/killed.log").stdout
    held = h.exec("docker info -f '{{.LiveRestoreEnabled}}'").stdout.strip() == "true"
    assert held or h.read(DAEMON) == final  # killed between the state and the held file: nothing held yet
    res = _json(h, f"{BOOT} --json")
    detail = {s["id"]: s for s in res["steps"]}["engine.config"]["detail"]
    # where the kill came before the held file (a loaded machine), there is nothing to put back: the run just holds
    assert ("live-restore put back" in detail) if held else ("with live-restore on for the restart" in detail), detail
    assert h.read(DAEMON) == final and h.exec(f"test -e {hold}").returncode == 1
    assert h.exec("docker info -f '{{.LiveRestoreEnabled}}'").stdout.strip() == "false"
    assert h.exec(f"docker inspect -f '{STATE}' keeper").stdout.split() == before
    assert _json(h, f"{BOOT} --json")["changed"] == 0


def test_uninstall_restart_engine_keeps_the_running_container(host):
    """`uninstall --restart-engine` where a change needs dockerd's restart (features.cdi, read at start only): the
    plan says the held restart and the run does it, so the operator's container keeps running (on 112b38f it was a
    plain `systemctl restart docker`, which stops it with live-restore off)."""
    h = host
    r = h.exec("gpuprov engine configure docker --default --cdi", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(h.read(DAEMON))["features"]["cdi"] is True
    before = h.exec(f"docker inspect -f '{STATE}' keeper").stdout.split()
    assert before[1] == "true", before
    dockerd = h.exec("systemctl show -p MainPID --value docker").stdout.strip()
    plan = h.exec("gpuprov uninstall --dry-run -v --restart-engine", timeout=300)
    assert plan.returncode == 0 and KEEP in " ".join(plan.stdout.split()), plan.stdout[-3000:] + plan.stderr[-2000:]
    r = h.exec("gpuprov uninstall --yes --restart-engine", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert h.exec("systemctl show -p MainPID --value docker").stdout.strip() != dockerd  # it did restart
    assert h.exec(f"docker inspect -f '{STATE}' keeper").stdout.split() == before  # the same container, running
    doc = json.loads(h.read(DAEMON))
    assert "live-restore" not in doc and "features" not in doc and "nvidia" not in doc.get("runtimes", {}), doc
    assert h.exec("docker info -f '{{.LiveRestoreEnabled}}'").stdout.strip() == "false"
