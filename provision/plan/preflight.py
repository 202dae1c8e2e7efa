"""The preflight: the questions that can stop a run, asked before its first change (issue 39 item 2, issue 43 item 4).

A run used to learn that ELRepo offers no build for the boot kernel's minor release (exit 4), or that a package's
dependency is missing from the mirror (exit 5), in its driver step, after its first steps had added ELRepo or edited
sources.list and written the nouveau blacklist. The preflight asks the package manager the same questions first, in a
scratch configuration: the host's repositories plus those the plan adds, in a private temporary directory
(the package-manager adapter's `scratch_*`: apt's sources, preferences, lists and cache pointed there; dnf's reposdir
and a scratch rpm root holding the keys and release packages). It walks the steps that would change, in order:
- a repository the step adds (a sources file written, a key or .repo file fetched, a release package installed) is
  added to the scratch configuration by the plan's own command in its scratch form;
- an install's dry run (`apt-get -s install`, `dnf install --assumeno`; ELRepo's "is this build offered") runs there.
A name no repository offers stops with exit 4 (no package for this host), a transaction that does not resolve with
exit 5, each in the line the run would have ended with, and "nothing was changed" is then true.

The host is read, never written: its package database (dpkg's status, rpm's database) is the one resolved against;
dnf's metadata cache is the host's (the run reuses what the preflight fetched; it is a cache, no configuration).
Where it cannot ask (a host tree under --root, an offline bundle, a repository it cannot reach within the deadline,
a package manager with no scratch configuration), it says that the question was not asked and the run goes on as
before. `bootstrap`, `bootstrap --check`, `bootstrap --dry-run`, `plan` (so install.sh --dry-run) ask it alike."""
from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from provision import effects, package_managers
from provision.errors import GpuprovError, StepFailed, Unsupported
from provision.facts.rootfs import is_live
from provision.fsutil import write_file
from provision.package_managers.base import Answer, PackageManager
from provision.plan.dkms import DriverInstall
from provision.plan.kmods import KmodOffered
from provision.plan.packages import PackageInstall
from provision.plan.steps import Command, Step, WriteFile

COMMAND_TIMEOUT = 120.0  # s, each scratch command (its fetches time out sooner: the adapters' scratch options)
DEADLINE = 300.0  # s, the whole preflight: past it, the rest is not asked
ENV = (("LC_ALL", "C"),)  # the package managers' words, which `answer` reads
# curl's exit statuses for a host it could not reach: the question was not asked (any other failure is an answer)
UNREACHED = re.compile(r"curl: \((?:5|6|7|28|35|56)\)|Could not resolve|Connection refused|timed out")


@dataclass
class Preflight:
    """What the preflight asked (its dry runs, as commands), why it asked nothing (`not_asked`), and the stop it
    found (None: every transaction resolves)."""
    asked: list[str] = field(default_factory=list)
    not_asked: str = ""
    stop: GpuprovError | None = None
    step: str = ""  # the step whose question stopped it
    seconds: float = 0.0

    def line(self) -> str:
        """One line for the plan, the check and the run."""
        if self.not_asked:
            return f"preflight: not asked ({self.not_asked}); a run finds it out at its step"
        if self.stop:
            return f"preflight: step {self.step} would stop the run (exit {self.stop.exit_code}) ({self.seconds:.1f}s)"
        if not self.asked:
            return "preflight: nothing to ask (no package to install)"
        return (f"preflight: {len(self.asked)} dry run(s) with the repositories the plan adds resolve "
                f"({self.seconds:.1f}s)")

    def to_dict(self) -> dict:
        return {"asked": self.asked, "not_asked": self.not_asked or None, "seconds": round(self.seconds, 1),
                "stop": {"id": self.step, "error": str(self.stop), "exit_code": self.stop.exit_code}
                if self.stop else None}


class _NotAsked(Exception):
    """A repository could not be reached, or the deadline passed: the rest of the questions are not asked."""


