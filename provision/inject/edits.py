"""Edits (pure): a container's request (its env) + discovery -> the typed records it gets (`Edits`: device nodes,
device-cgroup rules, bind mounts, env), turned into OCI (or CDI) JSON only by whoever writes that JSON (`.oci()`,
`.cdi()`). No I/O here: every rule about *what* a GPU container gets lives in this file and is unit-tested.

    e = compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "0"})   # None: the container asked for no GPU
    e.devices, e.rules, e.mounts, e.env                        # tuples of DeviceNode, CgroupRule, Mount, EnvVar
    [d.oci() for d in e.devices]                               # linux.devices entries"""
from __future__ import annotations

import re

from provision.errors import Refused
from provision.inject.capabilities import CAPABILITIES, DEFAULT_CAPABILITIES, IMPLIES, LIB32_DEST, MIG_ENV
from provision.inject.records import Record, fields
from provision.share.limits import is_index
from provision.versions import numbers

TYPE_CHECKING = False  # not typing's: importing typing costs ~3 ms (-X importtime) on a GPU start's cold path
if TYPE_CHECKING:  # the records are only named in annotations: this module stays pure (no I/O module imported)
    from provision.inject.discover import Discovery, Gpu, Node

LIB_RO = ("ro", "nosuid", "nodev", "bind")
IPC_OPTS = ("nosuid", "nodev", "noexec", "bind")
PERSISTENCED_SOCKET = "/var/run/nvidia-persistenced/socket"  # where nvidia-smi and NVML look, host and container
DEBIAN_LIBDIR = "/usr/lib/x86_64-linux-gnu"
RHEL_LIBDIR = "/usr/lib64"
LIBDIR = "/usr/lib"  # musl's and single-directory glibc images' (neither Debian's nor the RHEL family's)
# CUDA version that each driver branch supports (driver major -> CUDA major.minor), newest first.
DRIVER_CUDA = ((595, "13.2"), (590, "13.1"), (580, "13.0"), (575, "12.9"), (570, "12.8"), (565, "12.7"),
               (560, "12.6"), (555, "12.5"), (550, "12.4"), (545, "12.3"), (535, "12.2"), (530, "12.1"),
               (525, "12.0"), (520, "11.8"), (515, "11.7"), (510, "11.6"), (495, "11.5"), (470, "11.4"),
               (465, "11.3"), (460, "11.2"), (455, "11.1"), (450, "11.0"), (440, "10.2"), (418, "10.1"))


# --- the records (records.py: tuples with named fields, µs to build on a cold start) ---

class DeviceNode(Record):
    """A character device the container gets: its path (the same in the host's and the container's /dev) and
    major:minor (ints), checked on the host before it is passed (modify.add_devices)."""
    __slots__ = ()
    FIELDS = ("path", "major", "minor")
    path, major, minor = fields(*FIELDS)

    def __new__(cls, path: str, major: int, minor: int) -> DeviceNode:
        return tuple.__new__(cls, (path, major, minor))

    def oci(self) -> dict:
        """A linux.devices entry."""
        return {"path": self.path, "type": "c", "major": self.major, "minor": self.minor, "fileMode": 0o666,
                "uid": 0, "gid": 0}

    def cdi(self) -> dict:
        """A CDI deviceNodes entry."""
        return {"path": self.path, "hostPath": self.path, "type": "c", "major": self.major, "minor": self.minor,
                "permissions": "rw"}


class CgroupRule(Record):
    """The device cgroup lets the container use character device major:minor with `access` ("rwm")."""
    __slots__ = ()
    FIELDS = ("major", "minor", "access")
    major, minor, access = fields(*FIELDS)

    def __new__(cls, major: int, minor: int, access: str) -> CgroupRule:
        return tuple.__new__(cls, (major, minor, access))

    def oci(self) -> dict:
        """A linux.resources.devices entry."""
        return {"allow": True, "type": "c", "major": self.major, "minor": self.minor, "access": self.access}


class Mount(Record):
    """A bind mount of a host file (`source`) at `destination` in the container; `options`: a tuple of mount
    options (LIB_RO, IPC_OPTS). The destination is the image's path before modify resolves it inside the rootfs."""
    __slots__ = ()
    FIELDS = ("source", "destination", "options")
    source, destination, options = fields(*FIELDS)

    def __new__(cls, source: str, destination: str, options: tuple[str, ...]) -> Mount:
        return tuple.__new__(cls, (source, destination, options))

    def oci(self, destination: str | None = None) -> dict:
        """A mounts entry (at `destination`: where the image resolves this mount's own destination)."""
        return {"destination": destination or self.destination, "source": self.source, "type": "bind",
                "options": list(self.options)}

    def cdi(self, destination: str | None = None) -> dict:
        """A CDI mounts entry (at `destination` when the spec mounts the same file in several places)."""
        return {"hostPath": self.source, "containerPath": destination or self.destination,
                "options": list(self.options)}


