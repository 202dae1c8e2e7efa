"""The step model. A step is data: the actions it takes (commands with their argv, files with their full new
content, a service start) and the check that says it is already done. `plan`, `--dry-run`, `--check` and `apply`
all walk these same objects, so what is printed is what runs:

- `Command`: printed with `shlex.join` (paste it into a shell and it does the same); applied by running exactly
  that argv through `effects.run`.
- `WriteFile`: printed as a unified diff against the file under the plan's root; applied by an atomic write.
- `StartService`: printed as the commands it runs, in order, with the fallback it takes without systemd.
- gpuprov's own operations, run in-process under the host lock bootstrap holds (the same functions as the
  commands `gpuprov runtime install`, `engine configure`, `cdi refresh`): `InstallRuntime`, `RefreshCdi`, and
  `ConfigureEngine`, whose diff is its engine adapter's plan (`edits`): the FileEdits it prints are the ones apply
  writes (engines/configure.py writes exactly `edit.new`), computed by the one function from the host's files.
Every action lists the `Command`s it runs (`commands()`, in order) and those it runs only to undo a failure
(`on_failure()`): the same objects its `execute` runs, so `plan --json` and `--check` list every command.

Checks are data too, and read through the host root they are given; checks that need the live host (a daemon's
answer, the package database of a running system) say "cannot tell" (False: would change) for any other root.
"""
from __future__ import annotations

import os
import re
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Union

from provision import effects, engines, package_managers
from provision.engines.base import Change, EnginePlan, FileEdit, ImageImport, RuntimeRequest
from provision.engines.configure import configure, refuse_stopping_restart, restart_keeps
from provision.errors import GpuprovError, StepFailed
from provision.facts.rootfs import MAX_READ, is_live, read_bytes_bounded, read_text_file, under
from provision.fsutil import write_file
from provision.inject import install
from provision.inject.settings import load_settings
from provision.plan import runtime as runtime_host
from provision.share import mps

LIVE = Path("/")


# ---------------------------------------------------------------- actions


class Action:
    """What every action offers: the commands it runs, in order (`commands`; plan --json, --check and the
    printed-vs-executed test read them), and those it runs only to undo a failure (`on_failure`). Both are the
    very Command objects `execute` runs, so what is listed is what runs. `reports`: the last line of what it
    returns is the step's result, in words (an install's "installed docker.io 20.10.24; nothing removed", the
    validation container's own line); a command's output is not (it goes to the run's log: provision/progress.py)."""

    reports: ClassVar[bool] = False

    def commands(self) -> list[Command]:
        return []

    def on_failure(self) -> list[Command]:
        return []

    def diffs(self, root: Path) -> dict[str, str]:
        """{host path: unified diff} of the files it writes, against those under `root`."""
        return {}

    def brief(self) -> str | None:
        """What it does in a few words, where neither its commands nor its files say it (an action gpuprov runs
        in-process): a plan's one-line effect (Step.effect) shows it."""
        return None


@dataclass(frozen=True)
class Command(Action):
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # extra environment, printed as `K=V` before the command
    may_fail: bool = False  # its failure is not the step's (printed `|| true`): the next command repairs it
    stdout_to: str | None = None  # its standard output is written there by gpuprov, 0600 from the first byte
    result: bool = False  # its last output line is the step's result (the validation container's own line)

    @property
    def reports(self) -> bool:  # type: ignore[override]
        return self.result and not self.may_fail

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
        return effects.run(list(self.argv), check=False, env={**os.environ, **dict(self.env)},
                           private_stdout=self.stdout_to is not None)

    def execute(self) -> str:
        res = self.run()
        if res.returncode == 0 and self.stdout_to:
            write_file(self.stdout_to, res.stdout, mode=0o600, keep_mode=False, backup=False)
        if res.returncode == 0 or self.may_fail:
            return res.output
        raise effects.failed(self.shell(), res.returncode, res.output)


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
        current = under(root, self.path)
        try:
            old = read_bytes_bounded(current)
        except OSError:  # missing, or not a regular file: as read_or_empty says it
            old = b""
        new = self.content.encode(errors="surrogateescape")
        if is_binary(old) or is_binary(new):  # (uninstall's pass-through replaces the runtime's ELF: 8,352 lines)
            return binary_diff(self.path, current if old else None, new)
        return effects.unified_diff(old.decode(errors="replace"), self.content, self.path)

    def diffs(self, root: Path) -> dict[str, str]:
        return {self.path: self.diff(root)}

    def execute(self) -> str:
        write_file(self.path, self.content, mode=self.mode, backup=self.backup)
        return f"wrote {self.path}"


