"""Decisions that keep the NVIDIA module with the kernel: the headers metapackage that follows each installed kernel
metapackage (so DKMS builds for every kernel apt brings in later), Ubuntu's precompiled signed modules where the
archive has them for every kernel, and which installed driver series a change of branch replaces. Pure: package
names in, package names out.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

# `linux-image-<flavour>` metapackages follow a flavour across ABIs (Debian: amd64, cloud-amd64, rt-amd64, arm64,
# 686-pae; Ubuntu: generic, generic-hwe-22.04, virtual, aws, gcp, azure, oracle, lowlatency …); one kernel's own
# package carries its ABI (`linux-image-6.1.0-27-amd64`), and some names are neither (debug symbols, the unsigned
# twin, the signing template, Ubuntu's transitional extra-virtual).
ABI_RE = re.compile(r"^linux-image-(?:unsigned-)?\d+\.\d+")
NOT_META = ("-dbg", "-dbgsym", "-signed-template")
NOT_META_PREFIX = ("linux-image-unsigned-", "linux-image-extra-", "linux-image-uc-")
# Where a driver series' packages come from (dpkg's Source): Debian's and Ubuntu's driver sources, Debian's open
# kernel modules, Ubuntu's precompiled modules.
# The driver metapackage of a series (Debian's nvidia-driver / nvidia-tesla-470-driver, Ubuntu's nvidia-driver-535,
# nvidia-headless-535-server, and its no-DKMS twin beside precompiled modules), to name the series being replaced.
METAPACKAGE_RE = re.compile(r"^(nvidia-driver|nvidia-(tesla|legacy)-[0-9a-z]+-driver|"
                            r"nvidia-(driver|headless|headless-no-dkms)-\d.*)$")
DRIVER_SOURCES = ("nvidia-graphics-drivers", "nvidia-open-gpu-kernel-modules", "linux-restricted-modules")


def kernel_metapackages(installed: Iterable[str]) -> tuple[str, ...]:
    """The installed kernel metapackages: the packages through which apt brings newer kernels."""
    return tuple(sorted(p for p in installed if p.startswith("linux-image-") and not ABI_RE.match(p)
                        and not p.endswith(NOT_META) and not p.startswith(NOT_META_PREFIX)))


def headers_metapackages(kernel_metas: Iterable[str]) -> tuple[str, ...]:
    """The headers metapackage of each kernel metapackage: it pulls in the headers of every kernel the image
    metapackage pulls in, and the headers' own hook has DKMS build the module for it before the reboot."""
    return tuple(f"linux-headers-{m.removeprefix('linux-image-')}" for m in kernel_metas)


# ---------------------------------------------------------------- Ubuntu's precompiled modules


@dataclass(frozen=True)
class Precompiled:
    package: str | None  # linux-modules-nvidia-<series>-<flavour>, the metapackage that follows the kernel flavour
    why: str  # why it is used, or why not (DKMS then)
    driver: tuple[str, ...] = ()  # the driver packages to install with it (no DKMS package among their depends)
    abi: tuple[str, ...] = ()  # each kernel's own modules package: the metapackage brings only its newest kernel's


def without_dkms(driver_packages: Iterable[str]) -> tuple[str, ...]:
    """The driver packages with Ubuntu's headless metapackage swapped for its no-DKMS twin: nvidia-headless-580-server
    depends on nvidia-dkms-580-server (= its version), nvidia-headless-no-dkms-580-server on everything else of it, so
    next to the precompiled modules the twin is what keeps DKMS, a compiler and a build per kernel off the host (as
    ubuntu-drivers installs it)."""
    return tuple(f"nvidia-headless-no-dkms-{p.removeprefix('nvidia-headless-')}"
                 if p.startswith("nvidia-headless-") and p.removeprefix("nvidia-headless-")[:1].isdigit() else p
                 for p in driver_packages)


def ubuntu_series(driver_packages: Iterable[str]) -> str | None:
    """The series suffix of Ubuntu's driver metapackage: nvidia-headless-535-server-open -> 535-server-open."""
    for p in driver_packages:
        for meta in ("nvidia-headless-no-dkms-", "nvidia-headless-", "nvidia-driver-"):
            rest = p.removeprefix(meta)
            if rest != p and rest[:1].isdigit():
                return rest
    return None


