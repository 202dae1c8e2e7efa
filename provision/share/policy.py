"""The cGPU seed's scheduling policies (`policy` 0-5 in /proc/cgpu_km/N/policy) and what each becomes on NVIDIA's MPS:
one table, read by `share enable --policy`, the runtime (limits.share_request) and REFERENCE.md's table
(tests/unit/test_share_policy.py checks the document against it).

MPS has three knobs and no time slices: a ceiling on a client's share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE),
a ceiling on its pinned device memory, and a client priority (CUDA_MPS_CLIENT_PRIORITY: 0 normal, 1 below normal),
which orders the clients' work when the GPU's block scheduler picks what runs next. It never preempts a running
block and never gives a client a guaranteed slice. So the two time-slice policies (fair share, soft) have no MPS
equal and are refused, naming the nearest one that has. Import-light: the runtime reads this on shared starts."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Policy:
    name: str  # what `--policy` takes (the seed's number works too)
    number: int  # the seed's value for /proc/cgpu_km/N/policy
    cgpu: str  # what cGPU does (the seed's words, in English)
    mps: str  # what gpuprov does on MPS
    weights: bool  # ALIYUN_COM_GPU_SCHD_WEIGHT becomes a ceiling of weight/max_inst of the SMs
    default_weight: bool  # a container without a weight gets weight 1 (max_inst -> its share), as cGPU's fixed
    priorities: bool  # high-priority containers go ahead (the others run below normal)
    nearest: str = ""  # for a policy MPS cannot honour: the one to use instead

    @property
    def supported(self) -> bool:
        return not self.nearest


POLICIES = (
    Policy("fair-share", 0, "every container gets a fixed time slice of 1/max_inst, used or not",
           "refused (MPS has no time slices): the nearest is fixed", False, False, False, nearest="fixed"),
    Policy("preemptive", 1, "each busy container takes as much as it can; 1/N of the GPU with N busy containers",
           "no SM ceilings: the busy clients share the SMs; high-priority containers' work goes first",
           False, False, True),
    Policy("weight-preemptive", 2, "a container's share is its weight of max_inst",
           "ALIYUN_COM_GPU_SCHD_WEIGHT=w: a ceiling of w/max_inst of the SMs; no weight, no ceiling; "
           "high-priority containers' work goes first", True, False, True),
    Policy("fixed", 3, "a fixed share: weight/max_inst (weight 1 by default)",
           "a ceiling of weight/max_inst of the SMs for every container (weight 1 unless it sets one), in its "
           "environment; high-priority containers' work goes first", True, True, True),
    Policy("soft", 4, "time slices, with weaker isolation than preemptive",
           "refused (MPS has no time slices): the nearest is preemptive", False, False, False, nearest="preemptive"),
    Policy("native", 5, "the driver's own scheduling; memory isolation only",
           "memory caps only: no SM ceilings from weights, no priorities", False, False, False),
)
BY_NAME = {p.name: p for p in POLICIES} | {str(p.number): p for p in POLICIES}
# A share state from before policies existed: weights became ceilings and containers without one had none.
DEFAULT = "weight-preemptive"


def parse(text: str) -> Policy:
    """The policy for `--policy NAME|NUMBER`; ValueError (one line, naming the nearest) for one MPS cannot honour."""
    p = BY_NAME.get(text.strip().lower())
    if p is None:
        names = ", ".join(f"{q.name} ({q.number})" for q in POLICIES)
        raise ValueError(f"--policy {text!r}: not a policy (one of {names})")
    if not p.supported:
        near = BY_NAME[p.nearest]
        raise ValueError(f"--policy {p.name} ({p.number}): MPS cannot honour it ({p.cgpu}; MPS has no time slices): "
                         f"use --policy {near.name} ({near.number}), the nearest it can")
    return p


def of(name: str) -> Policy:
    """The policy a share state names ("" in files from before policies: the default)."""
    return BY_NAME.get(name or DEFAULT) or BY_NAME[DEFAULT]
