"""`/dev/char/MAJ:MIN` links for NVIDIA's device nodes, as udev makes them for every device it knows.

Why: with the systemd cgroup driver (Docker's `native.cgroupdriver=systemd`, containerd's `SystemdCgroup = true`)
runc hands a container's device rules to systemd as `DeviceAllow=/dev/char/MAJ:MIN` and leaves out every rule whose
path does not exist. NVIDIA's nodes are made by `nvidia-modprobe` or `mknod`, never by udev (the driver registers no
device class), so nothing makes their `/dev/char` links; the first `systemctl daemon-reload` re-applies the unit's
device policy without them and the running container gets EPERM on `/dev/nvidia*` ("Failed to initialize NVML:
Unknown Error": nvidia-docker#1730, nvidia-container-toolkit#48/#251, gpu-operator#485).

`link_nodes` is the one helper: `gpuprov runtime install`, the boot unit and udev rule (`dev_char_units`), `gpuprov
runtime dev-char-links` and the runtime's start path (after it makes a node) all call it. Every link it makes is
appended to RECORD (in /run, which goes with /dev at reboot), and `remove_links` (uninstall) removes only those,
and only while they still point where gpuprov pointed them: a link udev or the operator made is never touched.

It never writes through what a local user could plant: `dev/char` must be a directory (not a link) that only root
can write, reached and written with *at() calls that follow no link, and nothing is opened but directories (a FIFO
or a wedged device in /dev is only lstat'ed), so it never hangs. Import-light (os, stat and fsutil,
which the start path has loaded already)."""
from __future__ import annotations

import errno
import os
import stat

from provision import paths
from provision.fsutil import make_dirs

RECORD = f"{paths.RUN_DIR}/dev-char-links"  # one line per link gpuprov made: "<link> <target>"
UNDER_DEV_ROOT = "under dev_root"  # link_nodes' default record: record_for(dev_root)
CAPS_DIR = "nvidia-caps"
FIXED = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class DevCharRefused(OSError):
    """dev/char (or the directory above a node) is not what gpuprov may write into: nothing was changed."""


def _is_nvidia_name(name: str) -> bool:
    return name in FIXED or (name.startswith("nvidia") and name[6:].isdigit() and name[6:].isascii())


def _dev(dev_root: str) -> str:
    return os.path.join(dev_root, "dev")


def _chr_at(dfd: int, name: str) -> os.stat_result | None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    return st if stat.S_ISCHR(st.st_mode) else None


