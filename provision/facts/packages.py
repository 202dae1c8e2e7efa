"""Installed packages, read from dpkg's database under a host root (read only, no process): which packages are
installed, at which version, from which maintainer and source package, held or not, and which package owns a file; and
what the apt lists offer (Ubuntu's precompiled NVIDIA modules, the driver components' dependencies). The engine and
driver facts use it to tell where an installed engine or driver came from; the driver plan to follow kernels and to
change a driver series. rpm's database is not a file format to read here: rpm hosts are asked through `rpm -q` on the
live host (provision/probe)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

from provision.facts.rootfs import read_bytes_bounded, read_text_file, under
from provision.versions import numbers

DPKG_STATUS = "var/lib/dpkg/status"
DPKG_STATUS_MAX = 64 << 20  # dpkg's status file outgrows the facts' 4 MiB bound on hosts with many packages
APT_LISTS = "/var/lib/apt/lists"
LIST_MAX = 256 << 20
# The fields read, each at a line start; one pass over the whole file (dpkg writes Package first in a stanza).
FIELD_RE = re.compile(r"\n(Package|Status|Version|Maintainer|Source|Architecture): ([^\n]*)")
# Ubuntu ships its precompiled NVIDIA modules in `restricted`; one line per package name in a Packages index.
MODULES_RE = re.compile(r"^Package: (linux-modules-nvidia-\S+)$", re.M)
# Where Debian and Ubuntu keep the NVIDIA driver packages (and what they depend on beyond main).
DRIVER_COMPONENTS = ("non-free", "contrib", "restricted", "multiverse")
ARCHIVE_FIELD_RE = re.compile(r"\n(Package|Version|Depends|Pre-Depends): ([^\n]*)")


def upstream_version(version: str) -> str:
    """The upstream part of a Debian version: no epoch, no Debian revision ("5:28.0.1-1~debian.12" -> "28.0.1")."""
    v = version.split(":", 1)[-1]
    return v.rsplit("-", 1)[0] if "-" in v else v


class InstalledPackage(NamedTuple):
    name: str
    version: str  # the package manager's full version: "5:28.0.1-1~debian.12~bookworm"
    maintainer: str = ""
    source: str = ""  # the source package's name (dpkg's Source field without its version; the name when absent)
    held: bool = False
    installed: bool = True  # False: known to dpkg but not fully installed (unpacked, half-configured: a killed run)
    architecture: str = ""  # dpkg's Architecture field: "amd64", "all"
    database: str = "dpkg"  # dpkg | rpm: which database listed it (rpm's: [EPOCH:]VERSION-RELEASE, no maintainer)

    @property
    def upstream(self) -> str:
        return upstream_version(self.version)


# The status file parsed once per version of it: detect and plan ask for it several times (each engine's origin, the
# installed driver, the driver plan), and it is megabytes on a large host. A new version of the file (dpkg replaces
# it by rename) has another identity, so a check after an install reads it again.
_PARSED: dict[tuple, list[dict[str, str]]] = {}


def _dpkg_stanzas(root: Path) -> list[dict[str, str]]:
    """dpkg's status file as one dict of the read fields per package ([] where there is none)."""
    path = under(root, DPKG_STATUS)
    try:
        st = os.stat(path)
    except OSError:
        return []
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _PARSED:
        try:
            text = read_bytes_bounded(path, DPKG_STATUS_MAX).decode(errors="replace")
        except OSError:
            return []
        _PARSED.clear()  # one host's file at a time: tests walk many roots
        _PARSED[key] = _stanzas(text)
    return _PARSED[key]


def _stanzas(text: str) -> list[dict[str, str]]:
    """dpkg's database format (the status file, a journal entry) as one dict of FIELD_RE's fields per package."""
    stanzas: list[dict[str, str]] = []
    for name, value in FIELD_RE.findall("\n" + text):
        if name == "Package":
            stanzas.append({})
        if stanzas:
            stanzas[-1][name] = value
    return stanzas


