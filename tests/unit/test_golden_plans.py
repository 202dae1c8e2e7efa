"""A golden plan per supported release: commands, repository URLs, keys and file contents, reviewed and frozen.
Regenerate after a deliberate change with GPUPROV_UPDATE_GOLDEN=1 and review the diff."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from provision import paths
from provision.errors import GpuprovError
from provision.plan.build import build_plan
from provision.plan.options import Options
from provision.report import detect_host
from tests.conftest import DISTROS, make_host

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
KERNELS = {"debian": "6.1.0-27-amd64", "ubuntu": "6.8.0-49-generic", "alinux": "5.10.134-15.1.al8.x86_64"}
# Releases whose drivers predate the H100: plan them for a GPU they do support (ELRepo EL7 builds no open/580
# kmods: a Kepler Tesla K80; Debian 11 / Ubuntu 18.04 top out at 470: a Volta V100).
LEGACY_GPU = {"centos-7": "kepler", "debian-11": "volta", "ubuntu-18.04": "volta"}


def plan_doc(tmp_path, name: str, sysfs: str, opt: Options, files: dict[str, str] | None = None) -> dict:
    """The plan as data; `files`: host path -> content, the operator's own files added to the fixture tree."""
    fam = name.split("-")[0]
    root = make_host(tmp_path, name, sysfs, kernel=KERNELS.get(fam, "5.14.0-427.13.1.el9_4.x86_64"))
    (root / "run/systemd/system").mkdir(parents=True)  # a booted systemd host, as every release here ships
    for path, text in (files or {}).items():
        (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / path.lstrip("/")).write_text(text)
    rep = detect_host(root, engines=False)
    try:
        steps = build_plan(rep, opt)
    except GpuprovError as exc:
        return {"error": str(exc), "exit_code": exc.exit_code}
    # Files as diffs against the fixture's own tree (the plan's --root): a changed file shows only its change.
    return {"target": rep.target.name, "gpus": [d.pci_id for _, d in rep.gpus],
            "steps": [{"id": s.id, "actions": s.lines(), "files": {p: d.splitlines() for p, d in s.diffs(root).items()},
                       "check": s.check.describe(), "reboot": s.reboot} for s in steps]}


@pytest.mark.parametrize("name", sorted(p.name for p in DISTROS.iterdir() if p.name != "centos-7-legacy"))
def test_golden_plan(tmp_path, name):
    sysfs = LEGACY_GPU.get(name, "datacenter")
    doc = plan_doc(tmp_path, name, sysfs, Options())
    path = GOLDEN / f"{name}.json"
    if os.environ.get("GPUPROV_UPDATE_GOLDEN"):
        path.write_text(json.dumps(doc, indent=2) + "\n")
    assert doc == json.loads(path.read_text())


# An operator's containerd config that imports a directory of its own (present only in the host tree, not on the
# machine running the test): the drop-in must copy the CRI section containerd reads from that import (1.x replaces
# plugin sections), and the `imports` entry gpuprov adds must name the host's path, never the --root tree's.
CONTAINERD_FILES = {
    "/etc/containerd/config.toml": 'version = 2\nimports = ["/etc/containerd/site.d/*.toml"]\n\n'
                                   '[plugins."io.containerd.grpc.v1.cri"]\n'
                                   '  sandbox_image = "registry.invalid/pause:3.9"\n',
    "/etc/containerd/site.d/mirrors.toml": 'version = 2\n\n[plugins."io.containerd.grpc.v1.cri"]\n'
                                           '  sandbox_image = "registry.invalid/pause:3.10"\n'
                                           '  [plugins."io.containerd.grpc.v1.cri".registry]\n'
                                           '    config_path = "/etc/containerd/certs.d"\n',
}


def test_golden_containerd_on_debian(tmp_path):
    doc = plan_doc(tmp_path, "debian-12", "datacenter", Options(engine="containerd"), CONTAINERD_FILES)
    # the suite's private run directory (tests/conftest.py) as a host's own: the validation's output file is there
    doc = json.loads(json.dumps(doc).replace(paths.RUN_DIR, "/run/gpuprov"))
    path = GOLDEN / "debian-12-containerd.json"
    if os.environ.get("GPUPROV_UPDATE_GOLDEN"):
        path.write_text(json.dumps(doc, indent=2) + "\n")
    assert doc == json.loads(path.read_text())
    config = next(s for s in doc["steps"] if s["id"] == "engine.config")["files"]
    assert str(tmp_path) not in json.dumps(doc)
    assert '+imports = ["/etc/containerd/site.d/*.toml", "/etc/containerd/conf.d/99-gpuprov.toml"]' \
        in config["/etc/containerd/config.toml"]
    dropin = config["/etc/containerd/conf.d/99-gpuprov.toml"]
    assert '+sandbox_image = "registry.invalid/pause:3.10"' in dropin and \
        '+config_path = "/etc/containerd/certs.d"' in dropin


