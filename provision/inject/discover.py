"""Discovery: what a driver root offers, as typed records (`Discovery`, one JSON form), precomputed and cached so
that a container start only reads one small file. Refreshed when anything it was built from changes (host_key: the
loaded driver's version line, its loaded modules, their device majors, the boot, the MIG layout; and `watched`: the
driver root's library directories and the /dev entries discovery looks for), the key read before discovery and the
result stored only if the key did not move meanwhile (refresh)."""
from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

from provision import paths
from provision.fsutil import make_dirs, open_trusted_fd, read_fd, write_file
from provision.inject import mig
from provision.inject.capabilities import (
    BINARIES,
    DRIVER_LIB32_DIRS,
    FIRMWARE_FROM_INIT_NS,
    LIBRARIES,
    MANIFEST_DIRS,
    MANIFESTS,
)
from provision.versions import numbers

BIN_DIRS = ("bin", "usr/bin", "sbin", "usr/sbin")
CACHE_FILE = paths.DISCOVERY_CACHE
# Manifests whose library_path had to be rewritten are written here (root-owned, 0755; persistent, so that a CDI
# spec in /etc/cdi that names them stays valid across reboots). One sub-directory per driver version.
GENERATED_DIR = paths.GENERATED_MANIFESTS
SCHEMA = 5  # the cache file's form; a cache of another schema is a miss (rebuilt). 3: each GPU's arch; 4: brand,
# userspace (the driver root's version when it does not match the loaded module); 5: watch (the paths in the key)


# --- the typed result: one JSON form (to_dict/from_dict), read by modify, edits, cdi, k8s and the CLI ---
# Cost, measured on this 2-core machine (python -X importtime, min of 25): building these 7 frozen dataclasses is
# ~4 ms at import, paid by a cold GPU start (no warm editor yet, or the Python front-end); the warm editor pays it
# once and then parses nothing while the cache is unchanged (load_cached). Every record has a docstring: without
# one, Python 3.11's dataclass builds __doc__ with inspect.signature (~0.25 ms more per class).

@dataclass(frozen=True, slots=True)
class Library:
    """A driver library of this driver version."""
    name: str  # libcuda
    path: str  # host path of the versioned file (libcuda.so.580.159.04)
    soname: str  # libcuda.so.1: the name it is mounted at in the container


@dataclass(frozen=True, slots=True)
class Node:
    """A character device node: its path (in the host's and the container's /dev) and major:minor."""
    path: str
    major: int
    minor: int


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU the loaded driver lists."""
    bus_id: str  # 0000:3b:00.0
    uuid: str | None
    minor: int
    model: str | None
    index: int  # nvidia-smi's index: PCI bus order
    node: Node  # /dev/nvidiaN
    drm: tuple[Node, ...] = ()  # /dev/dri/card*, renderD* (nvidia-drm loaded)
    arch: str | None = None  # CUDA compute capability as the driver reports it ("9.0" on an H100/H200); None: unknown
    brand: str | None = None  # the driver's brand (NVML's, as libnvidia-container names it: "nvidia", "tesla",
    # "quadrortx"…); None: the driver did not say. Never guessed from the model name (NVIDIA_REQUIRE_BRAND)


@dataclass(frozen=True, slots=True)
class Manifest:
    """A loader manifest (Vulkan/EGL ICD, OpenCL .icd, …) for one capability."""
    cap: str
    path: str  # the host file
    container_path: str
    library: str | None  # the library it names
    rewrite: str | None  # the bare SONAME when it names an absolute host path (then a rewritten copy is mounted)
    generated: str | None = None  # that rewritten copy, once write_manifests() wrote it

    @property
    def source(self) -> str | None:
        """What to mount: the file itself, or its rewritten copy (None while a needed copy is not written)."""
        return self.generated if self.rewrite else self.path


@dataclass(frozen=True, slots=True)
class Firmware:
    """A GSP firmware file and where the container's kernel looks for it."""
    path: str
    container_path: str


@dataclass(frozen=True, slots=True)
class ControlNodes:
    """The driver's device nodes that are not a GPU's (present when their module is loaded)."""
    ctl: Node  # /dev/nvidiactl
    uvm: Node | None = None
    uvm_tools: Node | None = None
    modeset: Node | None = None

    def present(self) -> tuple[Node, ...]:
        return tuple(n for n in (self.ctl, self.modeset, self.uvm, self.uvm_tools) if n is not None)


_NODE_KEYS = (("ctl", "ctl"), ("uvm", "uvm"), ("uvm-tools", "uvm_tools"), ("modeset", "modeset"))


