"""Hostile and unusual daemon.json files: whatever dockerd would reject, or a lenient read would silently change, is
refused with exit 6 and the file left byte-for-byte as it was. The operator's own runtimes and default-runtime are
theirs (exit 14) unless --replace-runtime, and a replaced runtime never keeps the other binary's arguments."""
from __future__ import annotations

import json

import pytest

from tests.faults.conftest import CONFIG_INVALID, CONFLICT, RT, configure, snapshot

HOSTILE = {
    "nan": b'{"debug": NaN}',
    "infinity": b'{"mtu": Infinity}',
    "minus-infinity": b'{"mtu": -Infinity}',
    "1e400": b'{"max-concurrent-downloads": 1e400}',  # was written back as Infinity
    "huge-int": b'{"mtu": 1' + b"0" * 400 + b"}",
    "duplicate-key": b'{"data-root": "/srv/a", "data-root": "/srv/b"}',  # one copy was silently dropped
    "duplicate-runtime": b'{"runtimes": {"kata": {"path": "/a"}, "kata": {"path": "/b"}}}',
    "not-utf8": b'{"labels": ["caf\xe9"]}',
    "deep-nesting": b'{"labels": ' + b"[" * 100000 + b"]" * 100000 + b"}",
    "runtime-is-string": b'{"runtimes": {"nvidia": "/usr/bin/nvidia-container-runtime"}}',
    "runtime-path-number": b'{"runtimes": {"kata": {"path": 5}}}',
    "runtime-args-string": b'{"runtimes": {"kata": {"path": "/a", "runtimeArgs": "--x"}}}',
    "default-runtime-number": b'{"default-runtime": 5}',
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_config_refused_untouched(tmp_path, case):
    p = tmp_path / "daemon.json"
    p.write_bytes(HOSTILE[case])
    before = snapshot(tmp_path)
    r = configure(p, "--default", "--cdi", lock_dir=tmp_path.parent / f"{tmp_path.name}.lock")
    assert r.returncode == CONFIG_INVALID, (case, r.returncode, r.stderr[-300:])
    assert r.stderr.startswith("Error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "was not changed" in r.stderr
    assert snapshot(tmp_path) == before


def test_operators_runtime_of_the_same_name_is_kept(tmp_path):
    """NVIDIA's nvidia-container-runtime registered as `nvidia` with --debug: exit 14, nothing changed; with
    --replace-runtime it points at gpuprov-runtime, and its --debug (meant for the other binary) is gone."""
    p = tmp_path / "daemon.json"
    old = json.dumps({"runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime",
                                              "runtimeArgs": ["--debug"]}}}, indent=2).encode()
    p.write_bytes(old)
    before = snapshot(tmp_path)
    r = configure(p, lock_dir=tmp_path.parent / f"{tmp_path.name}.lock")
    assert r.returncode == CONFLICT, r.stderr
    assert "nvidia-container-runtime" in r.stderr and "--replace-runtime" in r.stderr
    assert snapshot(tmp_path) == before
    r = configure(p, "--replace-runtime", lock_dir=tmp_path.parent / f"{tmp_path.name}.lock")
    assert r.returncode == 0, r.stderr
    assert json.loads(p.read_text())["runtimes"]["nvidia"] == {"path": RT, "runtimeArgs": []}


def test_operators_default_runtime_is_kept(tmp_path):
    """A default-runtime of the operator's (crun) is not replaced by --default (bootstrap uses --default) unless
    --replace-runtime; a runtime registered under another name leaves it alone."""
    p = tmp_path / "daemon.json"
    old = b'{"default-runtime": "crun", "runtimes": {"crun": {"path": "/usr/bin/crun"}}}'
    p.write_bytes(old)
    lock = tmp_path.parent / f"{tmp_path.name}.lock"
    before = snapshot(tmp_path)
    r = configure(p, "--default", lock_dir=lock)
    assert r.returncode == CONFLICT and "'crun'" in r.stderr, r.stderr
    assert snapshot(tmp_path) == before
    assert configure(p, lock_dir=lock).returncode == 0  # registering without --default is fine
    doc = json.loads(p.read_text())
    assert doc["default-runtime"] == "crun" and doc["runtimes"]["crun"] == {"path": "/usr/bin/crun"}
    assert configure(p, "--default", "--replace-runtime", lock_dir=lock).returncode == 0
    assert json.loads(p.read_text())["default-runtime"] == "nvidia"
