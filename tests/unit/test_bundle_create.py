"""`gpuprov bundle create` from an installed gpuprov (issue 28 item 13): every prerequisite named before anything is
downloaded, a failed create leaves nothing of its own behind, and an installed gpuprov (no checkout) packs the wheel
install.sh kept beside it."""
from __future__ import annotations

from pathlib import Path

import pytest

from provision import effects
from provision.bundle import create as cr
from provision.decide.targets import parse_target
from provision.errors import StepFailed, Unsupported

DEB12 = parse_target("debian-12")


def _opt(out: Path, sign: str | None = None) -> cr.CreateOptions:
    return cr.CreateOptions(DEB12, ("engine", "runtime"), out, sign_key=sign)


@pytest.fixture
def bare(monkeypatch, tmp_path):
    """A machine with docker but without debootstrap and gpg, no image of the target yet, gpuprov installed (no
    checkout, no kept wheel); every download recorded."""
    downloads = []
    monkeypatch.setattr(effects, "which", lambda t: None if t in ("debootstrap", "gpg") else f"/usr/bin/{t}")
    monkeypatch.setattr(cr, "SOURCE_ROOT", tmp_path / "site-packages")
    monkeypatch.setattr(cr, "KEPT_WHEELS", tmp_path / "opt/wheels")
    real = effects.run

    def run(argv, **kw):
        if argv[:3] == ["docker", "image", "inspect"]:
            return effects.CommandResult(list(argv), 1, "no such image")
        return real(argv, **kw)
    monkeypatch.setattr(effects, "run", run)
    monkeypatch.setattr(cr, "resolve_and_download", lambda *a: downloads.append(a))
    return downloads


def test_every_missing_prerequisite_is_named_before_any_download(bare, tmp_path):
    with pytest.raises(Unsupported) as exc:
        cr.create(_opt(tmp_path / "b", sign="ops@example.org"))
    msg = str(exc.value)
    assert exc.value.exit_code == 4 and bare == [] and not (tmp_path / "b").exists()
    for what in ("debootstrap (apt-get install debootstrap)", "gpg (apt-get install gpg)", "gpuprov's own wheel",
                 "nothing was downloaded"):
        assert what in msg, msg


def test_an_installed_gpuprov_packs_the_wheel_install_sh_kept(bare, tmp_path, monkeypatch):
    kept = cr.KEPT_WHEELS / f"gpuprov-{cr.__version__}-py3-none-any.whl"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"PK wheel")
    monkeypatch.setattr(effects, "which", lambda t: f"/usr/bin/{t}")
    assert cr.prerequisites(_opt(tmp_path / "b")) == []
    monkeypatch.setattr(cr, "py_deps", lambda: [])  # (no index here: gpuprov's own wheel is what is checked)
    monkeypatch.setattr(effects, "run", lambda argv, **kw: effects.CommandResult(list(argv), 0, ""))
    cr.build_wheels(DEB12, tmp_path / "w")
    assert (tmp_path / "w" / kept.name).read_bytes() == b"PK wheel"


@pytest.mark.parametrize("output", ["b", "b.tar.gz", "empty"])
def test_a_failed_create_removes_what_it_wrote(bare, tmp_path, monkeypatch, output):
    monkeypatch.setattr(effects, "which", lambda t: f"/usr/bin/{t}")
    monkeypatch.setattr(cr, "prerequisites", lambda opt: [])

    def fails(target, pkgs, repo, nonfree):
        (repo / "docker.io_20.10.24_amd64.deb").write_bytes(b"half")  # what a download leaves
        raise StepFailed("resolving docker.io for debian-12 failed")
    monkeypatch.setattr(cr, "resolve_and_download", fails)
    monkeypatch.setattr(cr.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "empty").mkdir()
    with pytest.raises(StepFailed):
        cr.create(_opt(tmp_path / output))
    assert list((tmp_path / "tmp").iterdir()) == []
    if output == "empty":  # the operator's empty directory stays, empty
        assert list((tmp_path / "empty").iterdir()) == []
    else:
        assert not (tmp_path / output).exists()
    with pytest.raises(StepFailed):  # and the same command can simply be run again
        cr.create(_opt(tmp_path / output))
