"""A stand-in for the `pynvml` module (nvidia-ml-py) at the function boundary gpuprov calls, answering from a real
`nvidia-smi -q -x` capture (tests/fixtures/hosts/h200-vm/commands/nvidia-smi-q.xml). NVML itself cannot exist on a
machine without an NVIDIA GPU; everything above this boundary (mapping, aggregation, text format) runs for real.
Process lists are whatever the test puts there (real PIDs of real containers)."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

XML = Path(__file__).parent / "fixtures/hosts/h200-vm/commands/nvidia-smi-q.xml"
MIB = 1 << 20


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(f"NVML error {value}")
        self.value = value


NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6


def _num(text: str | None) -> float | None:
    if text is None or text.strip() in ("N/A", ""):
        return None
    return float(text.split()[0])


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None  # noqa: N815 - pynvml's field name


class FakeNVML:
    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, xml: Path = XML):
        root = ET.parse(xml).getroot()
        self.driver = root.findtext("driver_version")
        cuda = root.findtext("cuda_version")  # "13.0" -> 13000, as NVML encodes it
        self.cuda = int(cuda.split(".")[0]) * 1000 + int(cuda.split(".")[1]) * 10
        self.gpus = root.findall("gpu")
        self.compute: dict[int, list[Proc]] = {}
        self.mps: dict[int, list[Proc]] = {}
        self.graphics: dict[int, list[Proc]] = {}
        self.sm_util: dict[int, dict[int, int]] = {}
        self.calls: list[str] = []
        self.inited = False

    # lifecycle
    def nvmlInit(self):  # noqa: N802 - pynvml's names throughout
        self.inited = True

    def nvmlShutdown(self):  # noqa: N802
        self.inited = False

    def _gpu(self, h):
        assert self.inited, "NVML called before nvmlInit"
        return self.gpus[h]

    def nvmlSystemGetDriverVersion(self):  # noqa: N802
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self):  # noqa: N802
        return self.cuda

    def nvmlDeviceGetCount(self):  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return i

    def nvmlDeviceGetName(self, h):  # noqa: N802
        return self._gpu(h).findtext("product_name")

    def nvmlDeviceGetUUID(self, h):  # noqa: N802
        return self._gpu(h).findtext("uuid")

    def nvmlDeviceGetMinorNumber(self, h):  # noqa: N802
        return int(self._gpu(h).findtext("minor_number"))

    def nvmlDeviceGetPciInfo(self, h):  # noqa: N802
        return SimpleNamespace(busId=self._gpu(h).findtext("pci/pci_bus_id").encode())

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        fb = self._gpu(h).find("fb_memory_usage")
        total = int(_num(fb.findtext("total")) * MIB)
        used = int(_num(fb.findtext("used")) * MIB) + sum(p.usedGpuMemory or 0 for p in self.compute.get(h, []))
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        u = self._gpu(h).find("utilization")
        return SimpleNamespace(gpu=int(_num(u.findtext("gpu_util"))), memory=int(_num(u.findtext("memory_util"))))

    def nvmlDeviceGetTemperature(self, h, sensor):  # noqa: N802
        return int(_num(self._gpu(h).findtext("temperature/gpu_temp")))

    def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802 - milliwatts
        return int(_num(self._gpu(h).findtext("gpu_power_readings/instant_power_draw")) * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):  # noqa: N802 - not in nvidia-smi -q: as on GPUs without it
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):  # noqa: N802
        v = self._gpu(h).find("ecc_errors/volatile")
        if kind == self.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return int(_num(v.findtext("dram_correctable")) + _num(v.findtext("sram_correctable")))
        return int(_num(v.findtext("dram_uncorrectable")) + _num(v.findtext("sram_uncorrectable_secded")))

    def nvmlDeviceGetCudaComputeCapability(self, h):  # noqa: N802 - not in the XML; query-gpu.csv says 9.0
        return (9, 0)

    def nvmlDeviceGetMigMode(self, h):  # noqa: N802
        mode = self._gpu(h).findtext("mig_mode/current_mig")
        if mode in (None, "N/A"):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [int(mode == "Enabled"), int(self._gpu(h).findtext("mig_mode/pending_mig") == "Enabled")]

    def nvmlDeviceGetComputeRunningProcesses(self, h):  # noqa: N802
        return list(self.compute.get(h, []))

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):  # noqa: N802
        return list(self.graphics.get(h, []))

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h):  # noqa: N802
        return list(self.mps.get(h, []))

    def nvmlDeviceGetProcessUtilization(self, h, ts):  # noqa: N802
        samples = self.sm_util.get(h)
        if not samples:
            raise NVMLError(NVML_ERROR_NOT_FOUND)  # what NVML says when no process ran in the sample window
        return [SimpleNamespace(pid=p, smUtil=u, memUtil=0, timeStamp=ts) for p, u in samples.items()]


MIG_L = Path(__file__).parent / "fixtures/hosts/h100-mig/commands/nvidia-smi-L.txt"
MIG_LCI = Path(__file__).parent / "fixtures/hosts/h100-mig/commands/nvidia-smi-mig-lci.txt"
MIG_LGIP = Path(__file__).parent / "fixtures/hosts/h100-mig-capture/mig.txt"  # the real H100's `nvidia-smi mig -lgip`


def lgip_profiles(text: str) -> dict[str, dict[str, int]]:
    """`nvidia-smi mig -lgip`'s table -> {profile: NVML's nvmlDeviceAttributes_t fields of a MIG device that is one
    compute instance spanning its GPU instance (what `-cgi … -C` makes)}. Each profile takes two rows: `GPU Name ID
    Instances Memory P2P SM DEC ENC` then `CE JPEG OFA`. nvidia-smi prints memorySizeMB / 1024 with two decimals
    (9984 MiB -> 9.75, 20096 -> 19.62): the MiB are the one multiple of 32 that prints as that figure (NVIDIA's GPU
    Operator MIG page shows 9984 and 20096 for this H100's 1g.10gb and 2g.20gb: tests/unit/test_k8s.py)."""
    out: dict[str, dict[str, int]] = {}
    rows = [r.strip("| ").split() for r in text.splitlines() if r.startswith("|")]
    for first, second in zip(rows, rows[1:]):
        if len(first) == 10 and first[1] == "MIG" and len(second) == 3 and all(x.isdigit() for x in second):
            gib = first[5]
            mib = next(m for m in range(int(float(gib) * 1024) - 64, int(float(gib) * 1024) + 64)
                       if m % 32 == 0 and f"{m / 1024:.2f}" == gib)
            slices = int(first[2].split("g.")[0])
            out[first[2]] = {"memorySizeMB": mib, "multiprocessorCount": int(first[7]), "sharedDecoderCount": int(first[8]),
                             "sharedEncoderCount": int(first[9]), "sharedCopyEngineCount": int(second[0]),
                             "sharedJpegCount": int(second[1]), "sharedOfaCount": int(second[2]),
                             "gpuInstanceSliceCount": slices, "computeInstanceSliceCount": slices}
    return out


class FakeMigNVML(FakeNVML):
    """NVML on the MIG host of tests/fixtures/hosts/h100-mig: its one GPU (the `nvidia-smi -L` GPU line: the real
    H100's name and UUID) and MIG devices (`-L`: index, UUID, profile in NVML's index order; `nvidia-smi mig -lci`: GI
    and CI IDs, matched in order; the fixture's README says how the two were put together). A MIG handle is
    (gpu handle, index). Everything else answers from FakeNVML's capture."""

    def __init__(self, xml: Path = XML, listing: Path = MIG_L, lci: Path = MIG_LCI, lgip: Path = MIG_LGIP):
        super().__init__(xml)
        self.profiles = lgip_profiles(lgip.read_text())
        self.mig: list[dict] = []
        for line in listing.read_text().splitlines():
            line = line.strip()
            if line.startswith("GPU "):
                self.gpu_name = line.split(": ", 1)[1].split(" (UUID")[0]
                self.gpu_uuid = line.split("UUID: ")[1].rstrip(")")
            elif line.startswith("MIG "):
                profile, _, rest = line[4:].partition(" ")
                index = int(rest.split("Device")[1].split(":")[0])
                uuid = rest.split("UUID: ")[1].rstrip(")")
                self.mig.append({"index": index, "uuid": uuid, "profile": profile})
        lci_rows = [r for r in (line.strip("| ").split() for line in lci.read_text().splitlines())
                    if len(r) == 7 and r[0].isdigit() and r[1].isdigit()]
        for dev, row in zip(self.mig, lci_rows):  # row: GPU, GI ID, MIG, profile, profile ID, CI ID, placement
            assert row[3] == dev["profile"], (row, dev)
            dev["gi"], dev["ci"] = int(row[1]), int(row[5])
            # the compute instance's slices: the Size of -lci's Start:Size (a full-GI CI: the GI's own)
            assert int(row[6].split(":")[1]) == self.profiles[dev["profile"]]["computeInstanceSliceCount"], row

    def nvmlDeviceGetMigMode(self, h):  # noqa: N802 - this host's GPU has MIG on (current, pending)
        self._gpu(h)
        return [1, 1]

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802 - a MIG handle: its GPU instance's memory (-lgip's)
        if not isinstance(h, tuple):  # the whole GPU: every instance's processes' memory too
            whole = super().nvmlDeviceGetMemoryInfo(h)
            inst = sum(p.usedGpuMemory or 0 for k, ps in self.compute.items() if isinstance(k, tuple) and k[0] == h
                       for p in ps)
            return SimpleNamespace(total=whole.total, used=whole.used + inst, free=whole.free - inst)
        total = self.profiles[self.mig[h[1]]["profile"]]["memorySizeMB"] * MIB
        used = sum(p.usedGpuMemory or 0 for p in self.compute.get(h, []))
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetComputeRunningProcesses(self, h):  # noqa: N802 - the parent's list holds every instance's too
        if isinstance(h, tuple):
            return list(self.compute.get(h, []))
        return list(self.compute.get(h, [])) + [p for (g, _), ps in
                                                 ((k, v) for k, v in self.compute.items() if isinstance(k, tuple))
                                                 if g == h for p in ps]

    def nvmlDeviceGetAttributes(self, m):  # noqa: N802 - MIG devices only, as NVML (NOT_SUPPORTED on a GPU)
        if not isinstance(m, tuple):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(**self.profiles[self.mig[m[1]]["profile"]])

    def nvmlDeviceGetHandleByUUID(self, uuid):  # noqa: N802
        if uuid != self.gpu_uuid:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return 0

    def nvmlDeviceGetMaxMigDeviceCount(self, h):  # noqa: N802 - 7 on every MIG-capable GPU so far
        self._gpu(h)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, i):  # noqa: N802
        self._gpu(h)
        if i >= len(self.mig):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return (h, i)

    def nvmlDeviceGetGpuInstanceId(self, m):  # noqa: N802
        return self.mig[m[1]]["gi"]

    def nvmlDeviceGetComputeInstanceId(self, m):  # noqa: N802
        return self.mig[m[1]]["ci"]

    def nvmlDeviceGetUUID(self, h):  # noqa: N802
        return self.mig[h[1]]["uuid"] if isinstance(h, tuple) else self.gpu_uuid

    def nvmlDeviceGetName(self, h):  # noqa: N802 - NVML names a MIG device "<GPU name> MIG <profile>"
        return f"{self.gpu_name} MIG {self.mig[h[1]]['profile']}" if isinstance(h, tuple) else self.gpu_name
