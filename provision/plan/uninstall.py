"""uninstall_steps: bootstrap's inverse, as the same typed steps (plan/steps.py), so what `uninstall --dry-run`
prints is what `uninstall` runs. Built from what is on the host now (read under `root`) and from gpuprov's install
record (provision/record.py); a step exists only where there is something of gpuprov's to take away, so a second
uninstall plans nothing but releasing its own lock.

Order: the engines first (their configs without gpuprov's keys, each engine reloaded only where its config changed,
or where the live engine still names what the file no longer says: a re-run after a kill reloads), so that no
engine names the runtime once it is gone; then the validation images, the MPS daemon, the refresh units, the CDI
specs, the NFD labels, the runtime (its warm editor stopped first; its binary only once no running dockerd names it,
and kept as a pass-through to runc while containers still run under it), the packages when asked (only those
gpuprov installed, and only when apt's simulation removes nothing else; an engine's package whose purge would delete
its data root is removed rather than purged unless --delete-engine-data, and the uninstall stops before any change
while that data root holds the operator's things and they said neither way: plan/engine_data.py), and last
gpuprov's state, caches and logs (the record of packages gpuprov installed stays while they do; the host lock file
never goes: another run may hold it). Packages stay unless asked. Every step is idempotent: a run killed or stopped
half-way is finished by the next.

dockerd is never restarted unasked: gpuprov's runtimes and default come out live (SIGHUP, DockerEngine.reload_live);
only `features.cdi`, which dockerd reads at start, waits for its next restart unless --restart-engine.
"""
from __future__ import annotations

import fcntl
import glob
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from provision import effects, engines, package_managers, paths, record
from provision.engines import validate
from provision.engines.base import RUNTIME_PATH, RuntimeRequest
from provision.engines.configure import restart_keeps
from provision.engines.containerd import ContainerdEngine
from provision.engines.docker import LIVE, DockerEngine
from provision.errors import EngineDataAtStake, GpuprovError, RemovalRefused, StepFailed, UntrustedPath
from provision.facts.distro_facts import read_distro
from provision.facts.rootfs import is_live, under
from provision.fsutil import read_trusted, resolve
from provision.hostlock import LOCK_NAME, lock_dirs
from provision.inject import cdi, devchar, server
from provision.inject.install import EDITOR_LIB
from provision.inject.modify import HOOK_MARKER, HOOK_NAME
from provision.inject.settings import load_settings, settings_path
from provision.k8s.labels import NFD_FILE
from provision.options import Stage
from provision.package_managers.base import PackageManager
from provision.plan import boot_default, engine_data, persistence, pkgconfig
from provision.plan.apply import LOG_FILE
from provision.plan.driver import gpuprov_files
from provision.plan.packages import StreamsReset
from provision.plan.steps import (
    Action,
    Command,
    Never,
    ReloadEngine,
    Step,
    StopSharing,
    Undone,
    WriteFile,
    packages_installed,
    read_or_empty,
)
from provision.probe.cache import cache_dir
from provision.share.state import proc_identity

UNIT_DIR = "/etc/systemd/system"
UNITS = ("gpuprov-cdi-refresh.path", "gpuprov-cdi-refresh.service", "gpuprov-mps.service", devchar.UNIT)
LABELS_HEADER = "# GPU node labels"  # k8s/labels.py: nfd_file's first line


PASS_MARKER = "# gpuprov pass-through (uninstall)"
PURGE_OPTIONS = {"driver": "--purge-driver", "engine": "--purge-engine"}
ENGINE_DATA = engine_data.OPTIONS  # keep | delete -> --keep-engine-data | --delete-engine-data
ALLOW_REMOVE = "--allow-remove"
RESTART_ENGINE = "--restart-engine"
FORCE = "--force"


@dataclass(frozen=True)
class UninstallOptions:
    purge_driver: bool = False  # --purge-driver: purge the driver packages gpuprov installed, and their holds
    purge_engine: bool = False  # --purge-engine: purge the engine packages gpuprov installed (never ones it found)
    allow_remove: bool = False  # --allow-remove: a purge may take other packages with it (apt's simulation names them)
    restart_engine: bool = False  # --restart-engine: restart dockerd where a change needs it (features.cdi)
    force: bool = False  # --force: go on while containers only gpuprov's runtime can stop still run (Podman's)
    # with purge_engine: "" (a purge that would delete the operator's data stops, exit 14), "keep" (removed, not
    # purged: the data root stays) or "delete" (purged: the data root goes with the operator's things in it)
    engine_data: str = ""


