"""The default boot entry while the kernel that boots next has no NVIDIA module and DKMS cannot build one (issue 43
item 1): GRUB keeps booting the newest installed kernel that has the module, and goes back to the distribution's
default once that kernel has its module.

- Where: Debian and Ubuntu hosts whose GRUB grub-mkconfig configures (/boot/grub/grub.cfg and update-grub). Any other
  host is never touched: the plan says so and the kernel boots as the distribution set it (verify is red for it).
- When: the driver step builds the module for the kernel that would boot next, and another installed kernel has one.
  The driver step's DriverInstall is a `FallbackInstall`: when its build fails (exit 16) and that kernel still has no
  module, the failure is recorded (paths.DKMS_FAILED/KERNEL, as DKMS's kernel hook records one) and the default entry
  is kept (`KeepBootDefault`), then the run stops with exit 16 as before, its message saying where the node boots. The
  plan lists that branch before the first change (its lines, and its commands as the step's `on_failure`).
- How: where the operator's settings say GRUB_DEFAULT=saved, `grub-set-default` with the kernel's menu entry (and
  grubenv's saved_entry before it kept in the record); else a drop-in, /etc/default/grub.d/gpuprov-boot.cfg, setting
  GRUB_DEFAULT to that entry ("gnulinux-advanced-<uuid>>gnulinux-<kernel>-advanced-<uuid>", read from grub.cfg), then
  update-grub. /etc/default/grub is never edited; an operator's drop-in read after gpuprov's that sets GRUB_DEFAULT
  wins, so none is written there (the plan says why).
- Release: while a pin is there, the driver stage ends with `driver.boot-default`, which takes it out (the drop-in
  removed and update-grub, or saved_entry given back) once the kernel that would boot next has its module (a DKMS
  build that works, Canonical's precompiled modules); `gpuprov uninstall` takes it out too (plan/uninstall.py).
- The kernel "that would boot next" while gpuprov's pin holds is the one the distribution's hooks point /vmlinuz at
  (facts/boot.py: unpinned_next_kernel): the driver stage keeps planning for it through the pin.
"""
from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

from provision import paths, record
from provision.errors import DkmsBuildFailed, GpuprovError
from provision.facts.boot import (
    BOOT_PIN,
    BOOT_PIN_HEADER,
    GRUB_CFG,
    GRUBENV,
    UPDATE_GRUB,
    GrubSetup,
    entry_path,
    installed_kernels,
    next_boot_kernel,
    nvidia_module,
    read_grub,
    read_pin,
    unpinned_next_kernel,
)
from provision.facts.rootfs import read_text, under
from provision.fsutil import write_file
from provision.options import Stage
from provision.plan.dkms import DriverInstall
from provision.plan.steps import LIVE, Action, Command, Step

DROP_IN, SAVED = record.BOOT_METHODS


@dataclass(frozen=True)
class Pin:
    """The default boot entry kept on `kernel` (the newest installed kernel with an NVIDIA module) while `unserved`
    (the kernel that would boot next) has none."""
    kernel: str
    unserved: str
    entry: str  # its GRUB menu entry, as GRUB_DEFAULT and grub-set-default name it
    method: str  # DROP_IN | SAVED


@dataclass(frozen=True)
class Fallback:
    pin: Pin | None
    why: str  # in words: where the node boots if the build fails


