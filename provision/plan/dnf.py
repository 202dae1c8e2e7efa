"""dnf (and yum, EL 7) as a package-manager adapter for what gpuprov installed: which packages a step's transactions
added (to record them), and their purge with its dry run first. The install side (PackageInstall, its dry run and
`--allowerasing`) is provision/plan/packages.py's, shared with apt; apt's purge is provision/plan/uninstall.py's.

What is recorded: every package a step's transactions added to rpm's database, dependencies included. dnf's `remove`
takes unused dependencies along (clean_requirements_on_remove, on by default on EL), so a record of the named
packages alone would let a purge remove dependencies the record does not name, or (with that option off) leave
gpuprov's dependencies behind: with the dependencies recorded, the purge names exactly what gpuprov installed and
runs with that option off, so what else it would remove is only what depends on them (a package the operator
installed since), which its dry run names."""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from provision import effects
from provision.errors import RemovalRefused
from provision.facts.rootfs import under
from provision.plan.packages import ALLOW_REMOVE, PackageInstall, installed_versions, removals
from provision.plan.steps import Action, Command, Step, read_or_empty

MANAGERS = ("dnf", "yum")
PLUGIN = {"dnf": "python3-dnf-plugin-versionlock", "yum": "yum-plugin-versionlock"}
# rpm lists each imported signing key as a `gpg-pubkey` package: a key is trust the repository's step set up, not a
# package of gpuprov's to purge (and every key has that one name).
NOT_PACKAGES = ("gpg-pubkey",)
# Only the named packages and what depends on them: never dependencies dnf finds unused (see the module's text).
NO_AUTOREMOVE = "--setopt=clean_requirements_on_remove=0"


def versionlock_list(manager: str) -> str:
    return "/etc/dnf/plugins/versionlock.list" if manager == "dnf" else "/etc/yum/pluginconf.d/versionlock.list"


LOCK_ENTRY = re.compile(r"^!?(?:\d+:)?(.+?)-(?:\d+:)?([^-]+)-[^-]+$")  # [!]NAME-[EPOCH:]VERSION-RELEASE.ARCH


def locks(root: Path, manager: str) -> list[tuple[str, str]]:
    """(name, version) of each entry of the versionlock list under `root`, in order."""
    out = []
    for line in read_or_empty(under(root, versionlock_list(manager))).splitlines():
        m = LOCK_ENTRY.match(line.strip())
        if m and not line.lstrip().startswith("#"):
            out.append((m.group(1), m.group(2)))
    return out


def locked_names(root: Path, manager: str) -> list[str]:
    return list(dict.fromkeys(n for n, _ in locks(root, manager)))


def rpm_versions(root: Path, names: tuple[str, ...]) -> dict[str, str]:
    """The installed VERSION of each of `names` that rpm's database under `root` lists."""
    res = effects.try_run(["rpm", "--root", str(root), "-q", "--qf", "%{NAME} %{VERSION}\n", *names], timeout=60,
                          probe=True)
    return dict(ln.split(" ", 1) for ln in (res.output if res else "").splitlines() if ln.count(" ") == 1)


def locks_current(root: Path, manager: str, names: tuple[str, ...]) -> bool:
    """Each of `names` is locked, and only at the version installed (after a stream switch the old branch's lock
    would keep the new packages from their updates within the branch, and hold nothing)."""
    have = locks(root, manager)
    installed = rpm_versions(root, names)
    return all(any(n == name for n, _ in have) and all(v == installed.get(name) for n, v in have if n == name)
               for name in names)


def enabled_streams(root: Path) -> dict[str, str]:
    """The module streams dnf has enabled under `root` (its /etc/dnf/modules.d/NAME.module state files)."""
    out = {}
    d = under(root, "/etc/dnf/modules.d")
    for f in sorted(d.glob("*.module")) if d.is_dir() else ():
        text = read_or_empty(f)
        state = re.search(r"^state\s*=\s*(\S+)", text, re.M)
        stream = re.search(r"^stream\s*=\s*(\S+)", text, re.M)
        if state and state.group(1) == "enabled" and stream:
            out[f.name[:-len(".module")]] = stream.group(1)
    return out


