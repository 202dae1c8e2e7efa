"""Edits (pure): a container's request (its env) + discovery -> device nodes, bind mounts and env to add.
No I/O here: every rule about *what* a GPU container gets lives in this file and is unit-tested."""
from __future__ import annotations

import re

from provision.errors import Refused
from provision.inject.capabilities import CAPABILITIES, DEFAULT_CAPABILITIES, IMPLIES, LIB32_DEST
from provision.share.limits import is_index

TYPE_CHECKING = False  # not typing's: importing typing costs ~3 ms (-X importtime) on a GPU start's cold path
if TYPE_CHECKING:  # the records are only named in annotations: this module stays pure (no I/O module imported)
    from provision.inject.discover import Discovery, Gpu, Node

LIB_RO = ["ro", "nosuid", "nodev", "bind"]
IPC_OPTS = ["nosuid", "nodev", "noexec", "bind"]
DEBIAN_LIBDIR = "/usr/lib/x86_64-linux-gnu"
RHEL_LIBDIR = "/usr/lib64"
# CUDA version that each driver branch supports (driver major -> CUDA major.minor), newest first.
DRIVER_CUDA = ((595, "13.2"), (590, "13.1"), (580, "13.0"), (575, "12.9"), (570, "12.8"), (565, "12.7"),
               (560, "12.6"), (555, "12.5"), (550, "12.4"), (545, "12.3"), (535, "12.2"), (530, "12.1"),
               (525, "12.0"), (520, "11.8"), (515, "11.7"), (510, "11.6"), (495, "11.5"), (470, "11.4"),
               (465, "11.3"), (460, "11.2"), (455, "11.1"), (450, "11.0"), (440, "10.2"), (418, "10.1"))


def env_dict(env_list: list[str] | None) -> dict[str, str]:
    out = {}
    for item in env_list or []:
        k, sep, v = item.partition("=")
        if sep:
            out[k] = v  # later entries win, as in execve's environment
    return out


def requested_devices(env: dict[str, str]) -> list[str] | None:
    """None: not a GPU container (unset, empty, void). []: driver only, no GPU (none). Else the selectors."""
    raw = env.get("NVIDIA_VISIBLE_DEVICES")
    if raw is None:
        return None
    raw = raw.strip()
    if raw in ("", "void"):
        return None
    if raw == "none":
        return []
    return [x.strip() for x in raw.split(",") if x.strip()]


def capabilities(env: dict[str, str]) -> list[str]:
    raw = env.get("NVIDIA_DRIVER_CAPABILITIES", "").strip()
    if not raw:
        caps = list(DEFAULT_CAPABILITIES)
    elif raw == "all":
        caps = list(CAPABILITIES)
    else:
        caps = [c.strip() for c in raw.split(",") if c.strip()]
        unknown = [c for c in caps if c not in CAPABILITIES]
        if unknown:
            raise Refused(f"unknown NVIDIA_DRIVER_CAPABILITIES {','.join(unknown)}: use {','.join(CAPABILITIES)} or all")
    for c in list(caps):
        caps.extend(x for x in IMPLIES.get(c, ()) if x not in caps)
    return caps


def select_gpus(selectors: list[str], gpus: tuple[Gpu, ...]) -> list[Gpu]:
    if selectors == ["all"]:
        return list(gpus)
    chosen = []
    for s in selectors:
        if is_index(s):
            match = [g for g in gpus if g.index == int(s)]
        elif s.startswith("GPU-"):
            match = [g for g in gpus if (g.uuid or "").lower().startswith(s.lower())]
            if len(match) > 1:  # a prefix must name one GPU, never several (tests/faults/test_detect_selectors.py)
                raise Refused(f"NVIDIA_VISIBLE_DEVICES={s!r} is ambiguous: it is the start of "
                              f"{', '.join(g.uuid or '' for g in match)}; give more of the UUID")
        elif s.startswith("MIG-") or (s.count(":") == 1 and is_index(s.replace(":", ""))):
            raise Refused(f"MIG device {s} requested but no MIG instances are configured on this host")
        else:
            match = []
        if not match:
            known = ", ".join(f"{g.index} ({g.uuid})" for g in gpus) or "none"
            raise Refused(f"NVIDIA_VISIBLE_DEVICES names unknown GPU {s!r}; this host has: {known}")
        chosen.extend(g for g in match if g not in chosen)
    return chosen


