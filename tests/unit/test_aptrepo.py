"""The bundle's flat apt repository (issue 28 item 15): written by python-debian's deb822 classes, it is one apt
reads without a warning (seen: `W: Invalid 'Date' entry in Release file` on every bundle install, from a
hand-written Release without Date), and apt finds each package at its version."""
from __future__ import annotations

import subprocess
from pathlib import Path

from provision.bundle import aptrepo
from tests.conftest import needs


def _deb(tmp_path: Path, name: str, version: str) -> Path:
    root = tmp_path / f"{name}-build"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(f"Package: {name}\nVersion: {version}\nArchitecture: all\n"
                                         "Maintainer: gpuprov tests <t@example.invalid>\nDescription: test package\n"
                                         " with a continued description line\n")
    out = tmp_path / "repo" / f"{name}_{version}_all.deb"
    out.parent.mkdir(exist_ok=True)
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root), str(out)], check=True,
                   capture_output=True)
    return out


@needs("dpkg-deb", "apt-get")
def test_apt_reads_the_bundle_repository_without_a_warning(tmp_path):
    _deb(tmp_path, "gpuprov-test-a", "1.2-3")
    _deb(tmp_path, "gpuprov-test-b", "0.1")
    repo = tmp_path / "repo"
    index = aptrepo.write_flat_repo(repo)
    assert {(e["package"], e["version"]) for e in index} == {("gpuprov-test-a", "1.2-3"), ("gpuprov-test-b", "0.1")}
    release = (repo / "Release").read_text()
    assert "\nDate: " in release and " Packages.gz\n" in release
    state = tmp_path / "apt"
    (state / "lists/partial").mkdir(parents=True)
    (state / "cache/archives/partial").mkdir(parents=True)
    (state / "sources.list").write_text(f"deb [trusted=yes] file:{repo} ./\n")
    opts = ["-o", f"Dir::Etc::SourceList={state / 'sources.list'}", "-o", "Dir::Etc::SourceParts=-",
            "-o", f"Dir::State::Lists={state / 'lists'}", "-o", f"Dir::Cache={state / 'cache'}",
            "-o", "Debug::NoLocking=1", "-o", "Acquire::Languages=none", "-o", "APT::Sandbox::User=root"]
    r = subprocess.run(["apt-get", *opts, "update"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(("W:", "E:"))], r.stdout + r.stderr
    shown = subprocess.run(["apt-cache", *opts, "show", "gpuprov-test-a"], capture_output=True, text=True, timeout=60)
    assert "Version: 1.2-3" in shown.stdout and "with a continued description line" in shown.stdout, shown.stderr
    assert aptrepo.repo_packages(repo) == {"gpuprov-test-a": "1.2-3", "gpuprov-test-b": "0.1"}
