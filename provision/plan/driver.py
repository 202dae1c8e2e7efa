"""The driver's steps: repository/components, the nouveau blacklist, the packages with the headers of every kernel
the module must be built for, the kernel-module flavour `modprobe nvidia` loads, nouveau inside that kernel's
initramfs, held packages, and a staged MOK enrolment under Secure Boot.

Which kernel: the one that will boot (GRUB's default, `/vmlinuz`, else the newest `/boot/vmlinuz-*`), and the running
kernel too when apt installed it; with --kernel the ones named; when baking an image (--for-gpu) or changing the
driver branch, every installed kernel.

The module follows the kernel: on apt hosts the headers metapackage of each installed kernel metapackage
(linux-headers-amd64 for linux-image-amd64, linux-headers-generic-hwe-22.04 for linux-image-generic-hwe-22.04) is
installed with the driver, so a kernel apt brings in later comes with its headers and DKMS builds the module for it
before the reboot; on Ubuntu, the precompiled signed modules that follow the kernel flavour where the archive has
them. A change of branch (--driver B on a host whose other series gpuprov installed and held) unholds the old
series and swaps it for the new one in one apt transaction, then builds for every installed kernel and holds again.
On Ubuntu, day two: a kernel Canonical has no precompiled modules for yet gets the installed series' DKMS flavour
beside them, and the series moves back once the archive has them for every kernel (decide/kernel.py's
ubuntu_module_move). What is already on the host (a loaded driver left alone, a kept one, gpuprov's held series):
plan/driver_on_host.py.

A DKMS build that fails is met here, in `DriverInstall`: the compiler's first error line is named, the log kept
under /var/log/gpuprov, the half-configured module package purged so `dpkg --audit` is empty, and the ways out
named (exit 16).
"""
from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, replace
from pathlib import Path

from provision import effects, package_managers, paths
from provision.decide.debian import debian_driver_packages
from provision.decide.driver import default_source, packaged_branches, ubuntu_dkms_package
from provision.decide.kernel import (
    PIN_FILE,
    ModuleMove,
    Precompiled,
    Replacement,
    branch_replacement,
    headers_metapackages,
    kernel_metapackages,
    series_update,
    ubuntu_precompiled,
)
from provision.decide.packages import debian_components
from provision.decide.targets import Target
from provision.errors import StepFailed, Unsupported
from provision.facts.boot import installed_kernels
from provision.facts.packages import (
    archive_depends,
    archive_versions,
    closure,
    offered_module_packages,
)
from provision.facts.rootfs import is_live, under
from provision.options import Stage
from provision.package_managers.apt import restore_sources
from provision.plan import repos
from provision.plan.archive_preview import component_writes, driver_origins
from provision.plan.boot_default import with_boot_default
from provision.plan.dkms import DkmsBuild, DriverInstall
from provision.plan.driver_on_host import (
    boot_kernel,
    held_series,
    installed_driver_of,
    keep_installed,
    module_built,
    present_step,
    series_installed,
    ubuntu_move,
)
from provision.plan.kmods import KmodOffered, KmodServes, elrepo_build, minor_release
from provision.plan.packages import (
    PackageInstall,
    RepoInstalled,
    ReposAt,
    StreamsEnabled,
    mirror_commands,
    package_step,
)
from provision.plan.steps import (
    Action,
    Already,
    Command,
    FilesMatch,
    PackagesInstalled,
    Step,
    WriteFile,
    read_or_empty,
)
from provision.render import render
from provision.report import HostReport

NOUVEAU_CONF = "/etc/modprobe.d/gpuprov-blacklist-nouveau.conf"
NOUVEAU_TEMPLATE = "nouveau-blacklist.conf.j2"
DKMS_KEY = "/var/lib/dkms/mok.pub"
MOK_HASH = paths.MOK_HASH
ONE_TIME_PASSWORD = "<one-time password, shown once>"  # what a printed plan shows in its place
DKMS_SYSCONFIG = "/etc/sysconfig/dkms"  # read by DKMS's autoinstaller, which its kernel hooks run
# Debian's kernel module names per flavour: `install nvidia modprobe -i <name>` in /etc/modprobe.d/nvidia.conf,
# chosen by the `nvidia` alternative (/usr/lib/nvidia/<flavour dir>).
DEBIAN_FLAVOURS = {"open": ("nvidia-current-open", "/usr/lib/nvidia/current-open"),
                   "proprietary": ("nvidia-current", "/usr/lib/nvidia/current")}


# ---------------------------------------------------------------- kernels


@dataclass(frozen=True)
class Kernels:
    releases: tuple[str, ...]
    why: str


def check_kernels(root: Path, asked: tuple[str, ...]) -> None:
    """--kernel names installed kernels only (exit 4 with the installed ones otherwise), checked up front even where
    no GPU is there to build for."""
    missing = [k for k in asked if not under(root, f"/lib/modules/{k}").is_dir()]
    if missing:
        raise Unsupported(f"--kernel {missing[0]}: no such kernel is installed (no /lib/modules/{missing[0]}); "
                          f"installed: {', '.join(installed_kernels(root)) or 'none'}")


