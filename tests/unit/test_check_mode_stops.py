"""Issue 28 item 5: `bootstrap --check` tells the truth about conflicts. A step whose real run would stop (the
operator's default-runtime: 14; a dockerd flag the config would clash with: 6; an install the package manager says
would remove packages: 14) is reported in check mode as that failure: the report marks it, and the command ends with
the real run's `Error: step ID (TITLE) failed: …` line and exit code (the role's module fails the task on it, as it
does on any exit but 0 and 7). Before, --check said "N step(s) would change" and exited 0."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from provision.cli import main
from provision.errors import GpuprovError
from provision.options import Stage
from provision.plan import apply as ap
from provision.plan import steps as st
from provision.plan.packages import PackageInstall
from tests.conftest import FIXTURES

CONFIG_INVALID, CONFLICT = 6, 14


def host(tmp_path: Path, daemon_json: str | None = None) -> Path:
    root = tmp_path / "host"
    shutil.copytree(FIXTURES / "distros" / "debian-12", root, symlinks=True)
    if daemon_json is not None:
        (root / "etc/docker").mkdir(parents=True)
        (root / "etc/docker/daemon.json").write_text(daemon_json)
    return root


def test_operators_default_runtime_is_the_real_runs_failure(tmp_path, capsys):
    root = host(tmp_path, '{"default-runtime": "runc"}\n')
    assert main(["bootstrap", "--check", "--root", str(root), "--driver", "skip"]) == CONFLICT
    out, err = capsys.readouterr()
    assert "FAIL    Register runtime 'nvidia' in docker's config" in out and "the run would stop" in out
    err = err.strip()
    assert "\n" not in err and err.startswith("Error: step engine.config (Register runtime 'nvidia'")
    assert "default-runtime is 'runc', set by you" in err and "--replace-runtime" in err
    assert (root / "etc/docker/daemon.json").read_text() == '{"default-runtime": "runc"}\n'  # check changes nothing


def test_json_check_names_the_stop(tmp_path, capsys):
    root = host(tmp_path, '{"default-runtime": "runc"}\n')
    assert main(["bootstrap", "--check", "--json", "--root", str(root), "--driver", "skip"]) == CONFLICT
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["stop"]["id"] == "engine.config" and doc["stop"]["exit_code"] == CONFLICT
    assert err.strip() == f"Error: {doc['stop']['error']}"
    step = next(s for s in doc["steps"] if s["id"] == "engine.config")
    assert step["exit_code"] == CONFLICT and step["would_change"]


def test_no_conflict_still_exits_0(tmp_path, capsys):
    assert main(["bootstrap", "--check", "--root", str(host(tmp_path, "{}\n")), "--driver", "skip"]) == 0
    assert "the run would stop" not in capsys.readouterr().out


def test_unit_flag_clash_is_exit_6_in_check_mode(tmp_path, capsys):
    root = host(tmp_path, "{}\n")
    d = root / "etc/systemd/system/docker.service.d"
    d.mkdir(parents=True)
    (d / "flags.conf").write_text("[Service]\nExecStart=\nExecStart=/usr/sbin/dockerd --default-runtime=runc\n")
    assert main(["bootstrap", "--check", "--root", str(root), "--driver", "skip"]) == CONFIG_INVALID
    assert "flags.conf" in capsys.readouterr().err


def test_install_that_would_remove_packages_stops_check_mode(monkeypatch):
    """On this host (check mode runs the package manager's dry run only where it is live), an install whose
    `apt-get -s` removes a package is the real run's exit 14, with the same line."""
    ran = []

    def fake_run(self):
        ran.append(self.argv)
        return type("R", (), {"returncode": 0, "output": "Remv containerd.io [1.7]\nInst docker.io (20.10)\n"})()

    monkeypatch.setattr(st.Command, "run", fake_run)
    step = st.Step("engine.packages", Stage.ENGINE, "Install the container engine: docker.io",
                   actions=(PackageInstall("apt", ("docker.io",)),), check=st.Never("always"))
    doc = ap.check_plan([step], Path("/"))
    assert ran == [("apt-get", "-s", "install", "-y", "--no-install-recommends", "docker.io")]  # the dry run only
    assert doc["stop"]["exit_code"] == CONFLICT and "containerd.io" in doc["stop"]["error"]
    monkeypatch.setattr(PackageInstall, "install", lambda self: (_ for _ in ()).throw(AssertionError("ran")))
    try:
        ap.apply_plan([step], quiet=True, logged=False)
    except GpuprovError as exc:
        assert str(exc) == doc["stop"]["error"] and exc.exit_code == CONFLICT  # the same line as the real run
    else:
        raise AssertionError("the real run did not stop")
