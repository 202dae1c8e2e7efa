"""Readings from NVIDIA's NVML through its Python binding (`nvidia-ml-py`, module `pynvml`): per GPU and per process.

`pynvml` is imported only when a reading is taken (never at `gpuprov` start-up): loading it costs start-up time
that `gpuprov detect` and every other command would otherwise pay. Tests replace the module at this one boundary
(`load`) with a fake built from a real `nvidia-smi -q -x` capture."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from provision.errors import UNSUPPORTED, GpuprovError


@dataclass
class ProcessSample:
    gpu: int
    pid: int
    kind: str  # compute | graphics | mps  (MPS clients are listed by NVML apart from the MPS server)
    memory_bytes: int | None  # None: NVML could not say (e.g. no permission)
    sm_util: int | None = None  # percent of the GPU's SMs this process used over the last sample period
    mig: int | None = None  # the MIG device (its NVML index on `gpu`) the process runs on; None: the whole GPU


# GFD's MIG attribute labels (k8s/labels.py) <- NVML's nvmlDeviceAttributes_t fields of a MIG device, in GFD's order
MIG_ATTRIBUTES = (
    ("memory", "memorySizeMB"), ("multiprocessors", "multiprocessorCount"),
    ("slices.gi", "gpuInstanceSliceCount"), ("slices.ci", "computeInstanceSliceCount"),
    ("engines.copy", "sharedCopyEngineCount"), ("engines.decoder", "sharedDecoderCount"),
    ("engines.encoder", "sharedEncoderCount"), ("engines.jpeg", "sharedJpegCount"), ("engines.ofa", "sharedOfaCount"),
)


@dataclass
class MigSample:
    """One MIG device (a compute instance of a GPU instance) of a MIG-enabled GPU, read through its own NVML handle:
    NVML answers memory and processes per instance only there (the parent's handle gives the whole GPU's)."""
    index: int  # NVML's MIG device index on the parent (`nvidia-smi -L`'s "Device N", the `G:N` selector)
    uuid: str
    name: str  # NVML's name, "<GPU name> MIG <profile>"
    profile: str | None  # "1g.10gb"
    gi: int | None  # GPU instance ID
    ci: int | None  # compute instance ID
    memory_total: int | None  # bytes; the GPU instance's (its compute instances share it)
    memory_used: int | None
    memory_free: int | None
    attributes: dict[str, int] | None = None  # GFD's names (MIG_ATTRIBUTES) -> NVML's values; None: no answer
    processes: list[ProcessSample] = field(default_factory=list)


@dataclass
class GpuSample:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    minor: int
    memory_total: int  # bytes
    memory_used: int
    memory_free: int
    util_gpu: int | None  # percent
    util_memory: int | None
    temperature: int | None  # C
    power_watts: float | None
    energy_mj: int | None
    ecc_corrected: int | None  # volatile, since the driver loaded
    ecc_uncorrected: int | None
    last_xid: int = 0  # from the kernel log; 0 = none seen
    compute_capability: tuple[int, int] | None = None
    mig_capable: bool = False
    mig_enabled: bool = False  # MIG mode is on now: the GPU's work runs on its MIG devices
    processes: list[ProcessSample] = field(default_factory=list)  # MIG enabled: those on no MIG device (if any)
    mig_devices: list[MigSample] = field(default_factory=list)


@dataclass
class Snapshot:
    driver_version: str
    cuda_version: str  # "13.0": the CUDA version the driver supports
    gpus: list[GpuSample]


def load():
    """The NVML binding, imported on first use."""
    try:
        import pynvml  # lazy: 10.5 ms at start-up (-X importtime, min of 15), and it must not load for other commands
    except ImportError:
        raise GpuprovError("the NVML binding is missing: pip install nvidia-ml-py (gpuprov depends on it)",
                           exit_code=UNSUPPORTED) from None
    return pynvml


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _try(nv, fn, *args, default=None):
    """One NVML reading; NOT_SUPPORTED / NO_PERMISSION / NOT_FOUND and the like give `default`, not a failure."""
    try:
        return fn(*args)
    except nv.NVMLError:
        return default


XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")


def last_xids(kmsg: str = "/dev/kmsg") -> dict[str, int]:
    """The last Xid error the driver logged per PCI bus ID ("0000:00:06.0" -> 79), read from the kernel log without
    blocking. NVML reports Xids only as events to a waiting listener; the kernel log has the ones before this run."""
    out: dict[str, int] = {}
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return out
    try:
        while True:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record was overwritten while reading; go on with the next
                continue
            if not rec:
                break
            for m in XID_RE.finditer(rec.decode(errors="replace")):
                out[m.group(1).lower()] = int(m.group(2))
    finally:
        os.close(fd)
    return out


def _bus_key(bus_id: str) -> str:
    """NVML's '00000000:00:06.0' and the kernel's '0000:00:06' / '0000:00:06.0' to one form: '00:06'."""
    parts = bus_id.lower().split(":")
    return ":".join(parts[-2:]).split(".")[0]


def _processes(nv, h, index: int, mig: int | None = None) -> list[ProcessSample]:
    found: dict[int, ProcessSample] = {}
    for kind, fn_name in (("compute", "nvmlDeviceGetComputeRunningProcesses"),
                          ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
                          ("mps", "nvmlDeviceGetMPSComputeRunningProcesses")):
        fn = getattr(nv, fn_name, None)
        for p in (_try(nv, fn, h, default=[]) if fn else []) or []:
            mem = getattr(p, "usedGpuMemory", None)
            mem = int(mem) if isinstance(mem, int) and mem >= 0 and mem < (1 << 62) else None
            old = found.get(p.pid)
            # The same PID can be in two lists (an MPS client is also a compute process): count it once.
            if old is None or (mem or 0) > (old.memory_bytes or 0):
                found[p.pid] = ProcessSample(index, int(p.pid), kind if old is None else old.kind, mem, mig=mig)
            if old is not None and kind == "mps":
                found[p.pid].kind = "mps"
    for s in _try(nv, nv.nvmlDeviceGetProcessUtilization, h, 0, default=[]) or []:
        if s.pid in found:
            found[s.pid].sm_util = int(s.smUtil)
    return sorted(found.values(), key=lambda p: p.pid)


def _mig_devices(nv, h, gpu: int) -> list[MigSample]:
    """A MIG-enabled GPU's MIG devices, each through its own handle (nvmlDeviceGetMigDeviceHandleByIndex): UUID, GI and
    CI IDs, profile, the instance's memory (nvmlDeviceGetMemoryInfo on the MIG handle), GFD's attributes and the
    processes on it. An index with no device (NOT_FOUND) is skipped; a reading NVML refuses is None."""
    out = []
    for i in range(_try(nv, nv.nvmlDeviceGetMaxMigDeviceCount, h, default=0) or 0):
        m = _try(nv, nv.nvmlDeviceGetMigDeviceHandleByIndex, h, i)
        uuid = _try(nv, nv.nvmlDeviceGetUUID, m) if m is not None else None
        if uuid is None:
            continue
        name = _s(_try(nv, nv.nvmlDeviceGetName, m, default=""))
        _, sep, profile = name.rpartition("MIG ")
        mem = _try(nv, nv.nvmlDeviceGetMemoryInfo, m)
        attrs = _try(nv, nv.nvmlDeviceGetAttributes, m) if hasattr(nv, "nvmlDeviceGetAttributes") else None
        out.append(MigSample(
            index=i, uuid=_s(uuid), name=name, profile=(profile.strip() or None) if sep else None,
            gi=_try(nv, nv.nvmlDeviceGetGpuInstanceId, m), ci=_try(nv, nv.nvmlDeviceGetComputeInstanceId, m),
            memory_total=int(mem.total) if mem else None, memory_used=int(mem.used) if mem else None,
            memory_free=int(mem.free) if mem else None,
            attributes={k: int(getattr(attrs, f)) for k, f in MIG_ATTRIBUTES} if attrs is not None else None,
            processes=_processes(nv, m, gpu, mig=i)))
    return out


def snapshot(nv=None, *, kmsg: str = "/dev/kmsg") -> Snapshot:
    """Every GPU's readings and processes, in one NVML session."""
    nv = nv or load()
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        raise GpuprovError(f"NVML could not start ({exc}): is the NVIDIA driver loaded? (gpuprov verify)",
                           exit_code=UNSUPPORTED) from None
    try:
        drv = _s(nv.nvmlSystemGetDriverVersion())
        cuda = _try(nv, nv.nvmlSystemGetCudaDriverVersion, default=0) or 0
        xids = last_xids(kmsg)
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            util = _try(nv, nv.nvmlDeviceGetUtilizationRates, h)
            power = _try(nv, nv.nvmlDeviceGetPowerUsage, h)
            bus = _s(nv.nvmlDeviceGetPciInfo(h).busId)
            cc = _try(nv, nv.nvmlDeviceGetCudaComputeCapability, h)
            mode = _try(nv, nv.nvmlDeviceGetMigMode, h)  # [current, pending]; NOT_SUPPORTED: a GPU without MIG
            migs = _mig_devices(nv, h, i) if mode is not None and mode[0] == 1 else []
            on_mig = {p.pid for d in migs for p in d.processes}
            gpus.append(GpuSample(
                index=i, uuid=_s(nv.nvmlDeviceGetUUID(h)), name=_s(nv.nvmlDeviceGetName(h)), pci_bus_id=bus,
                minor=_try(nv, nv.nvmlDeviceGetMinorNumber, h, default=i),
                memory_total=int(mem.total), memory_used=int(mem.used), memory_free=int(mem.free),
                util_gpu=util.gpu if util else None, util_memory=util.memory if util else None,
                temperature=_try(nv, nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                power_watts=power / 1000.0 if power is not None else None,
                energy_mj=_try(nv, nv.nvmlDeviceGetTotalEnergyConsumption, h),
                ecc_corrected=_try(nv, nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                   nv.NVML_VOLATILE_ECC),
                ecc_uncorrected=_try(nv, nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                     nv.NVML_VOLATILE_ECC),
                last_xid=next((x for b, x in xids.items() if _bus_key(b) == _bus_key(bus)), 0),
                compute_capability=tuple(cc) if cc else None,
                # NVML answers NOT_SUPPORTED for GPUs without MIG; a mode (on or off) means the GPU can do it
                mig_capable=mode is not None, mig_enabled=mode is not None and mode[0] == 1,
                # MIG on, the parent's list is every instance's processes (for a privileged reader): each is
                # counted once, on its MIG device
                processes=[p for p in _processes(nv, h, i) if p.pid not in on_mig],
                mig_devices=migs))
        return Snapshot(drv, f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "", gpus)
    finally:
        _try(nv, nv.nvmlShutdown)