@dataclass(frozen=True)
class ReloadEngine(Action):
    """Make the running daemon that reads `config` read it again, the adapter's way (`Engine.apply`: dockerd gets
    SIGHUP, or a restart for `features`; containerd and CRI-O are restarted by their unit); nothing when no running
    daemon reads that file. dockerd without `restart` (uninstall): DockerEngine.reload_live, so that the live daemon
    also forgets the runtimes in `runtime_paths` and a default taken out of the file, with no restart."""
    engine: str
    config: str
    restart: bool
    runtime_paths: tuple[str, ...] = ()
    keeps: int = 0  # running containers a restart keeps by holding live-restore on for it (configure.restart_keeps)
    reports = True

    def lines(self) -> list[str]:
        eng = engines.get(self.engine)
        how = eng.apply_how(self.restart, self.keeps) if self.keeps else eng.apply_how(self.restart)
        out = [f"{how}: the running {eng.daemon_names[0]} that reads {self.config}, if any"]
        if self.runtime_paths and not self.restart and hasattr(eng, "reload_live"):
            out.append(f"  then ask it for its runtimes and default ({shlex.join(eng.live_argv)}, as often as it takes "
                       f"to see the change); where it still names a runtime at "
                       f"{', '.join(self.runtime_paths)} or a default the file no longer sets: write the file once "
                       "more with runtimes and default-runtime set to what remains, SIGHUP again, and write it "
                       "back as shown")
        return out

    def brief(self) -> str:
        return f"{_how(self.engine, self.restart)} where it runs"

    def execute(self) -> str:
        eng = engines.get(self.engine)
        daemon = eng.live_daemon(Path(self.config))
        if daemon is None:
            return f"no running {eng.daemon_names[0]} reads {self.config}"
        if self.runtime_paths and not self.restart and hasattr(eng, "reload_live"):
            return eng.reload_live(daemon, Path(self.config), self.runtime_paths)
        # --restart-engine consents to stopping containers, but where live-restore can be held on for the restart,
        # none is stopped (the run asks again: containers may have started or stopped since the plan)
        if self.restart and hasattr(eng, "restart_keeping") and restart_keeps(eng, daemon, "", consent=True):
            return eng.restart_keeping(daemon, Path(self.config))
        return eng.apply(daemon, EnginePlan([], [Change("undo", "", reload=not self.restart)]), restart=self.restart)


@dataclass(frozen=True)
class StartService(Action):
    """Start an engine's daemon and enable it at boot, then wait until its client answers (effects.start_daemon:
    `systemctl enable --now`, or without systemd the SysV script, then the daemon itself in the background). Printed
    from the same argvs it runs. Its fields come from the engine's adapter (unit, daemon, ready_argv)."""
    reports = True
    unit: str  # the systemd unit / SysV script
    daemon: str  # the binary for the last resort: dockerd | containerd
    ready: tuple[str, ...]  # the client command that answers once the daemon is up
    systemd: bool  # decided from the plan's root (/run/systemd/system)

    def commands(self) -> list[Command]:
        return [Command(a) for a in effects.daemon_start_argvs(self.unit, self.daemon, self.systemd)]

    def lines(self) -> list[str]:
        wait = f"then wait until `{shlex.join(self.ready)}` answers"
        if self.systemd:
            return [f"$ {self.commands()[0].shell()}", f"  ({wait})"]
        init, daemon = (c.shell() for c in self.commands())
        return [f"$ {init}", f"  (if that fails or is missing: `{daemon}` in the background, log "
                f"{effects.daemon_log(self.daemon)}; {wait})"]

    def execute(self) -> str:
        return f"started {self.daemon}: {effects.start_daemon(self.unit, self.daemon, self.ready, self.systemd)}"


