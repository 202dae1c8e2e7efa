"""Modify (create only): apply the edits to a bundle's config.json, safely, through MODIFIERS: one function per
concern (our hook's removal, the Aliyun alias, the device-selection policy, the edits, device nodes, driver files,
env, MPS), each taking the container's `Start` and run in order, as NVIDIA's toolkit lists its modifiers.

Safety rules (REFERENCE.md §6), each with a test in tests/unit/test_inject_security.py:
- mount *sources* come from discovery of the host's driver root only, must be regular files (not symlinks) and
  never lie inside the container's rootfs (files the image controls are never mounted as driver libraries); the
  image's own cuda-compat libraries are read inside the rootfs (inroot.py) and runc gets gpuprov's copies of them
  (compat.stage), never a path the image or a volume could redirect when runc resolves it;
- no destination lies under a bind mount the engine added (a volume): runc would create it in the host's directory;
- every path *inside the image* (mount destinations, the image's /etc/debian_version that picks its library
  directory) is resolved by one resolver, `scoped_resolve`, with symlinks interpreted relative to the rootfs (never
  the host): an image that turns /usr/lib/x86_64-linux-gnu into a link to a host path still gets its mounts inside
  itself, and an image's link to a host path learns nothing about that host path (tests/faults/test_runtime_round2.py);
- device lists from mounts count only when the mount's source is /dev/null (what the device plugin's volume-mounts
  strategy and NVIDIA's toolkit use): a pod's own emptyDir or tmpfs there is ignored, with a warning in the log;
- device nodes are checked on the host against the expected major:minor before being passed;
- no hooks are added, and nothing from the image runs: an image's LD_PRELOAD/LD_LIBRARY_PATH reaches no privileged
  step. A `--gpus` prestart hook that dockerd added for us is removed (its work is done here instead).
"""
from __future__ import annotations

import json
import os
import posixpath
import stat
import sys
import time

from provision.errors import Refused, UntrustedPath
from provision.fsutil import open_trusted, read_fd, resolve_way, write_file
from provision.inject import discover, edits, ldcache, nodes
from provision.inject.capabilities import CUDA_COMPAT_DIR
from provision.share.limits import MPS_VARS, aliyun_visible, limits_asked, mps_env, share_request

TYPE_CHECKING = False  # not typing's (~3 ms to import): this module is on every GPU start's path
if TYPE_CHECKING:
    from collections.abc import Callable

    from provision.inject.settings import Settings
    from provision.share.state import MpsState

HOOK_NAME = "nvidia-container-runtime-hook"
HOOK_MARKER = b"gpuprov-hook"
DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"


# Path components one lookup may walk. 40 links may each name a 4 kB path, and an image's ld.so.cache may name 512
# files: without a bound, one start walked millions of lstat calls (236 s, issue 38 item 3's review). A real path
# with its links takes a few dozen.
MAX_STEPS = 256
# The last name of a path walked inside the image is nearly always absent there (the driver's files): lstat then
# raises FileNotFoundError, whose making costs more than the call. faccessat2(F_OK, AT_SYMLINK_NOFOLLOW) says the same
# (no such name, no link followed) as a bool (AT_EACCESS: the kernel keeps our credentials instead of copying them
# with the real ids, which for existence alone answer the same); 35 names of an `all` start: 195 -> 169 us here,
# same process, interleaved. Only where a name and the path are short enough (in characters, 4 bytes each at most)
# that the kernel's answer cannot be ENAMETOOLONG, which stays a refusal through lstat; a present name, a link
# included, is lstat'ed as before.
SHORT_NAME, SHORT_PATH = 255 // 4, 4095 // 4


