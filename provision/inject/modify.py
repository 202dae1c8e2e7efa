"""Modify (create only): apply the edits to a bundle's config.json, safely.

Safety rules (REFERENCE.md §6), each with a test in tests/unit/test_inject_security.py:
- mount *sources* come from discovery of the host's driver root only, must be regular files (not symlinks) and
  never lie inside the container's rootfs (files the image controls are never mounted as driver libraries);
- mount *destinations* are resolved inside the rootfs with symlinks interpreted relative to it (never the host),
  so an image that turns /usr/lib/x86_64-linux-gnu into a link to a host path still gets its mounts inside itself;
- device nodes are checked on the host against the expected major:minor before being passed;
- no hooks are added, and nothing from the image runs: an image's LD_PRELOAD/LD_LIBRARY_PATH reaches no privileged
  step. A `--gpus` prestart hook that dockerd added for us is removed (its work is done here instead).
"""
from __future__ import annotations

import json
import os
import posixpath
import stat

from provision.errors import Refused
from provision.fsutil import write_file
from provision.inject import discover, edits
from provision.share.limits import MPS_VARS, REQUEST_VARS, aliyun_visible, mps_env, share_request

TYPE_CHECKING = False  # not typing's (~3 ms to import): this module is on every GPU start's path
if TYPE_CHECKING:
    from provision.inject.settings import Settings
    from provision.share.state import MpsState

HOOK_NAME = "nvidia-container-runtime-hook"
HOOK_MARKER = b"gpuprov-hook"
DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"


def scoped_resolve(rootfs: str, path: str, _depth: int = 0) -> str:
    """`path` inside the container, with every symlink component resolved *within* rootfs (absolute link targets
    are taken relative to rootfs, `..` never climbs above it). Returns the container path."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    resolved = "/"
    links = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            resolved = posixpath.dirname(resolved) or "/"
            continue
        cand = posixpath.join(resolved, part)
        host = os.path.join(rootfs, cand.lstrip("/"))
        try:
            st = os.lstat(host)
        except FileNotFoundError:
            resolved = cand
            continue
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > 40:
                raise Refused(f"too many symlinks while resolving {path} in the container image")
            target = os.readlink(host)
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            if target.startswith("/"):
                resolved = "/"
            continue
        resolved = cand
    return resolved


def image_libdir(rootfs: str) -> str:
    return edits.DEBIAN_LIBDIR if os.path.exists(os.path.join(rootfs, "etc/debian_version")) else edits.RHEL_LIBDIR


def is_privileged(config: dict) -> bool:
    return "CAP_SYS_ADMIN" in (config.get("process", {}).get("capabilities", {}).get("bounding") or [])


def _mounted_device_list(config: dict) -> list[str] | None:
    """Devices passed as volume mounts (/var/run/nvidia-container-devices/<dev>), the Kubernetes way."""
    devs = [m["destination"].rsplit("/", 1)[-1] for m in config.get("mounts", [])
            if m.get("destination", "").startswith(DEVICE_LIST_DIR + "/")]
    return devs or None


def _our_hook(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return HOOK_MARKER in fh.read(4096)
    except OSError:
        return False


def _check_node(dev_root: str, node: dict) -> None:  # an OCI linux.devices entry (edits._node)
    host = os.path.join(dev_root, node["path"].lstrip("/"))
    try:
        st = os.stat(host)
    except OSError:
        raise Refused(f"device node {node['path']} is missing on the host; is the NVIDIA driver loaded?") from None
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != (node["major"], node["minor"]):
        raise Refused(f"device node {node['path']} on the host is not the expected character device "
                      f"{node['major']}:{node['minor']}; refusing to pass it")


def _safe_source(src: str, rootfs_real: str) -> bool:
    """A host file we may bind: a regular file, or a daemon's socket (nvidia-persistenced's, which discovery found
    on the host), never a symlink (lstat) and never anything inside the container's own rootfs."""
    try:
        st = os.lstat(src)
    except OSError:
        return False
    real = os.path.realpath(src)
    inside = real == rootfs_real or real.startswith(rootfs_real + os.sep)
    return (stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode)) and not inside


