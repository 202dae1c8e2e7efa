"""gpuprov detect against fixture trees: real os-release files, real PCI IDs, the real H200 capture."""
from __future__ import annotations

import json

import pytest

from provision.errors import HostUnreadable
from provision.facts import distro_facts as df
from provision.facts.distro_facts import read_distro
from provision.facts.driver_facts import parse_nvrm, read_driver
from provision.facts.pci import scan_display_devices
from provision.report import detect_host
from tests.conftest import DISTROS, H200, run_cli

EXPECTED = {  # fixture -> (id, major, family, package manager, target)
    "centos-7": ("centos", "7", "rhel", "yum", "centos-7"),
    "centos-7-legacy": ("centos", "7", "rhel", "yum", "centos-7"),
    "rhel-8": ("rhel", "8", "rhel", "dnf", "rhel-8"),
    "rhel-9": ("rhel", "9", "rhel", "dnf", "rhel-9"),
    "rocky-8": ("rocky", "8", "rhel", "dnf", "rocky-8"),
    "rocky-9": ("rocky", "9", "rhel", "dnf", "rocky-9"),
    "rocky-10": ("rocky", "10", "rhel", "dnf", "rocky-10"),
    "almalinux-8": ("almalinux", "8", "rhel", "dnf", "almalinux-8"),
    "almalinux-9": ("almalinux", "9", "rhel", "dnf", "almalinux-9"),
    "ol-9": ("ol", "9", "rhel", "dnf", "ol-9"),
    "alinux-3": ("alinux", "3", "rhel", "dnf", "alinux-3"),
    "amzn-2023": ("amzn", "2023", "rhel", "dnf", "amzn-2023"),
    "ubuntu-18.04": ("ubuntu", "18.04", "debian", "apt", "ubuntu-18.04"),
    "ubuntu-20.04": ("ubuntu", "20.04", "debian", "apt", "ubuntu-20.04"),
    "ubuntu-22.04": ("ubuntu", "22.04", "debian", "apt", "ubuntu-22.04"),
    "ubuntu-24.04": ("ubuntu", "24.04", "debian", "apt", "ubuntu-24.04"),
    "debian-11": ("debian", "11", "debian", "apt", "debian-11"),
    "debian-12": ("debian", "12", "debian", "apt", "debian-12"),
    "debian-13": ("debian", "13", "debian", "apt", "debian-13"),
}


def test_every_distro_fixture_is_covered():
    assert sorted(p.name for p in DISTROS.iterdir()) == sorted(EXPECTED)
    assert len(EXPECTED) >= 14


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_distro_facts(name):
    d = read_distro(DISTROS / name)
    os_id, major, family, pm, _ = EXPECTED[name]
    assert (d.id, d.major, d.family, d.package_manager) == (os_id, major, family, pm)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_detect_host_maps_target(name):
    assert detect_host(DISTROS / name, engines=False).target.name == EXPECTED[name][4]


ODD_OS_RELEASE = {  # what the os-release reader must read as `distro` does, or leave to it
    "comments-and-quotes": 'ID="debian" # a comment\nVERSION_ID=\'12\'\nPRETTY_NAME="Debian \\"GNU\\"/Linux 12"\n'
                           "NAME=Debian GNU/Linux\nVERSION_CODENAME=bookworm\n",
    "no-pretty-name": "ID=debian\nVERSION_ID=12\nNAME=Debian\n",
    "no-version-id": 'ID=debian\nPRETTY_NAME="Debian GNU/Linux trixie/sid"\nVERSION_CODENAME=trixie\n',
    "unclosed-quote": 'ID=rocky\nVERSION_ID="9.3\nPRETTY_NAME="Rocky Linux"\n',
    "not-utf-8": b'ID=debian\nVERSION_ID="12"\nPRETTY_NAME="D\xe9bian 12"\n',  # distro refuses it: so does read_distro
}


