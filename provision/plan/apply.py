"""Apply a plan: progress per step, a log, stop at the first failure (the reboot state: plan/resume.py)."""
from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from provision import package_managers, progress, record
from provision.errors import GpuprovError, StepFailed
from provision.facts.rootfs import is_live
from provision.fsutil import make_dirs
from provision.plan import persistence
from provision.plan.packages import InstallWatch, PackageInstall, RemovalGuard
from provision.plan.steps import ConfigureEngine, PackagesInstalled, Step, packages_installed

LOG_FILE = Path(os.environ.get("GPUPROV_LOG", "/var/log/gpuprov/bootstrap.log"))


class Status(str, Enum):
    """What applying a step did (its value is what --json and the log say)."""
    OK = "ok"  # already satisfied: nothing run
    CHANGED = "changed"
    VERIFIED = "verified"  # a verify-only step ran its checks
    FAILED = "failed"


@dataclass
class StepOutcome:
    id: str
    title: str
    status: Status
    detail: str | None = None
    seconds: float = 0.0
    exit_code: int = 0  # a failed step's (the error's documented code)

    def to_dict(self) -> dict:
        return {"id": self.id, "title": self.title, "status": self.status.value, "detail": self.detail,
                "seconds": self.seconds}


@dataclass
class ApplyResult:
    outcomes: list[StepOutcome] = field(default_factory=list)
    reboot_required: bool = False
    log: str | None = None  # the run's full log (provision/progress.py)

    @property
    def failed(self) -> list[StepOutcome]:
        return [o for o in self.outcomes if o.status is Status.FAILED]

    @property
    def changed(self) -> int:
        return sum(o.status is Status.CHANGED for o in self.outcomes)

    def counts(self) -> str:
        """The summary's counts in words: `1 change, 5 steps`."""
        return (f"{self.changed} change{'' if self.changed == 1 else 's'}, "
                f"{len(self.outcomes)} step{'' if len(self.outcomes) == 1 else 's'}")

    def changed_ids(self) -> set[str]:
        return {o.id for o in self.outcomes if o.status is Status.CHANGED}

    def to_dict(self) -> dict:
        return {"changed": self.changed, "reboot_required": self.reboot_required,
                "steps": [o.to_dict() for o in self.outcomes], "log": self.log}


def log(line: str) -> None:
    try:
        make_dirs(LOG_FILE.parent, 0o755)
        with open(LOG_FILE, "a", opener=_root_only) as fh:
            fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
    except OSError:
        pass


def _root_only(path: str, flags: int) -> int:
    """open()'s opener for the log: never through a link, created 0600 whatever the umask."""
    fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)
    if os.fstat(fd).st_mode & 0o022:
        os.fchmod(fd, 0o600)
    return fd


def step_failure(step: Step, exc: GpuprovError) -> StepFailed:
    """The one line (and exit code) a step's failure ends a run with: the real run's, and check mode's for a step
    whose real run would stop."""
    return StepFailed(f"step {step.id} ({step.title}) failed: {exc}", exit_code=exc.exit_code)


def check_plan(steps: list[Step], root: Path = Path("/")) -> dict:
    """Check mode: which steps would change, with their diffs and the exact commands they would run; nothing is
    changed. Every check and diff reads through `root`. A step whose real run would stop (the operator's
    default-runtime: 14, a config it cannot edit: 6, an install that would remove packages: 14, by the package
    manager's own dry run on this host) is reported as that failure: `stop` holds the first, with the line and exit
    code the real run would end with."""
    out, stop = [], None
    for step in steps:
        if step.verify_only:
            continue
        item = {"id": step.id, "title": step.title}
        acting = False  # past the check: a failure from here is one of the step's actions (its hint applies)
        try:
            done = step.satisfied(root)
            item["would_change"] = not done
            acting = not done
            if not done:
                item["commands"] = [c.shell() for c in step.commands]
                item["on_failure"] = [c.shell() for c in step.on_failure]
                item["actions"] = step.lines()
                item["diff"] = ""
                item["diff"] = "".join(d for d in step.diffs(root).values() if d)
                if is_live(root):  # the package manager's dry run and the live daemon: this host only
                    for a in step.actions:
                        if isinstance(a, (PackageInstall, RemovalGuard)):
                            a.check_removals()
                        elif isinstance(a, ConfigureEngine):
                            a.check_restart()
        except GpuprovError as exc:
            if acting and step.hint:  # as Step.apply says it
                exc = type(exc)(f"{exc}; {step.hint}", exit_code=exc.exit_code)
            failure = step_failure(step, exc)
            item.update(would_change=True, error=str(exc), exit_code=exc.exit_code)
            stop = stop or {"id": step.id, "error": str(failure), "exit_code": failure.exit_code}
        out.append(item)
    return {"would_change": sum(i["would_change"] for i in out), "steps": out, "stop": stop}


