"""Discovery: what a driver root offers, as plain data (JSON-serialisable dicts), precomputed and cached so that
a container start only reads one small file. Refreshed when the loaded driver's version line changes."""
from __future__ import annotations

import json
import os
import stat

from provision import paths
from provision.facts.driver_facts import DRIVER_LIB_DIRS as LIB_DIRS
from provision.fsutil import write_file
from provision.inject.capabilities import (
    BINARIES,
    DRIVER_LIB32_DIRS,
    FIRMWARE_FROM_INIT_NS,
    LIBRARIES,
    MANIFEST_DIRS,
    MANIFESTS,
)

BIN_DIRS = ("bin", "usr/bin", "sbin", "usr/sbin")
CACHE_FILE = paths.DISCOVERY_CACHE
# Manifests whose library_path had to be rewritten are written here (root-owned, 0755; persistent, so that a CDI
# spec in /etc/cdi that names them stays valid across reboots). One sub-directory per driver version.
GENERATED_DIR = paths.GENERATED_MANIFESTS
SCHEMA = 2


def _join(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def elf_soname(path: str) -> str | None:
    """DT_SONAME of a 64-bit little-endian ELF file, or None (also for non-ELF files such as fixtures)."""
    import struct

    try:
        with open(path, "rb") as fh:
            ident = fh.read(64)
            if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
                return None
            shoff, = struct.unpack_from("<Q", ident, 0x28)
            shentsize, shnum = struct.unpack_from("<HH", ident, 0x3A)
            fh.seek(shoff)
            sh = fh.read(shentsize * shnum)
            secs = [struct.unpack_from("<IIQQQQIIQQ", sh, i * shentsize) for i in range(shnum)]
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


def _libraries(root: str, version: str, dirs: tuple[str, ...] = LIB_DIRS, elf64: bool = True) -> dict[str, list[dict]]:
    """Per capability: [{"name": libcuda, "path": host path of the versioned file, "soname": libcuda.so.1}]."""
    wanted: dict[str, list[str]] = {}
    for cap, libs in LIBRARIES.items():
        for lib in libs:
            wanted.setdefault(lib, []).append(cap)
    found: dict[str, list[dict]] = {}
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
            for cap in wanted[base]:
                found.setdefault(cap, []).append({"name": base, "path": p, "soname": soname})
    return found


def _libraries32(root: str, version: str) -> dict[str, list[dict]]:
    """32-bit builds of the same libraries (compat32). A 64-bit ELF in a shared dir such as usr/lib is skipped."""
    out = _libraries(root, version, DRIVER_LIB32_DIRS, elf64=False)
    for cap, libs in list(out.items()):
        out[cap] = [lib for lib in libs if _elf_class(lib["path"]) != 2]
    return {c: v for c, v in out.items() if v}


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


def _manifests(root: str) -> list[dict]:
    """[{"cap", "path": host file, "container_path", "library": what it names, "rewrite": bare name or None}].
    A manifest naming its library by an absolute host path (some distro packages do) would point the image's
    loader at a path that does not exist in the container: it gets a rewritten copy naming the bare SONAME."""
    import glob

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
                out.append({"cap": cap, "path": h, "container_path": cpath, "library": lib, "rewrite": rewrite})
            break
    return out


def _platform_libraries(root: str, manifests: list[dict], have: set[str]) -> list[dict]:
    """Libraries that EGL external-platform manifests name (libnvidia-egl-gbm.so.1, -wayland, -xcb…): they carry
    their own version, not the driver's, so the version scan does not see them."""
    out = []
    for m in manifests:
        name = os.path.basename(m["library"] or "")
        if m["cap"] != "graphics" or not name.startswith("libnvidia-egl-") or name in have:
            continue
        for d in LIB_DIRS:
            p = _join(root, f"{d}/{name}")
            if os.path.exists(p):
                real = os.path.realpath(p)
                out.append({"name": name.partition(".so")[0], "path": real, "soname": name})
                have.add(name)
                break
    return out


def _binaries(root: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for cap, names in BINARIES.items():
        for n in names:
            for d in BIN_DIRS:
                p = _join(root, f"{d}/{n}")
                if os.path.isfile(p) and not os.path.islink(p):
                    out.setdefault(cap, []).append(p)
                    break
    return out


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


def gpus_from_proc(proc_root: str) -> list[dict]:
    base = _join(proc_root, "proc/driver/nvidia/gpus")
    out = []
    try:
        buses = sorted(os.listdir(base))
    except OSError:
        return []
    for bus in buses:
        info = {}
        for line in _read(os.path.join(base, bus, "information")).splitlines():
            k, _, v = line.partition(":")
            info[k.strip()] = v.strip()
        minor = int(info.get("Device Minor", len(out)))
        out.append({"bus_id": info.get("Bus Location", bus), "uuid": info.get("GPU UUID"), "minor": minor,
                    "model": info.get("Model")})
    out.sort(key=lambda g: g["bus_id"])  # nvidia-smi indexes GPUs by PCI bus order
    for i, g in enumerate(out):
        g["index"] = i
    return out


def _drm_nodes(sys_root: str, dev_root: str, bus_id: str) -> list[dict]:
    """The GPU's /dev/dri/card* and renderD* (present when nvidia-drm is loaded): graphics and display need them."""
    try:
        names = sorted(os.listdir(_join(sys_root, f"sys/bus/pci/devices/{bus_id.lower()}/drm")))
    except OSError:
        return []
    out = []
    for n in names:
        if not n.startswith(("card", "renderD")):
            continue
        try:
            st = os.stat(_join(dev_root, f"dev/dri/{n}"))
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out.append({"path": f"/dev/dri/{n}", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev)})
    return out


def driver_version(proc_root: str, driver_root: str) -> str | None:
    """The loaded module's version, else the driver root's userspace version (only on a cache refresh: the
    facts module is imported here, not on every container start)."""
    from pathlib import Path

    from provision.facts.driver_facts import parse_nvrm, userspace_version

    return parse_nvrm(_read(_join(proc_root, "proc/driver/nvidia/version")))[0] or userspace_version(Path(driver_root))


def discover(driver_root: str = "/", *, proc_root: str = "/", dev_root: str = "/") -> dict:
    """Everything the runtime, CDI and docker-args need, as one JSON-serialisable dict."""
    version = driver_version(proc_root, driver_root)
    majors = char_majors(_read(_join(proc_root, "proc/devices")))
    gpus = gpus_from_proc(proc_root)
    nvidia_major = majors.get("nvidia-frontend", majors.get("nvidia", 195))
    nodes = {"ctl": {"path": "/dev/nvidiactl", "major": nvidia_major, "minor": 255}}
    if "nvidia-uvm" in majors:
        nodes["uvm"] = {"path": "/dev/nvidia-uvm", "major": majors["nvidia-uvm"], "minor": 0}
        nodes["uvm-tools"] = {"path": "/dev/nvidia-uvm-tools", "major": majors["nvidia-uvm"], "minor": 1}
    if os.path.exists(_join(dev_root, "dev/nvidia-modeset")):
        nodes["modeset"] = {"path": "/dev/nvidia-modeset", "major": nvidia_major, "minor": 254}
    for g in gpus:
        g["node"] = {"path": f"/dev/nvidia{g['minor']}", "major": nvidia_major, "minor": g["minor"]}
        g["drm"] = _drm_nodes(proc_root, dev_root, g["bus_id"])
    firmware: list[dict] = []
    if version:
        for fw_root in (driver_root, "/"):
            fwdir = _join(fw_root, f"lib/firmware/nvidia/{version}")
            if not os.path.isdir(fwdir):
                fwdir = _join(fw_root, f"firmware/nvidia/{version}")
            if os.path.isdir(fwdir):
                firmware = [{"path": os.path.join(fwdir, n), "container_path": f"/lib/firmware/nvidia/{version}/{n}"}
                            for n in sorted(os.listdir(fwdir)) if n.startswith("gsp")]
                break
    ipc = {}
    sock = _join(dev_root, "var/run/nvidia-persistenced/socket")
    if os.path.exists(sock):
        ipc["persistenced"] = sock
    libraries = _libraries(driver_root, version) if version else {}
    manifests = _manifests(driver_root)
    extra = _platform_libraries(driver_root, manifests, {lib["soname"] for v in libraries.values() for lib in v})
    if extra:
        libraries.setdefault("graphics", []).extend(extra)
    return {
        "schema": SCHEMA,
        "driver_root": driver_root,
        "version": version,
        "libraries": libraries,
        "libraries32": _libraries32(driver_root, version) if version else {},
        "manifests": manifests,
        "firmware_needed": firmware_needed(kernel_release(proc_root)),
        "binaries": _binaries(driver_root),
        "nodes": nodes,
        "gpus": gpus,
        "ipc": ipc,
        "firmware": firmware,
    }


def kernel_release(proc_root: str = "/") -> str:
    rel = _read(_join(proc_root, "proc/sys/kernel/osrelease")).strip()
    return rel or (os.uname().release if proc_root == "/" else "")


def firmware_needed(release: str) -> bool:
    """Only a kernel older than 5.7 loads GSP firmware from the mount namespace of the process that opened the GPU
    (see capabilities.FIRMWARE_FROM_INIT_NS); an unknown release counts as old (mounting it then is harmless)."""
    from provision.inject.edits import _vtuple

    v = _vtuple(release)
    return len(v) < 2 or v[:2] < FIRMWARE_FROM_INIT_NS


def write_manifests(doc: dict, gen_dir: str = GENERATED_DIR) -> dict:
    """Write the rewritten copies that `doc`'s manifests need under gen_dir/<version>/ and point their `source`
    there. The directory is created root-owned 0755 and checked (no symlink, nobody else can write), because the
    runtime bind-mounts what is in it into every graphics container."""
    todo = [m for m in doc.get("manifests", []) if m.get("rewrite")]
    if not todo:
        return doc
    d = os.path.join(gen_dir, doc.get("version") or "unknown")
    os.makedirs(d, mode=0o755, exist_ok=True)
    for p in (gen_dir, d):
        st = os.lstat(p)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise OSError(f"{p} must be a directory owned by uid {os.geteuid()} that only it can write")
    for m in todo:
        text = _read(m["path"]).replace(json.dumps(m["library"]), json.dumps(m["rewrite"]))
        if m["path"].endswith(".icd"):
            text = m["rewrite"] + "\n"
        target = os.path.join(d, os.path.basename(m["container_path"]))
        write_file(target, text, mode=0o644, keep_mode=False, backup=False)
        m["generated"] = target
    return doc


def version_key(proc_root: str = "/") -> str:
    """Cheap key that changes when the loaded driver changes: the kernel module's version line."""
    return _read(_join(proc_root, "proc/driver/nvidia/version")).split("\n", 1)[0]


def load_cached(cache_file: str = CACHE_FILE, proc_root: str = "/") -> dict | None:
    try:
        with open(cache_file) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    if doc.get("schema") != SCHEMA or doc.get("key") != version_key(proc_root):
        return None
    return doc


def refresh(driver_root: str, cache_file: str = CACHE_FILE, proc_root: str = "/", dev_root: str = "/") -> dict:
    doc = discover(driver_root, proc_root=proc_root, dev_root=dev_root)
    write_manifests(doc, os.path.join(os.path.dirname(cache_file), "manifests"))
    doc["key"] = version_key(proc_root)
    write_file(cache_file, json.dumps(doc), backup=False)
    return doc