@dataclass(frozen=True)
class ImportImage(Action):
    """A local image built from this host's own files (no registry): the tar is made in-process, from the binaries
    named and the libraries `ldd` lists for them, and fed to the engine's import (its adapter's ImageImport: docker
    imports the root filesystem only when `docker image inspect` fails; containerd's ctr imports it as a one-layer
    OCI archive in gpuprov's namespace on every run, since ctr has no command that fails for a missing image and
    importing the same content again changes nothing)."""
    image: ImageImport
    binaries: tuple[str, ...]

    def commands(self) -> list[Command]:
        return [Command(a) for a in (self.image.present, self.image.load) if a]

    def lines(self) -> list[str]:
        what = f"{', '.join(self.binaries)} and their libraries, taken from this host"
        *present, load = (c.shell() for c in self.commands())
        test = f"{present[0]} >/dev/null || " if present else ""
        return [f"$ {test}{load} < <{self.image.describe()} of {what}>"]

    def execute(self) -> str:
        *present, load = self.commands()
        if present and present[0].run().returncode == 0:
            return ""
        effects.run(list(load.argv), input_text=self.image.stdin(self.binaries))
        return ""


@dataclass(frozen=True)
class InstallRuntime(Action):
    """gpuprov-runtime (its compiled front-end, else Python) and the --gpus hook in /usr/local/bin, and the discovery
    cache for the driver at `driver_root`: what `gpuprov runtime install --driver-root DIR` does, run in-process."""
    reports = True
    driver_root: str
    prefix: str = "/usr/local"
    own: str | None = None  # the engine's own front-end (Podman's), said here; installed wherever that engine is

    def lines(self) -> list[str]:
        own = [f"and {self.prefix}/bin/{self.own}, the engine's own: it wraps the OCI runtime the engine names (podman "
               "info: Host.OCIRuntime.Path), gpuprov-runtime the one dockerd and containerd use (runc, else crun)"]
        return [f"install gpuprov-runtime and the --gpus hook in {self.prefix}/bin and refresh the discovery cache "
                f"(driver root {self.driver_root}), as gpuprov runtime install --driver-root {self.driver_root} does",
                *(own if self.own else []),
                "load nvidia-uvm while the NVIDIA driver is loaded and make its missing device nodes, as "
                "nvidia-modprobe would (CUDA in containers needs /dev/nvidia-uvm)",
                "make /dev/char/MAJ:MIN links for NVIDIA's device nodes and install gpuprov-dev-char.service and "
                "the udev rule that make them at every boot (GPU containers keep their devices across "
                "systemctl daemon-reload)"]

    def brief(self) -> str:
        return f"installs gpuprov-runtime and the --gpus hook in {self.prefix}/bin"

    def execute(self) -> str:
        doc, _ = runtime_host.install(self.prefix, driver_root=self.driver_root)
        kind = f"compiled front-end, {doc['front_end_origin']}" if doc["compiled"] else "Python front-end"
        changed = ", ".join(doc["changed"]) or "nothing"
        return "; ".join([f"installed {doc['runtime_path']} ({kind}); changed: {changed}",
                          *(f"note: {n}" for n in doc.get("notes", []))])


@dataclass(frozen=True)
class RefreshCdi(Action):
    """The CDI spec for the loaded driver in /etc/cdi and /var/run/cdi, and the units that refresh it at boot and on
    driver changes: what `gpuprov cdi refresh --install-units` does, run in-process."""
    reports = True
    driver_root: str

    def lines(self) -> list[str]:
        return [f"write the CDI spec of the driver at {self.driver_root} in {' and '.join(runtime_host.CDI_DIRS)} "
                "(rewritten only when the driver changed)",
                f"install and enable gpuprov-cdi-refresh.path and .service in {runtime_host.UNIT_DIR} (systemd), "
                "as gpuprov cdi refresh --install-units does"]

    def brief(self) -> str:
        return "writes the CDI spec and installs the units that refresh it"

    def execute(self) -> str:
        return "\n".join(runtime_host.refresh_cdi(self.driver_root, install_units=True))