def streams_to_switch(root: Path, specs: tuple[str, ...]) -> tuple[str, ...]:
    """The `NAME:STREAM` specs whose module has another stream enabled: a branch change, `dnf module switch-to`."""
    on = enabled_streams(root)
    return tuple(s for s in specs if ":" in s and on.get(s.split(":")[0]) not in (None, s.split(":")[1]))


# NVIDIA's `nvidia-driver` module: a stream's kernel-module flavour is in its name (570-open and open-dkms: open;
# 570-dkms and latest-dkms: proprietary), and each flavour's kmod package conflicts with the other's, so a switch
# between flavours replaces one with the other (NVIDIA's guide: `dnf module switch-to nvidia-driver:S --allowerasing`).
DRIVER_MODULE = "nvidia-driver"
FLAVOUR_KMOD = {"open": "kmod-nvidia-open-dkms", "proprietary": "kmod-nvidia-latest-dkms"}


def stream_flavour(stream: str) -> str:
    return "open" if stream.endswith("-open") or stream == "open-dkms" else "proprietary"


def flavour_swaps(root: Path, switch: tuple[str, ...]) -> tuple[str, ...]:
    """The installed kmod packages of the other flavour that switching to the `switch` streams replaces: that one
    removal is the switch's own (in its transaction, beside the new flavour's kmod); its dry run refuses any other."""
    on = enabled_streams(root)
    old = [FLAVOUR_KMOD[stream_flavour(on[m])] for m, _, new in (s.partition(":") for s in switch)
           if m == DRIVER_MODULE and m in on and stream_flavour(on[m]) != stream_flavour(new)]
    return tuple(rpm_versions(root, tuple(old))) if old else ()


@dataclass(frozen=True)
class StreamsReset:
    """A check and, besides it, none of the modules `modules` has a stream enabled (dnf's state under the root)."""
    check: object
    modules: tuple[str, ...]

    def satisfied(self, root: Path) -> bool:
        return self.check.satisfied(root) and not set(self.modules) & enabled_streams(root).keys()

    def describe(self) -> str:
        return f"{self.check.describe()}, and no stream of {', '.join(self.modules)} enabled"


