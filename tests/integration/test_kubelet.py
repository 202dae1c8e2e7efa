"""A real kubelet (1.32, built from source by tests/k8s/build.py) standalone, with static pods, on a private
containerd configured by `gpuprov k8s node --default` (handler `nvidia`, gpuprov's runtime, as the default: pods
need no RuntimeClass), against the fake H200 driver root: kubelet's own pod/container creation, its cgroup naming
(cgroupfs: /kubepods/<qos>/pod<uid>/<container id>), its --node-labels, its PodResources API.

What a standalone kubelet cannot show: RuntimeClass admission (a pod's runtimeClassName is resolved through the API
server's RuntimeClass objects; without one kubelet refuses such pods), node registration and scheduling. Those stay
proven through the CRI API (tests/integration/test_k8s_cri.py, tests/cri/). The device plugin (nvidia.com/gpu
through kubelet's device manager) needs NVML, so it runs only on a GPU host (tests/gpu/k8s_kubelet.sh).

kubelet comes from tests/k8s/build.py's cache, else is built from the repository's source subset of the pinned
commit (CI: 6-16 min on 2 cores, once per machine); without either, these tests skip and say why.
Slow (a kubelet and a containerd for the module; about 12 s once kubelet is built)."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import needs

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("containerd", "runc", "unshare", "ip")]
PROBE = ("echo DEV; ls /dev; echo MOUNTS; cat /proc/mounts; echo LIB; "
         "cat /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null || echo NOLIB; echo; echo END; sleep 3600")


def kubelet_binary() -> Path:
    from tests.k8s import build

    got = build.cached(build.KUBELET)
    if got:
        return got
    git_dir = build.source_dir(build.KUBELET, None)
    if git_dir is None:
        pytest.skip(f"no kubelet: it is built from {build.KUBELET.repo} at {build.KUBELET.commit[:12]} "
                    f"(tests/k8s/build.py), and neither its source subset ({build.subset_archive(build.KUBELET).name}) "
                    f"nor a git directory holding it ({build.KUBELET.env}) is here; CI reaches no code host")
    return build.build(build.KUBELET, git_dir)[0]


def h200_labels(tmp: Path) -> dict[str, str]:
    """What `gpuprov k8s labels` computes on the H200 (NVML answered from the host's capture)."""
    from provision.k8s.labels import Sharing, gfd_labels
    from provision.metrics import nvml
    from tests.fake_nvml import FakeNVML

    return gfd_labels(nvml.snapshot(FakeNVML(), kmsg=str(tmp / "none")), Sharing())


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from provision.inject import discover
    from provision.k8s.labels import kubelet_flag
    from tests import k8s_cri
    from tests.cri.harness import Containerd
    from tests.inject_helpers import settings_dict
    from tests.k8s.kubelet import Kubelet

    binary = kubelet_binary()
    base = tmp_path_factory.mktemp("kubelet")
    env = k8s_cri.private_runtime(base)
    c = Containerd(Path(shutil.which("containerd")).parent, env=env)
    res = k8s_cri.k8s_node(c, str(base / "rt/bin/gpuprov-runtime"), env=env, default=True)
    c.start(c.base / "config.toml")
    c.import_image()
    k = Kubelet(binary, c, kubelet_flag(h200_labels(base)))
    try:
        k.start()
        s = settings_dict(base)
        k.disc = discover.discover(s["driver_root"], proc_root=s["proc_root"], dev_root=s["dev_root"])
        k.node_result = res
        yield k
    finally:
        k.stop()
        c.cleanup()


def probe(k, name: str, env: dict[str, str], **spec) -> tuple[str, object]:
    """A static pod running PROBE (then sleeping); its output and its container's CRI status."""
    from tests.cri.client import log_text

    pod = k.static_pod(name, [{"name": "main", "image": "docker.io/gpuprov-test/ctrd-pause:1",
                               "imagePullPolicy": "Never", "command": ["sh", "-c", PROBE],
                               "env": [{"name": n, "value": v} for n, v in env.items()]}], **spec)
    st = k.container(pod, "main")
    deadline = time.monotonic() + 30
    while not log_text(Path(st.status.log_path)).rstrip().endswith("END") and time.monotonic() < deadline:
        time.sleep(0.2)
    return log_text(Path(st.status.log_path)), st


def test_default_handler_from_gpuprov(node):
    assert "default_runtime_name -> nvidia" in str(node.node_result)
    assert "Starting kubelet" in node.log() or "Kubelet version" in node.log()


def test_envvar_static_pod_gets_exactly_the_gpu(node):
    """The device plugin's envvar strategy, as kubelet passes a pod's env: GPU 0's nodes and the driver files."""
    from tests.cri.test_cri_containerd import expected_mounts, extra_mounts, nvidia_nodes
    from tests.inject_helpers import NODES

    env = {"NVIDIA_VISIBLE_DEVICES": "0"}
    out, _ = probe(node, "gpu-env", env)
    assert nvidia_nodes(out) == set(NODES)
    assert set(extra_mounts(out)) == expected_mounts(node.disc, env)
    assert "fake libcuda.so.580.159.04" in out


def test_pod_without_request_gets_nothing(node):
    from tests.cri.test_cri_containerd import extra_mounts, nvidia_nodes

    out, _ = probe(node, "no-gpu", {})
    assert nvidia_nodes(out) == set() and extra_mounts(out) == {}, out


def test_metrics_name_kubelets_pod(node, tmp_path):
    """kubelet's own cgroup path and containerd's CRI annotations for a static pod, read by `gpuprov metrics`'s
    mapping: the pod's process is reported under its pod, namespace and container names; PodResources lists it."""
    from provision.metrics import nvml, prom, usage
    from provision.metrics.containers import ContainerRef
    from tests.k8s.kubelet import NODE, container_pid
    from tests.unit.test_metrics import fake_with, families

    _, st = probe(node, "gpu-env", {"NVIDIA_VISIBLE_DEVICES": "0"})
    pid, cid, pod = container_pid(st), st.status.id, f"gpu-env-{NODE}"
    uid = st.status.labels["io.kubernetes.pod.uid"]
    cg = Path(f"/proc/{pid}/cgroup").read_text()
    assert f"/kubepods/besteffort/pod{uid}/{cid}" in cg  # what kubelet (cgroupfs driver) really writes
    snap = nvml.snapshot(fake_with({pid: 5 << 30}), kmsg=str(tmp_path / "none"))
    [u] = usage.by_container(snap)
    assert u.ref == ContainerRef(cid, "containerd", "main", pod, "gpuprov-test")
    [mem] = families(prom.render(snap, [u], "n"))["container_accelerator_memory_used_bytes"]
    assert (mem.labels["pod"], mem.labels["namespace"], mem.labels["container"], mem.value) == \
        (pod, "gpuprov-test", "main", 5 << 30)
    listed = {(p.namespace, p.name): [c.name for c in p.containers] for p in node.pod_resources().pod_resources}
    assert listed[("gpuprov-test", pod)] == ["main"]


def test_node_labels_reach_kubelets_node(node, tmp_path):
    """`k8s labels --format kubelet` is accepted by kubelet's --node-labels (it refuses labels outside the allowed
    kubernetes.io prefixes) and lands on the node object that standalone kubelet admits pods against: a static pod
    whose nodeSelector names the H200 product runs, one naming another GPU is rejected (NodeAffinity)."""
    labels = h200_labels(tmp_path)
    pod = node.static_pod("on-h200", [{"name": "main", "image": "docker.io/gpuprov-test/ctrd-pause:1",
                                       "imagePullPolicy": "Never", "command": ["sleep", "3600"]}],
                          nodeSelector={"nvidia.com/gpu.product": labels["nvidia.com/gpu.product"],
                                        "nvidia.com/gpu.memory": labels["nvidia.com/gpu.memory"]})
    assert node.container(pod, "main").status.state == node.cri.pb.CONTAINER_RUNNING
    other = node.static_pod("on-a100", [{"name": "main", "image": "docker.io/gpuprov-test/ctrd-pause:1",
                                         "imagePullPolicy": "Never", "command": ["sleep", "3600"]}],
                            nodeSelector={"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"})
    denied = [ln for ln in node.log().splitlines() if '"Pod admission denied"' in ln]
    deadline = time.monotonic() + 30
    while not any(f'pod="gpuprov-test/{other}"' in ln for ln in denied) and time.monotonic() < deadline:
        time.sleep(0.5)
        denied = [ln for ln in node.log().splitlines() if '"Pod admission denied"' in ln]
    assert [ln for ln in denied if f'pod="gpuprov-test/{other}"' in ln and 'reason="NodeAffinity"' in ln]
    assert not [ln for ln in denied if f'pod="gpuprov-test/{pod}"' in ln]
    assert node.sandboxes(other) == []
