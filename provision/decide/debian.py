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
from typing import NamedTuple

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
