"""Podman: GPUs through CDI, and gpuprov's runtime as a `containers.conf.d` drop-in for NVIDIA_VISIBLE_DEVICES users.

Podman has no daemon: every `podman` command reads its configuration when it starts, so nothing is reloaded and a
change applies to the next container. GPUs reach containers through CDI, the path Podman itself supports: the spec
`gpuprov cdi refresh` writes in /etc/cdi, and `podman run --device nvidia.com/gpu=all|0|<uuid>`. Podman 4.x reads
CDI specs from /etc/cdi and /var/run/cdi without any setting, rootful and rootless alike (a rootless user reads the
same system specs; the device nodes are bind-mounted into the user's namespace by crun/runc), so gpuprov writes
nothing under any user's home.

The runtime's registration is one drop-in, `/etc/containers/containers.conf.d/99-gpuprov.conf`, written with tomlkit
from a validated name and path: `[engine.runtimes] nvidia = ["/usr/local/bin/gpuprov-runtime"]` (and `[engine]
runtime = "nvidia"` with --default). Podman reads /usr/share/containers/containers.conf, then
/etc/containers/containers.conf, then each file of containers.conf.d in name order, later values winning key by key;
a rootless user's own ~/.config/containers files come after those, and are theirs. A runtime of the same name
pointing elsewhere, or another default runtime, in the operator's system files is theirs: exit 14 unless
--replace-runtime; a file read after gpuprov's that sets one of its keys is a conflict too (exit 14 naming it).
"""
from __future__ import annotations

from pathlib import Path

import tomlkit

from provision import effects
from provision.engines import base, dropin, validate
from provision.engines.base import Change, Daemon, EnginePlan, FileEdit, RuntimeRequest, same_file
from provision.errors import RuntimeConflict, UsageError
from provision.facts.engine_data import StoredData, containers_storage, repository
from provision.facts.rootfs import read_text

VENDOR = "/usr/share/containers/containers.conf"  # the package's defaults
MAIN = "/etc/containers/containers.conf"
DROPIN_DIR = "/etc/containers/containers.conf.d"
DROPIN_NAME = "99-gpuprov.conf"
HEADER = ("Written by gpuprov (engine configure podman): its GPU runtime for NVIDIA_VISIBLE_DEVICES users.\n"
          "GPUs reach containers through CDI (podman run --device nvidia.com/gpu=all); remove this file to "
          "unregister the runtime.")
# Podman's own OCI runtimes: a default of one of these is the engine's, never the operator's choice to protect.
ENGINE_DEFAULTS = (None, "", "crun", "runc")
KIND = "nvidia.com/gpu"  # the CDI device kind gpuprov's spec declares (provision/inject/cdi.py)
# Validation and verify containers: no network (no netavark/CNI needed, nothing reached), never a pull.
RUN = ("podman", "run", "--rm", "--network", "none", "--pull", "never")
INFO = ("podman", "info", "--format", "{{.Host.OCIRuntime.Name}} {{.Version.Version}}")


def dropin_path() -> str:
    return f"{DROPIN_DIR}/{DROPIN_NAME}"


def render(*, runtime_name: str = "nvidia", runtime_path: str, default: bool = False) -> str:
    doc = dropin.document(HEADER, RuntimeRequest(runtime_name, runtime_path))
    engine = tomlkit.table()
    if default:
        engine["runtime"] = runtime_name
    runtimes = tomlkit.table()
    runtimes[runtime_name] = [runtime_path]
    engine["runtimes"] = runtimes
    doc["engine"] = engine
    return tomlkit.dumps(doc)


_load = dropin.load


def _engine(doc: dict) -> dict:
    engine = doc.get("engine", {})
    return engine if isinstance(engine, dict) else {}


def _runtime_paths(doc: dict, name: str) -> list | None:
    runtimes = _engine(doc).get("runtimes", {})
    paths = runtimes.get(name) if isinstance(runtimes, dict) else None
    return paths if isinstance(paths, list) else None


def read_order(dropin: Path) -> list[Path]:
    """Every system file Podman reads, in its order, gpuprov's drop-in at its place (whether it exists yet or not).
    For a drop-in elsewhere (a host tree: ROOT/etc/containers/containers.conf.d), the files of that tree."""
    etc = dropin.parent.parent  # ROOT/etc/containers: ROOT's vendor file too; elsewhere (a test's directory) not
    tree = etc.parent.parent if (etc.name, etc.parent.name) == ("containers", "etc") else None
    vendor = tree / VENDOR.lstrip("/") if tree else etc / "no-vendor-file"
    inside = {p.name: p for p in dropin.parent.glob("*.conf") if p.is_file()} if dropin.parent.is_dir() else {}
    inside = {n: p for n, p in inside.items() if not same_file(p, dropin)} | {dropin.name: dropin}
    return [p for p in (vendor, etc / "containers.conf") if p.is_file()] + [inside[n] for n in sorted(inside)]


