"""Apply a plan: progress per step, a log, stop at the first failure (the reboot state: plan/resume.py)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from provision import record
from provision.errors import GpuprovError, StepFailed
from provision.fsutil import make_dirs
from provision.output import progress
from provision.plan import persistence
from provision.plan.steps import PackagesInstalled, Step, packages_installed

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

    def to_dict(self) -> dict:
        return {"id": self.id, "title": self.title, "status": self.status.value, "detail": self.detail,
                "seconds": self.seconds}


@dataclass
class ApplyResult:
    outcomes: list[StepOutcome] = field(default_factory=list)
    reboot_required: bool = False

    @property
    def changed(self) -> int:
        return sum(o.status is Status.CHANGED for o in self.outcomes)

    def changed_ids(self) -> set[str]:
        return {o.id for o in self.outcomes if o.status is Status.CHANGED}

    def to_dict(self) -> dict:
        return {"changed": self.changed, "reboot_required": self.reboot_required,
                "steps": [o.to_dict() for o in self.outcomes]}


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


def check_plan(steps: list[Step], root: Path = Path("/")) -> dict:
    """Check mode: which steps would change, with their diffs and the exact commands they would run; nothing is
    changed. Every check and diff reads through `root`."""
    out = []
    for step in steps:
        if step.verify_only:
            continue
        item = {"id": step.id, "title": step.title}
        try:
            done = step.satisfied(root)
        except GpuprovError as exc:
            out.append({**item, "would_change": True, "error": str(exc)})
            continue
        item["would_change"] = not done
        if not done:
            try:
                item["diff"] = "".join(d for d in step.diffs(root).values() if d)
            except GpuprovError as exc:
                item["diff"], item["error"] = "", str(exc)
            item["commands"] = [c.shell() for c in step.commands]
            item["on_failure"] = [c.shell() for c in step.on_failure]
            item["actions"] = step.lines()
        out.append(item)
    return {"would_change": sum(i["would_change"] for i in out), "steps": out}


def missing_packages(steps: list[Step]) -> dict[str, list[str]]:
    """Per step id, the packages its install would add that are not installed now (read before applying): what
    `record_installed` keeps for `uninstall --driver/--engine`, which never remove a package gpuprov found."""
    out = {}
    for s in steps:
        if isinstance(s.check, PackagesInstalled) and s.check.manager == "apt" and not s.satisfied():
            out[s.id] = [p for p in s.check.packages if not packages_installed("apt", (p,))]
    return out


def record_installed(steps: list[Step], missing: dict[str, list[str]], res: ApplyResult) -> None:
    """Keep in the install record the packages gpuprov's steps installed (those missing before that are installed
    now) by stage, and the packages the hold step held."""
    changed = res.changed_ids()
    for s in steps:
        if s.id in missing:
            installed = [p for p in missing[s.id] if packages_installed("apt", (p,))]
            record.note_packages(getattr(s.stage, "value", s.stage), installed)
            if s.id == persistence.PACKAGE_STEP and installed:  # Debian's package enables its unit when installed
                record.note_enabled(persistence.UNIT)
        elif s.id == "driver.hold" and s.id in changed and getattr(s.check, "manager", None) == "apt":
            record.note_packages(getattr(s.stage, "value", s.stage), [], held=list(s.check.packages))
        elif s.id == persistence.STEP and s.id in changed:  # enabled by gpuprov (its check: it was not before)
            record.note_enabled(persistence.UNIT)


def apply_plan(steps: list[Step], *, quiet: bool = False, logged: bool = True) -> ApplyResult:
    """Walk the steps on the live host: a satisfied step is skipped, any other runs its actions, in order.
    `logged=False`: no lines in bootstrap's log (uninstall removes the log's directory)."""
    res = ApplyResult()
    n = len(steps)
    say = (lambda m: None) if quiet else progress
    note = log if logged else (lambda line: None)
    for i, step in enumerate(steps, 1):
        t = time.monotonic()
        say(f"[{i}/{n}] {step.title} …")
        try:
            if step.verify_only:
                detail = step.apply() if step.actions else None
                status = Status.VERIFIED
            elif step.satisfied():
                detail, status = None, Status.OK
            else:
                detail = step.apply()
                status = Status.CHANGED
                res.reboot_required |= step.reboot
        except GpuprovError as exc:
            res.outcomes.append(StepOutcome(step.id, step.title, Status.FAILED, str(exc), time.monotonic() - t))
            note(f"FAILED {step.id}: {exc}")
            say(f"[{i}/{n}] FAILED: {step.title}")
            raise StepFailed(f"step {step.id} ({step.title}) failed: {exc}", exit_code=exc.exit_code) from None
        dt = time.monotonic() - t
        res.outcomes.append(StepOutcome(step.id, step.title, status, detail, dt))
        note(f"{status.value.upper()} {step.id}{': ' + detail if detail else ''} ({dt:.1f}s)")
        say(f"[{i}/{n}] {status.value}{': ' + detail if detail else ''} ({dt:.1f}s)")
    return res
