"""Issue 43 item 1, its last part, decided from fixture roots: on Ubuntu, a kernel ABI bump whose precompiled modules
Canonical has not published, and whose DKMS build fails, must not become the default boot entry. The decision (which
kernel, which GRUB menu entry, drop-in or grub-set-default) read from a grub.cfg that grub-mkconfig itself wrote
(tests/fixtures/boot/ubuntu-jammy-grub.cfg), the plan's words and its failure branch, the pinned node planned for
the kernel that would boot without the pin, the step that gives the entry back, verify's warning, the record's
field and uninstall's step. The same through real apt, dpkg, DKMS and GRUB's own update-grub:
tests/integration/test_ubuntu_day_two.py (test_dkms_failure_keeps_the_default_boot_entry)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from provision import record
from provision.facts.boot import (
    BOOT_PIN,
    GrubSetup,
    entry_path,
    next_boot_kernel,
    parse_grub_menu,
    read_grub,
    read_pin,
    unpinned_next_kernel,
)
from provision.plan import uninstall
from provision.plan.boot_default import (
    DROP_IN,
    SAVED,
    FallbackInstall,
    KeepBootDefault,
    Pin,
    decide,
    pin_text,
)
from provision.plan.driver_on_host import boot_kernel
from provision.verify.checks import NodeHost, boot_default
from tests.unit.test_loaded_driver_day_two import K91, K131, plan, ubuntu_node

BOOT = Path(__file__).resolve().parents[1] / "fixtures/boot"
U = "3f5d2e7c-8a10-4b8e-9d1a-6d2c1a9e5b1e"  # the fixture's root filesystem uuid
ENTRY91 = f"gnulinux-advanced-{U}>gnulinux-{K91}-advanced-{U}"


def _grub(root: Path, cfg: str = "ubuntu-jammy-grub.cfg", defaults: str = "GRUB_DEFAULT=0\n",
          drop_ins: dict[str, str] | None = None, env: str = "") -> Path:
    """GRUB as Debian's and Ubuntu's grub2-common leave it: grub.cfg (grub-mkconfig's), grubenv, update-grub and
    grub-set-default, the operator's /etc/default/grub and drop-ins."""
    (root / "boot/grub").mkdir(parents=True, exist_ok=True)
    shutil.copy(BOOT / cfg, root / "boot/grub/grub.cfg")
    (root / "boot/grub/grubenv").write_text("# GRUB Environment Block\n" + env + "#" * 900)
    (root / "usr/sbin").mkdir(parents=True, exist_ok=True)
    for tool in ("update-grub", "grub-set-default"):
        (root / "usr/sbin" / tool).write_text("#!/bin/sh\n")
    (root / "etc/default/grub.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/default/grub").write_text(defaults)
    for name, text in (drop_ins or {}).items():
        (root / "etc/default/grub.d" / name).write_text(text)
    return root


# ---------------------------------------------------------------- the decision


def test_entry_of_a_kernel_in_grub_mkconfigs_own_output():
    menu = parse_grub_menu((BOOT / "ubuntu-jammy-grub.cfg").read_text())
    assert entry_path(menu, K91) == ENTRY91  # the advanced submenu's entry, never the recovery one
    assert entry_path(menu, K131) == f"gnulinux-advanced-{U}>gnulinux-{K131}-advanced-{U}"
    assert entry_path(menu, "5.15.0-1-generic") is None
    # what update-grub wrote with gpuprov's drop-in: GRUB's default resolves to 5.15.0-91
    pinned = (BOOT / "ubuntu-jammy-pinned-grub.cfg").read_text()
    assert f'set default="{ENTRY91}"' in pinned


def test_decide(tmp_path):
    kernels = [K91, K131]
    root = _grub(tmp_path / "plain")
    grub = read_grub(root)
    assert grub == GrubSetup(grub.menu, False, None, None, True)
    fb = decide(K131, kernels, frozenset({K91}), grub)
    assert fb.pin == Pin(K91, K131, ENTRY91, DROP_IN)
    assert fb.why == f"the default boot entry stays on {K91} ({BOOT_PIN} sets GRUB_DEFAULT; update-grub)"
    # the operator's GRUB_DEFAULT=saved: grub-set-default, as the operator's setting asks
    saved = read_grub(_grub(tmp_path / "saved", defaults='GRUB_DEFAULT="saved"\nGRUB_SAVEDEFAULT=true\n',
                            env=f"saved_entry=gnulinux-simple-{U}\n"))
    assert saved.saved and saved.saved_entry == f"gnulinux-simple-{U}"
    assert decide(K131, kernels, frozenset({K91}), saved).pin == Pin(K91, K131, ENTRY91, SAVED)
    # saved set in a drop-in of the operator's counts as theirs too
    assert read_grub(_grub(tmp_path / "saved-d", drop_ins={"50-site.cfg": "GRUB_DEFAULT=saved\n"})).saved
    # an operator's drop-in read after gpuprov's sets GRUB_DEFAULT: it would win, so none is written
    later = read_grub(_grub(tmp_path / "later", drop_ins={"zz-site.cfg": "GRUB_DEFAULT=2\n"}))
    fb = decide(K131, kernels, frozenset({K91}), later)
    assert fb.pin is None and "/etc/default/grub.d/zz-site.cfg sets GRUB_DEFAULT" in fb.why
    # no GRUB: never touched, and the plan says so
    fb = decide(K131, kernels, frozenset({K91}), None)
    assert fb.pin is None and fb.why.startswith("no GRUB configured by grub-mkconfig on this host")
    # nothing to decide: the kernel has its module; no kernel has one (a first install)
    assert decide(K131, kernels, frozenset({K91, K131}), grub) is None
    assert decide(K131, kernels, frozenset(), grub) is None
    # the newest kernel with a module is chosen
    assert decide("5.15.0-140-generic", [K91, K131, "5.15.0-140-generic"], frozenset({K91, K131}),
                  grub).pin.kernel == K131


# ---------------------------------------------------------------- the plan


def test_abi_bump_plan_names_the_fallback_before_the_first_change(tmp_path):
    root = _grub(ubuntu_node(tmp_path))
    step = plan(root, driver="570")["driver.packages"]
    install = next(a for a in step.actions if isinstance(a, FallbackInstall))
    assert install.kernels == (K131,) and install.fallback == KeepBootDefault(Pin(K91, K131, ENTRY91, DROP_IN))
    note = next(n for n in step.notes if n.startswith("if DKMS cannot build"))
    assert note == (f"if DKMS cannot build for {K131}: the default boot entry stays on {K91} ({BOOT_PIN} sets "
                    "GRUB_DEFAULT; update-grub)"), note
    lines = step.lines()
    assert any(f"still has no nvidia module after a failed build (exit 16), the default boot entry stays on {K91}"
               in ln for ln in lines), lines
    assert "  $ /usr/sbin/update-grub" in lines
    # the failure branch's commands are listed as the step's on_failure (plan --json), after the DKMS rollback's
    assert [c.shell() for c in step.on_failure][-1] == "/usr/sbin/update-grub"
    d = step.to_dict(root)
    assert "/usr/sbin/update-grub" in d["on_failure"] and d["files"] == []


def test_no_grub_the_plan_says_so_and_nothing_is_kept(tmp_path):
    step = plan(ubuntu_node(tmp_path), driver="570")["driver.packages"]
    assert not [a for a in step.actions if isinstance(a, (FallbackInstall, KeepBootDefault))]
    assert any(n.startswith(f"if DKMS cannot build for {K131}: no GRUB configured by grub-mkconfig") for n in
               step.notes), step.notes


def test_first_install_has_no_fallback(tmp_path):
    """No kernel has a module yet: nothing better to boot, no note (the golden plans keep their words)."""
    root = _grub(ubuntu_node(tmp_path))
    for p in root.glob("lib/modules/*/kernel/nvidia-570srv-open"):
        shutil.rmtree(p)
    steps = plan(root, driver="570")
    assert not any("DKMS cannot build" in n for s in steps.values() for n in s.notes)


def _pinned(root: Path) -> Path:
    """The node after a failed build for K131: gpuprov's drop-in, update-grub's output with it, the record."""
    _grub(root, "ubuntu-jammy-pinned-grub.cfg")
    (root / BOOT_PIN.lstrip("/")).write_text(pin_text(Pin(K91, K131, ENTRY91, DROP_IN)))
    return root


def test_a_pinned_node_is_planned_for_the_kernel_that_would_boot_without_the_pin(tmp_path):
    root = _pinned(ubuntu_node(tmp_path / "a"))
    assert next_boot_kernel(root)[0] == K91  # GRUB's default now
    assert read_pin(root) == (K91, K131)
    assert unpinned_next_kernel(root, True) == K131 and boot_kernel(root) == K131
    steps = plan(root, driver="570")
    # the build for K131 is tried again (with its fallback), and the entry is given back if it works
    assert isinstance(steps["driver.packages"].actions[-2], FallbackInstall)
    rel = steps["driver.boot-default"]
    assert rel.title == (f"Give the default boot entry back to the distribution once kernel {K131} has its nvidia "
                         f"module (gpuprov keeps it on {K91}: {BOOT_PIN})"), rel.title
    assert [c.shell() for c in rel.commands] == [f"rm -f -- {BOOT_PIN}", "/usr/sbin/update-grub"]
    assert not rel.satisfied(root)  # this plan builds for K131
    assert list(steps)[-1] == "driver.boot-default"


def test_module_there_the_pin_goes_even_when_the_driver_is_left_alone(tmp_path):
    root = _pinned(ubuntu_node(tmp_path, boot_module="updates/dkms/nvidia.ko", dkms=True))
    steps = plan(root, driver="570")
    assert list(steps) == ["driver.present", "driver.boot-default"], list(steps)
    assert not steps["driver.boot-default"].satisfied(root)
    (root / BOOT_PIN.lstrip("/")).unlink()
    assert list(plan(root, driver="570")) == ["driver.present"]


def test_canonicals_modules_published_the_release_is_planned(tmp_path):
    """The failed build's rollback left the precompiled series; Canonical publishes 5.15.0-131's modules: the plan
    installs them and, in the same run, gives the entry back (said before the first change: would change)."""
    root = _pinned(ubuntu_node(tmp_path, abis=(K91, K131), meta_for=K131))
    steps = plan(root, driver="570")
    assert any(f"linux-modules-nvidia-570-server-open-{K131}" in ln for ln in steps["driver.packages"].lines())
    assert not [a for a in steps["driver.packages"].actions if isinstance(a, FallbackInstall)]  # no DKMS build
    assert not steps["driver.boot-default"].satisfied(root)


def test_pin_held_while_nothing_builds_for_it(tmp_path):
    """The release step's check: satisfied while K131 has no module and the plan builds none for it."""
    from provision.plan.boot_default import PinReleased
    root = _pinned(ubuntu_node(tmp_path))
    assert PinReleased(()).satisfied(root) and not PinReleased((K131,)).satisfied(root)


# ---------------------------------------------------------------- verify, the record, uninstall


class Host(NodeHost):
    def __init__(self, files: dict[str, str]):
        self.files = files

    def run(self, argv):
        if argv[0] == "cat" and argv[1] in self.files:
            return 0, self.files[argv[1]], ""
        return 1, "", "No such file or directory"


def test_verify_warns_of_the_kept_entry():
    r = boot_default(Host({BOOT_PIN: pin_text(Pin(K91, K131, ENTRY91, DROP_IN))}))
    assert r.status == "warn" and r.detail.startswith(f"kept on {K91} by gpuprov ({BOOT_PIN} sets GRUB_DEFAULT): "
                                                      f"kernel {K131} has no NVIDIA module"), r.detail
    assert "gpuprov bootstrap" in r.detail
    rec = record.Record(boot={"method": SAVED, "kernel": K91, "unserved": K131, "entry": ENTRY91,
                              "saved_before": None})
    r = boot_default(Host({record.paths.INSTALL_RECORD: rec.to_json()}))
    assert r.status == "warn" and "grub-set-default" in r.detail
    assert boot_default(Host({BOOT_PIN: "GRUB_DEFAULT=2\n"})).status == "skip"  # an operator's file of that name
    assert boot_default(Host({})).status == "skip"


def test_record_keeps_the_pin_typed():
    rec = record.Record(boot={"method": DROP_IN, "kernel": K91, "unserved": K131, "entry": ENTRY91,
                              "saved_before": None, "file": BOOT_PIN})
    assert record.Record.from_json(rec.to_json(), "r").boot == rec.boot
    assert "boot" not in json.loads(record.Record().to_json())  # records without one read back the same
    bad = json.loads(rec.to_json())
    bad["boot"]["method"] = "edit"
    with pytest.raises(record.RecordInvalid, match="boot.method"):
        record.Record.from_json(json.dumps(bad), "r")


def test_uninstall_gives_the_entry_back(tmp_path):
    root = _pinned(ubuntu_node(tmp_path))
    steps = [s for s in uninstall.uninstall_steps(root, uninstall.UninstallOptions(), record.Record())
             if s.id == "uninstall.boot-default"]
    assert [c.shell() for c in steps[0].commands] == [f"rm -f -- {BOOT_PIN}", "/usr/sbin/update-grub"]
    assert not steps[0].satisfied(root)
    saved = record.Record(boot={"method": SAVED, "kernel": K91, "unserved": K131, "entry": ENTRY91,
                                "saved_before": f"gnulinux-simple-{U}"})
    (root / BOOT_PIN.lstrip("/")).unlink()
    (root / "var/lib/gpuprov").mkdir(parents=True, exist_ok=True)
    step = uninstall.boot_default.release_step(root, saved.boot, uninstall=True)
    assert [c.shell() for c in step.commands] == [f"grub-set-default gnulinux-simple-{U}"]


def test_failed_build_keeps_the_entry_and_says_so(tmp_path, monkeypatch):
    """FallbackInstall after its DriverInstall's failure (rolled back, exit 16): the failure recorded, the pin
    applied, the message names where the node boots; exit 16 kept. A kernel that has its module after all: the
    failure as it was. (Files and commands stubbed here: the real ones run in test_ubuntu_day_two.py.)"""
    from provision.errors import DKMS_FAILED, DkmsBuildFailed
    from provision.plan import boot_default as bd
    from provision.plan.dkms import DriverInstall

    def failed(self):
        raise DkmsBuildFailed(f"DKMS could not build nvidia-dkms-570-server-open for kernel {K131}: no compiler "
                              "error found. Rolled back")
    monkeypatch.setattr(DriverInstall, "execute", failed)
    written, pinned = {}, []
    monkeypatch.setattr(bd, "write_file", lambda path, text, **kw: written.__setitem__(path, text))
    monkeypatch.setattr(bd, "apply_pin", pinned.append)
    monkeypatch.setattr(bd, "nvidia_module", lambda root, k: None)
    pin = Pin(K91, K131, ENTRY91, DROP_IN)
    act = FallbackInstall(("nvidia-headless-570-server-open",), (K131,), "nvidia-dkms-570-server-open", (), "ways",
                          fallback=KeepBootDefault(pin))
    with pytest.raises(DkmsBuildFailed) as exc:
        act.execute()
    assert exc.value.exit_code == DKMS_FAILED and pinned == [pin]
    assert str(exc.value).endswith(f"; the default boot entry stays on {K91} until {K131} has an nvidia module "
                                   f"({BOOT_PIN}; `gpuprov verify` says so, and the next bootstrap that gives it one "
                                   "moves it back)"), exc.value
    assert list(written) == [f"{record.paths.DKMS_FAILED}/{K131}"]
    monkeypatch.setattr(bd, "nvidia_module", lambda root, k: "/lib/modules/x/nvidia.ko")
    with pytest.raises(DkmsBuildFailed) as exc:
        act.execute()
    assert str(exc.value).endswith("Rolled back") and len(pinned) == 1


def test_debian_the_same_with_grub_set_default(tmp_path):
    """Debian 12 (the same GRUB, the operator's GRUB_DEFAULT=saved): a kernel update whose module did not build, the
    series' build for it planned; if it fails, grub-set-default keeps 6.1.0-50's entry. Debian's grub.cfg fixture
    (grub-mkconfig's, two kernels) with its kernel releases renamed to these."""
    from tests.unit.test_driver_follows_branch import NEW, OLD
    from tests.unit.test_kernel_update_safe import OURS, _steps, _unserved_host
    root = _unserved_host(tmp_path, OURS)
    cfg = (BOOT / "debian-grub.cfg").read_text().replace("6.1.0-28-amd64", NEW).replace("6.1.0-27-amd64", OLD)
    _grub(root, "debian-grub.cfg", defaults="GRUB_DEFAULT=saved\n")
    (root / "boot/grub/grub.cfg").write_text(cfg)
    du = "6d2c1a9e-5b1e-4b8e-9d1a-3f5d2e7c8a10"
    step = _steps(root)["driver.packages"]
    keep = next(a for a in step.actions if isinstance(a, KeepBootDefault))
    entry = f"gnulinux-advanced-{du}>gnulinux-{OLD}-advanced-{du}"
    assert keep.pin == Pin(OLD, NEW, entry, SAVED)
    assert [c.shell() for c in step.on_failure][-1] == f"grub-set-default '{entry}'"
    assert f"if DKMS cannot build for {NEW}: the default boot entry stays on {OLD} (grub-set-default, as " \
           "GRUB_DEFAULT=saved asks)" in step.notes