def conflicts(dropin: Path, req: RuntimeRequest) -> None:
    """Exit 14 where a file read after gpuprov's sets one of its keys to another value (Podman would use that, not
    gpuprov's; --replace-runtime cannot help), or where the operator's earlier files hold a runtime of that name
    elsewhere or another default (theirs: kept unless --replace-runtime)."""
    order = read_order(dropin)
    at = order.index(dropin)  # read_order puts this very path at its place
    for i, f in enumerate(order):
        if i == at:
            continue
        doc = _load(f)
        theirs, dflt = _runtime_paths(doc, req.name), _engine(doc).get("runtime")
        if i > at and (theirs not in (None, [req.path]) or (req.default and dflt not in (None, req.name))):
            key = f"engine.runtimes.{req.name}" if theirs not in (None, [req.path]) else "engine.runtime"
            raise RuntimeConflict(f"{f} is read after {dropin.name} and sets {key}, so Podman would use its value, "
                                  f"not gpuprov's: remove that setting from it or rename it to sort before "
                                  f"{dropin.name}, then run again (nothing was changed)")
        if theirs not in (None, [req.path]) and not req.replace:
            raise RuntimeConflict(f"{f} already defines Podman runtime {req.name!r} ({', '.join(map(str, theirs))}):"
                                  " it is yours, so gpuprov leaves it; use another --runtime-name, or "
                                  "--replace-runtime to override it (nothing was changed)")
        if req.default and dflt not in (*ENGINE_DEFAULTS, req.name) and not req.replace:
            raise RuntimeConflict(f"{f} sets Podman's engine.runtime = {dflt!r}: gpuprov leaves it; drop --default, "
                                  "or add --replace-runtime (nothing was changed)")


def effective(dropin: Path) -> dict:
    """engine.runtime and engine.runtimes as Podman folds its system files (later files win key by key)."""
    runtimes: dict = {}
    default = None
    for p in read_order(dropin):
        engine = _engine(_load(p))
        default = engine.get("runtime", default)
        more = engine.get("runtimes", {})
        runtimes.update(more if isinstance(more, dict) else {})
    return {"runtime": default, "runtimes": runtimes}


def runtime_info(name: str) -> list[str]:
    """The binary Podman runs for `--runtime NAME`, as Podman resolves it."""
    return ["podman", "--runtime", name, "info", "--format", "{{.Host.OCIRuntime.Path}}"]


def asked_podman(run, req: RuntimeRequest) -> str | None:
    """None when Podman itself runs req.path for `--runtime NAME` (and, with --default, has NAME as its default);
    else why not, in one line. `run(argv)` returns a CompletedProcess-like result or None (not runnable)."""
    r = run(runtime_info(req.name))
    got = r.stdout.strip() if r is not None and r.returncode == 0 else None
    if got != req.path:
        said = got or ((r.stderr or r.stdout).strip()[-160:] if r is not None else "did not run")
        return f"`podman --runtime {req.name} info` says {said}, not {req.path}"
    if req.default:
        r = run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"])
        name = r.stdout.strip() if r is not None and r.returncode == 0 else None
        if name != req.name:
            return f"`podman info` has default OCI runtime {name!r}, not {req.name!r}"
    return None


STORAGE = "/var/lib/containers/storage"  # containers/storage's default graphroot for root
STORAGE_CONFS = ("/etc/containers/storage.conf", "/usr/share/containers/storage.conf")  # the first found is read


def _graphroot(root: Path) -> str:
    """Root's graphroot as containers/storage reads it: [storage] graphroot of the first storage.conf there, else
    its default (a file that does not parse: the default, as the count is only what the plan says)."""
    for conf in STORAGE_CONFS:
        text = read_text(root, conf)
        if text is None:
            continue
        try:
            storage = tomlkit.parse(text).unwrap().get("storage")
        except ValueError:  # tomlkit's ParseError is one
            return STORAGE
        graph = storage.get("graphroot") if isinstance(storage, dict) else None
        return graph if isinstance(graph, str) and graph.startswith("/") else STORAGE
    return STORAGE


