"""The step model. A step is data: the actions it takes (commands with their argv, files with their full new
content, a service start) and the check that says it is already done. `plan`, `--dry-run`, `--check` and `apply`
all walk these same objects, so what is printed is what runs:

- `Command`: printed with `shlex.join` (paste it into a shell and it does the same); applied by running exactly
  that argv through `effects.run`. A `gpuprov …` command is dispatched through gpuprov's own command line in this
  process (`run_gpuprov`): the same code the printed command runs, under the host lock bootstrap already holds
  (a child process would wait for that lock), without a second interpreter start-up.
- `WriteFile`: printed as a unified diff against the file under the plan's root; applied by an atomic write.
- `StartService`: printed as the commands it runs, in order, with the fallback it takes without systemd.
Every action lists the `Command`s it runs (`commands()`, in order) and those it runs only to undo a failure
(`on_failure()`): the same objects its `execute` runs, so `plan --json` and `--check` list every command.

Checks are data too, and read through the host root they are given; checks that need the live host (a daemon's
answer, the package database of a running system) say "cannot tell" (False: would change) for any other root.
"""
from __future__ import annotations

import contextlib
import io
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Union

from provision import checkimage, dispatch, effects, engines
from provision.engines import containerd
from provision.engines.base import Change, EnginePlan, FileEdit, RuntimeRequest
from provision.errors import GpuprovError, StepFailed
from provision.facts.rootfs import MAX_READ, is_live, read_text_file, under
from provision.fsutil import write_file
from provision.inject import install

LIVE = Path("/")


# ---------------------------------------------------------------- actions


class Action:
    """What every action offers: the commands it runs, in order (`commands`; plan --json, --check and the
    printed-vs-executed test read them), and those it runs only to undo a failure (`on_failure`). Both are the
    very Command objects `execute` runs, so what is listed is what runs. `reports`: the last line of what it
    returns is the step's result (a command's last output line, an install's summary)."""

    reports: ClassVar[bool] = False

    def commands(self) -> list[Command]:
        return []

    def on_failure(self) -> list[Command]:
        return []


@dataclass(frozen=True)
class Command(Action):
    reports = True
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # extra environment, printed as `K=V` before the command
    may_fail: bool = False  # its failure is not the step's (printed `|| true`): the next command repairs it
    stdout_to: str | None = None  # its standard output is written there by gpuprov, 0600 from the first byte

    def shell(self) -> str:
        return " ".join([f"{k}={shlex.quote(v)}" for k, v in self.env] + [shlex.join(self.argv)]
                        + ([f"> {shlex.quote(self.stdout_to)}"] if self.stdout_to else [])
                        + (["|| true"] if self.may_fail else []))

    def lines(self) -> list[str]:
        return [f"$ {self.shell()}"] + ([f"  (written by gpuprov: {self.stdout_to} mode 0600 from its first byte, "
                                         "atomically)"] if self.stdout_to else [])

    def commands(self) -> list[Command]:
        return [self]

    def run(self) -> effects.CommandResult:
        """The argv with its environment; a failure is returned, not raised."""
        return effects.run(list(self.argv), check=False, env={**os.environ, **dict(self.env)})

    def execute(self) -> str:
        if self.argv[0] == "gpuprov":
            return run_gpuprov(list(self.argv[1:]))
        res = self.run()
        if res.returncode == 0 and self.stdout_to:
            write_file(self.stdout_to, res.stdout, mode=0o600, keep_mode=False, backup=False)
        if res.returncode == 0 or self.may_fail:
            return res.output
        raise effects.failed(self.shell(), res.returncode, res.output)


def run_gpuprov(args: list[str]) -> str:
    """`gpuprov ARGS` through the command line's own dispatch, in this process; its stdout is captured (it must
    not mix with bootstrap's --json) and returned. Its errors are raised as they are (same message, same code)."""

    run = dispatch.current()
    if run is None:
        raise StepFailed(f"`{shlex.join(['gpuprov', *args])}`: gpuprov's command line is not loaded in this process")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run(args)
    if isinstance(rc, int) and rc != 0:
        raise StepFailed(f"`{shlex.join(['gpuprov', *args])}` exited {rc}: {out.getvalue().strip()[-300:]}")
    return out.getvalue()