def decide(unserved: str | None, kernels: list[str], with_module: frozenset[str], grub: GrubSetup | None
           ) -> Fallback | None:
    """Where the default boot entry goes if `unserved` (the kernel that would boot next) stays without a module.
    `kernels`: the installed ones, oldest first; `with_module`: those with an NVIDIA module; `grub`: facts/boot.py's
    read_grub (None: no GRUB that grub-mkconfig configures). None: nothing to decide (that kernel has its module, or
    no kernel has one: a first install, where no kernel is better to boot)."""
    if unserved is None or unserved in with_module:
        return None
    served = [k for k in kernels if k in with_module and k != unserved]
    if not served:
        return None
    keep = served[-1]
    if grub is None:
        return Fallback(None, f"no GRUB configured by grub-mkconfig on this host ({GRUB_CFG}, {UPDATE_GRUB}): the "
                        f"default boot entry is left as it is, and {unserved} boots without a module")
    entry = entry_path(grub.menu, keep)
    if entry is None:
        return Fallback(None, f"{GRUB_CFG} has no menu entry for {keep}: the default boot entry is left as it is, "
                        f"and {unserved} boots without a module")
    if grub.saved:
        if not grub.set_default:
            return Fallback(None, f"GRUB_DEFAULT=saved, and grub-set-default is not installed: the default boot "
                            f"entry is left as it is, and {unserved} boots without a module")
        return Fallback(Pin(keep, unserved, entry, SAVED),
                        f"the default boot entry stays on {keep} (grub-set-default, as GRUB_DEFAULT=saved asks)")
    if grub.later:
        return Fallback(None, f"{grub.later} sets GRUB_DEFAULT after any gpuprov drop-in: the default boot entry "
                        f"is left as the operator set it, and {unserved} boots without a module")
    return Fallback(Pin(keep, unserved, entry, DROP_IN),
                    f"the default boot entry stays on {keep} ({BOOT_PIN} sets GRUB_DEFAULT; update-grub)")


def pin_text(pin: Pin) -> str:
    """The drop-in's text: what it is for in words, the line verify and the plan read back, the setting."""
    return (f"{BOOT_PIN_HEADER} (bootstrap's driver step): kernel {pin.unserved} has no nvidia module and DKMS "
            f"could not build one,\n# so the default boot entry stays on {pin.kernel} until it has one. "
            "`gpuprov bootstrap` removes this file (and runs\n# update-grub) once it has; so does `gpuprov "
            f"uninstall`.\n# gpuprov-boot-pin: kernel={pin.kernel} unserved={pin.unserved}\n"
            f"GRUB_DEFAULT={shlex.quote(pin.entry)}\n")


def pin_state(root: Path) -> dict | None:
    """gpuprov's pin on this host: the record's `boot` entry, else its drop-in (a record lost or not written);
    None: no pin."""
    try:
        boot = record.read(str(under(root, paths.INSTALL_RECORD))).boot
    except GpuprovError:
        boot = {}
    if boot:
        return boot
    f = read_pin(root)
    return {"method": DROP_IN, "kernel": f.kernel, "unserved": f.unserved, "entry": "", "saved_before": None,
            "file": BOOT_PIN} if f else None


# ---------------------------------------------------------------- keeping it: after a failed build


def _keep_commands(pin: Pin) -> list[Command]:
    return [Command((UPDATE_GRUB,))] if pin.method == DROP_IN else [Command(("grub-set-default", pin.entry))]


@dataclass(frozen=True)
class KeepBootDefault(Action):
    """Listed after the driver step's FallbackInstall, which runs it when the build failed: nothing on the normal
    path (its commands are the step's `on_failure`)."""
    pin: Pin

    def on_failure(self) -> list[Command]:
        return _keep_commands(self.pin)

    def lines(self) -> list[str]:
        p = self.pin
        how = (f"write {BOOT_PIN} (GRUB_DEFAULT={shlex.quote(p.entry)})" if p.method == DROP_IN else
               f"grubenv's saved_entry kept in gpuprov's record ({paths.INSTALL_RECORD})")
        return [f"  if kernel {p.unserved} still has no nvidia module after a failed build (exit 16), the default "
                f"boot entry stays on {p.kernel}: record the failure in {paths.DKMS_FAILED}/{p.unserved}; {how}",
                *(f"  {ln}" for c in _keep_commands(p) for ln in c.lines())]

    def execute(self) -> str | None:
        return None  # the build worked: nothing to keep

    def keep(self, failure: str) -> str:
        """After the failed build: where the node boots, in words ("" when the kernel has its module after all)."""
        p = self.pin
        if nvidia_module(LIVE, p.unserved):
            return ""
        write_file(f"{paths.DKMS_FAILED}/{p.unserved}", f"gpuprov bootstrap at "
                   f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: {failure.splitlines()[0][:300]}\n",
                   backup=False)
        try:
            apply_pin(p)
        except GpuprovError as exc:
            return f"the default boot entry could not be kept on {p.kernel} ({exc}): {p.unserved} boots without it"
        return (f"the default boot entry stays on {p.kernel} until {p.unserved} has an nvidia module "
                f"({BOOT_PIN if p.method == DROP_IN else 'grub-set-default'}; `gpuprov verify` says so, and the next "
                "bootstrap that gives it one moves it back)")


