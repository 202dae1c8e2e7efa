"""Per-container sharing requests (pure): GPUPROV_GPU_MEMORY / GPUPROV_GPU_COMPUTE, and the cGPU seed's
ALIYUN_COM_GPU_* aliases, into MPS client settings. Bad values and limits asked for while sharing is off are
refused with one line; the container's own CUDA_MPS_* variables never survive (it cannot raise its limits)."""
from __future__ import annotations

import math

from provision.errors import Refused

TYPE_CHECKING = False  # not typing's (~3 ms to import): this module is on every GPU start's path
if TYPE_CHECKING:
    from provision.share.policy import Policy
    from provision.share.state import MpsState, ShareRequest


def is_index(s: str) -> bool:
    """ASCII digits only: str.isdigit() and int() also take '１' or '٣' (and isdigit '²', which int() refuses)."""
    return s.isascii() and s.isdigit()

GIB = 1 << 30
UNITS = {"": GIB, "g": GIB, "gi": GIB, "gib": GIB, "gb": GIB, "m": 1 << 20, "mi": 1 << 20, "mib": 1 << 20,
         "mb": 1 << 20, "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40}
MPS_VARS = ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PIPE_DIRECTORY",
            "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ENABLE_PER_CTX_DEVICE_MULTIPROCESSOR_PARTITIONING",
            "CUDA_MPS_CLIENT_PRIORITY")
REQUEST_VARS = ("GPUPROV_GPU_MEMORY", "GPUPROV_GPU_COMPUTE", "ALIYUN_COM_GPU_MEM_CONTAINER", "ALIYUN_COM_GPU_SCHD_WEIGHT",
                "ALIYUN_COM_GPU_HIGH_PRIO")
NORMAL, BELOW_NORMAL = 0, 1  # CUDA_MPS_CLIENT_PRIORITY's two levels (NVIDIA's MPS guide)
DEFAULT_MAX_INST = 16  # containers per GPU a weight counts against when `share enable` named no --max-clients


def limits_asked(env: dict[str, str]) -> bool:
    """The container asks for a memory or compute limit or high priority (ALIYUN_COM_GPU_MEM_CONTAINER=0 and
    ALIYUN_COM_GPU_HIGH_PRIO=0 mean cGPU unused)."""
    return any(env.get(v, "").strip() not in ("", "0") for v in REQUEST_VARS) or wants_high(env)


def wants_high(env: dict[str, str]) -> bool:
    """ALIYUN_COM_GPU_HIGH_PRIO=1 (the seed's) or GPUPROV_GPU_PRIORITY=high (the project's); a bad value is refused."""
    ali = env.get("ALIYUN_COM_GPU_HIGH_PRIO", "").strip()
    own = env.get("GPUPROV_GPU_PRIORITY", "").strip().lower()
    if ali not in ("", "0", "1"):
        raise Refused(f"ALIYUN_COM_GPU_HIGH_PRIO={ali!r}: must be 0 (normal) or 1 (high)")
    if own not in ("", "normal", "high"):
        raise Refused(f"GPUPROV_GPU_PRIORITY={own!r}: must be high or normal")
    return ali == "1" or own == "high"


def parse_size(text: str, var: str, default_unit: str = "g") -> int:
    """'6G', '6GiB', '512M', '1.5G', '6' (GiB unless another default unit) -> bytes."""
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):] or default_unit
    try:
        value = float(num)
    except ValueError:
        raise Refused(f"{var}={text!r}: not a size (use e.g. 6G, 512M, 1.5GiB)") from None
    if unit not in UNITS:
        raise Refused(f"{var}={text!r}: unknown unit {unit!r} (use M, G or T)")
    if not math.isfinite(value) or value * UNITS[unit] > 1 << 62:  # 1e999 / nan / inf: not a size, never a crash
        raise Refused(f"{var}={text!r}: not a finite size (use e.g. 6G, 512M, 1.5GiB)")
    size = int(value * UNITS[unit])
    if size <= 0:
        raise Refused(f"{var}={text!r}: the size must be positive")
    return size


