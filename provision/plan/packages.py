"""Package installs as steps: the commands that install packages (apt, dnf/yum, or an offline bundle's repository
alone) and the step that runs them with its check. Shared by the engine's and the driver's steps.

No install removes a package by accident (a Docker CE host asked for Debian's docker.io would lose docker-ce and
containerd.io to apt's conflict resolution): every install is a `PackageInstall`, which first asks the package
manager what the transaction would do (`apt-get -s install`, `dnf/yum install --assumeno`) and stops with exit 14,
naming the packages, when it would remove any; the install itself then runs in a form that cannot remove either
(apt-get's `--no-remove`; dnf erases nothing without `--allowerasing`). `--allow-remove` lifts both."""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from provision import package_managers, paths
from provision.decide.targets import Target
from provision.errors import RemovalRefused
from provision.facts.rootfs import under
from provision.options import Stage
from provision.package_managers.base import PackageManager
from provision.plan import pkgconfig, repos
from provision.plan.steps import Action, Command, PackagesInstalled, Step, WriteFile, read_or_empty

BUNDLE_STATE = paths.BUNDLE_APT  # a bundle's own package-manager state (apt's sources list and lists)
ALLOW_REMOVE = "--allow-remove"  # the bootstrap option that lets an install remove packages


@dataclass(frozen=True)
class PackageInstall(Action):
    """One install transaction: its dry run (the package manager's own answer: what it would remove), then the
    install in a form that cannot remove. Printed from the same two Commands it runs; the package manager's adapter
    (provision/package_managers) says how each looks."""
    reports = True
    manager: str  # apt | dnf | yum: package_managers.get's name
    packages: tuple[str, ...]
    opts: tuple[str, ...] = ()  # options before the verb: apt's `-o …` for a bundle, dnf's repository options
    verb: tuple[str, ...] = ("install",)  # ("module", "install") for a dnf module stream
    allow_remove: bool = False
    # Packages this very transaction removes on purpose (apt's `NAME-`: the old series of a driver branch change the
    # operator asked for with --driver; dnf: the other flavour's kmod a module stream switch replaces): such an
    # install is guarded by its dry run alone, which goes ahead only when it removes nothing else.
    remove: tuple[str, ...] = ()
    # What the step did before this install and keeps when the dry run refuses it (a repository file written
    # disabled): a refusal says so instead of "nothing was changed".
    kept_before: str = ""

    @property
    def pm(self) -> PackageManager:
        return package_managers.get(self.manager)

    def _simulate(self) -> Command:
        return Command(self.pm.simulate_install(self.packages, self.opts, self.verb, self.remove), self.pm.env)

    def install(self) -> Command:
        return Command(self.pm.install(self.packages, self.opts, self.verb, self.allow_remove, self.remove),
                       self.pm.env)

    def commands(self) -> list[Command]:
        return [self._simulate(), self.install()]

    def lines(self) -> list[str]:
        sim, inst = self.commands()
        return [f"$ {sim.shell()}",
                "  (" + ("lists what the install would remove: with --allow-remove it goes ahead" if self.allow_remove
                         else "stops here with exit 14 when the install would remove any package"
                         + (f" but {', '.join(self.remove)}" if self.remove else "")) + ")",
                *inst.lines()]

    def check_removals(self) -> None:
        """The dry run; RemovalRefused (14) when it would remove anything and removal was not allowed. A dry run that
        fails says nothing about removals: the install then fails with the package manager's own message."""
        sim = self._simulate()
        res = sim.run()
        gone = [p for p in self.pm.removals(res.output) if p not in self.remove]
        if gone and not self.allow_remove:
            raise RemovalRefused(
                f"installing {' '.join(self.packages)} would remove installed packages: {', '.join(gone)} "
                f"(`{sim.shell()}` says so); gpuprov removes nothing it did not install. Keep them (an engine found "
                f"on the host is kept when --engine-source is auto), or pass {ALLOW_REMOVE} to let "
                f"{self.manager} remove them; "
                + (f"no package was changed ({self.kept_before})" if self.kept_before
                   else "nothing was changed by this step"))

    def execute(self) -> str:
        self.check_removals()
        before = self.pm.versions()
        self.install().execute()
        return package_changes(before, self.pm.versions(), self.packages)