@dataclass(frozen=True)
class WriteFile(Action):
    path: str
    content: str
    mode: int = 0o644
    backup: bool = True  # False: an undo that only takes gpuprov's own keys out (uninstall)

    def lines(self) -> list[str]:
        return [f"write {self.path} (atomic; an existing file keeps its mode and owner"
                + (" and gets a backup)" if self.backup else ")")]

    def diff(self, root: Path) -> str:
        return effects.unified_diff(read_or_empty(under(root, self.path)), self.content, self.path)

    def execute(self) -> str:
        write_file(self.path, self.content, mode=self.mode, backup=self.backup)
        return f"wrote {self.path}"


@dataclass(frozen=True)
class ReloadEngine(Action):
    """Make the running daemon that reads `config` read it again, the adapter's way (`Engine.apply`: dockerd gets
    SIGHUP, or a restart for `features`; containerd and CRI-O are restarted by their unit); nothing when no running
    daemon reads that file."""
    engine: str
    config: str
    restart: bool
    reports = True

    def lines(self) -> list[str]:
        eng = engines.get(self.engine)
        return [f"{eng.apply_how(self.restart)}: the running {eng.daemon_names[0]} that reads {self.config}, if any"]

    def execute(self) -> str:
        eng = engines.get(self.engine)
        daemon = eng.live_daemon(Path(self.config))
        if daemon is None:
            return f"no running {eng.daemon_names[0]} reads {self.config}"
        return eng.apply(daemon, EnginePlan([], [Change("undo", "", reload=not self.restart)]), restart=self.restart)


@dataclass(frozen=True)
class StartService(Action):
    """Start an engine's daemon and enable it at boot, then wait until its client answers (effects.start_daemon:
    `systemctl enable --now`, or without systemd the SysV script, then the daemon itself in the background). Printed
    from the same argvs it runs."""
    reports = True
    name: str  # the unit / init script, and the engine whose client answers: docker | containerd
    daemon: str  # the binary for the last resort: dockerd | containerd
    systemd: bool  # decided from the plan's root (/run/systemd/system)

    def commands(self) -> list[Command]:
        return [Command(a) for a in effects.daemon_start_argvs(self.name, self.daemon, self.systemd)]

    def lines(self) -> list[str]:
        wait = f"then wait until `{shlex.join(effects.ANSWERS[self.name])}` answers"
        if self.systemd:
            return [f"$ {self.commands()[0].shell()}", f"  ({wait})"]
        init, daemon = (c.shell() for c in self.commands())
        return [f"$ {init}", f"  (if that fails or is missing: `{daemon}` in the background, log "
                f"{effects.daemon_log(self.daemon)}; {wait})"]

    def execute(self) -> str:
        return effects.start_daemon(self.name, self.daemon, self.systemd)


@dataclass(frozen=True)
class ImportImage(Action):
    """A local image built from this host's own files (no registry): the tar is made in-process, from the binaries
    named and the libraries `ldd` lists for them. docker: fed to `docker import` only when the image is missing.
    containerd: the same files as a one-layer OCI archive, fed to `ctr images import` in gpuprov's namespace on every
    run (ctr has no command that fails for a missing image; importing the same content again changes nothing)."""
    image: str
    binaries: tuple[str, ...]
    engine: str = "docker"  # docker | containerd

    def commands(self) -> list[Command]:
        return [Command(a) for a in checkimage.import_argvs(self.image, self.engine)]

    def lines(self) -> list[str]:
        what = f"{', '.join(self.binaries)} and their libraries, taken from this host"
        if self.engine == "containerd":
            return [f"$ {self.commands()[0].shell()} < <OCI image archive {self.image} of {what}>"]
        inspect, imp = (c.shell() for c in self.commands())
        return [f"$ {inspect} >/dev/null || {imp} < <tar of {what}>"]

    def execute(self) -> str:
        checkimage.import_image(self.image, self.binaries, self.engine)  # runs exactly commands()
        return ""


