"""Which Debian package drives a GPU, per suite: Debian's own answer (the `nvidia-detect` package's id lists and its
order of preference), so gpuprov recommends what Debian's maintainers recommend for every id Debian knows.

The lists are vendored in provision/data/debian_nvidia_ids.json by scripts/debian_nvidia_detect.py (which names
the nvidia-detect version per suite); tests/integration/test_driver_debian_detect.py runs the real nvidia-detect
script over every id in them and holds `recommend` against it.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Mapping, NamedTuple

from provision.versions import numbers

IDS_PATH = Path(__file__).resolve().parent.parent / "data" / "debian_nvidia_ids.json"


class DebianDriver(NamedTuple):
    branch: str  # the driver major this package ships ("535", "470", "390")
    package: str  # the metapackage Debian's nvidia-detect names
    kernel_dkms: str  # its proprietary kernel module, built by DKMS
    version: str  # upstream version in the suite (apt-cache madison, 2026-11)
    lists: tuple[str, ...]  # nvidia-detect id lists of the GPUs it supports
    open_dkms: str | None = None  # the open kernel modules' DKMS package, where the suite has one
    recommended: bool = True  # False: in the archive, but nvidia-detect never recommends it (pin only)

    @property
    def node_packages(self) -> tuple[str, ...]:
        """What a GPU container node needs beyond the metapackage's hard dependencies (apt runs without
        recommends): nvidia-smi and the CUDA driver library, which the runtime hands to containers."""
        if self.package == "nvidia-driver":
            return ("nvidia-smi", "libcuda1")
        series = self.package.removesuffix("-driver")  # nvidia-tesla-470, nvidia-legacy-390xx
        return (f"{series}-smi", f"lib{series}-cuda1")


class DebianSuite(NamedTuple):
    codename: str
    version: str
    drivers: tuple[DebianDriver, ...]  # nvidia-detect's order of preference first, then pin-only packages
    gone: tuple[tuple[str, str], ...] = ()  # (id list, why) for lists nvidia-detect checks but cannot install

    @property
    def main(self) -> DebianDriver:
        return self.drivers[0]


def _tesla(branch: str, version: str, **kw) -> DebianDriver:
    return DebianDriver(branch, f"nvidia-tesla-{branch}-driver", f"nvidia-tesla-{branch}-kernel-dkms", version,
                        (f"nvidia-tesla-{branch}",), **kw)


LEGACY_390 = DebianDriver("390", "nvidia-legacy-390xx-driver", "nvidia-legacy-390xx-kernel-dkms", "390.157",
                          ("nvidia-legacy-390xx", "nvidia-legacy-390xx-amd64"))
# The order is nvidia-detect's own (its per-suite if/elif chain); packages after the recommended ones are in the
# archive for --driver <branch> only.
SUITES: dict[str, DebianSuite] = {
    "bullseye": DebianSuite("bullseye", "11", (
        # bullseye's nvidia-driver is 470: nvidia-detect tests the Tesla 470 list for it (identical to nvidia.ids).
        DebianDriver("470", "nvidia-driver", "nvidia-kernel-dkms", "470.256.02", ("nvidia-tesla-470",)),
        LEGACY_390,
        _tesla("418", "418.226.00"),
        _tesla("460", "460.106.00", recommended=False),
        _tesla("450", "450.248.02", recommended=False),
        _tesla("470", "470.256.02", recommended=False),
    ), gone=(("nvidia", "bullseye-backports (where nvidia-detect sends GPUs only newer drivers support) is "
                        "archived"),)),
    "bookworm": DebianSuite("bookworm", "12", (
        DebianDriver("535", "nvidia-driver", "nvidia-kernel-dkms", "535.261.03", ("nvidia",),
                     open_dkms="nvidia-open-kernel-dkms"),
        _tesla("470", "470.256.02"),
        _tesla("535", "535.216.03", recommended=False),
    )),
    "trixie": DebianSuite("trixie", "13", (
        DebianDriver("550", "nvidia-driver", "nvidia-kernel-dkms", "550.163.01", ("nvidia",),
                     open_dkms="nvidia-open-kernel-dkms"),
        _tesla("535", "535.274.02"),
    )),
}


# The suites that carry a release's updates after it (Debian's security suite, and its updates suite): a package
# whose newest version comes from one of them is maintained; one the point release alone carries gets no fixes.
UPDATE_SUITES = ("-security", "-updates")


class Upkeep(NamedTuple):
    """Which of a driver's two kernel-module flavours the archive maintains, from where each one's newest in-branch
    version comes from (the suite of its candidate, as `apt-cache policy` shows it)."""
    flavour: str | None  # "open" | "proprietary": the only one maintained; None: neither is, or both are
    why: str = ""  # in words, for the plan


def upkeep(drv: DebianDriver, origins: Mapping[str, Mapping[str, frozenset[str]]], codename: str) -> Upkeep:
    """The flavour of `drv` whose newest in-branch version an update suite of `codename` carries, where the other
    flavour's does not (or is older): bookworm-security carries nvidia-kernel-dkms 535.309.01 while
    nvidia-open-kernel-dkms stays at bookworm's 535.261.03. origins: package -> suite -> upstream versions
    (facts.packages.suite_versions). Upkeep(None) where the lists cannot tell, where neither flavour is maintained
    (trixie: both 550.163.01 in the release alone) or where both are."""
    if not drv.open_dkms:
        return Upkeep(None)

    def newest(pkg: str) -> tuple[str, tuple[str, ...]] | None:
        by = origins.get(pkg, {})
        versions = {v for vs in by.values() for v in vs if v.split(".")[0] == drv.branch}
        if not versions:
            return None
        top = max(versions, key=numbers)
        return top, tuple(sorted(s for s, vs in by.items() if top in vs))

    flavours = {"proprietary": (drv.kernel_dkms, newest(drv.kernel_dkms)), "open": (drv.open_dkms, newest(drv.open_dkms))}
    if any(n is None for _, n in flavours.values()):
        return Upkeep(None)
    best = max(numbers(n[0]) for _, n in flavours.values())  # type: ignore[index]
    kept = [f for f, (_, n) in flavours.items()
            if numbers(n[0]) == best and any(s.startswith(codename) and s.endswith(UPDATE_SUITES) for s in n[1])]  # type: ignore[index]
    if len(kept) != 1:
        return Upkeep(None)
    (pkg, (ver, suites)), (other, (over, osuites)) = flavours[kept[0]], flavours[
        "open" if kept[0] == "proprietary" else "proprietary"]  # type: ignore[misc]
    upd = ", ".join(s for s in suites if s.endswith(UPDATE_SUITES))
    lags = "lags" if any(s.endswith(UPDATE_SUITES) for s in osuites) else "gets no updates"
    return Upkeep(kept[0], f"{upd} updates {pkg} ({ver}); {other} {over} {lags} ({', '.join(osuites)})")


def debian_driver_packages(suite: str) -> tuple[str, ...]:
    """The suite's driver metapackages and module packages: whose versions in the apt lists decide the flavour."""
    s = SUITES.get(suite)
    return tuple(n for d in (s.drivers if s else ()) for n in (d.package, d.kernel_dkms, d.open_dkms) if n)