def _trusted(root: Path, path: str) -> str:
    """A state file of gpuprov's under `root`, read only when root alone could have written it (fsutil.read_trusted);
    "" when it is absent or anyone else could have (nothing is acted on from it)."""
    try:
        return (read_trusted(under(root, path)) or b"").decode(errors="replace")
    except (UntrustedPath, OSError):
        return ""


def _exists(root: Path, path: str) -> bool:
    return os.path.lexists(under(root, path))


def _rm(*paths_: str, tree: bool = False) -> Command:
    return Command(("rm", "-rf" if tree else "-f", "--", *paths_))


# ---------------------------------------------------------------- engines


def _configs(rec: record.Record) -> list[tuple[str, str]]:
    """(engine, config path): every config the record names, then each adapter's default config."""
    out = [(e.get("engine"), c) for c, e in rec.configs.items() if e.get("engine") in engines.names()]
    for name in engines.names():  # every adapter's default config
        eng = engines.get(name)
        out.append((name, str(eng.config_path(None, RuntimeRequest("nvidia", "/")))))
    return list(dict.fromkeys(out))


def _backups(root: Path, path: str) -> list[str]:
    """gpuprov's backups beside a config it edited (fsutil: `<name>.gpuprov-<stamp>[-N].bak`): beside the config's
    name, and, where that is a link gpuprov writes through (root's, in private directories: fsutil.resolve), beside
    the file it leads to, where fsutil put them (an operator's config kept in their own tree)."""
    where = [str(under(root, path))]
    if os.path.islink(where[0]):
        try:
            where.append(resolve(where[0]))
        except OSError:  # a link gpuprov would not write through: it wrote no backup beside its target either
            pass
    found = {p for w in where for p in glob.glob(glob.escape(w) + ".gpuprov-*.bak")}
    return sorted("/" + os.path.relpath(p, root) for p in found)


def _runtime_paths(rec: record.Record) -> tuple[str, ...]:
    """Every path gpuprov's runtime was registered under: bootstrap's, and those the record names."""
    return tuple(dict.fromkeys([RUNTIME_PATH, *(p for e in rec.configs.values() for p in e.get("runtime_paths", []))]))


def _stale(root: Path, name: str, config: str, rtpaths: tuple[str, ...]) -> list[str]:
    """What the live engine reading `config` still names of gpuprov's that the file no longer says (dockerd only:
    the one engine that reloads live and lists its runtimes); [] when it agrees or cannot tell."""
    eng = engines.get(name)
    if not is_live(root) or not hasattr(eng, "stale") or eng.live_daemon(Path(config)) is None:
        return []
    return eng.stale(Path(config), rtpaths) or []


def engine_steps(root: Path, rec: record.Record, opt: UninstallOptions = UninstallOptions()) -> list[Step]:
    steps = []
    rtpaths = _runtime_paths(rec)
    for name, config in _configs(rec):
        eng = engines.get(name)
        entry = rec.configs.get(config) if rec.configs.get(config, {}).get("engine") == name else None
        plan = eng.unplan(Path(config), entry, root=root)
        files = sorted({str(e.path) for e in plan.edits} | {str(p) for p in plan.removals}
                       | set((entry or {}).get("files", {})))
        baks = [b for f in files for b in _backups(root, f)]
        stale = [] if plan.changed else _stale(root, name, config, rtpaths)
        if stale:  # a run killed after the write, before the reload: the file is done, the daemon not
            steps.append(Step(f"uninstall.engine.{name}", Stage.RUNTIME, f"Reload {name}: it still names "
                              f"{', '.join(stale)}, which {config} no longer has",
                              actions=(ReloadEngine(name, config, restart=False, runtime_paths=rtpaths),),
                              check=Never("the live engine was asked while planning")))
            continue
        if not plan.changed and not baks:
            continue
        gone = [str(p) for p in plan.removals]
        dirs = [d for d in (entry or {}).get("made_dirs", []) if _empty_after(root, d, gone)]
        actions: list = [WriteFile(str(e.path), e.new, backup=False) for e in plan.edits if e.changed]
        actions += [_rm(*gone)] if gone else []
        actions += [_rm(*baks)] if baks else []
        actions += [Command(("rmdir", "--", *dirs))] if dirs else []
        restart = plan.needs_restart and (opt.restart_engine or not eng.restart_stops_containers)
        notes = list(plan.warnings)
        if plan.needs_restart and not restart:
            notes.append(f"{', '.join(c.key for c in plan.changes if not c.reload)}: dockerd reads it only at start; "
                         f"it applies at dockerd's next restart ({RESTART_ENGINE} restarts it now, keeping running "
                         "containers by holding live-restore on for the restart where dockerd can)")
        if plan.changed:
            actions.append(ReloadEngine(name, config, restart=restart, runtime_paths=rtpaths,
                                        keeps=_restart_keeps(eng, root, config) if restart else 0))
        what = ", ".join(str(c) for c in plan.changes) or "gpuprov's backups"
        steps.append(Step(f"uninstall.engine.{name}", Stage.RUNTIME,
                          f"Take gpuprov out of {name}'s config {config} ({what})", actions=tuple(actions),
                          check=Undone(tuple((str(e.path), e.new) for e in plan.edits if e.changed),
                                       tuple(gone + baks + dirs)),
                          notes=tuple(notes)))
    return steps


