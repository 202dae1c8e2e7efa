"""Prometheus text exposition format (version 0.0.4) of a snapshot.

Per GPU: DCGM-exporter's names and labels (`DCGM_FI_DEV_*{gpu, UUID, pci_bus_id, device, modelName, hostname}`,
memory in MiB, power in W, as NVIDIA/dcgm-exporter's etc/default-counters.csv defines them), so its dashboards and
alerts work unchanged. Per container: cAdvisor's `container_accelerator_*` (labels make, model, acc_id = the GPU's
UUID) with the `container`, `pod`, `namespace` labels kubelet's cAdvisor adds, plus `id` (the container ID)."""
from __future__ import annotations

from provision.metrics.nvml import Snapshot
from provision.metrics.usage import ContainerUsage

MIB = 1 << 20
# name, type, help, how to read it from a GpuSample (None = not available: the sample is left out)
GPU_METRICS = (
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda g: g.util_gpu),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", lambda g: g.util_memory),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", lambda g: g.memory_used // MIB),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", lambda g: g.memory_free // MIB),
    ("DCGM_FI_DEV_FB_TOTAL", "gauge", "Framebuffer memory total (in MiB).", lambda g: g.memory_total // MIB),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda g: g.temperature),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda g: g.power_watts),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ).",
     lambda g: g.energy_mj),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors.",
     lambda g: g.ecc_corrected),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors.",
     lambda g: g.ecc_uncorrected),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", lambda g: g.last_xid),
)
CONTAINER_METRICS = (
    ("container_accelerator_memory_used_bytes", "Total accelerator memory allocated.", lambda u, g: u.memory_bytes),
    ("container_accelerator_memory_total_bytes", "Total accelerator memory.", lambda u, g: g.memory_total),
    ("container_accelerator_duty_cycle", "Percent of time over the past sample period during which the accelerator "
     "was actively processing.", lambda u, g: u.sm_util),
)


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in pairs) + "}"


def _num(v) -> str:
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def render(snap: Snapshot, usage: list[ContainerUsage], hostname: str) -> str:
    lines: list[str] = []
    gpu_labels = {g.index: [("gpu", str(g.index)), ("UUID", g.uuid), ("pci_bus_id", g.pci_bus_id),
                            ("device", f"nvidia{g.minor}"), ("modelName", g.name), ("hostname", hostname),
                            ("DCGM_FI_DRIVER_VERSION", snap.driver_version)] for g in snap.gpus}
    for name, kind, help_, read in GPU_METRICS:
        samples = [(g, read(g)) for g in snap.gpus]
        samples = [(g, v) for g, v in samples if v is not None]
        if not samples:
            continue
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{_labels(gpu_labels[g.index])} {_num(v)}" for g, v in samples]
    gpus = {g.index: g for g in snap.gpus}
    for name, help_, read in CONTAINER_METRICS:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
        for u in usage:
            g = gpus[u.gpu]
            labels = [("container", u.ref.container), ("pod", u.ref.pod), ("namespace", u.ref.namespace),
                      ("id", u.ref.id), ("make", "nvidia"), ("model", g.name), ("acc_id", g.uuid)]
            lines.append(f"{name}{_labels(labels)} {_num(read(u, g))}")
    return "\n".join(lines) + "\n"