def apply_pin(pin: Pin) -> None:
    """Keep the default boot entry (idempotent: a re-run finds it kept and runs nothing). The record first: a run
    killed half-way leaves a pin the next bootstrap or uninstall knows of."""
    grub = read_grub(LIVE)
    old = pin_state(LIVE) or {}
    before = old.get("saved_before") if old.get("method") == SAVED else (grub.saved_entry if grub else None)
    record.note_boot({"method": pin.method, "kernel": pin.kernel, "unserved": pin.unserved, "entry": pin.entry,
                      "saved_before": before, **({"file": BOOT_PIN} if pin.method == DROP_IN else {})})
    if pin.method == DROP_IN:
        text = pin_text(pin)
        if read_text(LIVE, BOOT_PIN) != text:
            write_file(BOOT_PIN, text, mode=0o644, backup=False)
    elif grub and grub.saved_entry == pin.entry:
        return
    if pin.method == SAVED or next_boot_kernel(LIVE)[0] != pin.kernel:
        for c in _keep_commands(pin):
            c.execute()


@dataclass(frozen=True)
class FallbackInstall(DriverInstall):
    """DriverInstall whose failed build (exit 16, after its own rollback) keeps the default boot entry on a kernel
    with a module (`fallback`), the failure's message saying so."""
    fallback: KeepBootDefault | None = None

    def execute(self) -> str:
        try:
            return super().execute()
        except DkmsBuildFailed as exc:
            kept = self.fallback.keep(str(exc)) if self.fallback else ""
            if not kept:
                raise
            raise DkmsBuildFailed(f"{exc}; {kept}") from None


# ---------------------------------------------------------------- releasing it


@dataclass(frozen=True)
class ReleaseBootDefault(Action):
    """Take gpuprov's pin out: the drop-in removed and update-grub, or grubenv's saved_entry given back."""
    state: tuple[tuple[str, str | None], ...]  # pin_state's items

    @property
    def boot(self) -> dict:
        return dict(self.state)

    def commands(self) -> list[Command]:
        b = self.boot
        if b.get("method") == SAVED:
            before = b.get("saved_before")
            return [Command(("grub-set-default", before)) if before else
                    Command(("grub-editenv", GRUBENV, "unset", "saved_entry"))]
        return [Command(("rm", "-f", "--", b.get("file") or BOOT_PIN)), Command((UPDATE_GRUB,))]

    def lines(self) -> list[str]:
        return [ln for c in self.commands() for ln in c.lines()]

    def execute(self) -> str:
        for c in self.commands():
            c.execute()
        unserved = self.boot.get("unserved")
        if unserved and nvidia_module(LIVE, unserved):  # the hook's record of it is stale now
            Command(("rm", "-f", "--", f"{paths.DKMS_FAILED}/{unserved}")).execute()
        record.note_boot({})
        return f"the default boot entry is the distribution's again (it was kept on {self.boot.get('kernel')})"


