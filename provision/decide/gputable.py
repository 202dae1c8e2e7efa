"""The vendored GPU table (provision/data/gpu_table.json, made by scripts/regen_gpu_table.py)."""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from provision.errors import UsageError
from provision.values import PCI_ID

TABLE_PATH = Path(__file__).resolve().parent.parent / "data" / "gpu_table.json"
PCI_ID_RE = re.compile(f"^{PCI_ID}$")  # the CLI's options check the same rule (provision/values.py)


class PciId(NamedTuple):
    vendor: int
    device: int
    subvendor: int | None = None
    subdevice: int | None = None

    def __str__(self) -> str:
        return f"{self.vendor:04x}:{self.device:04x}"

    @property
    def subsystem(self) -> str | None:
        if self.subvendor is None or self.subdevice is None:
            return None
        return f"{self.subvendor:04x}:{self.subdevice:04x}"


def parse_pci_id(text: str) -> PciId:
    m = PCI_ID_RE.match(text.strip())
    if not m:
        raise UsageError(
            f"malformed PCI id {text!r}: expected VENDOR:DEVICE[:SUBVENDOR:SUBDEVICE] in hex, e.g. 10de:2330:10de:16c1"
        )
    vals = [int(g, 16) if g else None for g in m.groups()]
    return PciId(vals[0], vals[1], vals[2], vals[3])


@lru_cache(maxsize=1)
def load_table() -> dict:
    return json.loads(TABLE_PATH.read_text())


def table_entry(device: int) -> dict | None:
    return load_table()["devices"].get(f"{device:04x}")


def newest_branch() -> str:
    return load_table()["newest_branch"]