def ubuntu_precompiled(driver_packages: Iterable[str], kernel_metas: Iterable[str], kernels: Iterable[str],
                       offered: frozenset[str]) -> Precompiled:
    """Ubuntu's own path, as ubuntu-drivers takes it: the modules metapackage of the driver series for the flavour of
    the installed kernel metapackage (linux-modules-nvidia-535-server-generic-hwe-22.04), used when the archive has
    it and, for every kernel the module is for, that kernel's ABI package (linux-modules-nvidia-535-server-6.8.0-49-
    generic). Signed by Canonical: no DKMS build, no MOK enrolment under Secure Boot."""
    series = ubuntu_series(driver_packages)
    metas = list(kernel_metas)
    if series is None:
        return Precompiled(None, "not an Ubuntu driver metapackage")
    if len(metas) != 1:
        return Precompiled(None, "no kernel metapackage installed (linux-image-<flavour>)" if not metas else
                           f"several kernel metapackages installed ({', '.join(metas)}): DKMS builds for each")
    flavour = metas[0].removeprefix("linux-image-")
    meta = f"linux-modules-nvidia-{series}-{flavour}"
    if meta not in offered:
        return Precompiled(None, f"the archive has no installable {meta} (none, or its newest version's kernel "
                           "modules package is not in the lists yet): DKMS builds the module")
    missing = [k for k in kernels if f"linux-modules-nvidia-{series}-{k}" not in offered]
    if missing:
        return Precompiled(None, f"the archive has no linux-modules-nvidia-{series}-{missing[0]} (kernel "
                           f"{missing[0]}): DKMS builds the module")
    return Precompiled(meta, f"Ubuntu's precompiled, signed modules ({meta}, following linux-image-{flavour})",
                       without_dkms(driver_packages), tuple(f"linux-modules-nvidia-{series}-{k}" for k in kernels))


@dataclass(frozen=True)
class ModuleMove:
    """Ubuntu, day two: the installed headless series stays, its kernel modules change packaging. `to` "dkms": a
    kernel Canonical has not published precompiled modules for yet (it happens for days after most kernel uploads)
    gets the DKMS flavour of the same series beside them; the kernels that have Canonical's keep theirs. `to`
    "precompiled": Canonical's modules are in the archive for every installed kernel now, so DKMS goes again."""
    to: str  # "dkms" | "precompiled"
    install: tuple[str, ...]  # what the transaction asks apt for
    remove: tuple[str, ...]  # … and removes in the same transaction
    kernels: tuple[str, ...]  # "dkms": the kernels DKMS builds for; "precompiled": every installed kernel
    why: str
    abi: tuple[str, ...] = ()  # "precompiled": each kernel's own modules package (marked automatic afterwards)


