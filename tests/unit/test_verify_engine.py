"""Issue 28 item 7: verify diagnoses the engine the node is set up for. With dockerd stopped on a Docker node, the
containerd that docker.io brings as dockerd's backend still answers `ctr version`: verify said `engine running PASS
containerd answers` and then "run gpuprov engine configure containerd". It checks the engine whose config registers
runtime `nvidia` now, and names the real fix (`systemctl start docker`). And the "gpuprov installed" check runs the
gpuprov that runs verify (a venv install need not be on PATH)."""
from __future__ import annotations

import json
import subprocess
import sys

from provision.verify import checks
from provision.verify.checks import LocalHost, NodeHost, engine_running, gpuprov_installed, runtime_registered

CTR_VERSION = "Client:\n  Version:  1.6.20~ds1\nServer:\n  Version:  1.6.20~ds1\n"


class ScriptedHost(NodeHost):
    """A node whose commands answer as the docker.io node seen in the issue: dockerd stopped, containerd running."""

    def __init__(self, engines_facts, docker_up: bool):
        self._facts = {"target": "debian-12", "gpus": [], "engines": engines_facts}
        self.docker_up = docker_up
        self.ran: list[list[str]] = []

    @property
    def facts(self):
        return self._facts

    def run(self, argv):
        self.ran.append(argv)
        if argv[:2] == ["docker", "info"]:
            if self.docker_up:
                return 0, json.dumps({"runc": {"path": "runc"}, "nvidia": {"path": checks.RUNTIME_PATH}}), ""
            return 1, "", "Cannot connect to the Docker daemon at unix:///var/run/docker.sock"
        if argv[:2] == ["ctr", "version"]:
            return 0, CTR_VERSION, ""
        if argv[:1] == ["test"]:
            return 0, "", ""
        return 127, "", f"{argv[0]}: not found"


DOCKER_SET_UP = [{"name": "docker", "runtimes": ["nvidia", "runc"], "default_runtime": "nvidia",
                  "config_path": "/etc/docker/daemon.json"},
                 {"name": "containerd", "runtimes": [], "default_runtime": None,
                  "config_path": "/etc/containerd/config.toml"}]


def test_stopped_dockerd_is_named_not_containerd():
    h = ScriptedHost(DOCKER_SET_UP, docker_up=False)
    r = engine_running(h)
    assert r.status == "fail" and "set up for Docker" in r.detail and "systemctl start docker" in r.detail, r
    assert runtime_registered(h).status == "fail"
    assert not any(a[:1] == ["ctr"] for a in h.ran)  # containerd was never taken for the node's engine


def test_running_dockerd_passes():
    h = ScriptedHost(DOCKER_SET_UP, docker_up=True)
    assert engine_running(h).status == "pass" and h.engine.name == "docker"
    assert runtime_registered(h).status == "pass"


def test_a_node_set_up_for_nothing_takes_the_first_engine_that_answers():
    h = ScriptedHost([{"name": "containerd", "runtimes": [], "config_path": "/etc/containerd/config.toml"}],
                     docker_up=False)
    assert engine_running(h).status == "pass" and h.engine.name == "containerd"


def test_gpuprov_installed_finds_the_gpuprov_running_verify(tmp_path):
    """PATH without any gpuprov (a venv install not linked): the local check still runs this gpuprov's detect."""
    assert LocalHost.gpuprov[0] == sys.executable
    code = ("import os, sys; os.environ['PATH'] = '/usr/bin:/bin'; from provision.verify.checks import LocalHost, "
            "gpuprov_installed; r = gpuprov_installed(LocalHost()); print(r.status, r.detail)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(__import__("pathlib").Path(
                             checks.__file__).resolve().parents[2])}, timeout=120)
    assert out.stdout.startswith("pass target "), (out.stdout, out.stderr)
    assert gpuprov_installed(ScriptedHost([], docker_up=False)).status == "pass"
