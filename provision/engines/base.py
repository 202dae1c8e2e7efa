"""The one interface every container-engine adapter implements (docker, containerd, CRI-O, …), and the only place
(with its subclasses in this package) that knows an engine by name: plan/, effects, verify/, k8s/ and metrics/ ask
the adapter (tests/unit/test_engine_literals.py fails on an engine-name comparison anywhere else).

An adapter owns, for its engine: where the config lives, how it is parsed (strictly: whatever the engine would reject
is refused here, exit 6, file untouched), how gpuprov's runtime is merged in (typed Changes: what changed and whether
the live daemon picks it up on a reload or needs a restart), how the *live* daemon is found and which config file it
really reads, how it is reloaded/restarted, and how the result is verified. `engines.configure.configure` drives any
adapter the same way: plan → write through `fsutil.write_file` → check (rolled back on failure) → signal the live
daemon only when it reads the file that was written → verify.

Adding an engine (podman, …) = one module here with a subclass of Engine, and its class added to ADAPTERS in
`provision/engines/__init__.py`. The subclass sets or implements:

- identity: `name` (what `--engine`/`engine configure NAME` say), `title` (for people), `default_config`,
  `daemon_names` (its /proc/PID/comm), `pid_files` (optional fast path);
- config: `plan` (merge gpuprov's runtime in: FileEdits + Changes; reads only), `plan_under` (the same for a host
  tree at `--root`, files only: override it when `plan` asks the live engine anything), `unplan` (the undo),
  `config_path` (when `--config` may name a directory), `check` (the engine's own offline check of what was
  written, optional), `daemon_config` (the config file a daemon with this argv reads);
- the live daemon: `live_daemon`/`running_daemons` (inherited), `apply` (reload or restart), `apply_how` (that,
  for people), `pending_restart` (optional), `verify` (does the live daemon list the runtime; optional),
  `lists_runtimes` + `listed_runtimes` (an engine that lists its runtimes: the plan's check asks it too);
- installing and starting it: `unit`, `ready_argv`, `packages`, `default_source` (bootstrap offers the engines
  options.Engine lists: offering a new one is a line there too), `gpus_through_cdi` (an engine whose containers
  get GPUs through CDI, not a runtime of gpuprov's: bootstrap writes the CDI spec and leaves its default runtime);
- bootstrap's validation container: `validation` (image import, commands, containers through the runtime);
- `gpuprov verify` on a node: `node_probe`, `node_runtime`, `check_container_argv`, `check_log`, `check_route`,
  `prepare_check_image`, and for a CRI engine `serves_cri` + `cri_handler`;
- k8s and metrics: `has_cdi`, `cgroup_prefixes`, `cgroup_parents`, `container_store` + `stored_container`;
- its store, for `uninstall --purge-engine` (what a purge of its packages would delete): `data_root`,
  `data_packages`, `purge_deletes_data`, `stored`.
The identity, `plan`, `unplan`, `daemon_config` and `apply` are required; everything else has a default that means
"this engine does not do that". The plan's steps use all of it generically (plan/steps: ConfigureEngine, StartService,
ImportImage, ReloadEngine), so nothing outside this package changes for a new engine.
"""
from __future__ import annotations

import json
import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, NamedTuple

from provision import effects
from provision.engines import validate
from provision.errors import ConfigInvalid, Unsupported, UsageError
from provision.facts.engine_data import StoredData
from provision.facts.engines import find_processes, flag_value  # noqa: F401  (the adapters' helpers, one copy)
from provision.facts.rootfs import MAX_READ, NotRegular, read_bytes_bounded, under

if TYPE_CHECKING:
    from provision.decide.targets import Target

RUNTIME_PATH = "/usr/local/bin/gpuprov-runtime"  # where bootstrap installs gpuprov's runtime


