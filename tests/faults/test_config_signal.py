"""On a fresh Debian 12 host with a real dockerd (a container with a nested engine; its log records every reload):
`engine configure docker --config /tmp/x.json` must not reload the live dockerd (it used to SIGHUP whatever
/run/docker.pid named), the live daemon.json must; and bootstrap keeps the operator's default-runtime."""
from __future__ import annotations

import json

import pytest

from tests.conftest import needs
from tests.integration.hosts import Host

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
RELOAD = "Got signal to reload configuration"
GPUPROV = "/opt/gpuprov/bin/gpuprov"


@pytest.fixture(scope="module")
def host():
    h = Host(name=None)
    try:
        r = h.install_gpuprov()
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        r = h.exec("apt-get install -y -qq --no-install-recommends docker.io >/dev/null", timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        h.spawn("exec dockerd --iptables=false --bridge=none >/var/log/test-dockerd.log 2>&1")
        r = h.exec("for i in $(seq 60); do docker info >/dev/null 2>&1 && exit 0; sleep 1; done; exit 1")
        assert r.returncode == 0, h.exec("tail -20 /var/log/test-dockerd.log").stdout
        yield h
    finally:
        h.remove()


def _dockerd(host) -> tuple[str, int]:
    pid = host.exec("cat /run/docker.pid").stdout.strip()
    log = host.exec("cat /var/log/test-dockerd.log").stdout
    return pid, log.count(RELOAD)


def test_foreign_config_never_signals_the_live_dockerd(host):
    pid, reloads = _dockerd(host)
    host.write("/tmp/x.json", '{"debug": false}\n')
    r = host.exec(f"{GPUPROV} engine configure docker --config /tmp/x.json --runtime-path /usr/bin/runc "
                  "--runtime-name foreign --json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["changed"] and "not signalled" in res["restart"] and "/etc/docker/daemon.json" in res["restart"]
    assert json.loads(host.read("/tmp/x.json"))["runtimes"]["foreign"]["path"] == "/usr/bin/runc"
    assert _dockerd(host) == (pid, reloads)  # same dockerd, no reload in its log
    assert "foreign" not in host.exec("docker info --format '{{json .Runtimes}}'").stdout


def test_live_config_reloads_the_live_dockerd(host):
    """The control: the file dockerd really reads (/etc/docker/daemon.json, here through a symlink) is reloaded
    (SIGHUP, same pid) and the runtime is listed."""
    pid, reloads = _dockerd(host)
    host.exec("mkdir -p /srv/conf && echo '{}' > /srv/conf/daemon.json && ln -sf /srv/conf/daemon.json "
              "/etc/docker/daemon.json")
    r = host.exec(f"{GPUPROV} engine configure docker --runtime-path /usr/bin/runc --runtime-name live --json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["verified"] is True and f"pid {pid}" in res["restart"]
    new_pid, new_reloads = _dockerd(host)
    assert new_pid == pid and new_reloads == reloads + 1
    assert host.exec("test -L /etc/docker/daemon.json").returncode == 0


def test_bootstrap_keeps_the_operators_default_runtime(host):
    """`bootstrap` registers its runtime as the default; an operator's own default-runtime (crun here) stops it with
    exit 14 and daemon.json byte-identical, until --replace-runtime."""
    user = json.dumps({"default-runtime": "crun", "runtimes": {"crun": {"path": "/usr/bin/crun"}}}, indent=4) + "\n"
    host.exec("rm -f /etc/docker/daemon.json")
    host.write("/etc/docker/daemon.json", user)
    boot = f"{GPUPROV} bootstrap --yes --driver skip --no-validate"
    r = host.exec(boot)
    assert r.returncode == 14, r.stdout[-1000:] + r.stderr[-1000:]
    assert "'crun'" in r.stderr and "--replace-runtime" in r.stderr
    assert host.read("/etc/docker/daemon.json") == user.encode()
    r = host.exec(boot + " --replace-runtime")
    assert r.returncode == 0, r.stdout[-1000:] + r.stderr[-1000:]
    doc = json.loads(host.read("/etc/docker/daemon.json"))
    assert doc["default-runtime"] == "nvidia" and doc["runtimes"]["crun"] == {"path": "/usr/bin/crun"}
