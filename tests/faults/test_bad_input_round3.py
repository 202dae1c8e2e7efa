"""Issue 27 item 15: bad input on the newer commands gets its documented exit code and one line, and is refused before
anything is written. Each case was exit 1, exit 0 or exit 6 (or wrote first) before."""
from __future__ import annotations

import pytest

from provision.cli import main
from provision.commands import k8s as k8s_cmd
from provision.metrics import nvml
from tests.fake_nvml import FakeNVML

USAGE, HOST_UNREADABLE = 2, 3


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize("root", ["/no/such", "/etc/passwd", "FILE"])
def test_uninstall_root_that_is_no_host_tree_is_exit_3(root, dry_run, tmp_path, capsys):
    if root == "FILE":
        root = str(tmp_path / "f")
        (tmp_path / "f").write_text("not a tree\n")
    args = ["uninstall", "--root", root] + (["--dry-run"] if dry_run else ["--yes"])
    assert main(args) == HOST_UNREADABLE
    assert root in _one_line_error(capsys)


def test_uninstall_root_directory_without_os_release_is_exit_3(tmp_path, capsys):
    assert main(["uninstall", "--dry-run", "--root", str(tmp_path)]) == HOST_UNREADABLE
    assert "os-release" in _one_line_error(capsys)


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_k8s_manifests_output_not_a_directory_is_exit_2(where, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(tmp_path / "runtime.json"))
    (tmp_path / "runtime.json").write_text('{"share_state": "%s"}' % (tmp_path / "share.json"))
    f = tmp_path / "out"
    f.write_text("the operator's\n")
    out = f if where == "file" else f / "sub"
    assert main(["k8s", "manifests", "--output", str(out)]) == USAGE
    assert "not a directory" in _one_line_error(capsys)
    assert f.read_text() == "the operator's\n"


def test_k8s_labels_bad_format_writes_nothing(tmp_path, monkeypatch, capsys):
    nfd = tmp_path / "features.d" / "gpuprov"
    monkeypatch.setattr(k8s_cmd, "NFD_FILE", str(nfd))
    monkeypatch.setattr(nvml, "load", FakeNVML)
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(tmp_path / "runtime.json"))
    monkeypatch.setenv("GPUPROV_LOCK_DIR", str(tmp_path))
    (tmp_path / "runtime.json").write_text('{"share_state": "%s"}' % (tmp_path / "share.json"))
    assert main(["k8s", "labels", "--write", "--format", "bogus"]) == USAGE
    assert "--format" in _one_line_error(capsys)
    assert not nfd.exists() and not nfd.parent.exists()
