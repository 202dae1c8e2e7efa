"""Hosts that already have an engine: gpuprov keeps it and configures it where it is, and no install removes a
package. One Debian 12 systemd host container for all the checks, in order:

1. Docker CE (stand-in packages docker-ce, docker-ce-cli, containerd.io with Docker's names, epoch-5 versions,
   Conflicts/Replaces and units around Debian's real binaries: tests/integration/dockerce.py), engine running:
   `bootstrap --yes --driver skip` keeps docker-ce and containerd.io (`dpkg` before == after), registers runtime
   `nvidia` in the running dockerd, validates; a second run changes nothing.
2. No removal, with real apt: asked for Debian's docker.io on that host (`--engine-source distro`), apt would remove
   Docker's packages: the run stops with exit 14 naming them and --allow-remove, and nothing changed.
3. `--engine containerd` with containerd.io: refused while its config disables the CRI plugin (Docker's default),
   then kept, runtime registered in that containerd, validated, 0 changes again.
4. A dockerd started from static binaries with `--config-file /srv/docker.json` (Docker CE's unit stopped): gpuprov
   configures /srv/docker.json (not /etc/docker/daemon.json) and reloads that daemon; 0 changes again.
"""
from __future__ import annotations

import json

import pytest

from tests.conftest import needs
from tests.integration import dockerce
from tests.integration.hosts import Host, steps

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", "dpkg-deb", "apt-get", docker=True)]
BOOT = "gpuprov bootstrap --yes --driver skip --json"
RT = "/usr/local/bin/gpuprov-runtime"
PACKAGES = "dpkg-query -W -f '${Package} ${Version} ${Status}\\n'"
RUNTIMES = "docker info --format '{{json .Runtimes}}'"
STATIC_JSON = {"log-level": "warn", "labels": ["started-by=operator"]}