def stream_resets(root: Path, recorded: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The modules of the record's `streams` (those gpuprov enabled where none was) that still have a stream enabled:
    `uninstall --purge-driver` resets them after the purge. An operator's own enabled stream is never recorded."""
    on = enabled_streams(root)
    return tuple(m for m in recorded if m in on)


def reset_command(manager: str, modules: tuple[str, ...]) -> Command:
    return Command((manager, "module", "reset", "-y", *modules))


@dataclass(frozen=True)
class StreamsEnabled:
    """A check and, besides it, the module streams `specs` (NAME:STREAM) enabled (dnf's state under the root)."""
    check: object
    specs: tuple[str, ...]

    def satisfied(self, root: Path) -> bool:
        return self.check.satisfied(root) and not streams_to_switch(root, self.specs) and all(
            s.split(":")[0] in enabled_streams(root) for s in self.specs)

    def describe(self) -> str:
        return f"{self.check.describe()}, with module stream {', '.join(self.specs)} enabled"


@dataclass(frozen=True)
class ReposAt:
    """These repository files exist, each naming its mirror where one was given (path, base URL or None)."""
    files: tuple[tuple[str, str | None], ...]

    def satisfied(self, root: Path) -> bool:
        return all(under(root, f).is_file() and (m is None or m in read_or_empty(under(root, f)))
                   for f, m in self.files)

    def describe(self) -> str:
        return "skipped when " + " and ".join(f + (f" names {m}" if m else " exists") for f, m in self.files)


@dataclass
class InstallWatch:
    """Per stage, the packages the steps' transactions added on an rpm host: rpm's database read before and after
    each step that installs with dnf/yum (one query each, ~50 ms), the names new to it kept. Kept even when the step
    fails after an install (a later action of it failed): what got installed is gpuprov's either way. Likewise the
    modules whose stream a step enabled where none was enabled before it (`streams`): uninstall resets those."""
    added: dict[str, list[str]] = field(default_factory=dict)
    streams: list[str] = field(default_factory=list)

    @contextmanager
    def step(self, step: Step):
        pm = next((a.manager for a in step.actions if isinstance(a, PackageInstall) and a.manager in MANAGERS), None)
        if pm is None:
            yield
            return
        before, on = installed_versions(pm), enabled_streams(Path("/"))
        try:
            yield
        finally:
            new = [p for p in installed_versions(pm) if p not in before and p not in NOT_PACKAGES]
            stage = getattr(step.stage, "value", step.stage)
            self.added[stage] = list(dict.fromkeys([*self.added.get(stage, []), *new]))
            self.streams += [m for m in enabled_streams(Path("/")) if m not in on and m not in self.streams]


@dataclass(frozen=True)
class DnfPurge(Action):
    """`dnf remove` of the packages gpuprov installed (its record), after dnf's own dry run of that very removal:
    anything it would remove beyond them (a package installed since that requires one of them) stops the step with
    exit 14 naming it, unless --allow-remove. Their version locks go first (the dry run has changed nothing yet)."""
    manager: str  # dnf | yum
    packages: tuple[str, ...]
    unlock: tuple[str, ...]  # names whose versionlock entries are gpuprov's (`versionlock delete` matches by name)
    allow_remove: bool

    def simulate(self) -> Command:
        return Command((self.manager, "remove", "--assumeno", NO_AUTOREMOVE, *self.packages))

    def unlock_command(self) -> Command:
        return Command((self.manager, "versionlock", "delete", *self.unlock))

    def purge(self) -> Command:
        return Command((self.manager, "remove", "-y", NO_AUTOREMOVE, *self.packages))

    def commands(self) -> list[Command]:
        return [self.simulate(), *([self.unlock_command()] if self.unlock else []), self.purge()]

    def lines(self) -> list[str]:
        sim, *rest = self.commands()
        return [f"$ {sim.shell()}",
                "  (stop, nothing removed, where it would remove anything else"
                + (f"; {ALLOW_REMOVE} given: go on)" if self.allow_remove else f", unless {ALLOW_REMOVE})"),
                *(f"$ {c.shell()}" for c in rest)]

    def check(self) -> None:
        """The dry run: dnf answers `--assumeno` with its transaction and "Operation aborted." (yum: "Exiting on
        user command"), exit 1; any other failure is the package manager's own (a package it cannot find), reported
        as it says it."""
        sim = self.simulate()
        res = sim.run()
        if res.returncode != 0 and not any(w in res.output for w in ("Operation aborted", "Exiting on user command")):
            raise effects.failed(sim.shell(), res.returncode, res.output)
        extra = sorted(set(removals(self.manager, res.output)) - set(self.packages))
        if extra and not self.allow_remove:
            raise RemovalRefused(f"purging {' '.join(self.packages)} would also remove {' '.join(extra)}, which "
                                 f"gpuprov did not install (`{sim.shell()}` says so); nothing was removed (keep "
                                 f"them, or pass {ALLOW_REMOVE})")

    def execute(self) -> str:
        self.check()
        if self.unlock:
            self.unlock_command().execute()
        return self.purge().execute()


def purge_actions(root: Path, manager: str, packages: tuple[str, ...], holds: tuple[str, ...],
                  allow_remove: bool) -> tuple[list[Action], str]:
    """The purge of `packages` (installed, recorded) and the removal of gpuprov's locks on them and on `holds`; and a
    note for the step's title. The versionlock plugin gpuprov installed stays where the lock list keeps entries that
    are not gpuprov's (the operator's own locks would stop holding without it)."""
    locked = locked_names(root, manager)
    ours = set(packages) | set(holds)
    unlock = tuple(n for n in locked if n in ours)
    note = ""
    if PLUGIN[manager] in packages and any(n not in ours for n in locked):
        packages = tuple(p for p in packages if p != PLUGIN[manager])
        note = f" ({PLUGIN[manager]} kept: the versionlock list holds locks that are not gpuprov's)"
    return ([DnfPurge(manager, packages, unlock, allow_remove)] if packages else []), note
