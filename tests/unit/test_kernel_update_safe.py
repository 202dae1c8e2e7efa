"""A security kernel update never breaks apt on a gpuprov node (issue 31), decided and planned from fixture trees:
- the driver series is pinned to its branch (an apt preferences file by source package) instead of `apt-mark hold`
  on one version, so the security suite's in-branch update comes with its kernel; a series an earlier gpuprov held
  is migrated (pinned, then unheld); a pinned series is gpuprov's series as a held one was (followed within its
  branch, replaced by `--driver`, the pin dropped first);
- DKMS's kernel hooks (its autoinstaller reads /etc/sysconfig/dkms) record a failed build instead of failing the
  kernel's configuration: gpuprov's file there, run with dash as the kernel hook runs it;
- the pin file is what real apt reads (apt-cache policy with it).
The same with real apt, DKMS and unattended-upgrades: tests/integration/test_driver_install.py (stage 2)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from provision import effects, paths
from provision.decide.kernel import PIN_FILE, branch_of, pinned_branches, pinned_series
from provision.package_managers import apt as apt_pm
from provision.plan import dkms
from provision.plan import driver as drv
from provision.plan.build import build_plan
from provision.plan.options import Options
from provision.render import render
from provision.report import detect_host
from tests.conftest import dpkg_status, make_host
from tests.unit.test_driver_follows_branch import H100, NEW, OLD, OPEN_535, _lists

SERIES = {p.name: p.source for p in OPEN_535.values()}
OURS = tuple(p.name for p in OPEN_535.values() if p.held)


def _pin(root: Path, branch: str = "1", sources=("nvidia-graphics-drivers", "nvidia-open-gpu-kernel-modules")) -> None:
    """The pin file as PIN_SERIES writes it (fixture packages are at version 1.0-1: branch 1)."""
    (root / PIN_FILE.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (root / PIN_FILE.lstrip("/")).write_text("".join(
        f"Package: src:{s}:any\nPin: version {branch}.*\nPin-Priority: 990\n\n"
        f"Package: src:{s}:any\nPin: version *\nPin-Priority: -1\n\n" for s in sources))


def _unserved_host(tmp_path: Path, held: tuple[str, ...]) -> Path:
    """After a kernel update: 6.1.0-56 boots next without a module, the open 535 series built for 6.1.0-50."""
    root = make_host(tmp_path, "debian-12", "none", kernel=OLD)
    (root / f"lib/modules/{NEW}/kernel").mkdir(parents=True)
    (root / f"boot/vmlinuz-{NEW}").write_text("")
    (root / f"lib/modules/{OLD}/updates/dkms").mkdir(parents=True)
    (root / f"lib/modules/{OLD}/updates/dkms/nvidia-current-open.ko").write_text("")
    (root / "vmlinuz").symlink_to(f"boot/vmlinuz-{NEW}")
    dpkg_status(root, SERIES, held=held)
    _lists(root)
    return root


def _steps(root: Path, opt: Options | None = None) -> dict:
    opt = opt or Options(for_gpus=(H100,))
    pin = opt.driver if opt.driver.isdigit() else None
    return {s.id: s for s in build_plan(detect_host(root, engines=False, pin=pin, for_gpus=opt.for_gpus), opt)}


# ---------------------------------------------------------------- the branch pin


def test_pin_decisions():
    assert branch_of("535.261.03-1~deb12u1") == "535.*" and branch_of("1:470.256.02-1") == "1:470.*"
    text = ("Package: src:nvidia-graphics-drivers:any\nPin: version 535.*\nPin-Priority: 990\n\n"
            "Package: src:nvidia-graphics-drivers:any\nPin: version *\nPin-Priority: -1\n\n")
    assert pinned_branches(text) == {"nvidia-graphics-drivers": "535.*"}
    assert pinned_branches("Package: src:x:any\nPin: version *\nPin-Priority: -1\n") == {}
    unheld = {n: p._replace(held=False) for n, p in OPEN_535.items()}
    view = pinned_series(unheld, {"nvidia-graphics-drivers": "535.*"})
    assert view["nvidia-driver"].held and not view["nvidia-settings"].held  # another source: the operator's


def test_the_hold_step_pins_the_branch_and_migrates_apt_mark_holds(tmp_path):
    """A series held with `apt-mark hold` (what gpuprov did before) is not done: the step pins its sources to the
    installed branch and takes the holds off; done only with the pin right and no hold left."""
    root = make_host(tmp_path, "debian-12", "datacenter", kernel=OLD)
    dpkg_status(root, SERIES, held=OURS)
    step = _steps(root, Options())["driver.hold"]
    named = step.check.packages
    assert step.actions[0].argv == ("sh", "-c", apt_pm.PIN_SERIES, "pin-series", *named)
    assert "apt-mark hold" not in "\n".join(step.lines()) and PIN_FILE in step.title
    assert not step.check.satisfied(root)  # held, not pinned
    _pin(root)
    assert not step.check.satisfied(root)  # pinned, still held: the hold keeps the in-branch update out
    (root / "var/lib/dpkg/status").write_text("")
    dpkg_status(root, SERIES)
    assert step.check.satisfied(root)
    _pin(root, branch="2")
    assert not step.check.satisfied(root)  # another branch pinned
    _pin(root, sources=("nvidia-graphics-drivers",))
    assert not step.check.satisfied(root)  # the open module's source is not pinned


def test_the_pin_script_writes_what_apt_reads(tmp_path):
    """PIN_SERIES run for real on two of this machine's packages (its file moved under tmp_path, its unhold echoed):
    apt-cache policy, reading only that file, gives the installed branch 990 and every other version -1, and the
    plan's reader parses what it wrote."""
    for tool in ("dpkg-query", "apt-cache"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not here")
    pin = tmp_path / "gpuprov-nvidia"
    script = apt_pm.PIN_SERIES.replace(PIN_FILE, str(pin)).replace("apt-mark unhold", "echo unhold")
    r = subprocess.run(["sh", "-c", script, "pin-series", "apt", "libapt-pkg6.0"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = pin.read_text()
    version = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "apt"], capture_output=True, text=True).stdout
    assert pinned_branches(text) == {"apt": branch_of(version)}, text
    policy = subprocess.run(["apt-cache", "-o", "Dir::Etc::PreferencesParts=/nonexistent", "-o",
                             f"Dir::Etc::Preferences={pin}", "policy", "apt"], capture_output=True, text=True).stdout
    assert f" {version} 990" in policy, policy


def test_a_pinned_series_is_followed_within_its_branch(tmp_path):
    """No apt-mark hold, only the pin: still gpuprov's series. A kernel without its module gets the update within the
    branch (on main, a series without a hold was not gpuprov's: the driver step said the driver was kept)."""
    root = _unserved_host(tmp_path, held=())
    _pin(root)
    steps = _steps(root)
    step = steps["driver.packages"]
    assert step.title.startswith("Update the driver nvidia-driver 1.0 within its branch: nvidia-kernel-dkms"), \
        step.title
    assert not any(ln.startswith("$ rm -f") for ln in step.lines())  # the same branch: the pin stays
    assert steps["driver.hold"].actions[0].argv[2] == apt_pm.PIN_SERIES


def test_a_branch_change_drops_the_pin_first_and_pins_again_on_refusal(tmp_path, monkeypatch):
    """--driver 470 over a pinned 535 series: the pin goes before the install (a later branch may share its source
    package); an install that would remove more stops with exit 14 and the old series is pinned again."""
    from provision.errors import RemovalRefused

    root = _unserved_host(tmp_path, held=())
    _pin(root)
    step = _steps(root, Options(driver="470", for_gpus=("10de:1eb8",)))["driver.packages"]
    lines = step.lines()
    assert lines[1] == f"$ rm -f {PIN_FILE}", lines[:3]
    ran: list[tuple[str, ...]] = []

    def run(argv, check=True, **kw):
        ran.append(tuple(argv))
        out = "Remv nvidia-driver [535]\nRemv docker.io [20.10]\n" if "-s" in argv else "Package: x\n"
        return effects.CommandResult(list(argv), 0, out, "")

    monkeypatch.setattr(effects, "run", run)
    with pytest.raises(RemovalRefused):
        step.actions[0].execute()
    assert ran[-1][:4] == ("sh", "-c", apt_pm.PIN_SERIES, "pin-series") and "nvidia-driver" in ran[-1]


# ---------------------------------------------------------------- DKMS's kernel hooks


def test_the_plan_installs_the_kernel_hook_guard_and_keeps_an_operators_file(tmp_path):
    root = make_host(tmp_path, "debian-12", "datacenter", kernel=OLD)
    step = _steps(root, Options())["driver.kernel-hook"]
    (write,) = step.actions
    assert write.path == "/etc/sysconfig/dkms" and write.content.startswith("# Written by gpuprov")
    assert not step.check.satisfied(root)
    (root / "etc/sysconfig").mkdir()
    (root / "etc/sysconfig/dkms").write_text("MAKEFLAGS=-j8\n")
    kept = _steps(root, Options())["driver.kernel-hook"]
    assert kept.verify_only and not kept.actions and "operator's" in kept.title


def _guard_run(tmp_path: Path, dkms_exit: int, *args: str) -> tuple[int, str, Path]:
    """gpuprov's /etc/sysconfig/dkms sourced by dash, as dkms_autoinstaller sources it, then `dkms ARGS` called as
    the autoinstaller calls it; a stand-in dkms on PATH exits `dkms_exit`."""
    shell = shutil.which("dash") or shutil.which("sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "dkms").write_text(f"#!/bin/sh\necho \"dkms $*\"\nexit {dkms_exit}\n")
    os.chmod(bin_dir / "dkms", 0o755)
    failed = tmp_path / "dkms-failed"
    guard = tmp_path / "sysconfig-dkms"
    guard.write_text(render("dkms-sysconfig.j2", failed_dir=str(failed)))
    r = subprocess.run([shell, "-c", f". {guard}; dkms \"$@\"", "autoinstaller", *args], capture_output=True,
                       text=True, env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"})
    return r.returncode, r.stdout + r.stderr, failed


def test_the_guard_records_a_failed_autoinstall_instead_of_failing_the_kernel(tmp_path):
    rc, out, failed = _guard_run(tmp_path, 11, "autoinstall", "--kernelver", NEW)
    assert rc == 0 and f"dkms autoinstall --kernelver {NEW}" in out
    assert f"could not build a module for kernel {NEW} (exit 11)" in out and "gpuprov bootstrap" in out
    assert (failed / NEW).read_text().startswith("dkms autoinstall exit 11")
    # the next autoinstall for that kernel that builds clears the record
    rc, _, _ = _guard_run(tmp_path, 0, "autoinstall", "--kernelver", NEW)
    assert rc == 0 and not (failed / NEW).exists()
    # every other dkms command keeps its exit code
    rc, _, _ = _guard_run(tmp_path, 3, "status", "-k", NEW)
    assert rc == 3
    assert paths.DKMS_FAILED.endswith("/dkms-failed")


# ---------------------------------------------------------------- a failed update keeps the driver that worked


def test_the_update_plan_rolls_back_to_the_series_installed_not_a_purge(tmp_path):
    """Issue 27 item 4: the update within the branch prints, as its rollback, the series reinstalled at the versions
    installed now (apt's cache or the archive), built for every kernel, pinned at exactly those versions; no purge
    (on main the rollback purged the series: no driver after the next reboot)."""
    root = _unserved_host(tmp_path, held=())
    _pin(root)
    step = _steps(root)["driver.packages"]
    act = step.actions[0]
    assert "nvidia-driver=1.0-1" in act.previous and "nvidia-open-kernel-dkms=1.0-1" in act.previous
    rollback = [c.argv for c in act.on_failure()]
    assert rollback[0][:4] == ("apt-get", "install", "-y", "--allow-downgrades")
    assert "nvidia-kernel-dkms-" in rollback[0]  # the new flavour's module package, which failed, goes
    assert ("dkms", "autoinstall", "-k", OLD) in rollback and ("dkms", "autoinstall", "-k", NEW) in rollback
    assert any(a[:4] == ("sh", "-c", apt_pm.PIN_EXACT, "pin-exact") for a in rollback)
    assert not any(a[:2] == ("apt-get", "purge") for a in rollback)
    assert "--allow-downgrades" in "\n".join(step.lines())  # printed as it runs


def test_a_failed_update_reinstalls_builds_pins_and_names_the_kernel_without_a_module(monkeypatch):
    """Run as printed: the new version does not build for NEW; the rollback reinstalls the old versions, builds for
    both kernels (OLD gets its module back, NEW still has none), pins them exactly; exit 16 names NEW."""
    from provision.errors import DkmsBuildFailed

    ran: list[tuple[str, ...]] = []
    restored = []

    def run(argv, check=True, **kw):
        ran.append(tuple(argv))
        if argv[:3] == ["apt-get", "install", "-y"] and "--allow-downgrades" in argv:
            restored.append(True)
        if argv[:2] == ["dkms", "status"]:
            ok = argv[-1] == OLD
            return effects.CommandResult(list(argv), 0, f"nvidia/535, {argv[-1]}, x86_64: installed\n" if ok else "",
                                         "")
        return effects.CommandResult(list(argv), 0, "" if argv[0] == "dpkg" else "Package: x\n", "")

    monkeypatch.setattr(effects, "run", run)
    monkeypatch.setattr(dkms, "build_logs", lambda: [])
    prev = ("nvidia-driver=535.261.03-1~deb12u1", "nvidia-open-kernel-dkms=535.261.03-1~deb12u1")
    act = dkms.DriverInstall((f"linux-headers-{OLD}", f"linux-headers-{NEW}", "nvidia-kernel-dkms", "nvidia-driver"),
                            (OLD, NEW), "nvidia-kernel-dkms", (f"linux-headers-{OLD}", f"linux-headers-{NEW}"), "x",
                            unhold=("nvidia-driver",), remove=("nvidia-open-kernel-dkms",), previous=prev)
    with pytest.raises(DkmsBuildFailed) as exc:
        act.execute()
    msg = str(exc.value)
    assert "Rolled back to the driver that worked: reinstalled and pinned " + " ".join(prev) in msg, msg
    assert f"kernel {NEW} still has no nvidia module" in msg and "`dpkg --audit` is empty" in msg
    rollback = [c.argv for c in act.on_failure()]
    assert ran[-len(rollback):] == rollback  # what ran is what the plan prints, in order
    assert ran[-len(rollback)][-1] == "nvidia-kernel-dkms-" and restored
    assert f"for kernel {NEW}:" in msg


def test_verify_names_the_recorded_failure_and_the_fix():
    """The guard's record for the kernel that boots next is in verify's red detail, with the fix."""
    from provision.verify.checks import next_boot_module
    from tests.unit.test_kernel_follow import FactsHost

    class Recorded(FactsHost):
        def run(self, argv):
            if argv == ["cat", f"{paths.DKMS_FAILED}/{NEW}"]:
                return 0, "dkms autoinstall exit 11 at 2026-11-27T22:00:00Z; log: /var/lib/dkms/x/make.log\n", ""
            return 1, "", "no such file"

    facts = {"gpus": [], "driver": {"userspace_version": "535.261.03", "next_boot_kernel": NEW,
                                    "next_boot_from": "/vmlinuz", "next_boot_module": None}}
    r = next_boot_module(Recorded(facts))
    assert r.status == "fail" and f"kernel {NEW} boots next" in r.detail
    assert "DKMS could not build it when the kernel was installed (dkms autoinstall exit 11" in r.detail
    assert "gpuprov bootstrap" in r.detail


def test_uninstall_takes_the_pin_and_gpuprovs_guard_not_an_operators(tmp_path):
    root = make_host(tmp_path, "debian-12", "none")
    assert drv.gpuprov_files(root) == ()
    _pin(root)
    (root / "etc/sysconfig").mkdir()
    (root / "etc/sysconfig/dkms").write_text("MAKEFLAGS=-j8\n")  # the operator's
    assert drv.gpuprov_files(root) == (PIN_FILE,)
    (root / "etc/sysconfig/dkms").write_text(render("dkms-sysconfig.j2", failed_dir=paths.DKMS_FAILED))
    assert drv.gpuprov_files(root) == (PIN_FILE, "/etc/sysconfig/dkms")


def test_debian_13_plan_names_the_risk_its_dkms_leaves(tmp_path):
    """trixie's dkms 3.2.2 autoinstaller no longer sources /etc/sysconfig/dkms (read from the real package): no
    guard is written there, the plan says what a failed build does to a kernel update instead."""
    root = make_host(tmp_path, "debian-13", "datacenter", kernel="6.12.48+deb13-amd64")
    step = _steps(root, Options())["driver.kernel-hook"]
    assert step.verify_only and not step.actions and "not available" in step.title
    assert any("apt exits 100" in n for n in step.notes)


def test_apt_failing_before_dkms_is_installed_reports_apts_error(monkeypatch):
    """Seen on a bookworm host with the security suite on and contrib not yet enabled: apt refused the open module
    beside the newest driver, and the step said "command not found: dkms" (the status check) instead of apt's error."""
    from provision.errors import StepFailed

    def run(argv, check=True, **kw):
        if argv[:2] == ["apt-get", "install"]:
            return effects.CommandResult(list(argv), 100, "E: Unable to correct problems, you have held broken "
                                         "packages.\n", "")
        if argv[0] == "dkms":
            raise StepFailed("command not found: dkms")
        return effects.CommandResult(list(argv), 0, "Package: x\n", "")

    monkeypatch.setattr(effects, "run", run)
    monkeypatch.setattr(effects, "which", lambda name: None)
    act = dkms.DriverInstall((f"linux-headers-{OLD}", "nvidia-open-kernel-dkms", "nvidia-driver"), (OLD,),
                            "nvidia-open-kernel-dkms", (f"linux-headers-{OLD}",), "x")
    with pytest.raises(StepFailed, match="held broken packages"):
        act.execute()
