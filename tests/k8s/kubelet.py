"""A standalone kubelet for tests: the real binary (tests/k8s/build.py), no API server, static pods from a manifest
directory, a private containerd (tests/cri harness) as its CRI runtime, its own root, logs and PodResources socket.

It runs in its own mount and network namespaces (`unshare`), so that what kubelet does to a node stays in the test:
it sets kernel sysctls at start (vm.overcommit_memory=1, kernel.panic=10, kernel.panic_on_oops=1 … and fails if it
cannot), which here would change the shared machine's kernel: each is a bind-mounted file holding the value kubelet
wants, in kubelet's mount namespace only. Its iptables chains land in its own network namespace. Pods use the host
network (containerd creates them; no CNI here), so kubelet's namespace is not theirs."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import yaml

from tests.cri.client import CRI, proto_stubs
from tests.cri.harness import Containerd

NODE = "gpuprov-node"
PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
# Host paths kubelet writes whatever its --root-dir says (its device manager's sockets, the container log links),
# each given a directory of the test's own in kubelet's mount namespace.
FIXED_DIRS = {PLUGIN_DIR: "device-plugins", "/var/log/containers": "container-logs"}
PROTO = Path(__file__).with_name("podresources.proto")
# kubelet's containerManager setupKernelTunables: the values it sets (pkg/kubelet/cm/container_manager_linux.go)
SYSCTLS = {"vm/overcommit_memory": "1", "vm/panic_on_oom": "0", "kernel/panic": "10", "kernel/panic_on_oops": "1",
           "kernel/keys/root_maxkeys": "1000000", "kernel/keys/root_maxbytes": "25000000"}
_STUBS: tuple | None = None


def podresources_stubs() -> tuple:
    global _STUBS
    if _STUBS is None:
        _STUBS = proto_stubs(PROTO)
    return _STUBS


def config(base: Path, socket: str, **extra) -> dict:
    """KubeletConfiguration for a standalone node: static pods, cgroupfs (this machine's cgroup v1), no
    authentication webhook (no API server), eviction and image GC off (a test node must not evict or delete)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "staticPodPath": str(base / "manifests"), "fileCheckFrequency": "1s", "syncFrequency": "5s",
        "containerRuntimeEndpoint": f"unix://{socket}", "cgroupDriver": "cgroupfs", "failSwapOn": False,
        "address": "127.0.0.1", "healthzBindAddress": "127.0.0.1", "readOnlyPort": 0,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"}, "podLogsDir": str(base / "pod-logs"),
        "evictionHard": {"memory.available": "0%", "nodefs.available": "0%", "imagefs.available": "0%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "localStorageCapacityIsolation": False, "resolvConf": "",
        # upstream serves PodResources always; KubeEdge's fork only behind this (alpha, off) gate of its own
        "featureGates": {"KubeletPodResources": True}, **extra}


class Kubelet:
    def __init__(self, binary: Path, ctrd: Containerd, node_labels: str = "", root_dir: Path | None = None,
                 **extra_config):
        """`root_dir`: kubelet's --root-dir (default: under the containerd's base). NVIDIA's device plugin puts its
        socket in /var/lib/kubelet/device-plugins whatever kubelet's root is, so a node with it needs the default."""
        self.binary, self.ctrd = binary, ctrd
        self.base = ctrd.base / "kubelet"
        self.root = root_dir or self.base / "root"
        self.made_dirs: list[Path] = []  # host directories made as mount points (removed at stop)
        # a host without `ip` (the lent GPU hosts: no iptables either) cannot bring up a namespace's loopback
        self.private_net = shutil.which("ip") is not None
        for d in ("manifests", "pod-logs", "sysctl", *FIXED_DIRS.values()):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.base / "config.yaml").write_text(yaml.safe_dump(config(self.base, ctrd.socket, **extra_config)))
        self.node_labels = node_labels
        self.proc: subprocess.Popen | None = None
        self.cri = CRI(ctrd.socket)

    @property
    def podresources_socket(self) -> Path:
        return self.root / "pod-resources/kubelet.sock"

    @property
    def device_plugin_dir(self) -> Path:
        return Path(PLUGIN_DIR) if self.root == Path(PLUGIN_DIR).parent else self.base / "device-plugins"

    def _wrapper(self) -> str:
        binds = "".join(f"echo {v} > {self.base}/sysctl/{k.replace('/', '.')} && mount --bind "
                        f"{self.base}/sysctl/{k.replace('/', '.')} /proc/sys/{k} && " for k, v in SYSCTLS.items())
        binds += "".join(f"mount --bind {self.base}/{mine} {host} && " for host, mine in self._private_dirs().items())
        return f"{'ip link set lo up && ' if self.private_net else ''}{binds}exec \"$@\""

    def _private_dirs(self) -> dict[str, str]:
        """FIXED_DIRS, less the device-plugin directory where kubelet's root is the default one (a GPU host: NVIDIA's
        device plugin, outside kubelet's namespace, must find kubelet's socket there)."""
        shared = self.root == Path(PLUGIN_DIR).parent
        return {h: m for h, m in FIXED_DIRS.items() if not (shared and h == PLUGIN_DIR)}

    def _mount_points(self) -> None:
        for host in self._private_dirs():
            missing = [d for d in (Path(host), *Path(host).parents) if not d.exists()]
            for d in reversed(missing):
                d.mkdir()
                self.made_dirs.insert(0, d)

    def start(self, within: float = 120) -> None:
        self._mount_points()
        # --v=3: kubelet's events (an admission refusal) are logged
        args = [str(self.binary), f"--config={self.base}/config.yaml", f"--root-dir={self.root}",
                f"--cert-dir={self.base}/pki", f"--hostname-override={NODE}", "--node-ip=127.0.0.1", "--v=3"]
        if self.node_labels:
            args.append(self.node_labels)
        log = open(self.base / "kubelet.log", "ab")
        self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "slave",
                                      *(["--net"] if self.private_net else []), "sh", "-c", self._wrapper(),
                                      "kubelet", *args], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env={**os.environ, "PATH": self.ctrd.path_env})
        log.close()
        deadline = time.monotonic() + within
        while not self.podresources_socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kubelet did not start (exit {self.proc.poll()}):\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.base / "kubelet.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def log(self) -> str:
        return (self.base / "kubelet.log").read_text(errors="replace")

    def static_pod(self, name: str, containers: list[dict], namespace: str = "gpuprov-test", **spec) -> str:
        """Writes a static pod manifest (atomically: kubelet polls the directory); returns the pod's name as kubelet
        runs it (`<name>-<node>`)."""
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
               "spec": {"hostNetwork": True, "restartPolicy": "Never", "containers": containers, **spec}}
        tmp = self.base / f".{name}.yaml"
        tmp.write_text(yaml.safe_dump(pod))
        os.replace(tmp, self.base / "manifests" / f"{name}.yaml")
        return f"{name}-{NODE}"

    def container(self, pod: str, name: str, within: float = 90):
        """The CRI container `name` of pod `pod` once it runs (or has run): its ContainerStatus (verbose)."""
        pb = self.cri.pb
        flt = pb.ContainerFilter(label_selector={"io.kubernetes.pod.name": pod, "io.kubernetes.container.name": name})
        deadline = time.monotonic() + within
        while True:
            found = self.cri.runtime.ListContainers(pb.ListContainersRequest(filter=flt), timeout=self.cri.timeout)
            for c in found.containers:
                st = self.cri.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=c.id, verbose=True),
                                                      timeout=self.cri.timeout)
                if st.status.state != pb.CONTAINER_CREATED:
                    return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"no running container {name} of pod {pod}:\n{self.log_tail()}")
            time.sleep(0.5)

    def sandboxes(self, pod: str) -> list:
        pb = self.cri.pb
        flt = pb.PodSandboxFilter(label_selector={"io.kubernetes.pod.name": pod})
        return list(self.cri.runtime.ListPodSandbox(pb.ListPodSandboxRequest(filter=flt),
                                                    timeout=self.cri.timeout).items)

    def pod_resources(self):
        """kubelet's PodResources API (v1 List): what a monitoring agent on the node reads."""
        return self._podresources("List", "ListPodResourcesRequest")

    def allocatable(self):
        """PodResources v1 GetAllocatableResources: the devices kubelet's device manager holds (from plugins)."""
        return self._podresources("GetAllocatableResources", "AllocatableResourcesRequest")

    def _podresources(self, rpc: str, request: str):
        import grpc

        pb, grpc_mod = podresources_stubs()
        with grpc.insecure_channel(f"unix://{self.podresources_socket}") as ch:
            return getattr(grpc_mod.PodResourcesListerStub(ch), rpc)(getattr(pb, request)(), timeout=30)

    def stop(self) -> None:
        """kubelet first (it would restart what is removed), then every pod it started (their containers go with
        them), through the CRI."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        pb = self.cri.pb
        uids = []
        for p in self.cri.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=self.cri.timeout).items:
            uids.append(p.metadata.uid)
            try:
                self.cri.remove_pod(p.id)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self.cri.close()
        remove_pod_cgroups(uids)
        # kubelet's QoS cgroups (kubepods/…) stay as on any node it ran on: empty, and the next kubelet reuses them.
        shutil.rmtree(self.root / "pods", ignore_errors=True)
        for d in self.made_dirs:
            try:
                d.rmdir()
            except OSError:
                pass


def remove_pod_cgroups(uids: list[str]) -> None:
    """The pod cgroups kubelet made (cgroupfs driver: kubepods[/<qos>]/pod<uid>, in every hierarchy), now empty:
    kubelet removes them itself only while it runs, and it was stopped first."""
    root = Path("/sys/fs/cgroup")
    for top in (root, *root.iterdir()):  # cgroup v2 (the root), or each v1 hierarchy
        for qos in ("", "besteffort/", "burstable/"):
            for uid in uids:
                pod = top / f"kubepods/{qos}pod{uid}"
                for d in [*(c for c in pod.glob("*") if c.is_dir()), pod] if pod.is_dir() else []:
                    try:
                        d.rmdir()  # empty: their processes are gone with the pod
                    except OSError:
                        pass


def container_pid(status) -> int:
    return int(json.loads(status.info["info"])["pid"])
