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
    memory_bytes: int = 0
    sm_util: int = 0  # percent, summed over the container's processes (capped at 100)
    pids: list[int] = field(default_factory=list)


def by_pid(snap: Snapshot, proc: str = "/proc") -> dict[int, tuple[int, ContainerRef | None, int | None]]:
    """pid -> (gpu, container or None, memory bytes) for every GPU process."""
    cache: dict = {}
    return {p.pid: (g.index, container_of(p.pid, proc, cache), p.memory_bytes) for g in snap.gpus for p in g.processes}


def by_container(snap: Snapshot, proc: str = "/proc") -> list[ContainerUsage]:
    cache: dict = {}
    out: dict[tuple[int, str], ContainerUsage] = {}
    for g in snap.gpus:
        for p in g.processes:
            ref = container_of(p.pid, proc, cache)
            if ref is None:
                continue  # a host process (e.g. the MPS server itself)
            u = out.setdefault((g.index, ref.id), ContainerUsage(g.index, ref))
            u.memory_bytes += p.memory_bytes or 0
            u.sm_util = min(100, u.sm_util + (p.sm_util or 0))
            u.pids.append(p.pid)
    return sorted(out.values(), key=lambda u: (u.gpu, u.ref.id))
