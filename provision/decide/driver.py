"""The driver decision (nvidia-detect logic, done better): for each GPU its name, driver branch, kernel-module
requirement and the packages that install it on a target release; for several GPUs, which branch serves all.

Every per-distro table lives here, once; the CLI, the planner and the Ansible roles all call these functions.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import NamedTuple

from provision.decide import debian
from provision.decide.gputable import PciId, load_table, newest_branch, table_entry
from provision.decide.targets import Target
from provision.values import NVIDIA_VENDOR

# ELRepo kmod per EL major and branch ("" = ELRepo no longer builds it there; from ELRepo nvidia-detect 595.91.07).
ELREPO_KMODS: dict[int, dict[str, str]] = {
    10: {"open": "kmod-nvidia-open", "current": "kmod-nvidia", "580": "kmod-nvidia-580xx"},
    9: {"open": "kmod-nvidia-open", "current": "kmod-nvidia", "580": "kmod-nvidia-580xx", "470": "kmod-nvidia-470xx"},
    8: {"open": "kmod-nvidia-open", "current": "kmod-nvidia", "580": "kmod-nvidia-580xx", "470": "kmod-nvidia-470xx",
        "390": "kmod-nvidia-390xx"},
    7: {"current": "kmod-nvidia", "470": "kmod-nvidia-470xx", "390": "kmod-nvidia-390xx", "340": "kmod-nvidia-340xx"},
}
ELREPO_DRIVER_VERSION = "595.91.07"


# Driver branches Ubuntu packages per release (nvidia-driver-<b>[-server][-open]); -open from 515 on.
UBUNTU_BRANCHES: dict[str, tuple[int, ...]] = {
    "18.04": (390, 470),
    "20.04": (470, 535),
    "22.04": (470, 535, 550, 570, 580),
    "24.04": (535, 550, 570, 580),
}
# NVIDIA's CUDA repository: driver branches it publishes as EL8+ module streams / Ubuntu meta-packages (production
# and new-feature branches from 515 on; 470 only as EL7/EL8 legacy streams).
NVIDIA_REPO_BRANCHES: tuple[int, ...] = (470, 515, 520, 525, 530, 535, 545, 550, 555, 560, 565, 570, 575, 580, 590,
                                         595)
# "unknown-legacy": an id below the oldest current GPU that no table lists: some legacy series, which one unknown.
LEGACY_ORDER = ("current", "580", "470", "390", "367", "340", "304", "173", "96", "71", "unknown-legacy")


class GpuDecision(NamedTuple):
    pci_id: str
    subsystem: str | None
    name: str
    branch: str  # "current" or a legacy branch ("580", "470", ...)
    kernel_modules: str  # what the GPU allows: "open" | "proprietary" | "either"
    modules: str  # what gets installed: "open" | "proprietary"
    known: bool  # in the vendored table
    target: str | None = None
    source: str | None = None  # elrepo | debian | ubuntu | nvidia
    packages: tuple[str, ...] = ()
    driver_version: str | None = None  # the version the chosen packages ship, where known
    warnings: tuple[str, ...] = ()
    address: str | None = None
    pin: str | None = None  # the branch asked for with --driver <branch>

    def to_dict(self) -> dict:
        d = self._asdict()
        d["packages"] = list(self.packages)
        d["warnings"] = list(self.warnings)
        return d


class FleetDecision(NamedTuple):
    """Several GPUs on one host: does one branch serve all of them?"""

    branches: tuple[str, ...]
    common_branch: str | None
    common_modules: str | None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"branches": list(self.branches), "common_branch": self.common_branch,
                "common_modules": self.common_modules, "notes": list(self.notes)}


def is_datacenter(name: str, entry: dict | None) -> bool:
    if entry and entry.get("datacenter"):
        return True
    n = name.removeprefix("NVIDIA ").split()
    head = n[0] if n else ""
    return head.startswith(("Tesla", "GH", "GB")) or (
        len(head) >= 2 and head[0] in "AHLB" and head[1:].rstrip("SX").isdigit()
    )


def choose_modules(allowed: str, wanted: str) -> tuple[str, tuple[str, ...]]:
    """(modules to install, warnings) from what the GPU allows and what was asked (auto|open|proprietary)."""
    if wanted == "auto":
        return ("proprietary" if allowed == "proprietary" else "open"), ()
    if allowed in ("either", wanted):
        return wanted, ()
    return allowed, (f"--kernel-modules {wanted} is not supported by this GPU; using {allowed}",)


@lru_cache(maxsize=1)
def oldest_current_id() -> int:
    """The lowest device id on the current branch: NVIDIA numbers chips upwards, so an id below it that no table
    lists belongs to some legacy series, never to a new GPU."""
    return min(int(k, 16) for k, e in load_table()["devices"].items() if e["branch"] == "current")


class Identity(NamedTuple):
    """What the tables say about one PCI id."""
    name: str
    branch: str  # "current", "580", "470", …, "unknown-legacy"
    kernel_modules: str  # open | proprietary | either
    known: bool  # in a table (NVIDIA's or Debian's), not guessed from the id's range
    warnings: tuple[str, ...]


def identify(pci: PciId) -> Identity:
    """The id's name, branch and kernel modules from the table; subsystem entries win for the name. Ids the table
    lacks: Debian's lists (legacy series, or a current driver's list), else by range."""
    entry = table_entry(pci.device) if pci.vendor == NVIDIA_VENDOR else None
    if entry is None and pci.vendor == NVIDIA_VENDOR:
        legacy = debian.legacy_branch(pci.device)
        if legacy:
            return Identity(f"NVIDIA device {pci}", legacy, "proprietary", True,
                            (f"{pci} is not in NVIDIA's table; Debian's nvidia-detect lists put it in the {legacy} "
                             "legacy series",))
        if pci.device >= oldest_current_id() and debian.in_current_lists(pci.device):
            return Identity(f"NVIDIA device {pci}", "current", "either", True, ())
        if pci.device < oldest_current_id():
            return Identity(f"NVIDIA device {pci}", "unknown-legacy", "proprietary", False,
                            (f"{pci} is older than every current GPU (below 10de:{oldest_current_id():04x}) and in no "
                             "table: it needs a legacy driver series gpuprov cannot name; check NVIDIA's legacy GPU "
                             "list",))
    if entry is None:
        return Identity(
            f"NVIDIA device {pci}", "current", "open", False,
            (f"{pci} is newer than gpuprov's GPU table (NVIDIA {newest_branch()}): assuming the newest branch with "
             "the open kernel modules; refresh the table with scripts/regen_gpu_table.py",),
        )
    name = (entry.get("sub") or {}).get(pci.subsystem or "") or entry.get("name") or f"NVIDIA device {pci}"
    return Identity(name, entry["branch"], entry["modules"], True, ())


def open_module_lags(drv: debian.DebianDriver, offered: Mapping[str, frozenset[str]],
                     security: str | None = None) -> str | None:
    """Why the suite's open module cannot follow its driver, from what the apt lists offer (upstream versions per
    package), or None. Debian's driver metapackage depends on a kernel module of exactly its own version, and the
    security suite updates the proprietary module with the driver (bookworm-security: nvidia-driver and
    nvidia-kernel-dkms 535.309.01) while the open one (contrib, another source package) stays behind (535.261.03):
    apt cannot install the open module with the newest driver, and a held open module gets no update for a newer
    kernel it fails to build against. security: the suite's security suite, where apt has fetched its lists."""
    drivers, opens = offered.get(drv.package, frozenset()), offered.get(drv.open_dkms or "", frozenset())
    if not opens and not drivers and security:
        # the lists cannot tell yet (non-free and contrib not enabled: the installer's default), and what they will
        # show must not change the flavour on the next run: the security suite is where the driver's updates come from
        return (f"apt fetches {security}, and its lists show neither {drv.package} nor {drv.open_dkms} yet "
                f"(their components are not enabled): Debian's security suite updates {drv.package} with its "
                f"proprietary module (one source package), not {drv.open_dkms} (contrib, another source package; "
                "bookworm-security: 535.309.01 without it), so the open module does not follow the driver's updates")
    if not opens and drivers:
        opens = frozenset({drv.version})  # contrib not enabled yet: the suite's own open module (the point release's)
    missing = sorted(drivers - opens)
    if not opens or not missing:
        return None
    return (f"the archive's {drv.package} {', '.join(missing)} has no {drv.open_dkms} of its version (it offers "
            f"{', '.join(sorted(opens))}): the open module does not follow the driver's updates")