@dataclass(frozen=True)
class ConfigureEngine(Action):
    """gpuprov's runtime merged into an engine's config by its adapter (engines/configure.py: backup, atomic write,
    the engine's own check with a roll-back, the live daemon reloaded or restarted only when it reads that file,
    then asked whether it lists the runtime): what `gpuprov engine configure ENGINE …` does, run in-process. The
    diff printed is the adapter's plan (`edits`), the same FileEdits configure writes."""
    reports = True
    engine: str
    runtime_name: str
    runtime_path: str
    default: bool
    cdi: bool
    replace: bool = False
    config: str | None = None  # the config the engine really reads, where it is not the engine's default
    restart_engine: bool = False  # --restart-engine: a restart that stops running containers is consented to
    options: tuple[tuple[str, str], ...] = ()  # --engine-option: the operator's daemon.json keys, merged too
    # how the run will make the live daemon read the file, as the plan decided it on this host (plan/build.py:
    # restart_how): "" where nothing says more than the file's keys do (a --root tree, no restart pending)
    how: str = ""

    def apply_words(self) -> str:
        eng = engines.get(self.engine)
        return self.how or eng.apply_how(bool(self.start_only))

    def request(self) -> RuntimeRequest:
        return RuntimeRequest(self.runtime_name, self.runtime_path, default=self.default, cdi=self.cdi,
                              replace=self.replace, options=self.options)

    @property
    def start_only(self) -> tuple[str, ...]:
        """What it may set that dockerd reads only at start (features.cdi, an --engine-option key it does not
        reload): setting it restarts the daemon."""
        reloadable = engines.get(self.engine).reloadable_keys
        keys = tuple(k for k, _ in self.options if k not in reloadable)
        return (("features.cdi",) if self.cdi else ()) + keys

    def restart_reasons(self, daemon) -> list[str]:
        """Why this step will restart `daemon` (the live daemon that reads its config): dockerd looks for the --gpus
        hook only at start (one newer than it, or the one runtime.install puts in before this step), and reads
        `features` and most --engine-option keys only at start. The plan's note and check mode's stop say these."""
        eng = engines.get(self.engine)
        why = []
        pending = eng.pending_restart(daemon, installing=True)
        if pending:
            why.append(pending)
        if self.start_only:
            path = eng.config_path(self.config, self.request())
            try:
                if eng.plan(path, self.request()).needs_restart:
                    why.append(f"{eng.daemon_names[0]} reads {', '.join(self.start_only)} only when it starts")
            except GpuprovError:  # a conflict or a bad file: the step itself stops on it, with its own line
                pass
        return why

    def check_restart(self) -> None:
        """Check mode on the live host: the exit 14 the real run stops with, before writing anything, where this
        step's restart would stop running containers (live-restore off) and --restart-engine was not given."""
        eng = engines.get(self.engine)
        if self.restart_engine or not eng.restart_stops_containers:
            return
        daemon = eng.live_daemon(eng.config_path(self.config, self.request()))
        why = self.restart_reasons(daemon) if daemon else []
        if why:
            refuse_stopping_restart(eng, daemon, "; ".join(why))

    def edits(self, root: Path) -> list[FileEdit]:
        """The adapter's plan against the config under `root`: host paths, and what would be written names host
        paths too (containerd's `imports` entry), never `root`."""
        eng = engines.get(self.engine)
        host = eng.config_path(self.config, self.request())
        plan = eng.plan(host, self.request(), unit_root=root) if is_live(root) else \
            eng.plan_under(root, host, self.request())
        return [e for e in plan.edits if e.changed]

    def diffs(self, root: Path) -> dict[str, str]:
        return {str(e.path): e.diff() for e in self.edits(root)}

    def lines(self) -> list[str]:
        eng = engines.get(self.engine)
        path = eng.config_path(self.config, self.request())
        return [f"merge runtime {self.runtime_name!r} ({self.runtime_path}) into {path}"
                + (" as the default runtime" if self.default else "") + (", CDI on" if self.cdi else "")
                + (f", and set {', '.join(k for k, _ in self.options)}" if self.options else "")
                + " (the diff below; atomic write with a backup, the engine's own check, rolled back if it fails)",
                f"then {self.apply_words()}: the running {eng.daemon} that reads {path}, if any, and "
                f"check that it has runtime {self.runtime_name!r}"] + (  # (docker reads `features`, most keys at start)
            [f"first, put live-restore back as {path} had it (a run was stopped while it held it on for a restart)"]
            if eng.held(path) else [])

    def brief(self) -> str:
        return f"then {self.apply_words().split(' (')[0]} where it runs"

    def execute(self) -> str:
        res = configure(self.engine, config=self.config, runtime_name=self.runtime_name,
                        runtime_path=self.runtime_path, default=self.default, cdi=self.cdi, replace=self.replace,
                        restart_engine=self.restart_engine, options=self.options)
        return res.summary()


