"""Engine configuration: daemon.json merge (with a property test), dockerd flag clashes. containerd and CRI-O:
tests/unit/test_containerd_dropin.py, tests/unit/test_crio_dropin.py."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from provision.engines import docker
from provision.engines.configure import configure
from provision.errors import ConfigInvalid, RuntimeConflict
from tests.conftest import run_cli

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
