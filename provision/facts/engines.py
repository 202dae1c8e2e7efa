"""Container engines present on a host: binary, version, config path, whether the config parses, runtimes."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, NamedTuple

from provision.facts.packages import InstalledPackage, dpkg_installed, dpkg_owns
from provision.facts.rootfs import read_bytes_bounded, under

# containerd's CRI plugin per config version (version 3, containerd 2.x, split the plugin; its runtime part holds the
# runtimes). The one table: the containerd adapter (engines/containerd.py) uses it too.
CRI_PLUGIN = {1: "cri", 2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
BIN_DIRS = ("usr/bin", "usr/sbin", "usr/local/bin", "usr/local/sbin", "bin", "sbin")


class Origin(NamedTuple):
    """A package an engine comes in: its name, where that package comes from, and what people call it."""
    package: str
    source: str  # docker-ce (Docker's own packages) | distro (the distribution's)
    label: str


def _toml_load(text: str) -> dict:
    try:
        import tomllib  # lazy: 3.3 ms (-X importtime, min of 11) on every detect; only a TOML config is parsed with it
    except ModuleNotFoundError:  # pragma: no cover - Python 3.9/3.10 have no tomllib; tomlkit parses there
        import tomlkit  # lazy: 19 ms (-X importtime, min of 5), the same on Python 3.9/3.10

        return tomlkit.parse(text).unwrap()
    return tomllib.loads(text)


def _dig(d: dict, *keys: str) -> dict:
    for k in keys:
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d if isinstance(d, dict) else {}


# Each engine's config read for detect: (runtimes, default runtime, extra); a ValueError when it does not parse.

def _daemon_json(text: str) -> tuple[tuple[str, ...], str | None, dict]:
    doc = json.loads(text) if text.strip() else {}
    if not isinstance(doc, dict):
        raise ValueError("top level is not a JSON object")
    runtimes = tuple(["runc", *[r for r in doc.get("runtimes", {}) if r != "runc"]])
    return runtimes, doc.get("default-runtime", "runc"), {"cdi": bool(_dig(doc, "features").get("cdi"))}


def _containerd_toml(text: str) -> tuple[tuple[str, ...], str | None, dict]:
    doc = _toml_load(text)
    version = doc.get("version", 1)
    if type(version) is not int or version not in CRI_PLUGIN:
        raise ValueError(f"`version = {version!r}` is not a containerd config version (1, 2 or 3)")
    c = _dig(doc, "plugins", CRI_PLUGIN[version], "containerd")
    return tuple(c.get("runtimes", {})), c.get("default_runtime_name"), {"version": version}


def _crio_toml(text: str) -> tuple[tuple[str, ...], str | None, dict]:
    rt = _dig(_toml_load(text), "crio", "runtime")
    return tuple(rt.get("runtimes", {})), rt.get("default_runtime"), {}


def _containers_conf(text: str) -> tuple[tuple[str, ...], str | None, dict]:
    eng = _dig(_toml_load(text), "engine")
    return tuple(eng.get("runtimes", {})), eng.get("runtime"), {}


class EngineSpec(NamedTuple):
    """What tells an engine on a host: its daemon binary, the config file it reads by default and the flags that
    name another one, the packages it comes in (most specific first), its systemd unit, and Ubuntu's snap."""
    name: str
    binary: str
    config: str
    version_args: tuple[str, ...]
    config_flags: tuple[str, ...] = ()
    packages: tuple[Origin, ...] = ()
    unit: str | None = None
    snap_config: str | None = None  # the snap's config file (the snap's dockerd reads it, not /etc/docker)
    snap_unit: str | None = None
    read: Callable[[str], tuple[tuple[str, ...], str | None, dict]] = _containers_conf  # its config, for detect
    unconfigured: tuple[tuple[str, ...], str | None] = ((), None)  # (runtimes, default) with no config file
    imports: bool = False  # the config's `imports` name more files, whose runtimes count too (containerd)


ENGINES = (
    EngineSpec("docker", "dockerd", "/etc/docker/daemon.json", ("--version",), ("--config-file",),
               (Origin("docker-ce", "docker-ce", "Docker CE"), Origin("docker.io", "distro", "docker.io"),
                Origin("moby-engine", "distro", "Moby"), Origin("docker", "distro", "Docker")),
               "docker", "/var/snap/docker/current/config/daemon.json", "snap.docker.dockerd",
               read=_daemon_json, unconfigured=(("runc",), "runc")),
    EngineSpec("containerd", "containerd", "/etc/containerd/config.toml", ("--version",), ("--config", "-c"),
               (Origin("containerd.io", "docker-ce", "containerd.io (Docker CE)"),
                Origin("containerd", "distro", "containerd")), "containerd", read=_containerd_toml, imports=True),
    EngineSpec("podman", "podman", "/etc/containers/containers.conf", ("--version",),
               packages=(Origin("podman", "distro", "Podman"),)),  # no daemon, no unit
    EngineSpec("cri-o", "crio", "/etc/crio/crio.conf", ("--version",), ("--config", "-c"),
               (Origin("cri-o", "distro", "CRI-O"),), "crio", read=_crio_toml),
)


