"""The NVIDIA driver as the kernel sees it: loaded module, version, open vs proprietary, nouveau,
kernel release and headers, Secure Boot; where the userspace driver files live (driver root); and the kernel the
next boot starts, with its NVIDIA module or none (facts/boot.py)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, NamedTuple

from provision.facts.boot import read_next_boot
from provision.facts.packages import InstalledPackage, dpkg_installed
from provision.facts.rootfs import is_live, read_bytes_bounded, read_first_line, read_text, under

# Where a driver root keeps its libraries (a root of its own like /usr/local/nvidia, or a distro's /). The runtime's
# capability table (inject/capabilities.py) uses the same list: facts is the lower layer, so it lives here. Debian's
# packaged driver keeps libcuda, NVML, GLX… in nvidia/current/ (its alternatives link them into the multiarch dir).
DRIVER_LIB_DIRS = ("lib64", "lib", "usr/lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu/nvidia/current", "usr/lib64",
                   "lib/x86_64-linux-gnu")
SECURE_BOOT_VAR = "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
# Where a driver's userspace can live besides `/`: a read-only volume (seen on real GPU VMs), GPU Operator's
# driver container root, and the classic nvidia-docker 1.0 volume path.
DRIVER_ROOT_CANDIDATES = ("/", "/usr/local/nvidia", "/run/nvidia/driver")
# "NVIDIA UNIX Open Kernel Module for x86_64  580.159.04" (open) / "NVIDIA UNIX x86_64 Kernel Module  535.161.08"
NVRM_RE = re.compile(r"NVRM version:\s+NVIDIA UNIX (Open )?(?:\S+ )?Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")


# The packages that are an NVIDIA kernel driver (not its libraries), one table for dpkg's and rpm's databases:
# Debian's, Ubuntu's and NVIDIA's CUDA repository's (.deb); on rpm hosts NVIDIA's CUDA repository's (nvidia-driver,
# its module streams' kmod-nvidia-latest-dkms / kmod-nvidia-open-dkms, EL 10's nvidia-open and cuda-drivers) and
# ELRepo's (kmod-nvidia, kmod-nvidia-open, nvidia-x11-drv, the legacy kmod-nvidia-470xx / nvidia-x11-drv-470xx).
DRIVER_PACKAGE_RE = re.compile(r"^(cuda-drivers(-\d+)?|nvidia-driver(-\d+)?(-server)?(-open)?|nvidia-tesla-\d+-driver|"
                               r"nvidia-headless(-no-dkms)?-\d+(-server)?(-open)?|nvidia(-open)?-kernel-dkms|"
                               r"nvidia-tesla-\d+-kernel-dkms|nvidia-open(-\d+)?|"
                               r"kmod-nvidia(-open|-latest)?(-dkms)?|kmod-nvidia-\d+xx|nvidia-x11-drv(-\d+xx)?)$")
# rpm has no maintainer field to tell NVIDIA's packages by (dpkg's Maintainer at nvidia.com); the names tell: these
# are NVIDIA's CUDA repository's alone (NVIDIA/yum-packaging-nvidia-driver and -dkms specs; ELRepo ships kmod-nvidia and
# nvidia-x11-drv instead, tests/fixtures/el-repos/README.md)
CUDA_REPO_RPMS = ("nvidia-driver", "kmod-nvidia-latest-dkms", "kmod-nvidia-open-dkms", "nvidia-open", "cuda-drivers")
# ELRepo's build gives every package its `.elrepo` dist tag (kmod-nvidia-570.144-1.el9_5.elrepo): another
# kmod-nvidia (RPM Fusion's, a rebuild) is not ELRepo's
ELREPO_RELEASE = ".elrepo"
# The package whose version names the driver: a metapackage's, else the userspace's (ELRepo's nvidia-x11-drv)
MAIN_PACKAGES = ("cuda-drivers", "nvidia-driver", "nvidia-open", "nvidia-x11-drv")
RUN_INSTALLER = "usr/bin/nvidia-installer"  # NVIDIA's .run installer leaves itself here (for --uninstall)
REBOOT_FLAGS = ("run/reboot-required", "var/run/reboot-required")


class InstalledDriver(NamedTuple):
    """An NVIDIA driver on disk, loaded or not, and where it came from: gpuprov keeps one it did not install."""
    # cuda-repo (NVIDIA's CUDA repository packages) | distro (the distribution's) | elrepo (ELRepo's: on EL, gpuprov's
    # "distro" source) | run-installer
    source: str
    packages: tuple[str, ...]  # the driver packages installed (none for the .run installer)
    version: str | None  # the main package's version, or the .run installer's userspace version
    modules: tuple[str, ...]  # kernels that have an nvidia module on disk
    reboot_pending: bool  # the system asks for a reboot (/run/reboot-required)

    def describe(self) -> str:
        where = {"cuda-repo": "NVIDIA's CUDA repository", "distro": "the distribution's packages", "elrepo": "ELRepo",
                 "run-installer": f"NVIDIA's .run installer (/{RUN_INSTALLER})"}[self.source]
        return f"NVIDIA driver {self.version or '(version unknown)'} from {where}" + \
            (f" ({' '.join(self.packages)})" if self.packages else "")


def nvidia_modules(root: Path) -> tuple[str, ...]:
    """Kernels with an nvidia module on disk: DKMS's (updates/dkms; EL's dkms: extra), precompiled packages' and
    kmods' (extra; ELRepo's kmods: extra/nvidia, linked into weak-updates/nvidia for kABI-compatible kernels),
    kernel/drivers/video, where the .run installer puts its own."""
    found = []
    for k in sorted(p.name for p in under(root, "lib/modules").glob("*")):
        for sub in ("updates/dkms", "extra", "extra/nvidia", "weak-updates/nvidia", "kernel/drivers/video", "updates"):
            if any(under(root, f"lib/modules/{k}/{sub}").glob("nvidia*.ko*")):
                found.append(k)
                break
    return tuple(found)


def read_installed_driver(root: Path) -> InstalledDriver | None:
    """The driver packages dpkg lists, else the .run installer with its modules. None: no driver on disk that these
    files tell (rpm hosts: rpm's database is no file to read here; the plan asks rpm through the package-manager
    adapter, a layer above facts, and classifies its answer with `installed_driver`)."""
    return installed_driver(root, dpkg_installed(root, DRIVER_PACKAGE_RE.match))


def driver_source(pkgs: Iterable[InstalledPackage]) -> str:
    """Where installed driver packages came from: NVIDIA's CUDA repository (dpkg: its maintainer at nvidia.com; rpm:
    its names), ELRepo (its dist tag), else the distribution."""
    pkgs = list(pkgs)
    if any("nvidia.com" in p.maintainer.lower() for p in pkgs) or \
            any(p.name in CUDA_REPO_RPMS and p.database == "rpm" for p in pkgs):
        return "cuda-repo"
    if any(ELREPO_RELEASE in p.version for p in pkgs):
        return "elrepo"
    return "distro"


def installed_driver(root: Path, pkgs: dict[str, InstalledPackage]) -> InstalledDriver | None:
    """The driver of these installed driver packages (DRIVER_PACKAGE_RE's, from dpkg's or rpm's database), else the
    .run installer with its modules; None when neither is there."""
    modules = nvidia_modules(root)
    reboot = any(under(root, f).exists() for f in REBOOT_FLAGS)
    if pkgs:
        main = next((p for p in pkgs.values() if p.name.startswith(MAIN_PACKAGES)), next(iter(pkgs.values())))
        return InstalledDriver(driver_source(pkgs.values()), tuple(sorted(pkgs)), main.upstream, modules, reboot)
    if under(root, RUN_INSTALLER).is_file() and modules:
        return InstalledDriver("run-installer", (), find_driver_root(root)[1], modules, reboot)
    return None


class DriverFacts(NamedTuple):
    loaded: bool
    version: str | None
    kernel_module: str | None  # "open" | "proprietary" | None
    modules: tuple[str, ...]  # nvidia* and nouveau modules loaded
    nouveau_loaded: bool
    kernel_release: str | None
    kernel_headers: bool
    secure_boot: bool | None  # None: no EFI variables (BIOS boot or a VM without EFI)
    driver_root: str | None  # where nvidia-smi / libnvidia-ml live, if found
    userspace_version: str | None  # from the driver root's libnvidia-ml.so.<version>
    installed: InstalledDriver | None = None  # a driver on disk (packages or the .run installer), loaded or not
    next_boot_kernel: str | None = None  # the kernel the next boot starts (GRUB's default, /vmlinuz, the newest)
    next_boot_from: str = ""  # how that kernel was found
    next_boot_module: str | None = None  # its NVIDIA module file; None: it boots without one
    module_kernels: tuple[str, ...] = ()  # installed kernels with an NVIDIA module (a driver the package manager put in)

    def to_dict(self) -> dict:
        d = self._asdict()
        d["modules"] = list(self.modules)
        if self.installed:
            d["installed"] = {**self.installed._asdict(), "packages": list(self.installed.packages),
                              "modules": list(self.installed.modules), "description": self.installed.describe()}
        d["module_kernels"] = list(self.module_kernels)
        return d


def parse_nvrm(text: str | None) -> tuple[str | None, str | None]:
    """(version, 'open'|'proprietary') from /proc/driver/nvidia/version."""
    m = NVRM_RE.search(text or "")
    if not m:
        return None, None
    return m.group(2), "open" if m.group(1) else "proprietary"


def kernel_release(root: Path) -> str | None:
    rel = read_first_line(root, "proc/sys/kernel/osrelease")
    if rel:
        return rel
    return os.uname().release if is_live(root) else None


def secure_boot(root: Path) -> bool | None:
    try:
        data = read_bytes_bounded(under(root, SECURE_BOOT_VAR))
    except OSError:
        return None if not under(root, "sys/firmware/efi").exists() else False
    # efivarfs: 4 bytes of attributes, then the value; the last byte is 1 when Secure Boot is on.
    return bool(data) and data[-1] == 1


def userspace_version(driver_root: Path) -> str | None:
    """The version in libnvidia-ml.so.<version> under a driver root's library directories."""
    for libdir in DRIVER_LIB_DIRS:
        try:
            names = os.listdir(driver_root / libdir)
        except OSError:
            continue
        for n in names:
            if n.startswith("libnvidia-ml.so.") and n.count(".") >= 4:
                return n.removeprefix("libnvidia-ml.so.")
    return None


def find_driver_root(root: Path) -> tuple[str | None, str | None]:
    """(driver root, userspace version): the first candidate holding libnvidia-ml.so.<version>."""
    for cand in DRIVER_ROOT_CANDIDATES:
        version = userspace_version(under(root, cand))
        if version:
            return cand, version
    return None, None


def read_driver(root: Path) -> DriverFacts:
    version, flavour = parse_nvrm(read_text(root, "proc/driver/nvidia/version"))
    mods_text = read_text(root, "proc/modules") or ""
    loaded_mods = tuple(
        line.split()[0] for line in mods_text.splitlines()
        if line.split() and (line.startswith("nvidia") or line.startswith("nouveau"))
    )
    krel = kernel_release(root)
    headers = bool(krel) and (
        under(root, f"lib/modules/{krel}/build").exists() or under(root, f"usr/src/kernels/{krel}").exists()
    )
    droot, uver = find_driver_root(root)
    boot = read_next_boot(root)
    return DriverFacts(
        loaded="nvidia" in loaded_mods or version is not None,
        version=version or read_first_line(root, "sys/module/nvidia/version"),
        kernel_module=flavour,
        modules=loaded_mods,
        nouveau_loaded="nouveau" in loaded_mods,
        kernel_release=krel,
        kernel_headers=headers,
        secure_boot=secure_boot(root),
        driver_root=droot,
        userspace_version=uver,
        installed=read_installed_driver(root),
        next_boot_kernel=boot.kernel,
        next_boot_from=boot.source,
        next_boot_module=boot.module,
        module_kernels=boot.module_kernels,
    )