def scoped_resolve(rootfs: str, path: str, memo: dict[str, tuple[str, int, int]] | None = None) -> str:
    """`path` inside the container, with every symlink component resolved *within* rootfs (absolute link targets
    are taken relative to rootfs, `..` never climbs above it). Returns the container path. The one resolver for
    every lookup inside the image: nothing here follows a link on the host (only lstat and readlink run).
    Runs for every mount of every GPU start: plain string joins and a reversed stack (pop() from the end), no
    posixpath.join/os.path.join per component (measured 40 -> 13 us for /etc/debian_version here).
    `memo` (one start's, Start.resolved): the walk's state after each leading run of the path's own components, so
    that the driver's ~20-60 files in the same few directories walk those directories once per start, not once per
    file (issue 41: 3 of every 4 lstat calls of a start). The walk resumes from that state, counters included:
    the same answer and the same bounds as a walk from the top."""
    top = rootfs.rstrip("/") or ("/" if rootfs else ".")
    if memo is not None:
        # The common case, a driver file in a directory this start walked already: that directory's state is in the
        # memo under exactly its path less the leading "/" (a key's names are never "" or "."), and the last name
        # is absent. The same steps as the walk below, without splitting and joining the path (~2 us of ~5 per
        # file); anything else (a name present, a link, `..`, the step bound) takes the walk, from the same memo.
        head, _, name = path.rpartition("/")
        state = memo.get(head[1:]) if head[:1] == "/" and name not in ("", ".", "..") else None
        if state is not None and state[2] < MAX_STEPS:
            cand = "/" + name if state[0] == "/" else f"{state[0]}/{name}"
            if len(name) <= SHORT_NAME and len(top) + len(cand) <= SHORT_PATH and \
                    not os.access(top + cand, os.F_OK, effective_ids=True, follow_symlinks=False):
                return cand
    parts = [p for p in path.split("/") if p not in ("", ".")]
    resolved, links, steps, done = "/", 0, 0, 0
    if memo is not None:
        for k in range(len(parts) - 1, 0, -1):  # the longest leading run walked before in this start
            state = memo.get("/".join(parts[:k]))
            if state is not None:
                (resolved, links, steps), done = state, k
                break
    todo = parts[done:][::-1]  # next component last
    own = len(todo)  # the path's own components still to walk (below any link's components on the stack)
    gone = False  # the last name walked is absent: so is every name below it (no lookup), until a `..`
    while todo:
        if own == len(todo):  # the path's components before these are walked, their links' too
            if memo is not None and own < len(parts):
                memo["/".join(parts[:len(parts) - own])] = (resolved, links, steps)
            own -= 1
        steps += 1
        if steps > MAX_STEPS:
            raise Refused(f"{path} in the container image takes more than {MAX_STEPS} steps to resolve (links of "
                          "links): refusing to look further")
        part = todo.pop()
        if part == "..":
            resolved, gone = posixpath.dirname(resolved) or "/", False
            continue
        cand = "/" + part if resolved == "/" else f"{resolved}/{part}"
        if gone:
            resolved = cand
            continue
        if not todo and len(part) <= SHORT_NAME and len(top) + len(cand) <= SHORT_PATH and \
                not os.access(top + cand, os.F_OK, effective_ids=True, follow_symlinks=False):
            resolved = cand  # the last name, absent (the driver's files nearly always are): see SHORT_NAME
            continue
        try:
            st = os.lstat(top + cand)
        except (FileNotFoundError, NotADirectoryError):  # absent in the image (or under a file): nothing to follow
            resolved, gone = cand, True
            continue
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > 40:
                raise Refused(f"too many symlinks while resolving {path} in the container image")
            target = os.readlink(top + cand)
            todo += [p for p in reversed(target.split("/")) if p not in ("", ".")]
            if target.startswith("/"):
                resolved = "/"
            continue
        resolved = cand
    return resolved


def image_path(rootfs: str, path: str, memo: dict[str, tuple[str, int, int]] | None = None) -> str:
    """The host path of `path` inside the image, resolved by scoped_resolve: only lstat it (its last component is
    no link once resolved), never follow it."""
    return (rootfs.rstrip("/") or ("/" if rootfs else ".")) + scoped_resolve(rootfs, path, memo)


def in_image(rootfs: str, path: str, memo: dict[str, tuple[str, int, int]] | None = None) -> bool:
    try:
        os.lstat(image_path(rootfs, path, memo))
    except OSError:
        return False
    return True


def image_libdir(rootfs: str, memo: dict[str, tuple[str, int, int]] | None = None) -> str:
    """Where the image's loader looks by default: Debian's multiarch directory, the RHEL family's /usr/lib64, else
    /usr/lib, which musl (Alpine) and single-directory glibc images (Arch: /usr/lib64 -> /usr/lib) search, as
    /usr/lib64 they do not."""
    if in_image(rootfs, "/etc/debian_version", memo):
        return edits.DEBIAN_LIBDIR
    return edits.RHEL_LIBDIR if os.path.isdir(image_path(rootfs, edits.RHEL_LIBDIR, memo)) else edits.LIBDIR


def is_privileged(config: dict) -> bool:
    return "CAP_SYS_ADMIN" in (config.get("process", {}).get("capabilities", {}).get("bounding") or [])


def warn_stderr(msg: str) -> None:
    sys.stderr.write(f"gpuprov-runtime: warning: {msg}\n")


