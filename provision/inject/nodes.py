"""NVIDIA's kernel modules and device nodes, made as `nvidia-modprobe` makes them (read from NVIDIA/nvidia-modprobe,
modprobe-utils/nvidia-modprobe-utils.c; written here): Debian's driver loads only nvidia and nvidia-drm at boot, and
nothing loads nvidia-uvm or creates /dev/nvidia-uvm until a CUDA program on the host runs nvidia-modprobe. Without
them a GPU container gets nvidia-smi but no CUDA.

- Modules: `modprobe nvidia-uvm` (and nvidia-modeset where display needs it), only while the nvidia module is
  loaded, with the modprobe the kernel names (/proc/sys/kernel/modprobe), always under a deadline (a start never
  hangs: a modprobe that does not finish in time is killed and never waited for).
- Nodes: only the missing ones, and only for a module that is loaded (its major is in /proc/devices):
  /dev/nvidiaN (minor N), /dev/nvidiactl (255), /dev/nvidia-modeset (254) on the nvidia major with the uid, gid and
  mode the module's parameters name (/proc/driver/nvidia/params: DeviceFileUID/GID/Mode; ModifyDeviceFiles=0: make
  none), /dev/nvidia-uvm (0) and -tools (1) on nvidia-uvm's major, root:root 0666. A path that exists is never
  replaced. Each node made gets its /dev/char/MAJ:MIN link (link_dev_char).

Run at boot (the gpuprov-cdi-refresh unit: `gpuprov cdi refresh`), by `gpuprov runtime install`, and on the
container-start path when a node the container needs is missing. Import-light (os, stat): the start path loads it."""
from __future__ import annotations

import os
import stat

from provision.inject.discover import _join, _read, _trusted_exe, char_majors

UVM = "nvidia-uvm"
MODESET = "nvidia-modeset"
CTL_MINOR, MODESET_MINOR = 255, 254  # nvidia-modprobe's NV_CTL_DEVICE_NUM, NV_MODESET_MINOR_DEVICE_NUM
MODE, UID, GID = 0o666, 0, 0  # NV_DEVICE_FILE_MODE/UID/GID: nvidia-modprobe's defaults, and uvm's always
MODPROBE_TIMEOUT_S = 10.0  # boot and `runtime install`
START_MODPROBE_TIMEOUT_S = 5.0  # a container start waits no longer than this for a module
LIVE_MODPROBE = "/sbin/modprobe"  # nvidia-modprobe's default when the kernel names none


def loaded_modules(proc_root: str = "/") -> set[str]:
    """The kernel modules loaded now (/proc/modules), by their kernel names (nvidia_uvm)."""
    return {line.split(" ", 1)[0] for line in _read(_join(proc_root, "proc/modules")).splitlines() if line}


def driver_loaded(proc_root: str = "/") -> bool:
    return os.path.exists(_join(proc_root, "proc/driver/nvidia/version"))


def file_params(proc_root: str = "/") -> tuple[int, int, int, bool]:
    """(uid, gid, mode, modify) for the nvidia module's nodes, from its parameters (nvidia-modprobe's
    init_device_file_parameters)."""
    uid, gid, mode, modify = UID, GID, MODE, True
    for line in _read(_join(proc_root, "proc/driver/nvidia/params")).splitlines():
        name, _, value = line.partition(":")
        try:
            v = int(value.strip())
        except ValueError:
            continue
        if name == "DeviceFileUID":
            uid = v
        elif name == "DeviceFileGID":
            gid = v
        elif name == "DeviceFileMode":
            mode = v & 0o777
        elif name in ("ModifyDeviceFiles", "DeviceFileModify"):
            modify = v == 1
    return uid, gid, mode, modify


def wanted(proc_root: str = "/") -> list[tuple[str, int, int, tuple[int, int, int] | None]]:
    """(path, major, minor, (uid, gid, mode) or None: do not make it) for every node of a module loaded now."""
    majors = char_majors(_read(_join(proc_root, "proc/devices")))
    out: list[tuple[str, int, int, tuple[int, int, int] | None]] = []
    nv = majors.get("nvidia-frontend", majors.get("nvidia"))
    if nv is not None and driver_loaded(proc_root):
        uid, gid, mode, modify = file_params(proc_root)
        own = (uid, gid, mode) if modify else None
        out.append(("/dev/nvidiactl", nv, CTL_MINOR, own))
        base = _join(proc_root, "proc/driver/nvidia/gpus")
        try:
            buses = sorted(os.listdir(base))
        except OSError:
            buses = []
        for bus in buses:
            for line in _read(os.path.join(base, bus, "information")).splitlines():
                k, _, v = line.partition(":")
                if k.strip() == "Device Minor" and v.strip().isdigit():
                    out.append((f"/dev/nvidia{int(v)}", nv, int(v), own))
        if "nvidia_modeset" in loaded_modules(proc_root):
            out.append(("/dev/nvidia-modeset", nv, MODESET_MINOR, own))
    uvm = majors.get(UVM)
    if uvm is not None:
        out += [("/dev/nvidia-uvm", uvm, 0, (UID, GID, MODE)), ("/dev/nvidia-uvm-tools", uvm, 1, (UID, GID, MODE))]
    return out


