"""Driver plans per family (EL and Ubuntu archives are unreachable here: plans are what can be proven): branch
pinning with --driver, packages held against upgrades, Secure Boot with DKMS (a staged MOK enrolment) and with
signed kmods (nothing to stage), image baking with --for-gpu and the kernels it builds for."""
from __future__ import annotations

import dataclasses
import json

import pytest

from provision.errors import GpuprovError, Unsupported
from provision.facts.driver_facts import SECURE_BOOT_VAR
from provision.plan.build import build_plan
from provision.plan.driver import choose_kernels, loads
from provision.plan.options import Options
from provision.report import detect_host
from tests.conftest import make_host, run_cli

KERNEL = {"debian": "6.1.0-27-amd64", "ubuntu": "6.8.0-49-generic"}


def plan(tmp_path, distro: str, sysfs: str = "datacenter", secure_boot: bool = False, pin: str | None = None,
         files: dict[str, str] | None = None, **opt) -> dict[str, dict]:
    """`files`: host path -> content, added to the fixture host before it is planned for."""
    root = make_host(tmp_path, distro, sysfs, kernel=KERNEL.get(distro.split("-")[0], "5.14.0-427.el9.x86_64"))
    for path, text in (files or {}).items():
        (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / path.lstrip("/")).write_text(text)
    if secure_boot:
        var = root / SECURE_BOOT_VAR
        var.parent.mkdir(parents=True)
        var.write_bytes(b"\x06\x00\x00\x00\x01")
    o = Options(engine="none", **({"driver": pin} if pin else {}), **opt)
    rep = detect_host(root, engines=False, pin=pin, for_gpus=o.for_gpus, kernel_modules=o.kernel_modules,
                      source=None if o.driver_source == "distro" else o.driver_source)
    return {s.id: {"actions": s.lines(), "title": s.title, "reboot": s.reboot, "notes": s.notes}
            for s in build_plan(rep, o)}


def install_line(steps: dict) -> str:
    return next(a for a in steps["driver.packages"]["actions"] if " install " in a)