def _mounted_device_list(config: dict, warn: Callable[[str], None] = warn_stderr) -> list[str] | None:
    """Devices passed as volume mounts, the Kubernetes way (the device plugin's volume-mounts strategy): /dev/null
    mounted at /var/run/nvidia-container-devices/<dev>. Only a /dev/null source counts, as in NVIDIA's toolkit
    (internal/config/image/cuda_image.go, requestsFromMounts): any pod can mount its own emptyDir or tmpfs at that
    path, only the kubelet (for the device plugin) mounts a host's /dev/null there. Others are ignored, with a
    warning. The device is the path below the directory; imex/ entries are IMEX channels, not GPUs."""
    devs: list[str] = []
    for m in config.get("mounts", []):
        dest = posixpath.normpath(m.get("destination", "") or ".")
        if not dest.startswith(DEVICE_LIST_DIR + "/"):
            continue
        src = m.get("source", "")
        if posixpath.normpath(src or ".") != "/dev/null":
            warn(f"ignored the mount at {dest}: a device list counts only with source /dev/null (the orchestrator's), "
                 f"this one has source {src!r}")
            continue
        dev = dest[len(DEVICE_LIST_DIR):].strip("/")
        if dev and not dev.startswith("imex/") and dev not in devs:
            devs.append(dev)
    return devs or None


