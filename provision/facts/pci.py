"""GPUs on the PCI bus, from <root>/sys/bus/pci/devices/* (no lspci needed)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from provision.facts.rootfs import read_text_file, under
from provision.values import NVIDIA_VENDOR

# PCI class (base, subclass): VGA 0x0300, 3D controller 0x0302, other display 0x0380.
DISPLAY_CLASSES = (0x0300, 0x0302, 0x0380)


class PciDisplayDevice(NamedTuple):
    address: str  # 0000:00:06.0
    vendor_id: int
    device_id: int
    subsystem_vendor_id: int | None
    subsystem_device_id: int | None
    pci_class: int | None  # 24-bit class code, e.g. 0x030200; None when it could not be read
    driver: str | None  # bound kernel driver (nvidia, nouveau, vfio-pci) or None
    numa_node: int | None

    @property
    def is_nvidia(self) -> bool:
        return self.vendor_id == NVIDIA_VENDOR

    @property
    def pci_id(self) -> str:
        return f"{self.vendor_id:04x}:{self.device_id:04x}"

    def to_dict(self) -> dict:
        d = self._asdict()
        d.update(
            pci_id=self.pci_id,
            vendor_id=f"{self.vendor_id:04x}",
            device_id=f"{self.device_id:04x}",
            subsystem_vendor_id=None if self.subsystem_vendor_id is None else f"{self.subsystem_vendor_id:04x}",
            subsystem_device_id=None if self.subsystem_device_id is None else f"{self.subsystem_device_id:04x}",
            pci_class=None if self.pci_class is None else f"{self.pci_class:06x}",
        )
        return d


def _hex(path: Path) -> int:
    """A sysfs hex attribute ("0x10de\n"). Raises OSError (unreadable, not a regular file) or ValueError."""
    return int(read_text_file(path, 4096).strip(), 16)


# modalias, e.g. pci:v000010DEd00002335sv000010DEsd000018BFbc03sc02i00: the same ids again, read when an attribute
# cannot be (a capture that lost one, a file made unreadable).
MODALIAS_RE = re.compile(r"^pci:v([0-9A-F]{8})d([0-9A-F]{8})sv([0-9A-F]{8})sd([0-9A-F]{8})bc([0-9A-F]{2})"
                         r"sc([0-9A-F]{2})i([0-9A-F]{2})", re.I)


def _modalias(d: Path) -> dict[str, int]:
    try:
        m = MODALIAS_RE.match(read_text_file(d / "modalias", 4096).strip())
    except OSError:
        return {}
    if not m:
        return {}
    v, dev, sv, sd, bc, sc, pi = (int(x, 16) for x in m.groups())
    return {"vendor": v, "device": dev, "subsystem_vendor": sv, "subsystem_device": sd,
            "class": (bc << 16) | (sc << 8) | pi}


class PciScan(NamedTuple):
    """The display devices found and what could not be read about them."""
    devices: list[PciDisplayDevice]
    warnings: list[str]


def scan_pci(root: Path) -> PciScan:
    """Every display-class PCI device (any vendor), sorted by address. An attribute that cannot be read never
    drops a device silently: its modalias is tried, then the device is reported with what could be read (an
    NVIDIA device whose class is unknown counts as a GPU) and a warning says what was missing
    (tests/faults/test_detect_sysfs.py)."""
    base = under(root, "sys/bus/pci/devices")
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return PciScan([], [])
    found: list[PciDisplayDevice] = []
    warnings: list[str] = []
    for addr in entries:
        d = base / addr
        vals, errors = _ids(d)
        cls, vendor, device = vals["class"], vals["vendor"], vals["device"]
        if cls is not None and (cls >> 8) not in DISPLAY_CLASSES:
            continue
        missing = ", ".join(f"{k} ({v})" for k, v in errors.items())
        if vendor is None or (vendor == NVIDIA_VENDOR and device is None):
            warnings.append(f"PCI device {addr}: cannot read {missing}; it was not checked for an NVIDIA GPU "
                            "(run detect as root, or fix the --root tree)")
            continue
        if cls is None and vendor != NVIDIA_VENDOR:
            continue  # another vendor's device of unknown class: not ours to report
        if errors:
            warnings.append(f"PCI device {addr} ({vendor:04x}:{device:04x}): cannot read {missing}; reported with "
                            "what could be read")
        found.append(
            PciDisplayDevice(
                address=addr, vendor_id=vendor, device_id=device,
                subsystem_vendor_id=vals["subsystem_vendor"], subsystem_device_id=vals["subsystem_device"],
                pci_class=cls, driver=_driver_name(d), numa_node=_numa_node(d),
            )
        )
    return PciScan(found, warnings)


def _ids(d: Path) -> tuple[dict[str, int | None], dict[str, str]]:
    """The device's id attributes, each from its sysfs file or else from `modalias`; and why each one that neither
    gave could not be read."""
    vals: dict[str, int | None] = {}
    errors: dict[str, str] = {}
    alias: dict[str, int] | None = None
    for name in ("class", "vendor", "device", "subsystem_vendor", "subsystem_device"):
        try:
            vals[name] = _hex(d / name)
        except (OSError, ValueError) as exc:
            if alias is None:
                alias = _modalias(d)
            vals[name] = alias.get(name)
            if vals[name] is None:
                errors[name] = (exc.strerror or str(exc)) if isinstance(exc, OSError) else "not a hex number"
    return vals, errors


def _driver_name(d: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(d / "driver"))  # dangling in captures: readlink still works
    except OSError:
        return None


def _numa_node(d: Path) -> int | None:
    """-1 (no NUMA) and an unreadable file are both None."""
    try:
        numa = int(read_text_file(d / "numa_node", 4096).strip())
    except (OSError, ValueError):
        return None
    return None if numa < 0 else numa


def scan_display_devices(root: Path) -> list[PciDisplayDevice]:
    return scan_pci(root).devices
