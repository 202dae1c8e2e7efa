"""MIG (Multi-Instance GPU): the instances the loaded driver has, read the way NVIDIA's libnvidia-container does, and
which of them a container's selectors name. Configuring MIG layouts (nvidia-mig-parted's job) is out of scope.

Where the facts come from (README "MIG"):
- /proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<X>/access and …/gi<X>/ci<Y>/access: one directory per GPU
  instance (GI) and compute instance (CI) that exists now; each access file's `DeviceFileMinor` is the minor of its
  /dev/nvidia-caps/nvidia-cap<minor> node (major `nvidia-caps` in /proc/devices). mig/config and mig/monitor are the
  two host-wide capabilities (NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES, privileged containers only).
- NVML (through `pynvml`, in a child with a deadline: a wedged GPU can make NVML block) for each MIG device's UUID,
  profile (`1g.10gb`) and index (`nvidia-smi -L`'s "Device N", the `GPU:N` selector and CDI name). Asked only when
  the /proc layout has instances, so a host without MIG never pays for it.

A MIG device is one CI of one GI. Selectors (NVIDIA's forms, tests/unit/test_mig.py):
- `MIG-<uuid>`: the device with that NVML UUID;
- `G:N`: GPU index G's MIG device index N (NVML's order; what NVIDIA's device plugin and nvidia-ctk's CDI names pass);
- `G:GI:CI`: GPU index G, GPU instance ID GI, compute instance ID CI (the IDs `nvidia-smi mig -lci` prints).

A leaf of the runtime: it imports no other inject module (discover and edits import it; `gpus` arguments are
discover.Gpu records), and its records are records.Record tuples (µs to build: discover imports it on every cold
start, for the cache key)."""
from __future__ import annotations

import json
import os
import sys

from provision.errors import Refused
from provision.inject.capabilities import MIG_ENV
from provision.inject.records import Record, fields

CAPS_DIR = "proc/driver/nvidia/capabilities"
PROC_NVIDIA = "/proc/driver/nvidia"  # in the container (its own procfs shows the host driver's entries)
CAPS_DEV = "/dev/nvidia-caps/nvidia-cap"
NVML_TIMEOUT_S = 5.0


class CapNode(Record):
    """An nvidia-caps device node (read like discover.Node: path, major, minor)."""
    __slots__ = ()
    FIELDS = ("path", "major", "minor")
    path, major, minor = fields(*FIELDS)

    def __new__(cls, major: int, minor: int) -> CapNode:
        return tuple.__new__(cls, (f"{CAPS_DEV}{minor}", major, minor))


class MigDevice(Record):
    """One MIG device: parent GPU (nvidia-smi index and /dev minor), GI and CI IDs, the minors of the two nvidia-caps
    nodes that open it (GI access, CI access), and what NVML says (UUID, profile, index: None when it was not asked)."""
    __slots__ = ()
    FIELDS = ("gpu", "gpu_minor", "gi", "ci", "gi_minor", "ci_minor", "uuid", "profile", "index")
    gpu, gpu_minor, gi, ci, gi_minor, ci_minor, uuid, profile, index = fields(*FIELDS)

    def __new__(cls, gpu: int, gpu_minor: int, gi: int, ci: int, gi_minor: int, ci_minor: int,
                uuid: str | None = None, profile: str | None = None, index: int | None = None) -> MigDevice:
        return tuple.__new__(cls, (gpu, gpu_minor, gi, ci, gi_minor, ci_minor, uuid, profile, index))

    @property
    def ids(self) -> str:
        """`G:GI:CI`, the name that needs no NVML."""
        return f"{self.gpu}:{self.gi}:{self.ci}"

    def names(self) -> list[str]:
        """Every name this device answers to (CDI device names, refusal lists): UUID, `G:N`, `G:GI:CI`."""
        out = [self.uuid] if self.uuid else []
        if self.index is not None:
            out.append(f"{self.gpu}:{self.index}")
        return out + [self.ids]

    def identified(self, uuid: str, profile: str | None, index: int) -> MigDevice:
        return MigDevice(*self[:6], uuid, profile, index)


