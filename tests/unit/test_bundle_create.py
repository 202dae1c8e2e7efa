"""`gpuprov bundle create` from an installed gpuprov (issue 28 item 13): every prerequisite named before anything is
downloaded, a failed create leaves nothing of its own behind, and an installed gpuprov (no checkout) packs the wheel
install.sh kept beside it."""
from __future__ import annotations

from pathlib import Path

import pytest

from provision import effects
from provision.bundle import create as cr
from provision.decide.targets import parse_target
from provision.errors import StepFailed, Unsupported, UsageError

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


@pytest.fixture
def flaky(bare, tmp_path, monkeypatch):
    """A create whose download fails once, after it wrote one package, then works; gpuprov's wheels packed by a
    stand-in (no index here). Records what the package directory held when each download began."""
    monkeypatch.setattr(effects, "which", lambda t: f"/usr/bin/{t}")
    monkeypatch.setattr(cr, "prerequisites", lambda opt: [])
    monkeypatch.setattr(cr, "build_wheels", lambda target, wheels: (wheels.mkdir(exist_ok=True),
                                                                    (wheels / "gpuprov-0-py3-none-any.whl").write_bytes(b"PK")))
    seen: list[list[str]] = []

    def download(target, pkgs, repo, nonfree):
        seen.append(sorted(p.name for p in repo.iterdir()))
        if len(seen) == 1:
            (repo / "docker.io_20.10.24_amd64.deb").write_bytes(b"deb 1")  # what a download leaves, then it fails
            raise StepFailed("resolving docker.io for debian-12 failed")
        if not (repo / "docker.io_20.10.24_amd64.deb").exists():
            (repo / "docker.io_20.10.24_amd64.deb").write_bytes(b"deb 2")
        (repo / "runc_1.1.5_amd64.deb").write_bytes(b"deb 2")
    monkeypatch.setattr(cr, "resolve_and_download", download)
    monkeypatch.setattr(cr.aptrepo, "write_flat_repo", lambda repo: [])
    return seen


@pytest.mark.parametrize("output", ["b", "b.tar.gz"])
def test_resume_keeps_a_failed_creates_downloads_and_goes_on_from_them(flaky, tmp_path, capsys, output):
    """Issue 28.13: `bundle create --resume` keeps what a failed run downloaded (OUTPUT.partial; OUTPUT itself never
    holds half a bundle), the next --resume run goes on from it (the package is not fetched again), and the result
    is a bundle `bundle verify` accepts, the .partial gone."""
    out = tmp_path / output
    opt = cr.CreateOptions(DEB12, ("engine", "runtime"), out, resume=True)
    with pytest.raises(StepFailed):
        cr.create(opt)
    partial = tmp_path / f"{output}.partial"
    assert not out.exists() and (partial / "repo/docker.io_20.10.24_amd64.deb").read_bytes() == b"deb 1"
    assert "run the same command with --resume to go on" in capsys.readouterr().err
    with pytest.raises(UsageError, match="run the same command with --resume"):  # without --resume: named, kept
        cr.create(cr.CreateOptions(DEB12, ("engine", "runtime"), out))
    assert partial.exists()
    res = cr.create(opt)
    assert flaky[1] == ["docker.io_20.10.24_amd64.deb"]  # the second download began with the first one's package
    assert not partial.exists() and res["output"] == str(out)
    from provision.bundle.install import open_verified

    (tmp_path / "unpack").mkdir()
    opened = open_verified(out, None, base=tmp_path / "unpack")
    names = {f["path"] for f in opened.result.manifest["files"]}
    opened.discard()
    assert {"repo/docker.io_20.10.24_amd64.deb", "repo/runc_1.1.5_amd64.deb", "install-offline.sh"} <= names, names
    assert not any(n.endswith(cr.STARTED) for n in names)  # the marker is gone before the manifest lists files
    if output == "b":
        assert (out / "repo/docker.io_20.10.24_amd64.deb").read_bytes() == b"deb 1"  # kept, not fetched again


def test_resume_refuses_a_partial_started_for_another_bundle(flaky, tmp_path):
    out = tmp_path / "b"
    with pytest.raises(StepFailed):
        cr.create(cr.CreateOptions(DEB12, ("engine", "runtime"), out, resume=True))
    with pytest.raises(UsageError, match="was not started by `bundle create --resume` for this bundle"):
        cr.create(cr.CreateOptions(DEB12, ("engine",), out, resume=True))
    assert (tmp_path / "b.partial/repo/docker.io_20.10.24_amd64.deb").exists()  # the operator decides; kept
