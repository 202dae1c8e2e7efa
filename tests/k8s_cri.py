"""The Kubernetes node path, driven as kubelet drives it, shared by the CI test (tests/integration/test_k8s_cri.py,
fake driver root) and the GPU proof (tests/gpu/k8s_proof.py, real H200s): a private containerd (tests/cri harness)
configured by `gpuprov k8s node` (handler `nvidia` as a drop-in), pods with `runtime_handler: nvidia` created through
the CRI gRPC API (tests/cri client), each container's real host PID taken from the CRI's verbose status."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from provision.engines.validate import glibc_companions
from tests.cri import image
from tests.cri.client import CRI
from tests.cri.harness import Containerd
from tests.inject_helpers import settings_dict

NAMESPACE = "gpuprov-test"


def base_config(c: Containerd) -> str:
    """A containerd config of the operator's (own root/state/socket; no CNI: pods use the host network)."""
    b = c.base
    return (f'version = 2\nroot = "{b}/root"\nstate = "{b}/state"\n[grpc]\n  address = "{c.socket}"\n'
            f'[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "{image.NAME}"\n'
            "  restrict_oom_score_adj = true\n"  # these machines lack CAP_SYS_RESOURCE
            f'  [plugins."io.containerd.grpc.v1.cri".cni]\n    bin_dir = "{b}/cni/bin"\n    conf_dir = "{b}/cni/conf"\n'
            '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n    runtime_type = "io.containerd.runc.v2"\n'
            '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n    SystemdCgroup = false\n')


def gpuprov(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "provision", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def private_runtime(base: Path, driver_root: Path | None = None) -> dict:
    """gpuprov's runtime installed under `base` (its own settings, prefix and discovery cache; the host's are never
    touched) for the fake driver root of tests/inject_helpers.py (or `driver_root`, a copy of it). Returns the env
    that points gpuprov at it."""
    s = {**settings_dict(base), **({"driver_root": str(driver_root)} if driver_root else {})}
    env = {"GPUPROV_RUNTIME_CONFIG": str(base / "runtime.json")}
    r = gpuprov("runtime", "install", "--prefix", str(base / "rt"), "--driver-root", s["driver_root"],
                "--dev-root", s["dev_root"], "--proc-root", s["proc_root"], "--json", env=env)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((base / "runtime.json").read_text())
    (base / "runtime.json").write_text(json.dumps({**cfg, "cache": str(base / "discovery.json")}))
    return env


def k8s_node(c: Containerd, runtime_path: str, env: dict | None = None, cdi: bool = False,
             default: bool = False, accept_env: bool = True) -> dict:
    """`gpuprov k8s node` on this containerd. accept_env: these harnesses have no device plugin (pods ask with
    NVIDIA_VISIBLE_DEVICES), so they keep env selection on (`--accept-env-unprivileged`), which k8s node turns off
    by default since issue 26."""
    cfg = c.base / "config.toml"
    cfg.write_text(base_config(c))
    r = gpuprov("k8s", "node", "--engine", "containerd", "--config", str(cfg), "--runtime-path", runtime_path,
                "--cdi" if cdi else "--no-cdi", *(["--default"] if default else []),
                *(["--accept-env-unprivileged"] if accept_env else []), "--yes", "--json", env=env)
    if r.returncode != 0:
        raise RuntimeError(f"gpuprov k8s node failed ({r.returncode}): {r.stderr}")
    return json.loads(r.stdout)


class Pods:
    """Pods with one container each, kubelet-style: sandbox through handler `nvidia`, container, start."""

    def __init__(self, c: Containerd):
        self.c, self.cri, self.pods = c, CRI(c.socket), []

    def run(self, name: str, command: list[str], env: dict[str, str], img: str = image.NAME) -> tuple[str, int]:
        pb = self.cri.pb
        cfg = self.cri.pod_config(name, str(self.c.base / "logs"))
        # kubelet with the cgroupfs driver puts each pod under kubepods/<qos>/pod<uid>
        cfg.linux.cgroup_parent = f"/kubepods/besteffort/pod{cfg.metadata.uid}"
        pod = self.cri.run_pod(cfg, "nvidia")
        self.pods.append(pod)
        cid = self.cri.create(pod, cfg, name=f"{name}-ctr", image=img, command=command, env=env)
        self.cri.start(cid)
        st = self.cri.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid, verbose=True),
                                              timeout=self.cri.timeout)
        return cid, int(json.loads(st.info["info"])["pid"])

    def log(self, name: str) -> str:
        p = self.c.base / "logs" / f"{name}-ctr.log"
        if not p.exists():
            return ""
        out = []  # CRI log lines: `<time> <stream> <P|F> <text>` (read as bytes: programs may print any)
        for line in p.read_bytes().decode(errors="replace").splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4:
                out.append(parts[3] + ("\n" if parts[2] == "F" else ""))
        return "".join(out)

    def close(self) -> None:
        for p in self.pods:
            try:
                self.cri.remove_pod(p)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self.cri.close()


def workload_image(c: Containerd, extra: dict[str, str]) -> str:
    """The harness's image plus named host programs (with the C libraries they load) at /bin/<name>."""
    name = "docker.io/gpuprov-test/k8s-workload:1"
    saved, saved_libs = image.BINARIES, image._libs

    def libs(binary: str) -> list[str]:
        # glibc's companions that the injected driver libraries load (libcuda: libm, libdl, libpthread, librt),
        # as any distribution's base image has them
        return saved_libs(binary) + glibc_companions(saved_libs(binary))

    try:
        image.BINARIES, image._libs = saved + tuple(extra), libs
        tar = c.base / "workload.tar"
        tar.write_bytes(image.oci_archive(name))
    finally:
        image.BINARIES, image._libs = saved, saved_libs
    c.ctr("images", "import", str(tar))
    return name