def load_discovery(settings: Settings) -> discover.Discovery:
    disc = discover.load_cached(settings.cache, settings.proc_root)
    if disc is None or disc.driver_root != settings.driver_root:
        try:
            disc = discover.refresh(settings.driver_root, settings.cache, settings.proc_root, settings.dev_root)
        except OSError:  # read-only cache location: discover without caching
            disc = discover.discover(settings.driver_root, proc_root=settings.proc_root, dev_root=settings.dev_root)
    return disc


def load_share_state(path: str) -> MpsState | None:
    """Sharing is on when `gpuprov share enable` left its state and the MPS control daemon still runs. A state file
    that is not enable's refuses GPU containers (they might otherwise run without the caps the operator set)."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        return None
    # Without a state file (sharing off) the share records' classes are never built.
    from provision.share.state import MpsState  # lazy: 2 ms (-X importtime) per cold GPU start, sharing off

    try:
        state = MpsState.from_json(text)
    except ValueError as exc:
        raise Refused(f"GPU sharing state {path} is not gpuprov's ({exc}): run `gpuprov share disable`, then "
                      "`gpuprov share enable`") from None
    try:
        os.kill(state.daemon_pid, 0)
    except OSError:
        return None
    return state


def apply_sharing(config: dict, env: dict[str, str], n_gpus: int, settings: Settings) -> None:
    """MPS client settings for a GPU container: limits, the pipe directory, the daemon's /dev/shm and IPC."""
    for var in MPS_VARS:  # a container never sets its own MPS limits or pipes
        env.pop(var, None)
    state = load_share_state(settings.share_state)
    req = share_request(env, n_gpus, state)
    if req is None:
        return
    uid = int(config.get("process", {}).get("user", {}).get("uid", 0))
    if uid != state.uid:
        raise Refused(f"GPU sharing needs the container to run as uid {state.uid} (the MPS daemon's); "
                      f"it runs as uid {uid}")
    env.update(mps_env(req, state))
    mounts = [m for m in config.get("mounts", []) if m.get("destination") != "/dev/shm"]
    mounts.append({"destination": "/dev/shm", "source": "/dev/shm", "type": "bind",
                   "options": ["rbind", "nosuid", "nodev", "noexec"]})
    mounts.append({"destination": state.pipe_dir, "source": state.pipe_dir, "type": "bind",
                   "options": ["rbind", "nosuid", "nodev", "noexec"]})
    config["mounts"] = mounts
    linux = config.setdefault("linux", {})
    linux["namespaces"] = [n for n in linux.get("namespaces", []) if n.get("type") != "ipc"]  # MPS needs host IPC