@dataclass(frozen=True)
class RuntimeRequest:
    """What the operator asked for: register `path` as runtime `name` (and maybe make it the default, enable CDI)."""

    name: str
    path: str
    default: bool = False
    cdi: bool = False
    replace: bool = False  # --replace-runtime: the operator's runtime of that name / default-runtime may be replaced
    options: tuple[tuple[str, str], ...] = ()  # --engine-option: (daemon.json key, JSON value), Docker only


@dataclass(frozen=True)
class Change:
    """One setting gpuprov changes in an engine's config."""

    key: str  # where, in the engine's own terms: "runtimes.nvidia", "default-runtime", "features.cdi"
    value: str  # what it becomes, for people
    reload: bool = True  # True: the live daemon applies it on a reload (SIGHUP); False: it needs a restart

    def __str__(self) -> str:
        return f"{self.key} -> {self.value}"


@dataclass(frozen=True)
class FileEdit:
    path: Path
    old: str | None  # None: the file does not exist yet
    new: str

    @property
    def changed(self) -> bool:
        return self.old != self.new

    def diff(self) -> str:
        return effects.unified_diff(self.old or "", self.new, str(self.path)) if self.changed else ""


@dataclass
class EnginePlan:
    """What configuring an engine would do: the files to write and the settings that change."""

    edits: list[FileEdit]
    changes: list[Change]
    warnings: list[str] = field(default_factory=list)
    removals: list[Path] = field(default_factory=list)  # files to remove (an undo: gpuprov's own drop-ins), in order

    @property
    def changed(self) -> bool:
        return any(e.changed for e in self.edits) or bool(self.removals)

    @property
    def needs_restart(self) -> bool:
        return any(not c.reload for c in self.changes)

    def diff(self) -> str:
        return "".join(e.diff() for e in self.edits)


