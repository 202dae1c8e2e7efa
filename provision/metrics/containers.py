"""Which container a host process belongs to: the one code path that `gpuprov metrics` and `gpuprov share status`
both use, so their per-container numbers agree.

The container ID comes from the process's cgroup (`/proc/<pid>/cgroup`), whatever the engine and cgroup driver:
  docker      /docker/<id>                         system.slice/docker-<id>.scope
  containerd  /kubepods/<qos>/pod<uid>/<id>         kubepods-….slice/cri-containerd-<id>.scope   /<ns>/<id> (ctr)
  CRI-O       /kubepods/…/crio-<id>                 crio-<id>.scope
  Podman      /libpod_parent/libpod-<id>            machine.slice/libpod-<id>.scope (rootless: user.slice/…)
  runc alone  /<id>
Names come from the container's OCI config (bundle `config.json`), whose annotations the CRI engines fill in
(containerd: io.kubernetes.cri.*, CRI-O: io.kubernetes.*), or from Docker's own record (its labels carry the same
io.kubernetes.* keys when kubelet drives Docker through cri-dockerd). The bundle is found from the container's shim
(`containerd-shim-*` runs in a bundle directory; `conmon` names it with `--bundle`), so private engines with their
own state directories are covered without configuration."""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

_HEX64 = re.compile(r"[0-9a-f]{64}")
# (container, pod, namespace) annotation / label keys, in order of preference.
_NAME_KEYS = (
    ("io.kubernetes.cri.container-name", "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri.sandbox-namespace"),
    ("io.kubernetes.container.name", "io.kubernetes.pod.name", "io.kubernetes.pod.namespace"),
)
_BUNDLE_ROOTS = ("/run/containerd/io.containerd.runtime.v2.task", "/run/docker/containerd/daemon/io.containerd.runtime.v2.task")


@functools.cache
def _adapters() -> tuple:
    from provision import engines  # lazy: 25 ms (-X importtime, min of 6: the adapters, tomlkit), at the first lookup

    return tuple(engines.every())


@functools.cache
def _prefixes() -> tuple[tuple[str, str], ...]:
    return tuple(p for e in _adapters() for p in e.cgroup_prefixes)


@functools.cache
def _parents() -> tuple[tuple[str, str], ...]:
    return tuple((d, e.name) for e in _adapters() for d in e.cgroup_parents)


@functools.cache
def _stores() -> dict:
    return {e.name: e for e in _adapters() if e.container_store}


_SHIMS = ("containerd-shim", "conmon")


