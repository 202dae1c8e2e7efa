"""Compare NVIDIA's CDI spec (`nvidia-ctk cdi generate`) with gpuprov's for the same host: every device node and
every container path of theirs must be in ours, or the difference is listed with its reason (REASONS)."""
from __future__ import annotations

import os

LIBDIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64")

# Differences by design, by what the path contains. Anything else is "unexplained" (the test fails on it).
REASONS = (
    ("/firmware/nvidia/", "GSP firmware is loaded by the kernel module; Linux >= 5.7 reads it from init's mount "
                          "namespace, so gpuprov mounts it only on older kernels (capabilities.FIRMWARE_FROM_INIT_NS)"),
    ("/nvidia-mps", "MPS pipes are given by the runtime only while `gpuprov share` runs (README: GPU sharing)"),
    ("nvidia-fabricmanager/socket", "fabric manager socket: not on this host's spec of ours (NVSwitch systems only)"),
    ("/dev/nvidia-caps/", "MIG capability nodes: gpuprov passes them per MIG device, none configured here"),
    ("nvidia-imex", "IMEX daemon binaries: multi-node NVLink only, not a container workload's tool"),
    ("nvidia-xconfig", "X server configuration tool: gpuprov's display capability gives the modeset node, "
                       "not X server tooling"),
    ("/X11/", "X server (Xorg) driver configuration: gpuprov does not run X servers in containers"),
    ("libnvidia-egl-", "EGL platform library for Wayland/GBM/X: gpuprov mounts these only when the driver root "
                       "ships their platform manifest (egl_external_platform.d) naming them"),
)


def _real(p: str) -> str:
    return os.path.realpath(p) if os.path.exists(p) else p


def _nodes(spec: dict) -> set[str]:
    out = {n["path"] for n in spec.get("containerEdits", {}).get("deviceNodes", [])}
    for d in spec.get("devices", []):
        out |= {n["path"] for n in d.get("containerEdits", {}).get("deviceNodes", [])}
    return out


def _mounts(spec: dict) -> list[dict]:
    out = list(spec.get("containerEdits", {}).get("mounts", []))
    for d in spec.get("devices", []):
        out += d.get("containerEdits", {}).get("mounts", [])
    return out


def _reason(path: str) -> str | None:
    return next((why for key, why in REASONS if key in path), None)


def _moved_why(path: str) -> str:
    if path.endswith((".json", ".icd")):
        return "same manifest; gpuprov puts loader manifests under /usr/share, which the loaders search as well as /etc"
    if "/bin/" in path:
        return "same binary; gpuprov mounts binaries in /usr/bin, on every image's PATH"
    return ("same library; gpuprov mounts it at its SONAME in the image's default library directories, so no "
            "ldconfig or create-symlinks hook has to run in the container")


def compare(theirs: dict, ours: dict) -> dict:
    our_paths = {m["containerPath"]: m for m in _mounts(ours)}
    our_by_host: dict[str, list[str]] = {}
    for m in _mounts(ours):
        our_by_host.setdefault(_real(m["hostPath"]), []).append(m["containerPath"])
    # manifests: the host may keep them behind a symlink (/usr/share/vulkan/… -> the driver root): match by name too
    our_manifests = {os.path.basename(p): p for p in our_paths if p.endswith((".json", ".icd"))}
    same, moved, explained, unexplained = [], [], [], []
    for m in _mounts(theirs):
        cp = m["containerPath"]
        if cp in our_paths:
            same.append(cp)
        elif _real(m["hostPath"]) in our_by_host:
            moved.append({"theirs": cp, "ours": our_by_host[_real(m["hostPath"])], "why": _moved_why(cp)})
        elif os.path.basename(cp) in our_manifests:
            moved.append({"theirs": cp, "ours": [our_manifests[os.path.basename(cp)]], "why": _moved_why(cp)})
        elif _reason(cp) or _reason(m["hostPath"]):
            explained.append({"path": cp, "why": _reason(cp) or _reason(m["hostPath"])})
        else:
            unexplained.append({"path": cp, "hostPath": m["hostPath"]})
    node_diff = sorted(_nodes(theirs) - _nodes(ours))
    for n in node_diff:
        if n.startswith("/dev/dri/"):
            explained.append({"path": n, "why": "DRM nodes: gpuprov gives them per GPU with graphics/display"}
                             if any(x.startswith("/dev/dri/") for x in _nodes(ours)) else
                             {"path": n, "why": "DRM node not found for the GPU by gpuprov (nvidia-drm)"})
        elif _reason(n):
            explained.append({"path": n, "why": _reason(n)})
        else:
            unexplained.append({"path": n, "kind": "device node"})
    hooks = [h.get("args", [h.get("path")]) for h in theirs.get("containerEdits", {}).get("hooks", [])]
    names_theirs = {d["name"] for d in theirs.get("devices", [])}
    names_ours = {d["name"] for d in ours.get("devices", [])}
    return {
        "their_mounts": len(_mounts(theirs)), "our_mounts": len(_mounts(ours)),
        "their_nodes": sorted(_nodes(theirs)), "our_nodes": sorted(_nodes(ours)),
        "same_container_path": len(same), "same_file_other_path": moved, "explained": explained,
        "unexplained": unexplained, "their_hooks": hooks,
        "hooks_note": "gpuprov's spec has no hooks: no ldconfig, no symlink creation, no chmod in the container",
        "device_names_missing": sorted(names_theirs - names_ours),
        "our_extra_paths": sorted(set(our_paths) - {m["containerPath"] for m in _mounts(theirs)}),
    }