def missing_packages(steps: list[Step]) -> dict[str, list[str]]:
    """Per step id, the packages its install would add that are not installed now (read before applying), with their
    package manager, where its record keeps the packages asked for (apt; dnf's InstallWatch sees its own): what
    `record_installed` keeps for `uninstall --driver/--engine`, which never remove a package gpuprov found."""
    out = {}
    for s in steps:
        # the apt driver step's check (plan/driver.py's DriverBuilt) names its packages too: without it, the driver
        # packages were never recorded and `uninstall --purge-driver` purged none (tests/integration/test_ubuntu_apt.py)
        check = getattr(s.check, "installs", s.check)
        if isinstance(check, PackagesInstalled) and not package_managers.get(check.manager).records_dependencies \
                and not s.satisfied():
            out[s.id] = PackagesInstalled(check.manager, tuple(p for p in check.packages
                                                               if not packages_installed(check.manager, (p,))))
    return out


def record_installed(steps: list[Step], missing: dict[str, PackagesInstalled], res: ApplyResult,
                     watch: InstallWatch | None = None) -> None:
    """Keep in the install record the packages gpuprov's steps installed (apt: those of a step's check missing before
    that are installed now; dnf/yum: every package a step's transactions added, plan/packages.py's InstallWatch) by stage,
    and the packages the hold step held (apt's pin, dnf/yum's versionlock)."""
    changed = res.changed_ids()
    for stage, added in (watch.added.items() if watch else ()):
        record.note_packages(stage, added)
    if watch and watch.streams:
        record.note_streams(watch.streams)
    for s in steps:
        if s.id in missing:
            gone = missing[s.id]
            installed = [p for p in gone.packages if packages_installed(gone.manager, (p,))]
            record.note_packages(getattr(s.stage, "value", s.stage), installed)
            if s.id == persistence.PACKAGE_STEP and installed:  # Debian's package enables its unit when installed
                record.note_enabled(persistence.UNIT)
        elif s.id == "driver.hold" and s.id in changed:
            record.note_packages(getattr(s.stage, "value", s.stage), [], held=list(s.check.packages))
        elif s.id == persistence.STEP and s.id in changed:  # enabled by gpuprov (its check: it was not before)
            record.note_enabled(persistence.UNIT)


RUN_LOGS = LOG_FILE.parent / "runs"  # each run's full log (provision/progress.py), beside the one-line-a-step log
UNINSTALL_LOGS = LOG_FILE.parent.with_name(f"{LOG_FILE.parent.name}-uninstall")  # kept: uninstall removes RUN_LOGS


def step_line(i: int, n: int, title: str, status: Status, detail: str | None, seconds: float) -> str:
    """A step's one line when it ends: what it changed, in words (never a tool's own output: that is in the log)."""
    words = {Status.OK: "nothing to do (already done)", Status.FAILED: "FAILED",
             Status.VERIFIED: "checked", Status.CHANGED: "done"}[status]
    said = f"FAILED: {detail}" if status is Status.FAILED and detail else detail or words
    return f"[{i}/{n}] {title}: {said} ({seconds:.1f}s)"


