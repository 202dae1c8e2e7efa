"""GPUs on the PCI bus, from <root>/sys/bus/pci/devices/* (no lspci needed)."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from provision.facts.rootfs import under

NVIDIA_VENDOR = 0x10DE
# PCI class (base, subclass): VGA 0x0300, 3D controller 0x0302, other display 0x0380.
DISPLAY_CLASSES = (0x0300, 0x0302, 0x0380)


@dataclass(frozen=True)
class PciDisplayDevice:
    address: str  # 0000:00:06.0
    vendor_id: int
    device_id: int
    subsystem_vendor_id: int | None
    subsystem_device_id: int | None
    pci_class: int  # 24-bit class code, e.g. 0x030200
    driver: str | None  # bound kernel driver (nvidia, nouveau, vfio-pci) or None
    numa_node: int | None

    @property
    def is_nvidia(self) -> bool:
        return self.vendor_id == NVIDIA_VENDOR

    @property
    def pci_id(self) -> str:
        return f"{self.vendor_id:04x}:{self.device_id:04x}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            pci_id=self.pci_id,
            vendor_id=f"{self.vendor_id:04x}",
            device_id=f"{self.device_id:04x}",
            subsystem_vendor_id=None if self.subsystem_vendor_id is None else f"{self.subsystem_vendor_id:04x}",
            subsystem_device_id=None if self.subsystem_device_id is None else f"{self.subsystem_device_id:04x}",
            pci_class=f"{self.pci_class:06x}",
        )
        return d


def _hex(path: Path) -> int | None:
    try:
        return int(path.read_text().strip(), 16)
    except (OSError, ValueError):
        return None


def scan_display_devices(root: Path) -> list[PciDisplayDevice]:
    """Every display-class PCI device (any vendor), sorted by address."""
    base = under(root, "sys/bus/pci/devices")
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    found = []
    for addr in entries:
        d = base / addr
        cls = _hex(d / "class")
        if cls is None or (cls >> 8) not in DISPLAY_CLASSES:
            continue
        vendor, device = _hex(d / "vendor"), _hex(d / "device")
        if vendor is None or device is None:
            continue
        try:
            driver = os.path.basename(os.readlink(d / "driver"))  # dangling in captures: readlink still works
        except OSError:
            driver = None
        numa = None
        try:
            numa = int((d / "numa_node").read_text().strip())
        except (OSError, ValueError):
            pass
        found.append(
            PciDisplayDevice(
                address=addr, vendor_id=vendor, device_id=device,
                subsystem_vendor_id=_hex(d / "subsystem_vendor"), subsystem_device_id=_hex(d / "subsystem_device"),
                pci_class=cls, driver=driver, numa_node=None if numa is None or numa < 0 else numa,
            )
        )
    return found
