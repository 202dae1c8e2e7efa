"""The driver already on the host, as the driver stage meets it: a loaded driver left alone (only when nothing asked
differs from it and the kernel that boots next has its module), one gpuprov did not install kept (or, where --driver
or --kernel-modules asks for another, refused with exit 14), the series gpuprov installed and pinned (which `auto`
keeps following), and, on Ubuntu, the move of that series' modules between Canonical's precompiled packages and DKMS
(decide/kernel.py: ubuntu_module_move). Read through the plan's root; plan/driver.py builds the steps."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from provision import package_managers, paths, record
from provision.decide.kernel import (
    METAPACKAGE_RE,
    ModuleMove,
    kernel_metapackages,
    pinned_series,
    ubuntu_module_move,
    ubuntu_series,
    without_dkms,
)
from provision.decide.targets import Target
from provision.errors import CONFLICT, GpuprovError
from provision.facts.boot import installed_kernels, nvidia_module, unpinned_next_kernel
from provision.facts.driver_facts import DRIVER_PACKAGE_RE, InstalledDriver, installed_driver
from provision.facts.packages import dpkg_installed, offered_module_packages
from provision.facts.rootfs import under
from provision.options import Stage
from provision.package_managers.apt import read_pins
from provision.package_managers.base import PackageManager
from provision.plan.boot_default import pin_state
from provision.plan.steps import Already, Step
from provision.report import HostReport


def boot_kernel(root: Path) -> str | None:
    """The kernel the next boot starts (facts/boot.py: GRUB's default, /vmlinuz), when the package manager installed
    it (its modules directory is there); else the newest installed. While gpuprov keeps the default boot entry on a
    kernel with a module (plan/boot_default.py), the kernel that would boot without that: the driver stage keeps
    building for it, and gives the default entry back once it has its module."""
    rel = unpinned_next_kernel(root, pin_state(root) is not None)
    if rel and under(root, f"/lib/modules/{rel}").is_dir():
        return rel
    kernels = installed_kernels(root)
    return kernels[-1] if kernels else None


def module_built(root: Path, kernel: str) -> bool:
    return nvidia_module(root, kernel) is not None


def series_installed(root: Path) -> dict:
    """dpkg's packages, those of the sources gpuprov pinned counted as held (decide/kernel.py: pinned_series)."""
    return pinned_series(dpkg_installed(root), read_pins(root))


def present_step(report: HostReport, gpus: list, baking: bool, target: Target, opt=None) -> Step | None:
    """The verify-only step when there is no GPU, or a loaded driver with its userspace when nothing asked differs
    from what is there (unless baking an image for GPUs this machine does not have, the kernel that boots next lacks
    the module of the driver gpuprov holds, or Ubuntu's precompiled modules are back for that driver); None when the
    driver stage is planned."""
    drv = report.driver
    if not gpus:
        return Step("driver.none", Stage.DRIVER, "No NVIDIA GPU on the PCI bus: no driver to install",
                    check=Already("no GPU"), verify_only=True)
    if not (drv and drv.loaded and (drv.driver_root or drv.userspace_version)) or baking:
        return None
    root = Path(report.root or "/")
    ours = tuple(dict.fromkeys(p for d in gpus for p in d.packages))
    if _asked_change(drv, opt, held_driver(root)):
        return None  # --driver / --kernel-modules differ from the loaded driver: planned, never skipped
    # the packages installed for the kernels, whichever path installed them (Ubuntu's precompiled path installs the
    # headless metapackage's no-DKMS twin, not the decision's name)
    installed = tuple(drv.installed.packages) if drv.installed else ()
    series = tuple(dict.fromkeys((*ours, *without_dkms(ours), *installed)))
    if _boot_kernel_unserved(root, drv.kernel_release, target, series) or _moves_back(root, target, ours):
        return None
    return Step("driver.present", Stage.DRIVER,
                f"NVIDIA driver {drv.version} ({drv.kernel_module}) already loaded with "
                f"userspace in {drv.driver_root}: left alone", check=Already("driver loaded"),
                verify_only=True)


class HeldDriver(NamedTuple):
    """The driver series gpuprov installed and pinned (or held): its branch and, on Ubuntu, its module flavour."""
    branch: str
    modules: str | None  # "open" | "proprietary" (Ubuntu's series names say it); None: not told by the name
    package: str  # its metapackage, in words


def held_driver(root: Path) -> HeldDriver | None:
    """gpuprov's series on an apt host (the metapackage of a pinned source, or one on hold), else None. Without
    --driver the branch never changes: `auto` plans for this series (commands/plan.py)."""
    held = sorted(p for p in series_installed(root).values() if p.held and METAPACKAGE_RE.match(p.name))
    if not held:
        return None
    meta = held[0]
    series = ubuntu_series([meta.name])
    modules = (debian_flavour(root) if series is None else "open" if series.endswith("-open") else "proprietary")
    return HeldDriver(meta.upstream.split(".")[0], modules, f"{meta.name} {meta.upstream}")


def debian_flavour(root: Path) -> str | None:
    """The module flavour of gpuprov's Debian series (its kernel-module package), kept while it serves every installed
    kernel; None once a kernel has no module (it could not build there, or nothing tried): then the archive decides
    the flavour (decide/debian.py: upkeep), and where it maintains only the other one, the series moves to it within
    its branch (decide/kernel.py: series_update)."""
    dkms = [n for n, p in series_installed(root).items() if p.held and n.endswith("kernel-dkms")]
    if not dkms or not all(module_built(root, k) for k in installed_kernels(root)):
        return None
    return "open" if any("-open-" in n for n in dkms) else "proprietary"


def _asked_change(drv, opt, held: HeldDriver | None) -> str:
    """What --driver and --kernel-modules ask that differs from the loaded driver or the series gpuprov holds on
    disk (in words; "" when nothing asked differs, or nothing was asked)."""
    if opt is None:
        return ""
    loaded = (drv.version or "").split(".")[0]
    asked = str(getattr(opt, "driver", "auto"))
    if asked.isdigit() and (asked != loaded or (held and held.branch != asked)):
        return f"--driver {asked} ({drv.version or 'a driver of unknown version'} is loaded)"
    modules = str(getattr(opt, "kernel_modules", "auto"))
    if modules in ("open", "proprietary") and (drv.kernel_module not in (None, modules) or
                                                 (held and held.modules not in (None, modules))):
        return f"--kernel-modules {modules} (the {drv.kernel_module} module is loaded)"
    return ""


def ubuntu_move(root: Path, target: Target, packages, kernels: tuple[str, ...]) -> ModuleMove | None:
    """The move of an installed Ubuntu series' modules between Canonical's packages and DKMS (decide/kernel.py)."""
    if target.os_id != "ubuntu" or not package_managers.get(target.package_manager).checked_driver_install:
        return None
    installed = series_installed(root)
    return ubuntu_module_move(installed, packages, kernel_metapackages(installed), kernels, tuple(installed_kernels(root)),
                              offered_module_packages(root))


def _moves_back(root: Path, target: Target, packages: tuple[str, ...]) -> bool:
    """gpuprov's held Ubuntu series builds with DKMS while the archive now has Canonical's precompiled modules for
    every installed kernel: the driver stage moves back to them (the module loaded now is left as it is until the
    reboot)."""
    if target.os_id != "ubuntu" or not held_series(root, target, list(packages)):
        return False
    move = ubuntu_move(root, target, packages, tuple(installed_kernels(root)))
    return bool(move and move.to == "precompiled")


def held_series(root: Path, target: Target, packages: list[str]) -> bool:
    """The driver this plan installs is installed and held (its package manager's driver_held): the series gpuprov
    installed (its hold step), which it keeps following (another module flavour, an update within the branch for a
    new kernel). On Ubuntu the headless metapackage's no-DKMS twin counts: the precompiled path installs that one."""
    names = (*packages, *without_dkms(packages)) if target.os_id == "ubuntu" else tuple(packages)
    return package_managers.get(target.package_manager).driver_held(root, tuple(dict.fromkeys(names)))


def _boot_kernel_unserved(root: Path, running: str | None, target: Target, packages: tuple[str, ...]) -> bool:
    """A driver loaded from gpuprov's held series while the kernel that boots next (a kernel update) has no nvidia
    module: the driver stage runs for that kernel instead of leaving the driver alone. `packages`: every name the
    series can be installed under (the decision's, Ubuntu's no-DKMS twin, the driver packages dpkg lists)."""
    boot = boot_kernel(root)
    if not boot or boot == running or module_built(root, boot):
        return False
    return package_managers.get(target.package_manager).driver_held(root, packages)


def installed_driver_of(drv, root: Path, pm: PackageManager) -> InstalledDriver | None:
    """The driver on disk the facts found (dpkg's packages, the .run installer), else the driver packages the
    package manager's database lists (rpm's: the facts layer reads files, rpm's database is asked through the
    adapter; apt's answer is the dpkg database the facts read already). None: no driver on disk."""
    if drv is None or drv.installed is not None:
        return drv.installed if drv else None
    return installed_driver(root, pm.installed_packages(root, DRIVER_PACKAGE_RE.match))


def _recorded(root: Path, packages: tuple[str, ...]) -> bool:
    """`packages` are in gpuprov's install record (its driver stage): a driver gpuprov installed, before its reboot.
    dnf's record keeps side-by-side packages by NAME-VERSION-RELEASE.ARCH, so a name matches those too."""
    try:
        rec = record.read(str(under(root, paths.INSTALL_RECORD)))
    except GpuprovError:
        return False  # an untrusted or broken record names nothing of gpuprov's here (uninstall refuses it itself)
    ours = rec.packages.get("driver", [])
    return bool(packages) and all(any(record.entry_names(o, p) for o in ours) for p in packages)


def keep_installed(inst: InstalledDriver | None, packages: list[str], opt, baking: bool, pm: PackageManager,
                   root: Path, ours: bool = False, drv=None) -> Step | None:
    """A driver on disk that gpuprov did not install is kept, with no driver step: NVIDIA's CUDA-repository
    packages and the .run installer always (installing the distro's over them breaks both), the distribution's (or,
    on EL, ELRepo's) driver of another branch unless --driver names one. Where --driver or --kernel-modules asks for
    something else than such a kept driver (or than a loaded one no package manager installed), the run is refused
    (exit 14) rather than skipped. None: plan the install (nothing there, the packages this plan installs: their own
    checks say done, or `ours`: the series gpuprov installed and held, or the packages its install record names)."""
    loaded = bool(drv and drv.loaded)
    if inst is None and loaded and not baking:
        asked = _asked_change(drv, opt, None)
        if asked:
            raise GpuprovError(f"{asked}: the loaded NVIDIA driver {drv.version} (userspace in "
                               f"{drv.driver_root or 'an unknown place'}) was not installed by the package manager, "
                               "and gpuprov never replaces a driver it did not install: remove it first, or leave "
                               "the option out to keep it", exit_code=CONFLICT)
    if inst is None or baking or _recorded(root, inst.packages):
        return None
    if inst.source in ("distro", "elrepo"):
        mine = {p for p in packages if DRIVER_PACKAGE_RE.match(p)}
        flavour = str(getattr(opt, "kernel_modules", "auto")) != "auto" and pm.driver_held(root, inst.packages)
        if mine <= set(inst.packages) or opt.driver != "auto" or ours or flavour:
            return None  # flavour: the other module flavour asked of gpuprov's series replaces it (_apt_facts)
    hint = " && ".join(" ".join(a) for a in pm.removal_hint(root, inst.packages)) if inst.packages else ""
    replace = {"cuda-repo": f"to have gpuprov install its own instead, remove NVIDIA's packages first ({hint})",
               "run-installer": "to have gpuprov install the distribution's driver instead, remove it first "
                                "(nvidia-installer --uninstall)",
               "distro": "`--driver <branch>` replaces it", "elrepo": "`--driver <branch>` replaces it"}[inst.source]
    asked = _asked_change(drv, opt, None) if loaded else _asked_of_kept(inst, opt)
    if asked:  # what was asked is refused, never skipped
        raise GpuprovError(f"{asked}: {inst.describe()} is {'loaded' if loaded else 'installed'}, and gpuprov "
                           f"never replaces a driver it did not install: {replace}; or leave the option out to keep "
                           "it", exit_code=CONFLICT)
    boot = [f"reboot to load it: the module is on disk for {', '.join(inst.modules)}" if inst.modules else
            "no nvidia module on disk for any kernel: its package's build may have failed"]
    if inst.reboot_pending:
        boot.append("a reboot is pending (/run/reboot-required)")
    state = "loaded" if loaded else "installed, not loaded"
    return Step("driver.installed", Stage.DRIVER, f"{inst.describe()}: {state}: kept (no driver step)",
                check=Already("a driver gpuprov did not install"), verify_only=True,
                notes=(*boot, f"gpuprov never replaces a driver it did not install: {replace}"))


def _asked_of_kept(inst: InstalledDriver, opt) -> str:
    """What --driver and --kernel-modules ask that differs from a driver on disk, not loaded (its main package's
    version; its flavour as its package names tell: nvidia-open, kmod-nvidia-open-dkms, nvidia-driver-580-open)."""
    asked = str(getattr(opt, "driver", "auto"))
    if asked.isdigit() and inst.version and inst.version.split(".")[0] != asked:
        return f"--driver {asked} (NVIDIA driver {inst.version} is installed)"
    modules = str(getattr(opt, "kernel_modules", "auto"))
    flavour = ("open" if any("open" in p for p in inst.packages) else "proprietary") if inst.packages else None
    if modules in ("open", "proprietary") and flavour not in (None, modules):
        return f"--kernel-modules {modules} (the {flavour} module is installed)"
    return ""