def modify_config(config: dict, bundle: str, settings: Settings) -> bool:
    """Apply GPU edits to `config` in place. Returns True when something changed. Raises Refused."""
    process = config.setdefault("process", {})
    env = edits.env_dict(process.get("env"))
    if "ALIYUN_COM_GPU_VISIBLE_DEVICES" in env:
        aliyun_visible(env)
    hooks = config.get("hooks", {}).get("prestart", [])
    gpus_hook = [h for h in hooks if posixpath.basename(h.get("path", "")) == HOOK_NAME]
    if gpus_hook and not all(_our_hook(h["path"]) for h in gpus_hook):
        return False  # NVIDIA's own toolkit hook: leave the whole job to it, never break such a host
    selectors = edits.requested_devices(env)
    mounted = _mounted_device_list(config)
    if selectors == [DEVICE_LIST_DIR]:  # the device plugin's volume-mounts strategy: the list is in the mounts
        selectors = mounted
    if selectors is None or (not settings.accept_env_unprivileged and not is_privileged(config)):
        selectors = mounted  # multi-tenant policy: only the device lists the orchestrator mounted count
    changed = False
    if gpus_hook:
        config["hooks"]["prestart"] = [h for h in hooks if h not in gpus_hook]
        changed = True
    if selectors is None:
        if any(env.get(v, "").strip() not in ("", "0") for v in REQUEST_VARS):
            raise Refused("GPU memory/compute limits were asked for, but the container requests no GPU "
                          "(set NVIDIA_VISIBLE_DEVICES or --gpus)")
        return changed
    disc = load_discovery(settings)
    rootfs = config.get("root", {}).get("path", "rootfs")
    rootfs = rootfs if os.path.isabs(rootfs) else os.path.join(bundle, rootfs)
    e = edits.compute_edits(disc, env, libdir=image_libdir(rootfs), selectors=selectors)
    for node in e["devices"]:
        _check_node(settings.dev_root, node)
    linux = config.setdefault("linux", {})
    have = {d.get("path") for d in linux.get("devices", [])}
    linux.setdefault("devices", []).extend(d for d in e["devices"] if d["path"] not in have)
    linux.setdefault("resources", {}).setdefault("devices", []).extend(e["allow"])
    rootfs_real = os.path.realpath(rootfs)
    taken = {m.get("destination") for m in config.get("mounts", [])}
    for m in e["mounts"]:
        if not _safe_source(m["source"], rootfs_real):
            continue
        m["destination"] = scoped_resolve(rootfs, m["destination"])
        if m["destination"] in taken:
            continue
        taken.add(m["destination"])
        config.setdefault("mounts", []).append(m)
    # Our values replace the image's: NVIDIA_VISIBLE_DEVICES becomes the resolved list.
    env.update(e["env"])
    n_gpus = len([d for d in e["devices"] if d["path"][len("/dev/nvidia"):].isdigit()])
    apply_sharing(config, env, n_gpus, settings)
    process["env"] = [f"{k}={v}" for k, v in env.items()]
    return True


# The parts of config.json the edits read or write, and the JSON type each must have (runc's own spec types).
SHAPE = {"process": dict, "process.env": list, "process.capabilities": dict, "process.capabilities.bounding": list,
         "process.user": dict, "process.user.uid": int, "mounts": list, "linux": dict, "linux.devices": list,
         "linux.resources": dict, "linux.resources.devices": list, "linux.namespaces": list, "root": dict,
         "root.path": str, "hooks": dict, "hooks.prestart": list}
ITEMS = {"process.env": str, "process.capabilities.bounding": str, "mounts": dict, "linux.devices": dict,
         "linux.namespaces": dict, "hooks.prestart": dict}


def check_shape(config: object) -> None:
    """ValueError naming the first field whose type is not runc's (a config.json runc itself would reject): the
    edits then never meet a surprise type, and the refusal is one line instead of a traceback."""
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    for key, typ in SHAPE.items():
        node: object = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            continue
        if not isinstance(node, typ) or isinstance(node, bool):
            raise ValueError(f"config.json: {key} must be a JSON {typ.__name__.replace('dict', 'object')}")
        item = ITEMS.get(key)
        if item and not all(isinstance(x, item) for x in node):
            raise ValueError(f"config.json: every entry of {key} must be a JSON {item.__name__.replace('dict', 'object')}")
    for m in config.get("mounts", []):
        if not all(isinstance(m.get(k, ""), str) for k in ("destination", "source", "type")):
            raise ValueError("config.json: a mount's destination, source and type must be strings")


def modify_bundle(bundle: str, settings: Settings) -> bool:
    path = os.path.join(bundle, "config.json")
    with open(path) as fh:
        config = json.load(fh)
    check_shape(config)
    if not modify_config(config, bundle, settings):
        return False
    # The one write path; no fsync: a container's config.json does not outlive the host's uptime.
    write_file(path, json.dumps(config, separators=(",", ":")), backup=False, durable=False)
    return True
