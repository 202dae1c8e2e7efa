"""Issue 43 items 1 and 2, decisions on fixture roots: a running GPU node (its driver loaded, as
/proc/driver/nvidia/version and /proc/modules say) after a kernel update, and with options that ask for another driver.

Item 1, Ubuntu: gpuprov's series on Canonical's precompiled modules (the headless metapackage's no-DKMS twin, the
linux-modules-nvidia-* packages) and a kernel ABI bump whose precompiled modules Canonical has not published yet:
the next-boot check asks about the packages installed (it asked about nvidia-headless-B-server-open, which that path
does not install, so bootstrap said "left alone"), and bootstrap adds DKMS for that kernel, Canonical's modules kept
for the others. Once the archive has them for every kernel, the next bootstrap moves back, DKMS removed in the same
transaction. Without --driver, the plan is for the installed series' branch, not the newest.

Item 2: --driver B (or --kernel-modules) that differs from the loaded driver plans the change, on Ubuntu and Debian;
"left alone" only when nothing asked differs; a driver gpuprov would not replace is refused (exit 14), not skipped.

The same through real apt and dpkg: tests/integration/test_ubuntu_day_two.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from provision.commands.plan import _plan
from provision.decide.kernel import PIN_FILE, branch_replacement, ubuntu_module_move
from provision.errors import CONFLICT, GpuprovError
from provision.facts.packages import InstalledPackage
from provision.plan.build import build_plan
from provision.plan.driver_on_host import held_driver
from provision.plan.options import Options
from provision.report import detect_host
from tests.conftest import make_host

K91, K131 = "5.15.0-91-generic", "5.15.0-131-generic"
V570, V580 = "570.195.03-0ubuntu0.22.04.1", "580.95.05-0ubuntu0.22.04.1"
SRC570 = "nvidia-graphics-drivers-570-server"
LRM = "linux-modules-nvidia-570-server-open-"
OPEN_570 = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.195.03  Release Build\n"
PRECOMPILED = {  # what gpuprov's precompiled install of 570-server-open leaves (test_ubuntu_apt.py, stage 2)
    "nvidia-headless-no-dkms-570-server-open": (V570, SRC570), "nvidia-utils-570-server": (V570, SRC570),
    "libnvidia-compute-570-server": (V570, SRC570), "nvidia-kernel-common-570-server": (V570, SRC570),
    "nvidia-kernel-source-570-server-open": (V570, SRC570), "nvidia-compute-utils-570-server": (V570, SRC570),
    f"{LRM}generic": ("5.15.0.91.88", "linux-meta"), f"{LRM}{K91}": ("5.15.0-91.101", "linux-restricted-modules")}
DKMS_570 = {"nvidia-headless-570-server-open": (V570, SRC570), "nvidia-dkms-570-server-open": (V570, SRC570)}


def _status(root: Path, packages: dict[str, tuple[str, str]]) -> None:
    path = root / "var/lib/dpkg/status"
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.exists() else ""
    path.write_text(old + "".join(
        f"Package: {n}\nStatus: install ok installed\nPriority: optional\nMaintainer: Ubuntu\nArchitecture: amd64\n"
        f"Source: {src}\nVersion: {v}\nDescription: fixture\n\n" for n, (v, src) in packages.items()))


def _kernel(root: Path, k: str, module: str | None) -> None:
    (root / f"boot/vmlinuz-{k}").write_text("")
    (root / f"lib/modules/{k}/kernel").mkdir(parents=True, exist_ok=True)
    if module:
        (root / f"lib/modules/{k}/{module}").parent.mkdir(parents=True, exist_ok=True)
        (root / f"lib/modules/{k}/{module}").write_text("")


def _lists(root: Path, abis: tuple[str, ...], meta_for: str) -> None:
    """The restricted component's list: each ABI's precompiled package, and the flavour's metapackage at the
    version that depends on `meta_for`'s."""
    lists = root / "var/lib/apt/lists"
    lists.mkdir(parents=True, exist_ok=True)
    (lists / "archive_ubuntu_dists_jammy-updates_restricted_binary-amd64_Packages").write_text(
        "".join(f"Package: {LRM}{k}\nVersion: {k[:-8]}.1\nSource: linux-restricted-modules\n"
                f"Depends: linux-image-{k}\n\n" for k in abis)
        + f"Package: {LRM}generic\nVersion: {meta_for[:-8].replace('-', '.')}\nSource: linux-meta\n"
          f"Depends: {LRM}{meta_for}\n\n")