def apply_plan(steps: list[Step], *, quiet: bool = False, logged: bool = True, keep_going: bool = False,
               run: progress.Run | None = None, watch: InstallWatch | None = None, first: int = 1,
               total: int | None = None) -> ApplyResult:
    """Walk the steps on the live host: a satisfied step is skipped, any other runs its actions, in order.
    `logged=False`: no lines in bootstrap's log (uninstall removes the log's directory). `keep_going` (uninstall,
    whose steps are each idempotent): a failed step is recorded and the next one runs; the caller reports them.
    `run`: the run's log and screen (provision/progress.py); without one, a run of its own (no log file unless
    `logged`). `watch`: notes what each step's dnf/yum transactions installed (for the install record).
    `first`, `total`: the steps' numbers, `[first/total]` on, where a plan is applied in parts (uninstall applies its
    state step after the others): the numbers then run as the dry run counted them, [1/5] to [5/5], not [1/4] to
    [4/4] then [1/1]."""
    if run is None:
        with progress.Run("bootstrap", log_dir=RUN_LOGS if logged else None,
                          mode="quiet" if quiet else None) as own:
            return apply_plan(steps, logged=logged, keep_going=keep_going, run=own, watch=watch, first=first,
                              total=total)
    res = ApplyResult(log=str(run.log.path) if run.log.path else None)
    n = total or len(steps)
    # an engine restart that would stop containers it cannot keep (exit 14 until --restart-engine) stops the run
    # before its first step changes anything, as check mode says, not after runtime.install (issue 39 item 2)
    for step in steps:
        engine_steps = [a for a in step.actions if isinstance(a, ConfigureEngine)]
        if engine_steps and not step.verify_only and not step.satisfied():
            try:
                for a in engine_steps:
                    a.check_restart()
            except GpuprovError as exc:
                raise step_failure(step, exc) from None
    note = log if logged else (lambda line: None)
    for i, step in enumerate(steps, first):
        t = time.monotonic()
        run.step_started(f"[{i}/{n}] {step.title}")
        try:
            if step.verify_only:
                detail = step.apply() if step.actions else None
                status = Status.VERIFIED
            elif step.satisfied():
                detail, status = None, Status.OK
            else:
                with watch.step(step) if watch else nullcontext():
                    detail = step.apply()
                status = Status.CHANGED
                res.reboot_required |= step.reboot
        except GpuprovError as exc:
            dt = time.monotonic() - t
            res.outcomes.append(StepOutcome(step.id, step.title, Status.FAILED, str(exc), dt, exc.exit_code))
            note(f"FAILED {step.id}: {exc}")
            run.step_ended(step_line(i, n, step.title, Status.FAILED, str(exc) if keep_going else None, dt),
                           f"FAILED {step.id}: {exc}")
            if keep_going:
                continue
            raise step_failure(step, _after_changes(exc, res)) from None
        dt = time.monotonic() - t
        res.outcomes.append(StepOutcome(step.id, step.title, status, detail, dt))
        note(f"{status.value.upper()} {step.id}{': ' + detail if detail else ''} ({dt:.1f}s)")
        run.step_ended(step_line(i, n, step.title, status, detail, dt))
    return res


def _after_changes(exc: GpuprovError, res: ApplyResult) -> GpuprovError:
    """A failure after earlier steps of the run changed the host: its "nothing was changed" is the step's alone, and
    the line names what the run changed and how to undo it (a preflight that could not ask lets a run get here)."""
    done = [o.title for o in res.outcomes if o.status is Status.CHANGED]
    if not done:
        return exc
    said = str(exc).replace("nothing was changed", "nothing was changed by this step")
    return type(exc)(f"{said}. This run changed before it: {'; '.join(done)}: run bootstrap again once that is "
                     "fixed (it goes on from there), or `gpuprov uninstall` to undo them", exit_code=exc.exit_code)


def open_run(command: str, *, json_out: bool = False, verbose: bool = False, log_dir: Path | None = RUN_LOGS):
    """The Run a host-changing command applies its plan in: nothing on the screen with --json, every line with
    -v/--verbose, else the live tail on a terminal and one line a step when piped."""
    return progress.Run(command, log_dir=log_dir, mode="quiet" if json_out else "verbose" if verbose else None)


def log_named(res: ApplyResult) -> str:
    """The summary's pointer to the run's log."""
    return f"full log: {res.log}" if res.log else "no log file could be written"