@dataclass(frozen=True)
class StopSharing(Action):
    """Stop the MPS control daemon cleanly (running clients finish first) and remove its state: what `gpuprov share
    disable` does, run in-process."""
    reports = True

    def lines(self) -> list[str]:
        return ["stop the MPS control daemon (running clients finish first) and remove its state, as gpuprov share "
                "disable does"]

    def brief(self) -> str:
        return "stops the MPS control daemon"

    def execute(self) -> str:
        res = mps.disable(load_settings().share_state)
        return "GPU sharing off" + (f"; still running: {res['left_running']}" if res.get("left_running") else "")


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


def _how(engine: str, restart: bool) -> str:
    """How the engine's live daemon is made to read its config, in a few words: the adapter's apply_how without
    its reasons (`SIGHUP to dockerd`, `systemctl restart containerd`)."""
    return engines.get(engine).apply_how(restart).split(" (")[0]


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
class InGroup:
    """These users are members of this group (/etc/group under the root: its member list)."""
    group: str
    users: tuple[str, ...]

    def satisfied(self, root: Path) -> bool:
        return set(self.users) <= set(group_members(root, self.group) or ())

    def describe(self) -> str:
        return f"skipped when group {self.group} already lists {', '.join(self.users)} (/etc/group)"


def group_members(root: Path, group: str) -> list[str] | None:
    """The member list /etc/group gives `group` under `root`; None: no such group."""
    for line in read_or_empty(under(root, "/etc/group")).splitlines():
        parts = line.split(":")
        if len(parts) == 4 and parts[0] == group:
            return [u for u in parts[3].split(",") if u]
    return None


@dataclass(frozen=True)
class PackagesFinished:
    """No run of the package manager left anything part-way: its journal is empty and no package is half-installed,
    unpacked, half-configured or waiting on triggers (the adapter's `unfinished`)."""
    manager: str

    def satisfied(self, root: Path) -> bool:
        return not package_managers.get(self.manager).interrupted(root)

    def describe(self) -> str:
        return f"skipped when {package_managers.get(self.manager).database}'s last run finished: nothing is part-way"


@dataclass(frozen=True)
class Undone:
    """An undo already done: these files hold this content and these paths are gone (links not followed)."""
    files: tuple[tuple[str, str], ...] = ()  # (path, content)
    gone: tuple[str, ...] = ()

    def satisfied(self, root: Path) -> bool:
        return FilesMatch(self.files).satisfied(root) and not any(os.path.lexists(under(root, p)) for p in self.gone)

    def describe(self) -> str:
        parts = ([f"{', '.join(p for p, _ in self.files)} {'hold' if len(self.files) > 1 else 'holds'} this "
                  "content"] if self.files else []) \
            + ([f"{', '.join(self.gone)} {'are' if len(self.gone) > 1 else 'is'} gone"] if self.gone else [])
        return "skipped when " + " and ".join(parts)


