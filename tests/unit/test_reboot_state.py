"""Reboot handling: a recorded pending reboot stops bootstrap (exit 7) until the machine has really rebooted
(a new boot_id, or the marker in /run gone: a restarted host container keeps the kernel's boot_id, but every boot
starts /run empty); resumed on a host without an NVIDIA device, bootstrap says so (exit 15), one line."""
from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli


def _pending(tmp_path, marker: bool) -> dict:
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    (tmp_path / "state.json").write_text(json.dumps({"reboot_required": True, "boot_id": boot_id,
                                                     "reason": "driver installed"}))
    run = tmp_path / "run"
    run.mkdir()
    if marker:
        (run / "reboot-pending").write_text("driver installed\n")
    return {"GPUPROV_STATE_DIR": str(tmp_path), "GPUPROV_RUN_DIR": str(run)}


def test_pending_reboot_is_reported_until_the_host_reboots(tmp_path):
    r = run_cli("bootstrap", "--yes", "--driver", "skip", "--engine", "none", env=_pending(tmp_path, True))
    assert r.returncode == 7
    assert "reboot is still pending (driver installed)" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert json.loads((tmp_path / "state.json").read_text())["reboot_required"] is True


def test_resumed_without_a_device_exits_15(tmp_path):
    r = run_cli("bootstrap", "--yes", "--engine", "none", env=_pending(tmp_path, False))
    assert r.returncode == 15, r.stderr
    assert "no NVIDIA device" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["reboot_required"] is False and state["resumed_after_reboot"] is True


def test_a_run_without_the_driver_goes_on_after_the_reboot(tmp_path):
    """Exit 15 is for the run that would verify the driver: one that plans no driver step (`--driver skip`, an
    `--only` without it) records the resume and applies its plan (tests/integration/test_el_cuda.py runs one on a
    host). On the previous commit `bootstrap --driver skip --engine docker` stopped with 15 before the engine."""
    for i, args in enumerate((["--driver", "skip"], ["--only", "engine,runtime"])):
        (tmp_path / str(i)).mkdir()
        r = run_cli("bootstrap", *args, "--engine", "none", "--dry-run", "--json", env=_pending(tmp_path / str(i), False))
        assert r.returncode == 0, r.stderr
        said = json.loads(r.stdout)["resume"]["bootstrap"]
        assert "records the resume in" in said and "and applies this plan (no NVIDIA device" in said, said
    (tmp_path / "driver").mkdir()
    r = run_cli("bootstrap", "--engine", "none", "--dry-run", "--json", env=_pending(tmp_path / "driver", False))
    assert "then stops: no NVIDIA device to verify the driver on (exit 15)" in json.loads(r.stdout)["resume"]["bootstrap"]


def test_dry_run_and_check_only_say_what_the_resume_would_do(tmp_path):
    """`bootstrap --dry-run` and `--check` change nothing, not even the resume after a reboot: they say what a
    real run would do first (stop with exit 7 while the reboot is pending; after it, record the resume and verify
    the driver), exit 0, and leave the state file byte for byte and /run untouched."""
    for marker, rebooted, words in ((True, False, "exit 7"), (False, True, "records the resume")):
        case = tmp_path / f"marker-{marker}"
        case.mkdir()
        env = _pending(case, marker)
        before = (case / "state.json").read_bytes()
        runs = sorted((case / "run").iterdir())
        for args in (["--dry-run", "--json"], ["--check", "--json"], ["--dry-run"]):
            r = run_cli("bootstrap", "--driver", "skip", "--engine", "none", *args, env=env)
            assert r.returncode == 0, r.stderr
            if "--json" in args:
                resume = json.loads(r.stdout)["resume"]
                assert resume["rebooted"] is rebooted and resume["reason"] == "driver installed"
                assert words in resume["bootstrap"]
            else:
                assert r.stdout.startswith("Before the plan: ") and words in r.stdout.splitlines()[0]
            assert (case / "state.json").read_bytes() == before
            assert sorted((case / "run").iterdir()) == runs