def ubuntu_module_move(installed: Mapping, driver_packages: Iterable[str], kernel_metas: Iterable[str],
                       kernels: Iterable[str], every_kernel: Iterable[str], offered: frozenset[str]
                       ) -> ModuleMove | None:
    """Which packaging the kernel module of an installed Ubuntu headless series moves to, if any. `installed`: dpkg's
    packages (name -> facts.packages.InstalledPackage); `driver_packages`: the decision's (nvidia-headless-B-server
    [-open] …); `kernels`: those the plan is for; `every_kernel`: every installed one; `offered`: the precompiled
    module packages the lists offer. None: a first install (ubuntu_precompiled decides), or nothing to move.

    The DKMS flavour is added rather than swapped in: Canonical's signed modules stay where they are (DKMS leaves a
    kernel alone that already has the same version), so a DKMS build that fails takes nothing from the kernels that
    worked. Back to precompiled only when every installed kernel has its package: removing the DKMS package removes
    its modules from every kernel."""
    pkgs = tuple(driver_packages)
    series = ubuntu_series(pkgs)
    dkms_meta = f"nvidia-headless-{series}"
    if series is None or dkms_meta not in pkgs:  # nvidia-driver-B has no no-DKMS twin: DKMS is always there
        return None
    twin, dkms_pkg, lrm = f"nvidia-headless-no-dkms-{series}", f"nvidia-dkms-{series}", f"linux-modules-nvidia-{series}-"
    kernels, every = tuple(kernels), tuple(every_kernel)
    if dkms_meta in installed:
        back = ubuntu_precompiled(pkgs, kernel_metas, every, offered)
        if not back.package:
            return None
        gone = tuple(p for p in (dkms_meta, dkms_pkg) if p in installed)
        return ModuleMove("precompiled", (back.package, *back.abi, *back.driver), gone, every,
                          f"{back.why} for every installed kernel ({', '.join(every)}) now: DKMS's build ({dkms_pkg}) "
                          "goes in the same transaction", back.abi)
    if twin not in installed:
        return None
    served = tuple(k for k in every if f"{lrm}{k}" in installed)
    lacking = tuple(k for k in kernels if f"{lrm}{k}" not in installed)
    pre = ubuntu_precompiled(pkgs, kernel_metas, kernels, offered)
    if not lacking or pre.package:
        return None  # every kernel served, or the archive has them all: the usual install adds the new ones
    return ModuleMove("dkms", (dkms_meta,), (), lacking,
                      f"{pre.why.removesuffix(': DKMS builds the module')}: DKMS builds the same series for "
                      f"{', '.join(lacking)}"
                      + (f"; Canonical's precompiled modules stay for {', '.join(served)}" if served else "")
                      + ". Once the archive has them for every installed kernel, bootstrap moves back to them")


# ---------------------------------------------------------------- a change of driver branch


@dataclass(frozen=True)
class Replacement:
    unhold: tuple[str, ...]  # the old series' held packages (gpuprov's hold step held them)
    remove: tuple[str, ...]  # every installed package of the old series, removed in the install's transaction
    old: str  # the old series, in words ("nvidia-driver 535.261.03")
    why: str = ""  # an update within the branch: why it is needed ("kernel 6.1.0-56-amd64 has no nvidia module")
    previous: tuple[str, ...] = ()  # … and the series as installed (name=version): what a failed update goes back to


def branch_replacement(installed: dict, new_packages: Iterable[str], needed: frozenset[str] = frozenset()
                       ) -> Replacement | None:
    """A different driver series installed and held (as gpuprov's hold step leaves it) while `new_packages` ask
    for another: replace it. `installed`: name -> facts.packages.Installed; `needed`: what the new packages depend
    on, transitively (from the apt lists): the old source's shared packages (nvidia-egl-common, …) stay. None when
    the series is the same (all new packages installed already) or no held driver series is there (nothing gpuprov
    held to replace)."""
    wanted = set(new_packages)
    if all(p in installed for p in wanted):
        return None
    ours = [p for p in installed.values() if p.source.startswith(DRIVER_SOURCES) and p.name not in wanted]
    held = [p for p in ours if p.held]
    if not held:
        return None
    sources = {p.source for p in held}
    old = [p for p in ours if p.source in sources]
    meta = next((p for p in held if METAPACKAGE_RE.match(p.name)), held[0])
    if ubuntu_series([meta.name]) is not None and ubuntu_series([meta.name]) == ubuntu_series(wanted):
        return None  # Ubuntu's same series, only its modules' packaging differs: ubuntu_module_move's, not a change
    # Ubuntu: the old branch's precompiled modules (linux-modules-nvidia-570-server-open-generic and its per-ABI
    # packages) need the old series' nvidia-kernel-common: they go with it, or apt removes them on its own (exit 14)
    series = ubuntu_series([meta.name])
    lrm = f"linux-modules-nvidia-{series.split('-')[0]}-" if series else None
    old += [p for p in installed.values() if lrm and p.name.startswith(lrm) and p not in old]
    remove = sorted(p.name for p in old if p.name not in needed)
    return Replacement(tuple(sorted(p.name for p in old if p.held)), tuple(remove),
                       f"{meta.name} {meta.version.split('-')[0]}")


# A driver series' kernel-module packages, of either flavour (Debian: nvidia-kernel-dkms / nvidia-open-kernel-dkms and
# their -support packages; the Tesla series' nvidia-tesla-535-kernel-dkms …).
MODULE_PACKAGE_RE = re.compile(r"^nvidia-.*(?:kernel|open-kernel)-(?:dkms|support)$")


