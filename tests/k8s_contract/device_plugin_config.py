"""The NVIDIA device plugin's config contract, transliterated from its Go source (NVIDIA/k8s-device-plugin,
api/config/v1 at commit 1b826acc6af3079d8923bac395c3124b8861a9a6): config.go (Config, parseConfigFrom),
flags.go (CommandLineFlags, PluginCommandLineFlags, GFDCommandLineFlags, deviceListStrategyFlag.UnmarshalJSON),
sharing.go, replicas.go (ReplicatedResources/ReplicatedResource/ReplicatedDevices.UnmarshalJSON), consts.go and
strategy.go (NewDeviceListStrategies), and the checks cmd/nvidia-device-plugin/main.go makes at start-up.

The Go YAML decoder ignores unknown keys, so a misspelt field would be silently dropped there: `parse` is strict
and rejects any key the structs do not have."""
from __future__ import annotations

import re

FIELDS = {  # json tag -> nested struct (dict) or a Python type
    "version": str,
    "flags": {
        "migStrategy": str, "failOnInitError": bool, "mpsRoot": str, "nvidiaDriverRoot": str, "nvidiaDevRoot": str,
        "gdrcopyEnabled": bool, "gdsEnabled": bool, "mofedEnabled": bool, "useNodeFeatureAPI": bool,
        "deviceDiscoveryStrategy": str,
        "plugin": {"passDeviceSpecs": bool, "deviceListStrategy": (str, list), "deviceIDStrategy": str,
                   "cdiAnnotationPrefix": str, "nvidiaCTKPath": str, "containerDriverRoot": str,
                   "sharedDevicesAllocationPolicy": str},
        "gfd": {"oneshot": bool, "noTimestamp": bool, "sleepInterval": str, "outputFile": str, "machineTypeFile": str},
    },
    "resources": {"gpus": list, "migs": list},
    "sharing": {"timeSlicing": "replicated", "mps": "replicated"},
    "imex": {"channelIDs": list, "required": bool},
}
MIG_STRATEGIES = ("none", "single", "mixed")
DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEVICE_ID_STRATEGIES = ("uuid", "index")
UUID = re.compile(r"(GPU|MIG)-[0-9a-fA-F-]+")


class ConfigError(ValueError):
    pass


def _replicated(doc, where: str) -> None:
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: not an object")
    unknown = set(doc) - {"renameByDefault", "failRequestsGreaterThanOne", "resources"}
    if unknown:
        raise ConfigError(f"{where}: unknown fields {sorted(unknown)}")
    res = doc.get("resources")
    if not res:
        raise ConfigError(f"{where}: no resources specified")
    for i, r in enumerate(res):
        w = f"{where}.resources[{i}]"
        unknown = set(r) - {"name", "rename", "devices", "replicas"}
        if unknown:
            raise ConfigError(f"{w}: unknown fields {sorted(unknown)}")
        if "name" not in r:
            raise ConfigError(f"{w}: no resource name specified")
        if not str(r["name"]).startswith("nvidia.com/") and "/" in str(r["name"]):
            raise ConfigError(f"{w}: resource name must be in the nvidia.com namespace")
        if "replicas" not in r:
            raise ConfigError(f"{w}: no replicas specified")
        if not isinstance(r["replicas"], int) or r["replicas"] < 2:
            raise ConfigError(f"{w}: number of replicas must be >= 2")
        dev = r.get("devices", "all")
        if isinstance(dev, str) and dev != "all":
            raise ConfigError(f"{w}: the only valid string for devices is 'all'")
        if isinstance(dev, int) and dev <= 0:
            raise ConfigError(f"{w}: a count of devices must be > 0")
        if isinstance(dev, list):
            for d in dev:
                if not (isinstance(d, int) or str(d).isdigit() or re.fullmatch(r"\d+:\d+", str(d))
                        or UUID.fullmatch(str(d))):
                    raise ConfigError(f"{w}: unsupported device {d!r}")


def _walk(doc: dict, fields: dict, where: str) -> None:
    for k, v in doc.items():
        if k not in fields:
            raise ConfigError(f"{where}{k}: unknown field (the device plugin would ignore it)")
        want = fields[k]
        if isinstance(want, dict):
            if not isinstance(v, dict):
                raise ConfigError(f"{where}{k}: must be an object")
            _walk(v, want, f"{where}{k}.")
        elif want == "replicated":
            _replicated(v, f"{where}{k}")
        elif not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ConfigError(f"{where}{k}: wrong type {type(v).__name__}")


def parse(doc: dict) -> dict:
    """Check a parsed config as the plugin would load and validate it; returns it."""
    _walk(doc, FIELDS, "")
    if doc.get("version", "v1") != "v1":
        raise ConfigError(f"unknown version: {doc['version']}")
    flags = doc.get("flags", {})
    if flags.get("migStrategy", "none") not in MIG_STRATEGIES:
        raise ConfigError(f"unknown MIG strategy: {flags['migStrategy']}")
    plugin = flags.get("plugin", {})
    dls = plugin.get("deviceListStrategy", ["envvar"])
    for s in [dls] if isinstance(dls, str) else dls:
        if s not in DEVICE_LIST_STRATEGIES:
            raise ConfigError(f"invalid strategy: {s}")
    if plugin.get("deviceIDStrategy", "uuid") not in DEVICE_ID_STRATEGIES:
        raise ConfigError(f"invalid --device-id-strategy option: {plugin['deviceIDStrategy']}")
    sharing = doc.get("sharing", {})
    if "mps" in sharing:
        if flags.get("migStrategy") == "mixed":
            raise ConfigError("using --mig-strategy=mixed is not supported with MPS")
        if not flags.get("mpsRoot"):
            raise ConfigError("using MPS requires --mps-root to be specified")
    return doc