@dataclass(frozen=True)
class PinReleased:
    """Nothing to release: no pin of gpuprov's, or the kernel that would boot next still has no module and this
    plan builds none for it (`building`: the kernels the plan's driver step builds for)."""
    building: tuple[str, ...] = ()

    def satisfied(self, root: Path) -> bool:
        if pin_state(root) is None:
            return True
        k = unpinned_next_kernel(root, True)
        return k is not None and nvidia_module(root, k) is None and k not in self.building

    def describe(self) -> str:
        return ("skipped when gpuprov keeps no default boot entry, or the kernel that would boot next still has no "
                "nvidia module")


def release_step(root: Path, state: dict, building: tuple[str, ...] = (), uninstall: bool = False) -> Step:
    items = tuple((k, state.get(k)) for k in ("method", "kernel", "unserved", "saved_before", "file"))
    how = BOOT_PIN if state.get("method") == DROP_IN else "grub-set-default"
    if uninstall:
        return Step("uninstall.boot-default", Stage.DRIVER, f"Give the default boot entry back to the distribution "
                    f"(gpuprov kept it on {state.get('kernel')}: {how})", actions=(ReleaseBootDefault(items),),
                    check=_Gone(),
                    notes=(f"kernel {state.get('unserved')} boots next again, with or without its nvidia module",))
    return Step("driver.boot-default", Stage.DRIVER, f"Give the default boot entry back to the distribution once "
                f"kernel {state.get('unserved')} has its nvidia module (gpuprov keeps it on {state.get('kernel')}: "
                f"{how})", actions=(ReleaseBootDefault(items),), check=PinReleased(building))


@dataclass(frozen=True)
class _Gone:
    """uninstall: no pin of gpuprov's left."""

    def satisfied(self, root: Path) -> bool:
        return pin_state(root) is None

    def describe(self) -> str:
        return "skipped when gpuprov keeps no default boot entry"


# ---------------------------------------------------------------- the driver stage's steps


def with_boot_default(root: Path, family: str, steps: list[Step]) -> list[Step]:
    """The driver stage's steps with the default boot entry's fallback on the build for the kernel that would boot
    next (its packages step's DriverInstall a FallbackInstall, the plan's note saying where the node boots if it
    fails) and, while gpuprov keeps the entry, the step that gives it back."""
    if family != "debian" or not steps:
        return steps
    state = pin_state(root)
    kernels = installed_kernels(root)
    unserved = unpinned_next_kernel(root, state is not None)
    with_module = frozenset(k for k in kernels if nvidia_module(root, k))
    fb = decide(unserved, kernels, with_module, read_grub(root) if unserved else None)
    out, building = [], ()
    for s in steps:
        installs = [a for a in s.actions if isinstance(a, DriverInstall)]
        # the kernels the driver step gives a module: DKMS's builds, or Canonical's packages (the move back)
        building += tuple(k for a in installs for k in a.kernels)
        if fb is not None and unserved in (k for a in installs if a.dkms_package for k in a.kernels):
            s = _fallback(s, fb, unserved)
        out.append(s)
    if state is not None:
        out.append(release_step(root, state, building))
    return out


def _fallback(step: Step, fb: Fallback, unserved: str) -> Step:
    note = f"if DKMS cannot build for {unserved}: {fb.why}"
    if fb.pin is None:
        return replace(step, notes=(*step.notes, note))
    keep = KeepBootDefault(fb.pin)
    acts: list[Action] = []
    for a in step.actions:
        if isinstance(a, DriverInstall) and a.dkms_package:
            acts += [FallbackInstall(**{f.name: getattr(a, f.name) for f in fields(a)}, fallback=keep), keep]
        else:
            acts.append(a)
    return replace(step, actions=tuple(acts), notes=(*step.notes, note))


def uninstall_steps(root: Path) -> list[Step]:
    """uninstall: gpuprov's pin of the default boot entry taken out (whatever the kernels' modules)."""
    state = pin_state(root)
    return [release_step(root, state, uninstall=True)] if state else []