def check_driver_pin(target: Target, opt) -> None:
    """--driver BRANCH names a branch the target packages from the chosen source (exit 4 with those branches
    otherwise), checked up front: without a GPU to decide for, nothing else would refuse it."""
    pin = opt.driver
    if not pin.isdigit():
        return
    src = None if opt.driver_source == "distro" else opt.driver_source
    avail = packaged_branches(target, src)
    if int(pin) not in avail:
        where = f"{target.name}" + (f" from {src}" if src else "")
        raise Unsupported(f"--driver {pin}: {where} packages no driver branch {pin}; branches it packages: "
                          + (", ".join(map(str, avail)) or "none (use --driver-source nvidia)")
                          + "; or --driver auto")


def choose_kernels(root: Path, running: str | None, asked: tuple[str, ...], baking: bool,
                   replacing: bool = False) -> Kernels:
    if asked:
        check_kernels(root, asked)
        return Kernels(asked, "asked for with --kernel")
    if baking or replacing:
        ks = installed_kernels(root)
        if not ks:
            raise Unsupported("no installed kernel to build the driver for: install the distribution's kernel "
                              "(e.g. linux-image-amd64) first, or name one with --kernel")
        return Kernels(tuple(ks), "every installed kernel (" + ("image baking" if baking else "a new driver branch")
                       + ")")
    boot = boot_kernel(root)
    running_ok = bool(running) and under(root, f"/lib/modules/{running}/kernel").is_dir()
    if boot is None and not running_ok:
        raise Unsupported(f"no installed kernel to build the driver for (the running kernel {running} has no "
                          f"/lib/modules/{running}): install the distribution's kernel and headers "
                          "(Debian: apt-get install linux-image-amd64 linux-headers-amd64), or name one with --kernel")
    if boot is None or boot == running:
        return Kernels((running,), "the running kernel, which also boots next")  # type: ignore[arg-type]
    if running_ok:
        return Kernels((boot, running), f"{boot} boots next (/vmlinuz); {running} runs now")  # type: ignore
    return Kernels((boot,), f"{boot} boots next (/vmlinuz); the running kernel {running} was not installed by the "
                   "package manager (no modules directory), so nothing is built for it")


def el_devel_package(kernel: str) -> str:
    """The kernel-devel package of an EL kernel release, by its variant (NVIDIA's driver installation guide, Oracle
    Linux and RHEL): Oracle's UEK (5.15.0-208.159.3.el9uek.x86_64) ships kernel-uek-devel; a `+VARIANT` release
    (5.14.0-503.14.1.el9_5.aarch64+64k, …x86_64+rt) kernel-VARIANT-devel of the release without the suffix."""
    if ".el" in kernel and "uek." in kernel.rsplit(".el", 1)[1]:
        return f"kernel-uek-devel-{kernel}"
    if "+" in kernel:
        release, variant = kernel.rsplit("+", 1)
        return f"kernel-{variant}-devel-{release}"
    return f"kernel-devel-{kernel}"


def check_kmod_kernels(kernels: tuple[str, ...]) -> None:
    """ELRepo's kmods are built for Red Hat's kernel (kABI-tracking, weak-updates across its minor release): none
    loads into Oracle's UEK, which Oracle Linux boots by default, or into Alibaba Cloud Linux's kernel. Refused up
    front (exit 4) with the ways out."""
    uek = [k for k in kernels if el_devel_package(k).startswith("kernel-uek-")]
    if uek:
        raise Unsupported(f"ELRepo's kmods are built for Red Hat's kernel, not Oracle's UEK ({uek[0]}): use NVIDIA's "
                          "repository (--driver-source nvidia: DKMS builds for UEK), or boot the Red Hat compatible "
                          "kernel first")
    # Alibaba Cloud Linux 3's kernels (5.10.134-15.1.al8.x86_64): its own 5.10 line, no Red Hat compatible kernel to
    # boot instead
    alinux = [k for k in kernels if re.search(r"\.al\d+\.", k)]
    if alinux:
        raise Unsupported(f"ELRepo's kmods are built for Red Hat's kernel, not Alibaba Cloud Linux's ({alinux[0]}): "
                          "use NVIDIA's repository (--driver-source nvidia, the default there: DKMS builds against "
                          "its kernel-devel)")


def headers_packages(target: Target, kernels: tuple[str, ...]) -> list[str]:
    if target.family == "debian":
        return [f"linux-headers-{k}" for k in kernels]
    # kernel-headers (the userspace API headers) is one package, not one per kernel as kernel-devel is: dnf refuses
    # two versions of it in one transaction, and one older than the installed would be downgraded
    return [*(el_devel_package(k) for k in kernels), "kernel-headers"]


# ---------------------------------------------------------------- checks (read through the plan's root)


@dataclass(frozen=True)
class DriverBuilt:
    """The packages are installed and an nvidia module (DKMS's, or a precompiled package's) for every kernel."""
    manager: str
    packages: tuple[str, ...]
    kernels: tuple[str, ...]
    dkms: bool

    @property
    def installs(self) -> PackagesInstalled:
        """The packages part of the check (what the install record keeps: plan/apply.py's missing_packages)."""
        return PackagesInstalled(self.manager, self.packages)

    def satisfied(self, root: Path) -> bool:
        if not self.installs.satisfied(root):
            return False
        return not self.dkms or all(module_built(root, k) for k in self.kernels)

    def describe(self) -> str:
        db = package_managers.get(self.manager).database
        return (f"skipped when {db} lists {' '.join(self.packages)} as installed"
                + (f" and an nvidia module is installed for {', '.join(self.kernels)}" if self.dkms else ""))


