"""ansible-playbook site.yml against three fresh Debian 12 hosts (containers reached through `docker exec`):
install and configure all three, a second run with changed=0, --check --diff, the testinfra suite through the
Ansible inventory, and one host with an invalid daemon.json failing alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from provision.engines.validate import IMAGE
from tests.conftest import needs
from tests.integration.fleet import playbook, write_inventory
from tests.integration.hosts import REPO, Host

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              needs("debootstrap", "ansible-playbook", docker=True)]
SUITE = REPO / "provision/verify/test_gpu_node.py"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    hosts = [Host(f"role-fleet-{i}-{os.getpid()}") for i in range(3)]
    try:
        inv = write_inventory(tmp_path_factory.mktemp("inv") / "hosts.yml", hosts)
        yield hosts, inv
    finally:
        for h in hosts:
            h.remove()


def run_testinfra(inv, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hosts=ansible://gpu_nodes",
                           f"--ansible-inventory={inv}", str(SUITE), *extra], capture_output=True, text=True,
                          cwd="/tmp", env={**os.environ, "PYTHONPATH": str(REPO)})


def test_0_check_diff_on_fresh_nodes_says_what_it_cannot_know(fleet):
    """Issue 28.6: `--check --diff` on fresh nodes (no Python, no gpuprov) ends well, one line per node saying what
    check mode cannot know there, and changes nothing (it failed with `/usr/bin/python3: not found`)."""
    hosts, inv = fleet
    rc, out, recap = playbook(inv, "--check", "--diff")
    assert rc == 0, out[-3000:]
    for h in hosts:
        assert recap[h.name]["failed"] == 0 and recap[h.name]["unreachable"] == 0, recap
        assert f"{h.name}: check mode cannot know what gpuprov would change here until a real run has installed " \
               "Python 3 with venv and gpuprov on the node; nothing was changed" in out, out[-3000:]
        assert h.exec("command -v python3 || test -e /opt/gpuprov").returncode != 0  # still fresh


def test_1_first_run_configures_all(fleet):
    hosts, inv = fleet
    rc, out, recap = playbook(inv)
    assert rc == 0, out[-3000:]
    assert set(recap) == {h.name for h in hosts}
    assert all(r["changed"] > 0 and r["failed"] == 0 for r in recap.values()), recap
    for h in hosts:
        assert "nvidia" in json.loads(h.exec("docker info --format '{{json .Runtimes}}'").stdout)


def test_2_second_run_changes_nothing(fleet):
    _, inv = fleet
    rc, out, recap = playbook(inv)
    assert rc == 0, out[-3000:]
    assert all(r["changed"] == 0 for r in recap.values()), recap


def test_2b_tags_runtime_changes_only_the_runtime(fleet):
    """`--tags runtime` runs `bootstrap --only runtime`: the runtime removed by hand comes back, and no other stage
    runs (the validation image removed by hand stays removed; the log names runtime steps only)."""
    hosts, inv = fleet
    h = hosts[0]
    h.exec(f"rm -f /usr/local/bin/gpuprov-runtime; docker rmi {IMAGE}")
    before = len(h.read("/var/log/gpuprov/bootstrap.log").splitlines())
    rc, out, recap = playbook(inv, "--tags", "runtime", "--limit", h.name)
    assert rc == 0, out[-3000:]
    assert recap[h.name]["changed"] == 1, recap
    assert h.exec("test -x /usr/local/bin/gpuprov-runtime").returncode == 0
    assert h.exec(f"docker image inspect {IMAGE}").returncode != 0  # validate did not run
    run = h.read("/var/log/gpuprov/bootstrap.log").decode().splitlines()[before:]
    assert {ln.split()[2].rstrip(":") for ln in run} == {"runtime.install", "engine.config"}, run
    rc, out, recap = playbook(inv, "--limit", h.name)  # the whole role again: the validation image is rebuilt
    assert rc == 0 and h.exec(f"docker image inspect {IMAGE}").returncode == 0, out[-2000:]


def _logged_steps(h, before: int) -> set[str]:
    return {ln.split()[2].rstrip(":") for ln in h.read("/var/log/gpuprov/bootstrap.log").decode().splitlines()[before:]}


@pytest.mark.parametrize("tag", ["driver", "engine", "runtime", "validate"])
def test_2c_each_stage_tag_runs_exactly_that_stage(fleet, tag):
    """`--tags T` walks exactly the steps `gpuprov plan --only T` lists for that node, no more, no fewer."""
    hosts, inv = fleet
    h = hosts[0]
    plan = json.loads(h.exec(f"gpuprov plan --only {tag} --driver skip --json", check=True).stdout)
    before = len(h.read("/var/log/gpuprov/bootstrap.log").splitlines())
    rc, out, recap = playbook(inv, "--tags", tag, "--limit", h.name)
    assert rc == 0, out[-3000:]
    assert _logged_steps(h, before) == {s["id"] for s in plan["steps"]}, out[-2000:]
    if tag != "driver":  # (the containers' inventory skips the driver: its stage may plan nothing)
        assert plan["steps"]


def test_3_check_diff_shows_daemon_json_and_changes_nothing(fleet):
    hosts, inv = fleet
    h = hosts[0]
    doc = json.loads(h.read("/etc/docker/daemon.json"))
    doc.pop("default-runtime")
    h.write("/etc/docker/daemon.json", json.dumps(doc, indent=2) + "\n")
    before = h.read("/etc/docker/daemon.json")
    rc, out, recap = playbook(inv, "--check", "--diff", "--limit", h.name)
    assert rc == 0, out[-3000:]
    assert recap[h.name]["changed"] >= 1
    assert '+  "default-runtime": "nvidia"' in out and "daemon.json" in out
    assert h.read("/etc/docker/daemon.json") == before
    rc, out, recap = playbook(inv, "--limit", h.name)  # put it back
    assert rc == 0 and recap[h.name]["changed"] >= 1


def test_3b_check_reports_the_conflict_the_real_run_stops_at(fleet):
    """Issue 28.5: with the operator's `default-runtime: runc`, --check --diff fails the task with the real run's
    line and exit code (14), instead of `changed`; nothing is changed."""
    hosts, inv = fleet
    h = hosts[0]
    before = h.read("/etc/docker/daemon.json")
    doc = json.loads(before)
    doc["default-runtime"] = "runc"
    h.write("/etc/docker/daemon.json", json.dumps(doc, indent=2) + "\n")
    mine = h.read("/etc/docker/daemon.json")
    try:
        rc, out, recap = playbook(inv, "--check", "--diff", "--limit", h.name)
        assert rc != 0 and recap[h.name]["failed"] == 1, out[-3000:]
        assert "default-runtime is 'runc', set by you" in out and "(exit 14)" in out, out[-3000:]
        assert h.read("/etc/docker/daemon.json") == mine
    finally:
        h.write("/etc/docker/daemon.json", before.decode())


def test_4_testinfra_suite_through_the_inventory(fleet):
    hosts, inv = fleet
    r = run_testinfra(inv)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "passed" in r.stdout and "failed" not in r.stdout
    h = hosts[1]
    h.exec("rm -f /usr/local/bin/gpuprov-runtime")
    r = run_testinfra(inv)
    assert r.returncode != 0
    assert f"{h.name}: runtime registered: runtime 'nvidia' points to /usr/local/bin/gpuprov-runtime, which is " \
           "missing" in r.stdout, r.stdout[-3000:]
    rc, out, recap = playbook(inv, "--limit", h.name)  # the role repairs it
    assert rc == 0 and recap[h.name]["changed"] >= 1, out[-2000:]


def test_4b_busy_host_is_retried_then_named(fleet):
    """Another gpuprov run holds the node's host lock: the task fails fast (exit 11) and retries; when the retries
    run out it fails naming the fix; when the holder finishes within them, the play goes on."""
    hosts, inv = fleet
    h = hosts[1]
    # the holder keeps the lock until /tmp/hold is removed
    h.spawn("mkdir -p /run/gpuprov && touch /tmp/hold && exec flock /run/gpuprov/host.lock "
            "sh -c 'while [ -e /tmp/hold ]; do sleep 0.2; done'")
    h.exec("for i in $(seq 100); do flock -n /run/gpuprov/host.lock true || exit 0; sleep 0.1; done; exit 1", check=True)
    rc, out, recap = playbook(inv, "--tags", "runtime", "--limit", h.name, "-e",
                              '{"gpuprov_busy_retries": 1, "gpuprov_busy_delay": 1}')
    assert rc != 0 and recap[h.name]["failed"] == 1, out[-3000:]
    assert "(exit 11). Fix: another gpuprov run holds the node's host lock" in out, out[-3000:]
    assert "FAILED - RETRYING" in out
    released = []

    def release_on_first_retry(line: str) -> None:
        if "FAILED - RETRYING" in line and not released:
            released.append(line)
            h.exec("rm -f /tmp/hold", check=True)

    rc, out, recap = playbook(inv, "--tags", "runtime", "--limit", h.name, "-e",
                              '{"gpuprov_busy_retries": 20, "gpuprov_busy_delay": 2}', on_line=release_on_first_retry)
    assert released and rc == 0 and recap[h.name]["failed"] == 0, out[-3000:]


def test_4c_operators_runtime_needs_replace_runtime(fleet):
    """The node's own runtime named nvidia (pointing elsewhere): exit 14, the message names
    gpuprov_replace_runtime, daemon.json untouched; with gpuprov_replace_runtime: true the role replaces it."""
    hosts, inv = fleet
    h = hosts[0]
    doc = json.loads(h.read("/etc/docker/daemon.json"))
    doc["runtimes"]["nvidia"] = {"path": "/usr/bin/runc", "runtimeArgs": ["--debug"]}
    h.write("/etc/docker/daemon.json", json.dumps(doc, indent=2) + "\n")
    before = h.read("/etc/docker/daemon.json")
    rc, out, recap = playbook(inv, "--tags", "runtime", "--limit", h.name)
    assert rc != 0 and recap[h.name]["failed"] == 1, out[-3000:]
    assert "(exit 14). Fix: " in out and "set gpuprov_replace_runtime: true" in out, out[-3000:]
    assert "runtime 'nvidia' is already registered as /usr/bin/runc" in out
    assert h.read("/etc/docker/daemon.json") == before
    rc, out, recap = playbook(inv, "--tags", "runtime", "--limit", h.name, "-e", '{"gpuprov_replace_runtime": true}')
    assert rc == 0 and recap[h.name]["changed"] == 1, out[-3000:]
    runtimes = json.loads(h.read("/etc/docker/daemon.json"))["runtimes"]
    assert runtimes["nvidia"] == {"path": "/usr/local/bin/gpuprov-runtime", "runtimeArgs": []}


def test_4d_engine_options_and_users_go_through_gpuprov(fleet):
    """Issue 28.14, geerlingguy.docker's variables: gpuprov_engine_options (its docker_daemon_options) merged into
    daemon.json by gpuprov, beside its own keys and the operator's (check mode shows the diff first); a key dockerd
    reads only at start restarts it (no container runs here), the live daemon then uses it; gpuprov_engine_users
    (docker_users) added to the docker group; the next run changes nothing; a key gpuprov's own options set is
    refused by the module with exit 2 before anything runs. (test_6 then shows uninstall keeps these keys.)"""
    hosts, inv = fleet
    h = hosts[1]
    h.exec("useradd -m alice", check=True)
    mine = json.loads(h.read("/etc/docker/daemon.json"))
    mine["dns"] = ["192.0.2.53"]  # the operator's own key, set by hand
    h.write("/etc/docker/daemon.json", json.dumps(mine, indent=2) + "\n")
    before = h.read("/etc/docker/daemon.json")
    extra = ["--tags", "engine,runtime", "--limit", h.name, "-e", json.dumps(
        {"gpuprov_engine_options": {"log-driver": "local", "max-concurrent-downloads": 4},
         "gpuprov_engine_users": ["alice"]})]
    rc, out, recap = playbook(inv, "--check", "--diff", *extra)
    assert rc == 0 and recap[h.name]["changed"] >= 1, out[-3000:]
    assert '+  "log-driver": "local"' in out and '+  "max-concurrent-downloads": 4' in out, out[-3000:]
    assert h.read("/etc/docker/daemon.json") == before
    rc, out, recap = playbook(inv, *extra)
    assert rc == 0 and recap[h.name]["failed"] == 0, out[-3000:]
    doc = json.loads(h.read("/etc/docker/daemon.json"))
    assert doc == {**mine, "log-driver": "local", "max-concurrent-downloads": 4}, doc
    assert h.exec("docker info --format '{{.LoggingDriver}}'").stdout.strip() == "local"  # restarted: read at start
    assert "docker" in h.exec("id -nG alice").stdout.split()
    rc, out, recap = playbook(inv, *extra)
    assert rc == 0 and recap[h.name]["changed"] == 0, (recap, out[-3000:])
    rc, out, recap = playbook(inv, "--limit", h.name, "--tags", "runtime", "-e",
                              '{"gpuprov_engine_options": {"default-runtime": "runc"}}')
    assert rc != 0 and recap[h.name]["failed"] == 1, out[-3000:]
    assert "engine_options 'default-runtime=\"runc\"': KEY=JSON" in out and "(exit 2)" in out, out[-3000:]
    assert json.loads(h.read("/etc/docker/daemon.json")) == doc


def test_5_invalid_daemon_json_fails_alone(fleet):
    hosts, inv = fleet
    bad = hosts[2]
    bad.write("/etc/docker/daemon.json", '{"log-driver": "json-file",,}\n')
    for h in hosts[:2]:  # something for the healthy hosts to do, so "finish" is visible
        doc = json.loads(h.read("/etc/docker/daemon.json"))
        doc.pop("default-runtime")
        h.write("/etc/docker/daemon.json", json.dumps(doc) + "\n")
    rc, out, recap = playbook(inv)
    assert rc != 0
    assert recap[bad.name]["failed"] == 1
    assert "is not valid JSON" in out and "the file was not changed" in out
    for h in hosts[:2]:
        assert recap[h.name]["failed"] == 0 and recap[h.name]["changed"] >= 1
    assert bad.read("/etc/docker/daemon.json") == b'{"log-driver": "json-file",,}\n'


def test_6_state_absent_takes_gpuprov_off_every_node_then_changes_nothing(fleet):
    """`gpuprov_state: absent` across the inventory: gpuprov's keys out of daemon.json (the operator's kept, and the
    runtime gpuprov_replace_runtime replaced given back), its runtime, state and the role's own install gone,
    dockerd still running; with gpuprov_uninstall_engine the docker.io gpuprov installed is purged too; a re-run
    changes nothing."""
    hosts, inv = fleet
    hosts[2].write("/etc/docker/daemon.json", json.dumps({"log-driver": "json-file", "runtimes": {"nvidia": {
        "path": "/usr/local/bin/gpuprov-runtime", "runtimeArgs": []}}, "default-runtime": "nvidia"}, indent=2) + "\n")
    before = {h.name: json.loads(h.read("/etc/docker/daemon.json")) for h in hosts}
    rc, out, recap = playbook(inv, "--limit", hosts[2].name, "-e", "gpuprov_state=absent",
                              "-e", "gpuprov_uninstall_engine=true")
    assert rc == 0 and recap[hosts[2].name]["changed"] > 0, out[-3000:]
    assert hosts[2].exec("dpkg-query -W -f '${Status}' docker.io").stdout != "install ok installed"  # gpuprov's
    rc, out, recap = playbook(inv, "-e", "gpuprov_state=absent")
    assert rc == 0, out[-3000:]
    assert recap[hosts[2].name]["changed"] == 0 and recap[hosts[2].name]["failed"] == 0, recap
    for h in hosts[:2]:
        assert recap[h.name]["changed"] > 0 and recap[h.name]["failed"] == 0, recap
        kept = {k: v for k, v in before[h.name].items() if k not in ("runtimes", "default-runtime")}
        if h is hosts[0]:  # its own `nvidia` that test_4c replaced (gpuprov_replace_runtime) is given back
            kept["runtimes"] = {"nvidia": {"path": "/usr/bin/runc", "runtimeArgs": ["--debug"]}}
        if kept:
            assert json.loads(h.read("/etc/docker/daemon.json")) == kept, h.name
        else:  # gpuprov created the file (a fresh node) and nothing of the operator's is in it: it goes
            assert h.exec("test -e /etc/docker/daemon.json").returncode != 0, h.name
        runtimes = json.loads(h.exec("docker info --format '{{json .Runtimes}}'").stdout)  # dockerd runs, without ours
        assert not any(r.get("path") == "/usr/local/bin/gpuprov-runtime" for r in runtimes.values()), runtimes
    for h in hosts:
        gone = h.exec("ls -d /usr/local/bin/gpuprov-runtime /usr/local/bin/nvidia-container-runtime-hook "
                      "/usr/local/lib/gpuprov-runtime /etc/gpuprov /var/log/gpuprov "
                      "/opt/gpuprov /usr/local/bin/gpuprov 2>/dev/null")
        assert gone.stdout == "", (h.name, gone.stdout)
        # what stays, on purpose: the host lock (never removed, issue 27.8) and the record of the packages gpuprov
        # installed and uninstall kept (issue 28.4: a later `uninstall --purge-engine` still knows them)
        left = h.exec("find /run/gpuprov /var/lib/gpuprov -mindepth 1 2>/dev/null").stdout.split()
        assert set(left) <= {"/run/gpuprov/host.lock", "/var/lib/gpuprov/installed.json"}, (h.name, left)
    rc, out, recap = playbook(inv, "-e", "gpuprov_state=absent")
    assert rc == 0 and all(r["changed"] == 0 for r in recap.values()), (recap, out[-2000:])
