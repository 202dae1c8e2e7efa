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
    processes: list[ProcessSample] = field(default_factory=list)


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


def _processes(nv, h, index: int) -> list[ProcessSample]:
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
                found[p.pid] = ProcessSample(index, int(p.pid), kind if old is None else old.kind, mem)
            if old is not None and kind == "mps":
                found[p.pid].kind = "mps"
    for s in _try(nv, nv.nvmlDeviceGetProcessUtilization, h, 0, default=[]) or []:
        if s.pid in found:
            found[s.pid].sm_util = int(s.smUtil)
    return sorted(found.values(), key=lambda p: p.pid)


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
                mig_capable=_try(nv, nv.nvmlDeviceGetMigMode, h) is not None,
                processes=_processes(nv, h, i)))
        return Snapshot(drv, f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "", gpus)
    finally:
        _try(nv, nv.nvmlShutdown)
