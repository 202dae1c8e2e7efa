"""Engine configuration: merge our runtime into each engine's own config, never overwrite it. One adapter per engine
(see base.Engine); ENGINES names them."""
from __future__ import annotations

from provision.engines.base import Engine
from provision.engines.containerd import ContainerdEngine
from provision.engines.crio import CrioEngine
from provision.engines.docker import DockerEngine
from provision.errors import UsageError


def get(name: str) -> Engine:
    engines: dict[str, type[Engine]] = {e.name: e for e in (DockerEngine, ContainerdEngine, CrioEngine)}
    if name not in engines:
        raise UsageError(f"unknown engine {name!r}: use {', '.join(engines)}")
    return engines[name]()
