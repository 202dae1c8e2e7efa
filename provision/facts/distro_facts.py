"""Which distribution and release a root holds: via `distro`, reading <root>/etc/os-release
(or /usr/lib/os-release, or the legacy release files such as /etc/centos-release)."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import distro

from provision.errors import HostUnreadable
from provision.facts.rootfs import NotRegular, read_bytes_bounded, under

# ID / ID_LIKE words -> family. Order matters: the first match wins.
FAMILY_WORDS = (
    ("debian", "debian"), ("ubuntu", "debian"),
    ("rhel", "rhel"), ("centos", "rhel"), ("fedora", "rhel"), ("amzn", "rhel"), ("alinux", "rhel"),
    ("suse", "suse"), ("opensuse", "suse"), ("sles", "suse"),
    ("arch", "arch"), ("alpine", "alpine"),
)
RELEASE_MAX = 64 << 10  # real os-release files are under 1 KiB
LEGACY_FILES = ("etc/centos-release", "etc/redhat-release", "etc/system-release", "etc/oracle-release")


@dataclass(frozen=True)
class DistroFacts:
    id: str
    version: str  # VERSION_ID as written ("9.3", "24.04", "12")
    major: str  # "9", "24.04" for Ubuntu (its releases are year.month), "12"
    codename: str
    family: str  # debian | rhel | suse | arch | alpine | unknown
    package_manager: str  # apt | dnf | yum | zypper | unknown
    like: tuple[str, ...]
    pretty_name: str
    platform_id: str

    def to_dict(self) -> dict:
        d = asdict(self)
        d["like"] = list(self.like)
        return d


def _family(os_id: str, like: tuple[str, ...]) -> str:
    for word in (os_id, *like):
        for key, fam in FAMILY_WORDS:
            if word == key:
                return fam
    return "unknown"


def _package_manager(family: str, os_id: str, major: str) -> str:
    if family == "debian":
        return "apt"
    if family == "rhel":
        if os_id in ("centos", "rhel", "ol", "scientific") and major.isdigit() and int(major) <= 7:
            return "yum"
        return "dnf"
    return {"suse": "zypper", "arch": "pacman", "alpine": "apk"}.get(family, "unknown")


def _release_files(root: Path) -> dict[str, bytes]:
    """The release files present under `root`, each read once through the bounded, non-blocking reader: `distro`
    then parses copies of these alone, so it never opens anything else in the tree (a FIFO named
    etc/x-release would otherwise hang it)."""
    candidates = ["etc/os-release", "usr/lib/os-release", *LEGACY_FILES]
    present = [c for c in candidates if under(root, c).exists()]
    if not present:
        raise HostUnreadable(
            f"no os-release under {root} (looked for /etc/os-release, /usr/lib/os-release and legacy release "
            "files): pass --root pointing at a host's root, or use --target to name the release"
        )
    out, odd = {}, []
    for c in present:
        try:
            data = read_bytes_bounded(under(root, c), RELEASE_MAX + 1)
        except NotRegular:
            odd.append(c)  # a FIFO, device or directory: not a release file; the others may still say
            continue
        except OSError as exc:
            raise HostUnreadable(
                f"cannot read {under(root, c)}: {exc.strerror}; run as root or fix its permissions") from None
        if len(data) > RELEASE_MAX:
            odd.append(c)  # megabytes are not an os-release (and would take `distro` minutes to parse)
        else:
            out[c] = data
    if not out:
        raise HostUnreadable(f"cannot read {under(root, odd[0])}: not a regular file of at most {RELEASE_MAX} "
                             "bytes; restore it from the distro package, or pass --target to name the release")
    return out


def read_distro(root: Path) -> DistroFacts:
    # `distro` is pointed at exactly the files checked above (regular, bounded), by name: it opens nothing else
    # (a FIFO named etc/x-release would hang it) and nothing is copied (facts write nothing: plans run on a
    # read-only root). /dev/null stands for "none of that kind".
    files = _release_files(root)
    os_rel = next((c for c in ("etc/os-release", "usr/lib/os-release") if c in files), None)
    legacy = next((c for c in LEGACY_FILES if c in files), None)
    info = distro.LinuxDistribution(
        include_lsb=False, include_uname=False, include_oslevel=False, root_dir=str(root),
        os_release_file=str(under(root, os_rel)) if os_rel else os.devnull,
        distro_release_file=str(under(root, legacy)) if legacy else os.devnull,
    )
    info.info()  # parse now
    return _facts(root, info)


def _facts(root: Path, info) -> DistroFacts:
    # The raw ID (distro normalises some, e.g. "ol" -> "oracle"); legacy release files only give distro's.
    os_id = info.os_release_attr("id") or info.id()
    if not os_id:
        raise HostUnreadable(f"os-release under {root} has no ID=: the file is malformed; restore it from the distro package")
    version = info.version(best=True) if os_id in ("centos",) else (info.os_release_attr("version_id") or info.version())
    like = tuple(info.like().split())
    family = _family(os_id, like)
    major = version if os_id == "ubuntu" else version.split(".")[0]
    # Suites matter on Debian/Ubuntu only; EL "codenames" (Plow, Blue Onyx) are names, not repository keys.
    codename = info.os_release_attr("version_codename") or info.os_release_attr("ubuntu_codename") or ""
    return DistroFacts(
        id=os_id,
        version=version,
        major=major,
        codename=codename.lower().split()[0] if codename else "",
        family=family,
        package_manager=_package_manager(family, os_id, major),
        like=like,
        pretty_name=info.name(pretty=True),
        platform_id=info.os_release_attr("platform_id") or "",
    )