@dataclass(frozen=True)
class RemovalGuard(Action):
    """The dry run of a recovery command that removes packages on purpose (the recover step's `dnf remove
    --duplicates`: rpm's older duplicates), run before it: RemovalRefused (14), naming them, when it would remove any
    other package (one that needs an older duplicate, which dnf could otherwise take along). A dry run that fails says
    nothing about removals: the command then fails with the package manager's own message."""
    manager: str
    dry_run: tuple[str, ...]
    removes: tuple[str, ...]  # the names it removes on purpose

    def _command(self) -> Command:
        return Command(self.dry_run, package_managers.get(self.manager).env)

    def commands(self) -> list[Command]:
        return [self._command()]

    def lines(self) -> list[str]:
        return [f"$ {self._command().shell()}",
                f"  (stops here with exit 14 when it would remove any package but {', '.join(self.removes)})"]

    def check_removals(self) -> None:
        sim = self._command()
        res = sim.run()
        gone = [p for p in package_managers.get(self.manager).removals(res.output) if p not in self.removes]
        if gone:
            raise RemovalRefused(
                f"finishing what a killed {self.manager} run left would remove installed packages: {', '.join(gone)} "
                f"(`{sim.shell()}` says so: they need a version the killed run replaced); gpuprov removes nothing but "
                f"the older duplicates. Finish that run by hand (`{self.manager} check` names what is left), or pass "
                f"{ALLOW_REMOVE} to let {self.manager} remove them; nothing was changed by this step")

    def execute(self) -> None:
        self.check_removals()
        return None


def package_changes(before: dict[str, str], after: dict[str, str], asked: tuple[str, ...] = ()) -> str:
    """An install's result in words, from the package database before and after it: `installed docker.io
    20.10.24+dfsg1-1+b3 and 9 dependencies (containerd, runc, …); nothing removed`."""
    names = [re.split(r"[=:]", p)[0].rstrip("-") for p in asked]
    new = [p for p in after if p not in before]
    changed = [p for p in after if p in before and before[p] != after[p]]
    gone = sorted(p for p in before if p not in after)
    main = [p for p in names if p in new]
    deps = [p for p in new if p not in main]
    parts = []
    if main or deps:
        said = ", ".join(f"{p} {after[p]}" for p in main) or f"{len(deps)} package(s)"
        more = f" and {len(deps)} dependencies ({_some(deps)})" if main and deps else \
            (f" ({_some(deps)})" if not main else "")
        parts.append(f"installed {said}{more}")
    if changed:
        parts.append("upgraded " + ", ".join(f"{p} {before[p]} -> {after[p]}" for p in changed[:5])
                     + (f" and {len(changed) - 5} more" if len(changed) > 5 else ""))
    if not parts:
        parts.append("nothing installed (all of it was already there)")
    parts.append(f"removed {_some(gone, 10)}" if gone else "nothing removed")
    return "; ".join(parts)