# Debian's legacy lists for series no current suite ships: the branch an unknown-to-NVIDIA's-table id belongs to.
# Newest first: a GPU belongs to the newest series that still supports it.
LEGACY_LISTS = {"nvidia-tesla-470": "470", "nvidia-tesla-418": "418", "nvidia-legacy-390xx": "390",
                "nvidia-legacy-390xx-amd64": "390", "nvidia-legacy-340xx": "340", "nvidia-legacy-304xx": "304",
                "nvidia-legacy-173xx": "173", "nvidia-legacy-96xx": "96", "nvidia-legacy-71xx": "71"}


@lru_cache(maxsize=1)
def _lists() -> dict[str, dict[str, frozenset[int]]]:
    doc = json.loads(IDS_PATH.read_text())
    return {suite: {name: frozenset(int(x, 16) for x in ids.split()) for name, ids in s["lists"].items()}
            for suite, s in doc["suites"].items()}


def nvidia_detect_version(suite: str) -> str:
    return json.loads(IDS_PATH.read_text())["suites"][suite]["nvidia_detect"]


def known_ids(suite: str) -> frozenset[int]:
    """Every device id in the suite's lists (what nvidia-detect knows)."""
    return frozenset().union(*_lists()[suite].values())


def in_lists(device: int, suite: str, names: tuple[str, ...]) -> bool:
    lists = _lists()[suite]
    return any(device in lists.get(n, ()) for n in names)


def supports(drv: DebianDriver, device: int, suite: str) -> bool:
    return in_lists(device, suite, drv.lists)


def legacy_branch(device: int) -> str | None:
    """The newest legacy series Debian's lists (any suite) put a device in, for ids NVIDIA's table lacks."""
    for name, branch in LEGACY_LISTS.items():
        if any(device in lists.get(name, ()) for lists in _lists().values()):
            return branch
    return None


def recommend(device: int, suite: str) -> tuple[DebianDriver | None, str | None]:
    """(the package nvidia-detect recommends, or None with Debian's reason)."""
    s = SUITES[suite]
    for drv in s.drivers:
        if drv.recommended and supports(drv, device, suite):
            return drv, None
    for name, why in s.gone:
        if in_lists(device, suite, (name,)):
            return None, f"Debian {s.version} ({suite}) packages no driver for it: {why}"
    branch = legacy_branch(device)
    if branch:
        return None, (f"it is supported only by the {branch} legacy series, which Debian {s.version} ({suite}) "
                      "does not package")
    return None, f"no driver in Debian {s.version} ({suite}) supports it (not in nvidia-detect {suite}'s lists)"


def pinned(device: int, suite: str, branch: str) -> tuple[DebianDriver | None, str | None]:
    """The suite's package of driver BRANCH for this GPU (the suite's main driver first), or why not."""
    s = SUITES[suite]
    cands = [d for d in s.drivers if d.branch == branch]
    ok = [d for d in s.drivers if supports(d, device, suite)]
    way = (f"branches that support it there: {', '.join(sorted({d.branch for d in ok}, key=int, reverse=True))}"
           if ok else "no branch Debian packages there supports it")
    if not cands:
        return None, f"Debian {s.version} ({suite}) does not package driver branch {branch}; {way}"
    for drv in cands:
        if supports(drv, device, suite):
            return drv, None
    return None, f"Debian {s.version}'s {cands[0].package} ({branch}) does not support this GPU; {way}"


def in_current_lists(device: int) -> bool:
    """In some suite's list for its main driver or open modules (a GPU current drivers support)."""
    return any(device in lists.get(n, ()) for lists in _lists().values() for n in ("nvidia", "nvidia-open"))