class EnvVar(Record):
    """A variable the container's process gets (ours replace the image's)."""
    __slots__ = ()
    FIELDS = ("name", "value")
    name, value = fields(*FIELDS)

    def __new__(cls, name: str, value: str) -> EnvVar:
        return tuple.__new__(cls, (name, value))

    def oci(self) -> str:
        """A process.env entry."""
        return f"{self.name}={self.value}"


class Edits(Record):
    """Everything one GPU container gets: tuples of DeviceNode, CgroupRule, Mount and EnvVar, in order, and the
    container paths it must not see (`masked`: runc's linux.maskedPaths; MIG containers only, mig.proc_masks)."""
    __slots__ = ()
    FIELDS = ("devices", "rules", "mounts", "env", "masked")
    devices, rules, mounts, env, masked = fields(*FIELDS)

    def __new__(cls, devices: tuple[DeviceNode, ...], rules: tuple[CgroupRule, ...], mounts: tuple[Mount, ...],
                env: tuple[EnvVar, ...], masked: tuple[str, ...] = ()) -> Edits:
        return tuple.__new__(cls, (devices, rules, mounts, env, masked))


def device_node(n: Node) -> DeviceNode:
    """The edit that passes a node discovery found."""
    return DeviceNode(n.path, n.major, n.minor)


def persistenced_mount(disc: Discovery) -> Mount | None:
    """nvidia-persistenced's socket (when it runs on the host): the one definition, for the runtime and CDI."""
    return Mount(disc.persistenced, PERSISTENCED_SOCKET, IPC_OPTS) if disc.persistenced else None


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
        else:
            match = []
        if not match:
            known = ", ".join(f"{g.index} ({g.uuid})" for g in gpus) or "none"
            raise Refused(f"NVIDIA_VISIBLE_DEVICES names unknown GPU {s!r}; this host has: {known}")
        chosen.extend(g for g in match if g not in chosen)
    return chosen



def cuda_version(driver_version: str | None) -> str | None:
    if not driver_version:
        return None
    major = numbers(driver_version)[0]
    return next((cuda for d, cuda in DRIVER_CUDA if major >= d), None)


# Go's strconv.ParseBool, which NVIDIA's toolkit reads NVIDIA_DISABLE_REQUIRE with (any other value: false).
PARSEBOOL_TRUE = ("1", "t", "T", "TRUE", "true", "True")
BRAND_UNKNOWN = "unknown (the driver did not report it when discovery ran: `gpuprov runtime install` refreshes it)"
UVM_MODULE = "nvidia-uvm"


def mismatch(kernel: str | None, userspace: str | None) -> str:
    """The one line for a loaded module whose userspace libraries are another version: the runtime's refusal and
    verify's finding (provision/verify/checks.py) say the same."""
    return (f"NVIDIA driver mismatch: the loaded kernel module is {kernel} but the driver's libraries are "
            f"{userspace} (\"Driver/library version mismatch\" in every CUDA program): reboot into {userspace}, or "
            f"reinstall the {kernel} userspace, or reload the module when no process holds it "
            "(`modprobe -r nvidia_uvm nvidia_drm nvidia_modeset nvidia && modprobe nvidia`)")


