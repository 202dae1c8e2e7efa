"""Target releases gpuprov has rules for, and how a host's distro facts map onto one."""
from __future__ import annotations

from typing import NamedTuple

from provision.errors import Unsupported


class Target(NamedTuple):
    name: str  # "debian-12", "ubuntu-24.04", "rocky-9", "centos-7", "amzn-2023"
    os_id: str
    version: str
    family: str  # debian | rhel
    package_manager: str  # apt | dnf | yum
    codename: str = ""  # Debian/Ubuntu suite
    el_major: int | None = None  # EL-compatible major for ELRepo / NVIDIA's rhel<N> repos


def _el(os_id: str, major: int, *, el_major: int | None = None) -> Target:
    return Target(
        name=f"{os_id}-{major}", os_id=os_id, version=str(major), family="rhel",
        package_manager="yum" if major <= 7 and el_major is None else "dnf",
        el_major=el_major if el_major is not None else major,
    )


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("debian-11", "debian", "11", "debian", "apt", "bullseye"),
        Target("debian-12", "debian", "12", "debian", "apt", "bookworm"),
        Target("debian-13", "debian", "13", "debian", "apt", "trixie"),
        Target("ubuntu-18.04", "ubuntu", "18.04", "debian", "apt", "bionic"),
        Target("ubuntu-20.04", "ubuntu", "20.04", "debian", "apt", "focal"),
        Target("ubuntu-22.04", "ubuntu", "22.04", "debian", "apt", "jammy"),
        Target("ubuntu-24.04", "ubuntu", "24.04", "debian", "apt", "noble"),
        _el("centos", 7),
        _el("rhel", 7), _el("rhel", 8), _el("rhel", 9), _el("rhel", 10),
        _el("centos", 8), _el("centos", 9), _el("centos", 10),  # CentOS Stream
        _el("rocky", 8), _el("rocky", 9), _el("rocky", 10),
        _el("almalinux", 8), _el("almalinux", 9), _el("almalinux", 10),
        _el("ol", 8), _el("ol", 9), _el("ol", 10),
        # Alibaba Cloud Linux 3 is binary compatible with EL8 (its PLATFORM_ID is platform:al8).
        _el("alinux", 3, el_major=8),
        # Amazon Linux 2023 is Fedora-based: no ELRepo; NVIDIA's repo has an amzn2023 tree.
        Target("amzn-2023", "amzn", "2023", "rhel", "dnf", "", None),
    )
}
ALIASES = {"el7": "rhel-7", "el8": "rhel-8", "el9": "rhel-9", "el10": "rhel-10",
           "bullseye": "debian-11", "bookworm": "debian-12", "trixie": "debian-13",
           "bionic": "ubuntu-18.04", "focal": "ubuntu-20.04", "jammy": "ubuntu-22.04", "noble": "ubuntu-24.04"}


def parse_target(text: str) -> Target:
    key = ALIASES.get(text.strip().lower(), text.strip().lower())
    if key in TARGETS:
        return TARGETS[key]
    raise Unsupported(
        f"unknown target {text!r}: use one of {', '.join(sorted(TARGETS))} (or el7..el10, a Debian/Ubuntu codename)"
    )


def target_for(os_id: str, major: str, like: tuple[str, ...] = ()) -> Target:
    """The target for a detected distro; EL rebuilds we do not list map by ID_LIKE."""
    key = f"{os_id}-{major}"
    if key in TARGETS:
        return TARGETS[key]
    if major.isdigit() and any(w in ("rhel", "centos") for w in like) and f"rhel-{major}" in TARGETS:
        base = TARGETS[f"rhel-{major}"]
        return Target(key, os_id, major, "rhel", base.package_manager, "", base.el_major)
    raise Unsupported(
        f"unsupported distribution {os_id} {major}: gpuprov has rules for {', '.join(sorted(TARGETS))}; "
        "use --target to plan for one of them"
    )