@dataclass(frozen=True)
class RunContainer(Action):
    """A container through containerd's `ctr run`, its output taken from the file the shim writes it to
    (`--log-uri file://…`), not from ctr's own stdout: ctr stops reading a short-lived container's output when it
    deletes the task, so a starved ctr can print nothing for a container that did print (seen on containerd 1.6 on
    a loaded 2-core machine, about 3 runs in 1000), while the shim finishes writing the file before the task is
    deleted. The file is removed before the run (the shim appends to it) and after."""
    reports = True
    argv: tuple[str, ...]  # `ctr … run --rm --log-uri file://<log> …`
    log: str
    expect: str | None = None  # the run passes only when its output holds this

    def commands(self) -> list[Command]:
        return [Command(self.argv)]

    def lines(self) -> list[str]:
        return [f"$ {self.commands()[0].shell()}", f"  (its output read from {self.log}, removed before and after"
                + (f"; passes when the output holds {self.expect})" if self.expect else ")")]

    def execute(self) -> str:
        log = Path(self.log)
        log.unlink(missing_ok=True)
        (run,) = self.commands()
        try:
            res = effects.run(list(run.argv), check=False, timeout=600)
            out = read_or_empty(log)
        finally:
            log.unlink(missing_ok=True)
        if res.returncode != 0:
            raise effects.failed(shlex.join(self.argv), res.returncode, res.output + out)
        if self.expect and self.expect not in out:
            raise StepFailed(f"`{shlex.join(self.argv)}` exited 0 but its output lacks {self.expect!r}: "
                             f"{out.strip()[-200:]!r}")
        return out


# ---------------------------------------------------------------- checks


@dataclass(frozen=True)
class Never:
    """Nothing tells that the step is done: it always runs (e.g. the validation container)."""
    reason: str = "always runs"

    def satisfied(self, root: Path) -> bool:
        return False

    def describe(self) -> str:
        return self.reason


@dataclass(frozen=True)
class Already:
    """Nothing to do: the step only reports a fact found while planning."""
    reason: str

    def satisfied(self, root: Path) -> bool:
        return True

    def describe(self) -> str:
        return self.reason


@dataclass(frozen=True)
class FilesMatch:
    files: tuple[tuple[str, str], ...]  # (path, content)

    def satisfied(self, root: Path) -> bool:
        return all(read_or_empty(under(root, p)) == t for p, t in self.files)

    def describe(self) -> str:
        verb = "hold" if len(self.files) > 1 else "holds"
        return f"skipped when {', '.join(p for p, _ in self.files)} already {verb} this content"


@dataclass(frozen=True)
class PathExists:
    path: str

    def satisfied(self, root: Path) -> bool:
        return under(root, self.path).exists()

    def describe(self) -> str:
        return f"skipped when {self.path} exists"


@dataclass(frozen=True)
class DirEmpty:
    path: str

    def satisfied(self, root: Path) -> bool:
        return not any(under(root, self.path).glob("*"))

    def describe(self) -> str:
        return f"skipped when {self.path} is empty"


@dataclass(frozen=True)
class Undone:
    """An undo already done: these files hold this content and these paths are gone (links not followed)."""
    files: tuple[tuple[str, str], ...] = ()  # (path, content)
    gone: tuple[str, ...] = ()

    def satisfied(self, root: Path) -> bool:
        return FilesMatch(self.files).satisfied(root) and not any(os.path.lexists(under(root, p)) for p in self.gone)

    def describe(self) -> str:
        parts = ([f"{', '.join(p for p, _ in self.files)} hold this content"] if self.files else []) \
            + ([f"{', '.join(self.gone)} {'are' if len(self.gone) > 1 else 'is'} gone"] if self.gone else [])
        return "skipped when " + " and ".join(parts)