def _restart_keeps(eng, root: Path, config: str) -> int:
    """The running containers a --restart-engine restart keeps by holding live-restore on (ReloadEngine does it)."""
    daemon = eng.live_daemon(Path(config)) if is_live(root) and hasattr(eng, "restart_keeping") else None
    return restart_keeps(eng, daemon, "", consent=True) if daemon else 0


def _empty_after(root: Path, d: str, removed: list[str]) -> bool:
    """A directory gpuprov made that holds nothing but what this uninstall removes."""
    try:
        left = {e.name for e in os.scandir(under(root, d))}
    except OSError:
        return False
    return left <= {os.path.basename(p) for p in removed if os.path.dirname(p) == d.rstrip("/")}


# ---------------------------------------------------------------- what bootstrap and its siblings left


def image_steps(root: Path) -> list[Step]:
    """The validation images (every gpuprov version's tag), in each engine that answers. Only on the live host."""
    if not is_live(root):
        return []
    argvs = validate.leftover_image_argvs()
    if not argvs:
        return []
    return [Step("uninstall.images", Stage.VALIDATE, "Remove gpuprov's validation images",
                 actions=tuple(Command(a, may_fail=may) for a, may in argvs),
                 check=Never("the images were listed while planning"))]


def service_steps(root: Path) -> list[Step]:
    steps = []
    if _exists(root, paths.SHARE_STATE):
        steps.append(Step("uninstall.mps", Stage.RUNTIME, "Stop GPU sharing (the MPS control daemon) and remove "
                          "its state", actions=(StopSharing(),),
                          check=Undone(gone=(paths.SHARE_STATE,))))
    units = [f"{UNIT_DIR}/{u}" for u in UNITS if _exists(root, f"{UNIT_DIR}/{u}")]
    if units:
        systemd = under(root, "/run/systemd/system").is_dir()
        names = tuple(os.path.basename(u) for u in units)
        # the links `systemctl enable` made (what disable removes), named so the plan says every path that goes,
        # and removed by rm too where systemd is not running to do it
        wants = sorted(str(Path("/") / w.relative_to(root)) for n in names
                       for w in under(root, UNIT_DIR).glob(f"*.wants/{n}"))
        acts = ([Command(("systemctl", "disable", "--now", *names), may_fail=True)] if systemd else []) \
            + [_rm(*units, *wants)] + ([Command(("systemctl", "daemon-reload"))] if systemd else [])
        steps.append(Step("uninstall.units", Stage.RUNTIME, f"Stop and remove gpuprov's units: {' '.join(names)}",
                          actions=tuple(acts), check=Undone(gone=tuple(units) + tuple(wants))))
    return steps


def persistence_steps(root: Path, rec: record.Record) -> list[Step]:
    """nvidia-persistenced disabled, only where bootstrap enabled it (the record) and it is enabled still."""
    if persistence.UNIT not in rec.enabled or not os.path.lexists(under(root, persistence.WANTS)):
        return []
    return [Step("uninstall.persistence", Stage.DRIVER, f"Disable {persistence.UNIT} (gpuprov enabled it)",
                 actions=(Command(("systemctl", "disable", "--now", persistence.UNIT)),),
                 check=Undone(gone=(persistence.WANTS,)))]