@dataclass(frozen=True)
class Daemon:
    """A running engine daemon and the config path it reads, as it sees it (its own mount namespace)."""

    pid: int
    argv: tuple[str, ...]
    config: str

    def path_in_its_root(self, path: str) -> str:
        if not os.path.isabs(path):
            return f"/proc/{self.pid}/cwd/{path}"
        return f"/proc/{self.pid}/root{path}"

    def reads(self, path: Path) -> bool:
        """Whether the file this daemon reads is `path` (same inode, seen through /proc/PID/root: right across
        symlinks, bind mounts and containers, where comparing path strings is not)."""
        return same_file(path, Path(self.path_in_its_root(self.config)))

    def started_at(self) -> float:
        """When this daemon started (epoch seconds): /proc/PID/stat's start time after boot plus the boot time. Not
        /proc/PID's mtime, which is when its inode was first looked up, often long after the start. OSError when
        the process is gone."""
        with open(f"/proc/{self.pid}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22 (starttime); comm may hold ')'
        with open("/proc/stat") as fh:
            boot = next(int(ln.split()[1]) for ln in fh if ln.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")

    def in_our_mount_namespace(self) -> bool:
        try:
            return os.readlink(f"/proc/{self.pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt")
        except OSError:
            return False

    def is_unit(self, unit: str) -> bool:
        """Whether this daemon is systemd's `unit` here (its main process): only then does `systemctl restart unit`
        restart it. Another daemon of the same engine (its own --config, e.g. a private test or CI containerd) must
        not make gpuprov restart the system's."""
        if not (effects.has_systemd() and self.in_our_mount_namespace()):
            return False
        r = effects.run(["systemctl", "show", "--property=MainPID", "--value", unit], check=False, timeout=10)
        return r.returncode == 0 and r.output.strip() == str(self.pid)


@dataclass(frozen=True)
class ImageImport:
    """How an engine gets the check image built from this host's own files (engines/validate.py): `load` reads it
    on stdin (a root-filesystem tar, or a one-layer OCI archive when `oci`), skipped when `present` succeeds (None:
    always loaded; loading the same content again changes nothing)."""
    image: str
    load: tuple[str, ...]
    oci: bool = False
    present: tuple[str, ...] | None = None

    def describe(self) -> str:
        return f"OCI image archive {self.image}" if self.oci else "tar"

    def stdin(self, binaries: tuple[str, ...]) -> bytes:
        tar = validate.build_image_tar(binaries)
        return validate.oci_archive(tar, self.image) if self.oci else tar


@dataclass(frozen=True)
class ContainerRun:
    """One command of bootstrap's validation: a container through the runtime (or a clean-up that may fail)."""
    argv: tuple[str, ...]
    log: str | None = None  # its output is read from this file (`ctr run --log-uri`), not from its stdout
    expect: str | None = None  # the run passes only when its output holds this
    may_fail: bool = False  # a clean-up whose failure is not the step's (printed `|| true`)


@dataclass(frozen=True)
class Validation:
    """Bootstrap's last step for an engine: the check image imported, then these runs, in order."""
    image: ImageImport
    runs: tuple[ContainerRun, ...]
    where: str = ""  # appended to the step's title, e.g. " (containerd, namespace gpuprov)"
    route: str = "through the runtime"  # how its containers get the GPU, in the step's title


Run = Callable[[list], "tuple[int, str, str]"]  # a node's command runner (verify: local, or testinfra's host)


class Engine(ABC):
    """See the module's docstring for what an adapter sets and implements."""
    name: ClassVar[str]
    title: ClassVar[str]  # for people: "Docker", "containerd", "CRI-O"
    default_config: ClassVar[str]
    daemon_names: ClassVar[tuple[str, ...]]  # the daemon's process name(s) (/proc/PID/comm); the first: its binary
    check_error: str | None = None  # why check() said False (one line, for the error after the roll-back)
    # A restart of the daemon stops its containers (dockerd without live-restore); containerd's shims and CRI-O's
    # conmon keep theirs: a restart asked for there needs no --restart-engine consent.
    restart_stops_containers: ClassVar[bool] = False
    pid_files: ClassVar[tuple[str, ...]] = ()  # where the daemon usually says its pid: looked at first (fast path)
    unit: ClassVar[str | None] = None  # the systemd unit / SysV script that runs the daemon
    ready_argv: ClassVar[tuple[str, ...]] = ()  # the client command that succeeds once the daemon answers
    lists_runtimes: ClassVar[bool] = False  # the live daemon lists its runtimes (docker info): checks ask it too
    serves_cri: ClassVar[bool] = False  # a CRI engine (kubelet's): `gpuprov k8s node` and verify's CRI check
    check_log: ClassVar[bool] = False  # verify's check container writes its output to a log file (ctr run)
    cgroup_prefixes: ClassVar[tuple[tuple[str, str], ...]] = ()  # (scope prefix, engine label) in /proc/PID/cgroup
    cgroup_parents: ClassVar[tuple[str, ...]] = ()  # cgroup directories whose children are this engine's containers
    container_store: ClassVar[str | None] = None  # where it keeps its containers' names and labels (stored_container)
    gpus_through_cdi: ClassVar[bool] = False  # its containers get GPUs through CDI (--device), not gpuprov's runtime

    own_front_end: ClassVar[str | None] = None  # its own front-end's file name beside gpuprov-runtime (Podman's)

    def front_end(self, runtime_path: str) -> str:
        """The runtime path this engine registers for gpuprov's runtime at `runtime_path` (gpuprov-runtime): the
        same file, unless the engine has its own front-end (Podman: the one wrapping Podman's OCI runtime)."""
        p = Path(runtime_path)
        return str(p.with_name(self.own_front_end)) if self.own_front_end and p.name == "gpuprov-runtime" else \
            runtime_path

    def oci_runtime(self) -> str | None:
        """The OCI runtime this engine runs, where it has its own front-end and is installed (None otherwise)."""
        return None

    def stranded(self, names: tuple[str, ...]) -> list[str]:
        """Running containers of this engine, created under gpuprov's runtime (any of `names`), that uninstall would
        leave unstoppable and keeps no pass-through for: it refuses while they run (exit 14, --force to go on). []
        for an engine whose containers uninstall keeps stoppable (Docker: plan/uninstall.py's pass-through)."""
        return []

    @property
    def daemon(self) -> str:
        return self.daemon_names[0]

    # --- installing and starting it (engines bootstrap installs) ------------------------------------------------

    def packages(self, target: Target, source: str) -> tuple[str, ...]:
        """The packages that install this engine on `target` from `source` (distro | docker-ce)."""
        raise Unsupported(f"gpuprov does not install {self.name}: install it yourself, then run again")

    def default_source(self, target: Target) -> str:
        """Where its packages come from when --engine-source is auto."""
        return "distro"

    def answers(self) -> bool:
        """Whether the daemon answers its client now (readiness, after a start or restart)."""
        return bool(self.ready_argv) and effects.daemon_answers(self.ready_argv)

    def listed_runtimes(self) -> list[str] | None:
        """The runtimes the live daemon lists (None: cannot ask it, or it lists none: see lists_runtimes)."""
        return None

    def validation(self, runtime_name: str, runtime_path: str, gpu: bool) -> Validation | None:
        """Bootstrap's validation container through runtime `runtime_name` (whose binary is `runtime_path`)."""
        return None

    # --- gpuprov verify, on a node reached through `run` -----------------------------------------------------------

    def node_probe(self, run: Run) -> object | None:
        """What the node's daemon answers (kept for node_runtime), or None when it does not answer."""
        return None

    def node_runtime(self, run: Run, probe: object, name: str, runtime_path: str) -> tuple[str | None, str | None]:
        """(the binary runtime `name` runs, None) when the live engine has it registered, else (None, why not)."""
        return None, f"gpuprov cannot ask {self.name} for its runtimes"

    def check_container_argv(self, cid: str, env: dict[str, str], argv: list[str], runtime_path: str, rootfs: str,
                             log: str) -> list[str]:
        """The command that starts verify's check container through the runtime, never pulling anything."""
        raise UsageError(f"gpuprov verify has no check container for {self.name}")

    def check_route(self) -> str:
        """How verify's check containers start (and get the GPU), for people."""
        return f"runtime nvidia ({self.name})"

    def prepare_check_image(self, rootfs: str) -> None:
        """On this host: verify's check image, from this host's own files (no registry)."""
        raise UsageError(f"gpuprov verify has no check image for {self.name}: --prepare takes docker, containerd or podman")

    def cri_handler(self, run: Run, has_command: Callable[[str], bool], name: str) -> tuple[str, str] | None:
        """A CRI engine's handler `name` on the node: ("pass"|"fail", detail), None when this engine is not there."""
        return None

    # --- k8s and metrics -------------------------------------------------------------------------------------------

    def has_cdi(self) -> bool:
        """Whether this node's engine applies CDI devices."""
        return False

    def stored_container(self, cid: str) -> tuple[dict, str] | None:
        """(labels, name) of container `cid` from the engine's own store, where it keeps one gpuprov can read."""
        return None

    # --- its store: what `uninstall --purge-engine` says a purge would delete, before it deletes anything ------------

    data_root: ClassVar[str | None] = None  # where it keeps its containers, images and volumes
    data_packages: ClassVar[tuple[str, ...]] = ()  # the packages it comes in, from any source
    # Those of data_packages whose purge deletes data_root (their own maintainer scripts do): gpuprov then removes
    # them without purging unless the operator lets it delete (uninstall --delete-engine-data).
    purge_deletes_data: ClassVar[tuple[str, ...]] = ()

    def stored(self, root: Path) -> StoredData | None:
        """Its containers, images and volumes under data_root that are not gpuprov's (the validation image and what
        ran from it), from the live engine where it answers on the live host, else from its files under `root`;
        None where there is no data root."""
        return None

    # --- its config ------------------------------------------------------------------------------------------------

    def config_path(self, config: str | None, req: RuntimeRequest) -> Path:
        return Path(config or self.default_config)

    @abstractmethod
    def plan(self, path: Path, req: RuntimeRequest, *, unit_root: Path = Path("/")) -> EnginePlan:
        """Read and strictly parse the config, merge the request in; raise ConfigInvalid (6) or
        RuntimeConflict (14) with nothing written."""

    def plan_under(self, root: Path, path: Path, req: RuntimeRequest) -> EnginePlan:
        """`plan` for the host tree at `root` (`plan --root`): the config at host path `path` read under `root`, the
        edits naming host paths. Files only: an adapter whose `plan` asks the live engine overrides this."""
        plan = self.plan(under(root, str(path)), req, unit_root=root)
        return EnginePlan([FileEdit(Path("/", Path(e.path).relative_to(root)), e.old, e.new) for e in plan.edits],
                          plan.changes, plan.warnings)

    @abstractmethod
    def daemon_config(self, argv: list[str]) -> str:
        """The config file a daemon started with `argv` reads (its flag, or the engine's default)."""

    def live_daemon(self, path: Path) -> Daemon | None:
        """The running daemon that reads `path`, if any. A --config no running daemon reads is never signalled."""
        for candidates in (lambda: processes_in_pid_files(self.pid_files, self.daemon_names),
                           lambda: find_processes(self.daemon_names)):  # the /proc scan only when needed
            for pid, argv in candidates():
                d = Daemon(pid, tuple(argv), self.daemon_config(argv))
                if d.reads(path):
                    return d
        return None

    def running_daemons(self) -> list[Daemon]:
        return [Daemon(pid, tuple(argv), self.daemon_config(argv)) for pid, argv in find_processes(self.daemon_names)]

    def check(self, path: Path, req: RuntimeRequest) -> bool | None:
        """After writing, before signalling: does the engine itself accept the file? False → the edit is rolled
        back. None: this engine has no offline check."""
        return None

    # config keys its running daemon applies on a reload (docker: daemon.json's, engines/docker.RELOADABLE); any other
    # key an --engine-option sets needs a restart
    reloadable_keys: frozenset[str] = frozenset()

    def pending_restart(self, daemon: Daemon, installing: bool = False) -> str | None:
        """A reason the live daemon needs a restart even when the file is unchanged (docker: the --gpus hook; with
        `installing`, one that this run's runtime.install will put in)."""
        return None

    def restart_stops(self, daemon: Daemon) -> int:
        """How many running containers a restart of `daemon` would stop. 0 for engines whose containers outlive
        their daemon (containerd's shims, CRI-O's conmon); dockerd overrides it."""
        return 0

    @abstractmethod
    def apply(self, daemon: Daemon, plan: EnginePlan, *, restart: bool) -> str:
        """Make the live daemon pick the change up (reload, or restart when `restart` or the plan needs it).
        Returns what was done, for people."""

    def verify(self, daemon: Daemon, req: RuntimeRequest, *, wait: bool = True) -> bool | None:
        """Does the live daemon list the runtime now? None: cannot tell."""
        return None

    @abstractmethod
    def unplan(self, path: Path, entry: dict | None, *, root: Path = Path("/")) -> EnginePlan:
        """The undo of `plan` for the config at host path `path` (read under `root`): gpuprov's keys, drop-ins and
        `imports` entry taken out, every other byte of the operator's kept, their changes since bootstrap included.
        `entry`: what provision/record.py kept of gpuprov's writes to this config (None: no record; gpuprov's keys
        are then found by what they are, e.g. a runtime whose path is gpuprov's runtime). Reads only."""

    def apply_how(self, restart: bool, keeps: int = 0) -> str:
        """How `apply` makes the live daemon read its config, for people (the uninstall plan prints it); `keeps`:
        the running containers a restart keeps by holding them (restart_keeping)."""
        return f"restart {self.daemon_names[0]}"

    def hold_blocker(self, daemon: Daemon) -> str | None:
        """Why the containers a restart of `daemon` would stop cannot be kept through it (None: restart_keeping
        keeps them). Only dockerd's containers need it (restart_stops)."""
        return f"{self.daemon_names[0]} cannot keep its containers across a restart"

    def restart_keeping(self, daemon: Daemon, path: Path) -> str:
        """A restart that keeps the running containers (hold_blocker said it can)."""
        raise NotImplementedError

    def running(self) -> dict[str, tuple[str, str]] | None:
        """The running containers, id -> (name, start time); None: not known."""
        return None

    def held(self, path: Path) -> dict | None:
        """What a run killed during restart_keeping left to put back for `path`; None: nothing."""
        return None

    def finish_hold(self, daemon: Daemon | None, path: Path) -> str | None:
        """Put back what a killed restart_keeping left (held); what was done, or None."""
        return None


# --- helpers shared by the adapters ------------------------------------------------------------------------------

def undo_text(old: str | None, written: str, current: str) -> str | None:
    """`current` with gpuprov's own line changes (`old` -> `written`) taken back, keeping the operator's changes
    since (`written` -> `current`): a three-way merge by lines. None where the operator's changes touch one of
    gpuprov's changes or the lines around it (the adapter then edits the parsed config instead). A file gpuprov
    created (`old` None) gives None unless it is still exactly what gpuprov wrote."""
    if current == written:
        return old
    if old is None:
        return None
    o, w, c = (t.splitlines(keepends=True) for t in (old, written, current))
    w_to_c = {}  # lines of what gpuprov wrote that the operator left alone -> their index in the current file
    for tag, i1, i2, j1, _ in SequenceMatcher(None, w, c, autojunk=False).get_opcodes():
        if tag == "equal":
            w_to_c.update({i1 + k: j1 + k for k in range(i2 - i1)})
    out: list[str] = []
    at = 0
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, o, w, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        # gpuprov turned o[i1:i2] into w[j1:j2]: those lines and the ones around them must be in `current` as written
        start = w_to_c[j1 - 1] + 1 if j1 > 0 and j1 - 1 in w_to_c else (0 if j1 == 0 else None)
        end = w_to_c[j2] if j2 < len(w) and j2 in w_to_c else (len(c) if j2 == len(w) else None)
        if start is None or end is None or start < at or end - start != j2 - j1 \
                or any(w_to_c.get(j1 + k) != start + k for k in range(j2 - j1)):
            return None
        out += c[at:start] + o[i1:i2]
        at = end
    return "".join(out + c[at:])


def read_config(path: Path) -> str | None:
    """The config's text (None when it does not exist); not UTF-8, unreadable, not a regular file (a FIFO would
    hang the read: it is opened non-blocking and refused) or larger than any engine config → ConfigInvalid."""
    try:
        data = read_bytes_bounded(path, MAX_READ + 1)
    except FileNotFoundError:
        return None
    except NotRegular:
        raise ConfigInvalid(f"{path} is not a regular file; move it aside and run again (nothing was changed)") \
            from None
    except OSError as exc:
        raise ConfigInvalid(f"cannot read {path}: {exc.strerror}; the file was not changed") from None
    if len(data) > MAX_READ:
        raise ConfigInvalid(f"{path} is larger than {MAX_READ >> 20} MiB: not an engine config; fix it, then run "
                            "again (the file was not changed)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigInvalid(f"{path} is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r}); fix "
                            "it, then run again (the file was not changed)") from None


