"""`gpuprov verify` says which GPUs are in MIG mode and how many MIG devices each has (issue 30), from nvidia-smi's
answers: the real H100's (MIG disabled, tests/fixtures/hosts/h100-mig-capture) and the MIG fixture's `-L`."""
from __future__ import annotations

from provision.verify.checks import NodeHost, mig_mode, mig_result
from tests.conftest import FIXTURES

CAPTURE = FIXTURES / "hosts" / "h100-mig-capture"
MIG_L = (FIXTURES / "hosts" / "h100-mig" / "commands/nvidia-smi-L.txt").read_text()


def test_real_h100_with_mig_disabled():
    listing = CAPTURE.joinpath("host.txt").read_text().splitlines()[0] + "\n"
    r = mig_result("0, Disabled\n", listing)
    assert (r.status, r.detail) == ("pass", "0 of 1 GPU(s) in MIG mode: GPU 0: MIG disabled")


def test_mig_enabled_counts_devices_per_gpu():
    two = MIG_L + "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000001)\n"
    r = mig_result("0, Enabled\n1, [N/A]\n", two)
    assert r.detail == ("1 of 2 GPU(s) in MIG mode: GPU 0: MIG enabled, 4 MIG device(s); GPU 1: MIG not supported")


class Fake(NodeHost):
    def __init__(self, answers: dict, gpus: bool = True):
        self.answers, self.facts = answers, {"gpus": [{}] if gpus else []}

    def run(self, argv):
        return self.answers.get(argv[1], (127, "", "nvidia-smi: not found"))


def test_check_runs_nvidia_smi_and_skips_without_gpu_or_answer():
    ok = Fake({"--query-gpu=index,mig.mode.current": (0, "0, Enabled\n", ""), "-L": (0, MIG_L, "")})
    assert mig_mode(ok).detail.endswith("GPU 0: MIG enabled, 4 MIG device(s)")
    assert mig_mode(Fake({}, gpus=False)).status == "skip"
    assert mig_mode(Fake({})).status == "skip" and "not found" in mig_mode(Fake({})).detail
