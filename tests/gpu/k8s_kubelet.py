"""GPU proof of the Kubernetes product path (run on a lent GPU host by tests/gpu/k8s_kubelet.sh; results in
$OUT/k8s-kubelet.json): a real kubelet (standalone, static pods; tests/k8s/kubelet.py) on Debian's containerd
configured by `gpuprov k8s node --default`, NVIDIA's k8s-device-plugin (built from source, run on the host as its
DaemonSet would run it, with the config `gpuprov k8s manifests` wrote) registering nvidia.com/gpu with kubelet.
A static pod asking for nvidia.com/gpu: 1 sees exactly the GPU kubelet allocated (read back through PodResources),
runs a CUDA program, and `gpuprov metrics` reports its memory under the pod's labels. Then with `gpuprov share`
on, the plugin's timeSlicing replicas let two pods share one GPU, each held to its own MPS memory cap. Last, a
multi-tenant node (`runtime install --no-env-unprivileged`, so `k8s manifests` picks the volume-mounts strategy): each
pod asking for one GPU sees exactly the one kubelet allocated (two pods, two different GPUs on a host with two or
more), and a pod asking for none but setting NVIDIA_VISIBLE_DEVICES=all sees no GPU."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests import k8s_cri
from tests.cri.client import CRI, log_text
from tests.cri.harness import Containerd
from tests.k8s.kubelet import NODE, Kubelet

OUT = Path(os.environ.get("OUT", "/tmp/k8s-kubelet"))
KIT = Path(os.environ.get("KIT", "/tmp/kkit/bin"))
RESULT: dict = {}
ENV = {"GPUPROV_RUNTIME_CONFIG": "/tmp/rt/runtime.json"}
CAPS = [{"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"}, {"name": "PATH", "value": "/bin:/usr/bin"}]


def save() -> None:
    (OUT / "k8s-kubelet.json").write_text(json.dumps(RESULT, indent=2, default=str))


def metrics(tag: str) -> dict:
    r = k8s_cri.gpuprov("metrics")
    (OUT / f"metrics-{tag}.prom").write_text(r.stdout + r.stderr)
    fam = {f.name: f.samples for f in text_string_to_metric_families(r.stdout)}
    return {s.labels["id"]: {"mib": s.value / 2**20, **{k: s.labels[k] for k in ("acc_id", "container", "pod",
                                                                                   "namespace")}}
            for s in fam.get("container_accelerator_memory_used_bytes", [])}


class Plugin:
    """NVIDIA's device plugin as a host process (its DaemonSet runs the same binary with the same config file and
    /var/lib/kubelet/device-plugins mounted)."""

    def __init__(self, k: Kubelet, config: Path, driver_root: str):
        self.k, self.config, self.driver_root, self.proc = k, config, driver_root, None

    def start(self, tag: str, replicas: bool = False) -> list[str]:
        """Starts it; the device IDs kubelet then holds for nvidia.com/gpu (once they are the plugin's: replicas are
        `<uuid>::<n>`)."""
        log = open(OUT / f"device-plugin-{tag}.log", "wb")
        lib = ":".join(str(Path(self.driver_root) / d) for d in ("lib64", "lib", "lib/x86_64-linux-gnu"))
        self.proc = subprocess.Popen([str(KIT / "nvidia-device-plugin"), "--config-file", str(self.config),
                                      "--kubelet-socket", str(self.k.device_plugin_dir / "kubelet.sock")],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = [d for r in self.k.allocatable().devices if r.resource_name == "nvidia.com/gpu" for d in r.device_ids]
            if got and (not replicas or all("::" in d for d in got)):
                return got
            time.sleep(1)
        return []

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)


def gpu_pod(k: Kubelet, img: str, name: str, cmd: str, env: list[dict] | None = None) -> str:
    return k.static_pod(name, [{"name": "main", "image": img, "imagePullPolicy": "Never", "command": ["sh", "-c", cmd],
                                "env": CAPS + (env or []), "resources": {"limits": {"nvidia.com/gpu": "1"}}}])


def wait_log(k: Kubelet, pod: str, text: str, within: float = 60) -> tuple[str, object]:
    st = k.container(pod, "main", within=within)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        out = log_text(Path(st.status.log_path)) if Path(st.status.log_path).exists() else ""
        if text in out or "failed" in out or "rror" in out:
            return out, st
        time.sleep(0.5)
    return log_text(Path(st.status.log_path)), st


def allocated(k: Kubelet, pod: str) -> list[str]:
    for p in k.pod_resources().pod_resources:
        if p.name == pod:
            return [i for c in p.containers for d in c.devices if d.resource_name == "nvidia.com/gpu" for i in d.device_ids]
    return []


def single(k: Kubelet, img: str, uuids: list[str]) -> None:
    pod = gpu_pod(k, img, "cuda", "nvidia-smi -L; gpuprov-hold 3000 40")
    log, st = wait_log(k, pod, "holding")
    ids = allocated(k, pod)
    m = metrics("single").get(st.status.id) or {}
    seen = [ln.split("UUID: ")[1].rstrip(")") for ln in log.splitlines() if "UUID: " in ln]
    RESULT["single"] = {"pod": pod, "log": log, "podresources_devices": ids, "uuids_seen_in_pod": seen,
                        "metrics": m, "sees_exactly_the_allocated_gpu": seen == ids and len(ids) == 1,
                        "metrics_labels_ok": (m.get("pod"), m.get("namespace"), m.get("container"), m.get("acc_id"))
                        == (pod, "gpuprov-test", "main", ids[0] if ids else None),
                        "host_gpus": uuids}
    save()


def shared(k: Kubelet, img: str, plugin: Plugin) -> None:
    r = k8s_cri.gpuprov("share", "enable", "--max-clients", "4", "--keep-compute-mode", "--json")
    RESULT["share_enable"] = {"rc": r.returncode, "out": (r.stdout + r.stderr)[-600:]}
    man = OUT / "manifests-shared"
    r = k8s_cri.gpuprov("k8s", "manifests", "--output", str(man))
    RESULT["manifests_shared_rc"] = r.returncode
    RESULT["plugin_config_shared"] = (man / "device-plugin-config.yaml").read_text()
    plugin.stop()
    plugin.config = man / "device-plugin-config.yaml"
    time.sleep(2)
    RESULT["allocatable_shared"] = plugin.start("shared", replicas=True)
    save()
    a = gpu_pod(k, img, "mps-a", "gpuprov-hold 3000 40", [{"name": "GPUPROV_GPU_MEMORY", "value": "4G"}])
    b = gpu_pod(k, img, "mps-b", "gpuprov-hold 6000 40", [{"name": "GPUPROV_GPU_MEMORY", "value": "4G"}])
    c = gpu_pod(k, img, "mps-c", "gpuprov-hold 2000 40", [{"name": "GPUPROV_GPU_MEMORY", "value": "6G"}])
    logs = {n: wait_log(k, n, "holding" if n != b else "cudaMalloc") for n in (a, b, c)}
    m = metrics("shared")
    st = json.loads(k8s_cri.gpuprov("share", "status", "--json").stdout or "{}")
    RESULT["shared"] = {n: {"log": lg, "podresources_devices": allocated(k, n), "metrics": m.get(s.status.id)}
                        for n, (lg, s) in logs.items()}
    RESULT["share_status_clients"] = st.get("clients")
    save()


def fresh_kubelet(k: Kubelet, pods: list[str]) -> None:
    """A standalone kubelet (no API server) never frees a finished pod's devices: its device manager waits until every
    pod source is ready, and the API server's never is ("skipping delete because sources aren't ready yet"). The
    multi-tenant pods need both GPUs, so kubelet is stopped with its pods, the earlier pods' manifests and its device
    checkpoint are removed, and it starts again (containerd, its config and the runtime stay)."""
    k.stop()
    for pod in pods:
        (k.base / "manifests" / f"{pod.removesuffix(f'-{NODE}')}.yaml").unlink(missing_ok=True)
    (k.device_plugin_dir / "kubelet_internal_checkpoint").unlink(missing_ok=True)
    k.cri = CRI(k.ctrd.socket)
    k.start()


def plain_pod(k: Kubelet, img: str, name: str, cmd: str, env: list[dict]) -> str:
    """A pod that asks for no GPU."""
    return k.static_pod(name, [{"name": "main", "image": img, "imagePullPolicy": "Never", "command": ["sh", "-c", cmd],
                                "env": CAPS + env}])


def multi_tenant(k: Kubelet, img: str, plugin: Plugin, uuids: list[str], earlier: list[str]) -> None:
    plugin.stop()
    fresh_kubelet(k, earlier)
    k8s_cri.gpuprov("share", "disable")
    r = k8s_cri.gpuprov("runtime", "install", "--prefix", "/tmp/rt", "--no-env-unprivileged", "--json")
    man = OUT / "manifests-multitenant"
    m = k8s_cri.gpuprov("k8s", "manifests", "--output", str(man))
    RESULT["multitenant_setup"] = {"install_rc": r.returncode, "manifests_rc": m.returncode,
                                   "plugin_config": (man / "device-plugin-config.yaml").read_text()}
    plugin.config = man / "device-plugin-config.yaml"
    time.sleep(2)
    RESULT["allocatable_multitenant"] = plugin.start("multitenant")
    save()
    smi = "nvidia-smi -L; gpuprov-hold 1000 20"
    asking = [gpu_pod(k, img, f"mt-{c}", smi) for c in "ab"[:min(2, len(uuids))]]
    none = plain_pod(k, img, "mt-none", "ls -1 /dev; nvidia-smi -L 2>&1; echo done",
                     [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])
    logs = {n: wait_log(k, n, "holding" if n != none else "done") for n in (*asking, none)}
    pods = {}
    for n, (lg, _) in logs.items():
        seen = [ln.split("UUID: ")[1].rstrip(")") for ln in lg.splitlines() if "UUID: " in ln]
        pods[n] = {"log": lg, "podresources_devices": allocated(k, n), "uuids_seen_in_pod": seen}
    mine = [pods[n] for n in asking]
    RESULT["multitenant"] = {
        "pods": pods, "host_gpus": uuids,
        "each_sees_exactly_its_gpu": all(p["uuids_seen_in_pod"] == p["podresources_devices"] and
                                         len(p["podresources_devices"]) == 1 for p in mine),
        "different_gpus": len({d for p in mine for d in p["podresources_devices"]}) == len(mine),
        "no_request_sees_no_gpu": pods[none]["uuids_seen_in_pod"] == [] and "done" in pods[none]["log"] and
        not [ln for ln in pods[none]["log"].splitlines() if ln.startswith("nvidia")],  # ls -1 /dev: no nvidia* node
    }
    save()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    os.environ.update(ENV)
    uuids = [ln.split("UUID: ")[1].rstrip(")") for ln in
             subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines()]
    r = k8s_cri.gpuprov("runtime", "install", "--prefix", "/tmp/rt", "--json")
    RESULT["runtime_install_rc"] = r.returncode
    driver_root = json.loads(Path(ENV["GPUPROV_RUNTIME_CONFIG"]).read_text()).get("driver_root", "/")
    b = subprocess.run(["nvcc", "-O2", "-o", "/usr/local/bin/gpuprov-hold", "tests/gpu/hold.cu", "-Xcompiler",
                        "-static-libgcc", "-Xcompiler", "-static-libstdc++"], capture_output=True, text=True)
    RESULT["nvcc"] = b.returncode
    c = Containerd(KIT, env=ENV)
    RESULT["containerd"] = c.version()
    RESULT["k8s_node"] = k8s_cri.k8s_node(c, "/tmp/rt/bin/gpuprov-runtime", env=ENV, default=True)["changed"]
    c.start(c.base / "config.toml")
    c.import_image()
    img = k8s_cri.workload_image(c, {"gpuprov-hold": ""})
    labels = k8s_cri.gpuprov("k8s", "labels", "--format", "kubelet").stdout.strip()
    RESULT["node_labels"] = labels
    man = OUT / "manifests"
    RESULT["manifests_rc"] = k8s_cri.gpuprov("k8s", "manifests", "--output", str(man)).returncode
    RESULT["plugin_config"] = (man / "device-plugin-config.yaml").read_text()
    k = Kubelet(KIT / "kubelet", c, labels, root_dir=Path("/var/lib/kubelet"))
    plugin = Plugin(k, man / "device-plugin-config.yaml", driver_root)
    try:
        t0 = time.monotonic()
        k.start()
        RESULT["kubelet_start_s"] = round(time.monotonic() - t0, 1)
        RESULT["allocatable"] = plugin.start("single")
        save()
        earlier = [f"{n}-{NODE}" for n in ("cuda", "mps-a", "mps-b", "mps-c")]
        for step in (lambda: single(k, img, uuids), lambda: shared(k, img, plugin),
                     lambda: multi_tenant(k, img, plugin, uuids, earlier)):
            try:
                step()
            except Exception:  # noqa: BLE001 - record and go on to the next proof
                RESULT.setdefault("errors", []).append(traceback.format_exc()[-1500:])
                save()
    finally:
        (OUT / "kubelet.log").write_text(k.log()[-200000:] if (k.base / "kubelet.log").exists() else "")
        plugin.stop()
        k.stop()
        k8s_cri.gpuprov("share", "disable")
        c.cleanup()
        save()
    print(json.dumps(RESULT, indent=2, default=str)[-6000:])


if __name__ == "__main__":
    sys.exit(main())