def spec(name: str) -> EngineSpec:
    return next(s for s in ENGINES if s.name == name)


class EngineOrigin(NamedTuple):
    """Where an engine on the host came from and what its daemon really reads: gpuprov keeps an engine it found
    (the plan says "Docker CE 28.0.1 (docker-ce): kept" and configures that config, unit and daemon), and an
    uninstall removes only an engine gpuprov installed itself, never one recorded here as found."""
    source: str  # docker-ce | distro | snap | static | rpm (an rpm package: which one, `rpm -qf` on the live host)
    label: str  # for people: "Docker CE", "docker.io", "static binaries", "snap"
    package: str | None  # the package that owns the daemon binary (None: snap, static binaries)
    version: str | None  # that package's version, e.g. "5:28.0.1-1~debian.12~bookworm"
    binary: str | None  # the daemon binary: the running daemon's executable, else the one found on PATH
    config: str  # the config file it reads: its --config-file/--config, the snap's, or the engine's default
    unit: str | None  # the systemd unit that runs it (None: static binaries, started by hand or by other means)
    pid: int | None = None  # the running daemon (in this mount namespace), if any
    argv: tuple[str, ...] = ()  # its command line

    def describe(self) -> str:
        if self.package:
            upstream = InstalledPackage(self.package, self.version or "").upstream
            return f"{self.label} {upstream} ({self.package})"
        if self.source == "static":
            return f"{Path(self.binary or '?').name} from static binaries ({self.binary}, no package owns it)"
        return f"{self.label} ({self.binary})"

    def to_dict(self) -> dict:
        d = self._asdict()
        d["argv"] = list(self.argv)
        d["description"] = self.describe()
        return d


class EngineFacts(NamedTuple):
    name: str
    binary: str | None
    version: str | None
    config_path: str
    config_exists: bool
    config_valid: bool | None  # None when there is no config file (engine defaults apply)
    config_error: str | None
    runtimes: tuple[str, ...]
    default_runtime: str | None
    extra: dict  # the engine's own facts (docker: cdi; containerd: the config version)
    origin: EngineOrigin | None = None  # None: no daemon binary, package, snap or running daemon (a config alone)

    def to_dict(self) -> dict:
        d = self._asdict()
        d["runtimes"] = list(self.runtimes)
        d["origin"] = self.origin.to_dict() if self.origin else None
        return d


def find_binary(root: Path, name: str) -> str | None:
    for d in BIN_DIRS:
        p = under(root, f"{d}/{name}")
        if p.is_file():
            return "/" + f"{d}/{name}"
    return None


def flag_value(argv: list[str] | tuple[str, ...], names: tuple[str, ...], first: bool = False) -> str | None:
    """The value of `--flag VALUE` or `--flag=VALUE`: the last one wins, as in Go's flag parsing; with `first`, the
    first one (conmon: Podman repeats its own options after conmon's as `--exit-command-arg --runtime …`)."""
    value = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(n + "="):
                value = a[len(n) + 1:]
            else:
                continue
            if first:
                return value
    return value


def _link(path: Path) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def processes_by_name(names: tuple[str, ...], root: Path = Path("/")) -> dict[str, list[tuple[int, list[str]]]]:
    """(pid, argv) of every process whose name (`comm`) is one of `names`, by name, oldest first, from `proc` under
    `root` (the one /proc scan: the adapters find their live daemon with it; pid files can be stale or another's)."""
    found: dict[str, list[tuple[int, list[str]]]] = {}
    try:
        entries = list(os.scandir(under(root, "proc")))
    except OSError:
        return {}
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:  # the bounded reader, as for a parent's comm below: half of open()'s cost on every process of the node
            name = read_bytes_bounded(f"{entry.path}/comm", 64).decode(errors="replace").strip()
            if name not in names:
                continue
            argv = [a.decode(errors="replace") for a in read_bytes_bounded(f"{entry.path}/cmdline").split(b"\0") if a]
        except OSError:
            continue  # exited meanwhile (or not a regular file under a --root tree: NotRegular)
        found.setdefault(name, []).append((int(entry.name), argv))
    return {name: sorted(procs) for name, procs in found.items()}


def find_processes(names: tuple[str, ...], root: Path = Path("/")) -> list[tuple[int, list[str]]]:
    """(pid, argv) of every process named one of `names`, oldest first (processes_by_name, merged)."""
    return sorted(p for procs in processes_by_name(names, root).values() for p in procs)


def _parent_name(root: Path, pid: int) -> str | None:
    try:
        stat = read_bytes_bounded(under(root, f"proc/{pid}/stat")).decode(errors="replace")
        ppid = stat.rsplit(")", 1)[1].split()[1]
        return read_bytes_bounded(under(root, f"proc/{ppid}/comm")).decode(errors="replace").strip()
    except (OSError, IndexError):
        return None