def dpkg_installed(root: Path, wanted=None, *, partly: bool = False) -> dict[str, InstalledPackage]:
    """Installed packages (status `install|hold ok installed`) by name; `wanted`: a predicate on the name, to keep
    only those; `partly`: also those dpkg left unpacked or half-configured (`installed` False). {} where there is no
    dpkg database."""
    found = {}
    for f in _dpkg_stanzas(root):
        name, status = f["Package"], f.get("Status", "").split()
        whole = status[-2:] == ["ok", "installed"]
        if (wanted and not wanted(name)) or not (whole or partly) or \
                (status[-1:] or [""])[0] in ("not-installed", "config-files", ""):
            continue
        found[name] = InstalledPackage(name, f.get("Version", ""), f.get("Maintainer", ""),
                                       f.get("Source", name).split(" ", 1)[0], status[:1] == ["hold"], whole,
                                       f.get("Architecture", ""))
    return found


# The states dpkg(1) leaves a package in when a run of it is killed (an ssh session dropped, the OOM killer, a power
# cut): between "not-installed" and "installed". "half-installed" (the unpack was cut off) and dpkg's reinst-required
# flag need the package unpacked again; the others, configuring (and their triggers run).
UNFINISHED_STATES = ("half-installed", "unpacked", "half-configured", "triggers-awaited", "triggers-pending")


class UnfinishedPackage(NamedTuple):
    name: str
    version: str  # dpkg's version; rpm's EPOCH:VERSION-RELEASE
    architecture: str
    state: str  # one of UNFINISHED_STATES; rpm's: facts/rpm_unfinished.py's
    # installed again at this version: dpkg's reinst-required flag set or the unpack cut off (dpkg cannot configure it
    # as it is); rpm: its %post or %posttrans may not have run
    reinstall: bool
    database: str = "dpkg"  # dpkg | rpm

    @property
    def spec(self) -> str:
        """The package manager's name for exactly this version: apt's PKG=VERSION, dnf's NAME-EPOCH:VERSION-RELEASE.ARCH."""
        return f"{self.name}-{self.version}.{self.architecture}" if self.database == "rpm" else \
            f"{self.name}={self.version}"


def _journal_stanzas(root: Path) -> list[dict[str, str]]:
    """The stanzas of dpkg's journal (updates/NNNN: what a run recorded and had not yet folded into the status file,
    which a killed run leaves there), oldest first."""
    out: list[dict[str, str]] = []
    journal = under(root, "var/lib/dpkg/updates")
    for path in sorted(journal.glob("[0-9]*")) if journal.is_dir() else []:
        try:
            out += _stanzas(read_bytes_bounded(path, DPKG_STATUS_MAX).decode(errors="replace"))
        except OSError:
            continue
    return out


def dpkg_unfinished(root: Path) -> list[UnfinishedPackage]:
    """The packages a killed dpkg run left part-way (UNFINISHED_STATES), as dpkg itself reads its database: the status
    file with its journal applied (a run killed mid-unpack has recorded the package's state only there)."""
    latest: dict[tuple[str, str], dict[str, str]] = {}
    for f in [*_dpkg_stanzas(root), *_journal_stanzas(root)]:
        latest[(f["Package"], f.get("Architecture", ""))] = f
    out = []
    for f in latest.values():
        status = f.get("Status", "").split()
        if len(status) != 3 or status[2] not in UNFINISHED_STATES:
            continue
        out.append(UnfinishedPackage(f["Package"], f.get("Version", ""), f.get("Architecture", ""), status[2],
                                     status[1] == "reinstreq" or status[2] == "half-installed"))
    return out


def dpkg_owns(root: Path, package: InstalledPackage, path: str) -> bool:
    """Whether dpkg's file list of `package` holds `path` (also through the /usr merge: /bin is /usr/bin). The list is
    info/NAME.list, or info/NAME:ARCH.list for a Multi-Arch: same package: both names are tried, not the directory
    listed (thousands of files: 5 ms per engine)."""
    alts = {path, path.removeprefix("/usr")} | ({"/usr" + path} if not path.startswith("/usr/") else set())
    info = under(root, "var/lib/dpkg/info")
    names = [package.name] + ([f"{package.name}:{package.architecture}"] if package.architecture else [])
    for lst in (info / f"{n}.list" for n in names):
        try:
            lines = set(read_bytes_bounded(lst, DPKG_STATUS_MAX).decode(errors="replace").splitlines())
        except OSError:
            continue
        if lines & alts:
            return True
    return False