@dataclass(frozen=True)
class ModprobeLoads:
    """`modprobe nvidia` loads this module: Debian's `install nvidia modprobe -i <name>` line, which the `nvidia`
    alternative links into /etc/modprobe.d/nvidia.conf."""
    module: str

    def satisfied(self, root: Path) -> bool:
        return loads(root) == self.module

    def describe(self) -> str:
        return f"skipped when /etc/modprobe.d/nvidia.conf makes `modprobe nvidia` load {self.module}"


def _resolve(root: Path, path: str, depth: int = 10) -> Path:
    p = under(root, path)
    while depth and p.is_symlink():
        t = os.readlink(p)
        p = under(root, t) if t.startswith("/") else p.parent / t
        depth -= 1
    return p


def loads(root: Path) -> str | None:
    text = read_or_empty(_resolve(root, "/etc/modprobe.d/nvidia.conf"))
    m = re.search(r"^install nvidia modprobe -i (\S+)", text, re.M)
    return m.group(1) if m else None


@dataclass(frozen=True)
class InitramfsHas:
    """Every kernel's initramfs carries this file (listed with initramfs-tools' lsinitramfs or dracut's lsinitrd,
    from the plan's root)."""
    path: str
    kernels: tuple[str, ...]
    dracut: bool = False

    def satisfied(self, root: Path) -> bool:
        for k in self.kernels:
            img = under(root, f"/boot/initramfs-{k}.img" if self.dracut else f"/boot/initrd.img-{k}")
            if not img.exists():
                return False
            try:
                r = effects.run(["lsinitrd" if self.dracut else "lsinitramfs", str(img)], check=False)
            except StepFailed:  # the lister itself is missing: cannot tell
                return False
            if not any(w.lstrip("/") == self.path.lstrip("/") for w in r.output.split()):
                return False
        return True

    def describe(self) -> str:
        return f"skipped when {self.path} is inside the initramfs of {', '.join(self.kernels)}"


@dataclass(frozen=True)
class Held:
    """Packages held against upgrades as their package manager holds them (apt's branch pin, dnf/yum's versionlock:
    provision/package_managers)."""
    manager: str
    packages: tuple[str, ...]
    stale: tuple[str, ...] = ()  # removed packages (a flavour switch's old kmod) whose holds must be gone

    def satisfied(self, root: Path) -> bool:
        # a flavour switch within a branch leaves the named packages' locks current: the stale kmod's lock (and the
        # new kmod, unlocked) make the step run
        pm = package_managers.get(self.manager)
        return pm.held(root, self.packages) and not (self.stale and pm.holds_among(root, self.stale, ()))

    def describe(self) -> str:
        return package_managers.get(self.manager).hold_words(self.packages).check


@dataclass(frozen=True)
class MokStaged:
    """The DKMS signing key is enrolled or its enrolment is staged for the next boot (asks mokutil; live only)."""
    key: str

    def satisfied(self, root: Path) -> bool:
        if not is_live(root) or not Path(self.key).exists():
            return False
        r = effects.run(["mokutil", "--test-key", self.key], check=False)
        return "already enrolled" in r.output or "already in the enrollment request" in r.output

    def describe(self) -> str:
        return f"skipped when mokutil says {self.key} is enrolled or staged"


# ---------------------------------------------------------------- actions (DKMS's: plan/dkms.py; ELRepo's: plan/kmods.py)


@dataclass(frozen=True)
class MokImport(Action):
    """Stage the DKMS key for enrolment with a one-time password (mokutil reads it from a hash file, so nothing
    prompts); the password is shown once, for the console's question at the next boot. Printed and run from the
    same commands; the password is the one token a printed plan does not show as run."""
    key: str = DKMS_KEY

    def commands(self, password: str = ONE_TIME_PASSWORD) -> list[Command]:
        return [Command(("mokutil", f"--generate-hash={password}"), stdout_to=MOK_HASH),
                Command(("mokutil", "--import", self.key, "--hash-file", MOK_HASH))]

    def lines(self) -> list[str]:
        return [ln for c in self.commands() for ln in c.lines()]

    def execute(self) -> str:
        password = secrets.token_hex(4)
        try:
            for c in self.commands(password):
                c.execute()
        except StepFailed as exc:  # its message names the command: never with the password in it
            raise StepFailed(str(exc).replace(password, ONE_TIME_PASSWORD), exit_code=exc.exit_code) from None
        return mok_console_text(password)


def mok_console_text(password: str) -> str:
    return (f"Secure Boot: the DKMS signing key is staged for enrolment. At the next boot the console shows "
            f"'Perform MOK management': choose 'Enroll MOK', 'Continue', 'Yes', type the one-time password "
            f"{password} and choose 'Reboot'. Without that the kernel refuses the nvidia module.")


# ---------------------------------------------------------------- the steps


def driver_steps(report: HostReport, target: Target, opt) -> list[Step]:
    """The driver stage (_stage_steps), with the default boot entry kept on a kernel with a module where the build
    for the kernel that would boot next fails, and given back once it has one (plan/boot_default.py)."""
    return with_boot_default(Path(report.root or "/"), target.family, _stage_steps(report, target, opt))