def _some(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (", …" if len(names) > n else "")


@dataclass(frozen=True)
class RepoInstalled:
    """The release package that defines a repository is installed and, behind `--mirror`, its repository file
    points at the mirror (repos.mirror_setopts)."""
    manager: str
    package: str
    repo_file: str
    mirror: str | None = None  # the base URL the file must name; None: upstream's, as the package wrote it

    def satisfied(self, root: Path) -> bool:
        if not PackagesInstalled(self.manager, (self.package,)).satisfied(root):
            return False
        return self.mirror is None or self.mirror in read_or_empty(under(root, self.repo_file))

    def describe(self) -> str:
        return (f"skipped when rpm lists {self.package} as installed"
                + (f" and {self.repo_file} names {self.mirror}" if self.mirror else ""))


@dataclass(frozen=True)
class StreamsEnabled:
    """A check and, besides it, the module streams `specs` (NAME:STREAM) enabled (dnf's state under the root)."""
    check: object
    specs: tuple[str, ...]
    manager: str = "dnf"

    def satisfied(self, root: Path) -> bool:
        pm = package_managers.get(self.manager)
        return self.check.satisfied(root) and not pm.streams_to_switch(root, self.specs) and all(
            s.split(":")[0] in pm.enabled_streams(root) for s in self.specs)

    def describe(self) -> str:
        return f"{self.check.describe()}, with module stream {', '.join(self.specs)} enabled"


@dataclass(frozen=True)
class StreamsReset:
    """A check and, besides it, none of the modules `modules` has a stream enabled (dnf's state under the root)."""
    check: object
    modules: tuple[str, ...]
    manager: str = "dnf"

    def satisfied(self, root: Path) -> bool:
        pm = package_managers.get(self.manager)
        return self.check.satisfied(root) and not set(self.modules) & pm.enabled_streams(root).keys()

    def describe(self) -> str:
        return f"{self.check.describe()}, and no stream of {', '.join(self.modules)} enabled"


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
    """Per stage, the packages the steps' transactions added, dependencies included: the package manager's database
    read before and after each step that installs with it (one query each, ~50 ms), the names new to it kept. Kept
    even when the step fails after an install (a later action of it failed): what got installed is gpuprov's either
    way. Likewise the modules whose stream a step enabled where
    none was enabled before it (`streams`, module-stream managers): uninstall resets those."""
    added: dict[str, list[str]] = field(default_factory=dict)
    streams: list[str] = field(default_factory=list)

    @contextmanager
    def step(self, step: Step):
        """Also, for every manager, what the step changed of its configuration (plan/pkgconfig.py) and the packages
        its transactions added (apt's dependencies too: Ubuntu's precompiled modules of each kernel, issue 43)."""
        with pkgconfig.watched(getattr(step.stage, "value", step.stage), pkgconfig.host_manager()), \
                self._installs(step):
            yield

    @contextmanager
    def _installs(self, step: Step):
        pm = next((a.pm for a in step.actions if isinstance(getattr(a, "pm", None), PackageManager)), None)
        # Dependencies are recorded where the package manager's removal takes them along (dnf/yum:
        # records_dependencies) and for the driver everywhere (apt: Ubuntu's metapackages pull each kernel's module
        # packages, issue 43). An apt engine's dependencies (iptables, netbase, runc…) stay apt's to auto-remove, as
        # `apt-get purge docker.io` leaves them: a purge of netbase or iptables reaches past the engine.
        if pm is not None and not pm.records_dependencies and getattr(step.stage, "value", step.stage) != Stage.DRIVER:
            pm = None
        if pm is None:
            yield
            return
        before = pm.snapshot()
        on = pm.enabled_streams(Path("/")) if pm.module_streams else {}
        try:
            yield
        finally:
            new = pm.added(before, pm.snapshot())
            stage = getattr(step.stage, "value", step.stage)
            self.added[stage] = list(dict.fromkeys([*self.added.get(stage, []), *new]))
            if pm.module_streams:
                self.streams += [m for m in pm.enabled_streams(Path("/")) if m not in on and m not in self.streams]


def mirror_commands(name: str, target: Target, mirrors) -> tuple[Command, ...]:
    """The repository `name` pointed at its mirror, saved into its repository file; () without a mirror."""
    opts = repos.mirror_setopts(name, target, mirrors)
    pm = package_managers.get(target.package_manager)
    return (Command((*pm.config_manager(), "--save", *opts)),) if opts else ()


def install_actions(target: Target, packages: tuple[str, ...], bundle: str | None = None,
                    allow_remove: bool = False, opts: tuple[str, ...] = (), kept_before: str = "",
                    switch: tuple[str, ...] = (), swap: tuple[str, ...] = (), verb: tuple[str, ...] = ()) -> list:
    """The commands that install `packages`: a manager with lists refreshes them first (each package step, so a
    step that runs alone after an earlier run never installs from stale lists); with a bundle, the package manager
    sees the bundle alone (one transaction). Module streams (NAME:STREAM) install one each; `switch`: those whose
    module has another stream enabled (a branch change); `swap`: what a switch replaces in its own transaction (the
    other flavour's kmod: the dnf adapter's stream_swaps)."""
    pm = package_managers.get(target.package_manager)
    pre: list = []
    if bundle:
        state = Path(BUNDLE_STATE)
        opts = pm.bundle_options(Path(bundle), state)
        pre = [*(Command(("install", "-d", "-m", "0755", d)) for d in pm.bundle_dirs(state)),
               *(WriteFile(path, content) for path, content in pm.bundle_files(Path(bundle), state))]
    if not packages:
        return pre
    refresh = pm.refresh(opts)
    acts: list = [*pre, *([Command(refresh, pm.env)] if refresh else [])]
    streams = tuple(p for p in packages if ":" in p) if pm.module_streams and not bundle else ()
    plain = tuple(p for p in packages if p not in streams)
    acts += [PackageInstall(pm.name, plain, opts, verb=verb or ("install",), allow_remove=allow_remove,
                            kept_before=kept_before)] if plain else []
    for spec in streams:
        o, verb = pm.stream_install(spec, opts, switch=spec in switch)
        acts.append(PackageInstall(pm.name, (spec,), o, verb=verb, allow_remove=allow_remove,
                                   remove=swap if spec in switch else (), kept_before=kept_before))
    return acts


def package_step(sid: str, stage: Stage, title: str, target: Target, packages: tuple[str, ...],
                 pre: tuple[Command, ...] = (), bundle: str | None = None, check=None, allow_remove: bool = False,
                 opts: tuple[str, ...] = (), post: tuple[Action, ...] = (), kept_before: str = "",
                 switch: tuple[str, ...] = (), swap: tuple[str, ...] = (), verb: tuple[str, ...] = (),
                 **kw) -> Step:
    """pre: what runs before the install (a repository added); verb: the plain packages' verb when not install (an
    adapter's upgrade_verb); opts: dnf's options for the install and its dry run
    (`--enablerepo`); post: what runs once the install succeeded. A bundle has none of the three. kept_before: what
    `pre` leaves when the install's dry run refuses it, in words (its exit 14 says so)."""
    hint = (f"a package may be missing from bundle {bundle}: rebuild it with `gpuprov bundle create`; nothing was "
            "fetched from the network") if bundle else None
    return Step(sid, stage, title, actions=(*([] if bundle else pre),
                                            *install_actions(target, packages, bundle, allow_remove,
                                                             () if bundle else opts,
                                                             "" if bundle else kept_before, switch, swap, verb),
                                            *([] if bundle else post)),
                check=check or PackagesInstalled(target.package_manager, packages), hint=hint, **kw)