def list_texts(root: Path, component: str) -> Iterator[str]:
    """The text of each apt list of `component` (every suite), as `apt-get update` last fetched it: plain, or kept
    compressed (`Acquire::GzipIndexes`, which Docker's Debian images set) as .gz or .xz. Unreadable lists are skipped,
    and so are .lz4 ones (no reader in Python's standard library; facts start no process); each is bounded by
    LIST_MAX."""
    yield from _list_texts(root, f"*_{component}_binary-*_Packages*")


def _list_texts(root: Path, pattern: str) -> Iterator[str]:
    for p in sorted(under(root, APT_LISTS).glob(pattern)):
        suffix = p.name.rsplit("_Packages", 1)[1]
        try:
            if not suffix:
                yield read_text_file(p, LIST_MAX)
            elif suffix in (".gz", ".xz"):
                yield _decompressed(p, suffix)
        except (OSError, EOFError, ValueError):
            continue


def apt_offers(root: Path, package: UnfinishedPackage) -> bool:
    """Whether apt can fetch exactly this version of the package: a .deb in apt's cache, or an apt list (any source,
    flat file: repositories included) naming it."""
    epoch_quoted = package.version.replace(":", "%3a")  # how apt names a cached .deb of a version with an epoch
    if any(under(root, "var/cache/apt/archives").glob(f"{package.name}_{epoch_quoted}_*.deb")):
        return True
    stanza = re.compile(rf"^Package: {re.escape(package.name)}\n(?:[^\n]+\n)*?Version: {re.escape(package.version)}$",
                        re.M)
    return any(stanza.search(text) for text in _list_texts(root, "*_Packages*"))


def _decompressed(path: Path, suffix: str) -> str:
    """A .gz or .xz list, bounded by LIST_MAX; a corrupt one raises ValueError (or OSError, EOFError)."""
    import gzip  # lazy: ~2 ms, only where apt keeps its lists compressed
    import lzma  # lazy: ~2 ms, likewise

    try:
        with (gzip.open if suffix == ".gz" else lzma.open)(path, "rb") as f:
            return f.read(LIST_MAX).decode(errors="replace")
    except lzma.LZMAError as exc:
        raise ValueError(str(exc)) from exc


def fetched_suites(root: Path) -> frozenset[str]:
    """The suites whose package lists `apt-get update` last fetched (from the lists' file names,
    `<host>_<path>_dists_<suite>_<component>_binary-<arch>_Packages`): what apt installs and upgrades from."""
    return frozenset(m.group(1) for p in under(root, APT_LISTS).glob("*_dists_*_binary-*_Packages*")
                     if (m := re.search(r"_dists_([^_]+)_", p.name)))


def offered_module_packages(root: Path) -> frozenset[str]:
    """The `linux-modules-nvidia-*` names in the apt lists of the restricted component (Ubuntu's precompiled, signed
    NVIDIA modules), as `apt-get update` last fetched them; a flavour's metapackage only where the kernel-ABI
    modules package its newest version depends on is in the lists too (apt installs that newest version, and a
    mirror can carry a new kernel's linux-meta before its linux-restricted-modules: apt then stops on the
    metapackage's unmet dependency, where DKMS would have built the module)."""
    newest: dict[str, tuple[tuple[int, ...], frozenset[str]]] = {}
    for text in list_texts(root, "restricted"):
        for m in MODULES_RE.finditer(text):
            end = text.find("\n\n", m.end())
            fields = dict(ARCHIVE_FIELD_RE.findall(text[m.start() - 1 if m.start() else 0:end if end >= 0 else None]))
            deps = frozenset(d.split()[0] for d in fields.get("Depends", "").split(",")
                             if d.strip().startswith("linux-modules-nvidia-"))
            key = numbers(fields.get("Version", ""))
            if m.group(1) not in newest or key > newest[m.group(1)][0]:
                newest[m.group(1)] = (key, deps)
    return frozenset(n for n, (_, deps) in newest.items() if deps <= newest.keys())