@dataclass(frozen=True, slots=True)
class Discovery:
    """Everything the runtime, CDI and docker-args need from one driver root. Frozen and shared: the warm editor
    keeps one for every container start while the cache file is unchanged, so no reader may change it."""
    driver_root: str
    version: str | None  # None: no driver loaded (and then nothing else is filled)
    libraries: Mapping[str, tuple[Library, ...]]  # capability -> libraries
    libraries32: Mapping[str, tuple[Library, ...]]  # the same, 32-bit builds (compat32)
    manifests: tuple[Manifest, ...]
    firmware_needed: bool  # kernel < 5.7 loads GSP firmware from the opener's mount namespace
    binaries: Mapping[str, tuple[str, ...]]  # capability -> host paths
    nodes: ControlNodes
    gpus: tuple[Gpu, ...]
    persistenced: str | None  # nvidia-persistenced's socket on the host, when it runs
    firmware: tuple[Firmware, ...]
    key: str | None = None  # the cache's host key (host_key()); None outside the cache
    userspace: str | None = None  # the driver root's userspace version when none of its libraries is the loaded
    # module's version (an upgrade before the reboot): GPU containers are then refused (edits.mismatch)
    mig: mig.MigLayout | None = None  # MIG instances (provision/inject/mig.py); None: none on this host
    watch: tuple[str, ...] = ()  # the files and directories whose stamps are in `key` (watched()); () outside the cache

    def to_dict(self) -> dict:
        """The JSON form: the cache file's and `gpuprov runtime discover --json`'s (schema SCHEMA)."""
        def lib(x: Library) -> dict:
            return {"name": x.name, "path": x.path, "soname": x.soname}

        def node(n: Node) -> dict:
            return {"path": n.path, "major": n.major, "minor": n.minor}

        def man(m: Manifest) -> dict:
            d = {"cap": m.cap, "path": m.path, "container_path": m.container_path, "library": m.library,
                 "rewrite": m.rewrite}
            if m.generated is not None:
                d["generated"] = m.generated
            return d

        doc = {
            "schema": SCHEMA,
            "driver_root": self.driver_root,
            "version": self.version,
            "libraries": {c: [lib(x) for x in v] for c, v in self.libraries.items()},
            "libraries32": {c: [lib(x) for x in v] for c, v in self.libraries32.items()},
            "manifests": [man(m) for m in self.manifests],
            "firmware_needed": self.firmware_needed,
            "binaries": {c: list(v) for c, v in self.binaries.items()},
            "nodes": {k: node(getattr(self.nodes, a)) for k, a in _NODE_KEYS if getattr(self.nodes, a) is not None},
            "gpus": [{"bus_id": g.bus_id, "uuid": g.uuid, "minor": g.minor, "model": g.model, "index": g.index,
                      "node": node(g.node), "drm": [node(n) for n in g.drm], "arch": g.arch, "brand": g.brand}
                     for g in self.gpus],
            "ipc": {"persistenced": self.persistenced} if self.persistenced else {},
            "firmware": [{"path": f.path, "container_path": f.container_path} for f in self.firmware],
        }
        if self.key is not None:
            doc["key"] = self.key
        if self.userspace is not None:
            doc["userspace"] = self.userspace
        if self.mig is not None:
            doc["mig"] = self.mig.to_dict()
        if self.watch:
            doc["watch"] = list(self.watch)
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, doc: dict) -> Discovery:
        """ValueError for anything that is not to_dict()'s form of this SCHEMA (an older gpuprov's cache, a
        truncated or garbled file): the cache then counts as a miss and is rebuilt."""
        try:
            if _only(doc, _FIELDS["doc"])["schema"] != SCHEMA:
                raise ValueError(f"schema {doc['schema']!r}, not {SCHEMA}")
            nodes = _only(doc["nodes"], _FIELDS["nodes"])
            disc = cls(
                driver_root=_typed(doc["driver_root"], str),
                version=_typed(doc["version"], str, None),
                libraries=_libs(doc["libraries"]),
                libraries32=_libs(doc["libraries32"]),
                manifests=tuple(_manifest(m) for m in doc["manifests"]),
                firmware_needed=_typed(doc["firmware_needed"], bool),
                binaries=MappingProxyType({_typed(c, str): tuple(_typed(p, str) for p in v)
                                           for c, v in doc["binaries"].items()}),
                nodes=ControlNodes(**{a: _node(nodes[k]) for k, a in _NODE_KEYS if k in nodes}),
                gpus=tuple(_gpu(g) for g in doc["gpus"]),
                persistenced=_typed(_only(doc["ipc"], _FIELDS["ipc"]).get("persistenced"), str, None),
                firmware=tuple(_firmware(f) for f in doc["firmware"]),
                key=_typed(doc.get("key"), str, None),
                userspace=_typed(doc.get("userspace"), str, None),
                mig=_mig_layout(doc["mig"]) if doc.get("mig") is not None else None,
                watch=tuple(_typed(p, str) for p in _typed(doc.get("watch", []), list)),
            )
        except (KeyError, TypeError, AttributeError) as exc:  # a missing key, an unknown one, a wrong container
            raise ValueError(f"not a discovery document: {type(exc).__name__}: {exc}") from None
        return disc

    @classmethod
    def from_json(cls, text: str | bytes) -> Discovery:
        return cls.from_dict(json.loads(text))


