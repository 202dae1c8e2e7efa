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
from provision.plan.driver import versionlock_list
from provision.plan.packages import ALLOW_REMOVE, PackageInstall, installed_versions, removals
from provision.plan.steps import Action, Command, Step, read_or_empty

MANAGERS = ("dnf", "yum")
PLUGIN = {"dnf": "python3-dnf-plugin-versionlock", "yum": "yum-plugin-versionlock"}
# rpm lists each imported signing key as a `gpg-pubkey` package: a key is trust the repository's step set up, not a
# package of gpuprov's to purge (and every key has that one name).
NOT_PACKAGES = ("gpg-pubkey",)
# Only the named packages and what depends on them: never dependencies dnf finds unused (see the module's text).
NO_AUTOREMOVE = "--setopt=clean_requirements_on_remove=0"


def locked_names(root: Path, manager: str) -> list[str]:
    """The package names in the versionlock list under `root` (entries `[!]NAME-[EPOCH:]VERSION-RELEASE.ARCH`)."""
    out = []
    for line in read_or_empty(under(root, versionlock_list(manager))).splitlines():
        m = re.match(r"^!?(?:\d+:)?(.+?)-(?:\d+:)?[^-]+-[^-]+$", line.strip())
        if m and not line.lstrip().startswith("#"):
            out.append(m.group(1))
    return list(dict.fromkeys(out))


@dataclass
class InstallWatch:
    """Per stage, the packages the steps' transactions added on an rpm host: rpm's database read before and after
    each step that installs with dnf/yum (one query each, ~50 ms), the names new to it kept. Kept even when the step
    fails after an install (a later action of it failed): what got installed is gpuprov's either way."""
    added: dict[str, list[str]] = field(default_factory=dict)

    @contextmanager
    def step(self, step: Step):
        pm = next((a.manager for a in step.actions if isinstance(a, PackageInstall) and a.manager in MANAGERS), None)
        if pm is None:
            yield
            return
        before = installed_versions(pm)
        try:
            yield
        finally:
            new = [p for p in installed_versions(pm) if p not in before and p not in NOT_PACKAGES]
            stage = getattr(step.stage, "value", step.stage)
            self.added[stage] = list(dict.fromkeys([*self.added.get(stage, []), *new]))


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
        """The dry run: dnf answers `--assumeno` with its transaction and "Operation aborted." (exit 1); any other
        failure is the package manager's own (a package it cannot find), reported as it says it."""
        sim = self.simulate()
        res = sim.run()
        if res.returncode != 0 and "Operation aborted" not in res.output:
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