class PodmanEngine(dropin.DropinEngine):
    """Podman: installed from the distribution (or kept), no daemon to start; GPUs through CDI."""
    name = "podman"
    title = "Podman"
    default_config = MAIN  # what detect reports and Podman reads; gpuprov's drop-in goes beside it
    main_config = MAIN
    dropin_name = DROPIN_NAME
    header = HEADER
    undo_reload = True  # no daemon: the next podman command reads the files
    daemon_names = ("podman",)
    gpus_through_cdi = True
    cgroup_prefixes = (("libpod-", "podman"),)

    # Podman's OCI runtime is Podman's (crun by its default, where runc is there too for dockerd or containerd):
    # its runtime `nvidia` is gpuprov-runtime-podman, wrapping that, while gpuprov-runtime wraps theirs.
    own_front_end = "gpuprov-runtime-podman"

    def oci_runtime(self) -> str | None:
        """The OCI runtime Podman runs its containers with, as Podman says (`podman info`: Host.OCIRuntime.Path); None
        without podman. Where Podman's default is gpuprov's own front-end (configure --default): the one Podman takes
        without it, crun, else runc (containers.conf's default order)."""
        if not effects.which("podman"):
            return None
        r = effects.try_run(["podman", "info", "--format", "{{.Host.OCIRuntime.Path}}"], timeout=60)
        path = r.stdout.strip() if r is not None and r.returncode == 0 else ""
        if path.startswith("/") and not Path(path).name.startswith("gpuprov-runtime"):
            return path
        return effects.which("crun") or effects.which("runc")

    def stranded(self, names: tuple[str, ...]) -> list[str]:
        """Podman's running containers whose OCI runtime is one of `names`. Podman stops a container through the
        runtime of that name in its configuration: with gpuprov's drop-in and front-end gone, `podman stop` has
        neither. Root's are asked of Podman (`podman inspect`: OCIRuntime); a rootless user's (their own Podman reads
        the same drop-in) are found by their conmon, started with gpuprov's front-end and owned by that user."""
        if not effects.which("podman"):
            return []
        rootless = [f"{m.name} (user {_user(m.uid)})" for m in base.monitored_by_gpuprov() if m.podman and m.uid != 0]
        r = effects.try_run(["podman", "ps", "-q", "--no-trunc"], timeout=30)
        ids = r.stdout.split() if r is not None and r.returncode == 0 else []
        if not ids:
            return rootless
        r = effects.try_run(["podman", "inspect", "--format", "{{.Name}} {{.OCIRuntime}}", *ids], timeout=30)
        rows = [ln.split() for ln in (r.stdout if r is not None and r.returncode == 0 else "").splitlines()]
        return [row[0] for row in rows if len(row) == 2 and row[1] in names] + rootless

    # --- its store: Debian's podman purge deletes nothing there (bookworm's 4.3.1 and trixie's 5.4.2 postrm: units
    # only), so a purge keeps it. No daemon to ask: `podman ps -a` and `podman images` read these same files.

    data_root = STORAGE
    data_packages = ("podman",)

    def stored(self, root: Path) -> StoredData | None:
        """Root's store (storage.conf's graphroot): its containers, images and volumes, from its files."""
        return containers_storage(root, _graphroot(root), repository(validate.IMAGE))

    # --- installing it: the distribution's packages; no unit, no daemon (engine_steps' service step is skipped)

    def packages(self, target, source: str) -> tuple[str, ...]:
        if source == "docker-ce":
            raise UsageError("--engine-source docker-ce is Docker's repository: Podman comes from the distribution "
                             "(use --engine-source auto or distro)")
        # uidmap: newuidmap/newgidmap, for rootless users
        return ("podman", "uidmap") if target.family == "debian" else ("podman",)

    def validation(self, runtime_name: str, runtime_path: str, gpu: bool) -> base.Validation:
        """The image imported from this host's files when missing; the engine's own OCI runtime, the GPUs through
        CDI (the spec bootstrap's cdi.spec step wrote)."""
        image = base.ImageImport(validate.IMAGE, ("podman", "import", "-", validate.IMAGE),
                                 present=("podman", "image", "exists", validate.IMAGE))
        runs = [run_argv(validate.IMAGE, ("sh", "-c", f"echo {validate.OK_WORD}"))]
        if gpu:
            runs.append(run_argv(validate.IMAGE, ("nvidia-smi", "-L"), gpu="all"))
        return base.Validation(image, tuple(base.ContainerRun(a) for a in runs),
                               route="through CDI (podman's own OCI runtime)")

    # --- gpuprov verify on a node -------------------------------------------------------------------------------

    def node_probe(self, run: base.Run) -> str | None:
        rc, out, _ = run(list(INFO))
        return out.strip() if rc == 0 else None

    def node_runtime(self, run: base.Run, probe: object, name: str,
                     runtime_path: str) -> tuple[str | None, str | None]:
        """What Podman itself runs for `--runtime NAME` (its merged configuration, every file of the operator's
        included), never what gpuprov's drop-in says."""
        rc, out, err = run(runtime_info(name))
        path = out.strip() if rc == 0 else ""
        if not path:
            return None, (f"`{' '.join(runtime_info(name))}` fails ({(err or out).strip()[-160:]}): run gpuprov "
                          "engine configure podman (GPUs through CDI need no runtime)")
        if path != runtime_path:
            return None, (f"Podman runs {path} for --runtime {name}, not {runtime_path}: a file read after "
                          f"{dropin_path()} sets engine.runtimes.{name} (podman info shows the merged value)")
        return path, None

    def check_container_argv(self, cid: str, env: dict[str, str], argv: list[str], runtime_path: str, rootfs: str,
                             log: str) -> list[str]:
        return list(run_argv(validate.IMAGE, argv, gpu=env.get("NVIDIA_VISIBLE_DEVICES")))

    def check_route(self) -> str:
        return "CDI (podman, its own OCI runtime)"

    def prepare_check_image(self, rootfs: str) -> None:
        """The validation image, imported from this host's files when it is missing."""
        image = self.validation("nvidia", "", False).image
        if effects.run(list(image.present or ()), check=False).returncode == 0:
            return
        effects.run(list(image.load), input_text=image.stdin(validate.BINARIES))

    def has_cdi(self) -> bool:
        return True  # Podman applies CDI devices (--device nvidia.com/gpu=…)

    # --- its config ---------------------------------------------------------------------------------------------

    def config_path(self, config: str | None, req: RuntimeRequest) -> Path:
        """As the drop-in engines have it, and then only a file Podman reads: `NAME.conf` in a `containers.conf.d`
        directory (exit 2 otherwise: a file Podman never reads would be written and "verified")."""
        p = super().config_path(config, req)
        if p.suffix != ".conf" or p.parent.name != Path(DROPIN_DIR).name:
            raise UsageError(f"--config {config}: Podman reads only *.conf files in a containers.conf.d directory "
                             f"(e.g. {dropin_path()}), so it would never read {p}; name such a file or directory")
        return p

    def plan(self, path: Path, req: RuntimeRequest, *, unit_root: Path = Path("/")) -> EnginePlan:
        old = dropin.read_ours(path, req)
        conflicts(path, req)
        text = render(runtime_name=req.name, runtime_path=req.path, default=req.default)
        if text == old:
            return EnginePlan([], [])
        changes = [Change(f"engine.runtimes.{req.name}", req.path)]
        if req.default:
            changes.append(Change("engine.runtime", req.name))
        # --cdi: nothing to write; Podman reads /etc/cdi and /var/run/cdi by default
        return EnginePlan([FileEdit(path, old, text)], changes)

    def check(self, path: Path, req: RuntimeRequest) -> bool | None:
        """Podman itself, for the system drop-in directory it reads (`podman --runtime NAME info`: the binary it
        would run; `podman info`: its default), when podman is here; else, for a drop-in in another tree, Podman's
        merged system configuration over every file as written (read_order, effective)."""
        if same_file(path.parent, Path(DROPIN_DIR)) and effects.which("podman"):
            self.check_error = asked_podman(lambda argv: effects.try_run(argv, timeout=60), req)
            return self.check_error is None
        merged = effective(path)
        if merged["runtimes"].get(req.name) != [req.path]:
            self.check_error = f"Podman's merged configuration does not have runtime {req.name!r} -> {req.path}"
        elif req.default and merged["runtime"] != req.name:
            self.check_error = f"Podman's merged configuration does not have engine.runtime = {req.name!r}"
        else:
            self.check_error = None
        return self.check_error is None

    def daemon_config(self, argv: list[str]) -> str:
        return DROPIN_DIR

    def live_daemon(self, path: Path) -> Daemon | None:
        return None  # no daemon: each podman command reads the files when it starts

    def running_daemons(self) -> list[Daemon]:
        return []

    def apply(self, daemon: Daemon, plan: EnginePlan, *, restart: bool) -> str:
        return self.apply_how(restart)

    def apply_how(self, restart: bool) -> str:
        return "nothing to reload (podman reads its configuration at each command)"


# --- the containers bootstrap's validation and verify run (the one place that spells them) ----------------------

def run_argv(image: str, argv: tuple[str, ...] | list[str], gpu: str | None = None) -> tuple[str, ...]:
    """A container from a local image, never pulled, no network; `gpu` (all, an index or a UUID) through CDI."""
    devices = ("--device", f"{KIND}={gpu}") if gpu else ()
    return (*RUN, *devices, image, *argv)


def _user(uid: int) -> str:
    """A login name for people (the uid where the account is gone)."""
    import pwd  # lazy: 0.1 ms, only when a rootless container is found

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
