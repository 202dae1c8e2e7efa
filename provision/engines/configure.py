"""`gpuprov engine configure`: merge the runtime into an engine's config through its adapter (base.Engine), write it
through the one hardened write path (with a backup), check it, and reload/restart the engine only when something
changed *and* the live daemon reads that file; then check the engine lists the runtime.

The caller holds the host lock (commands/engine.py, bootstrap): read-merge-write must not interleave with another run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from provision import engines, record
from provision.engines.base import EnginePlan, RuntimeRequest
from provision.errors import ConcurrentEdit, RestartRefused, StepFailed
from provision.fsutil import EDIT_TRIES, changed_line, seen_as, write_file
from provision.output import kv


@dataclass
class ConfigureResult:
    engine: str
    path: str
    changed: bool
    changes: list[str] = field(default_factory=list)
    diff: str = ""
    backup: str | None = None
    restart: str | None = None
    verified: bool | None = None
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def summary(self) -> str:
        """What was done, in one line of words (bootstrap's step result): the settings changed, the backup, what
        the live engine was told, whether it lists the runtime."""
        what = (f"set {', '.join(self.changes)} in {self.path}" if self.changes else f"updated {self.path}") \
            if self.changed else f"{self.path} already registers the runtime"
        parts = [what] + ([f"backup {self.backup}"] if self.backup else []) + ([self.restart] if self.restart else [])
        parts += {True: [f"{self.engine} lists the runtime"], False: [f"{self.engine} does NOT list the runtime"],
                  None: []}[self.verified]
        return "; ".join(parts + [f"warning: {w}" for w in self.warnings])

    def lines(self, dry_run: bool = False) -> list[str]:
        """What was done, for people (`engine configure` prints it after the diff; bootstrap's step reports its
        last line)."""
        status = ("would change" if dry_run else "changed") if self.changed else "unchanged"
        return [kv([("config", self.path), ("status", status), ("changes", "; ".join(self.changes)),
                    ("backup", self.backup), ("engine", self.restart),
                    ("verified", {True: "runtime listed by the engine", False: "NOT listed", None: "-"}[self.verified])])
                ] + [f"warning: {w}" for w in self.warnings]


def configure(engine: str, *, config: str | None = None, runtime_name: str = "nvidia", runtime_path: str,
              default: bool = False, cdi: bool = False, replace: bool = False, dry_run: bool = False,
              restart: bool = True, unit_root: Path = Path("/"), restart_engine: bool = False,
              options: tuple[tuple[str, str], ...] = ()) -> ConfigureResult:
    """`restart_engine`: consent to a restart that stops running containers (dockerd without live-restore); without
    it such a restart is refused (exit 14) before anything is written. `options`: the operator's own daemon.json
    keys (bootstrap --engine-option), merged by the same adapter."""
    eng = engines.get(engine)
    req = RuntimeRequest(runtime_name, runtime_path, default=default, cdi=cdi, replace=replace, options=options)
    path = eng.config_path(config, req)
    daemon = eng.live_daemon(path)
    # a run killed while it held live-restore on for a restart: the operator's setting back first
    finished = eng.finish_hold(daemon, path) if restart and not dry_run else None
    pending = eng.pending_restart(daemon) if daemon else None
    keeps = 0
    # The adapter's plan is the merge function: when the operator saves a file between its read and our rename
    # (fsutil compares before renaming), the files are read and merged again; after EDIT_TRIES, exit 14.
    for _ in range(EDIT_TRIES):
        plan = eng.plan(path, req, unit_root=unit_root)
        res = ConfigureResult(engine, str(path), plan.changed, [str(c) for c in plan.changes], plan.diff(),
                              warnings=list(plan.warnings))
        if pending:
            res.changes.append(pending)
        if finished:
            res.changes.append(finished)
        if dry_run or (not plan.changed and not (pending and restart)):
            if not dry_run and restart and daemon:
                res.verified = eng.verify(daemon, req, wait=False)
            res.changed = plan.changed or bool(pending) or bool(finished)
            return res
        res.changed = True
        if restart and daemon and (pending or plan.needs_restart):
            keeps = restart_keeps(eng, daemon, pending or ", ".join(str(c) for c in plan.changes if not c.reload),
                                  restart_engine)
        try:
            if plan.changed:  # the engine's own check reads files only: it runs with --no-restart too
                made = _write(eng, plan, path, req, res)
                # for `gpuprov uninstall`: the files as they were and as written, the directories created
                record.note_config(str(path), eng.name, req.name, req.path,
                                   [(str(e.path), e.old, e.new) for e in plan.edits if e.changed], [str(d) for d in made])
            break
        except ConcurrentEdit:
            continue
    else:
        raise ConcurrentEdit(changed_line(path, EDIT_TRIES))
    if not restart:
        return res
    if daemon is None:
        res.restart = _not_signalled(eng, path)
        return res
    res.restart = eng.restart_keeping(daemon, path) if keeps else eng.apply(daemon, plan, restart=bool(pending))
    verified = eng.verify(daemon, req)
    if verified is False:
        raise StepFailed(f"{engine} does not list runtime {runtime_name!r} after `{res.restart}`; check {path}")
    if verified is not None:
        res.verified = verified
    return res


RESTART_OPTION = "--restart-engine"


def restart_keeps(eng, daemon, why: str, consent: bool = False) -> int:
    """A restart the change needs, of a daemon whose running containers it would stop (dockerd with live-restore
    off): how many the restart keeps by holding live-restore on for it (eng.restart_keeping). Where they cannot be
    kept (swarm mode, a --live-restore unit flag), exit 14 naming them and the option, before anything is written,
    unless `consent` (--restart-engine): then 0, a plain restart. Also check mode's stop and the plan's words
    (plan/steps.ConfigureEngine.check_restart, plan/build.restart_notes)."""
    stops = eng.restart_stops(daemon)
    if not stops:
        return 0
    blocker = eng.hold_blocker(daemon)
    if blocker is None:
        return stops
    if consent:
        return 0
    names = sorted(n for n, _ in (eng.running() or {}).values())
    raise RestartRefused(f"{eng.name} needs a restart ({why}), and restarting it stops its {stops} running "
                         f"container(s){' (' + ', '.join(names) + ')' if names else ''} (live-restore is off, and "
                         f"cannot be turned on for the restart: {blocker}); nothing was changed: run again with "
                         f"{RESTART_OPTION} to restart it anyway")


def refuse_stopping_restart(eng, daemon, why: str) -> None:
    """restart_keeps without consent: exit 14 where the restart would stop containers it cannot keep."""
    restart_keeps(eng, daemon, why)


def _write(eng, plan: EnginePlan, path: Path, req: RuntimeRequest, res: ConfigureResult) -> list[Path]:
    """Write every edit (backups kept); when one write fails, or the engine's own check rejects the result, put the
    old files back (a drop-in written before its `imports` line is removed again). Returns the directories made."""
    done: list[tuple] = []
    made: list[Path] = []  # directories this write creates (a drop-in's conf.d): removed again on a roll-back
    try:
        for edit in plan.edits:
            if edit.changed:
                parent = edit.path.parent
                while not parent.exists():
                    made.append(parent)
                    parent = parent.parent
                # The file as the adapter read it (its text) with its identity now: the rename happens only if it
                # is still that (ConcurrentEdit otherwise, and the caller merges again).
                seen = seen_as(edit.path, edit.old)
                bak = write_file(edit.path, edit.new, mode=0o644, backup=bool(edit.old), expect=seen)
                done.append((edit, bak))
                res.backup = res.backup or (str(bak) if bak else None)
    except BaseException:
        _roll_back(done, made)
        raise
    ok = eng.check(path, req)
    if ok is False:
        _roll_back(done, made)
        why = eng.check_error or f"its own check does not show runtime {req.name!r}"
        raise StepFailed(f"{eng.name} rejects the edited {path} ({why}); the change was rolled back")
    res.verified = ok
    return made


def _roll_back(done: list[tuple], made: list[Path]) -> None:
    for edit, bak in reversed(done):
        try:  # only what is still ours goes back: a file the operator saved since is theirs
            seen_as(edit.path, edit.new)
        except ConcurrentEdit:
            continue
        if edit.old is None:
            edit.path.unlink(missing_ok=True)
        else:
            write_file(edit.path, edit.old, backup=False)
        if bak:
            bak.unlink(missing_ok=True)
    for d in made:  # deepest first
        try:
            d.rmdir()
        except OSError:
            pass


def _not_signalled(eng, path: Path) -> str:
    running, name = eng.running_daemons(), eng.daemon_names[0]
    if not running:
        return f"{name} not running: the change applies when it starts"
    d = sorted(running, key=lambda d: not d.in_our_mount_namespace())[0]  # this host's own daemon first
    return f"{name} not signalled: the running {name} (pid {d.pid}) reads {d.config}, not {path}"
