"""The shared GPUs' compute mode. NVIDIA's MPS guide sets EXCLUSIVE_PROCESS on a GPU that MPS serves: the MPS
server is then the only process that holds a CUDA context there, so a client that bypasses the MPS pipe (a container
that unsets or changes CUDA_MPS_PIPE_DIRECTORY) cannot create a context of its own and gets no GPU at all, instead of
the whole GPU without the operator's limits. With the DEFAULT mode it would run outside MPS, uncapped.

Read and set through nvidia-smi, the driver's own tool, found next to nvidia-cuda-mps-control (every driver layout
ships both in one bin directory) and run through the one process path. The mode a GPU had before is recorded in the
share state by UUID (indices can move between boots), and `share disable` puts it back."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from provision import effects
from provision.errors import UNSUPPORTED, GpuprovError, StepFailed, UsageError

EXCLUSIVE = "Exclusive_Process"  # as nvidia-smi --query-gpu prints it; `-c` takes the name in capitals
MODES = ("Default", "Exclusive_Thread", "Prohibited", "Exclusive_Process")


@dataclass(frozen=True, slots=True)
class GpuMode:
    index: int  # nvidia-smi's index (PCI bus order), the one `share enable --gpus` takes
    uuid: str
    mode: str  # one of MODES


def find_smi(control: str) -> str:
    for cand in (os.path.join(os.path.dirname(control), "nvidia-smi"), shutil.which("nvidia-smi")):
        if cand and os.path.exists(cand):
            return cand
    raise GpuprovError(f"nvidia-smi not found next to {control} or on PATH: install the NVIDIA driver's utilities "
                       "(gpuprov bootstrap)", exit_code=UNSUPPORTED)


def query(smi: str) -> list[GpuMode]:
    """Every GPU with its compute mode. A line nvidia-smi should not print is exit 5, never a guess."""
    argv = [smi, "--query-gpu=index,uuid,compute_mode", "--format=csv,noheader"]
    out = effects.run(argv, timeout=60).stdout
    gpus = []
    for line in out.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0].isascii() or not parts[0].isdigit() or parts[2] not in MODES:
            raise StepFailed(f"`{' '.join(argv)}` printed {line.strip()!r}, not INDEX, UUID, MODE")
        gpus.append(GpuMode(int(parts[0]), parts[1], parts[2]))
    if not gpus:
        raise StepFailed(f"`{' '.join(argv)}` lists no GPU: is the NVIDIA driver loaded (nvidia-smi)?")
    return gpus


def chosen(present: list[GpuMode], indices: list[int] | None) -> list[GpuMode]:
    """The GPUs `--gpus` names (every GPU without it); an index the host does not have is a usage error."""
    if not indices:
        return present
    by_index = {g.index: g for g in present}
    missing = [i for i in indices if i not in by_index]
    if missing:
        raise UsageError(f"--gpus {','.join(map(str, indices))}: no GPU {', '.join(map(str, missing))} on this host "
                         f"(nvidia-smi lists {', '.join(str(g.index) for g in present)})")
    return [by_index[i] for i in dict.fromkeys(indices)]


def set_mode(smi: str, uuid: str, mode: str) -> None:
    effects.run([smi, "-i", uuid, "-c", mode.upper()], timeout=60)