def _stage_steps(report: HostReport, target: Target, opt) -> list[Step]:
    """The driver stage, in the order it runs: apt components or the EL repository, the nouveau blacklist (before the
    packages, so their own initramfs triggers carry it), the packages (DKMS built per kernel), the module flavour,
    the initramfs check, the package hold and, under Secure Boot, the MOK import."""
    if opt.driver == "skip":
        return []
    gpus = [d for _, d in report.gpus]
    baking = bool(getattr(opt, "for_gpus", ()))
    early = present_step(report, gpus, baking, target, opt)
    if early:
        return [early]
    drv = report.driver
    packages = _driver_packages(gpus, target)
    root = Path(report.root or "/")
    pm = package_managers.get(target.package_manager)
    kept = keep_installed(installed_driver_of(drv, root, pm), packages, opt, baking, pm, root,
                          held_series(root, target, packages), drv)
    if kept:
        return [kept]
    modules = gpus[0].modules
    # ELRepo's kmods are prebuilt; everything else builds with DKMS. "distro" on EL is ELRepo, but not where ELRepo
    # serves nothing (Amazon Linux 2023) or nothing that loads (Alibaba Cloud Linux 3's own kernel): NVIDIA's
    # repository, whose kmod-nvidia-*-dkms packages need kernel-devel
    dkms = not (opt.driver_source == "elrepo" or (target.family == "rhel" and opt.driver_source == "distro"
                                                   and default_source(target) == "elrepo"))
    apt = _apt_facts(root, target, opt, packages)
    running, asked = (drv.kernel_release if drv else None), tuple(getattr(opt, "kernels", ()))
    kernels = choose_kernels(root, running, asked, baking, replacing=apt.replacement is not None)
    if target.family == "rhel" and not dkms:
        check_kmod_kernels(kernels.releases)
    # ELRepo's kmods: the build for the boot kernel's minor release. One gpuprov locked, with the kernel that boots
    # next outside its minor release (no weak-updates link), follows that kernel (the hold step renews the lock)
    boot = boot_kernel(root) if target.family == "rhel" and not dkms and not opt.bundle else None
    moved = bool(boot) and _kmod_follows(root, pm, packages, boot)  # type: ignore[arg-type]
    if moved:
        kernels = Kernels((boot,), f"{boot} boots next without an nvidia module: ELRepo builds a kmod for each "  # type: ignore[arg-type]
                          "minor release's kernels")
    if apt.replacement is None and dkms and pm.checked_driver_install and not opt.bundle:
        update = series_update(series_installed(root), packages, closure(packages, archive_depends(root)),
                               _offered(root, target, packages),
                               tuple(k for k in kernels.releases if not module_built(root, k)))
        if update:  # the held series follows the kernel within its branch: built for every installed kernel
            apt = replace(apt, replacement=update)
            kernels = choose_kernels(root, running, asked, baking, replacing=True)
    steps: list[Step] = []
    if target.family == "debian":
        steps += _components_step(root, target, opt) + _cuda_apt_step(target, opt)
    else:
        steps += _el_repo_steps(target, opt)
    pre = ubuntu_precompiled(packages, apt.kernel_metas, kernels.releases, apt.offered) \
        if target.os_id == "ubuntu" and dkms and not opt.bundle else None
    # day two on Ubuntu: the installed series' modules follow the kernels between Canonical's packages and DKMS
    move = ubuntu_move(root, target, packages, kernels.releases) \
        if pre is not None and apt.replacement is None and not asked else None
    if move and move.to == "precompiled":
        kernels = Kernels(move.kernels, "every installed kernel (DKMS's modules go from all of them)")
        pre = Precompiled(move.install[0], move.why, abi=move.abi)
        packages, dkms = list(move.install), False
    elif move:  # DKMS added for the kernels without Canonical's modules; the rest of the series is installed already
        kernels = Kernels(move.kernels, "Canonical has no precompiled modules for it yet")
        pre = Precompiled(None, move.why)
        packages = list(move.install)
    elif pre and pre.package:  # Canonical's signed modules: no DKMS, no headers
        packages, dkms = [pre.package, *pre.abi, *pre.driver], False
    headers = headers_packages(target, kernels.releases) if dkms else []
    follow = headers_metapackages(apt.kernel_metas) if dkms and pm.checked_driver_install else ()
    if target.family == "rhel" and dkms and not opt.bundle:
        headers.append("dkms")
    steps.append(_nouveau_step(bool(drv and drv.nouveau_loaded)))
    # the package DKMS builds: named in Debian's list; pulled in by Ubuntu's metapackage (purged with it on a failure)
    dkms_pkg = next((p for p in packages if p.endswith("kernel-dkms")), None) or \
        (ubuntu_dkms_package(packages) if target.os_id == "ubuntu" else None)
    kernel_plan = KernelPlan(kernels, tuple(headers), follow, pre.why if pre else "", apt.replacement,
                             pre.abi if pre and pre.package else (), boot, moved, move)
    # dnf's module streams (NVIDIA's repository): another stream of the module enabled is a branch change, which
    # `dnf module switch-to` makes; a switch between kernel-module flavours also replaces the old flavour's kmod
    # (`swap`), whose hold goes too. Read once, for the packages step and the hold step.
    streams = tuple(p for p in packages if ":" in p) if pm.module_streams and not opt.bundle else ()
    switch = pm.streams_to_switch(root, streams) if streams else ()
    swap = pm.stream_swaps(root, switch) if switch else ()
    steps.append(_packages_step(target, opt, gpus[0], packages, kernel_plan, dkms, dkms_pkg, root, streams,
                                switch, swap))
    if target.os_id == "debian" and dkms_pkg and "nvidia-driver" in packages:
        mod, alt = DEBIAN_FLAVOURS[modules]
        steps.append(Step("driver.flavour", Stage.DRIVER, f"Make `modprobe nvidia` load the {modules} module ({mod})",
                          actions=(Command(("update-alternatives", "--set", "nvidia", alt)),),
                          check=ModprobeLoads(mod)))
    steps.append(_initramfs_step(target, kernels.releases))
    # Ubuntu's precompiled modules metapackage follows the kernel (its source is the kernel's metapackages'):
    # pinning it would pin linux-generic's source too
    steps.append(_hold_step(target, tuple(p for p in packages if not p.startswith(("firmware-", "linux-modules-"))),
                            swap))
    if pm.checked_driver_install and dkms_pkg and dkms:
        steps.append(_kernel_hook_step(root, target))
    if drv and drv.secure_boot and dkms:
        steps.append(Step("driver.mok", Stage.DRIVER,
                          "Secure Boot is on: stage the DKMS signing key for enrolment (one-time "
                          "password, asked by the console at the next boot)", actions=(MokImport(),),
                          check=MokStaged(DKMS_KEY), reboot=True))
    return steps


