"""Package installs as steps: the commands that install packages (apt, dnf/yum, or an offline bundle's repository
alone) and the step that runs them with its check. Shared by the engine's and the driver's steps.

No install removes a package by accident (a Docker CE host asked for Debian's docker.io would lose docker-ce and
containerd.io to apt's conflict resolution): every install is a `PackageInstall`, which first asks the package
manager what the transaction would do (`apt-get -s install`, `dnf/yum install --assumeno`) and stops with exit 14,
naming the packages, when it would remove any; the install itself then runs in a form that cannot remove either
(apt-get's `--no-remove`; dnf erases nothing without `--allowerasing`). `--allow-remove` lifts both."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from provision import effects, paths
from provision.decide.targets import Target
from provision.errors import RemovalRefused
from provision.facts.rootfs import under
from provision.options import Stage
from provision.plan import repos
from provision.plan.steps import Action, Command, PackagesInstalled, Step, WriteFile, read_or_empty

APT_ENV = (("DEBIAN_FRONTEND", "noninteractive"), ("NEEDRESTART_MODE", "a"))
BUNDLE_APT = paths.BUNDLE_APT
ALLOW_REMOVE = "--allow-remove"  # the bootstrap option that lets an install remove packages


@dataclass(frozen=True)
class PackageInstall(Action):
    """One install transaction: its dry run (the package manager's own answer: what it would remove), then the
    install in a form that cannot remove. Printed from the same two Commands it runs."""
    reports = True
    manager: str  # apt | dnf | yum
    packages: tuple[str, ...]
    opts: tuple[str, ...] = ()  # options before the verb: apt's `-o …` for a bundle, dnf's repository options
    verb: tuple[str, ...] = ("install",)  # ("module", "install") for a dnf module stream
    allow_remove: bool = False
    env: tuple[tuple[str, str], ...] = ()
    # Packages this very transaction removes on purpose (apt's `NAME-`: the old series of a driver branch change the
    # operator asked for with --driver; dnf: the other flavour's kmod a module stream switch replaces, which dnf
    # erases only with --allowerasing, dry run included). apt's --no-remove aborts on those too, so such an install
    # is guarded by its dry run alone: it goes ahead only when the dry run removes nothing else.
    remove: tuple[str, ...] = ()
    # What the step did before this install and keeps when the dry run refuses it (a repository file written
    # disabled): a refusal says so instead of "nothing was changed".
    kept_before: str = ""

    def _args(self) -> tuple[str, ...]:
        return (*self.packages, *(f"{p}-" for p in self.remove))

    def _simulate(self) -> Command:
        if self.manager == "apt":
            return Command(("apt-get", *self.opts, "-s", *self.verb, "-y", "--no-install-recommends", *self._args()),
                           self.env)
        erase = ("--allowerasing",) if self.remove and self.manager == "dnf" else ()
        return Command((self.manager, *self.opts, *self.verb, "--assumeno", *erase, *self.packages), self.env)

    def install(self) -> Command:
        if self.manager == "apt":
            guard = () if self.allow_remove or self.remove else ("--no-remove",)
            return Command(("apt-get", *self.opts, *self.verb, "-y", "--no-install-recommends", *guard,
                            *self._args()), self.env)
        erase = ("--allowerasing",) if (self.allow_remove or self.remove) and self.manager == "dnf" else ()
        return Command((self.manager, *self.opts, *self.verb, "-y", *erase, *self.packages), self.env)

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
        gone = [p for p in removals(self.manager, res.output) if p not in self.remove]
        if gone and not self.allow_remove:
            raise RemovalRefused(
                f"installing {' '.join(self.packages)} would remove installed packages: {', '.join(gone)} "
                f"(`{sim.shell()}` says so); gpuprov removes nothing it did not install. Keep them (an engine found "
                f"on the host is kept when --engine-source is auto), or pass {ALLOW_REMOVE} to let "
                f"{'apt' if self.manager == 'apt' else self.manager} remove them; "
                + (f"no package was changed ({self.kept_before})" if self.kept_before
                   else "nothing was changed by this step"))

    def execute(self) -> str:
        self.check_removals()
        before = installed_versions(self.manager)
        self.install().execute()
        return package_changes(before, installed_versions(self.manager), self.packages)


def installed_versions(manager: str) -> dict[str, str]:
    """Every installed package and its version, from the package database (one query, ~50 ms): read before and
    after an install, so that its result says what it really changed."""
    argv = (["dpkg-query", "-W", "-f", "${Package} ${Version} ${db:Status-Abbrev}\n"] if manager == "apt"
            else ["rpm", "-qa", "--qf", "%{NAME} %{VERSION}-%{RELEASE} ii\n"])
    res = effects.try_run(argv, timeout=60, probe=True)
    out = {}
    for line in (res.output if res else "").splitlines():
        words = line.split()
        if len(words) >= 3 and words[2][1:2] == "i":  # dpkg's "ii"/"hi": installed (not just known or removed)
            out[words[0]] = words[1]
    return out


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


APT_REMV = re.compile(r"^Remv (\S+)", re.M)
# dnf 4 / yum: "Removing:", "Removing dependent packages:", "Removing for dependencies:", "Erasing:"; dnf 5:
# "Removing:", "Removing dependent packages:". Obsoleted packages show as "replacing  NAME.ARCH VERSION" lines.
DNF_REMOVE_SECTION = re.compile(r"^(Removing|Erasing)\b[^:]*:\s*$")


def removals(manager: str, output: str) -> list[str]:
    """The installed packages a dry run says the transaction removes (apt's `Remv NAME [VERSION]` lines; dnf/yum's
    Removing sections and `replacing` lines), in order, once each."""
    if manager == "apt":
        found = APT_REMV.findall(output)
    else:
        found, in_section, wrapped = [], False, False
        for line in output.splitlines():
            words = line.split()
            if DNF_REMOVE_SECTION.match(line):
                in_section = True
            elif not line.startswith(" ") or not words:
                in_section = False  # another section header, the summary, or the blank line after a table
            elif wrapped:
                pass  # the rest of a row whose name filled the column (arch, version, repository, size)
            elif words[0] == "replacing" and len(words) > 1:
                found.append(words[1].rsplit(".", 1)[0])
            elif in_section:
                found.append(words[0])
            # dnf puts a name wider than its column on a line of its own and the row's other fields on the next
            # (`python3-dnf-plugin-versionlock` beside an `@commandline` package): that next line names no package
            wrapped = in_section and len(words) == 1 and line.startswith(" ")
    return list(dict.fromkeys(found))


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


def mirror_commands(name: str, target: Target, mirrors) -> tuple[Command, ...]:
    """The repository `name` pointed at its mirror, saved into its repository file; () without a mirror."""
    opts = repos.mirror_setopts(name, target, mirrors)
    return (Command((*repos.config_manager(target.package_manager), "--save", *opts)),) if opts else ()


def install_actions(target: Target, packages: tuple[str, ...], bundle: str | None = None,
                    allow_remove: bool = False, opts: tuple[str, ...] = (), kept_before: str = "",
                    switch: tuple[str, ...] = (), swap: tuple[str, ...] = ()) -> list:
    """The commands that install `packages`: apt refreshes its lists first (each package step, so a step that runs
    alone after an earlier run never installs from stale lists); with a bundle, apt sees the bundle alone."""
    pm = target.package_manager
    if pm == "apt":
        opts: tuple[str, ...] = ()
        pre: list = []
        if bundle:
            opts = tuple(repos.apt_options(Path(bundle), Path(BUNDLE_APT)))
            pre = [Command(("install", "-d", "-m", "0755", f"{BUNDLE_APT}/lists/partial")),
                   WriteFile(f"{BUNDLE_APT}/bundle.list", repos.source_list(Path(bundle)))]
        if not packages:
            return pre
        return pre + [Command(("apt-get", *opts, "update"), APT_ENV),
                      PackageInstall("apt", packages, opts, allow_remove=allow_remove, env=APT_ENV)]
    if bundle:
        return [PackageInstall("dnf", packages, tuple(repos.dnf_bundle_options(bundle)), allow_remove=allow_remove)]
    mods = [p for p in packages if ":" in p]
    plain = tuple(p for p in packages if ":" not in p)
    acts: list = [PackageInstall(pm, plain, opts, allow_remove=allow_remove, kept_before=kept_before)] if plain else []
    # a stream switch (`switch`: a branch change) runs, dry run included, without the versionlock plugin: the old
    # branch's locks are gpuprov's own, and the hold step replaces them with the new branch's
    # `swap`: what a switch replaces in its own transaction (the other flavour's kmod, plan/dnf.py: flavour_swaps)
    acts += [PackageInstall(pm, (m,), (*opts, "--disableplugin=versionlock") if m in switch else opts,
                            verb=("module", "switch-to" if m in switch else "install"), allow_remove=allow_remove,
                            remove=swap if m in switch else (), kept_before=kept_before) for m in mods]
    return acts


def package_step(sid: str, stage: Stage, title: str, target: Target, packages: tuple[str, ...],
                 pre: tuple[Command, ...] = (), bundle: str | None = None, check=None, allow_remove: bool = False,
                 opts: tuple[str, ...] = (), post: tuple[Command, ...] = (), kept_before: str = "",
                 switch: tuple[str, ...] = (), swap: tuple[str, ...] = (), **kw) -> Step:
    """pre: what runs before the install (a repository added); opts: dnf's options for the install and its dry run
    (`--enablerepo`); post: what runs once the install succeeded. A bundle has none of the three. kept_before: what
    `pre` leaves when the install's dry run refuses it, in words (its exit 14 says so)."""
    hint = (f"a package may be missing from bundle {bundle}: rebuild it with `gpuprov bundle create`; nothing was "
            "fetched from the network") if bundle else None
    return Step(sid, stage, title, actions=(*([] if bundle else pre),
                                            *install_actions(target, packages, bundle, allow_remove,
                                                             () if bundle else opts,
                                                             "" if bundle else kept_before, switch, swap),
                                            *([] if bundle else post)),
                check=check or PackagesInstalled(target.package_manager, packages), hint=hint, **kw)