def _vtuple(v: str) -> tuple[int, ...]:
    """"12.2" -> (12, 2); "535.161.08" -> (535, 161, 8). (No `re`: this module runs on every GPU start.)"""
    out = []
    for part in v.split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def cuda_version(driver_version: str | None) -> str | None:
    if not driver_version:
        return None
    major = _vtuple(driver_version)[0]
    return next((cuda for d, cuda in DRIVER_CUDA if major >= d), None)


def brand_of(model: str | None) -> str:
    m = (model or "").lower()
    for b in ("tesla", "quadro", "geforce", "titan", "nvs", "grid"):
        if b in m:
            return b
    return "nvidia"


OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "=": lambda a, b: a == b, "==": lambda a, b: a == b,
       "!=": lambda a, b: a != b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}
CONSTRAINT_PATTERN = r"^(cuda|driver|arch|brand)(>=|<=|==|!=|=|>|<)(\S+)$"
DEVICE_KEYS = ("brand", "arch")  # a property of each selected GPU; the others are the host's (its driver)
ARCH_UNKNOWN = "unknown (the driver did not report it when discovery ran: `gpuprov runtime install` refreshes it)"


def _version(v: str) -> tuple[int, ...] | None:
    """A version as libnvidia-container compares it (src/cli/dsl.c, dsl_compare_version): digits and dots only,
    number by number, and trailing zero parts do not count ("9" == "9.0", "9.0.1" > "9.0"). None: not a version."""
    if not v[:1].isdigit() or v.strip("0123456789."):
        return None
    nums = [int(x) for x in v.split(".") if x]
    while nums and nums[-1] == 0:
        nums.pop()
    return tuple(nums)


def _satisfied(constraint: str, facts: dict[str, str | None], device: bool = True) -> bool:
    m = re.match(CONSTRAINT_PATTERN, constraint)
    if not m:
        raise Refused(f"malformed requirement {constraint!r}: expected e.g. cuda>=12.2, driver>=535, arch>=8.0, "
                      "brand=tesla")
    key, op, want = m.groups()
    if key == "brand":
        if op not in ("=", "==", "!="):
            raise Refused(f"malformed requirement {constraint!r}: a brand is compared with = or != only")
    elif _version(want) is None:
        raise Refused(f"malformed requirement {constraint!r}: {want!r} is not a version (digits and dots)")
    if key in DEVICE_KEYS and not device:
        return True  # no GPU selected (NVIDIA_VISIBLE_DEVICES=none): as libnvidia-container, nothing to compare
    have = facts.get(key)
    if have is None:
        return False
    if key == "brand":
        return OPS[op](have.lower(), want.lower())
    have_v = _version(have)
    return have_v is not None and OPS[op](have_v, _version(want))


def check_requirements(env: dict[str, str], host: dict[str, str | None], gpus: list[Gpu] | tuple[Gpu, ...] = ()
                       ) -> None:
    """NVIDIA_REQUIRE_*: space = OR between groups, comma = AND within one, variables ANDed. As libnvidia-container
    (src/cli/configure.c) does, every selected GPU must satisfy each variable with its own brand and arch (its CUDA
    compute capability, from the driver); with no GPU selected only cuda and driver are checked."""
    if env.get("NVIDIA_DISABLE_REQUIRE", "").lower() in ("1", "true", "yes"):
        return
    targets = [(f"GPU {g.index}", {**host, "brand": brand_of(g.model), "arch": g.arch}) for g in gpus] or [("", host)]
    for var in sorted(k for k in env if k.startswith("NVIDIA_REQUIRE_")):
        groups = env[var].split()
        for name, facts in targets:
            if groups and not any(all(_satisfied(c, facts, bool(name)) for c in g.split(",") if c) for g in groups):
                have = ", ".join(f"{k} {v}" for k, v in host.items() if v)
                if name:
                    have += f"; {name}: brand {facts['brand']}, arch {facts['arch'] or ARCH_UNKNOWN}"
                raise Refused(f"{var}={env[var]!r} is not satisfied by this host ({have})")