@dataclass(frozen=True)
class PackagesInstalled:
    manager: str  # apt | dnf | yum
    packages: tuple[str, ...]

    def satisfied(self, root: Path) -> bool:
        return packages_installed(self.manager, self.packages, root)

    def describe(self) -> str:
        db = "dpkg" if self.manager == "apt" else "rpm"
        return f"skipped when {db} lists {' '.join(self.packages) or 'nothing'} as installed"


@dataclass(frozen=True)
class RuntimeInstalled:
    driver_root: str

    def satisfied(self, root: Path) -> bool:

        return is_live(root) and install.is_installed(self.driver_root)

    def describe(self) -> str:
        return "skipped when gpuprov-runtime is installed from these sources with these settings"


@dataclass(frozen=True)
class EngineConfigured:
    """The engine's config already holds the runtime (its adapter's merge changes nothing) and, for docker, the
    live daemon lists it."""
    engine: str
    runtime_name: str
    runtime_path: str
    default: bool
    cdi: bool
    replace: bool = False
    config: str | None = None  # the config the engine really reads, where it is not the engine's default

    def _plan(self, root: Path) -> EnginePlan:
        """The adapter's plan against the config under `root`. Its edits name host paths, and what they would
        write names host paths too (containerd's `imports` entry), never `root`."""
        eng = engines.get(self.engine)
        req = RuntimeRequest(self.runtime_name, self.runtime_path, default=self.default, cdi=self.cdi,
                             replace=self.replace)
        host = eng.config_path(self.config, req)
        if is_live(root):
            return eng.plan(host, req, unit_root=root)
        if self.engine == "containerd":
            # The adapter asks the live containerd (its version, `config dump`); a host tree's containerd cannot be
            # run: plan from the files alone, as for a containerd of unknown version.
            p = containerd.plan(host, runtime_name=req.name, runtime_path=req.path, default=req.default,
                                cdi=req.cdi, replace=req.replace, binary=containerd.Binary(None, None), root=root)
            return EnginePlan([FileEdit(f, old, new) for f, old, new in p.edits], [], p.warnings)
        plan = eng.plan(under(root, str(host)), req, unit_root=root)  # one file (daemon.json), read under root
        return EnginePlan([FileEdit(Path("/", Path(e.path).relative_to(root)), e.old, e.new) for e in plan.edits],
                          plan.changes, plan.warnings)

    def satisfied(self, root: Path) -> bool:
        if not is_live(root) or self._plan(root).changed:
            return False
        return self.engine != "docker" or self.runtime_name in (effects.docker_runtimes() or [])

    def preview(self, root: Path) -> dict[str, str]:
        """{path on the host: diff} for every file the merge would write, read under `root`."""
        return {str(e.path): effects.unified_diff(e.old or "", e.new, str(e.path)) for e in self._plan(root).edits
                if e.changed}

    def describe(self) -> str:
        return (f"skipped when {self.engine}'s config already registers {self.runtime_name!r}"
                + (" and dockerd lists it" if self.engine == "docker" else ""))


@dataclass(frozen=True)
class ServiceAnswers:
    name: str  # docker | containerd

    def satisfied(self, root: Path) -> bool:
        return is_live(root) and effects.daemon_answers(self.name)

    def describe(self) -> str:
        return f"skipped when `{shlex.join(effects.ANSWERS[self.name])}` answers"


Check = Union[Never, Already, FilesMatch, PathExists, DirEmpty, PackagesInstalled, RuntimeInstalled,
              EngineConfigured, ServiceAnswers, Undone]


# ---------------------------------------------------------------- the step


