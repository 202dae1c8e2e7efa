"""Node labels in GPU Feature Discovery's format, from NVML readings and gpuprov's sharing settings.

Names and value formats follow NVIDIA/k8s-device-plugin (internal/lm/resource.go, nvml.go at 1b826ac, 2026-08):
`nvidia.com/gpu.{product,count,replicas,sharing-strategy,memory,family,compute.major,compute.minor}`, the CUDA
`driver-version.*` / `runtime-version.*` labels, `mig.capable`, `mps.capable`. The product is the GPU name with every
character outside [A-Za-z0-9-_. ] removed and blanks turned to '-', and `-SHARED` appended when replicas > 1."""
from __future__ import annotations

import re
from dataclasses import dataclass

from provision.errors import INTERNAL, GpuprovError, Unsupported, UsageError
from provision.metrics.nvml import Snapshot

NFD_FEATURES_DIR = "/etc/kubernetes/node-feature-discovery/features.d"
NFD_FILE = f"{NFD_FEATURES_DIR}/gpuprov"
NFD_MAX_BYTES = 65536  # NFD's local source skips larger files (source/local/local.go: MaxFeatureFileSize)
_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class Sharing:
    """How one GPU is offered to several pods: what the labels say and what the device plugin's config holds."""
    strategy: str = "none"  # none | time-slicing | mps  (GFD's SharingStrategy values)
    replicas: int = 1
    plugin_section: str | None = None  # timeSlicing | mps: the device plugin config's sharing key (None = none)
    note: str = ""