def _debian_packages(device: int, modules: str, allowed: str, wanted: str, suite: str, pin: str | None,
                     offered: Mapping[str, frozenset[str]] | None = None, security: str | None = None,
                     origins: Mapping[str, Mapping[str, frozenset[str]]] | None = None
                     ) -> tuple[tuple[str, ...], str | None, str | None, tuple[str, ...]]:
    """Debian's own recommendation (nvidia-detect's lists and order), or the pinned branch's package; the last item:
    notes on the module flavour chosen. For a GPU both flavours drive, the flavour the archive maintains where only
    one is (debian.upkeep, from `origins`: which suite carries each one's newest version); else the open module, as
    long as it follows the driver (open_module_lags). A GPU one flavour alone drives keeps that one."""
    drv, problem = debian.pinned(device, suite, pin) if pin else debian.recommend(device, suite)
    if drv is None:
        return (), None, problem + ("; use NVIDIA's repository (--driver-source nvidia)" if not pin else ""), ()
    if modules == "open" and not drv.open_dkms and allowed == "either" and wanted == "auto":
        modules = "proprietary"  # a Tesla/legacy package: proprietary modules only, which this GPU also runs
    kept = debian.upkeep(drv, origins, suite) if origins else debian.Upkeep(None)
    lags = open_module_lags(drv, offered or {}, security) if modules == "open" and drv.open_dkms and \
        not kept.flavour else None
    notes: tuple[str, ...] = ()
    if kept.flavour and allowed == "either":  # the archive tells which flavour it maintains: that one, unless asked
        chosen = kept.flavour if wanted == "auto" else wanted
        notes = ((f"{kept.why}: installing the {chosen} module, which this GPU also runs",) if chosen == kept.flavour
                 else (f"the {wanted} module (--kernel-modules {wanted}, or the flavour of gpuprov's series while it "
                       f"serves every kernel), not the maintained one: {kept.why}; a kernel the {wanted} module cannot "
                       "build for leaves the node without its module until that flavour is updated",))
        modules = chosen
    elif lags and allowed == "either" and wanted == "auto":
        modules, notes = "proprietary", (f"{lags}; installing the proprietary module ({drv.kernel_dkms}), which this "
                                         "GPU also runs and which the driver's updates keep in step",)
    elif lags:
        notes = (f"{lags}; apt may refuse to install it with the newest driver",)
    if modules == "open":
        if not drv.open_dkms:
            return (), None, (f"Debian {debian.SUITES[suite].version}'s {drv.package} ({drv.branch}) has no open "
                              "kernel modules package; this GPU needs them" + (
                                  "" if pin else "; use NVIDIA's repository (--driver-source nvidia)")), notes
        return (drv.open_dkms, drv.package, *drv.node_packages, "firmware-misc-nonfree"), drv.version, None, notes
    firmware = ("firmware-misc-nonfree",) if drv.package == "nvidia-driver" else ()
    return (drv.kernel_dkms, drv.package, *drv.node_packages, *firmware), drv.version, None, notes