def driver_refusal(disc: Discovery, caps: list[str]) -> str | None:
    """Why a GPU container with these capabilities cannot start on this driver, or None. Never silently without
    libcuda or /dev/nvidia-uvm: a CUDA program in it would fail far from the cause."""
    if disc.userspace and disc.userspace != disc.version:
        return mismatch(disc.version, disc.userspace)
    if "compute" in caps:
        if not any(lib.name == "libcuda" for lib in disc.libraries.get("compute", ())):
            return (f"this container asks for compute but the driver root {disc.driver_root} has no libcuda.so."
                    f"{disc.version} (the loaded module's version): install the driver's userspace of that version")
        if disc.nodes.uvm is None:
            return (f"this container asks for compute but the {UVM_MODULE} kernel module is not loaded and could not "
                    f"be loaded: run `modprobe {UVM_MODULE}` (or `gpuprov cdi refresh`), then start it again")
    return None


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
    nums = list(numbers(".".join(x for x in v.split(".") if x)))
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
    if env.get("NVIDIA_DISABLE_REQUIRE", "") in PARSEBOOL_TRUE:
        return
    targets = [(f"GPU {g.index}", {**host, "brand": g.brand, "arch": g.arch}) for g in gpus] or [("", host)]
    for var in sorted(k for k in env if k.startswith("NVIDIA_REQUIRE_")):
        groups = env[var].split()
        for name, facts in targets:
            if groups and not any(all(_satisfied(c, facts, bool(name)) for c in g.split(",") if c) for g in groups):
                have = ", ".join(f"{k} {v}" for k, v in host.items() if v)
                if name:
                    have += f"; {name}: brand {facts['brand'] or BRAND_UNKNOWN}, arch {facts['arch'] or ARCH_UNKNOWN}"
                raise Refused(f"{var}={env[var]!r} is not satisfied by this host ({have})")


def driver_mounts(disc: Discovery, caps: list[str], *, libdir: str = DEBIAN_LIBDIR, with_firmware: bool = True
                  ) -> list[Mount]:
    """Read-only bind mounts for the capabilities: libraries at their SONAME in `libdir` (32-bit ones in the
    image's 32-bit dir with compat32), binaries in /usr/bin, loader manifests where the image's loaders look, and
    GSP firmware where the kernel would look for it (old kernels only). Nothing for a capability not asked for."""
    out: list[Mount] = []
    seen: set[str] = set()

    def add(source: str, destination: str) -> None:
        if destination not in seen:
            seen.add(destination)
            out.append(Mount(source, destination, LIB_RO))

    lib32dir = LIB32_DEST.get(libdir, "/usr/lib")
    for cap in caps:
        for lib in disc.libraries.get(cap, ()):
            add(lib.path, f"{libdir}/{lib.soname}")
            if cap == "graphics" and lib.name == "libnvidia-allocator":  # Mesa's libgbm loads NVIDIA's backend
                add(lib.path, f"{libdir}/gbm/nvidia-drm_gbm.so")  # by this name (nvidia-ctk: a symlink)
        if "compat32" in caps:
            for lib in disc.libraries32.get(cap, ()):
                add(lib.path, f"{lib32dir}/{lib.soname}")
        for path in disc.binaries.get(cap, ()):
            add(path, "/usr/bin/" + path.rsplit("/", 1)[-1])
        for man in disc.manifests:
            if man.cap == cap and man.source:  # no source: its rewritten copy is not written (never the host path)
                add(man.source, man.container_path)
    if with_firmware and disc.firmware_needed:
        for fw in disc.firmware:
            add(fw.path, fw.container_path)
    return out


# driver_mounts' answers for the discovery they were computed from (held, so its identity cannot be reused): a
# function of the driver's files and the request's capability set, library directory and firmware alone, and the
# same for every start of the warm editor until discovery changes (a new Discovery: the memo starts over). The
# image's part (where each destination resolves inside it, the sources' checks) is done per start by modify.
_mounts_memo: tuple[object, dict[tuple, tuple[Mount, ...]]] | None = None


def driver_mounts_for(disc: Discovery, caps: list[str], libdir: str, with_firmware: bool) -> tuple[Mount, ...]:
    """driver_mounts, once per (discovery, capabilities, libdir, firmware) in a process: ~10-25 us a start."""
    global _mounts_memo
    if _mounts_memo is None or _mounts_memo[0] is not disc:
        _mounts_memo = (disc, {})
    key = (tuple(caps), libdir, with_firmware)
    got = _mounts_memo[1].get(key)
    if got is None:
        got = _mounts_memo[1][key] = tuple(driver_mounts(disc, caps, libdir=libdir, with_firmware=with_firmware))
    return got