@pytest.mark.parametrize("name", sorted(EXPECTED) + sorted(ODD_OS_RELEASE))
def test_os_release_read_here_as_distro_reads_it(name, tmp_path, monkeypatch):
    """The os-release reader (distro_facts.read_distro, no `distro` import) and `distro` make the same facts of every
    fixture release and of odd files (quotes, comments, missing fields: those go to `distro` itself); every fixture
    release but CentOS is read here, without `distro`."""
    root = DISTROS / name
    if name in ODD_OS_RELEASE:
        root = tmp_path
        (root / "etc").mkdir()
        text = ODD_OS_RELEASE[name]
        (root / "etc/os-release").write_bytes(text if isinstance(text, bytes) else text.encode())
    files = df._release_files(root)
    os_rel = next((c for c in ("etc/os-release", "usr/lib/os-release") if c in files), None)
    try:
        by_distro = df._facts_by_distro(root, files, os_rel)
    except (HostUnreadable, ValueError) as exc:
        with pytest.raises(type(exc)):
            read_distro(root)
        return
    if name in EXPECTED and not name.startswith("centos"):
        monkeypatch.setattr(df, "_facts_by_distro", lambda *a: pytest.fail(f"{name} went to distro"))
    assert read_distro(root) == by_distro


def test_os_release_fields_tokenised_as_a_shell_does():
    text = b'ID="rocky" # comment\nID_LIKE="rhel centos fedora"\nNAME=Rocky Linux\nEMPTY=\n\n# note\nX=\'a b\'\n'
    assert df.os_release_fields(text) == {"id": "rocky", "id_like": "rhel centos fedora", "name": "Rocky",
                                          "empty": "", "x": "a b"}
    assert df.os_release_fields(b'ID="open') == {}  # unclosed quote: left to `distro`
    assert df.os_release_fields(b"ID=d\xe9bian") == {}  # not UTF-8: left to `distro` (which refuses it)


def test_debian_codenames():
    assert read_distro(DISTROS / "debian-12").codename == "bookworm"
    assert read_distro(DISTROS / "ubuntu-22.04").codename == "jammy"


def test_missing_os_release(tmp_path):
    with pytest.raises(HostUnreadable, match="no os-release"):
        read_distro(tmp_path)


def test_unreadable_os_release(tmp_path):
    (tmp_path / "etc/os-release").mkdir(parents=True)  # a directory where a file should be: unreadable
    with pytest.raises(HostUnreadable, match="cannot read"):
        read_distro(tmp_path)


def test_h200_capture():
    rep = detect_host(H200, engines=False)
    assert rep.target.name == "ubuntu-24.04"
    [(dev, dec)] = rep.gpus
    assert (dev.address, dev.pci_id, dev.driver, dev.numa_node) == ("0000:00:06.0", "10de:2335", "nvidia", None)
    assert dec.name == "NVIDIA H200" and dec.subsystem == "10de:18bf" and dec.branch == "current"
    assert rep.driver.version == "580.159.04" and rep.driver.kernel_module == "open"
    assert rep.driver.modules == ("nvidia_uvm", "nvidia") and not rep.driver.nouveau_loaded
    assert rep.driver.kernel_release == "6.18.44-fc-v657-gpu"
    assert rep.driver.secure_boot is None  # the VM has no EFI
    assert rep.driver.driver_root == "/usr/local/nvidia" and rep.driver.userspace_version == "580.159.04"
    assert rep.other_display == []  # virtio devices are not display class


def test_sysfs_none(host):
    assert scan_display_devices(host(sysfs="none")) == []


def test_sysfs_non_nvidia_only(host):
    rep = detect_host(host(sysfs="non-nvidia"), engines=False)
    assert rep.gpus == [] and [d.driver for d in rep.other_display] == ["i915", "amdgpu"]


def test_sysfs_datacenter(host):
    [(dev, dec)] = detect_host(host(sysfs="datacenter"), engines=False).gpus
    assert dec.name == "NVIDIA H100 80GB HBM3" and dec.packages == (
        "nvidia-open-kernel-dkms", "nvidia-driver", "nvidia-smi", "libcuda1", "firmware-misc-nonfree")


def test_sysfs_mixed_legacy(host):
    rep = detect_host(host("rocky-9", "mixed-legacy", modules="nouveau 2899968 0 - Live 0x0\n"), engines=False)
    assert [d.branch for _, d in rep.gpus] == ["470", "580", "current"]
    assert [d.packages for _, d in rep.gpus] == [("kmod-nvidia-470xx",), ("kmod-nvidia-580xx",), ("kmod-nvidia-open",)]
    assert rep.driver.nouveau_loaded and rep.gpus[0][0].driver == "nouveau"
    assert rep.fleet.common_branch is None and "different branches" in rep.fleet.notes[0]