def parse_memory(text: str, var: str, n_gpus: int, default_unit: str = "g") -> dict[int, int]:
    """One size for every visible GPU, a positional list ('3,4,5,6' per card) or 'INDEX=SIZE,…'."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise Refused(f"{var} is empty")
    if all("=" in x for x in items):
        out = {}
        for x in items:
            k, _, v = x.partition("=")
            if not is_index(k.strip()):
                raise Refused(f"{var}={text!r}: {k!r} is not a GPU index")
            if int(k) >= n_gpus:  # a limit for a GPU the container does not see would silently apply to none
                raise Refused(f"{var}={text!r}: GPU index {int(k)} is not visible to this container "
                              f"(it sees {n_gpus} GPU(s), indices 0-{n_gpus - 1})" if n_gpus else
                              f"{var}={text!r}: this container sees no GPU")
            if int(k) in out:
                raise Refused(f"{var}={text!r}: GPU index {int(k)} given twice")
            out[int(k)] = parse_size(v, var, default_unit)
        return out
    if any("=" in x for x in items):
        raise Refused(f"{var}={text!r}: mix of INDEX=SIZE and plain sizes")
    if len(items) == 1:
        return {i: parse_size(items[0], var, default_unit) for i in range(n_gpus)}
    if len(items) != n_gpus:
        raise Refused(f"{var}={text!r}: {len(items)} sizes for {n_gpus} visible GPU(s)")
    return {i: parse_size(x, var, default_unit) for i, x in enumerate(items)}


def parse_percent(text: str, var: str) -> int:
    try:
        v = int(text.strip())
    except ValueError:
        raise Refused(f"{var}={text!r}: not an integer percentage (1-100)") from None
    if not 1 <= v <= 100:
        raise Refused(f"{var}={text!r}: must be between 1 and 100")
    return v


def aliyun_visible(env: dict[str, str]) -> None:
    """ALIYUN_COM_GPU_VISIBLE_DEVICES means NVIDIA_VISIBLE_DEVICES (indices or UUIDs), as the seed describes."""
    if "ALIYUN_COM_GPU_VISIBLE_DEVICES" in env and "NVIDIA_VISIBLE_DEVICES" not in env:
        env["NVIDIA_VISIBLE_DEVICES"] = env["ALIYUN_COM_GPU_VISIBLE_DEVICES"]


def share_request(env: dict[str, str], n_gpus: int, state: MpsState | None) -> ShareRequest | None:
    """This container's MPS settings (memory per visible GPU index, compute percent, client priority), or None
    (sharing off, none asked). The node's policy (share/policy.py) decides what weights and priority become."""
    high = wants_high(env)
    mem = comp = None
    notes: list[str] = []
    pol = None
    if state is not None:  # only a host with sharing on reads its policy
        from provision.share import policy  # lazy: 1 ms (-X importtime) per cold GPU start, sharing off

        pol = policy.of(state.policy)
    if env.get("GPUPROV_GPU_MEMORY", "").strip():
        mem = parse_memory(env["GPUPROV_GPU_MEMORY"], "GPUPROV_GPU_MEMORY", n_gpus)
    elif env.get("ALIYUN_COM_GPU_MEM_CONTAINER", "").strip() not in ("", "0"):
        mem = parse_memory(env["ALIYUN_COM_GPU_MEM_CONTAINER"], "ALIYUN_COM_GPU_MEM_CONTAINER", n_gpus)
        dev = env.get("ALIYUN_COM_GPU_MEM_DEV", "").strip()
        if dev:
            card = parse_size(dev, "ALIYUN_COM_GPU_MEM_DEV")
            too_big = [i for i, v in mem.items() if v > card]
            if too_big:
                raise Refused(f"ALIYUN_COM_GPU_MEM_CONTAINER asks more than the card's ALIYUN_COM_GPU_MEM_DEV={dev} GiB")
    if env.get("GPUPROV_GPU_COMPUTE", "").strip():
        comp = parse_percent(env["GPUPROV_GPU_COMPUTE"], "GPUPROV_GPU_COMPUTE")
    elif env.get("ALIYUN_COM_GPU_SCHD_WEIGHT", "").strip():
        comp = _weight(env["ALIYUN_COM_GPU_SCHD_WEIGHT"], state, pol, high, notes)
    asked = mem is not None or comp is not None or high
    if state is None:
        if asked:
            raise Refused("GPU memory/compute limits or priority were asked for (GPUPROV_GPU_MEMORY/COMPUTE/PRIORITY "
                          "or ALIYUN_COM_GPU_*) but GPU sharing is off: run `gpuprov share enable` first")
        return None
    ceiling = state.max_memory
    if mem and ceiling and any(v > ceiling for v in mem.values()):
        raise Refused(f"the GPU memory asked for is above this host's sharing ceiling ({ceiling // (1 << 20)} MiB per "
                      "container, `gpuprov share enable --max-memory`)")
    # Only a host with sharing on needs the records: every cold GPU start elsewhere skips building their classes.
    from provision.share.state import ShareRequest  # lazy: 1 ms (-X importtime) per cold GPU start, sharing off

    if mem is None and state.default_memory:
        mem = {i: state.default_memory for i in range(n_gpus)}
    priority = None
    if pol.priorities:  # order-free: every other container runs below normal, so a later high one still goes first
        priority = NORMAL if high else BELOW_NORMAL
    elif high:
        raise Refused(f"high GPU priority was asked for, but this host's sharing policy {pol.name} has no priorities: "
                      "`gpuprov share disable`, then `gpuprov share enable --policy preemptive`")
    if high and comp is None:
        comp = state.prio_ratio  # not held to the policy's shares (the seed's words): prio_ratio is its ceiling
    if comp is None and pol.default_weight and not high:  # fixed: weight 1 of max_inst, in the client's env
        comp = max(1, round(100 / (state.max_clients or DEFAULT_MAX_INST)))  # (not the daemon's default: see below)
    if comp is None and state.default_compute and not high:
        # The daemon has it as its default too, and MPS holds every client to it (on an H100: 100% asked under a
        # default of 25 gave 32 of 132 SMs), so it is the node's ceiling, high priority included.
        comp = state.default_compute
    return ShareRequest(memory=mem, compute=comp, priority=priority, notes=tuple(notes))