# family -> (distro, gpu setup, pinned branch, the install line must name, the hold command)
FAMILIES = {
    "debian-tesla": ("debian-12", "volta", "470", "nvidia-tesla-470-driver", "pin-series"),
    "debian-main": ("debian-13", "datacenter", "550", "nvidia-driver", "pin-series"),
    "ubuntu": ("ubuntu-22.04", "datacenter", "535", "nvidia-headless-535-server-open", "pin-series"),
    "elrepo": ("rocky-9", "volta", "580", "kmod-nvidia-580xx", "lock-series dnf"),
    "elrepo-el7": ("centos-7", "kepler", "470", "kmod-nvidia-470xx", "lock-series yum"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pinned_branch_installed_and_held(tmp_path, family):
    distro, sysfs, pin, pkg, hold = FAMILIES[family]
    steps = plan(tmp_path, distro, sysfs, pin=pin)
    # ELRepo's kmod by the version glob of the boot kernel's minor release (plan/kmods.py's elrepo_build)
    assert any(w.strip("'") == pkg or w.strip("'").startswith(f"{pkg}-[0-9]*-*.el") for w in install_line(steps).split())
    holds = " ".join(steps["driver.hold"]["actions"])
    assert hold in holds and pkg in holds
    assert steps["driver.packages"]["reboot"]


def test_nvidia_repo_stream_pinned(tmp_path):
    steps = plan(tmp_path, "rocky-9", "datacenter", pin="570", driver_source="nvidia")
    assert "dnf module install -y nvidia-driver:570-open" in " ".join(steps["driver.packages"]["actions"])
    assert "lock-series dnf nvidia-driver" in " ".join(steps["driver.hold"]["actions"])


@pytest.mark.parametrize("distro,sysfs,pin,needle", [
    ("debian-12", "datacenter", "470", "does not support this GPU"),  # H100 on Tesla 470
    ("debian-13", "volta", "470", "does not package driver branch 470"),
    ("ubuntu-24.04", "kepler", "470", "does not package driver branch 470"),
    ("rocky-9", "volta", "595", "does not support this GPU"),
])
def test_pinned_branch_refused_with_the_way_out(tmp_path, distro, sysfs, pin, needle):
    with pytest.raises(Unsupported, match=needle) as exc:
        plan(tmp_path, distro, sysfs, pin=pin)
    assert exc.value.exit_code == 4 and ("branches that support it there" in str(exc.value)
                                         or "no branch" in str(exc.value))


def test_cli_pin_refused_exit_4_and_bad_pin_exit_2(tmp_path):
    root = make_host(tmp_path, "debian-12", "datacenter", kernel=KERNEL["debian"])
    r = run_cli("plan", "--root", str(root), "--driver", "470")
    assert r.returncode == 4 and "does not support this GPU" in r.stderr and r.stdout == ""
    r = run_cli("plan", "--root", str(root), "--driver", "latest-ish")
    assert r.returncode == 2 and "--driver" in r.stderr


@pytest.mark.parametrize("distro", ["debian-12", "ubuntu-24.04"])
def test_secure_boot_with_dkms_stages_the_mok(tmp_path, distro):
    steps = plan(tmp_path, distro, secure_boot=True)
    mok = steps["driver.mok"]
    assert mok["reboot"]
    assert any("mokutil --import /var/lib/dkms/mok.pub --hash-file" in a for a in mok["actions"])
    assert list(steps).index("driver.mok") > list(steps).index("driver.packages")  # the key exists after DKMS


def test_secure_boot_with_signed_kmods_needs_no_mok(tmp_path):
    steps = plan(tmp_path, "rocky-9", secure_boot=True)
    assert "driver.mok" not in steps and "kmod-nvidia-open" in install_line(steps)


def test_debian_open_flavour_and_initramfs(tmp_path):
    steps = plan(tmp_path, "debian-12")
    assert steps["driver.flavour"]["actions"] == ["$ update-alternatives --set nvidia /usr/lib/nvidia/current-open"]
    assert steps["driver.initramfs"]["actions"] == [f"$ update-initramfs -u -k {KERNEL['debian']}"]
    order = list(steps)
    assert order.index("driver.nouveau") < order.index("driver.packages") < order.index("driver.flavour")
    prop = plan(tmp_path / "p", "debian-12", kernel_modules="proprietary")
    assert prop["driver.flavour"]["actions"] == ["$ update-alternatives --set nvidia /usr/lib/nvidia/current"]
    assert "nvidia-kernel-dkms" in install_line(prop).split()


def test_modprobe_flavour_read_through_the_alternative(tmp_path):
    root = tmp_path / "r"
    (root / "etc/modprobe.d").mkdir(parents=True)
    (root / "etc/alternatives").mkdir(parents=True)
    (root / "etc/nvidia").mkdir(parents=True)
    (root / "etc/nvidia/nvidia-modprobe.conf").write_text("install nvidia modprobe -i nvidia-current-open $X\n")
    (root / "etc/alternatives/nvidia--nvidia-modprobe.conf").symlink_to("/etc/nvidia/nvidia-modprobe.conf")
    (root / "etc/modprobe.d/nvidia.conf").symlink_to("/etc/alternatives/nvidia--nvidia-modprobe.conf")
    assert loads(root) == "nvidia-current-open"


def test_bake_for_gpu_on_a_host_without_one(tmp_path):
    """--for-gpu decides as if the GPU were there (the host has none) and builds for every installed kernel."""
    root = make_host(tmp_path, "debian-12", "none", kernel=KERNEL["debian"])
    (root / "lib/modules/6.1.0-28-amd64/kernel").mkdir(parents=True)
    (root / "boot/vmlinuz-6.1.0-28-amd64").write_text("")
    r = run_cli("plan", "--root", str(root), "--for-gpu", "10de:2330", "--engine", "none", "--json")
    assert r.returncode == 0, r.stderr
    steps = {s["id"]: s for s in json.loads(r.stdout)["steps"]}
    line = next(a for a in steps["driver.packages"]["actions"] if " install " in a).split()
    assert {"linux-headers-6.1.0-27-amd64", "linux-headers-6.1.0-28-amd64", "nvidia-open-kernel-dkms"} <= set(line)
    assert "every installed kernel (image baking)" in steps["driver.packages"]["title"]
    r = run_cli("plan", "--root", str(root), "--for-gpu", "10de:2330", "--kernel", "6.1.0-28-amd64",
                "--engine", "none", "--json")
    line = next(a for s in json.loads(r.stdout)["steps"] if s["id"] == "driver.packages" for a in s["actions"]
                if " install " in a).split()
    assert "linux-headers-6.1.0-28-amd64" in line and "linux-headers-6.1.0-27-amd64" not in line
    r = run_cli("plan", "--root", str(root), "--for-gpu", "10de:2330", "--kernel", "9.9.9", "--engine", "none")
    assert r.returncode == 4 and "no such kernel is installed" in r.stderr
    r = run_cli("plan", "--root", str(root), "--for-gpu", "10de:zz")
    assert r.returncode == 2 and "a PCI id VENDOR:DEVICE" in r.stderr


@pytest.mark.parametrize("family,distro,sysfs", [("ubuntu", "ubuntu-24.04", "datacenter"),
                                                 ("elrepo", "rocky-9", "datacenter"),
                                                 ("debian-legacy", "debian-11", "volta")])
def test_bake_per_family(tmp_path, family, distro, sysfs):
    steps = plan(tmp_path, distro, "none", for_gpus=("10de:1db4" if sysfs == "volta" else "10de:2330",))
    assert "driver.packages" in steps and "driver.hold" in steps


def test_kernel_choice(tmp_path):
    root = tmp_path
    for k in ("6.1.0-27-amd64", "6.1.0-28-amd64"):
        (root / f"lib/modules/{k}/kernel").mkdir(parents=True)
        (root / "boot").mkdir(exist_ok=True)
        (root / f"boot/vmlinuz-{k}").write_text("")
    (root / "vmlinuz").symlink_to("boot/vmlinuz-6.1.0-28-amd64")
    ks = choose_kernels(root, "6.1.0-27-amd64", (), False)
    assert ks.releases == ("6.1.0-28-amd64", "6.1.0-27-amd64") and "boots next" in ks.why
    ks = choose_kernels(root, "6.18.44-foreign", (), False)  # a running kernel apt did not install
    assert ks.releases == ("6.1.0-28-amd64",) and "nothing is built for it" in ks.why
    with pytest.raises(GpuprovError, match="no installed kernel"):
        choose_kernels(tmp_path / "empty", "6.18.44-foreign", (), False)


def test_no_kernel_headers_for_running_kernel_is_planned(tmp_path):
    """Missing headers for the running kernel: the plan installs them (linux-headers-<running>)."""
    steps = plan(tmp_path, "debian-12")
    assert f"linux-headers-{KERNEL['debian']}" in install_line(steps).split()
    assert dataclasses.fields(Options)  # Options carries for_gpus/kernels


def test_dkms_failure_rolls_back_and_names_the_first_error(tmp_path, monkeypatch):
    """The failure path of DriverInstall with the host's answers recorded (the real one runs in
    tests/integration/test_driver_install.py on trixie): purge, dpkg consistent, exit 16 with the compiler's line."""
    from provision import effects
    from provision.errors import DkmsBuildFailed
    from provision.plan import dkms as drv

    log = tmp_path / "var/lib/dkms/nvidia-current-open/550.163.01/build/make.log"
    log.parent.mkdir(parents=True)
    log.write_text("make -C ...\n  CC [M]  nvidia/nv-pci.o\nnvidia/nv-pci.c:123:5: error: too few arguments to "
                   "function 'pci_resize_resource'\nmake: *** Error 2\n")
    monkeypatch.setattr(drv, "build_logs", lambda: [log])
    monkeypatch.setattr(drv, "LOG_DIR", str(tmp_path / "log"))
    ran = []

    def run(argv, *, check=True, env=None, timeout=None, input_text=None, private_stdout=False, probe=False):
        ran.append(tuple(argv))
        if argv[:2] == ["apt-get", "install"]:
            return effects.CommandResult(list(argv), 100, "Error! Bad return status for module build on kernel\n")
        if argv[:2] == ["dkms", "status"]:
            return effects.CommandResult(list(argv), 0, "nvidia-current-open/550.163.01: added\n")
        return effects.CommandResult(list(argv), 0, "" if argv[0] == "dpkg" else "ok\n")

    monkeypatch.setattr(effects, "run", run)
    act = drv.DriverInstall(("linux-headers-6.12.48+deb13-amd64", "nvidia-open-kernel-dkms", "nvidia-driver"),
                            ("6.12.48+deb13-amd64",), "nvidia-open-kernel-dkms", ("linux-headers-6.12.48+deb13-amd64",),
                            "--kernel-modules proprietary (this GPU allows it)")
    with pytest.raises(DkmsBuildFailed) as exc:
        act.execute()
    msg = str(exc.value)
    assert exc.value.exit_code == 16
    assert "nvidia-open-kernel-dkms" in msg and "6.12.48+deb13-amd64" in msg
    assert "error: too few arguments to function 'pci_resize_resource'" in msg
    assert "`dpkg --audit` is empty" in msg and "--kernel-modules proprietary" in msg
    assert ("apt-get", "purge", "-y", "nvidia-open-kernel-dkms", "nvidia-driver") in ran and ("dpkg", "--audit") in ran
    assert (tmp_path / "log").glob("dkms-*.log")


def test_apt_failing_before_dkms_is_a_step_failure(monkeypatch):
    from provision import effects
    from provision.plan import dkms as drv

    monkeypatch.setattr(drv, "build_logs", lambda: [])

    def run(argv, *, check=True, env=None, timeout=None, input_text=None, private_stdout=False, probe=False):
        rc = 100 if argv[:2] == ["apt-get", "install"] else 0
        return effects.CommandResult(list(argv), rc, "E: Could not get lock /var/lib/dpkg/lock-frontend\n")

    monkeypatch.setattr(effects, "run", run)
    act = drv.DriverInstall(("nvidia-driver",), ("6.1.0-27-amd64",), "nvidia-kernel-dkms", (), "x")
    with pytest.raises(GpuprovError) as exc:
        act.execute()
    assert exc.value.exit_code == 5 and "lock" in str(exc.value)


def test_headers_apt_lacks_refused_before_installing(monkeypatch):
    from provision import effects
    from provision.plan import dkms as drv

    ran = []

    def run(argv, *, check=True, env=None, timeout=None, input_text=None, private_stdout=False, probe=False):
        ran.append(argv[:2])
        rc = 100 if argv[0] == "apt-cache" else 0
        return effects.CommandResult(list(argv), rc, "")

    monkeypatch.setattr(effects, "run", run)
    act = drv.DriverInstall(("linux-headers-6.1.0-99-amd64", "nvidia-driver"), ("6.1.0-99-amd64",),
                            "nvidia-kernel-dkms", ("linux-headers-6.1.0-99-amd64",), "x")
    with pytest.raises(Unsupported, match="apt offers no linux-headers-6.1.0-99-amd64") as exc:
        act.execute()
    assert exc.value.exit_code == 4 and ["apt-get", "install"] not in ran


def test_elrepo_mirror_is_what_dnf_keeps_using(tmp_path):
    """--mirror elrepo=URL: elrepo-release's repository file names upstream's hosts whatever URL the package came
    from, so the plan saves the mirror into it (dnf config-manager --save), and the step is not done while the file
    still names upstream. On the previous commit the plan fetched the release package from the mirror only, and the
    next dnf run went upstream (test_el_dnf.py saw it fail on a host with no network)."""
    steps = plan(tmp_path, "rocky-9", mirrors={"elrepo": "http://mirror.example/elrepo"})
    assert ("$ dnf config-manager --save '--setopt=elrepo.baseurl=http://mirror.example/elrepo/linux/elrepo/el9/"
            "$basearch/' --setopt=elrepo.mirrorlist=") in steps["driver.repo"]["actions"]
    from provision.plan.packages import RepoInstalled
    root = tmp_path / "host"
    check = RepoInstalled("dnf", "elrepo-release", "/etc/yum.repos.d/elrepo.repo", "http://mirror.example/elrepo")
    (root / "etc/yum.repos.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/yum.repos.d/elrepo.repo").write_text("[elrepo]\nbaseurl=http://elrepo.org/linux/elrepo/el9/$basearch/\n")
    assert "names http://mirror.example/elrepo" in check.describe()
    assert not check.satisfied(root)


def test_el_hold_locks_the_driver_series(tmp_path):
    """The kmod alone locked leaves nvidia-x11-drv free to move to the next release, which needs the next kmod: with
    EL's best=True `dnf upgrade` then fails whole, kernel updates included (seen with a real dnf in
    test_el_dnf.py). The hold locks every installed nvidia package at the driver's version."""
    acts = plan(tmp_path, "rocky-9")["driver.hold"]["actions"]
    lock = next(a for a in acts if "versionlock add" in a)
    assert "lock-series dnf kmod-nvidia-open" in lock and "/nvidia/" in lock, lock


def test_docker_ce_repo_enabled_only_once_installed(tmp_path):
    """Docker CE on EL: its repository is added disabled, enabled for the install's dry run and install alone, and
    for good only after the install. On the previous commit a refused install (exit 14: containerd.io would replace
    runc) left docker-ce-stable enabled, and the operator's next plain `dnf upgrade` replaced the distribution's runc
    with containerd.io (seen with a real dnf in tests/integration/test_el_dnf.py)."""
    root = make_host(tmp_path, "rocky-9", "datacenter", kernel="5.14.0-427.el9.x86_64")
    o = Options(engine="docker", engine_source="docker-ce", driver="skip", mirrors={"docker-ce": "http://m.example/d"})
    rep = detect_host(root, engines=False)
    step = next(s for s in build_plan(rep, o) if s.id == "engine.packages")
    lines = [ln for ln in step.lines() if ln.startswith("$")]
    assert lines[0] == "$ dnf config-manager --add-repo http://m.example/d/centos/docker-ce.repo"
    assert lines[1].startswith("$ dnf config-manager --save ") and lines[1].endswith("--setopt=docker-ce-stable.enabled=0")
    assert "docker-ce-stable.baseurl=http://m.example/d/centos/9/$basearch/stable" in lines[1]
    assert lines[2] == "$ dnf --enablerepo=docker-ce-stable install --assumeno docker-ce docker-ce-cli containerd.io"
    assert lines[3] == "$ dnf --enablerepo=docker-ce-stable install -y docker-ce docker-ce-cli containerd.io"
    assert lines[4] == "$ dnf config-manager --save --setopt=docker-ce-stable.enabled=1"


def test_docker_ce_on_alibaba_cloud_linux_3_uses_docker_s_el8_tree(tmp_path):
    """Docker's docker-ce.repo reads `$releasever`, 3 on Alibaba Cloud Linux 3, where Docker has no tree: the plan
    saves the EL 8 tree's baseurl, mirror or not (real dnf: tests/integration/test_el_cuda_releases.py)."""
    root = make_host(tmp_path, "alinux-3", "none", kernel="5.10.134-15.1.al8.x86_64")
    o = Options(engine="docker", engine_source="docker-ce", driver="skip")
    step = next(s for s in build_plan(detect_host(root, engines=False), o) if s.id == "engine.packages")
    save = next(ln for ln in step.lines() if ln.startswith("$ dnf config-manager --save "))
    assert "--setopt=docker-ce-stable.baseurl=" in save and "/centos/8/$basearch/stable" in save, save
    assert "$releasever" not in save, save


def test_cuda_and_epel_mirrors_are_what_dnf_keeps_using(tmp_path):
    """--mirror cuda=URL / epel=URL: NVIDIA's .repo file and epel-release's epel.repo name upstream's hosts (EPEL a
    metalink) whatever URL they came from; the plan saves the mirrors into them, and the step is not done while a
    file does not name its mirror. On the previous commit neither was set: every later dnf run went upstream."""
    steps = plan(tmp_path, "rocky-9", driver_source="nvidia",
                 mirrors={"cuda": "http://mirror.example/cuda", "epel": "http://mirror.example/epel"})
    acts = steps["driver.repo"]["actions"]
    assert ("$ dnf config-manager --save '--setopt=epel.baseurl=http://mirror.example/epel/9/Everything/"
            "$basearch/' --setopt=epel.metalink=") in acts
    assert ("$ dnf config-manager --save --setopt=cuda-rhel9-x86_64.baseurl=http://mirror.example/cuda/rhel9/x86_64 "
            "--setopt=cuda-rhel9-x86_64.gpgkey=http://mirror.example/cuda/rhel9/x86_64/D42D0685.pub") in acts
    from provision.plan.packages import ReposAt
    root = tmp_path / "host"
    check = ReposAt((("/etc/yum.repos.d/epel.repo", "http://mirror.example/epel"),
                     ("/etc/yum.repos.d/cuda-rhel9.repo", "http://mirror.example/cuda")))
    (root / "etc/yum.repos.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/yum.repos.d/epel.repo").write_text("[epel]\nbaseurl=http://mirror.example/epel/$releasever/\n")
    (root / "etc/yum.repos.d/cuda-rhel9.repo").write_text("[cuda-rhel9-x86_64]\nbaseurl=https://upstream.invalid/\n")
    assert not check.satisfied(root)
    (root / "etc/yum.repos.d/cuda-rhel9.repo").write_text("[cuda-rhel9-x86_64]\nbaseurl=http://mirror.example/cuda/\n")
    assert check.satisfied(root)


def test_nvidia_apt_repository_added_before_its_packages(tmp_path):
    """--driver-source nvidia on Ubuntu: the plan installs NVIDIA's nvidia-open-<b>; on the previous commit it added no
    repository that has it (apt: no such package). Now NVIDIA's flat repository for the release, at its --mirror,
    signed-by the key beside it, in cuda-keyring's list file (a second list of the same URL with another Signed-By
    stops apt). tests/integration/test_ubuntu_apt.py installs from it with a real apt."""
    steps = plan(tmp_path, "ubuntu-22.04", driver_source="nvidia", mirrors={"cuda": "http://mirror.example/cuda"})
    ids = list(steps)
    assert ids.index("driver.repo") < ids.index("driver.packages"), ids
    acts = steps["driver.repo"]["actions"]
    assert ("$ curl -fsSL http://mirror.example/cuda/ubuntu2204/x86_64/3bf863cc.pub -o "
            "/etc/apt/keyrings/cuda-archive-keyring.asc") in acts, acts
    assert "write /etc/apt/sources.list.d/cuda-ubuntu2204-x86_64.list" in " ".join(acts), acts
    assert "nvidia-open-" in install_line(steps)
    # DKMS builds NVIDIA's module and is checked, as for Ubuntu's own packages
    assert any(a.startswith("$ dkms status -k ") for a in steps["driver.packages"]["actions"])


def test_another_module_stream_enabled_is_switched(tmp_path):
    """NVIDIA's repository on EL 8+: the branch is a module stream. With another stream of nvidia-driver enabled
    (dnf's state file), the plan switches it (`dnf module switch-to`, its dry run first, both past the old branch's
    version locks, which the hold step replaces); without, it installs the stream."""
    steps = plan(tmp_path / "fresh", "rocky-9", driver_source="nvidia", pin="575")
    assert "$ dnf module install -y nvidia-driver:575-open" in steps["driver.packages"]["actions"]
    state = {"/etc/dnf/modules.d/nvidia-driver.module":  # dnf's state of an enabled 570-open stream
             "[nvidia-driver]\nname=nvidia-driver\nstream=570-open\nprofiles=default\nstate=enabled\n"}
    steps = plan(tmp_path / "switch", "rocky-9", driver_source="nvidia", pin="575", files=state)
    acts = steps["driver.packages"]["actions"]
    assert "$ dnf --disableplugin=versionlock module switch-to --assumeno nvidia-driver:575-open" in acts
    assert "$ dnf --disableplugin=versionlock module switch-to -y nvidia-driver:575-open" in acts
    assert steps["driver.packages"]["title"].startswith("Switch the driver's module stream to nvidia-driver:575-open")