def test_sysfs_blackwell_open_only(host):
    [(_, dec)] = detect_host(host("ubuntu-24.04", "blackwell"), engines=False).gpus
    assert dec.kernel_modules == "open" and dec.packages[0].endswith("-open")


def test_sysfs_unknown_new_id_warns(host):
    [(_, dec)] = detect_host(host("debian-13", "unknown-new"), engines=False).gpus
    assert not dec.known and dec.branch == "current" and dec.kernel_modules == "open"
    assert any("newer than gpuprov's GPU table" in w for w in dec.warnings)


def test_sysfs_multi_gpu(host):
    rep = detect_host(host("ubuntu-22.04", "multi-gpu"), engines=False)
    assert len(rep.gpus) == 4 and rep.fleet.common_branch == "current" and rep.fleet.common_modules == "open"


def test_nvrm_parse():
    assert parse_nvrm("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.161.08  Tue Mar  5 22:42:15 UTC 2024") == (
        "535.161.08", "proprietary")
    assert parse_nvrm((H200 / "proc/driver/nvidia/version").read_text()) == ("580.159.04", "open")
    assert parse_nvrm("") == (None, None)


def test_secure_boot_from_efivars(host):
    root = host()
    var = root / "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
    var.parent.mkdir(parents=True)
    var.write_bytes(b"\x06\x00\x00\x00\x01")
    assert read_driver(root).secure_boot is True
    var.write_bytes(b"\x06\x00\x00\x00\x00")
    assert read_driver(root).secure_boot is False


def test_engine_config_facts(host):
    root = host()
    (root / "etc/docker").mkdir(parents=True)
    (root / "etc/docker/daemon.json").write_text('{"runtimes": {"nvidia": {"path": "/usr/bin/gpuprov-runtime"}},'
                                                 ' "default-runtime": "nvidia"}')
    (root / "etc/containerd").mkdir(parents=True)
    (root / "etc/containerd/config.toml").write_text("version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"")
    eng = {e.name: e for e in detect_host(root).engines}
    assert eng["docker"].runtimes == ("runc", "nvidia") and eng["docker"].default_runtime == "nvidia"
    assert eng["containerd"].config_valid is False and eng["containerd"].config_error


def test_cli_json_schema_h200():
    r = run_cli("detect", "--root", str(H200), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "gpuprov.detect/v1"
    assert set(doc) == {"schema", "root", "distro", "target", "gpus", "other_display_devices", "driver", "engines",
                        "fleet", "warnings"}
    g = doc["gpus"][0]
    assert {"pci_id", "name", "branch", "kernel_modules", "packages", "address", "bound_driver"} <= set(g)
    assert g["pci_id"] == "10de:2335" and g["kernel_modules"] == "either"


def test_cli_human_table():
    r = run_cli("detect", "--root", str(H200))
    assert r.returncode == 0 and "NVIDIA H200" in r.stdout and "580.159.04 (open kernel module)" in r.stdout
    assert "/usr/local/nvidia" in r.stdout


def test_containerd_runtimes_in_imported_dropins(tmp_path, monkeypatch):
    """detect lists the runtimes of the files containerd's config imports (gpuprov's own drop-in is one), read under
    the root: the drop-in here is the one `engine configure containerd` writes."""
    from provision.engines.configure import configure
    from provision.facts.engines import read_engines

    monkeypatch.setenv("GPUPROV_LOCK_DIR", str(tmp_path))
    live = tmp_path / "live"
    live.mkdir()
    (live / "config.toml").write_text("version = 2\n")
    configure("containerd", config=str(live / "config.toml"), runtime_path="/usr/local/bin/gpuprov-runtime",
              default=True, restart=False)
    root = tmp_path / "root"
    (root / "etc/containerd/conf.d").mkdir(parents=True)
    (root / "etc/containerd/config.toml").write_text(
        'version = 2\nimports = ["/etc/containerd/conf.d/99-gpuprov.toml"]\n')
    (root / "etc/containerd/conf.d/99-gpuprov.toml").write_text((live / "conf.d/99-gpuprov.toml").read_text())
    [ctd] = [e for e in read_engines(root) if e.name == "containerd"]
    assert "nvidia" in ctd.runtimes and ctd.default_runtime == "nvidia" and ctd.config_valid