class MigLayout(Record):
    """The MIG instances on this host, the nvidia-caps major, and the minors of the host-wide config/monitor
    capabilities (None: not offered)."""
    __slots__ = ()
    FIELDS = ("major", "devices", "config", "monitor")
    major, devices, config, monitor = fields(*FIELDS)

    def __new__(cls, major: int, devices: tuple[MigDevice, ...], config: int | None, monitor: int | None
                ) -> MigLayout:
        return tuple.__new__(cls, (major, devices, config, monitor))

    def nodes(self, d: MigDevice) -> tuple[CapNode, CapNode]:
        """The two nodes a container needs to open MIG device `d`: its GI's and its CI's access capability."""
        return CapNode(self.major, d.gi_minor), CapNode(self.major, d.ci_minor)

    def admin_node(self, which: str) -> CapNode | None:
        minor = self.config if which == "config" else self.monitor
        return None if minor is None else CapNode(self.major, minor)

    def to_dict(self) -> dict:
        """The discovery cache's `mig` object (discover.Discovery.to_dict; read back by discover._mig_layout)."""
        return {"major": self.major, "config": self.config, "monitor": self.monitor,
                "devices": [dict(zip(MigDevice.FIELDS, d)) for d in self.devices]}


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _numbered(names: list[str], prefix: str) -> list[int]:
    """[3, 9] from ['gi3', 'gi9', 'junk']: only `prefix` + ASCII digits count."""
    return sorted(int(n[len(prefix):]) for n in names
                  if n.startswith(prefix) and n[len(prefix):].isascii() and n[len(prefix):].isdigit())


def _tree(proc_root: str) -> list[tuple[int, int, list[int]]]:
    """(gpu minor, GI ID, [CI IDs]) for every gpuN/mig/giX under the capabilities directory."""
    base = os.path.join(proc_root, CAPS_DIR)
    out = []
    for gpu in _numbered(_listdir(base), "gpu"):
        gdir = f"{base}/gpu{gpu}/mig"
        out += [(gpu, gi, _numbered(_listdir(f"{gdir}/gi{gi}"), "ci")) for gi in _numbered(_listdir(gdir), "gi")]
    return out


def layout_key(proc_root: str = "/") -> str:
    """What changes when an instance is created or destroyed ("" when there is none): part of discovery's cache key
    (discover.host_key), so a changed layout rebuilds the cache at the next start. Costs one listdir of
    capabilities/ plus one per GPU's mig/ (MIG off: empty, nothing more)."""
    parts = [f"{gpu}/{gi}/{','.join(map(str, cis))}" for gpu, gi, cis in _tree(proc_root)]
    return " mig " + ";".join(parts) if parts else ""


def access_minor(path: str) -> int | None:
    """An access file's `DeviceFileMinor: N` (None: absent, unreadable, or not that form)."""
    try:
        with open(path) as fh:
            text = fh.read(4096)
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "DeviceFileMinor" and value.strip().isascii() and value.strip().isdigit():
            return int(value.strip())
    return None


def scan(proc_root: str, caps_major: int | None, gpus: tuple) -> MigLayout | None:
    """The MIG layout /proc shows (None: no instance and no config/monitor capability, or no nvidia-caps major).
    A GI or CI whose access file has no minor, or on a GPU the driver does not list, is left out."""
    if caps_major is None:
        return None
    base = os.path.join(proc_root, CAPS_DIR)
    by_minor = {g.minor: g for g in gpus}
    devices = []
    for gminor, gi, cis in _tree(proc_root):
        gpu = by_minor.get(gminor)
        gi_minor = access_minor(f"{base}/gpu{gminor}/mig/gi{gi}/access")
        for ci in cis:
            ci_minor = access_minor(f"{base}/gpu{gminor}/mig/gi{gi}/ci{ci}/access")
            if gpu is not None and gi_minor is not None and ci_minor is not None:
                devices.append(MigDevice(gpu.index, gminor, gi, ci, gi_minor, ci_minor))
    config, monitor = access_minor(f"{base}/mig/config"), access_minor(f"{base}/mig/monitor")
    if not devices and config is None and monitor is None:
        return None
    devices.sort(key=lambda d: (d.gpu, d.gi, d.ci))
    return MigLayout(caps_major, tuple(devices), config, monitor)