def _offered(root: Path, target: Target, packages: list[str]) -> dict[str, frozenset[str]]:
    """The upstream versions apt will offer each package once the components step has run: on Debian the lists as
    the plan decided the flavour from (plan/archive_preview.py: the security suite's non-free included), else the
    host's lists."""
    if target.os_id != "debian":
        return archive_versions(root, packages)
    origins = driver_origins(root, target, debian_driver_packages(target.codename))
    return {**archive_versions(root, packages), **{n: frozenset().union(*by.values()) for n, by in origins.items()}}


def flavour_switch(steps: list[Step]) -> str | None:
    """The driver step's move of gpuprov's series to the other kernel-module flavour within its branch, in words
    (None: no such move). Asked before the first change: without --yes the run stops with it (exit 14)."""
    for step in steps:
        for a in step.actions if step.id == "driver.packages" else ():
            if isinstance(a, DriverInstall) and a.dkms_package and a.previous:
                gone = [r for r in a.remove if r.endswith("kernel-dkms")
                        and ("-open-" in r) != ("-open-" in a.dkms_package)]
                if gone:
                    return (f"the driver's kernel module moves from {' '.join(gone)} to {a.dkms_package} within its "
                            f"branch ({'; '.join(n.removeprefix('update: ') for n in step.notes[:1])})")
    return None


def _kmod_follows(root: Path, pm, packages: list[str], boot: str) -> bool:
    """ELRepo's kmod follows the kernel that boots next: gpuprov locked it (driver_held) and that kernel has no nvidia
    module (weak-modules links a kmod only into the kernels of its minor release)."""
    return not module_built(root, boot) and pm.driver_held(root, tuple(packages))


def _driver_packages(gpus: list, target: Target) -> list[str]:
    """The union of every GPU's packages, in order; a GPU with none is refused with the decision's reasons."""
    packages: list[str] = []
    for d in gpus:
        if not d.packages:
            raise Unsupported(f"no driver package for {d.name} ({d.pci_id}) on {target.name}: "
                              + "; ".join(d.warnings))
        packages += [p for p in d.packages if p not in packages]
    return packages


def _components_step(root: Path, target: Target, opt) -> list[Step]:
    """Debian: enable contrib/non-free(-firmware) in the apt entries that exist (read under the root), as minimal
    edits; none when they are on already or the packages come from a bundle. The plan decided the module flavour
    from the lists as these edits will make them (plan/archive_preview.py)."""
    writes = component_writes(root, target)
    if not writes or opt.bundle:
        return []
    return [Step("driver.components", Stage.DRIVER,
                 f"Enable {' '.join(debian_components(target))} in the existing apt entries",
                 actions=tuple(writes), check=FilesMatch(tuple((w.path, w.content) for w in writes)),
                 notes=_security_note(writes, target))]


def _security_note(writes: list[WriteFile], target: Target) -> tuple[str, ...]:
    """The security suite's entry gets the components too: the driver's security updates (and the module updates a
    new security kernel needs) come from there."""
    sec = f"{target.codename}-security"
    return (f"{sec}'s entry included: the driver's security updates, and the module updates a security kernel "
            "needs, come from there",) if any(sec in w.content for w in writes) else ()


def _cuda_apt_step(target: Target, opt) -> list[Step]:
    """Debian/Ubuntu with --driver-source nvidia: NVIDIA's CUDA repository (where nvidia-open-<b> and cuda-drivers-<b>
    come from), signed-by the key beside its tree, at its --mirror where one is given. Without this step the install
    named packages no configured source has."""
    if opt.driver_source != "nvidia" or opt.bundle:
        return []
    url = repos.cuda_apt_url(target, opt.mirrors)
    src = WriteFile(repos.cuda_apt_list(target), repos.cuda_apt_source(target, opt.mirrors))
    return [Step("driver.repo", Stage.DRIVER, "Add NVIDIA's CUDA apt repository with a signed-by keyring",
                 actions=(Command(("install", "-m", "0755", "-d", "/etc/apt/keyrings")),
                          Command(("curl", "-fsSL", f"{url}/{repos.CUDA_APT_KEY}", "-o", repos.CUDA_APT_KEYRING)), src),
                 check=FilesMatch(((src.path, src.content),)))]


