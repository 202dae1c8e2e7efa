"""bootstrap across the driver's reboot: the state a run that needs one records, and the one resume path that reads
it. `pending(root)` decides what the next bootstrap does first (read only: `--dry-run` and `--check` say it);
`resume()` is a real run doing it on this host: wait for the reboot (exit 7), record the resume, then verify the
driver from this host's typed facts (exit 15 without an NVIDIA device to verify it on)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from provision import effects, paths
from provision.errors import NoDeviceToVerify, RebootRequired, StepFailed, UntrustedPath
from provision.facts.driver_facts import DriverFacts, read_driver
from provision.facts.pci import scan_display_devices
from provision.facts.rootfs import read_text, under
from provision.fsutil import read_trusted, write_file
from provision.plan.steps import Step
from provision.verify.checks import coherent_result, loaded_result

LIVE = Path("/")
STATE_FILE = Path(paths.STATE_FILE)
BOOT_MARKER = Path(paths.REBOOT_MARKER)
DEFAULT_REASON = "driver installed / nouveau blacklisted"


@dataclass(frozen=True)
class RebootState:
    """bootstrap's state file (paths.STATE_FILE), as JSON with these keys: a reboot asked for (its reason, the boot
    it was asked in), or a resume done after it."""
    reboot_required: bool = False
    boot_id: str = ""
    reason: str = ""
    resumed_after_reboot: bool = False

    @classmethod
    def from_json(cls, text: str) -> RebootState:
        """The state in `text`; an unreadable or foreign document is no state (bootstrap starts from the beginning)."""
        try:
            doc = json.loads(text)
        except ValueError:
            return cls()
        if not isinstance(doc, dict):
            return cls()
        kinds = {"reboot_required": bool, "boot_id": str, "reason": str, "resumed_after_reboot": bool}
        return cls(**{k: doc[k] for k, kind in kinds.items() if isinstance(doc.get(k), kind)})

    def to_json(self) -> str:
        doc = dataclasses.asdict(self)
        if not self.resumed_after_reboot:  # the keys a run that asks for a reboot has always written
            doc.pop("resumed_after_reboot")
        return json.dumps(doc, indent=2) + "\n"


def boot_id(root: Path = LIVE) -> str:
    return (read_text(root, "/proc/sys/kernel/random/boot_id") or "").strip()


def read_state(root: Path = LIVE) -> RebootState:
    """The reboot state of the host under `root` (no state when there is none, or it is unreadable). On this host,
    only a state nobody but root could have written is used (fsutil.open_trusted): another is refused, exit 6."""
    try:
        if root == LIVE:
            text = (read_trusted(STATE_FILE) or b"{}").decode()
        else:
            text = read_text(root, str(STATE_FILE)) or "{}"
    except UntrustedPath as exc:
        raise UntrustedPath(f"bootstrap's state: {exc}; remove it (bootstrap then starts from the beginning)") \
            from None
    except (OSError, ValueError):
        return RebootState()
    return RebootState.from_json(text)


def write_state(state: RebootState) -> None:
    write_file(STATE_FILE, state.to_json(), mode=0o644, keep_mode=False, backup=False)


def reason_of(steps: list[Step], changed: set[str]) -> str:
    """Why the host must reboot: the reasons of the steps that changed it and need one, in plan order."""
    return "; ".join(s.reboot_reason for s in steps if s.reboot and s.reboot_reason and s.id in changed) \
        or DEFAULT_REASON


def reboot_pending(reason: str) -> RebootState:
    """Record that a reboot is pending, with a marker in /run (a tmpfs every boot starts empty): a container host's
    restart keeps the kernel's boot_id, so the marker is what tells that one rebooted."""
    try:  # its directory is made 0755 by write_file, whatever the umask
        write_file(BOOT_MARKER, reason + "\n", keep_mode=False, backup=False, durable=False)  # /run: gone at boot
    except OSError:
        pass
    state = RebootState(reboot_required=True, boot_id=boot_id(), reason=reason)
    write_state(state)
    return state