def make_nodes(dev_root: str = "/", proc_root: str = "/", only: tuple[str, ...] | None = None) -> list[str]:
    """Make the missing nodes of the loaded modules (`only`: these paths) under dev_root; returns those made.
    Nothing for a module that is not loaded, nothing where a path exists (whatever it is: never replaced)."""
    made = []
    for path, major, minor, own in wanted(proc_root):
        if own is None or (only is not None and path not in only):
            continue
        host = _join(dev_root, path)
        try:
            os.mknod(host, stat.S_IFCHR | own[2], os.makedev(major, minor))  # never follows a link: EEXIST
        except FileExistsError:
            continue
        except OSError:
            continue  # read-only /dev, not root: the caller refuses or reports what is still missing
        try:  # the umask cut the mode; the module's parameters name the owner
            os.chmod(host, own[2])
            os.chown(host, own[0], own[1])
        except OSError:
            os.unlink(host)
            continue
        made.append(path)
    if made:
        link_dev_char(dev_root, made)
    return made


def link_dev_char(dev_root: str, made: list[str]) -> None:
    """THE call point for /dev/char/MAJ:MIN links of the nodes just made (helper `devchar`'s link_nodes): systemd's
    device policy resolves a container's devices through them, so a node without its link is lost at the next
    `systemctl daemon-reload`."""
    from provision.inject.devchar import link_nodes  # lazy: ~0.3 ms, only once a node was made

    try:  # the record of links made lives in /run: only for the host's own /dev
        link_nodes(dev_root, [p.removeprefix("/dev/") for p in made], **({} if dev_root == "/" else {"record": None}))
    except OSError:  # devchar.DevCharRefused included
        pass  # a planted dev/char: the node is made, its link is not (verify names it)


def modprobe_program(proc_root: str = "/") -> str | None:
    """The modprobe the kernel names (/proc/sys/kernel/modprobe, as nvidia-modprobe reads it), when it is root's
    own program; None for a --proc-root that names none (a fixture's kernel is not this one: nothing is loaded)."""
    named = _read(_join(proc_root, "proc/sys/kernel/modprobe")).strip()
    prog = named or (LIVE_MODPROBE if proc_root in ("/", "") else "")
    # /sbin/modprobe is a link to kmod on most distributions: the file it resolves to must be root's alone
    return prog if prog.startswith("/") and _trusted_exe(os.path.realpath(prog)) else None


def load_module(name: str, proc_root: str = "/", timeout: float = MODPROBE_TIMEOUT_S) -> str | None:
    """Load `name` (while the nvidia module is loaded) within `timeout`; None when it is loaded, else why not."""
    if name.replace("-", "_") in loaded_modules(proc_root):
        return None
    if not driver_loaded(proc_root):
        return "the nvidia kernel module is not loaded"
    prog = modprobe_program(proc_root)
    if prog is None:
        return "no modprobe program (/proc/sys/kernel/modprobe) that only root can change"
    from provision import effects  # lazy: ~13 ms (-X importtime -I -S), only when a module is missing

    try:
        rc = effects.run_bounded([prog, name], timeout, env={"PATH": "/sbin:/usr/sbin:/bin:/usr/bin"})
    except OSError as exc:
        return f"{prog} did not start: {exc.strerror}"
    if rc is None:  # killed at the deadline, never waited for
        return f"`modprobe {name}` did not finish within {timeout:g} s"
    if name.replace("-", "_") in loaded_modules(proc_root):
        return None
    return f"`modprobe {name}` exited {rc}"


def prepare_host(proc_root: str = "/", dev_root: str = "/", *, modeset: bool = False,
                 timeout: float = MODPROBE_TIMEOUT_S) -> list[str]:
    """What nvidia-modprobe would have done before a CUDA program ran: nvidia-uvm (and nvidia-modeset when asked)
    loaded, every missing node of a loaded module made. Nothing while the nvidia module is not loaded. Returns
    lines for people (what was loaded or made, and what could not be)."""
    if not driver_loaded(proc_root):
        return []
    lines = []
    for mod in (UVM, MODESET) if modeset else (UVM,):
        was = mod.replace("-", "_") in loaded_modules(proc_root)
        why = load_module(mod, proc_root, timeout)
        if why:
            lines.append(f"warning: {mod} not loaded: {why}; GPU containers that ask for "
                         f"{'compute' if mod == UVM else 'display'} are refused until it is")
        elif not was:
            lines.append(f"loaded {mod}")
    made = make_nodes(dev_root, proc_root)
    if made:
        lines.append(f"made device nodes: {', '.join(made)}")
    return lines
