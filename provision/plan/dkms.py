"""DKMS's builds of the driver's module, for every kernel the driver stage chose, and what a failed one leaves:
`DriverInstall` (apt: the install, DKMS for every kernel, the rollback of a failed build) and `DkmsBuild` (the builds
and their proof, after any package manager's install), with DKMS's status and build logs read here."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from provision import effects, package_managers
from provision.errors import DkmsBuildFailed, RemovalRefused, Unsupported
from provision.fsutil import write_file
from provision.package_managers.apt import Apt
from provision.plan.packages import PackageInstall, package_changes
from provision.plan.steps import Action, Command

LOG_DIR = "/var/log/gpuprov"
ERROR_RE = re.compile(r"(?:^|\s)(?:fatal )?error:", re.I)


@dataclass(frozen=True)
class DriverInstall(Action):
    """apt: refresh the lists, make sure every kernel's headers are offered, install; then have DKMS build for every
    kernel and prove it did. A failed build is rolled back (the module package purged, `dpkg --audit` empty) and
    reported with the compiler's first error line (exit 16). Every command, the rollback's too, is a Command below:
    printed and run from the same objects.

    A change of branch first unholds the old series, then removes it in the install's own transaction (`pkg-`), so
    apt never sees the host without a package that provides what others depend on (libcuda1-any …)."""
    reports = True  # what it installed and built, in words
    packages: tuple[str, ...]
    kernels: tuple[str, ...]
    dkms_package: str | None  # the kernel-module package DKMS builds (None: precompiled kmods)
    headers: tuple[str, ...]  # each kernel's own headers package, asked of apt before the install
    ways_out: str
    allow_remove: bool = False
    unhold: tuple[str, ...] = ()  # a change of branch: the old series' held (or pinned) packages
    remove: tuple[str, ...] = ()  # … and every package of the old series, removed in the same transaction
    unpin: bool = False  # a change of branch: the branch pin goes first (the new branch may share its sources)
    previous: tuple[str, ...] = ()  # an update within the branch: the series as installed before (name=version)
    restore: tuple[str, ...] = ()  # … what its rollback installs, per package: apt's cached .deb, else name=version
    manager: str = "apt"  # a package manager whose adapter has `checked_driver_install`

    @property
    def pm(self) -> Apt:
        return package_managers.get(self.manager)  # type: ignore[return-value]

    def _cmd(self, argv: tuple[str, ...]) -> Command:
        return Command(argv, self.pm.env)

    def _install(self) -> PackageInstall:
        return PackageInstall(self.manager, self.packages, allow_remove=self.allow_remove, remove=self.remove)

    def _header_checks(self) -> list[Command]:
        return [Command(self.pm.offered(h)) for h in self.headers]

    def _unhold(self) -> list[Command]:
        return ([Command(self.pm.unhold(self.unhold))] if self.unhold else []) + \
            ([Command(self.pm.unpin())] if self.unpin else [])

    def _autoinstall(self) -> list[Command]:
        return DkmsBuild(self.kernels, self.ways_out).builds() if self.dkms_package else []

    def _dkms_status(self) -> list[Command]:
        return DkmsBuild(self.kernels, self.ways_out).checks() if self.dkms_package else []

    def commands(self) -> list[Command]:
        """In order: unhold the old series (a change of branch), refresh, ask apt for every kernel's headers, install
        (its dry run first), build for every kernel, ask DKMS for every kernel."""
        return [*self._unhold(), self._cmd(self.pm.refresh()), *self._header_checks(),
                *self._install().commands(), *self._autoinstall(), *self._dkms_status()]

    def on_failure(self) -> list[Command]:
        """The rollback of a failed DKMS build: purge the module package together with the packages that need a
        kernel module (left to itself, apt would keep the metapackage by installing the other flavour's module: a
        silent switch, another build), finish what dpkg left, and ask dpkg whether anything is still broken.
        An update within the branch keeps the driver that worked instead: the series reinstalled at its versions
        before (from apt's cache or the archive; the new module package purged), built for every kernel, pinned at
        exactly those versions; then dpkg asked."""
        if not self.dkms_package:
            return []
        if self.previous:
            names = tuple(p.split("=", 1)[0] for p in self.previous)
            gone = (self.dkms_package,) if self.dkms_package not in names else ()
            return [self._cmd(self.pm.downgrade(self.restore or self.previous, gone)),
                    self._cmd(self.pm.configure_pending()), *self._autoinstall(),
                    Command(self.pm.hold_exact(names)), *self._dkms_status(), Command(self.pm.audit())]
        purge = [p for p in self.packages if not p.startswith(("linux-headers-", "firmware-"))]
        purge += [self.dkms_package] if self.dkms_package not in purge else []  # Ubuntu's: a dependency
        return [self._cmd(self.pm.purge(tuple(purge))), self._cmd(self.pm.configure_pending()),
                Command(self.pm.audit())]

    def lines(self) -> list[str]:
        before = [*self._unhold(), self._cmd(self.pm.refresh()), *self._header_checks()]
        out = [ln for c in before for ln in c.lines()] + self._install().lines() + \
            [ln for c in (*self._autoinstall(), *self._dkms_status()) for ln in c.lines()]
        if self.dkms_package:
            out.append("  (a kernel whose headers apt does not offer stops the step there: exit 4)")
            out.append("  on a failed DKMS build (a status other than installed), roll back, then stop with exit 16:")
            out += [f"  {ln}" for c in self.on_failure() for ln in c.lines()]
        return out

    def execute(self) -> str:
        for c in self._unhold():
            c.execute()
        self._cmd(self.pm.refresh()).execute()
        for check in self._header_checks():
            r = check.run()
            if r.returncode != 0 or not r.output.strip():
                h = check.argv[-1]
                k = h.removeprefix("linux-headers-")
                raise Unsupported(
                    f"apt offers no {h}: DKMS cannot build the driver for kernel {k} (a kernel newer than the "
                    "headers the archive carries, or one apt did not install). Ways out: install the current "
                    "kernel and its headers (apt-get install linux-image-amd64 linux-headers-amd64), reboot into it "
                    "and run bootstrap again; or build for another installed kernel with --kernel")
        install = self._install()
        try:  # exit 14 before anything is installed when apt would remove a package it was not asked to
            install.check_removals()
        except RemovalRefused:
            if self.unhold:  # nothing changed: the old series is pinned again
                for hold in self.pm.hold(self.unhold):
                    Command(hold).execute()
            raise
        before = self.pm.versions()
        install = install.install()
        res = install.run()
        if res.returncode == 0:
            for build in self._autoinstall():  # its outcome is what `dkms status` says next
                build.run()
        if res.returncode != 0 and self._dkms_status() and not effects.which("dkms") and \
                "Bad return status" not in res.output:
            # apt failed before DKMS was installed (nothing built, nothing to roll back): its own error, not
            # "command not found: dkms" from the status check below
            raise effects.failed(install.shell(), res.returncode, res.output)
        for status in self._dkms_status():
            k = status.argv[-1]
            built = dkms_installed(status.run().output, k)
            # a build that ran and failed (its make.log, DKMS's own message) — not apt failing before it
            if not built and (res.returncode == 0 or "Bad return status" in res.output or build_logs()):
                raise self._rollback(k)
        if res.returncode != 0:
            raise effects.failed(install.shell(), res.returncode, res.output)
        built = f"; DKMS built {self.dkms_package} for {', '.join(self.kernels)}" if self.dkms_package else ""
        return package_changes(before, self.pm.versions(), self.packages) + built

    def _rollback(self, kernel: str) -> DkmsBuildFailed:
        first, kept = first_build_error(kernel)
        if self.previous:
            return self._restore(kernel, first, kept)
        purge, configure, audit_cmd = self.on_failure()
        purged = purge.run()
        configure.run()
        audit = audit_cmd.run().output.strip()
        state = ("dpkg is consistent (`dpkg --audit` is empty)" if not audit and purged.returncode == 0 else
                 f"dpkg still reports: {audit.splitlines()[0] if audit else purged.output.strip()[-200:]}")
        return DkmsBuildFailed(
            f"DKMS could not build {self.dkms_package} for kernel {kernel}: {first or 'no compiler error found'}"
            f"{f' (full log: {kept})' if kept else ''}. Rolled back: purged {' '.join(purge.argv[3:])}; {state}. "
            f"Ways out: {self.ways_out}")


    def _restore(self, kernel: str, first: str | None, kept: str | None) -> DkmsBuildFailed:
        """The failed update's rollback (on_failure, in order): the driver that worked, reinstalled, built, pinned;
        the kernels that still lack a module named."""
        cmds = self.on_failure()
        install, rest = cmds[0], cmds[1:]
        done = install.run()
        lacking, audit = [], ""
        for c in rest:
            r = c.run()
            if c.argv[:2] == ("dkms", "status") and not dkms_installed(r.output, c.argv[-1]):
                lacking.append(c.argv[-1])
            if c.argv == self.pm.audit():
                audit = r.output.strip()
        state = ("dpkg is consistent (`dpkg --audit` is empty)" if not audit and done.returncode == 0 else
                 f"dpkg still reports: {audit.splitlines()[0] if audit else done.output.strip()[-200:]}")
        old = " ".join(self.previous)
        modules = (f"kernel {', '.join(lacking)} still has no nvidia module (`gpuprov verify` names it; boot another "
                   "kernel or fix the build)" if lacking else f"every kernel ({', '.join(self.kernels)}) has its module")
        back = (f"Rolled back to the driver that worked: reinstalled and pinned {old}" if done.returncode == 0 else
                f"The driver that worked ({old}) could not be reinstalled: "
                f"{_last_error(done.output) or f'{install.argv[0]} exit {done.returncode}'}")
        return DkmsBuildFailed(
            f"DKMS could not build {self.dkms_package} for kernel {kernel}: {first or 'no compiler error found'}"
            f"{f' (full log: {kept})' if kept else ''}. {back}; {modules}; {state}. Ways out: {self.ways_out}")


@dataclass(frozen=True)
class DkmsBuild(Action):
    """DKMS builds the driver's module for every kernel the plan chose, and `dkms status` proves it did. A module
    package's own scriptlet builds for the running kernel only (NVIDIA's kmod-nvidia-*-dkms; Debian's for the newest
    too), and kernel-devel installed after its kernel triggers no build: the kernel that boots next, or every
    installed one when baking an image, gets its build here (autoinstall does nothing where the module is built).
    On apt it is part of DriverInstall; elsewhere it follows the package install, which completed: a failed build
    stops the plan with exit 16 naming the kernel and the compiler's first error, the packages left installed (the
    package manager's database is consistent; nothing to roll back) for a re-run once the way out is taken."""
    reports = True
    kernels: tuple[str, ...]
    ways_out: str

    def builds(self) -> list[Command]:
        return [Command(("dkms", "autoinstall", "-k", k)) for k in self.kernels]

    def checks(self) -> list[Command]:
        return [Command(("dkms", "status", "-k", k)) for k in self.kernels]

    def commands(self) -> list[Command]:
        return [*self.builds(), *self.checks()]

    def lines(self) -> list[str]:
        return [ln for c in self.commands() for ln in c.lines()] + \
            ["  (a kernel whose status is not `installed` stops the step there: exit 16, the packages kept)"]

    def execute(self) -> str:
        for build in self.builds():  # its outcome is what `dkms status` says next
            build.run()
        for status in self.checks():
            k = status.argv[-1]
            if not dkms_installed(status.run().output, k):
                first, kept = first_build_error(k)
                raise DkmsBuildFailed(
                    f"DKMS could not build the driver's module for kernel {k}: {first or 'no compiler error found'}"
                    f"{f' (full log: {kept})' if kept else ''}. The driver's packages stay installed (nothing to roll "
                    f"back); kernel {k} has no nvidia module (`gpuprov verify` names it). Ways out: {self.ways_out}")
        return f"DKMS built the driver's module for {', '.join(self.kernels)}"


