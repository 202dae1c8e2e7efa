"""A snapshot in Prometheus' text exposition format (0.0.4), built by prometheus_client: a custom collector that
turns one reading into metric families, a private registry, and `generate_latest` (issue 28 item 15). Only
`gpuprov metrics` imports this module (prometheus_client costs 66 ms to import: never at start-up, never on the
container-start path; tests/unit/test_imports.py).

Per GPU: DCGM-exporter's names and labels (`DCGM_FI_DEV_*{gpu, UUID, pci_bus_id, device, modelName, hostname,
DCGM_FI_DRIVER_VERSION}`, memory in MiB, power in W, as NVIDIA/dcgm-exporter's etc/default-counters.csv defines
them), so its dashboards and alerts work unchanged. Per MIG device (a GPU with MIG on): the framebuffer series again,
once per GPU instance (its compute instances share its memory), with DCGM-exporter's `GPU_I_ID` and `GPU_I_PROFILE`
labels added, and `gpuprov_mig_device_info` naming each MIG device's UUID, NVML index, GI and CI IDs and parent GPU.
Per container: cAdvisor's `container_accelerator_*` (labels make, model, acc_id = the GPU's UUID, or the MIG device's
for a process on one, then with `GPU_I_ID`/`GPU_CI_ID`/`GPU_I_PROFILE`) with the `container`, `pod`, `namespace`
labels kubelet's cAdvisor adds, plus `id` (the container ID).

The `_total` catch: prometheus_client writes a counter family as `<name>_total` (its HELP, TYPE and samples), the
OpenMetrics rule. DCGM-exporter's counters (`DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`, `DCGM_FI_DEV_ECC_*_VOL_TOTAL`)
have no `_total`, and dashboards query those names. They are written as families of type `unknown` (TYPE `untyped`
in this format): the sample names stay exactly DCGM-exporter's; only the TYPE line differs from its `counter`
(rate() and increase() work on any series; docs/REFERENCE.md)."""
from __future__ import annotations

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import CollectorRegistry

from provision.metrics.nvml import GpuSample, MigSample, Snapshot
from provision.metrics.usage import ContainerUsage

MIB = 1 << 20
# DCGM-exporter's counters, written untyped so that their names keep no `_total` (module docstring)
COUNTER = "unknown"


def _mib(v: int | None) -> int | None:
    return None if v is None else v // MIB


# name, type, help, how to read it from a GpuSample, and from a MigSample (None: not a per-instance reading).
# A reading of None is left out, never a made-up 0.
GPU_METRICS = (
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda g: g.util_gpu, None),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", lambda g: g.util_memory, None),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", lambda g: _mib(g.memory_used),
     lambda m: _mib(m.memory_used)),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", lambda g: _mib(g.memory_free),
     lambda m: _mib(m.memory_free)),
    ("DCGM_FI_DEV_FB_TOTAL", "gauge", "Framebuffer memory total (in MiB).", lambda g: _mib(g.memory_total),
     lambda m: _mib(m.memory_total)),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda g: g.temperature, None),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda g: g.power_watts, None),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", COUNTER, "Total energy consumption since boot (in mJ).",
     lambda g: g.energy_mj, None),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", COUNTER, "Total number of single-bit volatile ECC errors.",
     lambda g: g.ecc_corrected, None),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", COUNTER, "Total number of double-bit volatile ECC errors.",
     lambda g: g.ecc_uncorrected, None),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", lambda g: g.last_xid, None),
)
# name, help, how to read it from (usage, the device it ran on: a GpuSample or MigSample)
CONTAINER_METRICS = (
    ("container_accelerator_memory_used_bytes", "Total accelerator memory allocated.", lambda u, d: u.memory_bytes),
    ("container_accelerator_memory_total_bytes", "Total accelerator memory.", lambda u, d: d.memory_total),
    # NVML gives no per-process utilisation on a MIG device: left out there, not 0
    ("container_accelerator_duty_cycle", "Percent of time over the past sample period during which the accelerator "
     "was actively processing.", lambda u, d: u.sm_util if isinstance(d, GpuSample) else None),
)
MIG_INFO = ("gpuprov_mig_device", "A MIG device: its UUID and NVML index, GPU instance and compute instance IDs, "
            "profile, and parent GPU (value 1).")


def _mig_labels(m: MigSample, ci: bool) -> dict[str, str]:
    out = {"GPU_I_ID": "" if m.gi is None else str(m.gi), "GPU_I_PROFILE": m.profile or ""}
    if ci:
        out["GPU_CI_ID"] = "" if m.ci is None else str(m.ci)
    return out


class SnapshotCollector:
    """prometheus_client's custom-collector protocol (`collect()` yields metric families) over one reading."""

    def __init__(self, snap: Snapshot, usage: list[ContainerUsage], hostname: str):
        self.snap, self.usage, self.hostname = snap, usage, hostname

    def _gpu_labels(self, g: GpuSample) -> dict[str, str]:
        return {"gpu": str(g.index), "UUID": g.uuid, "pci_bus_id": g.pci_bus_id, "device": f"nvidia{g.minor}",
                "modelName": g.name, "hostname": self.hostname, "DCGM_FI_DRIVER_VERSION": self.snap.driver_version}

    def collect(self):
        snap = self.snap
        for name, kind, help_, read, read_mig in GPU_METRICS:
            fam = Metric(name, help_, kind)
            for g in snap.gpus:
                if read(g) is not None:
                    fam.add_sample(name, self._gpu_labels(g), read(g))
                seen_gi: set = set()
                for m in g.mig_devices if read_mig else ():
                    if read_mig(m) is not None and m.gi not in seen_gi:  # once per GPU instance: its CIs share it
                        seen_gi.add(m.gi)
                        fam.add_sample(name, {**self._gpu_labels(g), **_mig_labels(m, ci=False)}, read_mig(m))
            if fam.samples:
                yield fam
        info = Metric(*MIG_INFO, "info")
        for g in snap.gpus:
            for m in g.mig_devices:
                info.add_sample(f"{MIG_INFO[0]}_info", {**self._gpu_labels(g), **_mig_labels(m, ci=True),
                                                        "mig_index": str(m.index), "mig_uuid": m.uuid}, 1)
        if info.samples:
            yield info
        gpus = {g.index: g for g in snap.gpus}
        for name, help_, read in CONTAINER_METRICS:
            fam = Metric(name, help_, "gauge")
            for u in self.usage:
                g = gpus[u.gpu]
                mig = next((m for m in g.mig_devices if m.index == u.mig), None) if u.mig is not None else None
                dev = mig or g
                labels = {"container": u.ref.container, "pod": u.ref.pod, "namespace": u.ref.namespace,
                          "id": u.ref.id, "make": "nvidia", "model": dev.name, "acc_id": dev.uuid}
                if mig is not None:
                    labels.update(_mig_labels(mig, ci=True))
                if read(u, dev) is not None:
                    fam.add_sample(name, labels, read(u, dev))
            yield fam  # written even with no sample (HELP and TYPE only), as before


def render(snap: Snapshot, usage: list[ContainerUsage], hostname: str) -> str:
    """The exposition text of one reading (`gpuprov metrics`, its --textfile and each --listen scrape)."""
    registry = CollectorRegistry(auto_describe=False)  # no describe(): registering must not take a reading
    registry.register(SnapshotCollector(snap, usage, hostname))
    return generate_latest(registry).decode()
