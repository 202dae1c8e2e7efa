"""Runtime settings: /etc/gpuprov/runtime.json (GPUPROV_RUNTIME_CONFIG overrides the path, for tests)."""
from __future__ import annotations

import json
import os

from provision import paths

DEFAULT_PATH = "/etc/gpuprov/runtime.json"
DEFAULTS = {
    "runc": None,  # the low-level runtime to hand over to; None = runc found on PATH
    "driver_root": "/",  # where the driver's userspace lives: "/", "/usr/local/nvidia", "/run/nvidia/driver"
    "dev_root": "/",  # where the host's /dev is (tests point this at a tree of real mknod nodes)
    "proc_root": "/",
    "cache": paths.DISCOVERY_CACHE,
    # Multi-tenant hosts turn this off: unprivileged containers then get GPUs only through device-list mounts
    # under /var/run/nvidia-container-devices/ (what Kubernetes device plugins pass), never from their own env.
    "accept_env_unprivileged": True,
    # Written by `gpuprov share enable`: where MPS runs, its defaults; absent = sharing off.
    "share_state": paths.SHARE_STATE,
}


def settings_path() -> str:
    return os.environ.get("GPUPROV_RUNTIME_CONFIG", DEFAULT_PATH)


def load_settings() -> dict:
    s = dict(DEFAULTS)
    try:
        with open(settings_path()) as fh:
            s.update(json.load(fh))
    except FileNotFoundError:
        pass
    if not s["runc"]:
        import shutil  # lazy: 2.2 ms (-X importtime -I -S, min of 15) on each runtime start; only without a runc setting

        s["runc"] = shutil.which("runc") or "/usr/sbin/runc"
    return s