class _Reject(ValueError):
    pass


def _no_constants(name: str):
    raise _Reject(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Reject(f"number {text[:40]} is out of range")
    return value


def _sane_int(text: str) -> int:
    if len(text.lstrip("-")) > 308:  # beyond float64, which is what the engines (Go) decode numbers into
        raise _Reject(f"number {text[:40]}… is out of range")
    return int(text)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    doc: dict = {}
    for k, v in pairs:
        if k in doc:
            raise _Reject(f"duplicate key {k!r} (one of the values would be silently lost)")
        doc[k] = v
    return doc


def load_json_strict(text: str, path: str | Path) -> object:
    """JSON as the engines accept it, and stricter where a lenient read would lose the operator's data: no NaN /
    Infinity, no numbers beyond float64 (1e400), no duplicate keys; too-deep nesting refused. → ConfigInvalid (6)."""
    try:
        return json.loads(text, parse_constant=_no_constants, parse_float=_finite_float, parse_int=_sane_int,
                          object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        why = f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
    except _Reject as exc:
        why = str(exc)
    except RecursionError:
        why = "nested too deeply"
    except ValueError as exc:
        why = str(exc)
    raise ConfigInvalid(f"{path} is not valid JSON ({why}); fix it or move it aside, then run again (the file was "
                        "not changed)")


def dump_json(doc: object, path: str | Path) -> str:
    try:
        return json.dumps(doc, indent=2, allow_nan=False) + "\n"
    except (RecursionError, ValueError) as exc:
        raise ConfigInvalid(f"{path}: cannot write it back as JSON ({exc}); the file was not changed") from None


MONITORS = ("conmon", "conmonrs")  # the container monitors CRI-O and Podman start, one per container


class Monitored(NamedTuple):
    """A container run under gpuprov's runtime, seen through its monitor: the monitor's owner, the container's name
    as its engine gave it (`-n`, else its ID) and whether Podman started it (Podman passes `--exit-command`, CRI-O
    never does)."""
    uid: int
    name: str
    podman: bool


def monitored_by_gpuprov() -> list[Monitored]:
    """The running containers whose monitor (conmon, conmon-rs) was started with one of gpuprov's front-ends as the
    OCI runtime (`-r`/`--runtime`): what CRI-O and a rootless Podman would stop through gpuprov's runtime. A
    monitor's own options are read first-wins (flag_value's `first`): Podman repeats its own after them."""
    found = []
    for pid, argv in find_processes(MONITORS):
        runtime = flag_value(argv[1:], ("-r", "--runtime"), first=True)
        if runtime is None or not Path(runtime).name.startswith("gpuprov-runtime"):
            continue
        try:  # the real uid (status' Uid:), not /proc/PID's owner: that is root for a process that is not dumpable
            status = read_bytes_bounded(f"/proc/{pid}/status").decode(errors="replace")
            uid = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Uid:")))
        except (OSError, StopIteration, IndexError, ValueError):
            continue  # gone meanwhile
        name = flag_value(argv[1:], ("-n", "--name"), first=True) or flag_value(argv[1:], ("-c", "--cid"), first=True) \
            or f"pid {pid}"
        found.append(Monitored(uid, name, flag_value(argv[1:], ("--exit-command",), first=True) is not None))
    return found


def processes_in_pid_files(pid_files: tuple[str, ...], names: tuple[str, ...]) -> list[tuple[int, list[str]]]:
    """(pid, argv) of the processes named in these pid files, when they are still running under one of `names`."""
    found = []
    for pidfile in pid_files:
        try:
            pid = int(Path(pidfile).read_text().strip())
            with open(f"/proc/{pid}/comm") as fh:
                if fh.read().strip() not in names:
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                found.append((pid, [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]))
        except (OSError, ValueError):
            continue
    return found


def same_file(a: Path, b: Path) -> bool:
    """Same inode; for files that do not exist (yet), the same name in the same directory."""
    try:
        sa, sb = os.stat(a), os.stat(b)
        return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    # (no realpath here: /proc/PID/root is a magic link that realpath would turn into our own "/")
    try:
        if os.path.lexists(a) or os.path.lexists(b):
            return False
        pa, pb = os.stat(os.path.dirname(a)), os.stat(os.path.dirname(b))
    except OSError:
        return False
    return (pa.st_dev, pa.st_ino) == (pb.st_dev, pb.st_ino) and os.path.basename(a) == os.path.basename(b)