def select_devices(selectors: list[str], disc: Discovery, env: dict[str, str], privileged: bool
                   ) -> tuple[list[Gpu], list[Node], list[str], list[str]]:
    """The GPUs whose /dev/nvidiaN the container gets (whole GPUs asked for, and each MIG device's parent), the
    MIG capability nodes it gets (mig.py: each instance's GI and CI access nodes; config/monitor for privileged
    containers that ask), the names it sees in NVIDIA_VISIBLE_DEVICES, and, for a container given a MIG device or
    capability, the /proc/driver/nvidia paths it must not see (mig.proc_masks). `all` is every GPU and MIG device."""
    mig_sel = [s for s in selectors if s.startswith("MIG-") or ":" in s]
    gpus = select_gpus([s for s in selectors if s not in mig_sel], disc.gpus) if len(mig_sel) < len(selectors) else []
    visible = [g.uuid or str(g.index) for g in gpus]
    if not mig_sel and (disc.mig is None or not disc.mig.devices) and not any(
            env.get(v, "").strip() for v in MIG_ENV):
        return gpus, [], visible, []  # no MIG request on a host without instances: as before MIG
    from provision.inject import mig  # lazy: 0.3 ms (-X importtime -I -S, min of 5); MIG requests or instances only

    devices = list(disc.mig.devices) if selectors == ["all"] and disc.mig is not None else mig.select(mig_sel, disc.mig)
    parents = {d.gpu for d in devices}
    gpus += [g for g in disc.gpus if g.index in parents and g not in gpus]
    if selectors != ["all"]:
        visible += [d.uuid or d.ids for d in devices]
    caps: list[Node] = []
    admin = mig.admin_nodes(env, disc.mig, privileged)
    for n in [n for d in devices for n in disc.mig.nodes(d)] + admin:
        if n not in caps:  # two CIs of one GI share its access node
            caps.append(n)
    # a container given whole GPUs only (on a MIG host) sees /proc as before; one given MIG sees only its own there
    masked = mig.proc_masks(disc.mig, devices, admin, disc.gpus, gpus) if devices or admin else []
    return gpus, caps, visible, masked


def compute_edits(disc: Discovery, env: dict[str, str], *, libdir: str = DEBIAN_LIBDIR,
                  selectors: list[str] | None = None, privileged: bool = False, compat=None) -> Edits | None:
    """The edits for one container, or None when it asked for no GPU. Raises Refused. `privileged`: the container
    has CAP_SYS_ADMIN (only then may NVIDIA_MIG_CONFIG_DEVICES / _MONITOR_DEVICES give it MIG's admin nodes).
    `compat`: the image's CUDA forward-compatibility libraries (compat.find); when compat.decide says they apply,
    they are mounted where the host's would be and NVIDIA_REQUIRE_CUDA is judged against their CUDA."""
    if selectors is None:
        selectors = requested_devices(env)
    if selectors is None:
        return None
    if not disc.version:
        raise Refused("this container asks for a GPU but no NVIDIA driver is loaded on the host (see gpuprov detect)")
    caps = capabilities(env)
    why = driver_refusal(disc, caps)
    if why:
        raise Refused(why)
    gpus, caps_nodes, visible, masked = select_devices(selectors, disc, env, privileged) if selectors else ([], [], [], [])
    host = {"cuda": cuda_version(disc.version), "driver": disc.version}
    swap: dict[str, str] = {}
    if compat is not None and "compute" in caps:
        from provision.inject.compat import decide  # lazy: 0.2 ms (-X importtime -I -S); images with compat libraries

        if decide(compat, disc.version, [g.model for g in gpus]):
            host["cuda"] = compat.cuda or cuda_version(compat.version)
            swap = {f"{libdir}/{lib.soname}": compat.files[lib.name] for cap in caps
                    for lib in disc.libraries.get(cap, ()) if lib.name in compat.files}
    check_requirements(env, host, gpus)
    ctl = disc.nodes
    nodes = [ctl.ctl]
    if "compute" in caps:
        nodes += [n for n in (ctl.uvm, ctl.uvm_tools) if n is not None]
    if "display" in caps and ctl.modeset is not None:
        nodes.append(ctl.modeset)
    nodes += [g.node for g in gpus] + caps_nodes
    if "graphics" in caps or "display" in caps:
        nodes += [n for g in gpus for n in g.drm]
    mounts = list(driver_mounts_for(disc, caps, libdir, bool(gpus)))
    if swap:
        mounts = [Mount(swap.get(m.destination, m.source), m.destination, m.options) for m in mounts]
    ipc = persistenced_mount(disc) if "utility" in caps else None
    if ipc is not None:
        mounts.append(ipc)
    return Edits(
        devices=tuple(device_node(n) for n in nodes),
        rules=tuple(CgroupRule(n.major, n.minor, "rwm") for n in nodes),
        mounts=tuple(mounts),
        env=(EnvVar("NVIDIA_VISIBLE_DEVICES", ",".join(visible) or "none"),
             EnvVar("NVIDIA_DRIVER_CAPABILITIES", ",".join(caps))),
        masked=tuple(masked),
    )
