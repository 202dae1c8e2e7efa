"""Issue 38 item 4: the operator's runtime settings survive every re-install. After `gpuprov k8s node` had turned
`accept_env_unprivileged` off (a multi-tenant node: GPUs only through the device plugin's lists), `gpuprov runtime
install` wrote it back to true, silently, and bootstrap's runtime step did the same; an unprivileged pod that set
only NVIDIA_VISIBLE_DEVICES=all then got every GPU. The runtime's own refusals tell operators to run exactly that
command.

Each writer of runtime.json is run as an operator runs it against its own settings file (GPUPROV_RUNTIME_CONFIG) and
prefix, for the fake H200 host (real mknod device nodes): `runtime install` again, with other options and with none
(the driver root and the low-level runtime are found on the host again unless given, as before: the others stay);
bootstrap's runtime step (InstallRuntime, as bootstrap applies it); then a container through the installed compiled
front-end, the runc hand-over recorded. A policy change asked for is said in one note. (`gpuprov k8s node` writes its
keys through settings.set_setting, which keeps the others: tests/unit/test_k8s.py.)"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from provision.inject.settings import set_setting
from provision.plan.steps import InstallRuntime
from tests.conftest import H200, run_cli
from tests.inject_helpers import edited, fake_dev, fake_runc, gpu_bundle, runc_calls, stop_editors

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod)")


class Node:
    def __init__(self, base: Path):
        self.base = base
        self.config = base / "runtime.json"
        self.runc = fake_runc(base)
        self.env = {"GPUPROV_RUNTIME_CONFIG": str(self.config)}
        self.roots = ("--driver-root", str(H200 / "usr/local/nvidia"), "--dev-root", str(fake_dev(base)),
                      "--proc-root", str(H200))

    def install(self, *args: str) -> dict:
        r = run_cli("runtime", "install", "--prefix", str(self.base / "rt"), "--runc", str(self.runc), *args,
                    "--json", env=self.env)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def settings(self) -> dict:
        return json.loads(self.config.read_text())

    def kept(self) -> dict:
        """The keys a re-install keeps: all but the two it finds on the host again (the driver root and runc)."""
        return {k: v for k, v in self.settings().items() if k not in ("driver_root", "runc")}

    def start(self, name: str) -> Path:
        """An unprivileged container asking NVIDIA_VISIBLE_DEVICES=all, created through the installed front-end."""
        b = gpu_bundle(self.base, name)
        r = __import__("subprocess").run(
            [str(self.base / "rt/bin/gpuprov-runtime"), "--root", "/run/x", "create", "--bundle", str(b), name],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **self.env}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return b


@pytest.fixture
def node(tmp_path, monkeypatch):
    n = Node(tmp_path)
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(n.config))
    # bootstrap's step finds the low-level runtime on PATH: the recording stand-in, named runc, comes first there
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/runc").symlink_to(n.runc)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    yield n
    stop_editors(n.config)


def test_reinstalls_keep_the_multi_tenant_policy(node):
    node.install(*node.roots)
    assert node.settings()["accept_env_unprivileged"] is True  # a first install: single-tenant, as before
    assert edited(node.start("before"))
    # `gpuprov k8s node` turns env selection off, and an operator points the share state elsewhere
    assert set_setting("accept_env_unprivileged", False) and set_setting("share_state", str(node.base / "share.json"))
    want = node.kept()
    assert want["accept_env_unprivileged"] is False

    again = node.install()  # as the runtime's refusals say to: no options at all
    assert node.kept() == want, node.settings()
    assert not [n for n in again["notes"] if "accept_env_unprivileged" in n], again["notes"]
    node.install(*node.roots)  # with the first install's options
    assert node.settings() == {**want, "runc": str(node.runc), "driver_root": str(H200 / "usr/local/nvidia")}

    # bootstrap's runtime step, applied as bootstrap applies it (its driver root is the only setting it names)
    InstallRuntime(driver_root=str(H200 / "usr/local/nvidia"), prefix=str(node.base / "rt")).execute()
    assert node.kept() == want

    b = node.start("after")  # the pod that sets only NVIDIA_VISIBLE_DEVICES=all: started, with no GPU
    cfg = json.loads((b / "config.json").read_text())
    assert not edited(b) and not cfg["linux"].get("devices"), cfg
    assert any(" create " in f" {c} " for c in runc_calls(node.base))  # handed to runc: a start, not a refusal


def test_a_policy_change_asked_for_is_made_and_said(node):
    node.install(*node.roots, "--no-env-unprivileged")
    assert node.settings()["accept_env_unprivileged"] is False
    doc = node.install("--env-unprivileged")
    assert node.settings()["accept_env_unprivileged"] is True
    assert [n for n in doc["notes"] if n.endswith("accept_env_unprivileged false -> true")], doc["notes"]
