"""Engine configuration: merge our runtime into each engine's own config, never overwrite it. One adapter per engine
(see base.Engine, whose docstring lists what an adapter implements); ADAPTERS registers them, in the order verify and
`k8s node --engine auto` look for them."""
from __future__ import annotations

from provision.engines.base import Engine
from provision.engines.containerd import ContainerdEngine
from provision.engines.crio import CrioEngine
from provision.engines.docker import DockerEngine
from provision.engines.podman import PodmanEngine
from provision.errors import UsageError

# a new engine: one line here
ADAPTERS: tuple[type[Engine], ...] = (DockerEngine, ContainerdEngine, CrioEngine, PodmanEngine)


def names() -> tuple[str, ...]:
    return tuple(e.name for e in ADAPTERS)


def get(name: str) -> Engine:
    engines = {e.name: e for e in ADAPTERS}
    if name not in engines:
        raise UsageError(f"unknown engine {name!r}: use {', '.join(engines)}")
    return engines[name]()


def every() -> list[Engine]:
    """One adapter of each engine, in ADAPTERS' order."""
    return [e() for e in ADAPTERS]


def front_ends() -> dict[str, str]:
    """The engines' own front-ends beside gpuprov-runtime, for those installed here: file name -> the OCI runtime it
    wraps (inject/install.py installs them)."""
    out = {}
    for eng in every():
        oci = eng.oci_runtime() if eng.own_front_end else None
        if oci:
            out[eng.own_front_end] = oci
    return out