def _nouveau_step(nouveau_loaded: bool) -> Step:
    nouveau = WriteFile(NOUVEAU_CONF, render(NOUVEAU_TEMPLATE))
    return Step("driver.nouveau", Stage.DRIVER,
                "Blacklist nouveau (before the packages, so their initramfs rebuild has it)",
                actions=(nouveau,), check=FilesMatch(((nouveau.path, nouveau.content),)), reboot=nouveau_loaded)


@dataclass(frozen=True)
class AptFacts:
    """What dpkg and the apt lists say that the driver's packages depend on (empty off apt, or from a bundle)."""
    kernel_metas: tuple[str, ...] = ()  # installed linux-image-<flavour> metapackages
    offered: frozenset[str] = frozenset()  # Ubuntu: the precompiled module packages the lists offer
    replacement: Replacement | None = None  # --driver B over another series gpuprov held


def _apt_facts(root: Path, target: Target, opt, packages: list[str]) -> AptFacts:
    if not package_managers.get(target.package_manager).checked_driver_install or opt.bundle:
        return AptFacts()
    installed = series_installed(root)
    # only a branch or a module flavour asked for replaces what is there
    pinned = str(getattr(opt, "driver", "auto")).isdigit() or \
        str(getattr(opt, "kernel_modules", "auto")) in ("open", "proprietary")
    return AptFacts(kernel_metapackages(installed),
                    offered_module_packages(root) if target.os_id == "ubuntu" else frozenset(),
                    branch_replacement(installed, packages, closure(packages, archive_depends(root))) if pinned
                    else None)


@dataclass(frozen=True)
class KernelPlan:
    """The kernels the module is for, their headers, the headers metapackages that keep later kernels served, why
    Ubuntu's precompiled modules are used or not, and the series a change of branch replaces."""
    kernels: Kernels
    headers: tuple[str, ...]
    follow: tuple[str, ...]
    precompiled_why: str = ""
    replacement: Replacement | None = None
    auto: tuple[str, ...] = ()  # Ubuntu: each kernel's precompiled modules, marked automatic after the install
    elrepo_boot: str | None = None  # ELRepo: the kernel that boots next, whose minor release's build is installed
    kmod_moves: bool = False  # ELRepo: the kmod gpuprov locked moves to that build (the kernel boots without one)
    module_move: ModuleMove | None = None  # Ubuntu: the installed series' modules move to DKMS or back to Canonical's