def _node(n: Node) -> dict:
    return {"path": n.path, "type": "c", "major": n.major, "minor": n.minor, "fileMode": 0o666, "uid": 0, "gid": 0}


def _ro(source: str, destination: str) -> dict:
    return {"destination": destination, "source": source, "type": "bind", "options": list(LIB_RO)}


def driver_mounts(disc: Discovery, caps: list[str], *, libdir: str = DEBIAN_LIBDIR, with_firmware: bool = True
                  ) -> list[dict]:
    """Read-only bind mounts for the capabilities: libraries at their SONAME in `libdir` (32-bit ones in the
    image's 32-bit dir with compat32), binaries in /usr/bin, loader manifests where the image's loaders look, and
    GSP firmware where the kernel would look for it (old kernels only). Nothing for a capability not asked for."""
    out: list[dict] = []
    seen: set[str] = set()

    def add(m: dict) -> None:
        if m["destination"] not in seen:
            seen.add(m["destination"])
            out.append(m)

    lib32dir = LIB32_DEST.get(libdir, "/usr/lib")
    for cap in caps:
        for lib in disc.libraries.get(cap, ()):
            add(_ro(lib.path, f"{libdir}/{lib.soname}"))
            if cap == "graphics" and lib.name == "libnvidia-allocator":  # Mesa's libgbm loads NVIDIA's backend
                add(_ro(lib.path, f"{libdir}/gbm/nvidia-drm_gbm.so"))  # by this name (nvidia-ctk: a symlink)
        if "compat32" in caps:
            for lib in disc.libraries32.get(cap, ()):
                add(_ro(lib.path, f"{lib32dir}/{lib.soname}"))
        for path in disc.binaries.get(cap, ()):
            add(_ro(path, "/usr/bin/" + path.rsplit("/", 1)[-1]))
        for man in disc.manifests:
            if man.cap == cap and man.source:  # no source: its rewritten copy is not written (never the host path)
                add(_ro(man.source, man.container_path))
    if with_firmware and disc.firmware_needed:
        for fw in disc.firmware:
            add(_ro(fw.path, fw.container_path))
    return out


def compute_edits(disc: Discovery, env: dict[str, str], *, libdir: str = DEBIAN_LIBDIR,
                  selectors: list[str] | None = None) -> dict | None:
    """OCI edits for one container, or None when it asked for no GPU. Raises Refused."""
    if selectors is None:
        selectors = requested_devices(env)
    if selectors is None:
        return None
    if not disc.version:
        raise Refused("this container asks for a GPU but no NVIDIA driver is loaded on the host (see gpuprov detect)")
    caps = capabilities(env)
    gpus = select_gpus(selectors, disc.gpus) if selectors else []
    check_requirements(env, {"cuda": cuda_version(disc.version), "driver": disc.version}, gpus)
    ctl = disc.nodes
    nodes = [ctl.ctl]
    if "compute" in caps:
        nodes += [n for n in (ctl.uvm, ctl.uvm_tools) if n is not None]
    if "display" in caps and ctl.modeset is not None:
        nodes.append(ctl.modeset)
    nodes += [g.node for g in gpus]
    if "graphics" in caps or "display" in caps:
        nodes += [n for g in gpus for n in g.drm]
    mounts = driver_mounts(disc, caps, libdir=libdir, with_firmware=bool(gpus))
    if "utility" in caps and disc.persistenced:
        mounts.append({"destination": "/var/run/nvidia-persistenced/socket", "source": disc.persistenced,
                       "type": "bind", "options": list(IPC_OPTS)})
    return {
        "devices": [_node(n) for n in nodes],
        "allow": [{"allow": True, "type": "c", "major": n.major, "minor": n.minor, "access": "rwm"} for n in nodes],
        "mounts": mounts,
        "env": {"NVIDIA_VISIBLE_DEVICES": ",".join(g.uuid or str(g.index) for g in gpus) or "none",
                "NVIDIA_DRIVER_CAPABILITIES": ",".join(caps)},
    }
