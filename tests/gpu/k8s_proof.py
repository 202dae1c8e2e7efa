"""GPU proof of the Kubernetes node path (run on a lent host with 2+ GPUs by tests/gpu/k8s_proof.sh; results in
$OUT/k8s-proof.json): Debian's containerd + `gpuprov k8s node` (handler `nvidia` drop-in) + the CRI client start a
pod whose container sees exactly GPU 1 and runs a CUDA program; `gpuprov metrics`, taken meanwhile, attributes the
program's GPU memory to that container; under MPS (`gpuprov share enable`) two pods' memory is attributed to each,
and `gpuprov share status` says the same."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests import k8s_cri
from tests.cri.harness import Containerd

OUT = Path(os.environ.get("OUT", "/tmp/k8s-proof"))
RESULT: dict = {}


def save() -> None:
    (OUT / "k8s-proof.json").write_text(json.dumps(RESULT, indent=2))


def metrics(tag: str) -> dict:
    """`gpuprov metrics` as the CLI runs it; per-container memory (MiB) by container ID."""
    t0 = time.monotonic()
    r = k8s_cri.gpuprov("metrics")
    RESULT[f"metrics_{tag}_ms"] = round((time.monotonic() - t0) * 1000)
    (OUT / f"metrics-{tag}.prom").write_text(r.stdout + r.stderr)
    fam = {f.name: f.samples for f in text_string_to_metric_families(r.stdout)}
    return {s.labels["id"]: {"mib": s.value / 2**20, "gpu_uuid": s.labels["acc_id"], "container": s.labels["container"],
                             "pod": s.labels["pod"], "namespace": s.labels["namespace"]}
            for s in fam.get("container_accelerator_memory_used_bytes", [])}


def wait_for(pods, name: str, text: str, within: float = 60) -> str:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        log = pods.log(name)
        if text in log or "failed" in log:
            return log
        time.sleep(0.5)
    return pods.log(name)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines()
    RESULT["host_gpus"] = smi
    uuid1 = smi[1].split("UUID: ")[1].rstrip(")")
    env = {"GPUPROV_RUNTIME_CONFIG": "/tmp/rt/runtime.json"}
    r = k8s_cri.gpuprov("runtime", "install", "--prefix", "/tmp/rt", "--json", env=env)
    RESULT["runtime_install"] = r.stdout[-400:] or r.stderr[-400:]
    os.environ.update(env)
    c = Containerd(Path(os.environ.get("CKIT", "/tmp/ckit/usr/bin")), env=env)
    RESULT["containerd"] = c.version()
    node = k8s_cri.k8s_node(c, "/tmp/rt/bin/gpuprov-runtime", env=env, cdi=True)
    RESULT["k8s_node"] = {k: node[k] for k in ("changed", "cdi_spec", "labels_file")}
    RESULT["labels"] = node["labels"]
    dump = subprocess.run([c.binary, "--config", str(c.base / "config.toml"), "config", "dump"], capture_output=True,
                          text=True).stdout
    (OUT / "containerd-dump.toml").write_text(dump)
    RESULT["dump_has_nvidia_handler"] = 'runtimes.nvidia]' in dump and "/tmp/rt/bin/gpuprov-runtime" in dump
    save()
    # the CUDA program, built here, shipped in the image with the C libraries it loads (libcuda comes from the runtime)
    b = subprocess.run(["nvcc", "-O2", "-o", "/usr/local/bin/gpuprov-hold", str(Path(__file__).with_name("hold.cu")),
                        "-Xcompiler", "-static-libgcc", "-Xcompiler", "-static-libstdc++"], capture_output=True, text=True)
    RESULT["nvcc"] = b.returncode
    c.start(c.base / "config.toml")
    c.import_image()
    img = k8s_cri.workload_image(c, {"gpuprov-hold": ""})
    pods = k8s_cri.Pods(c)
    gpu = {"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility", "PATH": "/bin:/usr/bin"}
    try:
        cid, pid = pods.run("single", ["sh", "-c", "nvidia-smi -L; gpuprov-hold 3000 30"], gpu, img)
        log = wait_for(pods, "single", "holding")
        m = metrics("single")
        RESULT["single"] = {"container_id": cid, "pid": pid, "log": log, "metrics": m.get(cid),
                            "sees_only_gpu1": log.count("GPU ") == 1 and uuid1 in log,
                            "attributed_to_gpu1": (m.get(cid) or {}).get("gpu_uuid") == uuid1}
        save()
        r = k8s_cri.gpuprov("share", "enable", "--gpus", "1", "--keep-compute-mode", "--json")  # a lent GPU
        RESULT["share_enable"] = r.returncode
        b_id, _ = pods.run("mps-b", ["gpuprov-hold", "1000", "30"], {**gpu, "GPUPROV_GPU_MEMORY": "4G"}, img)
        c_id, _ = pods.run("mps-c", ["gpuprov-hold", "2000", "30"], {**gpu, "GPUPROV_GPU_MEMORY": "6G"}, img)
        logs = {n: wait_for(pods, n, "holding") for n in ("mps-b", "mps-c")}
        m = metrics("mps")
        st = json.loads(k8s_cri.gpuprov("share", "status", "--json").stdout or "{}")
        (OUT / "share-status.json").write_text(json.dumps(st, indent=2))
        RESULT["mps"] = {"logs": logs, "metrics": {k: m.get(k) for k in (b_id, c_id)},
                         "share_status": {cl["container"]: cl["memory_used_mib"] for cl in st.get("clients", [])},
                         "ids": {"mps-b": b_id, "mps-c": c_id}}
        save()
    finally:
        pods.close()
        k8s_cri.gpuprov("share", "disable")
        c.cleanup()
        save()
    print(json.dumps(RESULT, indent=2))


if __name__ == "__main__":
    sys.exit(main())