def _weight(text: str, state: MpsState | None, pol: Policy | None, high: bool, notes: list[str]) -> int | None:
    """ALIYUN_COM_GPU_SCHD_WEIGHT=w as a percentage of the SMs (w/max_inst), where the node's policy has weights."""
    max_inst = (state.max_clients if state else None) or DEFAULT_MAX_INST
    try:
        w = int(text)
    except ValueError:
        raise Refused(f"ALIYUN_COM_GPU_SCHD_WEIGHT={text!r}: not an integer") from None
    if not 1 <= w <= max_inst:
        raise Refused(f"ALIYUN_COM_GPU_SCHD_WEIGHT={w}: must be between 1 and max_inst ({max_inst})")
    if pol is None:
        return max(1, round(100 * w / max_inst))  # refused below: sharing is off
    if not pol.weights or high:
        why = "a high-priority container is not held to the policy's shares" if high else \
            f"this host's sharing policy {pol.name} has no weights"
        notes.append(f"ALIYUN_COM_GPU_SCHD_WEIGHT={w} left unused: {why}")
        return None
    return max(1, round(100 * w / max_inst))


def mps_env(req: ShareRequest, state: MpsState) -> dict[str, str]:
    env = {"CUDA_MPS_PIPE_DIRECTORY": state.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": state.log_dir}
    if req.memory:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{i}={v // (1 << 20)}M" for i, v in sorted(req.memory.items()))
    if req.compute:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(req.compute)
    if req.priority is not None:
        env["CUDA_MPS_CLIENT_PRIORITY"] = str(req.priority)
    return env