def dev_char_steps(root: Path) -> list[Step]:
    """The /dev/char links gpuprov made (its record in /run), only those still pointing where gpuprov pointed them,
    and its udev rule. A link udev or the operator made is never in the record."""
    links = devchar.ours_now(str(under(root, devchar.RECORD)), str(root))
    rule = [devchar.UDEV_RULE] if _exists(root, devchar.UDEV_RULE) else []
    if not links and not rule:
        return []
    return [Step("uninstall.dev-char", Stage.RUNTIME, "Remove the /dev/char links gpuprov made for NVIDIA's nodes "
                 "and its udev rule", actions=(_rm(*links, *rule),), check=Undone(gone=tuple(links + rule)))]


def file_steps(root: Path) -> list[Step]:
    """The CDI specs and the NFD labels file, each only when gpuprov wrote it (its marker)."""
    specs = [f"{d}/{cdi.SPEC_NAME}" for d in cdi.SPEC_DIRS
             if cdi.MARKER in read_or_empty(under(root, f"{d}/{cdi.SPEC_NAME}"))]
    labels = [NFD_FILE] if read_or_empty(under(root, NFD_FILE)).startswith(LABELS_HEADER) else []
    steps = []
    if specs:
        steps.append(Step("uninstall.cdi", Stage.RUNTIME, "Remove the CDI specs gpuprov wrote",
                          actions=(_rm(*specs),), check=Undone(gone=tuple(specs))))
    if labels:
        steps.append(Step("uninstall.labels", Stage.RUNTIME, "Remove gpuprov's NFD labels file",
                          actions=(_rm(*labels),), check=Undone(gone=tuple(labels))))
    return steps


def _prefix(root: Path) -> str:
    try:
        prefix = json.loads(_trusted(root, paths.INSTALL_STAMP) or "{}").get("prefix")
    except (ValueError, AttributeError):
        return "/usr/local"
    return prefix if isinstance(prefix, str) and prefix.startswith("/") else "/usr/local"