# The keys each JSON object may have (to_dict's): anything else is another writer's form, so a miss.
_FIELDS = {
    "doc": {"schema", "driver_root", "version", "libraries", "libraries32", "manifests", "firmware_needed", "binaries",
            "nodes", "gpus", "ipc", "firmware", "key", "userspace", "mig", "watch"},
    "nodes": {k for k, _ in _NODE_KEYS}, "node": {"path", "major", "minor"}, "library": {"name", "path", "soname"},
    "manifest": {"cap", "path", "container_path", "library", "rewrite", "generated"}, "ipc": {"persistenced"},
    "gpu": {"bus_id", "uuid", "minor", "model", "index", "node", "drm", "arch", "brand"},
    "firmware": {"path", "container_path"}, "mig": {"major", "devices", "config", "monitor"},
}


def _mig_layout(doc: dict) -> mig.MigLayout:
    _only(doc, _FIELDS["mig"])
    devices = []
    for d in doc["devices"]:
        _only(d, set(mig.MigDevice.FIELDS))
        devices.append(mig.MigDevice(*(_typed(d[k], int) for k in mig.MigDevice.FIELDS[:6]),
                                     _typed(d["uuid"], str, None), _typed(d["profile"], str, None),
                                     _typed(d["index"], int, None)))
    return mig.MigLayout(_typed(doc["major"], int), tuple(devices), _typed(doc["config"], int, None),
                         _typed(doc["monitor"], int, None))


def _only(obj: dict, keys: set[str]) -> dict:
    if not obj.keys() <= keys:
        raise TypeError(f"unknown field(s) {sorted(obj.keys() - keys)}")
    return obj


def _typed(value, typ: type, *none):
    """`value` when it is a `typ` (or None where None is allowed), else TypeError. bool is not an int here."""
    if (value is None and none) or (type(value) is typ):
        return value
    raise TypeError(f"{value!r} is not a {typ.__name__}")


def _manifest(m: dict) -> Manifest:
    _only(m, _FIELDS["manifest"])
    return Manifest(_typed(m["cap"], str), _typed(m["path"], str), _typed(m["container_path"], str),
                    _typed(m["library"], str, None), _typed(m["rewrite"], str, None), _typed(m.get("generated"), str, None))


def _gpu(g: dict) -> Gpu:
    _only(g, _FIELDS["gpu"])
    return Gpu(bus_id=_typed(g["bus_id"], str), uuid=_typed(g["uuid"], str, None), minor=_typed(g["minor"], int),
               model=_typed(g["model"], str, None), index=_typed(g["index"], int), node=_node(g["node"]),
               drm=tuple(_node(n) for n in g["drm"]), arch=_typed(g.get("arch"), str, None),
               brand=_typed(g.get("brand"), str, None))


def _node(n: dict) -> Node:
    _only(n, _FIELDS["node"])
    return Node(_typed(n["path"], str), _typed(n["major"], int), _typed(n["minor"], int))


def _libs(doc: dict) -> Mapping[str, tuple[Library, ...]]:
    return MappingProxyType({_typed(c, str): tuple(_library(x) for x in v) for c, v in doc.items()})


def _library(x: dict) -> Library:
    _only(x, _FIELDS["library"])
    return Library(_typed(x["name"], str), _typed(x["path"], str), _typed(x["soname"], str))


def _firmware(f: dict) -> Firmware:
    _only(f, _FIELDS["firmware"])
    return Firmware(_typed(f["path"], str), _typed(f["container_path"], str))


def _join(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def elf_soname(path: str) -> str | None:
    """DT_SONAME of a 64-bit little-endian ELF file, or None (also for non-ELF files such as fixtures)."""
    import struct  # lazy: 0.3 ms (-X importtime -I -S, min of 15) per cold GPU create; only discovery reads ELF

    from provision.inject import elf  # lazy: 0.15 ms (-X importtime -I -S, min of 5); only when an ELF is read

    try:
        with open(path, "rb") as fh:
            found = elf.sections(fh)
            if found is None:
                return None
            secs = found[0]
            dyn = next((s for s in secs if s[1] == 6), None)  # SHT_DYNAMIC
            if dyn is None:
                return None
            strtab = secs[dyn[6]]  # sh_link -> .dynstr
            fh.seek(dyn[4])
            data = fh.read(dyn[5])
            fh.seek(strtab[4])
            strs = fh.read(strtab[5])
            for off in range(0, len(data), 16):
                tag, val = struct.unpack_from("<qQ", data, off)
                if tag == 14:  # DT_SONAME
                    return strs[val:strs.index(b"\0", val)].decode()
                if tag == 0:
                    break
    except (OSError, struct.error, ValueError, IndexError):
        return None
    return None


def _libraries(root: str, version: str, dirs: tuple[str, ...], elf64: bool = True) -> dict[str, list[Library]]:
    """Per capability, the driver's libraries of this version found under `dirs`."""
    wanted: dict[str, list[str]] = {}
    for cap, libs in LIBRARIES.items():
        for lib in libs:
            wanted.setdefault(lib, []).append(cap)
    found: dict[str, list[Library]] = {}
    seen = set()
    for d in dirs:
        full = _join(root, d)
        if os.path.islink(full) or not os.path.isdir(full):
            continue  # `lib -> lib64` on real driver roots: read the real directory once
        names = os.listdir(full)
        links = {}
        for n in names:
            p = os.path.join(full, n)
            if os.path.islink(p):
                links.setdefault(os.readlink(p), []).append(n)
        for n in sorted(names):
            base, sep, ver = n.partition(".so.")
            if not sep or ver != version or base not in wanted or base in seen:
                continue
            p = os.path.join(full, n)
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode):
                continue
            soname = elf_soname(p) if elf64 else None
            if soname is None:  # fixture, 32-bit or stripped: the `libX.so.N -> libX.so.<version>` link names it
                cands = [x for x in links.get(n, []) if x.startswith(base + ".so.")]
                soname = min(cands, key=len) if cands else n
            seen.add(base)
            lib = Library(name=base, path=p, soname=soname)
            for cap in wanted[base]:
                found.setdefault(cap, []).append(lib)
    return found


