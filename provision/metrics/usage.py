"""GPU use per container: NVML's processes (compute, graphics, MPS clients) grouped by the container each runs in.
`gpuprov metrics` and `gpuprov share status` both read it from here."""
from __future__ import annotations

from dataclasses import dataclass, field

from provision.metrics.containers import ContainerRef, container_of
from provision.metrics.nvml import Snapshot


@dataclass
class ContainerUsage:
    gpu: int
    ref: ContainerRef
    mig: int | None = None  # the MIG device (NVML index on `gpu`) the processes run on; None: the whole GPU
    memory_bytes: int = 0
    sm_util: int = 0  # percent, summed over the container's processes (capped at 100)
    pids: list[int] = field(default_factory=list)


def by_pid(snap: Snapshot, proc: str = "/proc") -> dict[int, tuple[int, ContainerRef | None, int | None]]:
    """pid -> (gpu, container or None, memory bytes) for every GPU process (MIG devices' included)."""
    cache: dict = {}
    return {p.pid: (g.index, container_of(p.pid, proc, cache), p.memory_bytes) for g in snap.gpus for p in _all(g)}


def _all(g) -> list:
    """A GPU's processes: its own and those on each of its MIG devices (nvml.snapshot lists each once)."""
    return g.processes + [p for d in g.mig_devices for p in d.processes]


def by_container(snap: Snapshot, proc: str = "/proc") -> list[ContainerUsage]:
    cache: dict = {}
    out: dict[tuple[int, int, str], ContainerUsage] = {}
    for g in snap.gpus:
        for p in _all(g):
            ref = container_of(p.pid, proc, cache)
            if ref is None:
                continue  # a host process (e.g. the MPS server itself)
            key = (g.index, -1 if p.mig is None else p.mig, ref.id)
            u = out.setdefault(key, ContainerUsage(g.index, ref, p.mig))
            u.memory_bytes += p.memory_bytes or 0
            u.sm_util = min(100, u.sm_util + (p.sm_util or 0))
            u.pids.append(p.pid)
    return [out[k] for k in sorted(out)]