def preflight(steps: list[Step], manager: str, root: Path = Path("/"), *, bundle: bool = False,
              other_target: bool = False) -> Preflight:
    """Ask, before the first change, every install's "is it offered, does it resolve" of the steps that would
    change, in a scratch configuration holding the repositories the plan adds (the module docstring)."""
    t0 = time.monotonic()
    why = ("a host tree under --root: the package manager's dry runs are for this host only" if not is_live(root) else
           "--target plans for another release than this host's" if other_target else
           "an offline bundle: its repository was checked when it was built and verified" if bundle else "")
    if why:
        return Preflight(not_asked=why)
    pending = [s for s in steps if not s.verify_only and not s.satisfied()]
    if any(s.id == "packages.recover" for s in pending):
        return Preflight(not_asked="the package database has a killed run to finish first, the plan's first step")
    if not any(isinstance(a, (PackageInstall, DriverInstall, KmodOffered)) for s in pending for a in s.actions):
        return Preflight()
    pm = package_managers.get(manager)
    with tempfile.TemporaryDirectory(prefix="gpuprov-preflight-") as tmp:
        setup = pm.scratch_setup(Path(tmp))
        if setup is None:
            return Preflight(not_asked=f"{pm.name} has no scratch configuration to ask in")
        asker = _Asker(pm, Path(tmp), setup[0], t0)
        try:
            for argv in setup[1]:
                asker.repository(argv, "the scratch configuration")
            for step in pending:
                asker.step = step
                for action in step.actions:
                    asker.ask(action)
        except _NotAsked as exc:
            return Preflight(asker.asked, not_asked=str(exc), seconds=time.monotonic() - t0)
        except GpuprovError as exc:
            return Preflight(asker.asked, stop=exc, step=asker.step.id, seconds=time.monotonic() - t0)
        return Preflight(asker.asked, seconds=time.monotonic() - t0)