def _libraries32(root: str, version: str) -> dict[str, tuple[Library, ...]]:
    """32-bit builds of the same libraries (compat32). A 64-bit ELF in a shared dir such as usr/lib is skipped."""
    out = _libraries(root, version, DRIVER_LIB32_DIRS, elf64=False)
    kept = {cap: tuple(lib for lib in libs if _elf_class(lib.path) != 2) for cap, libs in out.items()}
    return {c: v for c, v in kept.items() if v}


def _elf_class(path: str) -> int | None:
    try:
        with open(path, "rb") as fh:
            head = fh.read(5)
    except OSError:
        return None
    return head[4] if head[:4] == b"\x7fELF" else None


def _manifest_library(path: str) -> str | None:
    """The library a loader manifest names: ICD/layer JSON `library_path`, or an OpenCL .icd file's one line."""
    text = _read(path)
    if path.endswith(".icd"):
        return text.strip() or None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    for key in ("ICD", "layer"):
        if isinstance(doc.get(key), dict) and isinstance(doc[key].get("library_path"), str):
            return doc[key]["library_path"]
    layers = doc.get("layers")
    if isinstance(layers, list) and layers and isinstance(layers[0], dict):
        return layers[0].get("library_path")
    return None


def _manifests(root: str) -> tuple[Manifest, ...]:
    """The loader manifests under the driver root. A manifest naming its library by an absolute host path (some
    distro packages do) would point the image's loader at a path that does not exist in the container: it gets a
    rewritten copy naming the bare SONAME (`rewrite`, written by write_manifests)."""
    import glob  # lazy: 0.3 ms (-X importtime -I -S, min of 15) per cold GPU create; only discovery globs

    out = []
    for cap, rel, dest in MANIFESTS:
        for base in MANIFEST_DIRS:
            hits = sorted(glob.glob(_join(root, os.path.join(base, rel))))
            hits = [h for h in hits if os.path.isfile(h) and not os.path.islink(h)]
            if not hits:
                continue
            for h in hits:
                lib = None if h.endswith(".bin") else _manifest_library(h)
                cpath = dest + os.path.basename(h) if dest.endswith("/") else dest
                rewrite = os.path.basename(lib) if lib and "/" in lib else None
                out.append(Manifest(cap=cap, path=h, container_path=cpath, library=lib, rewrite=rewrite))
            break
    return tuple(out)


def _platform_libraries(root: str, manifests: tuple[Manifest, ...], have: set[str], lib_dirs: tuple[str, ...]
                        ) -> list[Library]:
    """Libraries that EGL external-platform manifests name (libnvidia-egl-gbm.so.1, -wayland, -xcb…): they carry
    their own version, not the driver's, so the version scan does not see them."""
    out = []
    for m in manifests:
        name = os.path.basename(m.library or "")
        if m.cap != "graphics" or not name.startswith("libnvidia-egl-") or name in have:
            continue
        for d in lib_dirs:
            p = _join(root, f"{d}/{name}")
            if os.path.exists(p):
                real = os.path.realpath(p)
                out.append(Library(name=name.partition(".so")[0], path=real, soname=name))
                have.add(name)
                break
    return out


def _binaries(root: str) -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for cap, names in BINARIES.items():
        for n in names:
            for d in BIN_DIRS:
                p = _join(root, f"{d}/{n}")
                if os.path.isfile(p) and not os.path.islink(p):
                    out.setdefault(cap, []).append(p)
                    break
    return {c: tuple(v) for c, v in out.items()}


def char_majors(proc_devices: str) -> dict[str, int]:
    majors: dict[str, int] = {}
    in_char = False
    for line in proc_devices.splitlines():
        if line.startswith("Character devices"):
            in_char = True
        elif line.startswith("Block devices"):
            in_char = False
        elif in_char and line.strip():
            num, _, name = line.strip().partition(" ")
            majors.setdefault(name.strip(), int(num))
    return majors


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def gpus_from_proc(proc_root: str, dev_root: str, nvidia_major: int) -> tuple[Gpu, ...]:
    """The GPUs the loaded driver lists, indexed as nvidia-smi does (PCI bus order), with their device nodes."""
    base = _join(proc_root, "proc/driver/nvidia/gpus")
    found = []
    try:
        buses = sorted(os.listdir(base))
    except OSError:
        return ()
    for bus in buses:
        info = {}
        for line in _read(os.path.join(base, bus, "information")).splitlines():
            k, _, v = line.partition(":")
            info[k.strip()] = v.strip()
        found.append((info.get("Bus Location", bus), info.get("GPU UUID"), int(info.get("Device Minor", len(found))),
                      info.get("Model")))
    found.sort(key=lambda g: g[0])  # nvidia-smi indexes GPUs by PCI bus order
    return tuple(Gpu(bus_id=bus_id, uuid=uuid, minor=minor, model=model, index=i,
                     node=Node(f"/dev/nvidia{minor}", nvidia_major, minor), drm=_drm_nodes(proc_root, dev_root, bus_id))
                 for i, (bus_id, uuid, minor, model) in enumerate(found))


