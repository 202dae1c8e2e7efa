"""Reboot handling: a recorded pending reboot stops bootstrap (exit 7) until the machine has really rebooted."""
from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli


def test_pending_reboot_is_reported_until_boot_id_changes(tmp_path):
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    (tmp_path / "state.json").write_text(json.dumps({"reboot_required": True, "boot_id": boot_id,
                                                     "reason": "driver installed"}))
    r = run_cli("bootstrap", "--yes", "--driver", "skip", "--engine", "none", env={"GPUPROV_STATE_DIR": str(tmp_path)})
    assert r.returncode == 7
    assert "reboot is still pending (driver installed)" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert json.loads((tmp_path / "state.json").read_text())["reboot_required"] is True