@dataclass(frozen=True)
class Step:
    id: str  # stable identifier: "driver.packages", "engine.config"
    stage: str  # provision.options.Stage: what `bootstrap --only` / the role's tags select
    title: str
    actions: tuple[Action, ...] = ()
    check: Check = field(default_factory=Never)
    verify_only: bool = False  # changes nothing (validation, facts): never counted as a change
    reboot: bool = False  # doing this step requires a reboot afterwards
    reboot_reason: str = ""  # why, in words: what bootstrap records for the resume (plan/resume.py)
    notes: tuple[str, ...] = ()  # shown with the plan and appended to the step's result
    hint: str | None = None  # appended to a failure's message: what to do about it

    @property
    def commands(self) -> list[Command]:
        """Every command the step's actions run, in order (a fallback included)."""
        return [c for a in self.actions for c in a.commands()]

    @property
    def on_failure(self) -> list[Command]:
        """The commands run only to undo a failed action (the DKMS rollback), in order."""
        return [c for a in self.actions for c in a.on_failure()]

    @property
    def files(self) -> dict[str, str]:
        return {a.path: a.content for a in self.actions if isinstance(a, WriteFile)}

    def lines(self) -> list[str]:
        return [ln for a in self.actions for ln in a.lines()]

    def shown_notes(self) -> list[str]:
        """The notes as the plan and the step's result show them: the reboot's reason first."""
        return ([f"reboot: {self.reboot_reason}"] if self.reboot_reason else []) + list(self.notes)

    def diffs(self, root: Path) -> dict[str, str]:
        out = {a.path: a.diff(root) for a in self.actions if isinstance(a, WriteFile)}
        if isinstance(self.check, EngineConfigured):
            out.update(self.check.preview(root))
        return out

    def satisfied(self, root: Path = LIVE) -> bool:
        return self.check.satisfied(root)

    def apply(self) -> str | None:
        outs = []
        for a in self.actions:
            try:
                out = a.execute()
            except GpuprovError as exc:
                if self.hint:
                    raise type(exc)(f"{exc}; {self.hint}", exit_code=exc.exit_code) from None
                raise
            last = [ln for ln in (out or "").strip().splitlines() if ln.strip()]
            # a command that may fail is not the step's result (e.g. "not found" from removing a leftover)
            if last and a.reports and not getattr(a, "may_fail", False):
                outs.append(last[-1].strip())
        detail = "; ".join(outs + self.shown_notes())
        return detail or None

    def to_dict(self, root: Path = LIVE, diffs: bool = True) -> dict:
        d = {"id": self.id, "title": self.title, "commands": [c.shell() for c in self.commands],
             "on_failure": [c.shell() for c in self.on_failure], "actions": [ln for ln in self.lines()],
             "files": sorted(self.files), "check": self.check.describe(),
             "reboot": self.reboot, "verify_only": self.verify_only, "notes": self.shown_notes()}
        if diffs:
            d["diffs"] = self.diffs(root)
        return d


def executed_argvs(step: Step) -> list[tuple[str, ...]]:
    """Every argv the step may run, in order: what a test compares with what apply really ran."""
    return [c.argv for c in step.commands]


def read_or_empty(path: Path | str, limit: int = MAX_READ) -> str:
    """A file under the plan's root, or "" when it is missing or not a regular file. Read as facts are (bounded,
    regular files only, non-blocking open): a FIFO or device node in a `--root` tree never hangs a plan."""
    try:
        return read_text_file(path, limit)
    except OSError:
        return ""


def packages_installed(pm: str, packages: tuple[str, ...], root: Path = LIVE) -> bool:
    """All packages installed, by the package database under `root` (one fast query; reads only)."""
    if not packages:
        return True
    if pm == "apt":
        argv = ["dpkg-query", f"--admindir={under(root, 'var/lib/dpkg')}", "-W", "-f", "${Package} ${Status}\n",
                *packages]
    else:
        argv = ["rpm", "--root", str(root), "-q", "--whatprovides", *[p.split(":")[0] for p in packages]]
    try:
        p = effects.run(argv, check=False)
    except StepFailed:  # the package manager itself is missing under this root: nothing is installed by it
        return False
    if pm == "apt":
        # held packages (the driver's, after its hold step) are "hold ok installed"
        ok = {ln.split()[0] for ln in p.output.splitlines() if ln.endswith((" install ok installed",
                                                                             " hold ok installed"))}
        return all(pkg in ok for pkg in packages)
    return p.returncode == 0
