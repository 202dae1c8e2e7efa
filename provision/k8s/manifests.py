"""What a cluster needs besides the node: the RuntimeClass for handler `nvidia` and the NVIDIA device plugin's config
(its `--config-file`, the Helm chart's `config.map`), both derived from gpuprov's own settings.

The device plugin config uses only fields of its Go struct (NVIDIA/k8s-device-plugin api/config/v1, at 1b826ac):
`version`, `flags.{migStrategy,failOnInitError,nvidiaDriverRoot,plugin.{passDeviceSpecs,deviceListStrategy,
deviceIDStrategy}}`, `sharing.{timeSlicing,mps}.{failRequestsGreaterThanOne,resources[{name,replicas}]}`."""
from __future__ import annotations

from dataclasses import dataclass

from provision.errors import UsageError
from provision.k8s.labels import Sharing
from provision.share.state import MpsState

HANDLER = "nvidia"
STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations")
MIG_STRATEGIES = ("none", "single", "mixed")  # the plugin's and GFD's --mig-strategy
PLUGIN_MPS_ROOT = "/run/nvidia/mps"  # the device plugin chart's default for its own MPS daemon
DEFAULT_REPLICAS = 4  # pods per GPU when `gpuprov share enable` set no --max-clients and none was asked for


@dataclass(frozen=True)
class NodeSettings:
    """gpuprov's settings that decide the manifests."""
    share_state: MpsState | None  # `gpuprov share enable` state, None when sharing is off
    accept_env_unprivileged: bool  # runtime setting: may containers pick GPUs with NVIDIA_VISIBLE_DEVICES?
    engine_cdi: bool  # CDI enabled in the CRI engine
    driver_root: str = "/"


def decide_sharing(settings: NodeSettings, asked: str = "auto", replicas: int | None = None) -> Sharing:
    """`auto`: gpuprov's MPS sharing on -> replicas advertised through the plugin's `timeSlicing` (the plugin only
    multiplies the resource; gpuprov's runtime puts every GPU container on gpuprov's MPS daemon with its caps).
    The plugin's own `mps` mode runs NVIDIA's MPS daemon instead, so it is refused while gpuprov's is on."""
    on = settings.share_state is not None
    n = replicas or (settings.share_state.max_clients if settings.share_state else None) or DEFAULT_REPLICAS
    if replicas is not None and replicas < 2 and asked not in ("none", "auto"):
        raise UsageError("--replicas must be 2 or more (the device plugin refuses fewer)")
    if asked == "auto":
        asked = "gpuprov-mps" if on else "none"
    if asked == "none":
        return Sharing()
    if asked == "gpuprov-mps":
        return Sharing("mps", n, "timeSlicing", "replicas of each GPU; gpuprov's runtime runs every GPU container "
                       "on gpuprov's MPS daemon (memory caps via GPUPROV_GPU_MEMORY)")
    if asked == "time-slicing":
        return Sharing("time-slicing", n, "timeSlicing", "time-sliced replicas of each GPU (no isolation)")
    if asked == "mps":
        if on:
            raise UsageError("gpuprov's MPS sharing is on (gpuprov share status): --sharing mps would start the device "
                             "plugin's own MPS daemon beside it; use --sharing auto, or `gpuprov share disable` first")
        return Sharing("mps", n, "mps", f"the device plugin's own MPS daemon (mpsRoot {PLUGIN_MPS_ROOT})")
    raise UsageError(f"--sharing {asked!r}: use auto, none, time-slicing or mps")


def decide_strategy(settings: NodeSettings, asked: str = "auto") -> str:
    """How the plugin hands the chosen GPUs to the runtime. `envvar` (NVIDIA_VISIBLE_DEVICES) unless the runtime is set
    not to trust containers' env, then `volume-mounts` (/var/run/nvidia-container-devices/…, which gpuprov's runtime
    reads). `cdi-annotations` only on request: the plugin then writes its own CDI spec, whose hooks call NVIDIA's
    nvidia-cdi-hook (flags.plugin.nvidiaCTKPath), which gpuprov does not install."""
    if asked == "auto":
        return "envvar" if settings.accept_env_unprivileged else "volume-mounts"
    if asked not in STRATEGIES:
        raise UsageError(f"--device-list-strategy {asked!r}: use auto, {', '.join(STRATEGIES)}")
    if asked == "envvar" and not settings.accept_env_unprivileged:
        raise UsageError("the runtime ignores NVIDIA_VISIBLE_DEVICES from unprivileged containers on this host "
                         "(runtime install --no-env-unprivileged): use volume-mounts")
    if asked == "cdi-annotations" and not settings.engine_cdi:
        raise UsageError("CDI is not enabled in the engine: run `gpuprov k8s node --cdi` first, or use envvar")
    return asked


