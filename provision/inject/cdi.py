"""CDI specs (REFERENCE.md §5) from discovery, and applying one to an OCI config (what a CDI-aware engine does)."""
from __future__ import annotations

from provision.inject import edits

KIND = "nvidia.com/gpu"
LIBDIRS = (edits.DEBIAN_LIBDIR, edits.RHEL_LIBDIR)


def _node(n: dict) -> dict:
    return {"path": n["path"], "hostPath": n["path"], "type": "c", "major": n["major"], "minor": n["minor"],
            "permissions": "rw"}


def generate_spec(disc: dict, *, libdirs: tuple[str, ...] = LIBDIRS) -> dict:
    """One spec: devices by index, by UUID and `all`; common edits (control nodes, libraries, binaries)."""
    common = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "none",
                                        "NVIDIA_DRIVER_CAPABILITIES": "utility,compute"}, libdir=libdirs[0])
    mounts = []
    for m in common["mounts"]:
        dests = [m["destination"]]
        if m["destination"].startswith(libdirs[0] + "/"):
            dests = [d + m["destination"][len(libdirs[0]):] for d in libdirs]
        mounts += [{"hostPath": m["source"], "containerPath": d, "options": ["ro", "nosuid", "nodev", "bind"]}
                   for d in dests]
    gpu_devices = []
    for g in disc.get("gpus", []):
        gedits = {"deviceNodes": [_node(g["node"])]}
        gpu_devices.append({"name": str(g["index"]), "containerEdits": gedits})
        if g.get("uuid"):
            gpu_devices.append({"name": g["uuid"], "containerEdits": gedits})
    all_dev = {"name": "all", "containerEdits": {"deviceNodes": [_node(g["node"]) for g in disc.get("gpus", [])]}}
    fw = [{"hostPath": f["path"], "containerPath": f["container_path"], "options": ["ro", "nosuid", "nodev", "bind"]}
          for f in disc.get("firmware", [])]
    return {
        # 0.5.0: the lowest version allowing device names that start with a digit and hostPath on device nodes.
        "cdiVersion": "0.5.0",
        "kind": KIND,
        "devices": gpu_devices + [all_dev],
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void", f"GPUPROV_DRIVER_VERSION={disc.get('version')}"],
            "deviceNodes": [_node(n) for n in [disc["nodes"]["ctl"]] +
                            [disc["nodes"][k] for k in ("uvm", "uvm-tools") if k in disc["nodes"]]],
            "mounts": mounts + fw,
        },
    }


def apply_spec(config: dict, spec: dict, names: list[str]) -> None:
    """Apply the spec's common edits plus those of the named devices (e.g. ["all"]) to an OCI config."""
    chosen = [d for d in spec["devices"] if d["name"] in names]
    missing = set(names) - {d["name"] for d in chosen}
    if missing:
        raise KeyError(f"{spec['kind']}={sorted(missing)[0]} is not in the spec")
    for ce in [spec.get("containerEdits", {})] + [d["containerEdits"] for d in chosen]:
        proc = config.setdefault("process", {})
        proc["env"] = proc.get("env", []) + ce.get("env", [])
        linux = config.setdefault("linux", {})
        for n in ce.get("deviceNodes", []):
            linux.setdefault("devices", []).append({k: n[k] for k in ("path", "type", "major", "minor")})
            linux.setdefault("resources", {}).setdefault("devices", []).append(
                {"allow": True, "type": "c", "major": n["major"], "minor": n["minor"], "access": "rwm"})
        for m in ce.get("mounts", []):
            config.setdefault("mounts", []).append({"destination": m["containerPath"], "source": m["hostPath"],
                                                    "type": "bind", "options": m.get("options", ["bind"])})