@pytest.fixture(scope="module")
def host():
    debs = dockerce.build()
    h = Host(systemd=True, tmpfs=("/var/lib/containerd",), volumes={str(debs): "/debs"})
    try:
        r = h.exec("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                   "--no-install-recommends /debs/containerd.io.deb /debs/docker-ce-cli.deb /debs/docker-ce.deb "
                   "&& for i in $(seq 60); do docker info >/dev/null 2>&1 && exit 0; sleep 1; done; exit 1",
                   timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr + h.exec("journalctl -u docker -u containerd | tail -30").stdout
        r = h.install_gpuprov()
        assert r.returncode == 0, r.stdout + r.stderr
        yield h
    finally:
        h.remove()


def test_1_docker_ce_is_kept_and_configured(host):
    before = host.exec(PACKAGES).stdout
    assert "docker-ce 5:28.0.1-1~debian.12~bookworm install ok installed" in before
    detect = {e["name"]: e for e in json.loads(host.exec("gpuprov detect --json").stdout)["engines"]}
    origin = detect["docker"]["origin"]
    assert (origin["source"], origin["package"], origin["unit"], origin["config"]) == \
        ("docker-ce", "docker-ce", "docker", "/etc/docker/daemon.json")
    assert detect["containerd"]["origin"]["package"] == "containerd.io" and origin["pid"]
    r = host.exec(BOOT)
    assert r.returncode == 0, r.stdout + r.stderr
    by_id = steps(r.stdout)
    assert by_id["engine.present"]["title"] == "Docker CE 28.0.1 (docker-ce): kept", by_id["engine.present"]
    assert "engine.packages" not in by_id and "apt-get" not in r.stdout
    assert "gpuprov-validate-ok" in by_id["validate"]["detail"], by_id["validate"]
    assert host.exec(PACKAGES).stdout == before  # nothing removed, nothing added
    assert "nvidia" in json.loads(host.exec(RUNTIMES).stdout)
    assert host.exec("systemctl is-active docker containerd").stdout.split() == ["active", "active"]
    again = host.exec(BOOT)
    assert again.returncode == 0 and json.loads(again.stdout)["changed"] == 0, again.stdout + again.stderr


def test_2_an_install_that_would_remove_stops_before_any_change(host):
    """Real apt decides: docker.io conflicts with Docker's packages. The run stops at the dry run, exit 14, naming
    what apt would remove and the option that allows it; dpkg and the engine's config are as they were."""
    before, config = host.exec(PACKAGES).stdout, host.read("/etc/docker/daemon.json")
    r = host.exec("gpuprov bootstrap --yes --driver skip --engine-source distro")
    assert r.returncode == 14, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert "would remove installed packages" in err and "--allow-remove" in err, err
    assert all(p in err for p in ("docker-ce", "docker-ce-cli", "containerd.io")), err
    assert host.exec(PACKAGES).stdout == before and host.read("/etc/docker/daemon.json") == config
    assert host.exec("systemctl is-active docker").stdout.strip() == "active"


def test_3_containerd_io_is_kept_and_configured(host):
    """containerd.io as Docker ships it has the CRI plugin off (`disabled_plugins = ["cri"]`): that is the
    operator's setting, so the first run refuses (exit 14, the way out named, nothing written). With the CRI plugin
    on, containerd.io is kept and configured."""
    before, main = host.exec(PACKAGES).stdout, host.read("/etc/containerd/config.toml")
    r = host.exec(BOOT + " --engine containerd")
    assert r.returncode == 14, r.stdout + r.stderr
    assert "disabled_plugins lists 'cri'" in r.stderr and "nothing was changed" in r.stderr, r.stderr
    assert host.read("/etc/containerd/config.toml") == main
    assert host.exec("test -e /etc/containerd/conf.d/99-gpuprov.toml").returncode != 0
    host.exec("sed -i '/^disabled_plugins/d' /etc/containerd/config.toml && systemctl restart containerd", check=True)
    r = host.exec(BOOT + " --engine containerd")
    assert r.returncode == 0, r.stdout + r.stderr
    by_id = steps(r.stdout)
    assert by_id["engine.present"]["title"] == "containerd.io (Docker CE) 1.7.25 (containerd.io): kept"
    assert "engine.packages" not in by_id
    assert "gpuprov-validate-ok" in by_id["validate"]["detail"], by_id["validate"]
    assert host.exec(PACKAGES).stdout == before
    assert RT in host.exec("containerd config dump").stdout
    again = host.exec(BOOT + " --engine containerd")
    assert again.returncode == 0 and json.loads(again.stdout)["changed"] == 0, again.stdout + again.stderr


def test_4_static_dockerd_with_its_own_config_file(host):
    """Docker CE's units stopped; dockerd from static binaries in /usr/local/bin, started by hand with
    --config-file /srv/docker.json. gpuprov edits that file, reloads that daemon, and leaves daemon.json alone."""
    host.exec("systemctl disable --now docker.service docker.socket && cp /usr/bin/dockerd /usr/bin/docker-proxy "
              "/usr/local/bin/", check=True)
    host.write("/srv/docker.json", json.dumps(STATIC_JSON, indent=2) + "\n")
    host.spawn("exec setsid /usr/local/bin/dockerd --config-file /srv/docker.json >/var/log/static-dockerd.log 2>&1")
    assert host.exec("for i in $(seq 60); do docker info >/dev/null 2>&1 && exit 0; sleep 1; done; exit 1"
                     ).returncode == 0, host.exec("cat /var/log/static-dockerd.log").stdout
    etc = host.exec("cat /etc/docker/daemon.json 2>&1").stdout  # (its content, or that there is none)
    before = host.exec(PACKAGES).stdout
    r = host.exec(BOOT)
    assert r.returncode == 0, r.stdout + r.stderr
    by_id = steps(r.stdout)
    assert by_id["engine.present"]["title"] == ("dockerd from static binaries (/usr/local/bin/dockerd, no package "
                                                "owns it): kept"), by_id["engine.present"]
    assert by_id["engine.config"]["title"].endswith(": /srv/docker.json, the file the running docker reads")
    assert by_id["engine.config"]["status"] == "changed", by_id["engine.config"]
    assert "engine.service" not in by_id and "engine.packages" not in by_id
    assert "gpuprov-validate-ok" in by_id["validate"]["detail"], by_id["validate"]
    doc = json.loads(host.read("/srv/docker.json"))
    assert {k: doc[k] for k in STATIC_JSON} == STATIC_JSON and doc["runtimes"]["nvidia"]["path"] == RT
    assert host.exec("cat /etc/docker/daemon.json 2>&1").stdout == etc and host.exec(PACKAGES).stdout == before
    assert "nvidia" in json.loads(host.exec(RUNTIMES).stdout)
    again = host.exec(BOOT)
    assert again.returncode == 0 and json.loads(again.stdout)["changed"] == 0, again.stdout + again.stderr
