"""Which packages a host gets, per distro family and source: the engine's packages and the archive components the
driver's come from (the driver's own names: provision.decide.driver). Pure: plan and bundle both decide from here."""
from __future__ import annotations

from provision.decide.targets import Target


def engine_packages(target: Target, engine: str, source: str) -> tuple[str, ...]:
    if engine == "containerd":
        return ("containerd",) if target.family == "debian" else ("containerd.io",)
    if source == "docker-ce":
        return ("docker-ce", "docker-ce-cli", "containerd.io")
    if target.family == "debian":
        return ("docker.io",)
    if target.os_id == "amzn":
        return ("docker",)
    return ("moby-engine",)  # Fedora-family Moby; EL proper ships no Docker (the default there is docker-ce)


def debian_components(target: Target) -> tuple[str, ...]:
    if target.os_id == "ubuntu":
        return ("restricted", "multiverse")
    return ("contrib", "non-free") + (("non-free-firmware",) if int(target.version) >= 12 else ())