PODMAN_CONF = {"/etc/containers/containers.conf": '[engine]\ncgroup_manager = "cgroupfs"\n\n[engine.runtimes]\n'
                                                   'kata = ["/opt/kata/bin/kata-runtime"]\n'}


def test_golden_podman_on_debian(tmp_path):
    doc = plan_doc(tmp_path, "debian-12", "datacenter", Options(engine="podman"), PODMAN_CONF)
    path = GOLDEN / "debian-12-podman.json"
    if os.environ.get("GPUPROV_UPDATE_GOLDEN"):
        path.write_text(json.dumps(doc, indent=2) + "\n")
    assert doc == json.loads(path.read_text())
    by_id = {s["id"]: s for s in doc["steps"]}
    assert "engine.service" not in by_id and any("podman uidmap" in a for a in by_id["engine.packages"]["actions"])
    assert "+nvidia = [\"/usr/local/bin/gpuprov-runtime-podman\"]" in \
        by_id["engine.config"]["files"]["/etc/containers/containers.conf.d/99-gpuprov.conf"]
    # the host tree's own containers.conf is the one read: its runtime `nvidia` elsewhere is the operator's (14)
    theirs = {"/etc/containers/containers.conf": '[engine.runtimes]\nnvidia = ["/opt/theirs/runtime"]\n'}
    with pytest.raises(GpuprovError) as e:  # (raised by the plan's preview of the drop-in, as `plan --root` shows it)
        plan_doc(tmp_path / "theirs", "debian-12", "datacenter", Options(engine="podman"), theirs)
    assert e.value.exit_code == 14 and "/opt/theirs/runtime" in str(e.value)


def test_golden_docker_ce_on_debian(tmp_path):
    doc = plan_doc(tmp_path, "debian-12", "none", Options(engine_source="docker-ce"))
    repo = next(s for s in doc["steps"] if s["id"] == "engine.repo")
    assert any(ln.startswith("+deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.asc]")
               for ln in repo["files"]["/etc/apt/sources.list.d/docker.list"])
    assert any("docker.asc" in c for c in repo["actions"])


def test_debian_components_enabled_in_existing_entries(tmp_path):
    doc = plan_doc(tmp_path, "debian-12", "datacenter", Options())
    comp = next(s for s in doc["steps"] if s["id"] == "driver.components")
    # a minimal diff against the fixture's own sources.list: its two entries extended, nothing else
    changed = [ln for ln in comp["files"]["/etc/apt/sources.list"]
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert changed == [
        "-deb http://mirror.invalid/debian bookworm main",
        "-deb http://mirror.invalid/debian-security bookworm-security main",
        "+deb http://mirror.invalid/debian bookworm main contrib non-free non-free-firmware",
        "+deb http://mirror.invalid/debian-security bookworm-security main contrib non-free non-free-firmware"]


def test_present_driver_left_alone():
    from tests.conftest import H200

    rep = detect_host(H200, engines=False)
    steps = build_plan(rep, Options(engine="none"))
    present = next(s for s in steps if s.id.startswith("driver."))
    assert present.id == "driver.present" and "left alone" in present.title
    assert not any(s.id.startswith("driver.packages") for s in steps)


def test_secure_boot_with_dkms_stages_the_mok(tmp_path):
    """Secure Boot with DKMS: the DKMS key's enrolment is staged (more in tests/unit/test_driver_plans.py)."""
    root = make_host(tmp_path, "debian-12", "datacenter", kernel="6.1.0-27-amd64")
    var = root / "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
    var.parent.mkdir(parents=True)
    var.write_bytes(b"\x06\x00\x00\x00\x01")
    steps = {s.id: s for s in build_plan(detect_host(root, engines=False), Options())}
    assert steps["driver.mok"].reboot and "mokutil --import" in " ".join(steps["driver.mok"].lines())


def test_unsupported_distro(tmp_path):
    root = tmp_path / "arch"
    (root / "etc").mkdir(parents=True)
    (root / "etc/os-release").write_text('NAME="Arch Linux"\nID=arch\nBUILD_ID=rolling\n')
    with pytest.raises(GpuprovError, match="unsupported distribution arch") as e:
        build_plan(detect_host(root, engines=False), Options())
    assert e.value.exit_code == 4