def _our_hook(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return HOOK_MARKER in fh.read(4096)
    except OSError:
        return False


def _check_node(settings: Settings, node: edits.DeviceNode) -> None:
    """The node is on the host as discovery found it; a missing one is made first when its module is loaded
    (nodes.make_nodes, as nvidia-modprobe would: a start after a fresh boot, /dev/nvidia-uvm never made)."""
    host = os.path.join(settings.dev_root, node.path.lstrip("/"))
    try:
        st = os.stat(host)
    except OSError:
        nodes.make_nodes(settings.dev_root, settings.proc_root, only=(node.path,))
        try:
            st = os.stat(host)
        except OSError:
            raise Refused(f"device node {node.path} is missing on the host and could not be made (is its kernel "
                          "module loaded? `gpuprov cdi refresh` loads it and makes the nodes)") from None
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != (node.major, node.minor):
        raise Refused(f"device node {node.path} on the host is not the expected character device "
                      f"{node.major}:{node.minor}; refusing to pass it")


# The warm editor's answers about the driver's host files (_safe_source), by directory: (its stamp: device, inode,
# ctime in ns; its real path; {name: whether it is a regular file or a socket}). A name's kind changes only through
# its directory (unlink, rename, symlink, mknod, create), each of which moves the directory's ctime, which nobody can
# set back; a different directory at that path (a parent swapped or retargeted: a driver upgrade behind a link) has
# another device or inode. So one stat of each directory per start stands for an lstat of each file in it (35 for
# `all`) and the walk of its parents (issue 41). Kept only for a directory that had been still for STILL_NS when it
# was read: a ctime moves in ticks of a few ms (jiffies), and a change within the tick of the one before it would not
# move it ("racy git"; 3 s covers filesystems that keep whole or even seconds); a directory changed more recently is
# read in full again at the next start. Kept only where nobody but root can change the directory or anything on its
# way (fsutil.resolve_way: every directory root's and not group/other-writable, every link root's):
# a user who could rename an ancestor or retarget a link on the way would move the real path or the names without
# moving this directory's stamp. What the image controls (every destination) is still resolved per start.
SOURCE_DIRS: dict[str, tuple[tuple[int, int, int], str, dict[str, bool]]] = {}
STILL_NS = 3_000_000_000
MAX_SOURCE_DIRS = 256  # a driver's files lie in ~10 directories; more is a host whose driver moved many times


def _safe_source(src: str, rootfs_real: str, seen: dict[str, tuple[str, dict[str, bool]] | None]) -> bool:
    """A host file we may bind: a regular file, or a daemon's socket (nvidia-persistenced's, which discovery found
    on the host), never a symlink (lstat) and never anything inside the container's own rootfs (its real path, against
    this start's rootfs). `seen`: this start's source directories (_source_dir), each stat'ed once per start."""
    if not src.startswith("/"):  # discovery's paths are absolute; a relative one would depend on the cwd
        return False
    parent, _, name = src.rpartition("/")
    if parent not in seen:
        seen[parent] = _source_dir(parent or "/")
    got = seen[parent]
    if got is None or name in ("", ".", ".."):
        return False
    real_dir, kinds = got
    ok = kinds.get(name)
    if ok is None:
        try:
            mode = os.lstat(src).st_mode
        except (FileNotFoundError, NotADirectoryError):
            ok = kinds[name] = False  # absent until the directory changes
        except OSError:
            return False  # an I/O error: this start only
        else:
            ok = kinds[name] = stat.S_ISREG(mode) or stat.S_ISSOCK(mode)
    if not ok:
        return False
    real = f"{real_dir.rstrip('/')}/{name}"  # the name itself is no link (lstat)
    return not (real == rootfs_real or real.startswith(rootfs_real + os.sep))


def _source_dir(path: str) -> tuple[str, dict[str, bool]] | None:
    """(the directory's real path, the kinds of its names known so far) for this start: the warm editor's while the
    directory's stamp holds (SOURCE_DIRS), else read afresh. None: not a directory."""
    try:
        st = os.stat(path)  # follows links: the directory the path reaches now
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    stamp = (st.st_dev, st.st_ino, st.st_ctime_ns)
    known = SOURCE_DIRS.get(path)
    if known is not None and known[0] == stamp:
        return known[1], known[2]
    try:  # after the stat: a change of the directory meanwhile moves its stamp
        real, private = resolve_way(path)
    except (UntrustedPath, OSError):  # a link another user planted on the way: realpath's answer, never kept
        real, private = os.path.realpath(path), False
    got: tuple[str, dict[str, bool]] = (real, {})
    if private and time.time_ns() - st.st_ctime_ns >= STILL_NS:  # else looked at in full at every start, as before
        if len(SOURCE_DIRS) >= MAX_SOURCE_DIRS:
            SOURCE_DIRS.clear()
        SOURCE_DIRS[path] = (stamp, *got)
    else:
        SOURCE_DIRS.pop(path, None)
    return got


def load_discovery(settings: Settings, warn: Callable[[str], None] | None = None,
                   known: discover.Discovery | None = None) -> discover.Discovery:
    """The cached discovery, else a new one (`known`: this start's earlier one, whose driver answers still stand)."""
    disc = discover.load_cached(settings.cache, settings.proc_root)
    if disc is None or disc.driver_root != settings.driver_root:
        try:
            disc = discover.refresh(settings.driver_root, settings.cache, settings.proc_root, settings.dev_root,
                                    warn=warn, known=known)
        except OSError:  # read-only cache location: discover without caching
            disc = discover.discover(settings.driver_root, proc_root=settings.proc_root, dev_root=settings.dev_root,
                                     arch=True, warn=warn, known=known)
    return disc


def load_share_state(path: str) -> MpsState | None:
    """The state `gpuprov share enable` left (None: sharing is off). A state file that is not enable's refuses GPU
    containers (they might otherwise run without the caps the operator set). Whether its daemon still runs is asked
    only for containers on the shared GPUs (apply_sharing)."""
    try:  # only a state nobody but root could have written: its daemon and limits decide every GPU container's caps
        with open_trusted(path) as fh:
            text = fh.read().decode("utf-8", errors="replace")
    except UntrustedPath as exc:
        raise Refused(f"GPU sharing state {path} refused ({exc}): run `gpuprov share disable`, then `gpuprov share "
                      "enable`") from None
    except OSError:
        return None
    # Without a state file (sharing off) the share records' classes are never built.
    from provision.share.state import MpsState  # lazy: 2 ms (-X importtime) per cold GPU start, sharing off

    try:
        return MpsState.from_json(text)
    except ValueError as exc:
        raise Refused(f"GPU sharing state {path} is not gpuprov's ({exc}): run `gpuprov share disable`, then "
                      "`gpuprov share enable`") from None


def _sharing_for(gpus: list[int], env: dict[str, str], state: MpsState | None, path: str) -> MpsState | None:
    """The state when this container's GPUs are shared and their daemon runs; None when none of its GPUs is shared
    (it runs as on a host without sharing). Refuses a container that spans shared and unshared GPUs (its MPS client
    would reach only the shared ones, through a daemon that numbers them its own way), limits asked for on unshared
    GPUs, and any start on shared GPUs whose daemon is gone (fail closed: never uncapped)."""
    if state is None:
        return None
    shared = [i for i in gpus if state.shares(i)]
    if not shared:
        if limits_asked(env):
            raise Refused(f"GPU memory/compute limits were asked for, but GPU {','.join(map(str, gpus)) or 'none'} "
                          f"is not shared (shared: {','.join(map(str, state.gpus))}): ask for a shared GPU, or "
                          "`gpuprov share enable --gpus` with this one")
        return None
    if len(shared) != len(gpus):
        unshared = [i for i in gpus if not state.shares(i)]
        raise Refused(f"this container asks for shared GPU {','.join(map(str, shared))} and unshared GPU "
                      f"{','.join(map(str, unshared))}: ask for shared GPUs only or unshared GPUs only "
                      f"(`gpuprov share enable --gpus` chose {','.join(map(str, state.gpus))})")
    if not state.daemon_running():
        raise Refused(state.gone(path))
    return state


class Start:
    """One container's create as the modifiers see it: its OCI config (edited in place), its environment as a dict
    (written back once, at the end), and what the modifiers before decided. A plain class: a dataclass would cost
    its build at import on every cold GPU start (see edits.py's records)."""
    __slots__ = ("config", "bundle", "settings", "warn", "env", "rootfs", "selectors", "disc", "edits", "changed",
                 "libdir", "resolved", "source_dirs", "rootfs_real", "binds")

    def __init__(self, config: dict, bundle: str, settings: Settings, warn: Callable[[str], None] = warn_stderr):
        self.config, self.bundle, self.settings, self.warn = config, bundle, settings, warn
        self.env = edits.env_dict(config.get("process", {}).get("env"))
        rootfs = config.get("root", {}).get("path", "rootfs")
        self.rootfs = rootfs if os.path.isabs(rootfs) else os.path.join(bundle, rootfs)  # the image, on the host
        self.selectors: list[str] | None = None  # the GPUs asked for (select_devices); None: no GPU
        self.disc: discover.Discovery | None = None
        self.edits: edits.Edits | None = None  # what the container gets (plan_edits)
        self.libdir = edits.DEBIAN_LIBDIR  # where the image's loader looks (plan_edits: image_libdir)
        self.changed = False
        # What this start looked up once for all its files (issue 41): scoped_resolve's walks inside the image,
        # the driver's host directories (_safe_source), the rootfs's real path, the engine's bind mounts (_binds).
        self.resolved: dict[str, tuple[str, int, int]] = {}
        self.source_dirs: dict[str, tuple[str, dict[str, bool]] | None] = {}
        self.rootfs_real: str | None = None
        self.binds: list[str] | None = None


# --- the modifiers, one per concern, applied in MODIFIERS' order. Each takes the Start and returns whether the next
# ones run (False: this container needs nothing more); a refusal raises Refused. ---

def remove_hook(s: Start) -> bool:
    """A `--gpus` prestart hook that dockerd added: ours is removed (its work is done here); NVIDIA's own toolkit
    hook means the whole job is NVIDIA's (nothing is changed, never break such a host)."""
    hooks = s.config.get("hooks", {}).get("prestart", [])
    gpus_hook = [h for h in hooks if posixpath.basename(h.get("path", "")) == HOOK_NAME]
    if not gpus_hook:
        return True
    if not all(_our_hook(h["path"]) for h in gpus_hook):
        return False
    s.config["hooks"]["prestart"] = [h for h in hooks if h not in gpus_hook]
    s.changed = True
    return True


def alias_aliyun(s: Start) -> bool:
    """ALIYUN_COM_GPU_VISIBLE_DEVICES (Alibaba's cGPU device plugin) stands for NVIDIA_VISIBLE_DEVICES."""
    aliyun_visible(s.env)
    return True


def select_devices(s: Start) -> bool:
    """The device-selection policy: the env's NVIDIA_VISIBLE_DEVICES, or the device lists the orchestrator mounted
    (the device plugin's volume-mounts strategy); multi-tenant (accept_env_unprivileged off), an unprivileged
    container's env does not count. No GPU asked for: nothing more, unless it asks for limits (refused)."""
    selectors = edits.requested_devices(s.env)
    mounted = _mounted_device_list(s.config, s.warn)
    if selectors == [DEVICE_LIST_DIR]:  # the list is in the mounts
        selectors = mounted
    if selectors is None or (not s.settings.accept_env_unprivileged and not is_privileged(s.config)):
        selectors = mounted  # multi-tenant policy: only the device lists the orchestrator mounted count
    if selectors is None:
        if limits_asked(s.env):
            raise Refused("GPU memory/compute limits were asked for, but the container requests no GPU "
                          "(set NVIDIA_VISIBLE_DEVICES or --gpus)")
        return False
    s.selectors = selectors
    return True


def plan_edits(s: Start) -> bool:
    """What the container gets, from the driver's discovery and its request (edits.compute_edits, pure). A compute
    container on a host where nvidia-uvm is not loaded yet loads it first (bounded), as nvidia-modprobe would."""
    s.disc = load_discovery(s.settings, s.warn)
    if s.disc.version and s.disc.nodes.uvm is None and "compute" in edits.capabilities(s.env):
        why = nodes.load_module(nodes.UVM, s.settings.proc_root, nodes.START_MODPROBE_TIMEOUT_S)
        if why:
            raise Refused(f"this container asks for compute but the {nodes.UVM} kernel module is not loaded ({why}): "
                          f"run `modprobe {nodes.UVM}` (or `gpuprov cdi refresh`), then start it again")
        nodes.make_nodes(s.settings.dev_root, s.settings.proc_root)
        s.disc = load_discovery(s.settings, s.warn, s.disc)  # the host key moved (a module, a major): rediscovered
    if s.disc.version and s.disc.nodes.modeset is None and "display" in edits.capabilities(s.env):
        why = _load_modeset(s)
        if why:  # display without modesetting still has its other files: said, not refused
            s.warn(f"{nodes.MODESET} not loaded ({why}): this display container gets no /dev/nvidia-modeset")
        else:
            nodes.make_nodes(s.settings.dev_root, s.settings.proc_root)
            s.disc = load_discovery(s.settings, s.warn, s.disc)
    s.libdir = image_libdir(s.rootfs, s.resolved)
    compat_libs = None
    if s.selectors and in_image(s.rootfs, CUDA_COMPAT_DIR, s.resolved):  # an image with forward-compatibility libraries
        from provision.inject import compat  # lazy: 0.2 ms (-X importtime -I -S); such images only

        compat_libs = compat.find(s.rootfs)
    s.edits = edits.compute_edits(s.disc, s.env, libdir=s.libdir, selectors=s.selectors,
                                  privileged=is_privileged(s.config), compat=compat_libs)
    if compat_libs is not None:
        _stage_compat(s, compat_libs)
    s.changed = True
    return True


# nvidia-modeset loads that failed, by host (the discovery's key: its modules, majors, boot, the driver's files):
# (when, why). A display start on a host where it cannot load (a container host without the module's file, no
# modprobe) says why, without a modprobe per start (a process, ~1-2 ms) for MODESET_RETRY_S.
MODESET_RETRY_S = 60.0
_modeset_failed: dict[tuple[str, str], tuple[float, str]] = {}


def _load_modeset(s: Start) -> str | None:
    """nodes.load_module(MODESET), None when loaded; a failure under the same host key is not retried for
    MODESET_RETRY_S (the warm editor's memory; the same words)."""
    key = (s.settings.proc_root, s.disc.key)
    failed = _modeset_failed.get(key)
    if failed is not None and time.monotonic() - failed[0] < MODESET_RETRY_S:
        return failed[1]
    why = nodes.load_module(nodes.MODESET, s.settings.proc_root, nodes.START_MODPROBE_TIMEOUT_S)
    if why:
        if len(_modeset_failed) > 64:  # a host key per boot and driver: a long-lived editor keeps only the latest
            _modeset_failed.clear()
        _modeset_failed[key] = (time.monotonic(), why)
    else:
        _modeset_failed.pop(key, None)
    return why


def _stage_compat(s: Start, compat_libs) -> None:
    """The compat files the edits use, swapped for gpuprov's copies (compat.stage). Where no safe copy can be had,
    the container gets the host's libraries and a one-line warning: an image can never make its start fail here."""
    from provision.inject import compat  # lazy: 0.2 ms (-X importtime -I -S); plan_edits loaded it for such images

    used = {m.source for m in s.edits.mounts} & set(compat_libs.files.values())
    if not used:
        return
    try:
        copies = compat.stage(s.rootfs, compat_libs, used, compat.store_dir(s.settings.cache))
    except compat.Unusable as exc:
        s.warn(f"the image's CUDA compat libraries are not used ({exc}); this container gets the host driver's")
        s.edits = edits.compute_edits(s.disc, s.env, libdir=s.libdir, selectors=s.selectors,
                                      privileged=is_privileged(s.config))
        return
    e = s.edits
    s.edits = edits.Edits(e.devices, e.rules, tuple(edits.Mount(copies.get(m.source, m.source), m.destination,
                                                                m.options) for m in e.mounts), e.env, e.masked)


def add_devices(s: Start) -> bool:
    """The device nodes (each checked on the host first) and the device cgroup's rules for them."""
    for node in s.edits.devices:
        _check_node(s.settings, node)
    linux = s.config.setdefault("linux", {})
    devices = linux.setdefault("devices", [])
    have = {d.get("path") for d in devices}
    devices.extend(d.oci() for d in s.edits.devices if d.path not in have)
    linux.setdefault("resources", {}).setdefault("devices", []).extend(r.oci() for r in s.edits.rules)
    return True


def add_mounts(s: Start) -> bool:
    """The driver's files: each source a safe host file (_safe_source), each destination resolved inside the image
    (scoped_resolve); a destination the config already mounts keeps its mount."""
    _mount_all(s, s.edits.mounts)
    return True


def _mount_all(s: Start, wanted: tuple[edits.Mount, ...] | list[edits.Mount], anywhere: bool = False) -> None:
    if not wanted:
        return
    rootfs = s.rootfs
    if s.rootfs_real is None:
        s.rootfs_real = os.path.realpath(rootfs)
    rootfs_real = s.rootfs_real
    mounts = s.config.setdefault("mounts", [])
    taken = {m.get("destination") for m in mounts}
    volumes = _volumes(s, anywhere)
    memo, seen = s.resolved, s.source_dirs
    for m in wanted:  # ~80 files for `all` with a full driver: nothing here that one start could do once
        if not _safe_source(m.source, rootfs_real, seen):
            continue
        dest = scoped_resolve(rootfs, m.destination, memo)
        if dest in taken:
            continue
        under = next((v for v in volumes if dest.startswith(v + "/")), None) if volumes else None
        if under is not None:
            s.warn(f"{dest} is not mounted: it lies under {under or 'a volume inside another'}, a volume, where runc "
                   "would create it in the volume's host directory")
            continue
        taken.add(dest)
        mounts.append(m.oci(dest))


def _volumes(s: Start, anywhere: bool) -> list[str]:
    """Where the engine's bind mounts land in the container, resolved as runc resolves a destination (inside the
    rootfs). A bind mount under another one lands wherever the outer one's content sends it (a link there), which
    only the volume's owner decides: with `anywhere` (the image's own ld.so.cache targets, which may be any path),
    it counts as covering the whole container; the driver's fixed destinations keep the plain rule."""
    dests = _binds(s)
    if anywhere and any(d.startswith(v + "/") for d in dests for v in dests if v != "/"):
        return [""]  # every destination starts with "/": all are skipped
    return [d.rstrip("/") for d in dests]


def _binds(s: Start) -> list[str]:
    """The engine's bind mounts of directories, their destinations resolved inside the rootfs: looked up once per
    start. The mounts this start adds are files (_safe_source), never a directory that could hold another."""
    if s.binds is None:
        s.binds = [scoped_resolve(s.rootfs, m.get("destination") or "/", s.resolved) for m in s.config.get("mounts", [])
                   if (m.get("type") == "bind" or any(o in ("bind", "rbind") for o in m.get("options") or ()))
                   and os.path.isdir(m.get("source") or "/")]  # a file (/etc/hosts) is nobody's parent: ~1 us, not ~13
    return s.binds


def mask_paths(s: Start) -> bool:
    """A MIG container's view of /proc/driver/nvidia: the other instances', the admin capabilities' and the other
    GPUs' entries masked by runc (linux.maskedPaths; edits.masked, mig.proc_masks), added to what the engine masks."""
    if s.edits.masked:
        masked = s.config.setdefault("linux", {}).setdefault("maskedPaths", [])
        masked.extend(p for p in s.edits.masked if p not in masked)
    return True


def override_image_cache(s: Start) -> bool:
    """The host's driver libraries win over the image's copies: where the image's own /etc/ld.so.cache names a
    file for a driver library's SONAME (its own libcuda.so.1 in /opt/…, which the loader would take before
    searching any directory), the host's library is mounted over that file too (resolved inside the rootfs, as
    every destination is). No hook, nothing run in the container (NVIDIA's CDI mode runs ldconfig there instead)."""
    found = ldcache.driver_entries(s.rootfs)  # nearly always [] (a walk of 2 names and an fstat when seen)
    if not found:
        return True
    libdir = s.libdir
    ours = {m.destination[len(libdir) + 1:]: m for m in s.edits.mounts if m.destination.startswith(libdir + "/")}
    extra = [edits.Mount(ours[soname].source, path, edits.LIB_RO) for soname, path in found
             if soname in ours and posixpath.dirname(path) != libdir and _image_file(s.rootfs, path, s.resolved)]
    _mount_all(s, extra, anywhere=True)
    return True


def _image_file(rootfs: str, path: str, memo: dict[str, tuple[str, int, int]] | None = None) -> bool:
    """The image has a regular file at `path` (resolved inside the rootfs): the loader would open it."""
    try:
        return stat.S_ISREG(os.lstat(image_path(rootfs, path, memo)).st_mode)
    except OSError:
        return False


def set_env(s: Start) -> bool:
    """Our values replace the image's: NVIDIA_VISIBLE_DEVICES becomes the resolved list."""
    for var in s.edits.env:
        s.env[var.name] = var.value
    return True


def share_gpus(s: Start) -> bool:
    """MPS client settings when the container's GPUs are shared (apply_sharing)."""
    passed = {d.path for d in s.edits.devices}
    apply_sharing(s.config, s.env, [g.index for g in s.disc.gpus if g.node.path in passed], s.settings, s.warn)
    return True


MODIFIERS = (remove_hook, alias_aliyun, select_devices, plan_edits, add_devices, add_mounts, mask_paths,
             override_image_cache, set_env, share_gpus)


def modify_config(config: dict, bundle: str, settings: Settings, warn: Callable[[str], None] = warn_stderr) -> bool:
    """Apply GPU edits to `config` in place (MODIFIERS, in order). Returns True when something changed. Raises
    Refused. `warn` gets the warnings (one line each) meant for the runtime's log."""
    s = Start(config, bundle, settings, warn)
    for modifier in MODIFIERS:
        if not modifier(s):
            break
    if s.edits is not None:
        config.setdefault("process", {})["env"] = [f"{k}={v}" for k, v in s.env.items()]
    return s.changed


def apply_sharing(config: dict, env: dict[str, str], gpus: list[int], settings: Settings,
                  warn: Callable[[str], None] = warn_stderr) -> None:
    """MPS client settings for a GPU container on shared GPUs (`gpus`: the host indices it gets): limits, priority,
    the pipe directory, the daemon's /dev/shm and IPC. Containers on unshared GPUs get none of it."""
    for var in MPS_VARS:  # a container never sets its own MPS limits, priority or pipes
        env.pop(var, None)
    path = settings.share_state
    state = _sharing_for(gpus, env, load_share_state(path), path)
    req = share_request(env, len(gpus), state)
    if req is None:
        return
    uid = int(config.get("process", {}).get("user", {}).get("uid", 0))
    if uid != state.uid:
        raise Refused(f"GPU sharing needs the container to run as uid {state.uid} (the MPS daemon's); "
                      f"it runs as uid {uid}")
    for note in req.notes:
        warn(note)
    env.update(mps_env(req, state))
    mounts = [m for m in config.get("mounts", []) if m.get("destination") != "/dev/shm"]
    mounts.append({"destination": "/dev/shm", "source": "/dev/shm", "type": "bind",
                   "options": ["rbind", "nosuid", "nodev", "noexec"]})
    mounts.append({"destination": state.pipe_dir, "source": state.pipe_dir, "type": "bind",
                   "options": ["rbind", "nosuid", "nodev", "noexec"]})
    config["mounts"] = mounts
    linux = config.setdefault("linux", {})
    linux["namespaces"] = [n for n in linux.get("namespaces", []) if n.get("type") != "ipc"]  # MPS needs host IPC


# The parts of config.json the modifiers read or write, typed as runc's spec types them (opencontainers/runtime-spec,
# specs-go/config.go): a dict is a JSON object with those fields, [T] a JSON array of T, `list` an array of anything.
# Fields not named here are not looked at. One table: check_shape walks it.
OCI_SHAPE = {
    "process": {"env": [str], "capabilities": {"bounding": [str]}, "user": {"uid": int}},
    "mounts": [{"destination": str, "source": str, "type": str}],
    "linux": {"devices": [dict], "resources": {"devices": list}, "namespaces": [dict], "maskedPaths": [str]},
    "root": {"path": str},
    "hooks": {"prestart": [{"path": str}]},
}
_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "number"}


