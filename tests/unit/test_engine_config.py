"""Engine configuration: daemon.json merge (with a property test), dockerd flag clashes, containerd v1/v2/v3, CRI-O."""
from __future__ import annotations

import json
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from provision.engines import containerd, crio, docker
from provision.engines.configure import configure
from provision.errors import ConfigInvalid, RuntimeConflict
from tests.conftest import needs, run_cli

RT = "/usr/local/bin/gpuprov-runtime"
USER_DOC = {"data-root": "/srv/docker", "insecure-registries": ["registry.local:5000"],
            "registry-mirrors": ["https://mirror.local"], "log-driver": "json-file",
            "log-opts": {"max-size": "10m", "max-file": "3"}, "exec-opts": ["native.cgroupdriver=systemd"],
            "features": {"buildkit": True}}


def test_merge_keeps_user_keys_in_order():
    m = docker.merge(json.dumps(USER_DOC), runtime_path=RT, default=True, cdi=True)
    doc = json.loads(m.text)
    assert list(doc)[:len(USER_DOC)] == list(USER_DOC)
    for k, v in USER_DOC.items():
        if k != "features":
            assert doc[k] == v
    assert doc["features"] == {"buildkit": True, "cdi": True}
    assert doc["runtimes"]["nvidia"] == {"path": RT, "runtimeArgs": []}
    assert doc["default-runtime"] == "nvidia"


def test_merge_is_idempotent_and_byte_identical():
    once = docker.merge(json.dumps(USER_DOC), runtime_path=RT, default=True)
    twice = docker.merge(once.text, runtime_path=RT, default=True)
    assert once.changed and not twice.changed and twice.text == once.text


def test_existing_runtime_is_the_operators():
    """A runtime of the same name pointing at another binary is theirs (exit 14); --replace-runtime re-points it
    with a fresh entry: its runtimeArgs belonged to the other binary and are not carried over."""
    old = json.dumps({"runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime", "runtimeArgs": ["--x"]},
                                   "kata": {"path": "/opt/kata"}}})
    with pytest.raises(RuntimeConflict, match="--replace-runtime"):
        docker.merge(old, runtime_path=RT)
    doc = json.loads(docker.merge(old, runtime_path=RT, replace=True).text)
    assert doc["runtimes"]["nvidia"] == {"path": RT, "runtimeArgs": []}
    assert doc["runtimes"]["kata"] == {"path": "/opt/kata"}
    same = json.dumps({"runtimes": {"nvidia": {"path": RT, "runtimeArgs": ["--debug"]}}})
    assert not docker.merge(same, runtime_path=RT).changed  # our binary with the operator's args: left alone


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                           max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: k not in ("runtimes", "default-runtime",
                                                                                      "features")),
                       json_values, max_size=8),
       st.booleans(), st.booleans())
def test_property_merge_keeps_every_key_and_value(user, default, cdi):
    m = docker.merge(json.dumps(user), runtime_path=RT, default=default, cdi=cdi)
    doc = json.loads(m.text)
    assert list(doc)[:len(user)] == list(user)
    assert all(doc[k] == v for k, v in user.items())
    assert doc["runtimes"]["nvidia"]["path"] == RT
    assert docker.merge(m.text, runtime_path=RT, default=default, cdi=cdi).changed is False


@pytest.mark.parametrize("bad", ["{", "[1,2]", '{"runtimes": 3}', "{'single': 'quotes'}"])
def test_invalid_file_untouched(tmp_path, bad):
    p = tmp_path / "daemon.json"
    p.write_text(bad)
    with pytest.raises(ConfigInvalid):
        configure("docker", config=str(p), runtime_path=RT, restart=False)
    assert p.read_text() == bad and list(tmp_path.iterdir()) == [p]  # no backup, no temp file left


def test_cli_invalid_json_exit_code(tmp_path):
    p = tmp_path / "daemon.json"
    p.write_bytes(b'{"debug": true,,}')
    r = run_cli("engine", "configure", "docker", "--config", str(p), "--runtime-path", RT, "--no-restart")
    assert r.returncode == 6 and "not valid JSON" in r.stderr and p.read_bytes() == b'{"debug": true,,}'


