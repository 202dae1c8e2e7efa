"""Kubernetes node path in CI: bookworm's containerd 1.6, private (tests/cri harness), configured by
`gpuprov k8s node`; a pod through handler `nvidia` (gpuprov-runtime, fake driver root from the H200 capture) created
over the CRI gRPC API as kubelet would; the container's real process is mapped by gpuprov's process->container code
to the pod, namespace and container names that `gpuprov metrics` puts on container_accelerator_*."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import needs

pytestmark = [pytest.mark.integration, needs("containerd", "runc")]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from tests import k8s_cri
    from tests.cri.harness import Containerd

    base = tmp_path_factory.mktemp("k8snode")
    env = k8s_cri.private_runtime(base)
    c = Containerd(Path(shutil.which("containerd")).parent, env=env)
    res = k8s_cri.k8s_node(c, str(base / "rt/bin/gpuprov-runtime"), env=env)
    c.start(c.base / "config.toml")
    c.import_image()
    pods = k8s_cri.Pods(c)
    yield c, pods, res
    pods.close()
    c.cleanup()


def test_handler_from_gpuprov_dropin(node):
    c, _, res = node
    assert any(ch.startswith("containerd: ") for ch in res["changed"])
    dump = c.ctr("version")  # containerd answers with gpuprov's drop-in loaded
    assert dump.returncode == 0


def test_cri_pod_through_handler_mapped_to_its_names(node):
    from provision.metrics.containers import ContainerRef, container_of

    _, pods, _ = node
    cid, pid = pods.run("gpu-job", ["sh", "-c", "ls /dev; sleep 60"], {"NVIDIA_VISIBLE_DEVICES": "0"})
    ref = container_of(pid)
    assert ref == ContainerRef(cid, "containerd", "gpu-job-ctr", "gpu-job", "gpuprov-test")
    cg = Path(f"/proc/{pid}/cgroup").read_text()
    assert "/kubepods/besteffort/pod" in cg and cid in cg  # kubelet's layout, as the mapping expects
    import time

    for _ in range(50):
        if "nvidia0" in pods.log("gpu-job"):
            break
        time.sleep(0.1)
    assert "nvidia0" in pods.log("gpu-job").split()  # the runtime behind handler `nvidia` injected GPU 0's node


@pytest.mark.parametrize("which, has_cdi", [("bookworm", False), ("sid", True)])
def test_cdi_annotations_only_where_the_engine_applies_them(which, has_cdi, tmp_path, monkeypatch):
    """The device plugin's CDI-annotations strategy is offered only when the node's real containerd applies CDI
    (1.7+): on bookworm's 1.6 the key is ignored and pods would get no GPU, so it is refused there."""
    from provision.errors import UsageError
    from provision.k8s import manifests, node
    from tests.cri.harness import newer_containerd

    bindir = Path("/usr/bin") if which == "bookworm" else newer_containerd(which)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    assert node.engine_has_cdi("containerd") is has_cdi
    settings = manifests.NodeSettings(share_state=None, accept_env_unprivileged=True,
                                      engine_cdi=node.engine_has_cdi("containerd"), driver_root="/")
    if has_cdi:
        assert manifests.decide_strategy(settings, "cdi-annotations") == "cdi-annotations"
    else:
        with pytest.raises(UsageError, match="CDI is not enabled"):
            manifests.decide_strategy(settings, "cdi-annotations")