@dataclass(frozen=True)
class ContainerRef:
    id: str  # full ID as the engine knows it
    engine: str  # docker | containerd | cri-o | podman | runc
    container: str = ""  # Kubernetes container name, or the engine's name for the container
    pod: str = ""
    namespace: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def container_id_from_cgroup(text: str) -> tuple[str, str] | None:
    """(id, engine) from the contents of /proc/<pid>/cgroup, or None for a process in no container."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        parts = [p for p in path.split("/") if p]
        if not parts:
            continue
        leaf = parts[-1].removesuffix(".scope")
        for prefix, engine in _prefixes():
            if leaf.startswith(prefix):
                return leaf[len(prefix):], engine
        parent = next((label for name, label in _parents() if name in parts[:-1]), None)
        if parent:
            return leaf, parent
        if any(p.startswith("kubepods") for p in parts[:-1]):
            return leaf, "containerd" if _HEX64.fullmatch(leaf) else "cri"
        if parts[0] in ("system.slice", "user.slice", "init.scope") or leaf.endswith((".service", ".slice")):
            continue  # a host service, not a container
        # runc / ctr without kubepods: the container's cgroup is named after it (`/<id>` or `/<ns>/<id>`)
        return leaf, "containerd" if len(parts) == 2 else "runc"
    return None


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def _ppid(pid: int, proc: str) -> int | None:
    stat = _read(f"{proc}/{pid}/stat")
    if not stat:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[1])  # the comm field may hold spaces and ')'
    except (IndexError, ValueError):
        return None


def _shim_bundle_dirs(pid: int, proc: str) -> list[str]:
    """Bundle directories named by the shim that supervises `pid` (walking up its parents)."""
    seen = 0
    while pid and pid > 1 and seen < 32:
        seen += 1
        comm = (_read(f"{proc}/{pid}/comm") or "").strip()
        if comm.startswith(_SHIMS):
            args = (_read(f"{proc}/{pid}/cmdline") or "").split("\0")
            dirs = []
            for flag in ("--bundle", "-b"):
                if flag in args and args.index(flag) + 1 < len(args):
                    dirs.append(args[args.index(flag) + 1])
            try:
                dirs.append(os.readlink(f"{proc}/{pid}/cwd"))
            except OSError:
                pass
            return dirs
        pid = _ppid(pid, proc) or 0
    return []


def _config_candidates(cid: str, pid: int, proc: str) -> list[str]:
    out = []
    for d in _shim_bundle_dirs(pid, proc):
        d = d.rstrip("/")
        if cid in d.split("/"):  # the container's own bundle (containerd: .../<id>, CRI-O: .../<id>/userdata)
            out.append(os.path.join(d, "config.json"))
        # one shim per pod (containerd's CRI) runs in the sandbox's bundle: the container's is its sibling
        out.append(os.path.join(os.path.dirname(d), cid, "config.json"))
    for root in _BUNDLE_ROOTS:
        try:
            out += [os.path.join(root, ns, cid, "config.json") for ns in os.listdir(root)]
        except OSError:
            pass
    out.append(f"/run/containers/storage/overlay-containers/{cid}/userdata/config.json")
    return out


def _names(meta: dict) -> tuple[str, str, str] | None:
    for keys in _NAME_KEYS:
        if keys[0] in meta or keys[1] in meta:
            return tuple(meta.get(k, "") for k in keys)  # type: ignore[return-value]
    return None


def _resolve(cid: str, engine: str, pid: int, proc: str) -> ContainerRef:
    store = _stores().get(engine)  # an engine that keeps its containers' names in a store of its own (dockerd)
    for path in _config_candidates(cid, pid, proc):
        text = _read(path)
        if not text:
            continue
        try:
            spec = json.loads(text)
        except ValueError:
            continue
        names = _names(spec.get("annotations") or {})
        if names:
            cri = "containerd" if any(k in spec["annotations"] for k in _NAME_KEYS[0]) else "cri-o"
            return ContainerRef(cid, cri, *names)
        if store is None:
            return ContainerRef(cid, engine, cid[:12])
    found = store.stored_container(cid) if store else None
    if found is not None:
        labels, name = found
        names = _names(labels)
        return ContainerRef(cid, engine, *names) if names else ContainerRef(cid, engine, name or cid[:12])
    return ContainerRef(cid, engine, cid[:12])


def _in_host_mount_ns(pid: int, proc: str) -> bool:
    """A process in the host's mount namespace is no container's, whatever cgroup it sits in (seen on a GPU host:
    the MPS server started from a job's cgroup `/<id>`, which looks like a runc container's)."""
    try:
        mine = os.readlink(f"{proc}/{pid}/ns/mnt")
    except OSError:
        return False
    for ref in (f"{proc}/1/ns/mnt", "/proc/self/ns/mnt"):  # the host's init; else gpuprov's own (a host process)
        try:
            return mine == os.readlink(ref)
        except OSError:
            continue
    return False


def container_of(pid: int, proc: str = "/proc", cache: dict | None = None) -> ContainerRef | None:
    """The container that process `pid` runs in (None for a host process or a process that is gone)."""
    cg = _read(f"{proc}/{pid}/cgroup")
    if cg is None or _in_host_mount_ns(pid, proc):
        return None
    found = container_id_from_cgroup(cg)
    if not found:
        return None
    cid, engine = found
    if cache is not None and cid in cache:
        return cache[cid]
    ref = _resolve(cid, engine, pid, proc)
    if cache is not None:
        cache[cid] = ref
    return ref