class ArchivePackage(NamedTuple):
    """One package version in an apt list."""
    name: str
    version: str  # the full version: "535.309.01-0+deb12u1"
    depends: frozenset[str]  # the names its Depends and Pre-Depends can be satisfied by (every alternative)

    @property
    def upstream(self) -> str:
        return upstream_version(self.version)


def archive_packages(root: Path) -> list[ArchivePackage]:
    """Every package version in the driver components' apt lists (every suite: the point release, its updates and
    security suites), as `apt-get update` last fetched them."""
    out: list[ArchivePackage] = []
    for comp in DRIVER_COMPONENTS:
        for text in list_texts(root, comp):
            for stanza in text.split("\n\n"):
                fields = dict(ARCHIVE_FIELD_RE.findall("\n" + stanza))
                if "Package" not in fields:
                    continue
                deps = ",".join(fields.get(k, "") for k in ("Depends", "Pre-Depends"))
                out.append(ArchivePackage(fields["Package"], fields.get("Version", ""), frozenset(
                    alt.split()[0].split(":")[0] for dep in deps.split(",") for alt in dep.split("|") if alt.strip())))
    return out


def archive_depends(root: Path) -> dict[str, frozenset[str]]:
    """For each package of the driver components' apt lists: the names its Depends and Pre-Depends can be satisfied
    by (every alternative of every version, no versions)."""
    deps: dict[str, set[str]] = {}
    for p in archive_packages(root):
        deps.setdefault(p.name, set()).update(p.depends)
    return {k: frozenset(v) for k, v in deps.items()}


def archive_versions(root: Path, names: Iterable[str]) -> dict[str, frozenset[str]]:
    """For each of `names`: the upstream versions the driver components' apt lists offer (every suite). Only the
    named stanzas are read: detect asks this on every Debian GPU host, and the lists are megabytes."""
    wanted = sorted(set(names))
    vers: dict[str, set[str]] = {n: set() for n in wanted}
    if not wanted:
        return {}
    stanza = re.compile(r"^Package: (" + "|".join(map(re.escape, wanted)) + r")\n(?:.+\n)*?Version: (\S+)", re.M)
    for comp in DRIVER_COMPONENTS:
        for text in list_texts(root, comp):
            for m in stanza.finditer(text):
                vers[m.group(1)].add(upstream_version(m.group(2)))
    return {k: frozenset(v) for k, v in vers.items() if v}


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


def suite_versions(root: Path, names: Iterable[str], lists: str = APT_LISTS) -> dict[str, dict[str, frozenset[str]]]:
    """For each of `names`: the upstream versions the driver components' apt lists offer, per suite (the suite a
    list came from is in its file name, `<host>_<path>_dists_<suite>_<component>_binary-<arch>_Packages`): where a
    version comes from, the point release or its security or updates suite, as `apt-cache policy` tells it. `lists`:
    the lists directory under `root` (a private one holds the lists as they will be: plan/archive_preview.py)."""
    wanted = sorted(set(names))
    out: dict[str, dict[str, set[str]]] = {n: {} for n in wanted}
    if not wanted:
        return {}
    stanza = re.compile(r"^Package: (" + "|".join(map(re.escape, wanted)) + r")\n(?:.+\n)*?Version: (\S+)", re.M)
    for comp in DRIVER_COMPONENTS:
        for p in sorted(under(root, lists).glob(f"*_dists_*_{comp}_binary-*_Packages*")):
            suite = re.search(r"_dists_([^_]+)_", p.name)
            suffix = p.name.rsplit("_Packages", 1)[1]
            try:
                text = read_text_file(p, LIST_MAX) if not suffix else \
                    _decompressed(p, suffix) if suffix in (".gz", ".xz") else ""
            except (OSError, EOFError, ValueError):
                continue
            for m in stanza.finditer(text):
                if suite:
                    out[m.group(1)].setdefault(suite.group(1), set()).add(upstream_version(m.group(2)))
    return {n: {s: frozenset(v) for s, v in by.items()} for n, by in out.items() if by}
