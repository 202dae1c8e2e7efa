"""Apply a plan: progress per step, a log, stop at the first failure; reboot state under /var/lib/gpuprov."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from provision import paths, record
from provision.errors import GpuprovError, StepFailed, UntrustedPath
from provision.facts.rootfs import read_text, under
from provision.fsutil import make_dirs, read_trusted, write_file
from provision.output import progress
from provision.plan.steps import PackagesInstalled, Step, packages_installed

LIVE = Path("/")
STATE_FILE = Path(paths.STATE_FILE)
LOG_FILE = Path(os.environ.get("GPUPROV_LOG", "/var/log/gpuprov/bootstrap.log"))


@dataclass
class StepOutcome:
    id: str
    title: str
    status: str  # ok (already satisfied) | changed | verified | failed
    detail: str | None = None
    seconds: float = 0.0


@dataclass
class ApplyResult:
    outcomes: list[StepOutcome] = field(default_factory=list)
    reboot_required: bool = False

    @property
    def changed(self) -> int:
        return sum(o.status == "changed" for o in self.outcomes)

    def to_dict(self) -> dict:
        return {"changed": self.changed, "reboot_required": self.reboot_required,
                "steps": [o.__dict__ for o in self.outcomes]}


def boot_id(root: Path = LIVE) -> str:
    return (read_text(root, "/proc/sys/kernel/random/boot_id") or "").strip()


BOOT_MARKER = Path(paths.REBOOT_MARKER)


def pending_reboot(reason: str) -> dict:
    """The state that says a reboot is pending, and a marker in /run (a tmpfs every boot starts empty): a container
    host's restart keeps the kernel's boot_id, so the marker is what tells that one rebooted."""
    try:  # its directory is made 0755 by write_file, whatever the umask
        write_file(BOOT_MARKER, reason + "\n", keep_mode=False, backup=False, durable=False)  # /run: gone at boot
    except OSError:
        pass
    return {"reboot_required": True, "boot_id": boot_id(), "reason": reason}


def rebooted_since(state: dict, root: Path = LIVE) -> bool:
    """Whether the host under `root` rebooted since `state` was written (reads only)."""
    return state.get("boot_id") != boot_id(root) or not under(root, str(BOOT_MARKER)).exists()


def read_state(root: Path = LIVE) -> dict:
    """The reboot state of the host under `root` ({} when there is none, or it is unreadable). On this host, only a
    state nobody but root could have written is used (fsutil.open_trusted): another is refused, exit 6."""
    try:
        if root == LIVE:
            text = (read_trusted(STATE_FILE) or b"{}").decode()
        else:
            text = read_text(root, str(STATE_FILE)) or "{}"
        state = json.loads(text)
    except UntrustedPath as exc:
        raise UntrustedPath(f"bootstrap's state: {exc}; remove it (bootstrap then starts from the beginning)") \
            from None
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def write_state(state: dict) -> None:
    write_file(STATE_FILE, json.dumps(state, indent=2) + "\n", mode=0o644, keep_mode=False, backup=False)


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
    changed = {o.id for o in res.outcomes if o.status == "changed"}
    for s in steps:
        if s.id in missing:
            record.note_packages(getattr(s.stage, "value", s.stage),
                                 [p for p in missing[s.id] if packages_installed("apt", (p,))])
        elif s.id == "driver.hold" and s.id in changed and getattr(s.check, "manager", None) == "apt":
            record.note_packages(getattr(s.stage, "value", s.stage), [], held=list(s.check.packages))


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
                status = "verified"
            elif step.satisfied():
                detail, status = None, "ok"
            else:
                detail = step.apply()
                status = "changed"
                res.reboot_required |= step.reboot
        except GpuprovError as exc:
            res.outcomes.append(StepOutcome(step.id, step.title, "failed", str(exc), time.monotonic() - t))
            note(f"FAILED {step.id}: {exc}")
            say(f"[{i}/{n}] FAILED: {step.title}")
            raise StepFailed(f"step {step.id} ({step.title}) failed: {exc}", exit_code=exc.exit_code) from None
        dt = time.monotonic() - t
        res.outcomes.append(StepOutcome(step.id, step.title, status, detail, dt))
        note(f"{status.upper()} {step.id}{': ' + detail if detail else ''} ({dt:.1f}s)")
        say(f"[{i}/{n}] {status}{': ' + detail if detail else ''} ({dt:.1f}s)")
    return res
