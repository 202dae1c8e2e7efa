"""plan/resume.py: the reboot state as a typed value (the file's keys as bootstrap has always written them; a foreign
or broken file is no state), and the resume's driver check from typed facts: what fails names the check, what
passes asks nvidia-smi."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from provision.errors import StepFailed
from provision.facts.driver_facts import DriverFacts
from provision.plan import resume as rs

GOOD = DriverFacts(loaded=True, version="580.1", kernel_module="open", modules=("nvidia",), nouveau_loaded=False,
                   kernel_release="6.1.0-27-amd64", kernel_headers=True, secure_boot=False,
                   driver_root="/usr/local/nvidia", userspace_version="580.1")


def test_state_file_keeps_its_keys_and_refuses_foreign_content():
    state = rs.RebootState(reboot_required=True, boot_id="b1", reason="driver installed")
    assert json.loads(state.to_json()) == {"reboot_required": True, "boot_id": "b1", "reason": "driver installed"}
    resumed = replace(state, reboot_required=False, resumed_after_reboot=True)
    assert rs.RebootState.from_json(resumed.to_json()) == resumed
    for text in ("[]", "not json", '{"reboot_required": "yes", "reason": 7}', '"x"'):
        assert rs.RebootState.from_json(text) == rs.RebootState()  # no reboot asked for: nothing to resume
    assert rs.RebootState.from_json('{"reboot_required": true, "extra": 1}').reboot_required is True


def test_pending_on_a_tree_says_what_bootstrap_does(tmp_path, monkeypatch):
    monkeypatch.setattr(rs, "STATE_FILE", Path("/var/lib/gpuprov/state.json"))
    assert rs.pending(tmp_path) is None
    (tmp_path / "var/lib/gpuprov").mkdir(parents=True)
    (tmp_path / "var/lib/gpuprov/state.json").write_text(rs.RebootState(True, "another boot", "").to_json())
    r = rs.pending(tmp_path)  # a tree: the state read through the root, no boot id there -> rebooted
    assert (r.reason, r.rebooted, r.device) == ("no reason recorded", True, False)
    assert r.to_dict() == {"reason": "no reason recorded", "rebooted": True, "bootstrap": r.bootstrap}
    assert "(exit 15)" in r.bootstrap


@pytest.mark.parametrize("facts, words", [
    (None, "after the reboot: driver loaded: NVIDIA GPU present but no driver loaded"),
    (GOOD._replace(loaded=False), "after the reboot: driver loaded: "),
    (GOOD._replace(userspace_version="570.2"), "after the reboot: driver versions coherent: NVIDIA driver mismatch: "
                                               "the loaded kernel module is 580.1 but the driver's libraries are 570.2"),
])
def test_verify_driver_names_the_failed_check(facts, words, monkeypatch):
    monkeypatch.setattr(rs.effects, "run", lambda argv, **kw: pytest.fail(f"ran {argv}"))
    with pytest.raises(StepFailed) as exc:
        rs.verify_driver(facts)
    assert str(exc.value).startswith(words) and exc.value.exit_code == 5


def test_resume_with_a_device_records_it_then_asks_nvidia_smi(tmp_path, monkeypatch):
    ran, written = [], []
    monkeypatch.setattr(rs, "read_state", lambda root=rs.LIVE: rs.RebootState(True, "old boot", "driver installed"))
    monkeypatch.setattr(rs, "write_state", written.append)
    monkeypatch.setattr(rs, "scan_display_devices", lambda root: [type("Dev", (), {"is_nvidia": True})()])
    monkeypatch.setattr(rs, "read_driver", lambda root: GOOD)
    monkeypatch.setattr(rs.effects, "which", lambda name: None)
    monkeypatch.setattr(rs.effects, "run", lambda argv, **kw: ran.append(argv))
    assert "verifies the driver" in rs.pending().bootstrap
    rs.resume()
    assert written == [rs.RebootState(False, "old boot", "driver installed", resumed_after_reboot=True)]
    assert ran == [["/usr/local/nvidia/bin/nvidia-smi", "-L"]]


def test_the_reason_recorded_is_the_changed_steps_own():
    from provision.plan.steps import Step

    steps = [Step("driver.packages", "driver", "t", reboot=True, reboot_reason="the module loads at the next boot"),
             Step("driver.nouveau", "driver", "t", reboot=True), Step("mok", "driver", "t", reboot=True,
                                                                         reboot_reason="enrol the key")]
    assert rs.reason_of(steps, {"driver.packages", "driver.nouveau"}) == "the module loads at the next boot"
    assert rs.reason_of(steps, {"driver.packages", "mok"}) == "the module loads at the next boot; enrol the key"
    assert rs.reason_of(steps, {"driver.nouveau"}) == rs.DEFAULT_REASON
