"""Where gpuprov keeps its state on a host: every path under /var/lib/gpuprov, /run/gpuprov and /var/log/gpuprov
comes from here.

GPUPROV_STATE_DIR, GPUPROV_RUN_DIR and GPUPROV_LOG_DIR move them (the test suite points them at private directories,
so it never writes the host's own gpuprov state). Plain strings, no pathlib: the runtime's container-start path
imports this.
Fixed on purpose, so not here: the host lock (every run must find the same one, provision/hostlock.py), the warm
editor's socket (shim.c names it too, inject/server.py) and verify's check paths (a controller names them for a
node, verify/checks.py).

Root's alone, whatever the umask: the directories are made by fsutil (write_file, make_dirs) with explicit modes
(0755; bundles 0700), and what is read back from them (the discovery cache, share.json, state.json, the install
stamp) goes through fsutil.open_trusted: used only when it and every directory above it are root's and writable by
no one else, otherwise a miss (a cache) or a refusal (state)."""
from __future__ import annotations

import os

STATE_DIR = os.environ.get("GPUPROV_STATE_DIR", "/var/lib/gpuprov")
RUN_DIR = os.environ.get("GPUPROV_RUN_DIR", "/run/gpuprov")
LOG_DIR = os.environ.get("GPUPROV_LOG_DIR", "/var/log/gpuprov")

STATE_FILE = f"{STATE_DIR}/state.json"  # reboot and resume state of bootstrap (plan/apply.py)
INSTALL_RECORD = f"{STATE_DIR}/installed.json"  # what gpuprov changed, for `gpuprov uninstall` (provision/record.py)
REBOOT_MARKER = f"{RUN_DIR}/reboot-pending"  # gone after a reboot (/run is a tmpfs)
RUNTIME_DIR = f"{STATE_DIR}/runtime"
DISCOVERY_CACHE = f"{RUNTIME_DIR}/discovery.json"
INSTALL_STAMP = f"{RUNTIME_DIR}/install.stamp"
# Where gpuprov rewrote a --gpus hook that was already there: since when that path has held a hook (engines/docker.py)
HOOK_SINCE = f"{RUNTIME_DIR}/hook-present-since.json"
# Manifests whose library_path had to be rewritten (root-owned, persistent: a CDI spec in /etc/cdi names them)
GENERATED_MANIFESTS = f"{RUNTIME_DIR}/manifests"
BUNDLES = f"{STATE_DIR}/bundles"  # where .tar.gz bundles are unpacked (root-only)
BUNDLE_APT = f"{STATE_DIR}/bundle-apt"  # the local apt source a bundle's packages are installed from
MOK_HASH = f"{STATE_DIR}/mok-password.hash"
MPS_PIPE_DIR = f"{RUN_DIR}/mps"  # `gpuprov share`: the MPS control daemon's pipes
MPS_LOG_DIR = f"{LOG_DIR}/mps"  # `gpuprov share`: the MPS control daemon's and servers' logs
SHARE_STATE = f"{RUN_DIR}/share.json"  # `gpuprov share`: what runs where (the runtime reads it)
DRIVER_VOLUMES = f"{STATE_DIR}/driver"  # `gpuprov driver-volume`: versioned copies and `current`
# DKMS builds that failed when a kernel was installed (one file per kernel: the failure, its log), written by the
# autoinstall guard of the driver's kernel-hook step (provision/templates/dkms-sysconfig.j2). Fixed on purpose, not
# under STATE_DIR: the kernel's hooks write it from dpkg, outside any gpuprov run and its environment.
DKMS_FAILED = "/var/lib/gpuprov/dkms-failed"