def series_update(installed: Mapping, new_packages: Iterable[str], needed: frozenset[str],
                  offered: Mapping[str, frozenset[str]], missing: tuple[str, ...]) -> Replacement | None:
    """gpuprov's held series of the same driver (its metapackage installed and held) while a kernel it must serve has
    no nvidia module (`missing`: the held version did not build for it, or nothing tried): bring the series to what
    the archive offers now, within the branch. Debian's security suite ships a driver update together with the kernel
    that needs it (bookworm-security: 535.309.01 with 6.1.0-56, which 535.261.03 does not build against), and the
    hold keeps it out; where the open module does not follow the driver (facts: the decision chose the proprietary
    one), the open module's packages go in the same transaction. None: nothing is missing, the series is not
    gpuprov's, or the archive offers nothing else for it.

    installed: name -> facts.packages.InstalledPackage; needed: what the new packages depend on, transitively."""
    wanted = tuple(new_packages)
    meta = next((p for p in wanted if METAPACKAGE_RE.match(p)), None)
    cur = installed.get(meta) if meta else None
    if not missing or cur is None or not cur.held:
        return None
    series = [p for p in installed.values() if p.source.startswith(DRIVER_SOURCES)]
    module = next((p for p in wanted if MODULE_PACKAGE_RE.match(p)), None)
    flavour_gone = sorted(p.name for p in series if module and MODULE_PACKAGE_RE.match(p.name)
                          and ("-open-" in p.name) != ("-open-" in module) and p.name not in needed)
    other = sorted(offered.get(meta, frozenset()) - {cur.upstream})  # what apt would install instead
    if not flavour_gone and not other:
        return None
    why = (f"kernel {', '.join(missing)} has no nvidia module; the archive offers {meta} "
           f"{', '.join(other) or cur.upstream} in the same branch"
           + (f", with the other module flavour ({', '.join(flavour_gone)} goes)" if flavour_gone else ""))
    return Replacement(tuple(sorted(p.name for p in series if p.held)), tuple(flavour_gone),
                       f"{meta} {cur.upstream}", why, tuple(sorted(f"{p.name}={p.version}" for p in series)))


# ---------------------------------------------------------------- the branch pin


# The apt preferences file that keeps the driver series on its branch (plan/driver.py's hold step writes it): per
# source package of the series, its branch's versions at 990 (updates within the branch are installed, with the
# kernel that needs them, in the same transaction) and every other version at -1 (never installed: a branch change
# is `gpuprov bootstrap --driver B`, which rewrites it). Written instead of `apt-mark hold`, which keeps even the
# security suite's in-branch update out, so the kernel that needs it arrives alone and its DKMS build fails.
PIN_FILE = "/etc/apt/preferences.d/gpuprov-nvidia"
PIN_PRIORITY = 990
PIN_STANZA_RE = re.compile(r"^Package: src:(\S+?)(?::any)?\nPin: version (\S+)\nPin-Priority: (-?\d+)$", re.M)


def pinned_branches(text: str) -> dict[str, str]:
    """source package -> the version pattern pinned at PIN_PRIORITY ("535.*") in a pin file's text."""
    out: dict[str, str] = {}
    for src, version, prio in PIN_STANZA_RE.findall(text):
        if int(prio) == PIN_PRIORITY and src not in out:
            out[src] = version
    return out


def branch_of(version: str) -> str:
    """The branch pattern of a driver version, epoch kept: "535.261.03-1~deb12u1" -> "535.*", "1:470.2-1" ->
    "1:470.*"."""
    return version.split(".", 1)[0] + ".*"


def pinned_series(installed: Mapping, pins: Mapping[str, str]) -> dict:
    """dpkg's packages with those of a pinned source (gpuprov's pin file) marked held: held (`apt-mark hold`, as
    gpuprov left a series before the pin) or pinned, the series is gpuprov's, which it keeps following."""
    return {n: (p._replace(held=True) if p.source in pins and not p.held else p) for n, p in installed.items()}