class _Asker:
    """The walk over the pending steps' actions, in the scratch configuration at `dir`."""

    def __init__(self, pm: PackageManager, scratch: Path, opts: tuple[str, ...], t0: float):
        self.pm, self.dir, self.opts, self.t0 = pm, scratch, opts, t0
        self.asked: list[str] = []
        self.moved: dict[str, str] = {}  # a keyring the plan fetches -> where the scratch has it
        self.stale = True  # the scratch's lists need a refresh before the next question (apt)
        self.step: Step = Step("preflight", "", "")

    def run(self, argv: tuple[str, ...]) -> effects.CommandResult:
        left = DEADLINE - (time.monotonic() - self.t0)
        if left <= 0:
            raise _NotAsked(f"past its {DEADLINE:g} s deadline")
        try:
            return effects.run(list(argv), check=False, env={**os.environ, **dict(self.pm.env + ENV)},
                               timeout=min(COMMAND_TIMEOUT, left), probe=True)
        except StepFailed as exc:  # cannot start, or timed out
            raise _NotAsked(str(exc)) from None

    def repository(self, argv: tuple[str, ...], what: str) -> None:
        """A repository command in its scratch form: its failure is the step's (exit 5), unless it could not reach
        its host (not asked)."""
        res = self.run(argv)
        if res.returncode == 0:
            self.stale = True
            return
        last = next((ln.strip() for ln in reversed(res.output.splitlines()) if ln.strip()), f"exit {res.returncode}")
        if UNREACHED.search(res.output):
            raise _NotAsked(f"{what}: {last}")
        raise StepFailed(f"step {self.step.id} ({self.step.title}) would fail: `{' '.join(argv)}` (its scratch "
                         f"form) says {last}; nothing was changed")

    def ask(self, action) -> None:
        if isinstance(action, WriteFile):
            dst = self.pm.scratch_file(self.dir, action.path)
            if dst is not None:
                content = action.content
                for host, scratch in self.moved.items():
                    content = content.replace(host, scratch)
                write_file(dst, content, backup=False, durable=False, keep_mode=False)
                self.stale = True
        elif isinstance(action, Command):
            argv = self.pm.scratch_command(self.dir, action.argv)
            if argv:
                if argv[:1] == ("curl",):  # a keyring fetched: the scratch's sources name it where it went
                    self.moved[action.argv[action.argv.index("-o") + 1]] = argv[argv.index("-o") + 1]
                self.repository(argv, action.shell())
        elif isinstance(action, KmodOffered):
            self.refresh()
            query = (action.query.argv[0], *self.opts, *action.query.argv[1:])
            self.asked.append(" ".join(query))
            res = self.run(query)
            if self.pm.answer(res.returncode, res.output).unreachable:
                raise _NotAsked(self.pm.answer(res.returncode, res.output).unreachable)
            # its own words and exit 4 (true here: nothing has changed)
            dataclasses.replace(action, query=Command(query, self.pm.env + ENV)).execute()
        elif isinstance(action, PackageInstall) and _release(action):
            for argv in self.pm.scratch_release(self.dir, action.packages):
                self.repository(argv, " ".join(action.packages))
        elif isinstance(action, (PackageInstall, DriverInstall)):
            if isinstance(action, DriverInstall) and action.unpin:  # the branch pin goes first (a change of branch)
                self.repository(self.pm.scratch_command(self.dir, self.pm.unpin()), "the branch pin")  # type: ignore
            self.transaction(action.packages, getattr(action, "opts", ()), getattr(action, "verb", ("install",)),
                             action.remove)

    def refresh(self) -> None:
        argv = self.pm.scratch_refresh(self.dir)
        if argv is None or not self.stale:
            return
        argv = (argv[0], *self.opts, *argv[1:])
        res = self.run(argv)
        answer = self.pm.answer(res.returncode, res.output)
        if answer.unreachable:
            raise _NotAsked(answer.unreachable)
        if res.returncode != 0:
            raise StepFailed(f"step {self.step.id} ({self.step.title}) would fail: `{' '.join(argv)}` in a scratch "
                             f"configuration with the repositories the plan adds: {answer.problem}; nothing was "
                             "changed")
        self.stale = False

    def transaction(self, packages: tuple[str, ...], opts: tuple[str, ...], verb: tuple[str, ...],
                    remove: tuple[str, ...]) -> None:
        self.refresh()
        argv = self.pm.simulate_install(packages, (*self.opts, *opts), verb, remove)
        self.asked.append(" ".join(argv))
        res = self.run(argv)
        answer: Answer = self.pm.answer(res.returncode, res.output)
        if answer.unreachable:
            raise _NotAsked(answer.unreachable)
        said = (f"(its dry run, in a scratch configuration with the repositories the plan adds, says so: "
                f"`{self.pm.name} … {' '.join((*verb, *packages))}`); nothing was changed")
        if answer.missing:
            raise Unsupported(f"step {self.step.id} ({self.step.title}) would stop: no repository offers "
                              f"{', '.join(answer.missing)} {said}. Ways out: a mirror that carries it (--mirror "
                              "NAME=URL, or the host's own sources), another branch (--driver) or source "
                              "(--driver-source, --engine-source); or wait for the repository to publish it")
        if answer.problem:
            raise StepFailed(f"step {self.step.id} ({self.step.title}) would fail: {self.pm.name} finds no "
                             f"transaction that installs {' '.join(packages)}: {answer.problem} {said}. Fix the "
                             "repository (a dependency it does not carry), or the package that holds it back")


def _release(action: PackageInstall) -> bool:
    """A release package that defines repositories (elrepo-release by URL, epel-release, a distribution's own): the
    preflight unpacks it into the scratch configuration instead of asking about it."""
    return all(p.endswith(".rpm") or re.search(r"-release(-latest-\d+)?$", p) for p in action.packages)