@dataclass(frozen=True)
class PackagesInstalled:
    manager: str  # apt | dnf | yum
    packages: tuple[str, ...]

    def satisfied(self, root: Path) -> bool:
        return packages_installed(self.manager, self.packages, root)

    def describe(self) -> str:
        db = package_managers.get(self.manager).database
        return f"skipped when {db} lists {' '.join(self.packages) or 'nothing'} as installed"


@dataclass(frozen=True)
class RuntimeInstalled:
    driver_root: str

    def satisfied(self, root: Path) -> bool:

        return is_live(root) and install.is_installed(self.driver_root, front_ends=engines.front_ends())

    def describe(self) -> str:
        return "skipped when gpuprov-runtime is installed from these sources with these settings"


@dataclass(frozen=True)
class EngineConfigured:
    """The engine's config already holds the runtime (its adapter's merge changes nothing) and, for an engine that
    lists its runtimes (dockerd), the live daemon lists it."""
    action: ConfigureEngine

    def satisfied(self, root: Path) -> bool:
        if not is_live(root) or self.action.edits(root):
            return False
        eng = engines.get(self.action.engine)
        if eng.held(eng.config_path(self.action.config, self.action.request())):
            return False  # a killed run's live-restore still to put back
        return not eng.lists_runtimes or self.action.runtime_name in (eng.listed_runtimes() or [])

    def describe(self) -> str:
        eng = engines.get(self.action.engine)
        return (f"skipped when {self.action.engine}'s config already registers {self.action.runtime_name!r}"
                + (f" and {eng.daemon} lists it" if eng.lists_runtimes else ""))


@dataclass(frozen=True)
class ServiceAnswers:
    ready: tuple[str, ...]  # the engine's client command (its adapter's ready_argv)

    def satisfied(self, root: Path) -> bool:
        return is_live(root) and effects.daemon_answers(self.ready)

    def describe(self) -> str:
        return f"skipped when `{shlex.join(self.ready)}` answers"