def supports_branch(entry: dict | None, gpu_branch: str, b: int) -> bool:
    """Does driver major B drive this GPU? Current GPUs: any branch from the oldest packaged one that knew them;
    legacy GPUs: up to their legacy branch only."""
    if gpu_branch == "unknown-legacy":
        return False
    if gpu_branch != "current" and b > int(gpu_branch):
        return False
    majors = [int(m) for m, st in ((entry or {}).get("drivers") or {}).items() if st == "current"]
    if entry is None:
        return b >= 570  # newer than our tables: only recent branches can know it
    return not majors or b >= min(majors)


def _pin_refusal(what: str, b: str, avail, entry, gpu_branch) -> str:
    ok = [str(x) for x in sorted(avail, reverse=True) if supports_branch(entry, gpu_branch, int(x))]
    return (f"{what} does not {'support this GPU with' if str(b) in map(str, avail) else 'package'} driver branch "
            f"{b}; " + (f"branches that support it there: {', '.join(ok)}" if ok else "no branch there supports it"))


def _min_branch(entry: dict | None) -> int:
    """Oldest packaged driver major known to support the device as current (570 when newer than our tables)."""
    majors = [int(m) for m, st in ((entry or {}).get("drivers") or {}).items() if st == "current"]
    return min(majors) if majors else 570


