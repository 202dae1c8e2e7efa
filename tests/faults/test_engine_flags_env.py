"""Issue 27 item 11: every place dockerd takes flags counts. Debian's docker.io unit (copied into
tests/fixtures/units from docker.io 20.10.24+dfsg1-1+deb12u1) runs `dockerd -H fd:// … $DOCKER_OPTS` with
`EnvironmentFile=-/etc/default/docker`; a `--default-runtime` there and `default-runtime` in daemon.json stop dockerd
("directives are specified both as a flag and in the configuration file"). gpuprov reads the environment the unit
gives dockerd like its ExecStart and drop-ins: the plan stops with exit 6 naming the file, daemon.json untouched."""
from __future__ import annotations

import shutil

import pytest

from provision.engines import docker
from provision.engines.configure import configure
from provision.errors import ConfigInvalid
from tests.conftest import FIXTURES, run_cli

CONFIG_INVALID = 6
UNIT = FIXTURES / "units" / "docker.io-20.10.24-deb12.service"
DEFAULT = FIXTURES / "units" / "docker.io-20.10.24-deb12.default"
RT = "/usr/local/bin/gpuprov-runtime"


def debian_host(tmp_path, opts: str | None):
    root = tmp_path / "host"
    shutil.copytree(FIXTURES / "distros" / "debian-12", root, symlinks=True)
    (root / "lib/systemd/system").mkdir(parents=True)
    shutil.copy(UNIT, root / "lib/systemd/system/docker.service")
    (root / "etc/default").mkdir(parents=True, exist_ok=True)
    text = DEFAULT.read_text() + (f"{opts}\n" if opts is not None else "")
    (root / "etc/default/docker").write_text(text)
    return root


def test_debian_default_file_flag_stops_the_plan(tmp_path):
    root = debian_host(tmp_path, 'DOCKER_OPTS="--default-runtime=runc --log-level=warn"')
    (root / "etc/docker").mkdir(parents=True, exist_ok=True)
    (root / "etc/docker/daemon.json").write_text('{"log-driver": "journald"}\n')
    r = run_cli("plan", "--root", str(root), "--driver", "skip")
    assert r.returncode == CONFIG_INVALID, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "\n" not in err and "default-runtime" in err and "etc/default/docker" in err and "$DOCKER_OPTS" in err
    assert (root / "etc/docker/daemon.json").read_text() == '{"log-driver": "journald"}\n'


def test_packaged_default_file_plans(tmp_path):
    root = debian_host(tmp_path, None)  # the file as Debian ships it: comments only
    assert docker.unit_flags(root) == {"hosts": str(root / "lib/systemd/system/docker.service"),
                                       "containerd": str(root / "lib/systemd/system/docker.service")}
    assert run_cli("plan", "--root", str(root), "--driver", "skip").returncode == 0


@pytest.mark.parametrize("opts", ['#DOCKER_OPTS="--default-runtime=runc"', 'OTHER="--default-runtime=runc"'])
def test_commented_or_unused_variables_are_not_flags(tmp_path, opts):
    assert "default-runtime" not in docker.unit_flags(debian_host(tmp_path, opts))


def test_missing_optional_environment_file(tmp_path):
    root = debian_host(tmp_path, None)
    (root / "etc/default/docker").unlink()
    assert "default-runtime" not in docker.unit_flags(root)


def test_dropin_environment_and_braces(tmp_path):
    """A drop-in's Environment= (and a later EnvironmentFile= winning over it, as systemd has it), `${VAR}` inside
    a word, and `--add-runtime` (runtimes) given as a separate word."""
    root = debian_host(tmp_path, None)
    d = root / "etc/systemd/system/docker.service.d"
    d.mkdir(parents=True)
    (d / "10-env.conf").write_text('[Service]\nEnvironment="RT=--add-runtime" "NAME=x=/usr/bin/runc"\n'
                                   "ExecStart=\nExecStart=/usr/sbin/dockerd ${RT} $NAME\n")
    flags = docker.unit_flags(root)
    assert flags["runtimes"] == str(d / "10-env.conf")
    (d / "20-file.conf").write_text("[Service]\nEnvironmentFile=/etc/gpu-opts\n")
    (root / "etc/gpu-opts").write_text("RT=--debug\n")
    assert "runtimes" not in docker.unit_flags(root)


def test_engine_configure_default_refused_with_the_env_file(tmp_path):
    root = debian_host(tmp_path, "DOCKER_OPTS='--default-runtime runc'")
    p = tmp_path / "daemon.json"
    p.write_text("{}")
    with pytest.raises(ConfigInvalid, match=r"default-runtime.*etc/default/docker"):
        configure("docker", config=str(p), runtime_path=RT, default=True, restart=False, unit_root=root)
    assert p.read_text() == "{}"