def _drm_nodes(sys_root: str, dev_root: str, bus_id: str) -> tuple[Node, ...]:
    """The GPU's /dev/dri/card* and renderD* (present when nvidia-drm is loaded): graphics and display need them."""
    try:
        names = sorted(os.listdir(_join(sys_root, f"sys/bus/pci/devices/{bus_id.lower()}/drm")))
    except OSError:
        return ()
    out = []
    for n in names:
        if not n.startswith(("card", "renderD")):
            continue
        try:
            st = os.stat(_join(dev_root, f"dev/dri/{n}"))
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out.append(Node(f"/dev/dri/{n}", os.major(st.st_rdev), os.minor(st.st_rdev)))
    return tuple(out)


def driver_version(proc_root: str, driver_root: str) -> str | None:
    """The loaded module's version, else the driver root's userspace version (only on a cache refresh)."""
    # The detect layer's driver facts: a refresh needs them, a cold GPU start that reads the cache does not.
    from provision.facts.driver_facts import parse_nvrm, userspace_version  # lazy: 7 ms (-X importtime -I -S, min of 15)

    return parse_nvrm(_read(_join(proc_root, "proc/driver/nvidia/version")))[0] or userspace_version(Path(driver_root))


def discover(driver_root: str = "/", *, proc_root: str = "/", dev_root: str = "/", arch: bool = False,
             warn: Callable[[str], None] | None = None, known: Discovery | None = None) -> Discovery:
    """Everything the runtime, CDI and docker-args need from this driver root. arch: also ask the driver for each
    GPU's compute capability and brand (the runtime's discovery, for NVIDIA_REQUIRE_ARCH/BRAND); `warn` hears when
    it did not answer in time. `known`: a discovery made earlier in this start, whose answers from the driver stand
    for the same GPUs under the same version (not asked twice)."""
    from provision.facts.driver_facts import DRIVER_LIB_DIRS  # lazy: 7 ms, loaded by driver_version() just before

    version = driver_version(proc_root, driver_root)
    majors = char_majors(_read(_join(proc_root, "proc/devices")))
    nvidia_major = majors.get("nvidia-frontend", majors.get("nvidia", 195))
    uvm = majors.get("nvidia-uvm")
    nodes = ControlNodes(
        ctl=Node("/dev/nvidiactl", nvidia_major, 255),
        uvm=Node("/dev/nvidia-uvm", uvm, 0) if uvm is not None else None,
        uvm_tools=Node("/dev/nvidia-uvm-tools", uvm, 1) if uvm is not None else None,
        modeset=Node("/dev/nvidia-modeset", nvidia_major, 254) if os.path.exists(_join(dev_root, "dev/nvidia-modeset"))
        else None)
    firmware: tuple[Firmware, ...] = ()
    if version:
        for fw_root in (driver_root, "/"):
            fwdir = _join(fw_root, f"lib/firmware/nvidia/{version}")
            if not os.path.isdir(fwdir):
                fwdir = _join(fw_root, f"firmware/nvidia/{version}")
            if os.path.isdir(fwdir):
                firmware = tuple(Firmware(os.path.join(fwdir, n), f"/lib/firmware/nvidia/{version}/{n}")
                                 for n in sorted(os.listdir(fwdir)) if n.startswith("gsp"))
                break
    sock = _join(dev_root, "var/run/nvidia-persistenced/socket")
    libraries = _libraries(driver_root, version, DRIVER_LIB_DIRS) if version else {}
    manifests = _manifests(driver_root)
    extra = _platform_libraries(driver_root, manifests, {lib.soname for v in libraries.values() for lib in v},
                                DRIVER_LIB_DIRS)
    if extra:
        libraries.setdefault("graphics", []).extend(extra)
    userspace = None
    if version and not any(lib.name == "libcuda" or lib.name == "libnvidia-ml" for v in libraries.values() for lib in v):
        from provision.facts.driver_facts import userspace_version  # lazy: 7 ms, loaded by driver_version() above

        userspace = userspace_version(Path(driver_root))  # what is there instead (None: no driver libraries at all)
    disc = Discovery(
        driver_root=driver_root,
        version=version,
        libraries={c: tuple(v) for c, v in libraries.items()},
        libraries32=_libraries32(driver_root, version) if version else {},
        manifests=manifests,
        firmware_needed=firmware_needed(kernel_release(proc_root)),
        binaries=_binaries(driver_root),
        nodes=nodes,
        gpus=gpus_from_proc(proc_root, dev_root, nvidia_major),
        persistenced=sock if os.path.exists(sock) else None,
        firmware=firmware,
        userspace=userspace,
    )
    # The driver's answers: nvidia-smi's queries start now and run while NVML is asked for MIG names (only where
    # instances exist, whoever asks: CDI names need them too), so that a wedged driver costs one deadline, not three.
    asked = _ask_driver(disc, known) if arch else None
    disc = replace(disc, mig=mig.identify(mig.scan(proc_root, majors.get("nvidia-caps"), disc.gpus), disc.gpus))
    if arch:
        disc = _answered(disc, asked, known, warn)
    return disc