def _ubuntu_packages(entry, branch, modules, release, datacenter, pin=None
                     ) -> tuple[tuple[str, ...], str | None, str | None]:
    avail = UBUNTU_BRANCHES[release]
    if pin:
        b = int(pin)
        if b not in avail or not supports_branch(entry, branch, b):
            return (), None, _pin_refusal(f"Ubuntu {release}", pin, avail, entry, branch)
        usable = [b]
    elif branch == "current":
        usable = [b for b in avail if b >= max(_min_branch(entry), 520)]
    elif branch.isdigit():
        usable = [b for b in avail if b <= int(branch) and (int(branch) > 470 or b == int(branch))]
        usable = [b for b in usable if b >= _min_branch(entry)] or usable
    else:
        usable = []
    if not usable:
        return (), None, f"Ubuntu {release} packages no driver branch that supports this GPU (branch {branch})"
    b = max(usable)
    opn = "-open" if modules == "open" and b >= 515 else ""
    if modules == "open" and b < 515:
        return (), None, f"Ubuntu {release}'s branch {b} has no open kernel modules; this GPU needs them"
    if datacenter:
        return (f"nvidia-headless-{b}-server{opn}", f"nvidia-utils-{b}-server"), str(b), None
    return (f"nvidia-driver-{b}{opn}",), str(b), None


def ubuntu_dkms_package(packages: tuple[str, ...] | list[str]) -> str | None:
    """The DKMS module package Ubuntu's driver metapackage pulls in, by Ubuntu's naming: nvidia-headless-B-server[-open]
    and nvidia-driver-B[-open] depend on nvidia-dkms-<the same suffix> (whose `dkms status` lines say whether the
    module was built). None for a package list that is not Ubuntu's."""
    for p in packages:
        for meta in ("nvidia-headless-", "nvidia-driver-"):
            rest = p.removeprefix(meta)
            if rest != p and rest[:1].isdigit():
                return f"nvidia-dkms-{rest}"
        # NVIDIA's repository for Ubuntu: nvidia-open-580 and cuda-drivers-580 pull in nvidia-driver-580[-open]
        for meta, suffix in (("nvidia-open-", "-open"), ("cuda-drivers-", "")):
            rest = p.removeprefix(meta)
            if rest != p and rest.isdigit():
                return f"nvidia-dkms-{rest}{suffix}"
    return None


def _elrepo_packages(entry, branch: str, modules: str, el_major: int, pin: str | None = None
                     ) -> tuple[tuple[str, ...], str | None, str | None]:
    kmods = ELREPO_KMODS[el_major]
    if pin:
        newest = newest_branch()
        avail = [int(k) for k in kmods if k.isdigit()] + [int(newest)]
        if int(pin) not in avail or not supports_branch(entry, branch, int(pin)):
            return (), None, _pin_refusal(f"ELRepo for EL{el_major}", pin, avail, entry, branch) + \
                "; or NVIDIA's repository (--driver-source nvidia)"
        if pin == newest:
            branch = "current"
        else:
            if modules == "open":
                return (), None, f"ELRepo's kmod-nvidia-{pin}xx has no open kernel modules; this GPU needs them"
            branch = pin
    key = "open" if branch == "current" and modules == "open" else branch
    name = kmods.get(key, "")
    if not name:
        return (), None, f"ELRepo no longer builds the {key} driver for EL{el_major}"
    return (name,), (ELREPO_DRIVER_VERSION if branch == "current" else branch), None