def _editor(root: Path) -> tuple[int, int, str] | None:
    """The warm editor as its lock file names it (`PID START COMM`, inject/server.py), while that very process still
    holds the lock: its pid, start time and name. Only on the live host; None when no editor runs, the lock file is
    not root's alone, or it names no start time (an editor from before start times were kept stops on its own when
    idle)."""
    if not is_live(root):
        return None
    lock = server.lock_path(server.socket_path())
    try:
        pid, start, comm = _trusted(root, lock).split(maxsplit=2)
        ident = (int(pid), int(start), comm.strip())
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (ValueError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # nobody holds it: no editor runs
    except OSError:
        pass
    finally:
        os.close(fd)
    return ident if proc_identity(ident[0]) == (ident[2], ident[1]) else None


@dataclass(frozen=True)
class SignalProcess(Action):
    """SIGTERM to one of gpuprov's own processes, sent with os.kill (no `kill` binary: a minimal host lacks it) and
    only while /proc still shows the name and start time gpuprov recorded for that pid: a process that got the pid
    later is never signalled."""
    pid: int
    start: int
    comm: str
    what: str

    def lines(self) -> list[str]:
        return [f"SIGTERM to {self.what} (pid {self.pid}), only while /proc/{self.pid}/stat still shows name "
                f"{self.comm!r} and start time {self.start} (os.kill; nothing when it is gone)"]

    def execute(self) -> str:
        if proc_identity(self.pid) != (self.comm, self.start):
            return f"{self.what} (pid {self.pid}) had already exited"
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return f"{self.what} (pid {self.pid}) had already exited"
        return f"stopped {self.what} (pid {self.pid})"


@dataclass(frozen=True)
class RuntimeForgotten(Action):
    """Before the runtime's binary goes: no running dockerd may still name it (a run killed between the config's
    write and dockerd's reload left one that does: every `docker run` would then fail). Asks dockerd."""
    runtime_paths: tuple[str, ...]

    def commands(self) -> list[Command]:
        return [Command(LIVE)]

    def lines(self) -> list[str]:
        return [f"$ {Command(LIVE).shell()}", f"  (stop here, the binary kept, while it names a runtime at "
                f"{', '.join(self.runtime_paths)} or one as its default; no answer: no dockerd runs)"]

    def execute(self) -> str:
        live = DockerEngine().live()
        if live is None:
            return ""
        rts, default = live
        ours = sorted(n for n, p in rts.items() if p in self.runtime_paths)
        if ours:
            raise StepFailed(f"the running dockerd still names runtime {', '.join(ours)}"
                             + (f" (its default: {default})" if default in ours else "")
                             + "; the runtime's binary stays until it does not: run `gpuprov uninstall` again (it "
                             "reloads dockerd)")
        return ""


PASS_THROUGH = """#!/bin/sh
{marker}: containers started under gpuprov's runtime outlived `gpuprov uninstall`
# ({names}). Their engine still runs this file to stop and delete them; it hands every call to {runc} as it is.
# The next `gpuprov uninstall` removes it once no running container uses it.
exec {runc} "$@"
"""


def _runc() -> str:
    try:
        return load_settings().runc
    except Exception:  # settings gone or unreadable: runc as the engines find it
        return "/usr/sbin/runc"


def _users(root: Path, rec: record.Record, bin_path: str) -> list[str]:
    """The running containers created under gpuprov's runtime: docker's (by any name it was registered under) and
    containerd's tasks whose runtime options name it as their runc (ctr, CRI)."""
    if not is_live(root):
        return []
    names = {"nvidia", *(e.get("runtime_name") for e in rec.configs.values() if e.get("runtime_name"))}
    live = DockerEngine().live()
    names |= {n for n, p in (live[0] if live else {}).items() if p == bin_path}
    docker = DockerEngine().users(tuple(sorted(names))) or []
    return docker + [t for t in ContainerdEngine().tasks_under(bin_path)
                     if not t.startswith("moby/")]  # dockerd's own namespace: its containers are named above


def runtime_steps(root: Path, rec: record.Record | None = None) -> list[Step]:
    rec = rec or record.Record()
    bindir = f"{_prefix(root)}/bin"
    hook = f"{bindir}/{HOOK_NAME}"
    binary = f"{bindir}/gpuprov-runtime"
    users = _users(root, rec, binary) if _exists(root, binary) else []
    passing = PASS_MARKER in read_or_empty(under(root, binary), 4096)
    own = tuple(f"{bindir}/{e.own_front_end}" for e in engines.every() if e.own_front_end)  # Podman's front-end
    files = [p for p in ((binary,) if not users else ()) + own + (settings_path(),) if _exists(root, p)]
    lib = f"{_prefix(root)}/{EDITOR_LIB}"  # the editor's copies (inject/install.py)
    trees = [lib] if _exists(root, lib) else []
    if HOOK_MARKER.decode() in read_or_empty(under(root, hook), 4096):  # NVIDIA's own hook is never gpuprov's
        files.append(hook)
    etc = os.path.dirname(settings_path())
    dirs = [etc] if _exists(root, etc) and _empty_after(root, etc, files) else []
    editor = _editor(root)
    keep = users and not passing
    if not files and not dirs and not trees and editor is None and not keep:
        return []
    acts: list = [SignalProcess(*editor, "the warm editor")] if editor else []
    shim = PASS_THROUGH.format(marker=PASS_MARKER, names=", ".join(users), runc=_runc()) if keep else ""
    if keep:
        acts.append(WriteFile(binary, shim, mode=0o755, backup=False))
    elif binary in files:
        acts.append(RuntimeForgotten(tuple(dict.fromkeys(_runtime_paths(rec) + (binary,)))))
    acts += [_rm(*files)] if files else []
    acts += [_rm(*trees, tree=True)] if trees else []
    acts += [Command(("rmdir", "--", *dirs))] if dirs else []
    title = ("Remove the pass-through gpuprov-runtime left for containers that outlived an uninstall" if passing
             and not users and len(files) == 1 else
             "Remove gpuprov-runtime, its editor's code, its --gpus hook stand-in and its settings")
    if users:
        title += (f"; gpuprov-runtime {'stays' if passing else 'becomes'} a pass-through to runc while running "
                  f"containers use it ({', '.join(users)}): the next uninstall removes it once they are gone")
    if editor:
        title += f" (the warm editor, pid {editor[0]}, stopped first)"
    check = Undone(files=((binary, shim),) if keep else (), gone=tuple(files + trees + dirs))
    return [Step("uninstall.runtime", Stage.RUNTIME, title, actions=tuple(acts), check=check)]


@dataclass(frozen=True)
class Purge(Action):
    """The purge of the packages gpuprov installed (its record), after the package manager's own dry run of that very
    purge: anything it would remove beyond them (a package the operator installed since that depends on one of
    them) stops the step with exit 14 naming it, unless --allow-remove. gpuprov's holds on them go next (the dry run
    has changed nothing yet), then the purge. Each command is the package manager's adapter's.
    `remove`: the packages are removed, not purged (a purge would delete an engine's data root: plan/engine_data.py);
    `stop`: the operator's data is at stake and they said nothing: it runs nothing and raises (exit 14), and the
    uninstall command refuses before any step (`refusal`); `stores`: what the engines keep, as the plan counted it."""
    manager: str
    packages: tuple[str, ...]
    unhold: tuple[str, ...]  # names whose holds are gpuprov's (apt-mark's, or dnf's versionlock entries)
    allow_remove: bool
    remove: bool = False
    stop: str = ""
    stores: tuple[engine_data.Store, ...] = ()

    @property
    def pm(self) -> PackageManager:
        return package_managers.get(self.manager)

    def simulate(self) -> Command:
        return Command((self.pm.simulate_remove if self.remove else self.pm.simulate_purge)(self.packages),
                       self.pm.env)

    def unhold_command(self) -> Command:
        return Command(self.pm.unhold(self.unhold))

    def purge(self) -> Command:
        return Command((self.pm.remove if self.remove else self.pm.purge)(self.packages), self.pm.env)

    def commands(self) -> list[Command]:
        if self.stop:
            return []
        return [self.simulate(), *([self.unhold_command()] if self.unhold else []), self.purge()]

    def lines(self) -> list[str]:
        if self.stop:
            return [f"  (stop, nothing changed, exit 14: {self.stop})"]
        sim, *rest = self.commands()
        return [f"$ {sim.shell()}",
                "  (stop, nothing removed, where it would remove anything else"
                + (f"; {ALLOW_REMOVE} given: go on)" if self.allow_remove else f", unless {ALLOW_REMOVE})"),
                *(f"$ {c.shell()}" for c in rest)]

    def data(self) -> list[dict]:
        """The stores as --json shows them, each with whether this step deletes it."""
        return [s.to_dict(deleted=bool(s.deleting) and not self.remove and not self.stop) for s in self.stores]

    def check(self) -> None:
        """The dry run; a failure of it that is not its answer is the package manager's own (a package it cannot
        find), reported as it says it."""
        sim = self.simulate()
        res = sim.run()
        if not self.pm.purge_dry_run_ok(res.returncode, res.output):
            raise effects.failed(sim.shell(), res.returncode, res.output)
        extra = self.pm.purged_too(res.output, self.packages)
        if extra and not self.allow_remove:
            raise RemovalRefused(f"purging {' '.join(self.packages)} would also remove {' '.join(extra)}, which "
                                 f"gpuprov did not install (`{sim.shell()}` says so); nothing was removed (keep "
                                 f"them, or pass {ALLOW_REMOVE})")

    def execute(self) -> str:
        if self.stop:
            raise EngineDataAtStake(self.stop)
        self.check()
        if self.unhold:
            self.unhold_command().execute()
        return self.purge().execute()


def purge_actions(root: Path, manager: str, packages: tuple[str, ...], holds: tuple[str, ...],
                  allow_remove: bool, data: engine_data.Decision | None = None,
                  stores: tuple[engine_data.Store, ...] = ()) -> tuple[list[Action], str]:
    """The purge of `packages` (installed, recorded) and the removal of gpuprov's holds on them and on `holds`; and a
    note for the step's title. A package the hold itself needs (dnf's versionlock plugin) stays where the hold keeps
    entries that are not gpuprov's (the operator's own locks would stop holding without it). `data`: what it does
    with the engines' data roots (the engine packages' step: remove rather than purge, or stop)."""
    pm = package_managers.get(manager)
    ours = set(packages) | set(holds)
    unhold = pm.holds_among(root, holds, packages)
    note = ""
    needed = [p for p in pm.hold_needs if p in packages]
    if needed and pm.holds_others(root, ours):
        packages = tuple(p for p in packages if p not in needed)
        note = f" ({' '.join(needed)} kept: the versionlock list holds locks that are not gpuprov's)"
    how = dict(remove=data.remove, stop=data.stop, stores=stores) if data else {}
    return ([Purge(manager, packages, unhold, allow_remove, **how)] if packages else []), note


def package_steps(root: Path, rec: record.Record, opt: UninstallOptions) -> list[Step]:
    """Only what the record says gpuprov installed and held, and only what is still installed."""
    steps = []
    pm = _package_manager(root)
    adapter = package_managers.get(pm)
    for stage, asked in ((Stage.DRIVER, opt.purge_driver), (Stage.ENGINE, opt.purge_engine)):
        if not asked:
            continue
        recorded = tuple(rec.packages.get(stage.value, []))
        # and what its metapackages pulled in since (Ubuntu's precompiled modules of a newer kernel: issue 43)
        pkgs = tuple(p for p in recorded if packages_installed(pm, (p,), root)) + adapter.followers(root, recorded)
        holds = tuple(p for p in rec.holds if p in pkgs) if stage == Stage.DRIVER else ()
        extra = gpuprov_files(root) if stage == Stage.DRIVER else ()
        # the driver's module stream gpuprov enabled (NVIDIA's repository), reset once its packages are gone: in the
        # purge's step, after it, so a purge that stops (exit 14) leaves the stream with the packages
        resets = adapter.stream_resets(root, tuple(rec.streams)) \
            if stage == Stage.DRIVER and adapter.module_streams else ()
        # the package manager's configuration the stage's steps added or changed, taken out after the purge (its
        # repositories, keys, pins and sources edits: plan/pkgconfig.py), in the same step: a purge that stops
        # leaves the repositories its packages came from
        config = pkgconfig.restore(root, adapter, rec.repo_config.get(stage.value, {}),
                                   rec.keys.get(stage.value, []), set(pkgs))
        extra = tuple(f for f in extra if f not in config.gone)
        if not (pkgs or extra or resets or config):
            continue
        # the engines' data roots a purge of these would delete (plan/engine_data.py), counted before any change
        stores = engine_data.stores(root, pkgs) if stage == Stage.ENGINE and pkgs else ()
        data = engine_data.decide(stores, pkgs, opt.engine_data, pm) if stage == Stage.ENGINE and pkgs else None
        acts, note = purge_actions(root, pm, pkgs, holds, opt.allow_remove, data, stores)
        acts += [_rm(*extra)] if extra else []
        acts += [Command(adapter.reset_streams(resets))] if resets else []
        acts += config.actions
        check = Undone(config.files, extra + config.gone) if not pkgs and not config.keys else Never()
        title = data.title if data else f"Purge the {stage.value} packages gpuprov installed: {' '.join(pkgs) or 'none'}"
        steps.append(Step(f"uninstall.{stage.value}.packages", stage, f"{title}{note}"
                          + (f"; reset the module stream gpuprov enabled: {' '.join(resets)}" if resets else "")
                          + ("; take out the repositories, keys and sources changes it made" if config else ""),
                          actions=tuple(acts), check=StreamsReset(check, resets, pm) if resets else check,
                          notes=(data.notes if data else ()) + config.notes))
    return steps


def refusal(steps: list[Step]) -> EngineDataAtStake | None:
    """The refusal a plan carries (an engine purge that would delete the operator's data, said neither way), raised
    by the command before any step runs, so that nothing changes (exit 14)."""
    stop = next((a.stop for s in steps for a in s.actions if isinstance(a, Purge) and a.stop), "")
    return EngineDataAtStake(stop) if stop else None


def engine_data_doc(steps: list[Step]) -> list[dict]:
    """The engines' stores the plan counted (--json's `engine_data`), each with whether the plan deletes it."""
    return [d for s in steps for a in s.actions if isinstance(a, Purge) for d in a.data()]


def _package_manager(root: Path) -> str:
    """The host's package manager (its os-release's family); apt where none can be read (the record's packages are
    then looked up in dpkg's database, as before rpm hosts had any)."""
    try:
        return read_distro(root).package_manager
    except GpuprovError:
        return "apt"


def kept_packages(rec: record.Record, opt: UninstallOptions) -> record.Record:
    """The part of the record an uninstall leaves: the packages (and holds) of the stages it does not purge."""
    kept = {s: list(p) for s, p in rec.packages.items()
            if p and not (s == Stage.DRIVER.value and opt.purge_driver or s == Stage.ENGINE.value and opt.purge_engine)}
    stages = [s for s, asked in ((Stage.DRIVER.value, opt.purge_driver), (Stage.ENGINE.value, opt.purge_engine))
              if not asked]
    return record.Record({}, kept, [h for h in rec.holds if any(h in p for p in kept.values())],
                         streams=[] if opt.purge_driver else list(rec.streams),
                         repo_config={s: dict(rec.repo_config[s]) for s in stages if rec.repo_config.get(s)},
                         keys={s: list(rec.keys[s]) for s in stages if rec.keys.get(s)})


def state_steps(root: Path, rec: record.Record | None = None, opt: UninstallOptions = UninstallOptions()) -> list[Step]:
    """gpuprov's state, caches, logs and /run/gpuprov, but the host lock file (never removed: another run may be
    waiting on it, and a new file would let a third run in beside it) and the record of the packages gpuprov
    installed while they stay (a later `uninstall --purge-engine` still knows them)."""
    rec = rec or record.Record()
    lock = lock_path()
    kept = kept_packages(rec, opt)
    held = bool(kept.packages or kept.repo_config or kept.keys)  # what a later uninstall --purge-* still needs
    keep = {lock} | ({paths.INSTALL_RECORD} if held else set())
    trees = []
    for d in (paths.RUN_DIR, paths.STATE_DIR):
        if any(k == d or k.startswith(d.rstrip("/") + "/") for k in keep):
            trees += [p for p in (os.path.join(d, e.name) for e in _scan(under(root, d))) if p not in keep]
        elif _exists(root, d):
            trees.append(d)
    trees += [d for d in (str(LOG_FILE.parent), str(cache_dir())) if _exists(root, d) and d not in trees]
    shown = kept.to_json() if held else None
    rewrite = shown is not None and _trusted(root, paths.INSTALL_RECORD) != shown
    if not trees and not rewrite:
        return []
    acts: list = [WriteFile(paths.INSTALL_RECORD, shown, mode=0o600, backup=False)] if rewrite else []
    acts += [_rm(*trees, tree=True)] if trees else []
    title = "Remove gpuprov's state, discovery cache, logs and /run/gpuprov" + (
        f" (kept: the host lock{' and the record of the packages gpuprov installed' if shown else ''})")
    return [Step("uninstall.state", Stage.RUNTIME, title, actions=tuple(acts),
                 check=Undone(files=((paths.INSTALL_RECORD, shown),) if shown else (), gone=tuple(trees)))]


def _scan(d: Path) -> list[os.DirEntry]:
    try:
        return sorted(os.scandir(d), key=lambda e: e.name)
    except OSError:
        return []


def lock_path() -> str:
    return os.path.join(lock_dirs()[0], LOCK_NAME)


def _refuse_stranding(root: Path, rec: record.Record, opt: UninstallOptions) -> None:
    """Exit 14 before anything is planned or changed while an engine runs containers under gpuprov's runtime that it
    could no longer stop once uninstall took the runtime away and keeps no pass-through for (Podman and CRI-O: each
    stops them through the runtime its configuration names; Docker's and containerd's keep a pass-through,
    runtime_steps), naming them; --force goes on (the operator's call: those containers then run on with nothing to
    stop them through)."""
    if opt.force or not is_live(root):
        return
    names = tuple(sorted({"nvidia", *(e.get("runtime_name") for e in rec.configs.values() if e.get("runtime_name"))}))
    held = {e.title: got for e in engines.every() if (got := e.stranded(names))}
    if held:
        running = "; ".join(f"{title}: {', '.join(c)}" for title, c in held.items())
        raise RemovalRefused(f"containers started under gpuprov's runtime still run ({running}); once uninstall "
                             f"removed the runtime their engine could not stop them: stop them first (`podman stop "
                             f"NAME`; CRI-O's: drain the node or delete their pods), or {FORCE} to go on (nothing was "
                             "changed)")


def uninstall_steps(root: Path, opt: UninstallOptions, rec: record.Record | None = None) -> list[Step]:
    """The steps in the order they run; the install record read through the trusted reader (exit 6 when anyone but
    root could have written it, or it is not of gpuprov's shape)."""
    rec = rec if rec is not None else record.read(str(under(root, paths.INSTALL_RECORD)))
    _refuse_stranding(root, rec, opt)
    return (engine_steps(root, rec, opt) + image_steps(root) + service_steps(root) + dev_char_steps(root)
            + persistence_steps(root, rec) + file_steps(root)
            + runtime_steps(root, rec) + package_steps(root, rec, opt) + boot_default.uninstall_steps(root)
            + state_steps(root, rec, opt))