def ubuntu_node(tmp_path: Path, *, boot_module: str | None = None, dkms: bool = False, abis=(K91,), meta_for=K91,
                nvrm: str = OPEN_570) -> Path:
    """A 22.04 H100 node running K91 with gpuprov's 570-server-open loaded, installed from Canonical's precompiled
    modules and pinned; a kernel update installed K131 (linux-generic moved on), which boots next (/boot/vmlinuz),
    with `boot_module` its nvidia module or none; `dkms`: the DKMS flavour was added since."""
    root = make_host(tmp_path, "ubuntu-22.04", "datacenter", kernel=K91, modules="nvidia 1 0 - Live 0x0\n", nvrm=nvrm)
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True, exist_ok=True)
    (lib / "libnvidia-ml.so.570.195.03").write_text("")
    _kernel(root, K91, "kernel/nvidia-570srv-open/nvidia.ko")
    _kernel(root, K131, boot_module)
    (root / "boot/vmlinuz").symlink_to(f"vmlinuz-{K131}")
    _status(root, {**PRECOMPILED, f"linux-image-{K131}": ("5.15.0-131.141", "linux-signed"),
                   **(DKMS_570 if dkms else {})})
    (root / PIN_FILE.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (root / PIN_FILE.lstrip("/")).write_text(f"Package: src:{SRC570}:any\nPin: version 570.*\nPin-Priority: 990\n\n"
                                             f"Package: src:{SRC570}:any\nPin: version *\nPin-Priority: -1\n\n")
    _lists(root, abis, meta_for)
    return root


def plan(root: Path, **opt) -> dict:
    rep = detect_host(root, engines=False, pin=opt.get("driver") if str(opt.get("driver", "")).isdigit() else None,
                      kernel_modules=opt.get("kernel_modules", "auto"))
    return {s.id: s for s in build_plan(rep, Options(engine="none", **opt)) if s.id.startswith("driver.")}


def _install(step) -> list[str]:
    return next(ln for ln in step.lines() if "apt-get install" in ln and " -s " not in ln).split()


# ---------------------------------------------------------------- item 1: the module follows the ABI


def test_abi_bump_without_precompiled_adds_dkms_for_that_kernel(tmp_path):
    """The issue's case: `apt-get full-upgrade` brought K131; the archive has no precompiled modules for it. Main
    said "left alone" (its next-boot check asked whether nvidia-headless-570-server-open was held)."""
    steps = plan(ubuntu_node(tmp_path), driver="570")
    assert "driver.present" not in steps, steps["driver.present"].title
    step = steps["driver.packages"]
    assert step.title.startswith(f"Add DKMS to the driver's series for kernel {K131}, which Canonical has no "
                                 "precompiled module for yet: nvidia-headless-570-server-open"), step.title
    install = _install(step)
    assert "nvidia-headless-570-server-open" in install and f"linux-headers-{K131}" in install
    assert "linux-headers-generic" in install  # the next kernel's headers follow: DKMS builds in its transaction
    assert not [w for w in install if w.endswith("-")], install  # Canonical's modules stay for K91: nothing removed
    assert not [w for w in install if w.startswith("linux-modules-nvidia")], install
    assert [ln for ln in step.lines() if ln.startswith("$ dkms autoinstall")] == [f"$ dkms autoinstall -k {K131}"]
    why = next(n for n in step.notes if n.startswith("kernel module: "))
    assert f"the archive has no {LRM}{K131}" in why and f"precompiled modules stay for {K91}" in why, why
    assert "moves back" in why
    assert step.reboot and K131 in step.reboot_reason
    # a failed build takes only what this step added: Canonical's module for K91 and the userspace stay
    purge = next(ln for ln in step.lines() if "apt-get purge" in ln)
    assert purge.split()[-2:] == ["nvidia-headless-570-server-open", "nvidia-dkms-570-server-open"], purge


def test_without_driver_the_plan_follows_the_installed_series(tmp_path):
    """`gpuprov bootstrap` without --driver on that node: the newest branch (580) would have apt remove the 570
    series (exit 14); the plan is for the series gpuprov installed and pinned."""
    root = ubuntu_node(tmp_path)
    assert held_driver(root) == ("570", "open", f"nvidia-headless-no-dkms-570-server-open {V570.split('-')[0]}")
    report, steps = _plan(root, None, Options(engine="none"))
    assert report.gpus[0][1].packages == ("nvidia-headless-570-server-open", "nvidia-utils-570-server")
    step = next(s for s in steps if s.id == "driver.packages")
    assert "nvidia-headless-570-server-open" in _install(step) and "580" not in " ".join(step.lines())
    # where nothing is pinned, auto is the newest branch as before
    (root / PIN_FILE.lstrip("/")).unlink()
    assert _plan(root, None, Options(engine="none"))[0].gpus[0][1].packages[0] == "nvidia-headless-580-server-open"


def test_next_boot_served_by_dkms_is_left_alone_until_the_precompiled_modules_appear(tmp_path):
    root = ubuntu_node(tmp_path / "a", boot_module="updates/dkms/nvidia.ko", dkms=True)
    steps = plan(root, driver="570")
    assert list(steps) == ["driver.present"] and "left alone" in steps["driver.present"].title
    # Canonical publishes K131's modules (and the flavour's metapackage moves to them): the next run moves back
    root = ubuntu_node(tmp_path / "b", boot_module="updates/dkms/nvidia.ko", dkms=True, abis=(K91, K131),
                       meta_for=K131)
    cli = next(s for s in _plan(root, None, Options(engine="none"))[1] if s.id == "driver.packages")  # no --driver
    for step in (plan(root, driver="570")["driver.packages"], cli):
        assert step.title.startswith("Move the driver's kernel module back to Canonical's precompiled modules"), \
            step.title
        install = _install(step)
        assert {f"{LRM}generic", f"{LRM}{K91}", f"{LRM}{K131}", "nvidia-headless-no-dkms-570-server-open"} <= \
            set(install), install
        assert {"nvidia-headless-570-server-open-", "nvidia-dkms-570-server-open-"} <= set(install), install
        assert not [ln for ln in step.lines() if "dkms autoinstall" in ln]
        assert f"$ apt-mark auto {LRM}{K91} {LRM}{K131}" in step.lines(), step.lines()
        assert any("for every installed kernel" in n for n in step.notes), step.notes


def test_module_move_decision():
    inst = {n: InstalledPackage(n, v, source=s) for n, (v, s) in PRECOMPILED.items()}
    pkgs = ("nvidia-headless-570-server-open", "nvidia-utils-570-server")
    metas = ("linux-image-generic",)
    offered = frozenset({f"{LRM}generic", f"{LRM}{K91}"})
    move = ubuntu_module_move(inst, pkgs, metas, (K131, K91), (K91, K131), offered)
    assert move.to == "dkms" and move.install == ("nvidia-headless-570-server-open",) and move.kernels == (K131,)
    # the archive has them for K131 too: the usual precompiled install adds K131's package, no move
    assert ubuntu_module_move(inst, pkgs, metas, (K131, K91), (K91, K131), offered | {f"{LRM}{K131}"}) is None
    # every kernel served already; a first install (no twin); desktop metapackages (DKMS always): no move
    assert ubuntu_module_move(inst, pkgs, metas, (K91,), (K91,), offered) is None
    assert ubuntu_module_move({}, pkgs, metas, (K131, K91), (K91, K131), offered) is None
    assert ubuntu_module_move(inst, ("nvidia-driver-570-open",), metas, (K131,), (K91, K131), offered) is None
    # DKMS installed, Canonical's modules offered for one kernel but not the other: stays
    dk = {**inst, **{n: InstalledPackage(n, v, source=s) for n, (v, s) in DKMS_570.items()}}
    assert ubuntu_module_move(dk, pkgs, metas, (K131,), (K91, K131), offered) is None
    back = ubuntu_module_move(dk, pkgs, metas, (K131,), (K91, K131), offered | {f"{LRM}{K131}"})
    assert back.to == "precompiled" and back.kernels == (K91, K131)
    assert back.remove == ("nvidia-headless-570-server-open", "nvidia-dkms-570-server-open")
    # the same Ubuntu series is never a branch change: its modules' packaging moves instead
    held = {n: p._replace(held=True) if p.source == SRC570 else p for n, p in inst.items()}
    assert branch_replacement(held, pkgs) is None
    assert branch_replacement(held, ("nvidia-headless-580-server-open", "nvidia-utils-580-server")) is not None


# ---------------------------------------------------------------- item 2: what is asked is done or refused


def test_driver_branch_asked_on_a_running_node_is_planned(tmp_path):
    """--driver 580 with 570 loaded: main said "left alone", exit 0, and changed nothing."""
    root = ubuntu_node(tmp_path, boot_module="updates/dkms/nvidia.ko", dkms=True)
    assert list(plan(root, driver="570")) == ["driver.present"]  # nothing asked differs
    assert list(plan(root)) == ["driver.present"]
    steps = plan(root, driver="580")
    step = steps["driver.packages"]
    assert step.title.startswith("Replace the driver nvidia-headless-no-dkms-570-server-open 570.195.03 with "
                                 "nvidia-headless-580-server-open"), step.title
    assert step.reboot and step.reboot_reason.startswith("driver nvidia-headless-no-dkms-570-server-open 570.195.03 "
                                                         "replaced")
    install = _install(step)
    assert "nvidia-headless-580-server-open" in install and "nvidia-headless-no-dkms-570-server-open-" in install
    assert f"{LRM}{K91}-" in install  # the old branch's precompiled modules go with it
    assert [ln for ln in step.lines() if "dkms autoinstall" in ln] == [f"$ dkms autoinstall -k {K91}",
                                                                      f"$ dkms autoinstall -k {K131}"]
    assert "Pin the driver to its branch" in steps["driver.hold"].title


def test_kernel_modules_asked_on_a_running_node_is_planned(tmp_path):
    root = ubuntu_node(tmp_path, boot_module="updates/dkms/nvidia.ko", dkms=True)
    assert list(plan(root, kernel_modules="open")) == ["driver.present"]
    step = plan(root, kernel_modules="proprietary", driver="570")["driver.packages"]
    assert step.title.startswith("Replace the driver nvidia-headless-no-dkms-570-server-open 570.195.03 with "
                                 "nvidia-headless-570-server "), step.title
    install = _install(step)
    assert "nvidia-headless-570-server" in install and "nvidia-dkms-570-server-open-" in install
    # without --driver too: the installed branch, the flavour asked
    _, steps = _plan(root, None, Options(engine="none", kernel_modules="proprietary"))
    assert next(s for s in steps if s.id == "driver.packages").title.startswith(
        "Replace the driver nvidia-headless-no-dkms-570-server-open 570.195.03 with nvidia-headless-570-server ")


def _debian_node(tmp_path: Path, sysfs: str, module: str, nvrm: str) -> Path:
    """Debian 12 with gpuprov's held 535 (`module`: its kernel-module package) loaded."""
    k = "6.1.0-27-amd64"
    root = make_host(tmp_path, "debian-12", sysfs, kernel=k, modules="nvidia 1 0 - Live 0x0\n", nvrm=nvrm)
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True, exist_ok=True)
    (root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.535.261.03").write_text("")
    (root / f"lib/modules/{k}/updates/dkms").mkdir(parents=True)
    (root / f"lib/modules/{k}/updates/dkms/nvidia-current.ko").write_text("")
    v = "535.261.03-1~deb12u1"
    _status(root, {p: (v, "nvidia-graphics-drivers") for p in ("nvidia-driver", "nvidia-smi", "libcuda1")})
    _status(root, {module: (v, "nvidia-open-gpu-kernel-modules" if "open" in module else "nvidia-graphics-drivers")})
    (root / PIN_FILE.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (root / PIN_FILE.lstrip("/")).write_text("".join(
        f"Package: src:{s}:any\nPin: version 535.*\nPin-Priority: 990\n\n"
        for s in ("nvidia-graphics-drivers", "nvidia-open-gpu-kernel-modules")))
    return root


def test_debian_driver_branch_asked_on_a_running_node_is_planned(tmp_path):
    """plan/driver.py is shared: Debian 12, a V100 with gpuprov's held 535 loaded, --driver 470."""
    root = _debian_node(tmp_path, "volta", "nvidia-kernel-dkms",
                        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.261.03  Release Build\n")
    assert list(plan(root)) == ["driver.present"] and list(plan(root, driver="535")) == ["driver.present"]
    step = plan(root, driver="470")["driver.packages"]
    assert step.title.startswith("Replace the driver nvidia-driver 535.261.03 with nvidia-tesla-470-kernel-dkms"), \
        step.title
    assert step.reboot and "nvidia-driver-" in _install(step)


def test_debian_kernel_modules_asked_on_a_running_node_is_planned(tmp_path):
    """An H100 running gpuprov's held proprietary 535 on Debian 12: --kernel-modules open swaps the module package
    (the open one's source replaces the proprietary one) instead of "left alone"."""
    root = _debian_node(tmp_path, "datacenter", "nvidia-kernel-dkms",
                        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.261.03  Release Build\n")
    assert list(plan(root, kernel_modules="proprietary")) == ["driver.present"]
    step = plan(root, kernel_modules="open")["driver.packages"]
    install = _install(step)
    assert "nvidia-open-kernel-dkms" in install and "nvidia-kernel-dkms-" in install, install
    assert step.reboot


def test_a_driver_gpuprov_would_not_replace_is_refused_not_skipped(tmp_path):
    """A loaded driver whose userspace no package manager installed (a GPU VM's /usr/local/nvidia), and NVIDIA's
    CUDA-repository packages loaded: --driver B for another branch is exit 14 with the way out; nothing asked, kept."""
    root = make_host(tmp_path / "vm", "ubuntu-22.04", "datacenter", kernel=K91, modules="nvidia 1 0 - Live 0x0\n",
                     nvrm=OPEN_570)
    (root / "usr/local/nvidia/lib64").mkdir(parents=True)
    (root / "usr/local/nvidia/lib64/libnvidia-ml.so.570.195.03").write_text("")
    assert list(plan(root)) == ["driver.present"]
    with pytest.raises(GpuprovError) as refused:
        plan(root, driver="580")
    assert refused.value.exit_code == CONFLICT and "/usr/local/nvidia" in str(refused.value), refused.value
    cuda = make_host(tmp_path / "cuda", "ubuntu-22.04", "datacenter", kernel=K91, modules="nvidia 1 0 - Live 0x0\n",
                     nvrm=OPEN_570)
    (cuda / "usr/lib/x86_64-linux-gnu").mkdir(parents=True, exist_ok=True)
    (cuda / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.195.03").write_text("")
    path = cuda / "var/lib/dpkg/status"
    path.write_text(path.read_text() + "Package: nvidia-open-570\nStatus: install ok installed\nMaintainer: cudatools "
                    "<cudatools@nvidia.com>\nArchitecture: amd64\nVersion: 570.195.03-0ubuntu1\n\n")
    with pytest.raises(GpuprovError) as refused:
        plan(cuda, driver="580")
    assert refused.value.exit_code == CONFLICT and "apt-get purge nvidia-open-570" in str(refused.value)
    assert list(plan(cuda)) == ["driver.present"]
