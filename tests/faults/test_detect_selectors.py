"""GPU selectors and per-GPU limits are exact: a UUID prefix naming several GPUs, GPU indices written with
non-ASCII digits ('１', '٣', '²'), and a memory limit for a GPU the container does not see are refused with one
line, never matched loosely. GPUs and UUIDs below are in the form the real H200 capture's `nvidia-smi -q` gives."""
from __future__ import annotations

import pytest

from provision.inject.discover import ControlNodes, Discovery, Gpu, Node
from provision.inject.edits import Refused, compute_edits, select_gpus
from provision.share.limits import share_request
from provision.share.state import MpsState
from tests.conftest import run_cli

# Two cards whose UUIDs share their first 8 hex digits (UUIDs are random: a short prefix can name both).
GPUS = (Gpu(index=0, uuid="GPU-3c1e2a5b-9f7d-4c2e-8a1b-0d9e8f7a6b5c", minor=0, bus_id="00000000:18:00.0",
            model="NVIDIA H200", node=Node("/dev/nvidia0", 195, 0)),
        Gpu(index=1, uuid="GPU-3c1e2a5b-1234-4abc-9def-112233445566", minor=1, bus_id="00000000:2A:00.0",
            model="NVIDIA H200", node=Node("/dev/nvidia1", 195, 1)))
# Each names an index these GPUs have, as int() reads it (fullwidth 1, Arabic-Indic 0, fullwidth 0, Arabic-Indic 1),
# or one int() cannot read at all though str.isdigit() says yes (superscript 2).
NON_ASCII = ["１", "\u0660", "０", "\u0661", "²"]


def test_ambiguous_uuid_prefix_refused():
    with pytest.raises(Refused, match="ambiguous.*GPU-3c1e2a5b-9f7d.*GPU-3c1e2a5b-1234"):
        select_gpus(["GPU-3c1e2a5b"], GPUS)


def test_unique_uuid_prefix_and_full_uuid_still_select():
    assert select_gpus(["GPU-3c1e2a5b-9"], GPUS) == [GPUS[0]]
    assert select_gpus([GPUS[1].uuid.upper()], GPUS) == [GPUS[1]]


@pytest.mark.parametrize("sel", NON_ASCII)
def test_non_ascii_digit_index_refused(sel):
    with pytest.raises(Refused, match="unknown GPU"):
        select_gpus([sel], GPUS)


@pytest.mark.parametrize("sel", NON_ASCII)
def test_non_ascii_mig_style_index_refused(sel):
    with pytest.raises(Refused, match="unknown GPU"):
        select_gpus([f"{sel}:0"], GPUS)


def test_ascii_index_selects():
    assert select_gpus(["1"], GPUS) == [GPUS[1]]


SHARING = MpsState(control="/usr/bin/nvidia-cuda-mps-control", pipe_dir="/run/gpuprov/mps", log_dir="/var/log/gpuprov/mps")


@pytest.mark.parametrize("value", ["1=4G", "0=2G,2=4G", "7=1G"])
def test_memory_limit_for_invisible_gpu_refused(value):
    with pytest.raises(Refused, match="not visible to this container"):
        share_request({"GPUPROV_GPU_MEMORY": value}, 1, SHARING)


def test_memory_limit_without_gpu_refused():
    with pytest.raises(Refused, match="sees no GPU"):
        share_request({"GPUPROV_GPU_MEMORY": "0=1G"}, 0, SHARING)


@pytest.mark.parametrize("k", NON_ASCII)
def test_memory_limit_non_ascii_index_refused(k):
    with pytest.raises(Refused, match="not a GPU index"):
        share_request({"GPUPROV_GPU_MEMORY": f"{k}=4G"}, 4, SHARING)


def test_memory_limit_index_twice_refused():
    with pytest.raises(Refused, match="given twice"):
        share_request({"GPUPROV_GPU_MEMORY": "0=1G,00=2G"}, 2, SHARING)


def test_memory_limits_for_visible_gpus_kept():
    assert share_request({"GPUPROV_GPU_MEMORY": "0=2G,1=4G"}, 2, SHARING).memory == {0: 2 << 30, 1: 4 << 30}


def test_compute_edits_refuses_ambiguous_prefix():
    disc = Discovery(driver_root="/", version="580.159.04", libraries={}, libraries32={}, manifests=(),
                     firmware_needed=False, binaries={}, nodes=ControlNodes(Node("/dev/nvidiactl", 195, 255)),
                     gpus=GPUS, persistenced=None, firmware=())
    with pytest.raises(Refused, match="ambiguous"):
        compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "GPU-3c1e", "NVIDIA_DRIVER_CAPABILITIES": "utility"})


@pytest.mark.parametrize("sel", ["１", "\u0663"])
def test_share_enable_non_ascii_gpu_is_usage_error(sel):
    r = run_cli("share", "enable", "--gpus", f"0,{sel}", timeout=60)
    assert r.returncode == 2 and "--gpus takes GPU indices" in r.stderr, r.stderr