def dkms_installed(status: str, kernel: str) -> bool:
    """`dkms status -k K` lists a module installed for K ("nvidia/570.133.20, K, x86_64: installed"; DKMS 2.x/3.x
    append "(WARNING! Diff between built and installed module!)" where the installed file differs, signed after the
    build say: installed all the same)."""
    return any(kernel in ln and ": " in ln and ln.split(": ", 1)[1].split()[:1] == ["installed"]
               for ln in status.splitlines())


def _last_error(output: str) -> str:
    """apt's last `E:` line (what it could not do), else ''."""
    return next((ln.strip() for ln in reversed(output.splitlines()) if ln.startswith("E:")), "")


def build_logs() -> list[Path]:
    """DKMS's build logs, oldest first (left behind by a failed build)."""
    return sorted(Path("/var/lib/dkms").glob("*/*/build/make.log"), key=lambda p: p.stat().st_mtime)


def first_build_error(kernel: str) -> tuple[str | None, str | None]:
    """(the compiler's first error line, where the build log was kept) from DKMS's make.log of the newest build."""
    logs = build_logs()
    if not logs:
        return None, None
    log = logs[-1]
    text = log.read_text(errors="replace")
    kept = Path(LOG_DIR) / f"dkms-{log.parts[-4]}-{log.parts[-3]}-{kernel}.log"
    try:
        write_file(kept, text, backup=False)  # its directory made 0755, whatever the umask
    except OSError:
        kept = log
    for line in text.splitlines():
        if ERROR_RE.search(line):
            return line.strip(), str(kept)
    return None, str(kept)
