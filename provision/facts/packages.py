"""What dpkg says is installed (name, version, source package, held), and which precompiled NVIDIA module packages
the apt lists offer, read through the host root. Only the driver plan asks (apt hosts): detect stays cheap."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from provision.facts.rootfs import read_text_file, under

DPKG_STATUS = "/var/lib/dpkg/status"
DPKG_STATUS_MAX = 64 << 20  # dpkg's status file outgrows the facts' 4 MiB bound on hosts with many packages
APT_LISTS = "/var/lib/apt/lists"
LIST_MAX = 256 << 20
# Ubuntu ships its precompiled NVIDIA modules in `restricted`; one line per package name in a Packages index.
MODULES_RE = re.compile(r"^Package: (linux-modules-nvidia-\S+)$", re.M)
# Where Debian and Ubuntu keep the NVIDIA driver packages (and what they depend on beyond main).
DRIVER_COMPONENTS = ("non-free", "contrib", "restricted", "multiverse")
DEPENDS_RE = re.compile(r"\n(Package|Depends|Pre-Depends): ([^\n]*)")
# The four fields read, each at a line start; one pass over the whole file (dpkg writes Package first).
FIELD_RE = re.compile(r"\n(Package|Status|Version|Source): ([^\n]*)")


@dataclass(frozen=True)
class Installed:
    name: str
    version: str
    source: str  # the source package's name (dpkg's Source field without its version; the name when absent)
    held: bool


def read_dpkg(root: Path) -> dict[str, Installed]:
    """Every package dpkg lists as installed (`install ok installed` or `hold ok installed`)."""
    try:
        text = read_text_file(under(root, DPKG_STATUS), DPKG_STATUS_MAX)
    except OSError:
        return {}
    stanzas: list[dict[str, str]] = []
    for key, value in FIELD_RE.findall("\n" + text):
        if key == "Package":
            stanzas.append({})
        if stanzas:
            stanzas[-1][key] = value
    out: dict[str, Installed] = {}
    for f in stanzas:
        status = f.get("Status", "").split()
        if status[-2:] == ["ok", "installed"]:
            source = f.get("Source", f["Package"]).split(" ", 1)[0]
            out[f["Package"]] = Installed(f["Package"], f.get("Version", ""), source, status[0] == "hold")
    return out


def offered_module_packages(root: Path) -> frozenset[str]:
    """The `linux-modules-nvidia-*` names in the apt lists of the restricted component (Ubuntu's precompiled, signed
    NVIDIA modules), as `apt-get update` last fetched them."""
    names: set[str] = set()
    for p in sorted(under(root, APT_LISTS).glob("*_restricted_binary-*_Packages")):
        try:
            names.update(MODULES_RE.findall(read_text_file(p, LIST_MAX)))
        except OSError:
            continue
    return frozenset(names)


def archive_depends(root: Path) -> dict[str, frozenset[str]]:
    """For each package of the driver components' apt lists: the names its Depends and Pre-Depends can be satisfied
    by (every alternative, no versions), as `apt-get update` last fetched them."""
    deps: dict[str, set[str]] = {}
    lists = under(root, APT_LISTS)
    for comp in DRIVER_COMPONENTS:
        for p in sorted(lists.glob(f"*_{comp}_binary-*_Packages")):
            try:
                text = read_text_file(p, LIST_MAX)
            except OSError:
                continue
            cur: set[str] | None = None
            for key, value in DEPENDS_RE.findall("\n" + text):
                if key == "Package":
                    cur = deps.setdefault(value, set())
                elif cur is not None:
                    cur.update(alt.split()[0].split(":")[0] for dep in value.split(",") for alt in dep.split("|")
                               if alt.strip())
    return {k: frozenset(v) for k, v in deps.items()}


def closure(names: Iterable[str], depends: dict[str, frozenset[str]]) -> frozenset[str]:
    """`names` and everything they depend on, transitively, as far as `depends` knows."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(depends.get(n, ()))
    return frozenset(seen)