def _check(value: object, shape: object, where: str) -> None:
    """ValueError unless `value` has `shape` (an OCI_SHAPE node); None (absent) always passes."""
    if value is None:
        return
    typ = dict if isinstance(shape, dict) else list if isinstance(shape, list) else shape
    if not isinstance(value, typ) or isinstance(value, bool):
        raise ValueError(f"config.json: {where} must be a JSON {_JSON_NAMES[typ]}")
    if isinstance(shape, dict):
        for key, sub in shape.items():
            _check(value.get(key), sub, f"{where}.{key}" if where else key)
    elif isinstance(shape, list):
        item = shape[0]
        if item is str and all(type(x) is str for x in value):  # process.env: the long one, checked in one pass
            return
        for i, x in enumerate(value):
            _check(x, item, f"{where}[{i}]")


def check_shape(config: object) -> None:
    """ValueError naming the first field whose type is not runc's (a config.json runc itself would reject): the
    modifiers then never meet a surprise type, and the refusal is one line instead of a traceback."""
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    _check(config, OCI_SHAPE, "")


def modify_bundle(bundle: str, settings: Settings, warn: Callable[[str], None] = warn_stderr) -> bool:
    path = os.path.join(bundle, "config.json")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # raw reads: a file object costs 5 more system calls per start
    try:
        config = json.loads(read_fd(fd).decode())  # strict UTF-8, as runc reads it
    finally:
        os.close(fd)
    check_shape(config)
    if not modify_config(config, bundle, settings, warn):
        return False
    # The one write path; no fsync: a container's config.json does not outlive the host's uptime.
    write_file(path, json.dumps(config, separators=(",", ":")), backup=False, durable=False)
    return True