def nvidia_repo_packages(branch: str, modules: str, target: Target) -> tuple[str, ...]:
    """Packages/module streams from NVIDIA's CUDA repository (EL7: branch meta-package; EL8+: dnf module stream).
    A stream is a *branch* (580-open, latest-dkms), never an exact version: pinning 580.159.04 as a stream name is
    the known bug; exact versions are pinned as package versions instead (see plan.driver)."""
    b = "latest" if branch == "current" else branch
    if target.family == "rhel" and target.el_major == 7:  # NVIDIA's rhel7 tree: branch metapackages, no streams
        return (f"nvidia-driver-branch-{b if b != 'latest' else newest_branch()}",)
    if target.family == "rhel" and (target.el_major or 0) >= 10:
        # EL 10 has no module streams: NVIDIA's rhel10 repository carries the meta-packages alone (nvidia-open: the
        # open modules; cuda-drivers: the proprietary), a branch as their version (NVIDIA's driver installation
        # guide, "Kernel Modules": `dnf install nvidia-open`): the newest branch only (see _nvidia_repo)
        return ("nvidia-open",) if modules == "open" else ("cuda-drivers",)
    if target.family == "rhel":
        if modules == "open":
            return ("nvidia-driver:open-dkms",) if b == "latest" else (f"nvidia-driver:{b}-open",)
        return (f"nvidia-driver:{b}-dkms",)
    b = newest_branch() if b == "latest" else b
    return (f"nvidia-open-{b}",) if modules == "open" else (f"cuda-drivers-{b}",)


# EL-compatible releases that boot a kernel line of their own, not Red Hat's: ELRepo's kmods (kABI-tracking, built
# for Red Hat's kernel) load into none of them, so their driver comes from NVIDIA's repository, built by DKMS against
# the distribution's kernel-devel. Alibaba Cloud Linux 3 (PLATFORM_ID platform:al8, EL 8 userspace) runs 5.10
# (5.10.134-15.1.al8), where RHEL 8 runs 4.18.
OWN_KERNEL_LINE = frozenset({"alinux"})


def default_source(target: Target) -> str:
    if target.family == "debian":
        return target.os_id
    return "elrepo" if target.el_major and target.os_id not in OWN_KERNEL_LINE else "nvidia"


def _nvidia_repo(entry, branch, modules, target, pin) -> tuple[tuple[str, ...], str | None, str | None]:
    if target.family == "rhel" and (target.el_major or 0) >= 10 and (pin or branch != "current"):
        # no module streams on EL 10: nothing in NVIDIA's repository keeps an older branch (its meta-packages require
        # their components at >= their version), so only the newest branch installs from it
        return (), None, (f"NVIDIA's repository for {target.name} has no branch streams (EL 10 has no modularity): "
                          f"it installs the newest driver only, not branch {pin or branch}; use ELRepo "
                          "(--driver-source elrepo) or --driver auto")
    if pin:
        avail = [b for b in NVIDIA_REPO_BRANCHES if b != 470 or (target.el_major or 0) in (7, 8)]
        if int(pin) not in avail or not supports_branch(entry, branch, int(pin)):
            return (), None, _pin_refusal("NVIDIA's repository for " + target.name, pin, avail, entry, branch)
        if modules == "open" and int(pin) < 515:
            return (), None, f"driver branch {pin} has no open kernel modules; this GPU needs them"
        return nvidia_repo_packages(pin, modules, target), pin, None
    return nvidia_repo_packages(branch, modules, target), None, None


def packaged_branches(target: Target, source: str | None = None) -> tuple[int, ...]:
    """The driver branches `--driver BRANCH` can name on this target from this source (newest first), whatever the
    GPU: the same tables decide_gpu pins from."""
    src = source or default_source(target)
    if src == "nvidia":
        avail = [b for b in NVIDIA_REPO_BRANCHES if b != 470 or (target.el_major or 0) in (7, 8)]
    elif src == "elrepo":
        kmods = ELREPO_KMODS.get(target.el_major or 0, {})
        avail = [int(k) for k in kmods if k.isdigit()] + ([int(newest_branch())] if kmods else [])
    elif target.os_id == "debian":
        avail = [int(d.branch) for d in debian.SUITES[target.codename].drivers]
    elif target.os_id == "ubuntu":
        avail = list(UBUNTU_BRANCHES[target.version])
    else:
        avail = []
    return tuple(sorted(set(avail), reverse=True))


