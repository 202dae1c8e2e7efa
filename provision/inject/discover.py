"""Discovery: what a driver root offers, as plain data (JSON-serialisable dicts), precomputed and cached so that
a container start only reads one small file. Refreshed when the loaded driver's version line changes."""
from __future__ import annotations

import json
import os
import stat

from provision.fsutil import write_file
from provision.inject.capabilities import BINARIES, LIBRARIES
from provision.inject.capabilities import DRIVER_LIB_DIRS as LIB_DIRS

BIN_DIRS = ("bin", "usr/bin", "sbin", "usr/sbin")
CACHE_FILE = "/var/lib/gpuprov/runtime/discovery.json"
SCHEMA = 1


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


def _libraries(root: str, version: str) -> dict[str, list[dict]]:
    """Per capability: [{"name": libcuda, "path": host path of the versioned file, "soname": libcuda.so.1}]."""
    wanted = {lib: cap for cap, libs in LIBRARIES.items() for lib in libs}
    found: dict[str, list[dict]] = {}
    seen = set()
    for d in LIB_DIRS:
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
            soname = elf_soname(p)
            if soname is None:  # fixture or stripped: the `libX.so.N -> libX.so.<version>` link names it
                cands = [x for x in links.get(n, []) if x.startswith(base + ".so.")]
                soname = min(cands, key=len) if cands else n
            seen.add(base)
            found.setdefault(wanted[base], []).append({"name": base, "path": p, "soname": soname})
    return found


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


def _mig_devices(dev_root: str, caps_major: int | None) -> list[dict]:
    d = _join(dev_root, "dev/nvidia-caps")
    out = []
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return out
    for n in names:
        try:
            st = os.stat(os.path.join(d, n))
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out.append({"path": f"/dev/nvidia-caps/{n}", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev)})
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
    firmware = []
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
    return {
        "schema": SCHEMA,
        "driver_root": driver_root,
        "version": version,
        "libraries": _libraries(driver_root, version) if version else {},
        "binaries": _binaries(driver_root),
        "nodes": nodes,
        "gpus": gpus,
        "mig": _mig_devices(dev_root, majors.get("nvidia-caps")),
        "ipc": ipc,
        "firmware": firmware,
    }


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
    doc["key"] = version_key(proc_root)
    write_file(cache_file, json.dumps(doc), backup=False)
    return doc
