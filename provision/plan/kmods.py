"""ELRepo's prebuilt kmods: each is built for one minor release's kernels and tagged so (570.172.08-1.el9_6.elrepo
requires 9.6's kernel). The driver stage installs the build of the boot kernel's minor release, asks first whether it
is offered (`KmodOffered`) and proves the boot kernel's module after (`KmodServes`)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from provision.errors import Unsupported
from provision.facts.boot import nvidia_module
from provision.plan.steps import Action, Command


@dataclass(frozen=True)
class KmodOffered(Action):
    """Before ELRepo's kmod is installed or moved: the repositories offer its build for the boot kernel's minor
    release (elrepo_build). ELRepo publishes a minor release's builds some days after its kernel (and a site's
    mirror may lag): with none, stop (exit 4) before anything changes, naming the kernel and the ways out."""
    kernel: str
    package: str
    query: Command

    def commands(self) -> list[Command]:
        return [self.query]

    def lines(self) -> list[str]:
        return [*self.query.lines(), "  (none offered: stop with exit 4, nothing changed)"]

    def execute(self) -> str:
        r = self.query.run()
        if r.returncode != 0 or not r.output.strip():
            raise Unsupported(
                f"ELRepo offers no build of {self.package} for kernel {self.kernel}'s minor release "
                f"({minor_release(self.kernel)}) yet: nothing was changed. Boot a kernel of a minor release ELRepo "
                "builds for, or wait for its build and run bootstrap again; or use NVIDIA's repository "
                "(--driver-source nvidia: DKMS builds for any kernel)")
        return ""


@dataclass(frozen=True)
class KmodServes(Action):
    """After ELRepo's kmod is installed or moved: the kernel that boots next has its nvidia module (the build's own,
    or a weak-updates link within its minor release); else stop (exit 4) naming the kernel."""
    reports = True
    kernel: str

    def lines(self) -> list[str]:
        return [f"  (then kernel {self.kernel} must have an nvidia module: exit 4 otherwise)"]

    def execute(self) -> str:
        if nvidia_module(Path("/"), self.kernel) is not None:
            return f"ELRepo's kmod serves kernel {self.kernel}"
        raise Unsupported(f"ELRepo's kmod was installed, but kernel {self.kernel}, which boots next, has no nvidia "
                          "module (weak-modules did not link it): boot a kernel it serves, or use NVIDIA's repository "
                          "(--driver-source nvidia: DKMS builds for any kernel)")


def elrepo_build(package: str, kernel: str | None) -> str:
    """ELRepo builds each kmod for one minor release's kernels and tags it so (kmod-nvidia-open-570.172.08-1.el9_6
    .elrepo.x86_64 requires 9.6's kernel): the version glob of `package`'s builds for `kernel`'s minor release, which dnf
    takes as a package spec; the name where either is no ELRepo kmod or kernel carries no such tag. Without it dnf
    took the newest build whatever the kernel: a newer kernel pulled into the driver's transaction, or (best=True,
    none offered, an EUS host) the install failed."""
    tag = minor_release(kernel)
    # NAME-VERSION-RELEASE.ARCH, each part a glob (dnf 4.14 matched no glob without the arch: it read `.elrepo` as one)
    return f"{package}-[0-9]*-*.{tag}*.elrepo.*" if tag and package.startswith("kmod-") else package


def minor_release(kernel: str | None) -> str | None:
    """An EL kernel's minor-release tag: el9_6 of 5.14.0-570.12.1.el9_6.x86_64 (el7 of EL 7's); None without one."""
    m = re.search(r"\.(el\d+(?:_\d+)?)\.", f"{kernel}." if kernel else "")
    return m.group(1) if m else None