Check = Union[Never, Already, FilesMatch, PathExists, PackagesFinished, PackagesInstalled, RuntimeInstalled,
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
        return {p: d for a in self.actions for p, d in a.diffs(root).items()}

    def satisfied(self, root: Path = LIVE) -> bool:
        return self.check.satisfied(root)

    def apply(self) -> str | None:
        """Run the actions in order; the step's result in words (what each action that `reports` returned, its
        notes), never a tool's own output (that goes to the run's log)."""
        outs: list[str] = []
        ran: list[Command] = []
        for a in self.actions:
            try:
                out = a.execute()
            except GpuprovError as exc:
                if self.hint:
                    raise type(exc)(f"{exc}; {self.hint}", exit_code=exc.exit_code) from None
                raise
            last = [ln for ln in (out or "").strip().splitlines() if ln.strip()]
            if last and a.reports:
                outs.append(last[-1].strip())
            elif isinstance(a, Command):
                ran.append(a)
        if not outs and ran:  # only commands, whose output is the log's: say which ran
            outs.append("ran " + "; ".join(f"`{shlex.join(c.argv)}`" for c in ran))
        detail = "; ".join(outs + self.shown_notes())
        return detail or None

    def effect(self, diffs: dict[str, str] | None = None) -> str:
        """What the step does, in one line: the programs it runs, the files it changes (by lines; a binary one by
        name), what it does in-process, the exit codes it may stop with. `diffs`: its diffs (to_dict's), for the
        lines; without them the files are only named. The commands and diffs themselves are -v's and --json's."""
        parts = []
        if self.commands:
            programs = dict.fromkeys(os.path.basename(c.argv[0]) for c in self.commands if c.argv)
            parts.append(f"runs {_counted(len(self.commands), 'command')} ({', '.join(programs)})")
        for path, diff in (diffs if diffs is not None else dict.fromkeys(self.files, None)).items():
            if diff is None:
                parts.append(f"writes {path}")
            elif diff.startswith("Binary file "):
                parts.append(f"replaces {path} (binary)")
            elif diff:
                lines = diff.splitlines()
                added = sum(ln.startswith("+") and not ln.startswith("+++") for ln in lines)
                removed = sum(ln.startswith("-") and not ln.startswith("---") for ln in lines)
                parts.append(f"creates {path} ({_counted(added, 'line')})" if "\n@@ -0,0 " in diff else
                             f"changes {path} (+{added} -{removed} lines)")
        parts += [b for a in self.actions if (b := a.brief())]
        if self.on_failure:
            parts.append(f"{len(self.on_failure)} more {'command' if len(self.on_failure) == 1 else 'commands'} "
                         "only to roll back a failure")
        codes = sorted({int(c) for ln in self.lines() if not ln.lstrip().startswith("$ ")
                        for c in re.findall(r"\bexit (\d+)", ln)})
        if codes:
            said = [str(c) for c in codes]
            parts.append("may stop with exit " + (f"{', '.join(said[:-1])} or {said[-1]}" if len(said) > 1 else
                                                  said[0]))
        return "; ".join(parts) or "done by gpuprov itself (-v: how)"

    def to_dict(self, root: Path = LIVE, diffs: bool = True) -> dict:
        d = {"id": self.id, "title": self.title, "commands": [c.shell() for c in self.commands],
             "on_failure": [c.shell() for c in self.on_failure], "actions": [ln for ln in self.lines()],
             "files": sorted(self.files), "check": self.check.describe(),
             "reboot": self.reboot, "verify_only": self.verify_only, "notes": self.shown_notes()}
        if diffs:
            d["diffs"] = self.diffs(root)
        d["effect"] = self.effect(d.get("diffs"))
        return d


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def executed_argvs(step: Step) -> list[tuple[str, ...]]:
    """Every argv the step may run, in order: what a test compares with what apply really ran."""
    return [c.argv for c in step.commands]


def is_binary(data: bytes) -> bool:
    """Not text a person can read line by line: a NUL in its first 8 KiB (diff's and git's rule), or not UTF-8."""
    if b"\0" in data[:8192]:
        return True
    try:
        data.decode()
    except UnicodeDecodeError:
        return True
    return False


def binary_diff(path: str, current: Path | None, new: bytes) -> str:
    """A binary file's change as the plan shows it: named with its size and SHA-256 before and after, never diffed
    (a diff of an executable is thousands of lines nobody can read). `current`: the file under the plan's root,
    hashed whole (in 1 MiB reads); None where there is none."""
    import hashlib  # lazy: 1.5 ms (-X importtime); only a plan that replaces a binary file needs it

    def said(size: int, digest: str) -> str:
        return f"{size} bytes, sha256 {digest}"

    before = "none"
    if current is not None:
        h, size = hashlib.sha256(), 0
        try:  # opened as facts are (non-blocking, regular files only): a FIFO swapped in never hangs a plan
            fd = os.open(current, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                    raise OSError("not a regular file")
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
                    size += len(chunk)
            before = said(size, h.hexdigest())
        except OSError as exc:
            before = f"unreadable ({exc.strerror or exc})"
    return (f"Binary file {path}: not diffed\n  current: {before}\n"
            f"  gpuprov: {said(len(new), hashlib.sha256(new).hexdigest())}\n")


def read_or_empty(path: Path | str, limit: int = MAX_READ) -> str:
    """A file under the plan's root, or "" when it is missing or not a regular file. Read as facts are (bounded,
    regular files only, non-blocking open): a FIFO or device node in a `--root` tree never hangs a plan."""
    try:
        return read_text_file(path, limit)
    except OSError:
        return ""


def packages_installed(pm: str, packages: tuple[str, ...], root: Path = LIVE) -> bool:
    """All packages installed, by the package database under `root` (one fast query; reads only)."""
    return package_managers.get(pm).installed(packages, root)