# --- NVML: UUID, profile and index of each MIG device ---

def read_nvml(nv, parents: list[str]) -> list[dict]:
    """For each parent GPU UUID, its MIG devices as NVML lists them: {parent, index, gi, ci, uuid, name}. `nv` is
    the pynvml module (tests: tests/fake_nvml.FakeMigNVML). An error on one device skips that device."""
    def s(v) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    out = []
    nv.nvmlInit()
    try:
        for parent in parents:
            try:
                h = nv.nvmlDeviceGetHandleByUUID(parent)
                count = nv.nvmlDeviceGetMaxMigDeviceCount(h)
            except nv.NVMLError:
                continue
            for i in range(count):
                try:
                    m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
                    out.append({"parent": parent, "index": i, "gi": nv.nvmlDeviceGetGpuInstanceId(m),
                                "ci": nv.nvmlDeviceGetComputeInstanceId(m), "uuid": s(nv.nvmlDeviceGetUUID(m)),
                                "name": s(nv.nvmlDeviceGetName(m))})
                except nv.NVMLError:  # NOT_FOUND: no device at this index
                    continue
    finally:
        nv.nvmlShutdown()
    return out


def profile_of(name: str) -> str | None:
    """'NVIDIA A100-SXM4-80GB MIG 1g.10gb' (NVML's MIG device name) -> '1g.10gb'."""
    _, sep, tail = name.rpartition("MIG ")
    return (tail.strip() or None) if sep else None


def merge(layout: MigLayout, found: list[dict], gpus: tuple) -> MigLayout:
    """The layout with NVML's UUID/profile/index filled in, matched by parent UUID, GI ID and CI ID."""
    index_of = {g.uuid: g.index for g in gpus if g.uuid}
    known = {(index_of.get(f["parent"]), f["gi"], f["ci"]): f for f in found}
    devs = []
    for d in layout.devices:
        f = known.get((d.gpu, d.gi, d.ci))
        devs.append(d if f is None else d.identified(str(f["uuid"]), profile_of(str(f["name"])), int(f["index"])))
    return MigLayout(layout.major, tuple(devs), layout.config, layout.monitor)


def identify(layout: MigLayout | None, gpus: tuple) -> MigLayout | None:
    """The layout with NVML's answers, asked in a child python (site-packages on, for pynvml) with a deadline; the
    layout as it was when there are no instances, no pynvml, or no answer in time."""
    if layout is None or not layout.devices:
        return layout
    parents = sorted({g.uuid for g in gpus if g.uuid and any(d.gpu == g.index for d in layout.devices)})
    if not parents:
        return layout
    from provision import effects  # lazy: 13.4 ms (-X importtime -I -S, as discover.gpu_arches); refresh, instances only

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import json,sys;sys.path.insert(0,sys.argv[1]);import pynvml;from provision.inject.mig import read_nvml;"
            "print(json.dumps(read_nvml(pynvml,sys.argv[2:])))")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
    r = effects.try_run([sys.executable, "-c", code, root, *parents], timeout=NVML_TIMEOUT_S, env=env)
    if r is None or r.returncode != 0:
        return layout
    try:
        found = json.loads(r.stdout)
        return merge(layout, [f for f in found if isinstance(f, dict)], gpus)
    except (ValueError, KeyError, TypeError):
        return layout


# --- selection ---