def _packages_step(target: Target, opt, gpu, packages: list[str], kp: KernelPlan, dkms: bool,
                   dkms_pkg: str | None, root: Path = Path("/"), streams: tuple[str, ...] = (),
                   switch: tuple[str, ...] = (), swap: tuple[str, ...] = ()) -> Step:
    """Headers and driver packages in one transaction. On apt (not from a bundle) a DriverInstall, which checks
    each kernel's DKMS build and rolls a failed one back; elsewhere the family's package step. `streams`, `switch`,
    `swap`: the module streams installed, those switched to, the other flavour's kmod they replace (driver_steps)."""
    kernels, rep = kp.kernels, kp.replacement
    all_pkgs = kp.headers + kp.follow + tuple(packages)
    pm = package_managers.get(target.package_manager)
    mv = kp.module_move
    title = ((f"Add DKMS to the driver's series for kernel {', '.join(mv.kernels)}, which Canonical has no "
              f"precompiled module for yet: {' '.join(packages)}" if mv and mv.to == "dkms" else
              f"Move the driver's kernel module back to Canonical's precompiled modules: {' '.join(packages)} "
              f"({' '.join(mv.remove)} removed in the same transaction)" if mv else
              f"Update the driver {rep.old} within its branch: {' '.join(packages)}" if rep and rep.why else
              f"Replace the driver {rep.old} with {' '.join(packages)}" if rep else
              f"Switch the driver's module stream to {' '.join(switch)} (another "
              + (f"kernel-module flavour is enabled: {' '.join(swap)} replaced in the same transaction)" if swap else
                 "branch is enabled)") if switch else
              f"Install the driver: {' '.join(packages)}")
             + (f"; DKMS builds it for kernel {', '.join(kernels.releases)}: {kernels.why}" if dkms else ""))
    why = (f"{f'driver {rep.old} replaced; ' if rep else ''}the nvidia module for {', '.join(kernels.releases)} "
           "loads at the next boot" + (" (nouveau blacklisted in its initramfs)" if target.family == "debian" else ""))
    notes = [f"update: {rep.why}"] if rep and rep.why else []
    # the decision's reasons (the module flavour the archive maintains, an override of it): the plan says why
    notes += [f"decision: {w}" for w in getattr(gpu, "warnings", ())]
    if kp.follow:
        notes.append(f"{' '.join(kp.follow)} follows {' '.join(f'linux-image-{h[14:]}' for h in kp.follow)}: a "
                     "kernel apt brings in later gets its headers, and DKMS builds the module for it before the reboot")
    elif dkms and pm.checked_driver_install and not opt.bundle:
        notes.append("no kernel metapackage (linux-image-<flavour>) is installed: apt brings no later kernels, and "
                     "one installed by hand needs its headers for DKMS (`gpuprov verify` names a kernel without the "
                     "module)")
    if kp.precompiled_why:
        notes.append(f"kernel module: {kp.precompiled_why}")
    ways = "; ".join(w for w in (
        "--kernel-modules proprietary (this GPU allows it)" if gpu.modules == "open" and
        gpu.kernel_modules == "either" else "",
        "another kernel (install it, then --kernel VERSION)",
        "NVIDIA's repository (--driver-source nvidia)" if opt.driver_source != "nvidia" else
        "ELRepo's prebuilt kmods (--driver-source elrepo)" if default_source(target) == "elrepo" else "",
        f"back to {rep.old} (--driver with its branch)" if rep else "") if w)
    if pm.checked_driver_install and not opt.bundle:
        install = DriverInstall(all_pkgs, kernels.releases, dkms_pkg if dkms else None,
                                tuple(h for h in kp.headers if h.startswith("linux-headers-")), ways,
                                allow_remove=opt.allow_remove, unhold=rep.unhold if rep else (),
                                remove=(rep.remove if rep else ()) + (mv.remove if mv else ()),
                                unpin=bool(rep and not rep.why),
                                previous=rep.previous if rep and rep.why else (),
                                restore=restore_sources(root, rep.previous) if rep and rep.why else (),
                                manager=pm.name)
        # marked automatic: a manual package depending on an old kernel's image would keep that kernel from apt's
        # autoremove; apt's own kernel protection (APT::VersionedKernelPackages) keeps the booted and newest ones'
        auto = (Command(pm.mark_auto(kp.auto)),) if kp.auto else ()
        return Step("driver.packages", Stage.DRIVER, title, actions=(install, *auto),
                    check=DriverBuilt(pm.name, all_pkgs, kernels.releases, bool(dkms_pkg) or not dkms),
                    reboot=True, reboot_reason=why, notes=tuple(notes))
    # DKMS's build for each chosen kernel, after the install (from a bundle: the packages' own scriptlets only)
    builds = DkmsBuild(kernels.releases, ways) if dkms and not opt.bundle else None
    pre: tuple = ()
    post: tuple = (builds,) if builds else ()
    verb, opts, specs, modules_for = (), (), all_pkgs, kernels.releases
    if kp.elrepo_boot:  # ELRepo's build for the boot kernel's minor release, offered first, its module proven after
        boot = kp.elrepo_boot
        specs = tuple(elrepo_build(p, boot) for p in all_pkgs)
        kmod, name = next(((s, p) for s, p in zip(specs, all_pkgs) if s != p), (specs[0], all_pkgs[0]))
        tag = minor_release(boot) if kmod != name else None
        title = (f"Move ELRepo's kmod to its build for kernel {boot}, which boots next without its module ({tag}; "
                 "kernels of other minor releases keep none): " + " ".join(packages) if kp.kmod_moves else
                 title + f" (ELRepo's build for kernel {boot}'s minor release{f': {tag}' if tag else ''})")
        pre = (KmodOffered(boot, name, Command(pm.offered(kmod))),)
        post, modules_for = (KmodServes(boot),), (boot,)
        if kp.kmod_moves:  # past the lock for this transaction only: a failed or killed run leaves it as it was
            verb, opts = pm.upgrade_verb(), pm.unlocked()
    check = DriverBuilt(target.package_manager, all_pkgs, modules_for, builds is not None or bool(kp.elrepo_boot))
    return package_step("driver.packages", Stage.DRIVER, title, target, specs, bundle=opt.bundle, reboot=True,
                        reboot_reason=why, pre=pre, post=post, opts=opts, verb=verb,
                        allow_remove=opt.allow_remove, switch=switch, swap=swap,
                        check=StreamsEnabled(check, streams) if streams else check,
                        notes=tuple(notes))


def _initramfs_step(target: Target, releases: tuple[str, ...]) -> Step:
    """nouveau's blacklist checked inside each chosen kernel's initramfs (update-initramfs on Debian, dracut on
    EL), rebuilt where it is missing."""
    dracut = target.family != "debian"
    rebuild = (lambda k: ("dracut", "-f", "--kver", k)) if dracut else (lambda k: ("update-initramfs", "-u", "-k", k))
    return Step("driver.initramfs", Stage.DRIVER, f"nouveau blacklisted inside the initramfs of {', '.join(releases)}",
                actions=tuple(Command(rebuild(k)) for k in releases),
                check=InitramfsHas(NOUVEAU_CONF, releases, dracut=dracut))


def _hold_step(target: Target, packages: tuple[str, ...], stale: tuple[str, ...] = ()) -> Step:
    """Hold the driver as its package manager holds it (provision/package_managers): apt pins the series to its
    branch, so updates within it come with the kernels that need them (a userspace newer than the loaded module until
    the reboot is the price); dnf/yum versionlock the packages until the operator upgrades them. `stale`: what a
    module stream switch removed (the other flavour's kmod), whose holds come off first (the hold renews only the
    installed packages' holds; a stale one would keep that kmod at the old branch)."""
    pm = package_managers.get(target.package_manager)
    names = tuple(p.split(":")[0] for p in packages)  # a module stream's spec: its name
    words = pm.hold_words(names)
    acts = (*([PackageInstall(pm.name, pm.hold_needs)] if pm.hold_needs else []),
            *([Command(pm.unhold(stale))] if stale else []),
            *(Command(argv) for argv in pm.hold(names)))
    return Step("driver.hold", Stage.DRIVER, words.title, actions=acts, check=Held(pm.name, names, stale),
                notes=words.notes)