# --- each GPU's CUDA compute capability ("arch" in NVIDIA_REQUIRE_*) and brand ---
# procfs and sysfs do not carry them: only the driver's NVML does (nvmlDeviceGetCudaComputeCapability and
# nvmlDeviceGetBrand, what libnvidia-container reads). The runtime's editor runs as `python -I -S`, without
# site-packages (no pynvml), and a wedged GPU can make NVML block: so the driver root's own nvidia-smi asks NVML, in
# children started together under one deadline (a wedged driver costs one deadline, not one per question), once per
# loaded driver (the discovery cache keeps the answers). Its `compute_cap` field is there since driver 510.
ARCH_QUERY = ("--query-gpu=pci.bus_id,compute_cap", "--format=csv,noheader")
# The brand: drivers since 580 refuse `--query-gpu=brand` ("not a valid field", seen on an H100), while every
# driver's XML report has <product_brand> under each <gpu id="PCI bus id"> (and no compute capability): a second
# process, so that a driver whose nvidia-smi lacks one answer loses that one only.
BRAND_QUERY = ("-q", "-x")
ARCH_TIMEOUT_S = 5.0  # the one deadline for every question discovery asks nvidia-smi
# nvidia-smi's brand text -> libnvidia-container's name for it; any other is lowercased without spaces ("Quadro RTX"
# -> quadrortx, "NVIDIA RTX" -> nvidiartx, "NVIDIA" -> nvidia, "Tesla" -> tesla).
BRAND_NAMES = {"nvidia virtual applications": "nvidiavapps", "nvidia virtual pc": "nvidiavpc",
               "nvidia virtual compute server": "nvidiavcs", "nvidia rtx virtual workstation": "nvidiavws",
               "nvidia cloud gaming": "nvidiacloudgaming"}


def _pci_key(bus_id: str) -> str:
    """NVML's '00000000:00:06.0' and the kernel's '0000:00:06.0' to one form."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return bus_id.strip().lower()


def _trusted_exe(path: str) -> bool:
    """A driver binary we may run as root: a regular file (not a link) that only its owner, root, can change."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def parse_arches(text: str) -> dict[str, str]:
    """nvidia-smi's `pci.bus_id, compute_cap` CSV -> {pci key: "9.0"}; lines that are not that are skipped."""
    out = {}
    for line in text.splitlines():
        bus, sep, cap = line.partition(",")
        major, dot, minor = cap.strip().partition(".")
        if sep and dot and major.isdigit() and minor.isdigit():
            out[_pci_key(bus)] = f"{int(major)}.{int(minor)}"
    return out


_GPU_BRAND_RE = re.compile(r'<gpu id="([^"]+)">.*?<product_brand>([^<]*)</product_brand>', re.S)


def parse_brands(xml: str) -> dict[str, str]:
    """nvidia-smi -q -x -> {pci key: "nvidia"}; a GPU without a brand (N/A, Unknown) is skipped."""
    out = {}
    for bus, brand in _GPU_BRAND_RE.findall(xml):
        brand = " ".join(brand.split()).lower()
        if brand and not brand.startswith(("[", "n/a", "unknown")):
            out[_pci_key(bus)] = BRAND_NAMES.get(brand, brand.replace(" ", ""))
    return out


def _same_gpus(a: Discovery, b: Discovery) -> bool:
    return a.version == b.version and [(g.bus_id, g.uuid) for g in a.gpus] == [(g.bus_id, g.uuid) for g in b.gpus]


def _ask_driver(disc: Discovery, known: Discovery | None):
    """Start the driver root's own nvidia-smi on both questions (effects.Started), or None when there is nobody to ask:
    no GPU, no trusted nvidia-smi, or `known` already has the answers for these GPUs."""
    if known is not None and _same_gpus(disc, known):
        return None
    smi = next((b for b in disc.binaries.get("utility", ()) if b.endswith("/nvidia-smi")), None)
    if not disc.gpus or smi is None or not _trusted_exe(smi):
        return None
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
    nvml = next((lib.path for lib in disc.libraries.get("utility", ()) if lib.name == "libnvidia-ml"), None)
    if nvml:  # a driver root outside the host's ld.so.cache (/run/nvidia/driver): its nvidia-smi finds its NVML
        env["LD_LIBRARY_PATH"] = os.path.dirname(nvml)
    from provision import effects  # lazy: 13.4 ms (-X importtime -I -S, min of 15); only a refresh runs a process

    return effects.start_all({"arch": [smi, *ARCH_QUERY], "brand": [smi, *BRAND_QUERY]}, ARCH_TIMEOUT_S, env)