def family(major: int, minor: int) -> str:
    """GFD's getArchFamily (internal/lm/resource.go)."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper", 10: "blackwell",
            12: "blackwell", 13: "rubin"}.get(major, "undefined")


def sanitise(name: str) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9-_. ]", "", name).split())


def mig_labels(product: str, strategy: str, profiles: list[str | None],
               attributes: dict[str, dict[str, int]] | None = None) -> dict[str, str]:
    """GFD's MIG labels (internal/lm/mig-strategy.go, resource.go): `nvidia.com/mig.strategy`; `single`: the node's
    GPUs are its MIG devices (`nvidia.com/gpu.product` `<GPU>-MIG-<profile>`, count = MIG devices; all of one profile,
    as GFD requires); `mixed`: `nvidia.com/mig-<profile>.count`, `.product`, `.replicas` and `.sharing-strategy` per
    profile. Both add each profile's attributes (`memory`, `multiprocessors`, `slices.gi`/`.ci`, `engines.copy`/
    `decoder`/`encoder`/`jpeg`/`ofa`: NVML's nvmlDeviceGetAttributes of a MIG device, as GFD's newMigAttributeLabels)
    under the resource's name (`nvidia.com/gpu.` for single, `nvidia.com/mig-<profile>.` for mixed).
    `profiles`: each MIG device's (discovery's, from NVML; None where NVML did not answer); `attributes`: profile ->
    {GFD's name: value} (metrics/nvml.py's MIG_ATTRIBUTES; a profile NVML gave none for gets no attribute labels)."""
    if strategy == "none":
        return {}
    if any(p is None for p in profiles):
        raise Unsupported("the MIG devices' profiles are unknown (NVML did not answer when discovery ran): run "
                          "`gpuprov runtime install` to refresh it, or use --mig-strategy none")
    attributes = attributes or {}
    labels = {"nvidia.com/mig.strategy": strategy}
    if strategy == "single" and profiles:
        if len(set(profiles)) > 1:
            raise Unsupported(f"--mig-strategy single needs every MIG device of one profile; this node has "
                              f"{', '.join(sorted(set(profiles)))}: use --mig-strategy mixed")
        labels.update({"nvidia.com/gpu.product": f"{product}-MIG-{profiles[0]}",
                       "nvidia.com/gpu.count": str(len(profiles))})
        # the MIG device's memory replaces the whole GPU's `nvidia.com/gpu.memory`, as in GFD
        labels.update({f"nvidia.com/gpu.{k}": str(v) for k, v in attributes.get(profiles[0], {}).items()})
    elif strategy == "mixed":
        for p in sorted(set(profiles)):
            labels.update({f"nvidia.com/mig-{p}.count": str(profiles.count(p)),
                           f"nvidia.com/mig-{p}.product": f"{product}-MIG-{p}",
                           f"nvidia.com/mig-{p}.replicas": "1", f"nvidia.com/mig-{p}.sharing-strategy": "none"})
            labels.update({f"nvidia.com/mig-{p}.{k}": str(v) for k, v in attributes.get(p, {}).items()})
    return labels


def mig_attributes(snap: Snapshot) -> dict[str, dict[str, int]]:
    """Profile -> GFD's attribute labels, from the first MIG device of each profile NVML answered for (GFD, too,
    labels a profile from one of its devices)."""
    out: dict[str, dict[str, int]] = {}
    for g in snap.gpus:
        for d in g.mig_devices:
            if d.profile and d.attributes is not None:
                out.setdefault(d.profile, d.attributes)
    return out


def gfd_labels(snap: Snapshot, sharing: Sharing, mig_strategy: str = "none",
               mig_profiles: list[str | None] | None = None) -> dict[str, str]:
    if not snap.gpus:
        raise Unsupported("no NVIDIA GPU visible to NVML: nothing to label (gpuprov verify)")
    g = snap.gpus[0]
    product = sanitise(g.name) + ("-SHARED" if sharing.replicas > 1 else "")
    labels = {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.count": str(len(snap.gpus)),
        "nvidia.com/gpu.replicas": str(sharing.replicas),
        "nvidia.com/gpu.sharing-strategy": sharing.strategy if sharing.replicas > 1 else "none",
        "nvidia.com/gpu.memory": str(g.memory_total >> 20),
        "nvidia.com/mig.capable": str(any(x.mig_capable for x in snap.gpus)).lower(),
        "nvidia.com/mps.capable": str(sharing.strategy == "mps").lower(),
    }
    if g.compute_capability:
        major, minor = g.compute_capability
        labels.update({"nvidia.com/gpu.family": family(major, minor), "nvidia.com/gpu.compute.major": str(major),
                       "nvidia.com/gpu.compute.minor": str(minor)})
    parts = snap.driver_version.split(".")
    if 2 <= len(parts) <= 3:
        labels.update({"nvidia.com/cuda.driver-version.major": parts[0], "nvidia.com/cuda.driver-version.minor": parts[1],
                       "nvidia.com/cuda.driver-version.revision": parts[2] if len(parts) == 3 else "",
                       "nvidia.com/cuda.driver-version.full": snap.driver_version})
    if snap.cuda_version:
        cmaj, cmin = snap.cuda_version.split(".")
        labels.update({"nvidia.com/cuda.runtime-version.major": cmaj, "nvidia.com/cuda.runtime-version.minor": cmin,
                       "nvidia.com/cuda.runtime-version.full": snap.cuda_version})
    labels.update(mig_labels(sanitise(g.name), mig_strategy, mig_profiles or [], mig_attributes(snap)))
    for k, v in labels.items():
        check_label(k, v)
    return dict(sorted(labels.items()))


def check_label(key: str, value: str) -> None:
    """Kubernetes' rules for a label (apimachinery validation): what the API server would reject, refused here."""
    prefix, _, name = key.rpartition("/")
    ok = (_NAME.fullmatch(name) and len(name) <= 63 and (not prefix or (_PREFIX.fullmatch(prefix) and len(prefix) <= 253))
          and (value == "" or (_NAME.fullmatch(value) and len(value) <= 63)))
    if not ok:
        raise UsageError(f"label {key}={value!r} is not a valid Kubernetes label")


def nfd_file(labels: dict[str, str]) -> str:
    """NFD's local-source format: `key=value` lines; lines starting with '#' are comments."""
    text = ("# GPU node labels (GPU Feature Discovery names) written by `gpuprov k8s labels --write`;\n"
            "# rewritten when the GPUs, the driver or GPU sharing change. Do not edit: run gpuprov again.\n"
            + "".join(f"{k}={v}\n" for k, v in labels.items()))
    if len(text.encode()) > NFD_MAX_BYTES:
        raise GpuprovError(f"the labels file would exceed NFD's {NFD_MAX_BYTES}-byte limit", exit_code=INTERNAL)
    return text


def kubelet_flag(labels: dict[str, str]) -> str:
    """The same labels for clusters without NFD: kubelet's --node-labels (applied when the node registers)."""
    return "--node-labels=" + ",".join(f"{k}={v}" for k, v in labels.items())