def decide_mig_strategy(asked: str, sharing: Sharing) -> str:
    """How the plugin offers MIG devices: `none` (whole GPUs only), `single` (every GPU's MIG devices as
    nvidia.com/gpu, all of one profile), `mixed` (one resource per profile, nvidia.com/mig-<profile>). The plugin
    refuses `mixed` with its own MPS sharing (cmd/nvidia-device-plugin/main.go); so does this, before it runs."""
    if asked not in MIG_STRATEGIES:
        raise UsageError(f"--mig-strategy {asked!r}: use {', '.join(MIG_STRATEGIES)}")
    if asked == "mixed" and sharing.plugin_section == "mps":
        raise UsageError("--mig-strategy mixed cannot go with the device plugin's MPS sharing (the plugin refuses it): "
                         "use --sharing time-slicing or none, or --mig-strategy single")
    return asked


def runtime_class(handler: str = HANDLER) -> dict:
    return {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": handler,
            "labels": {"app.kubernetes.io/managed-by": "gpuprov"}}, "handler": handler}


def device_plugin_config(settings: NodeSettings, sharing: Sharing, strategy: str, mig_strategy: str = "none") -> dict:
    flags = {"migStrategy": mig_strategy, "failOnInitError": True, "nvidiaDriverRoot": settings.driver_root,
             "plugin": {"passDeviceSpecs": False, "deviceListStrategy": strategy, "deviceIDStrategy": "uuid"}}
    if sharing.plugin_section == "mps":
        flags["mpsRoot"] = PLUGIN_MPS_ROOT
    cfg = {"version": "v1", "flags": flags}
    if sharing.plugin_section:
        cfg["sharing"] = {sharing.plugin_section: {
            "failRequestsGreaterThanOne": True,  # a pod asking 2 replicas would get 1 GPU's share twice: refuse it
            "resources": [{"name": "nvidia.com/gpu", "replicas": sharing.replicas}]}}
    return cfg


def configmap(name: str, namespace: str, config_yaml: str) -> dict:
    """The plugin config as a ConfigMap (Helm: --set config.name=NAME; the key is the config's name)."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace},
            "data": {"gpuprov": config_yaml}}


def helm_values(configmap_name: str) -> dict:
    """Values for NVIDIA's device-plugin chart: run it with the runtime class (so it finds NVML) and this config."""
    return {"runtimeClassName": HANDLER, "config": {"name": configmap_name, "default": "gpuprov"}}


def render_all(settings: NodeSettings, sharing: Sharing, strategy: str, namespace: str = "nvidia-device-plugin",
               mig_strategy: str = "none") -> dict[str, str]:
    """File name -> YAML text, as `gpuprov k8s manifests --output DIR` writes them."""
    import yaml  # lazy: 11 ms at start-up (-X importtime, min of 15); `k8s labels`/`node` never render manifests

    def dump(doc: dict) -> str:
        return yaml.safe_dump(doc, sort_keys=False)

    header = (f"# NVIDIA device plugin config generated by gpuprov: deviceListStrategy {strategy}; migStrategy "
              f"{mig_strategy}; "
              f"sharing {sharing.strategy} x{sharing.replicas}" + (f" ({sharing.note})" if sharing.note else "") + "\n")
    plugin = header + dump(device_plugin_config(settings, sharing, strategy, mig_strategy))
    cm_name = "gpuprov-device-plugin-config"
    return {
        "runtimeclass.yaml": dump(runtime_class()),
        "device-plugin-config.yaml": plugin,
        "device-plugin-configmap.yaml": dump(configmap(cm_name, namespace, plugin)),
        "device-plugin-helm-values.yaml": dump(helm_values(cm_name)),
    }