def rebooted_since(state: RebootState, root: Path = LIVE) -> bool:
    """Whether the host under `root` rebooted since `state` was written (reads only)."""
    return state.boot_id != boot_id(root) or not under(root, str(BOOT_MARKER)).exists()


@dataclass(frozen=True)
class Resume:
    """What a bootstrap does first on a host whose last run asked for a reboot (`--dry-run` and `--check` say it,
    the real run does it)."""
    reason: str
    rebooted: bool
    device: bool  # an NVIDIA device is there to verify the driver on
    state: RebootState
    driver: bool = True  # the run plans the driver's steps (it verifies the driver after the reboot)

    @property
    def bootstrap(self) -> str:
        """What `gpuprov bootstrap` would do, in a sentence."""
        if not self.rebooted:
            return (f"a reboot is still pending ({self.reason}): bootstrap stops before this plan (exit 7) until "
                    "the host has rebooted")
        first = f"the host rebooted since ({self.reason}): bootstrap first records the resume in {STATE_FILE}"
        if not self.device and not self.driver:
            return f"{first} and applies this plan (no NVIDIA device to verify the driver on; it plans no driver step)"
        if not self.device:
            return f"{first}, then stops: no NVIDIA device to verify the driver on (exit 15)"
        return (f"{first} and verifies the driver (module loaded, versions coherent, `nvidia-smi -L`), then applies "
                "this plan")

    def to_dict(self) -> dict:
        return {"reason": self.reason, "rebooted": self.rebooted, "bootstrap": self.bootstrap}


def pending(root: Path = LIVE, driver: bool = True) -> Resume | None:
    """The resume the next bootstrap on the host under `root` does first; None when no reboot was asked for.
    `driver`: the run plans the driver's steps."""
    state = read_state(root)
    if not state.reboot_required:
        return None
    rebooted = rebooted_since(state, root)
    device = rebooted and any(d.is_nvidia for d in scan_display_devices(root))
    return Resume(state.reason or "no reason recorded", rebooted, device, state, driver)


def resume(driver: bool = True) -> None:
    """A real bootstrap on this host whose last run asked for a reboot: refuse until the host rebooted, then record
    the resume and check the driver it installed. `driver=False` (a run that plans no driver step: `--driver skip`,
    `--only` without the driver): no NVIDIA device to verify it on is no reason to stop that run (exit 15 is for
    the run that would verify the driver); its steps go on."""
    r = pending(LIVE, driver)
    if r is None:
        return
    if not r.rebooted:
        raise RebootRequired(f"a reboot is still pending ({r.reason}): reboot, then run gpuprov bootstrap again")
    write_state(dataclasses.replace(r.state, reboot_required=False, resumed_after_reboot=True))
    if not r.device and not driver:
        return
    if not r.device:
        raise NoDeviceToVerify(f"resumed after the reboot ({r.reason}): the driver is installed, but this host has no "
                               "NVIDIA device to load and verify it on; boot the image on a GPU node and run "
                               "`gpuprov bootstrap` (or `gpuprov verify`) there")
    verify_driver(read_driver(LIVE))


def verify_driver(drv: DriverFacts | None) -> None:
    """After the reboot, on a host with an NVIDIA device: the module loaded, at the userspace's version, and
    `nvidia-smi -L` answering (StepFailed otherwise)."""
    version = drv.version if drv else None
    for r in (loaded_result(True, bool(drv and drv.loaded), version, drv.kernel_module if drv else None),
              coherent_result(True, version, drv.userspace_version if drv else None)):
        if r.status == "fail":
            raise StepFailed(f"after the reboot: {r.name}: {r.detail}")
    root = (drv.driver_root if drv else None) or "/"
    effects.run([effects.which("nvidia-smi") or f"{root.rstrip('/')}/bin/nvidia-smi", "-L"])