def test_backup_and_atomic_write(tmp_path):
    p = tmp_path / "daemon.json"
    p.write_text(json.dumps(USER_DOC))
    p.chmod(0o600)
    res = configure("docker", config=str(p), runtime_path=RT, default=True, restart=False)
    assert res.changed and res.backup and json.loads(open(res.backup).read()) == USER_DOC
    assert (p.stat().st_mode & 0o777) == 0o600
    again = configure("docker", config=str(p), runtime_path=RT, default=True, restart=False)
    assert not again.changed and again.backup is None


def test_dry_run_changes_nothing(tmp_path):
    p = tmp_path / "daemon.json"
    p.write_text("{}")
    res = configure("docker", config=str(p), runtime_path=RT, dry_run=True)
    assert res.changed and "+  \"runtimes\"" in res.diff and p.read_text() == "{}"


def test_flag_clash_detected(tmp_path):
    unit = tmp_path / "etc/systemd/system/docker.service.d"
    unit.mkdir(parents=True)
    (unit / "override.conf").write_text("[Service]\nExecStart=\nExecStart=/usr/sbin/dockerd -H fd:// "
                                        "--default-runtime=runc --data-root /srv\n")
    flags = docker.unit_flags(tmp_path)
    assert flags == {"hosts": str(unit / "override.conf"), "default-runtime": str(unit / "override.conf"),
                     "data-root": str(unit / "override.conf")}
    p = tmp_path / "daemon.json"
    p.write_text('{"data-root": "/srv"}')
    with pytest.raises(ConfigInvalid, match="default-runtime.*dockerd flag"):
        configure("docker", config=str(p), runtime_path=RT, default=True, restart=False, unit_root=tmp_path)
    assert p.read_text() == '{"data-root": "/srv"}'
    res = configure("docker", config=str(p), runtime_path=RT, restart=False, unit_root=tmp_path)
    assert any("data-root" in w for w in res.warnings)  # a user clash we did not cause: explained, not fatal


V1 = """# my containerd config
[plugins.cri.containerd]
  snapshotter = "overlayfs"
"""
V2 = """version = 2
# keep me
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = true
"""
V3 = """version = 3
# containerd 2.x
[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "runc"
"""


@pytest.mark.parametrize("text,version", [(V1, 1), (V2, 2), (V3, 3)])
def test_containerd_versions(text, version):
    import tomllib

    m = containerd.merge(text, runtime_path=RT, default=True, cdi=True)
    doc = tomllib.loads(m.text)
    node = doc
    for k in containerd.CRI_PATHS[version]:
        node = node[k]
    assert node["runtimes"]["nvidia"]["options"]["BinaryName"] == RT
    assert node["default_runtime_name"] == "nvidia"
    assert all(ln in m.text for ln in text.splitlines() if ln.startswith("#"))  # comments kept
    assert not containerd.merge(m.text, runtime_path=RT, default=True, cdi=True).changed
    if version == 2:
        assert node["runtimes"]["nvidia"]["options"]["SystemdCgroup"] is True  # copied from runc's options
        assert "# keep me" in m.text


@needs("containerd")
@pytest.mark.parametrize("text", [V1, V2])
def test_containerd_config_dump_real(tmp_path, text):
    """containerd itself parses the result and lists the runtime (`containerd config dump`)."""
    p = tmp_path / "config.toml"
    p.write_text(containerd.merge(text, runtime_path=RT).text)
    out = subprocess.run(["containerd", "--config", str(p), "config", "dump"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert containerd.runtime_in_dump(out.stdout, "nvidia")


def test_containerd_invalid_untouched(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text("version = 2\n[plugins.\n")
    with pytest.raises(ConfigInvalid):
        configure("containerd", config=str(p), runtime_path=RT, restart=False)
    assert p.read_text() == "version = 2\n[plugins.\n"


def test_crio_dropin(tmp_path):
    import tomllib

    text = crio.render(runtime_path=RT, default=True)
    doc = tomllib.loads(text)
    assert doc["crio"]["runtime"]["default_runtime"] == "nvidia"
    assert doc["crio"]["runtime"]["runtimes"]["nvidia"] == {"runtime_path": RT, "runtime_type": "oci",
                                                            "runtime_root": "/run/gpuprov-runtime"}
    p = tmp_path / "99.toml"
    assert configure("crio", config=str(p), runtime_path=RT, restart=False).changed
    assert not configure("crio", config=str(p), runtime_path=RT, restart=False).changed