def _answered(disc: Discovery, asked, known: Discovery | None, warn: Callable[[str], None] | None) -> Discovery:
    """`disc` with each GPU's arch and brand: `known`'s for the same GPUs, else the driver's answers (`asked`)."""
    if known is not None and _same_gpus(disc, known):
        return replace(disc, gpus=tuple(replace(g, arch=k.arch, brand=k.brand) for g, k in zip(disc.gpus, known.gpus)))
    if asked is None:
        return disc
    res = asked.results()
    late = [what for name, what in (("arch", "compute capability"), ("brand", "brand")) if name in asked.late]
    if late and warn is not None:
        warn(f"the driver did not answer within {ARCH_TIMEOUT_S:g} s (nvidia-smi, a wedged GPU?): each GPU's "
             f"{' and '.join(late)} stay unknown, and containers that require them (NVIDIA_REQUIRE_*) are refused, "
             "until `gpuprov runtime install` rediscovers")
    text = {name: r.stdout if r is not None and r.returncode == 0 else "" for name, r in res.items()}
    arches, brands = parse_arches(text["arch"]), parse_brands(text["brand"])
    if not arches and not brands:
        return disc
    return replace(disc, gpus=tuple(replace(g, arch=arches.get(_pci_key(g.bus_id)), brand=brands.get(_pci_key(g.bus_id)))
                                    for g in disc.gpus))


def kernel_release(proc_root: str = "/") -> str:
    rel = _read(_join(proc_root, "proc/sys/kernel/osrelease")).strip()
    return rel or (os.uname().release if proc_root == "/" else "")


def firmware_needed(release: str) -> bool:
    """Only a kernel older than 5.7 loads GSP firmware from the mount namespace of the process that opened the GPU
    (see capabilities.FIRMWARE_FROM_INIT_NS); an unknown release counts as old (mounting it then is harmless)."""
    v = numbers(release)
    return len(v) < 2 or v[:2] < FIRMWARE_FROM_INIT_NS


def write_manifests(disc: Discovery, gen_dir: str = GENERATED_DIR) -> Discovery:
    """Write the rewritten copies that `disc`'s manifests need under gen_dir/<version>/; returns `disc` with those
    manifests' `generated` set. The directory is created root-owned 0755 and checked (no symlink, nobody else can
    write), because the runtime bind-mounts what is in it into every graphics container."""
    if not any(m.rewrite for m in disc.manifests):
        return disc
    d = os.path.join(gen_dir, disc.version or "unknown")
    make_dirs(d, 0o755)
    for p in (gen_dir, d):
        st = os.lstat(p)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise OSError(f"{p} must be a directory owned by uid {os.geteuid()} that only it can write")
    manifests = []
    for m in disc.manifests:
        if m.rewrite:
            text = _read(m.path).replace(json.dumps(m.library), json.dumps(m.rewrite))
            if m.path.endswith(".icd"):
                text = m.rewrite + "\n"
            target = os.path.join(d, os.path.basename(m.container_path))
            write_file(target, text, mode=0o644, keep_mode=False, backup=False)
            m = replace(m, generated=target)
        manifests.append(m)
    return replace(disc, manifests=tuple(manifests))


def host_key(proc_root: str = "/", watch: tuple[str, ...] = ()) -> str:
    """What a discovery depends on, read on every GPU start: the loaded module's version line, the NVIDIA modules
    loaded (/proc/modules: nvidia-uvm loaded after the cache was built), their character majors (/proc/devices: a
    major can move across a reboot), the boot id and the MIG layout (mig.layout_key: "" without instances; creating
    or destroying an instance changes it); then a stamp of each watched path (watched(): the driver's library
    directories, the /dev entries discovery looks for). Any change is a miss. Raw reads, bytes only: ~4 small procfs
    reads and no decoding, the MIG listdirs, one stat per watched path (bench/cache_hit_bench.py)."""
    version = _raw(_join(proc_root, "proc/driver/nvidia/version")).split(b"\n", 1)[0]
    modules = sorted(line.split(b" ", 1)[0] for line in _raw(_join(proc_root, "proc/modules")).split(b"\n")
                     if line.startswith(b"nvidia"))
    devices = _raw(_join(proc_root, "proc/devices"))
    char = devices[:devices.find(b"Block devices")] if b"Block devices" in devices else devices
    majors = sorted(line.strip() for line in char.split(b"\n") if b" nvidia" in line)
    boot = _raw(_join(proc_root, "proc/sys/kernel/random/boot_id")).strip()
    key = b"|".join((version, b",".join(modules), b",".join(majors), boot)).decode(errors="replace") + \
        mig.layout_key(proc_root)
    return key + "|" + ",".join(map(_stamp, watch)) if watch else key


def _stamp(path: str) -> str:
    """A path's identity and change time ("-": absent). A directory's ctime moves with every name added, removed or
    renamed in it (a package upgrade replacing libcuda.so.<old> by libcuda.so.<new>), and nobody can set it back."""
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}"