def decide_gpu(pci: PciId, target: Target | None, *, kernel_modules: str = "auto", source: str | None = None,
               address: str | None = None, pin: str | None = None,
               offered: Mapping[str, frozenset[str]] | None = None, security: str | None = None,
               origins: Mapping[str, Mapping[str, frozenset[str]]] | None = None) -> GpuDecision:
    """pin: a driver branch ("535") asked for with --driver; refused (no packages, a warning with the way out)
    where the branch does not drive this GPU or the target does not package it. offered: the upstream versions
    the host's apt lists offer per package (facts.packages.archive_versions), where known; security: the target's
    security suite where apt has fetched its lists (Debian); origins: per package, the upstream versions each suite
    offers (facts.packages.suite_versions), which tell the flavour the archive maintains."""
    ident = identify(pci)
    allowed = ident.kernel_modules
    if pin and pin != "current" and int(pin) < 515 and allowed == "either":
        allowed = "proprietary"  # branches before 515 have no open modules: a Turing+ GPU runs proprietary there
    modules, w2 = choose_modules(allowed, kernel_modules)
    warnings = ident.warnings + w2
    pin = None if pin == "current" else pin
    name, branch = ident.name, ident.branch
    base = dict(pci_id=str(pci), subsystem=pci.subsystem, name=name, branch=branch, kernel_modules=allowed,
                modules=modules, known=ident.known, address=address, pin=pin)
    if target is None:
        return GpuDecision(**base, warnings=warnings)
    entry = table_entry(pci.device) if pci.vendor == NVIDIA_VENDOR else None
    src = source or default_source(target)
    problem = None
    if src == "nvidia":
        pkgs, ver, problem = _nvidia_repo(entry, branch, modules, target, pin)
    elif src == "elrepo":
        if not target.el_major:
            pkgs, ver, problem = (), None, f"ELRepo does not serve {target.name}; use --driver-source nvidia"
        else:
            pkgs, ver, problem = _elrepo_packages(entry, branch, modules, target.el_major, pin)
    elif target.os_id == "debian":
        pkgs, ver, problem, notes = _debian_packages(pci.device, modules, allowed, kernel_modules, target.codename,
                                                     pin, offered, security, origins)
        warnings += notes
        if pkgs and modules == "open" and "nvidia-open-kernel-dkms" not in pkgs:
            base["modules"] = "proprietary"
    elif target.os_id == "ubuntu":
        pkgs, ver, problem = _ubuntu_packages(entry, branch, modules, target.version, is_datacenter(name, entry),
                                              pin)
    else:
        pkgs, ver, problem = (), None, f"driver source {src!r} does not apply to {target.name}"
    if problem:
        warnings = warnings + (problem,)
    return GpuDecision(**base, target=target.name, source=src, packages=pkgs, driver_version=ver, warnings=warnings)


def compatible_branches(branch: str) -> set[str]:
    """Branches that drive a GPU: current GPUs also run on 580 (the last branch before Maxwell-Volta moved to
    legacy supports every GPU the current branch had then); legacy GPUs only on their own branch."""
    return {"current", "580"} if branch == "current" else {branch}


def decide_fleet(decisions: list[GpuDecision]) -> FleetDecision | None:
    if len(decisions) < 2:
        return None
    branches = tuple(sorted({d.branch for d in decisions}, key=LEGACY_ORDER.index))
    common = set.intersection(*(compatible_branches(d.branch) for d in decisions))
    # Brand-new (unknown) GPUs are only known to work on the newest branch.
    if any(not d.known for d in decisions):
        common &= {"current"}
    best = next((b for b in LEGACY_ORDER if b in common), None)
    allowed = {d.kernel_modules for d in decisions}
    mods = None
    if best:
        if "open" in allowed and "proprietary" in allowed:
            mods = None
        elif "open" in allowed:
            mods = "open"
        elif "proprietary" in allowed or best != "current":
            mods = "proprietary"
        else:
            mods = "open"
    notes = []
    if len(branches) > 1:
        notes.append("GPUs need different branches: " + ", ".join(
            f"{d.address or d.pci_id} ({d.name}) -> {d.branch}" for d in decisions))
    if best is None:
        notes.append("no single driver branch serves all GPUs: split them across hosts or pass through with vfio")
    elif mods is None:
        notes.append(f"branch {best} serves all GPUs, but some need the open and some the proprietary kernel modules")
    return FleetDecision(branches, best, mods, tuple(notes))
