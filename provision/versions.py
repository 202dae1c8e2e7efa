"""The one version parser: driver versions ("580.95.05"), CUDA versions ("12.2"), kernel releases ("6.1.0-18-amd64").
A top-level module with no imports, so that any layer may use it (facts/ to sort kernels, inject/ on every GPU
container start, where `re` is not wanted on the cold path).

    numbers("535.161.08") == (535, 161, 8);  numbers("6.1.0-18-amd64") == (6, 1, 0, 18);  numbers("12") == (12,)
    release_key(r)   # sorts kernel releases: by their numbers, then by the whole string (flavours, -rc)"""
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