# What discovery's answer depends on besides /proc, under dev_root: the nodes and sockets it checks for (the runtime
# makes /dev/nvidia-modeset after a boot that did not; nvidia-persistenced starts after the cache was built; udev makes
# /dev/dri/card* after nvidia-drm loaded).
DEV_WATCH = ("dev/nvidia-modeset", "dev/dri", "var/run/nvidia-persistenced/socket")


def watched(driver_root: str, dev_root: str = "/") -> tuple[str, ...]:
    """The paths whose stamps join the host key: each library directory the driver root has (64- and 32-bit, once
    each: `lib -> lib64` is the same directory), so that an upgrade of the userspace under the loaded module is a
    miss, and DEV_WATCH. Known before discovery runs, so that refresh can read the key first."""
    from provision.facts.driver_facts import DRIVER_LIB_DIRS  # lazy: 7 ms, a refresh only

    out, seen = [], set()
    for d in (*DRIVER_LIB_DIRS, *DRIVER_LIB32_DIRS):
        full = _join(driver_root, d)
        try:
            st = os.stat(full)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            out.append(full)
    return (*out, *(_join(dev_root, p) for p in DEV_WATCH))


def _raw(path: str, limit: int = 1 << 20) -> bytes:
    """A procfs file's bytes (b"" when it cannot be read): os.read until the end, without a Python file object."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b""
    chunks: list[bytes] = []
    try:
        while sum(map(len, chunks)) < limit:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError:
        return b""
    finally:
        os.close(fd)
    return b"".join(chunks)


# The warm editor's last parse of the cache, kept while the file is the same one (inode, size, times): a container
# start then reads no JSON at all. Safe to share because a Discovery is immutable (frozen, tuples, read-only maps).
_parsed: tuple[tuple, Discovery] | None = None


def load_cached(cache_file: str = CACHE_FILE, proc_root: str = "/") -> Discovery | None:
    """The cached discovery when it is current (same schema, same host_key over the paths it watches); None is a
    miss: a missing, older, truncated or garbled cache is rebuilt by the caller (refresh)."""
    global _parsed
    try:  # only a cache nobody but root could have written (a user's rewrite would choose what gets mounted)
        fd, st = open_trusted_fd(cache_file)  # a raw fd: a warm start reads nothing from it
        try:
            ident = (cache_file, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if _parsed is not None and _parsed[0] == ident:
                disc = _parsed[1]
            else:
                disc = Discovery.from_json(read_fd(fd))
                _parsed = (ident, disc)
        finally:
            os.close(fd)
    except (OSError, ValueError):  # absent, unreadable or untrusted; or not JSON, or not this schema's form
        return None
    return disc if disc.key == host_key(proc_root, disc.watch) else None


# A directory's ctime comes from the kernel's coarse clock (one tick: 1-10 ms; whole seconds on a filesystem without
# sub-second times, such as ext4 with 128-byte inodes): a change within the tick its stamp was read in would leave
# the stamp as it was. refresh waits past the newest stamp's tick before reading the key.
STAMP_TICK_NS = 20_000_000
REFRESH_TRIES = 3  # discoveries a refresh makes while the host keeps changing under it (the driver asked once)


def _settled_key(proc_root: str, watch: tuple[str, ...]) -> str:
    """host_key, read once no watched path changed within its clock's last tick (so that any later change shows).
    Waits only right after a change (a driver being installed, a node just made): at most one tick."""
    newest = 0
    for p in watch:
        try:
            newest = max(newest, os.stat(p).st_ctime_ns)
        except OSError:
            pass
    tick = 1_000_000_000 if newest % 1_000_000_000 == 0 else STAMP_TICK_NS
    wait = newest + tick - time.time_ns()
    if wait > 0:
        time.sleep(min(wait, tick) / 1e9)
    return host_key(proc_root, watch)


def refresh(driver_root: str, cache_file: str = CACHE_FILE, proc_root: str = "/", dev_root: str = "/", *,
            warn: Callable[[str], None] | None = None, known: Discovery | None = None) -> Discovery:
    """Discover, and cache the result under the host key read *before* discovery ran, only if the key is still the
    same after it: a module loaded, a node made or the driver's files changed while discovery read them would
    otherwise be stored as never having happened, under a key that says it did. A host that keeps changing is
    rediscovered (REFRESH_TRIES), then answered uncached. The file is replaced whole (temp file + rename): a killed
    or concurrent writer leaves the old cache or another's whole one, each checked against the key when read."""
    watch = watched(driver_root, dev_root)
    for _ in range(REFRESH_TRIES):
        key = _settled_key(proc_root, watch)
        disc = discover(driver_root, proc_root=proc_root, dev_root=dev_root, arch=True, warn=warn, known=known)
        disc = write_manifests(disc, os.path.join(os.path.dirname(cache_file), "manifests"))
        if host_key(proc_root, watch) == key:
            disc = replace(disc, key=key, watch=watch)
            write_file(cache_file, disc.to_json(), mode=0o644, keep_mode=False, backup=False)
            return disc
        known = disc  # its answers stand for the same GPUs: a host moving under discovery costs no second question
    return disc