def nvidia_nodes(dev_root: str = "/") -> dict[str, tuple[int, int]]:
    """The NVIDIA character nodes under DEV_ROOT/dev now ({name relative to dev: (major, minor)}): nvidiaN,
    nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset and nvidia-caps/nvidia-capN. Links are not nodes."""
    out: dict[str, tuple[int, int]] = {}
    try:
        dfd = os.open(_dev(dev_root), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return out
    try:
        with os.scandir(dfd) as it:
            names = sorted(e.name for e in it)
        for name in names:
            if _is_nvidia_name(name):
                st = _chr_at(dfd, name)
                if st is not None:
                    out[name] = (os.major(st.st_rdev), os.minor(st.st_rdev))
        try:
            cfd = os.open(CAPS_DIR, _DIR_FLAGS, dir_fd=dfd)
        except OSError:
            return out
        try:
            with os.scandir(cfd) as it:
                caps = sorted(e.name for e in it if e.name.startswith("nvidia-cap"))
            for name in caps:
                st = _chr_at(cfd, name)
                if st is not None:
                    out[f"{CAPS_DIR}/{name}"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
        finally:
            os.close(cfd)
    finally:
        os.close(dfd)
    return out


def _open_char(dfd: int, dev: str, create: bool) -> int | None:
    """dev/char opened without following a link, made (0755) when asked and missing; DevCharRefused when it is a
    link, not a directory, or writable by anyone but root."""
    try:
        cfd = os.open("char", _DIR_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        if not create:
            return None
        try:
            os.mkdir("char", 0o700, dir_fd=dfd)
            made = True
        except FileExistsError:
            made = False
        try:
            cfd = os.open("char", _DIR_FLAGS, dir_fd=dfd)
        except OSError as exc:
            raise DevCharRefused(errno.ENOTDIR, f"{dev}/char is not a directory (or became a link meanwhile); "
                                 "remove it, then run `gpuprov runtime dev-char-links` (nothing was changed)") from exc
        if made:
            os.fchmod(cfd, 0o755)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise DevCharRefused(exc.errno, f"{dev}/char is a symlink or not a directory: gpuprov does not write "
                                 f"through it; remove it (udev makes a directory there), then run `gpuprov runtime "
                                 "dev-char-links` (nothing was changed)") from None
        raise
    st = os.fstat(cfd)
    if st.st_uid != 0 and st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(cfd)
        raise DevCharRefused(errno.EPERM, f"{dev}/char can be written by others (uid {st.st_uid}, mode "
                             f"{stat.S_IMODE(st.st_mode):04o}): gpuprov does not write into it; `chown root "
                             f"{dev}/char; chmod 0755 {dev}/char`, then run `gpuprov runtime dev-char-links` "
                             "(nothing was changed)")
    return cfd


def _link_state(cfd: int, key: str, rdev: int) -> str:
    """'ok' (a link there resolves to a node with this rdev), 'missing', or 'other' (something else is there)."""
    try:
        lst = os.stat(key, dir_fd=cfd, follow_symlinks=False)
    except FileNotFoundError:
        return "missing"
    if stat.S_ISCHR(lst.st_mode) and lst.st_rdev == rdev:
        return "ok"  # a node itself, as some hosts make them
    if not stat.S_ISLNK(lst.st_mode):
        return "other"
    try:  # stat follows the link by name only: nothing is opened, so a FIFO or wedged device cannot block it
        st = os.stat(key, dir_fd=cfd)
    except OSError:
        return "other"
    return "ok" if stat.S_ISCHR(st.st_mode) and st.st_rdev == rdev else "other"


class Links:
    """What link_nodes did or check_links found: `made` (link paths), `ok` (already right), `missing` (none yet:
    check only), `other` (something else is at that name: left alone), each a list of "LINK -> TARGET" or paths."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.ok: list[str] = []
        self.missing: list[str] = []
        self.other: list[str] = []

    def to_dict(self) -> dict:
        return {"made": self.made, "ok": self.ok, "missing": self.missing, "other": self.other}


def _walk(dev_root: str, names, create: bool, record: str | None) -> Links:
    dev = _dev(dev_root)
    res = Links()
    nodes = nvidia_nodes(dev_root)
    if names is not None:
        wanted = [n.removeprefix("/dev/").lstrip("/") for n in names]
        nodes = {n: nodes[n] for n in wanted if n in nodes}
    if not nodes:
        return res
    dfd = os.open(dev, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        cfd = _open_char(dfd, dev, create)
        for name, (major, minor) in nodes.items():
            key, target = f"{major}:{minor}", f"../{name}"
            link = f"{dev}/char/{key}"
            state = "missing" if cfd is None else _link_state(cfd, key, os.makedev(major, minor))
            if state == "missing" and create:
                try:
                    os.symlink(target, key, dir_fd=cfd)
                except FileExistsError:  # made meanwhile (udev, another start): judged as it is now
                    state = _link_state(cfd, key, os.makedev(major, minor))
                else:
                    res.made.append(link)
                    if record:
                        _note(record, link, target)
                    continue
            getattr(res, state).append(link)
        if cfd is not None:
            os.close(cfd)
    finally:
        os.close(dfd)
    return res


def _note(record: str, link: str, target: str) -> None:
    """One line appended (O_APPEND: concurrent starts never interleave a line) to the record in root's /run dir."""
    make_dirs(os.path.dirname(record))
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, f"{link} {target}\n".encode())
    finally:
        os.close(fd)


def record_for(dev_root: str) -> str:
    """The record of the links made under DEV_ROOT/dev: RECORD for the host's own /dev, the same path under any
    other root (where `uninstall --root` looks), so a --dev-root never writes the host's record."""
    return RECORD if os.path.realpath(dev_root) == "/" else os.path.join(dev_root, RECORD.lstrip("/"))


def link_nodes(dev_root: str = "/", names=None, record: str | None = UNDER_DEV_ROOT) -> Links:
    """THE helper: make DEV_ROOT/dev/char/MAJ:MIN -> ../NAME for NVIDIA's nodes (`names`: only these, as names
    under /dev or /dev/… paths, e.g. ["nvidia-uvm"] after making that node; None: every NVIDIA node there). A name
    already taken (udev's link, anyone's file) is left as it is. Raises DevCharRefused (nothing changed) when
    dev/char is a link, not a directory, or writable by others. `record`: where the links made are noted
    (default record_for(dev_root); None: nowhere)."""
    return _walk(dev_root, names, True, record_for(dev_root) if record == UNDER_DEV_ROOT else record)


def check_links(dev_root: str = "/") -> Links:
    """What link_nodes would find, changing nothing (verify)."""
    return _walk(dev_root, None, False, None)


def recorded(record: str = RECORD) -> list[tuple[str, str]]:
    try:
        with open(record, "rb") as fh:
            text = fh.read(1 << 20).decode(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        link, _, target = line.partition(" ")
        if link.startswith("/") and "/char/" in link and target.startswith("../"):
            out.append((link, target))
    return list(dict.fromkeys(out))


def ours_now(record: str = RECORD, root: str = "/") -> list[str]:
    """The recorded links that are still there and still point where gpuprov pointed them (under `root`)."""
    out = []
    for link, target in recorded(record):
        try:
            if os.readlink(os.path.join(root, link.lstrip("/"))) == target:
                out.append(link)
        except OSError:
            pass
    return out


def remove_links(record: str = RECORD) -> list[str]:
    """uninstall: unlink the links gpuprov made that still point where it pointed them; the record goes too."""
    gone = []
    for link in ours_now(record):
        d, name = os.path.split(link)
        try:
            dfd = os.open(d, _DIR_FLAGS)
        except OSError:
            continue
        try:
            if os.readlink(name, dir_fd=dfd) == dict(recorded(record))[link]:
                os.unlink(name, dir_fd=dfd)
                gone.append(link)
        except OSError:
            pass
        finally:
            os.close(dfd)
    try:
        os.unlink(record)
    except OSError:
        pass
    return gone


UDEV_RULE = "/etc/udev/rules.d/71-gpuprov-dev-char.rules"
UNIT = "gpuprov-dev-char.service"
ENGINE_UNITS = "docker.service containerd.service crio.service podman.service kubelet.service"


def dev_char_units(gpuprov: str) -> dict[str, str]:
    """{path: text}: the boot unit (before the engines, for hosts where udev is absent or late) and the udev rule
    (when the driver binds a GPU or a module of NVIDIA's loads), both running `gpuprov runtime dev-char-links`."""
    cmd = f"{gpuprov} runtime dev-char-links --quiet"
    return {
        f"/etc/systemd/system/{UNIT}": f"""[Unit]
Description=/dev/char links for NVIDIA's device nodes (GPU containers keep their devices across daemon-reload)
After=systemd-modules-load.service systemd-udev-settle.service nvidia-persistenced.service
Before={ENGINE_UNITS} gpuprov-cdi-refresh.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart={cmd}

[Install]
WantedBy=multi-user.target
""",
        UDEV_RULE: f"""# gpuprov: /dev/char/MAJ:MIN links for NVIDIA's device nodes, which udev never sees
# (nvidia-modprobe or mknod makes them). Without the links, systemd drops a container's GPU at
# `systemctl daemon-reload`.
ACTION=="add", DEVPATH=="/bus/pci/drivers/nvidia", RUN+="{cmd}"
ACTION=="bind", SUBSYSTEM=="pci", DRIVER=="nvidia", RUN+="{cmd}"
ACTION=="add", SUBSYSTEM=="module", KERNEL=="nvidia_uvm|nvidia_modeset", RUN+="{cmd}"
""",
    }
