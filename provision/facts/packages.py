"""Installed packages, read from dpkg's database under a host root (read only, no process): which of some packages
are installed, at which version, from which maintainer, and which package owns a file. The engine and driver facts
use it to tell where an installed engine or driver came from (Docker's packages or the distro's, NVIDIA's CUDA
repository or the distro's). rpm's database is not a file format to read here: rpm hosts are asked through `rpm -q`
on the live host (provision/probe)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from provision.facts.rootfs import read_bytes_bounded, under

DPKG_STATUS = "var/lib/dpkg/status"
DPKG_STATUS_MAX = 64 << 20  # dpkg's status file outgrows the facts' 4 MiB bound on hosts with many packages
_FIELD = re.compile(r"^(Package|Status|Version|Maintainer|Architecture): (.*)$", re.M)


@dataclass(frozen=True)
class InstalledPackage:
    name: str
    version: str  # the package manager's full version: "5:28.0.1-1~debian.12~bookworm"
    maintainer: str = ""
    held: bool = False
    installed: bool = True  # False: known to dpkg but not fully installed (unpacked, half-configured: a killed run)

    @property
    def upstream(self) -> str:
        """The upstream part of the version: no epoch, no Debian revision ("5:28.0.1-1~debian.12" -> "28.0.1")."""
        v = self.version.split(":", 1)[-1]
        return v.rsplit("-", 1)[0] if "-" in v else v


def dpkg_installed(root: Path, wanted=None, *, partly: bool = False) -> dict[str, InstalledPackage]:
    """Installed packages (status `install|hold ok installed`) by name; `wanted`: a predicate on the name, to keep
    only those; `partly`: also those dpkg left unpacked or half-configured (`installed` False). {} where there is no
    dpkg database."""
    try:
        text = read_bytes_bounded(under(root, DPKG_STATUS), DPKG_STATUS_MAX).decode(errors="replace")
    except OSError:
        return {}
    found = {}
    for stanza in text.split("\n\n"):
        fields = dict(_FIELD.findall(stanza))
        name, status = fields.get("Package"), fields.get("Status", "")
        state = status.split()[-1] if status.split() else ""
        whole = status.endswith(" ok installed")
        if not name or (wanted and not wanted(name)) or not (whole or partly) or \
                state in ("not-installed", "config-files", ""):
            continue
        found[name] = InstalledPackage(name, fields.get("Version", ""), fields.get("Maintainer", ""),
                                       status.startswith("hold "), whole)
    return found


def dpkg_owns(root: Path, package: str, path: str) -> bool:
    """Whether dpkg's file list of `package` holds `path` (also through the /usr merge: /bin is /usr/bin)."""
    alts = {path, path.removeprefix("/usr")} | ({"/usr" + path} if not path.startswith("/usr/") else set())
    info = under(root, "var/lib/dpkg/info")
    for lst in (info / f"{package}.list", *info.glob(f"{package}:*.list")):
        try:
            lines = set(read_bytes_bounded(lst, DPKG_STATUS_MAX).decode(errors="replace").splitlines())
        except OSError:
            continue
        if lines & alts:
            return True
    return False