def _our_daemon(root: Path, sp: EngineSpec, candidates: list[tuple[int, list[str]]]) -> tuple[int, list[str], str | None] | None:
    """The engine's running daemon in this PID namespace (a nested engine in a container is another host's; a
    private mount namespace, as a read-only `plan` may run in, still sees this host's daemons), and not one another
    engine runs for itself (dockerd starts a private containerd, with its own --config, when no system containerd
    runs): (pid, argv, its executable)."""
    ours = _link(under(root, "proc/self/ns/pid"))
    engines = {e.binary for e in ENGINES}
    for pid, argv in candidates:
        if _link(under(root, f"proc/{pid}/ns/pid")) != ours or _parent_name(root, pid) in engines:
            continue
        exe = _link(under(root, f"proc/{pid}/exe"))
        return pid, argv, exe.removesuffix(" (deleted)") if exe else None
    return None


def read_origin(root: Path, sp: EngineSpec, binary: str | None,
                candidates: list[tuple[int, list[str]]]) -> EngineOrigin | None:
    """Where the engine came from: the package that owns its daemon binary (dpkg's file lists), Ubuntu's snap, or
    static binaries no package owns; the config its running daemon reads (its --config-file/--config), among the
    `candidates` (the processes of its daemon's name). None when there is no binary, no package, no snap and no daemon."""
    running = _our_daemon(root, sp, candidates)
    pid, argv, exe = running if running else (None, [], None)
    binary = exe or binary
    flagged = flag_value(argv, sp.config_flags) if sp.config_flags else None
    config = flagged if flagged and flagged.startswith("/") else sp.config
    snap = bool(sp.snap_config) and (under(root, str(sp.snap_config)).is_file() or "/snap/" in (binary or ""))
    if snap:
        return EngineOrigin("snap", "Ubuntu's snap", "docker", None, binary or "/snap/bin/docker",
                            flagged or str(sp.snap_config), sp.snap_unit, pid, tuple(argv))
    known = dpkg_installed(root, {o.package for o in sp.packages}.__contains__, partly=True)
    for o in sp.packages:
        pkg = known.get(o.package)
        if pkg and (binary is None or dpkg_owns(root, pkg, binary)):
            if not pkg.installed:
                return None  # left half-installed (a killed run): the plan's install step completes it
            return EngineOrigin(o.source, o.label, o.package, pkg.version, binary, config, sp.unit, pid, tuple(argv))
    if binary is None:
        return None
    if under(root, "var/lib/dpkg/status").is_file():
        return EngineOrigin("static", "static binaries", None, None, binary, config, None, pid, tuple(argv))
    return EngineOrigin("rpm", "an rpm package", None, None, binary, config, sp.unit, pid, tuple(argv))


def _containerd_imports(root: Path, main: str, text: str, runtimes: tuple[str, ...],
                        default: str | None) -> tuple[tuple[str, ...], str | None]:
    """Runtimes defined in the files the main config imports (gpuprov's own drop-in among them), read under
    `root`: listed with the main file's, the last default named wins. (containerd's exact merge rules differ by
    version; detect reports what is registered, `containerd config dump` is the engine's own answer.)"""
    imports = _toml_load(text).get("imports") or []
    seen = list(runtimes)
    for entry in imports if isinstance(imports, list) else []:
        path = entry if str(entry).startswith("/") else str(Path(main).parent / str(entry))
        for f in sorted(under(root, "/").glob(path.lstrip("/"))):
            try:
                more, dflt, _ = _containerd_toml(read_bytes_bounded(f).decode())
            except (OSError, ValueError, TypeError):
                continue  # an unreadable import is containerd's to refuse, not detect's
            seen += [r for r in more if r not in seen]
            default = dflt or default
    return tuple(seen), default


def read_engines(root: Path) -> list[EngineFacts]:
    """Engines found under `root`, by their binaries, packages, running daemons and config files (read only;
    `version` is left None: it takes running the binary, which `provision.probe.engines.with_versions` does on the
    live host). The config read is the one the engine really reads (EngineOrigin.config)."""
    found = []
    daemons = processes_by_name(tuple(sp.binary for sp in ENGINES), root)  # one /proc scan for every engine
    for sp in ENGINES:
        binary = find_binary(root, sp.binary)
        origin = read_origin(root, sp, binary, daemons.get(sp.binary, []))
        config = origin.config if origin else sp.config
        text = None
        try:
            text = read_bytes_bounded(under(root, config)).decode()  # a FIFO or huge file must not hang detect
        except OSError:
            pass
        if binary is None and text is None and origin is None:
            continue
        runtimes: tuple[str, ...] = ()
        default = None
        extra: dict = {}
        valid: bool | None = None
        error = None
        if text is not None:
            try:
                runtimes, default, extra = sp.read(text)
                if sp.imports:
                    runtimes, default = _containerd_imports(root, config, text, runtimes, default)
                valid = True
            except (ValueError, TypeError) as exc:  # json/toml decode errors are ValueErrors
                valid, error = False, str(exc).splitlines()[0]
        else:
            runtimes, default = sp.unconfigured
        found.append(
            EngineFacts(
                name=sp.name, binary=(origin.binary if origin else None) or binary, version=None,
                config_path=config, config_exists=text is not None, config_valid=valid, config_error=error,
                runtimes=runtimes, default_runtime=default, extra=extra, origin=origin,
            )
        )
    return found
