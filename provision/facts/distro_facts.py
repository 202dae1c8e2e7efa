"""Which distribution and release a root holds, from <root>/etc/os-release (or /usr/lib/os-release, or the legacy
release files such as /etc/centos-release).

An os-release that names its ID, VERSION_ID and PRETTY_NAME (every release gpuprov has rules for but CentOS) is read
here, tokenised as `distro` tokenises it; anything else (no os-release, a missing field, CentOS, whose precise
version is in /etc/centos-release) goes through `distro`. `distro` costs 11 ms to import, a sixth of what
`gpuprov detect` may take (issue 20); tests/unit/test_detect_facts.py holds the two readers to the same facts for
every fixture release."""
from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import NamedTuple

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


class DistroFacts(NamedTuple):
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
        d = self._asdict()
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


# What a command that decides for a release can take instead of a host tree (`detect`, `plan`); uninstall, which has
# no --target, is told only of --root (read_host_root; seen: `uninstall --root /tmp` suggested --target).
TARGET_HINT = ", or use --target to name the release"


def _release_files(root: Path, target_hint: bool = True) -> dict[str, bytes]:
    """The release files present under `root`, each read once through the bounded, non-blocking reader: `distro`
    then parses copies of these alone, so it never opens anything else in the tree (a FIFO named
    etc/x-release would otherwise hang it). `target_hint`: the error may point at --target."""
    candidates = ["etc/os-release", "usr/lib/os-release", *LEGACY_FILES]
    present = [c for c in candidates if under(root, c).exists()]
    if not present:
        raise HostUnreadable(
            f"no os-release under {root} (looked for /etc/os-release, /usr/lib/os-release and legacy release "
            f"files): pass --root pointing at a host's root{TARGET_HINT if target_hint else ''}"
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
                             "bytes; restore it from the distro package"
                             + (", or pass --target to name the release" if target_hint else ""))
    return out


def os_release_fields(data: bytes) -> dict[str, str]:
    """os-release(5)'s assignments, keys lower-cased, values as a POSIX shell reads them: `distro`'s own reading (shlex,
    whitespace-split; `#` starts a comment; a word without `=` is ignored)."""
    try:
        text = data.decode()
    except UnicodeDecodeError:  # `distro` reads it as UTF-8 too, and says what it makes of bytes that are not
        return {}
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # an unclosed quote: `distro` reads it (and says what it makes of it)
        return {}
    return {k.lower(): v for k, sep, v in (w.partition("=") for w in words) if sep}


def read_host_root(root: Path) -> DistroFacts:
    """A `--root` that must be a host tree (a directory with a readable os-release): its distro, else exit 3 in one
    line, the same for every command that takes one (detect, plan, uninstall)."""
    if not root.is_dir():
        raise HostUnreadable(f"--root {root} is not a directory: pass the root of a host tree")
    return read_distro(root, target_hint=False)  # (uninstall has no --target)


def read_distro(root: Path, target_hint: bool = True) -> DistroFacts:
    files = _release_files(root, target_hint)
    os_rel = next((c for c in ("etc/os-release", "usr/lib/os-release") if c in files), None)
    fields = os_release_fields(files[os_rel]) if os_rel else {}
    if fields.get("id") and fields.get("version_id") and fields.get("pretty_name") and fields["id"] != "centos":
        return _facts(fields["id"], fields["version_id"], fields)
    return _facts_by_distro(root, files, os_rel)


def _facts_by_distro(root: Path, files: dict[str, bytes], os_rel: str | None) -> DistroFacts:
    # `distro` is pointed at exactly the files checked above (regular, bounded), by name: it opens nothing else
    # (a FIFO named etc/x-release would hang it) and nothing is copied (facts write nothing: plans run on a
    # read-only root). /dev/null stands for "none of that kind".
    import distro  # lazy: 11 ms (perf_counter around the import, after re/json/shlex, min of 5); see the docstring

    legacy = next((c for c in LEGACY_FILES if c in files), None)
    info = distro.LinuxDistribution(
        include_lsb=False, include_uname=False, include_oslevel=False, root_dir=str(root),
        os_release_file=str(under(root, os_rel)) if os_rel else os.devnull,
        distro_release_file=str(under(root, legacy)) if legacy else os.devnull,
    )
    info.info()  # parse now
    # The raw ID (distro normalises some, e.g. "ol" -> "oracle"); legacy release files only give distro's.
    os_id = info.os_release_attr("id") or info.id()
    if not os_id:
        raise HostUnreadable(f"os-release under {root} has no ID=: the file is malformed; restore it from the distro package")
    version = info.version(best=True) if os_id in ("centos",) else (info.os_release_attr("version_id") or info.version())
    return _facts(os_id, version, {**info.os_release_info(), "id_like": info.like(),
                                         "pretty_name": info.name(pretty=True)})


def _facts(os_id: str, version: str, fields: dict[str, str]) -> DistroFacts:
    """`fields`: os-release's (keys lower-cased), with ID_LIKE and PRETTY_NAME as `distro` completes them."""
    like = tuple(fields.get("id_like", "").split())
    family = _family(os_id, like)
    major = version if os_id == "ubuntu" else version.split(".")[0]
    # Suites matter on Debian/Ubuntu only; EL "codenames" (Plow, Blue Onyx) are names, not repository keys.
    codename = fields.get("version_codename") or fields.get("ubuntu_codename") or ""
    return DistroFacts(
        id=os_id,
        version=version,
        major=major,
        codename=codename.lower().split()[0] if codename else "",
        family=family,
        package_manager=_package_manager(family, os_id, major),
        like=like,
        pretty_name=fields.get("pretty_name", ""),
        platform_id=fields.get("platform_id", ""),
    )