def select(selectors: list[str], layout: MigLayout | None) -> list[MigDevice]:
    """The MIG devices the selectors name, in order, each once. Refused (one line, listing those that exist) when a
    selector names none; `G:N` and `MIG-` selectors name none when NVML was not asked (only `G:GI:CI` works then)."""
    devices = layout.devices if layout is not None else ()
    chosen: list[MigDevice] = []
    for s in selectors:
        parts = s.split(":")
        if s.startswith("MIG-"):
            match = [d for d in devices if d.uuid and d.uuid.lower() == s.lower()]
        elif len(parts) in (2, 3) and all(p.isascii() and p.isdigit() for p in parts):
            nums = tuple(map(int, parts))
            match = [d for d in devices if (d.gpu, d.index) == nums or (d.gpu, d.gi, d.ci) == nums]
        else:
            match = []
        if not match:
            raise Refused(f"NVIDIA_VISIBLE_DEVICES names MIG device {s!r}, which does not exist; this host has: "
                          f"{describe(devices)}")
        chosen.extend(d for d in match if d not in chosen)
    return chosen


def describe(devices: tuple[MigDevice, ...]) -> str:
    """One line: each device's names and profile (refusals, `gpuprov runtime discover`)."""
    if not devices:
        return "no MIG instances (MIG off, or no GPU instance created: `nvidia-smi mig -lgi`)"
    text = "; ".join(" = ".join(d.names()) + (f" ({d.profile})" if d.profile else "") for d in devices)
    if any(d.uuid is None for d in devices):
        text += " (no NVML answer when discovery ran: only GPU:GI:CI names work; `gpuprov runtime install` refreshes)"
    return text


def proc_masks(layout: MigLayout | None, chosen: list[MigDevice], admin: list[CapNode], all_gpus: tuple,
               given_gpus: list) -> list[str]:
    """What a MIG container must not see under /proc/driver/nvidia, as container paths for runc's
    linux.maskedPaths: the capability directory of every GPU instance it was not given (or, in a GI it was given, of
    every other compute instance), mig/config and mig/monitor unless given (NVIDIA_MIG_*_DEVICES), and the
    gpus/<bus id> directory of every GPU it was not given. libnvidia-container gets the same view the other way round
    (a tmpfs over /proc/driver/nvidia, then the selected files bound back in, from a hook); runc refuses a mount
    under /proc from config.json, but masks paths there itself (a read-only empty tmpfs over a directory, /dev/null
    over a file; a path that does not exist is skipped), which needs no hook. The selected instance's access files
    stay readable: NVML in the container reads them to open its nvidia-caps nodes."""
    out: list[str] = []
    base = f"{PROC_NVIDIA}/capabilities"
    given_gis = {(d.gpu_minor, d.gi) for d in chosen}
    for d in layout.devices if layout is not None else ():
        if d in chosen:
            continue
        gi = f"{base}/gpu{d.gpu_minor}/mig/gi{d.gi}"
        path = f"{gi}/ci{d.ci}" if (d.gpu_minor, d.gi) in given_gis else gi
        if path not in out:
            out.append(path)
    minors = {n.minor for n in admin}
    for which, minor in (("config", layout.config if layout else None), ("monitor", layout.monitor if layout else None)):
        if minor is None or minor not in minors:
            out.append(f"{base}/mig/{which}")
    out += [f"{PROC_NVIDIA}/gpus/{g.bus_id}" for g in all_gpus if g not in given_gpus]
    return out


def admin_nodes(env: dict[str, str], layout: MigLayout | None, privileged: bool) -> list[CapNode]:
    """NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES: the host-wide mig/config and mig/monitor capability
    nodes, for privileged containers only (NVIDIA's runtime refuses them elsewhere; so does this)."""
    out = []
    for var, which in zip(MIG_ENV, ("config", "monitor")):
        if not env.get(var, "").strip():
            continue
        if not privileged:
            raise Refused(f"{var} is set but the container is not privileged: only a privileged container may "
                          "configure or monitor MIG (unset it, or run with --privileged)")
        node = layout.admin_node(which) if layout is not None else None
        if node is None:
            raise Refused(f"{var} is set but this host offers no MIG {which} capability "
                          f"(/{CAPS_DIR}/mig/{which} is absent: is a MIG-capable driver loaded?)")
        out.append(node)
    return out
