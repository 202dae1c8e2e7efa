"""A fake driver host built from the H200 capture: same file names (tiny contents), real /proc text, and real
character device nodes (mknod) with the capture's numbers."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import H200

NODES = {"nvidiactl": (195, 255), "nvidia0": (195, 0), "nvidia-uvm": (238, 0), "nvidia-uvm-tools": (238, 1)}


def fake_dev(base: Path) -> Path:
    dev = base / "devroot"
    (dev / "dev").mkdir(parents=True, exist_ok=True)
    for name, (ma, mi) in NODES.items():
        p = dev / "dev" / name
        if not p.exists():
            os.mknod(p, 0o666 | 0o020000, os.makedev(ma, mi))
    return dev


def settings(base: Path) -> dict:
    return {"runc": "runc", "driver_root": str(H200 / "usr/local/nvidia"), "dev_root": str(fake_dev(base)),
            "proc_root": str(H200), "cache": str(base / "discovery.json"), "accept_env_unprivileged": True}


def write_settings(base: Path, **over) -> Path:
    p = base / "runtime.json"
    p.write_text(json.dumps({**settings(base), **over}))
    return p
