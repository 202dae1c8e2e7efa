"""The driver decision (nvidia-detect logic, done better): for each GPU its name, driver branch, kernel-module
requirement and the packages that install it on a target release; for several GPUs, which branch serves all.

Every per-distro table lives here, once; the CLI, the planner and the Ansible roles all call these functions.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from provision.decide.gputable import PciId, newest_branch, table_entry
from provision.decide.targets import Target

NVIDIA = 0x10DE

# ELRepo kmod per EL major and branch ("" = ELRepo no longer builds it there; from ELRepo nvidia-detect 595.91.07).
ELREPO_KMODS: dict[int, dict[str, str]] = {
    10: {"open": "kmod-nvidia-open", "current": "kmod-nvidia", "580": "kmod-nvidia-580xx"},
    9: {"open": "kmod-nvidia-open", "current": "kmod-nvidia", "580": "kmod-nvidia-580xx", "470": "kmod-nvidia-470xx"},
    8: {"open": "kmod-nvidia-open", "current": "kmod-nvidia", "580": "kmod-nvidia-580xx", "470": "kmod-nvidia-470xx",
        "390": "kmod-nvidia-390xx"},
    7: {"current": "kmod-nvidia", "470": "kmod-nvidia-470xx", "390": "kmod-nvidia-390xx", "340": "kmod-nvidia-340xx"},
}
ELREPO_DRIVER_VERSION = "595.91.07"


@dataclass(frozen=True)
class DebianSuite:
    driver_version: str  # what `nvidia-driver` packages in that suite
    table: str  # which supported-gpus.json (driver major) describes that version
    legacy: dict[str, str]  # legacy branch -> package of that suite
    open_package: str | None  # the open kernel modules' DKMS package, if the suite has one


# Debian's non-free `nvidia-driver` per suite (apt-cache policy, 2026-11) and the legacy packages each suite carries.
DEBIAN_SUITES: dict[str, DebianSuite] = {
    "bullseye": DebianSuite("470.256.02", "470", {"390": "nvidia-legacy-390xx-driver"}, None),
    "bookworm": DebianSuite("535.261.03", "535", {"470": "nvidia-tesla-470-driver"}, "nvidia-open-kernel-dkms"),
    "trixie": DebianSuite("550.163.01", "550", {}, "nvidia-open-kernel-dkms"),
}
# Driver branches Ubuntu packages per release (nvidia-driver-<b>[-server][-open]); -open from 515 on.
UBUNTU_BRANCHES: dict[str, tuple[int, ...]] = {
    "18.04": (390, 470),
    "20.04": (470, 535),
    "22.04": (470, 535, 550, 570, 580),
    "24.04": (535, 550, 570, 580),
}
LEGACY_ORDER = ("current", "580", "470", "390", "367", "340", "304", "173", "96", "71")


@dataclass(frozen=True)
class GpuDecision:
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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["packages"] = list(self.packages)
        d["warnings"] = list(self.warnings)
        return d


@dataclass(frozen=True)
class FleetDecision:
    """Several GPUs on one host: does one branch serve all of them?"""

    branches: tuple[str, ...]
    common_branch: str | None
    common_modules: str | None
    notes: tuple[str, ...] = field(default=())

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


def identify(pci: PciId) -> tuple[str, str, str, bool, tuple[str, ...]]:
    """(name, branch, kernel_modules, known, warnings) from the table; subsystem entries win for the name."""
    entry = table_entry(pci.device) if pci.vendor == NVIDIA else None
    if entry is None:
        return (
            f"NVIDIA device {pci}", "current", "open", False,
            (f"{pci} is newer than gpuprov's GPU table (NVIDIA {newest_branch()}): assuming the newest branch with "
             "the open kernel modules; refresh the table with scripts/regen_gpu_table.py",),
        )
    name = (entry.get("sub") or {}).get(pci.subsystem or "") or entry.get("name") or f"NVIDIA device {pci}"
    return name, entry["branch"], entry["modules"], True, ()


def _debian_packages(entry: dict | None, branch: str, modules: str, suite: str) -> tuple[tuple[str, ...], str | None, str | None]:
    s = DEBIAN_SUITES[suite]
    status = (entry or {}).get("drivers", {}).get(s.table)
    if status == "current":
        if modules == "open" and s.open_package:
            return (s.open_package, "nvidia-driver", "firmware-misc-nonfree"), s.driver_version, None
        if modules == "open":
            return (), None, f"Debian {suite} has no open kernel modules package; this GPU needs them"
        return ("nvidia-kernel-dkms", "nvidia-driver", "firmware-misc-nonfree"), s.driver_version, None
    if status in s.legacy:
        return (s.legacy[status],), status, None
    return (), None, (
        f"Debian {suite}'s nvidia-driver {s.driver_version} does not support this GPU (branch {branch}); "
        "use a Debian release that packages a driver for it, or NVIDIA's repository (--driver-source nvidia)"
    )


def _min_branch(entry: dict | None) -> int:
    """Oldest packaged driver major known to support the device as current (570 when newer than our tables)."""
    majors = [int(m) for m, st in ((entry or {}).get("drivers") or {}).items() if st == "current"]
    return min(majors) if majors else 570


def _ubuntu_packages(entry, branch, modules, release, datacenter) -> tuple[tuple[str, ...], str | None, str | None]:
    avail = UBUNTU_BRANCHES[release]
    if branch == "current":
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
        return (), None, f"Ubuntu {release}'s newest usable branch {b} has no open kernel modules; this GPU needs them"
    if datacenter:
        return (f"nvidia-headless-{b}-server{opn}", f"nvidia-utils-{b}-server"), str(b), None
    return (f"nvidia-driver-{b}{opn}",), str(b), None


def _elrepo_packages(branch: str, modules: str, el_major: int) -> tuple[tuple[str, ...], str | None, str | None]:
    kmods = ELREPO_KMODS[el_major]
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
    if target.family == "rhel" and target.package_manager == "yum":
        return (f"nvidia-driver-branch-{b if b != 'latest' else newest_branch()}",)
    if target.family == "rhel":
        if modules == "open":
            return ("nvidia-driver:open-dkms",) if b == "latest" else (f"nvidia-driver:{b}-open",)
        return (f"nvidia-driver:{b}-dkms",)
    b = newest_branch() if b == "latest" else b
    return (f"nvidia-open-{b}",) if modules == "open" else (f"cuda-drivers-{b}",)


def default_source(target: Target) -> str:
    if target.family == "debian":
        return target.os_id
    return "elrepo" if target.el_major else "nvidia"


def decide_gpu(pci: PciId, target: Target | None, *, kernel_modules: str = "auto", source: str | None = None,
               address: str | None = None) -> GpuDecision:
    name, branch, allowed, known, warnings = identify(pci)
    modules, w2 = choose_modules(allowed, kernel_modules)
    warnings = warnings + w2
    base = dict(pci_id=str(pci), subsystem=pci.subsystem, name=name, branch=branch, kernel_modules=allowed,
                modules=modules, known=known, address=address)
    if target is None:
        return GpuDecision(**base, warnings=warnings)
    entry = table_entry(pci.device) if pci.vendor == NVIDIA else None
    src = source or default_source(target)
    problem = None
    if src == "nvidia":
        pkgs, ver = nvidia_repo_packages(branch, modules, target), None
    elif src == "elrepo":
        if not target.el_major:
            pkgs, ver, problem = (), None, f"ELRepo does not serve {target.name}; use --driver-source nvidia"
        else:
            pkgs, ver, problem = _elrepo_packages(branch, modules, target.el_major)
    elif target.os_id == "debian":
        pkgs, ver, problem = _debian_packages(entry, branch, modules, target.codename)
    elif target.os_id == "ubuntu":
        pkgs, ver, problem = _ubuntu_packages(entry, branch, modules, target.version, is_datacenter(name, entry))
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