def _kernel_hook_step(root: Path, target: Target) -> Step:
    """A module that cannot build for a kernel apt installs later must not fail that kernel's configuration (its
    initramfs and boot entry, and every apt run after it): DKMS's kernel hooks run its autoinstaller, which reads
    /etc/sysconfig/dkms (bookworm's dkms 3.0.10; its own options cannot: a BUILD_EXCLUSIVE mismatch is an
    autoinstall failure too); gpuprov's file there records the failure instead of passing it on. The default boot
    entry is left to the kernel's own hooks: `gpuprov verify` is red for a kernel that boots next without its module,
    and the plan's driver step builds one (the README says so). An operator's own file there is kept.
    Debian 13's dkms (3.2) no longer reads that file from its autoinstaller: there the plan names the risk instead."""
    guard = WriteFile(DKMS_SYSCONFIG, render("dkms-sysconfig.j2", failed_dir=paths.DKMS_FAILED))
    old = read_or_empty(under(root, DKMS_SYSCONFIG))
    title = "Keep a failed DKMS build from failing a kernel update: DKMS's kernel hooks record it instead"
    if target.os_id == "debian" and target.version.isdigit() and int(target.version) >= 13:
        return Step("driver.kernel-hook", Stage.DRIVER, f"{title}: not available with {target.name}'s DKMS",
                    check=Already("DKMS 3.2's autoinstaller reads no /etc/sysconfig/dkms"), verify_only=True,
                    notes=("a kernel whose module cannot build fails its configuration (apt exits 100, the kernel "
                           "left without initramfs and boot entry) until the module builds: run `gpuprov verify` "
                           "after kernel updates; `gpuprov bootstrap` builds for the kernel that boots next",))
    if old and not old.startswith(guard.content.split("\n", 1)[0]):
        return Step("driver.kernel-hook", Stage.DRIVER, f"{title}: not installed, {DKMS_SYSCONFIG} is the operator's",
                    check=Already("an operator's file"), verify_only=True,
                    notes=(f"{DKMS_SYSCONFIG} is kept as it is: a kernel whose module cannot build fails its "
                           "configuration (apt exits 100) until the module builds or the kernel is removed",))
    return Step("driver.kernel-hook", Stage.DRIVER, title, actions=(guard,),
                check=FilesMatch(((guard.path, guard.content),)),
                notes=(f"a kernel whose module cannot build still installs completely (initramfs, boot entry); the "
                       f"failure is recorded in {paths.DKMS_FAILED}/KERNEL and `gpuprov verify` names the kernel",))


def gpuprov_files(root: Path) -> tuple[str, ...]:
    """The driver stage's own files that are there (uninstall --driver removes them): the nouveau blacklist, the
    branch pin, and the DKMS hook guard when it is gpuprov's (an operator's /etc/sysconfig/dkms is not)."""
    guard = read_or_empty(under(root, DKMS_SYSCONFIG)).startswith("# Written by gpuprov")
    return tuple(f for f in (NOUVEAU_CONF, PIN_FILE, DKMS_SYSCONFIG)
                 if os.path.lexists(under(root, f)) and (f != DKMS_SYSCONFIG or guard))


def _el_repo_steps(target: Target, opt) -> list[Step]:
    el = target.el_major
    pm = package_managers.get(target.package_manager)
    if opt.bundle:
        return []  # the bundle's repository already holds the kmod / module packages
    if el and (opt.driver_source == "elrepo" or opt.driver_source == "distro" and default_source(target) == "elrepo"):
        pre = (Command(pm.import_key(repos.elrepo_key(el, opt.mirrors))),
               PackageInstall(target.package_manager, (repos.elrepo_release(el, opt.mirrors),)),
               *mirror_commands("elrepo", target, opt.mirrors))
        mirror = repos.base("elrepo", opt.mirrors) if opt.mirrors.get("elrepo") else None
        return [package_step("driver.repo", Stage.DRIVER, "Add ELRepo (elrepo-release + its key)", target, (), pre=pre,
                             check=RepoInstalled(target.package_manager, "elrepo-release",
                                                 "/etc/yum.repos.d/elrepo.repo", mirror),
                             notes=("ELRepo kmods are kABI-tracking and signed",))]
    # behind --mirror, each repository file is pointed at its mirror (its own URLs are upstream's)
    pre = ((PackageInstall(pm.name, (repos.epel_release(target, opt.mirrors),)),
            *mirror_commands("epel", target, opt.mirrors))
           if el else ()) + \
        (Command((*pm.config_manager(), "--add-repo", repos.cuda_repo(target, opt.mirrors))),
         *mirror_commands("cuda", target, opt.mirrors))
    files = ((("/etc/yum.repos.d/epel.repo", repos.base("epel", opt.mirrors) if opt.mirrors.get("epel") else None),)
             if el else ()) + \
        ((repos.cuda_repo_file(target), repos.base("cuda", opt.mirrors) if opt.mirrors.get("cuda") else None),)
    return [Step("driver.repo", Stage.DRIVER, "Add NVIDIA's CUDA repository (and EPEL for dkms)", actions=pre,
                 check=ReposAt(files))]
