"""The one version parser: driver versions ("580.95.05"), CUDA versions ("12.2"), kernel releases ("6.1.0-18-amd64").
A top-level module with no imports, so that any layer may use it (facts/ to sort kernels, inject/ on every GPU
container start, where `re` is not wanted on the cold path).

    numbers("535.161.08") == (535, 161, 8);  numbers("6.1.0-18-amd64") == (6, 1, 0, 18);  numbers("12") == (12,)
    release_key(r)   # sorts kernel releases: by their numbers, then by the whole string (flavours, -rc)
    rpm_vercmp(a, b), rpm_evr_cmp(a, b)   # rpm's own order (-1, 0, 1): of versions, of EPOCH:VERSION-RELEASE"""
from __future__ import annotations


def numbers(text: str) -> tuple[int, ...]:
    """The leading numbers of a version, split at '.' and '-': each part's leading digits, up to the first part
    that has none or that has something after its digits ("5.15.0rc1" -> (5, 15, 0), "6.8.0-rc3" -> (6, 8, 0))."""
    out: list[int] = []
    for part in text.replace("-", ".").split("."):
        n = 0
        while n < len(part) and "0" <= part[n] <= "9":  # ASCII digits only (str.isdigit also takes '²')
            n += 1
        if not n:
            break
        out.append(int(part[:n]))
        if n < len(part):
            break
    return tuple(out)


def release_key(release: str) -> tuple[tuple[int, ...], str]:
    """Sort key for kernel releases: numerically ("6.1.0-9" < "6.1.0-18"), ties (flavours) by the string, so two
    releases always compare (a mixed int/str tuple does not)."""
    return numbers(release), release


def rpm_vercmp(a: str, b: str) -> int:
    """rpm's own comparison of two versions (or two releases), as rpmvercmp() in rpm's lib/rpmvercmp.c: -1, 0 or 1.
    Alternating runs of ASCII digits and of ASCII letters compare in turn (digits numerically, and newer than
    letters); any other character only separates them; '~' sorts before anything (a pre-release), '^' after the
    version it extends (a snapshot)."""
    if a == b:
        return 0
    i = j = 0
    while i < len(a) or j < len(b):
        while i < len(a) and not _rpm_alnum(a[i]) and a[i] not in "~^":
            i += 1
        while j < len(b) and not _rpm_alnum(b[j]) and b[j] not in "~^":
            j += 1
        ca, cb = a[i:i + 1], b[j:j + 1]
        if ca == "~" or cb == "~":
            if ca != "~":
                return 1
            if cb != "~":
                return -1
            i, j = i + 1, j + 1
            continue
        if ca == "^" or cb == "^":
            if not ca:
                return -1
            if not cb:
                return 1
            if ca != "^":
                return 1
            if cb != "^":
                return -1
            i, j = i + 1, j + 1
            continue
        if not (ca and cb):
            break
        digits = "0" <= ca <= "9"
        si, sj = i, j
        while i < len(a) and _rpm_alnum(a[i]) and ("0" <= a[i] <= "9") == digits:
            i += 1
        while j < len(b) and _rpm_alnum(b[j]) and ("0" <= b[j] <= "9") == digits:
            j += 1
        sa, sb = a[si:i], b[sj:j]
        if not sb:  # the segments differ in kind: a number is newer than letters
            return 1 if digits else -1
        if digits:
            sa, sb = sa.lstrip("0"), sb.lstrip("0")
            if len(sa) != len(sb):
                return 1 if len(sa) > len(sb) else -1
        if sa != sb:
            return 1 if sa > sb else -1
    if i >= len(a) and j >= len(b):
        return 0  # equal but for their separators
    return -1 if i >= len(a) else 1  # the one with something left over is newer


def _rpm_alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


def rpm_evr_cmp(a: str, b: str) -> int:
    """Two [EPOCH:]VERSION-RELEASE compared as rpm does: the epoch (0 when none) numerically, then the version, then
    the release (a side without a release compares equal on it)."""
    def split(evr: str) -> tuple[int, str, str]:
        epoch, _, vr = evr.rpartition(":") if ":" in evr else ("0", "", evr)
        version, _, release = vr.rpartition("-") if "-" in vr else (vr, "", "")
        return int(epoch) if epoch.isdigit() else 0, version, release

    ea, va, ra = split(a)
    eb, vb, rb = split(b)
    if ea != eb:
        return 1 if ea > eb else -1
    return rpm_vercmp(va, vb) or (rpm_vercmp(ra, rb) if ra and rb else 0)
