"""A host report: all of a host's facts, read through one root (provision.facts, read-only), plus the driver decision
for each GPU found (provision.decide, pure). It sits above both layers, so facts never import decisions."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, NamedTuple

from provision.decide.debian import debian_driver_packages
from provision.decide.driver import FleetDecision, GpuDecision, decide_fleet, decide_gpu
from provision.decide.gputable import PciId, parse_pci_id
from provision.decide.targets import Target, target_for
from provision.errors import HostUnreadable, Unsupported
from provision.facts.distro_facts import DistroFacts, read_distro
from provision.facts.driver_facts import DriverFacts, read_driver
from provision.facts.engines import EngineFacts, read_engines
from provision.facts.packages import fetched_suites, suite_versions
from provision.facts.pci import PciDisplayDevice, scan_pci

SCHEMA = "gpuprov.detect/v1"


class HostReport(NamedTuple):
    """What detect found on a host and what it decided for each GPU (a frozen value: plan and verify read it)."""
    root: str
    distro: DistroFacts | None
    target: Target | None
    gpus: list[tuple[PciDisplayDevice | None, GpuDecision]]
    other_display: list[PciDisplayDevice]
    driver: DriverFacts | None
    engines: list[EngineFacts]
    fleet: FleetDecision | None
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        gpus = []
        for dev, dec in self.gpus:
            g = dec.to_dict()
            if dev is not None:
                g.update(address=dev.address, pci_class=dev.to_dict()["pci_class"], bound_driver=dev.driver,
                         numa_node=dev.numa_node)
            gpus.append(g)
        return {
            "schema": SCHEMA,
            "root": self.root,
            "distro": self.distro.to_dict() if self.distro else None,
            "target": self.target.name if self.target else None,
            "gpus": gpus,
            "other_display_devices": [d.to_dict() for d in self.other_display],
            "driver": self.driver.to_dict() if self.driver else None,
            "engines": [e.to_dict() for e in self.engines],
            "fleet": self.fleet.to_dict() if self.fleet else None,
            "warnings": [*self.warnings, *(w for _, d in self.gpus for w in d.warnings)],
        }


def host_target(distro: DistroFacts) -> tuple[Target | None, list[str]]:
    """The release gpuprov decides packages for on this host, or None and why not."""
    try:
        return target_for(distro.id, distro.major, distro.like), []
    except Unsupported as exc:
        return None, [str(exc)]


def detect_host(root: Path, *, target: Target | None = None, kernel_modules: str = "auto",
                source: str | None = None, engines: bool = True, pin: str | None = None,
                for_gpus: tuple[str, ...] = (),
                preview: Callable[[Path, Target, tuple[str, ...]], Mapping] | None = None) -> HostReport:
    """pin: a driver branch asked for (--driver 535); for_gpus: PCI ids to decide for instead of the devices
    found (image baking: the GPUs the image will meet, none of them here); preview: what reads the driver packages'
    origins from the apt lists as the plan's source edits will make them (plan/archive_preview.driver_origins),
    instead of the lists as they are."""
    distro = read_distro(root)
    warnings: list[str] = []
    if target is None:
        target, why = host_target(distro)
        warnings += why
    scan = scan_pci(root)
    devices = scan.devices
    warnings += scan.warnings
    nvidia = [d for d in devices if d.is_nvidia]
    # What the apt lists offer, and from which suite, for Debian's choice of module flavour; read only where there is
    # a GPU to decide for. `preview` (a plan's): the lists as the driver stage's source edits will make them.
    origins = None
    if (nvidia or for_gpus) and target and target.os_id == "debian" and (source or "debian") == "debian":
        names = debian_driver_packages(target.codename)
        origins = preview(root, target, names) if preview else suite_versions(root, names)
    offered = None if origins is None else \
        {n: frozenset().union(*by.values()) for n, by in origins.items()}
    # and whether apt fetched its security suite: where the lists cannot tell yet, that decides the flavour
    security = (f"{target.codename}-security" if offered is not None
                and f"{target.codename}-security" in fetched_suites(root) else None)
    gpus = []
    for dev in nvidia:
        pci = PciId(dev.vendor_id, dev.device_id, dev.subsystem_vendor_id, dev.subsystem_device_id)
        gpus.append((dev, decide_gpu(pci, target, kernel_modules=kernel_modules, source=source, address=dev.address,
                                     pin=pin, offered=offered, security=security, origins=origins)))
    if for_gpus:
        gpus = [(None, decide_gpu(parse_pci_id(p), target, kernel_modules=kernel_modules, source=source, pin=pin,
                                  offered=offered, security=security, origins=origins)) for p in for_gpus]
    return HostReport(
        root=str(root), distro=distro, target=target, gpus=gpus,
        other_display=[d for d in devices if not d.is_nvidia], driver=read_driver(root),
        engines=read_engines(root) if engines else [], fleet=decide_fleet([d for _, d in gpus]), warnings=tuple(warnings),
    )


def detect_ids(ids: list[PciId], target: Target | None, *, kernel_modules: str = "auto",
               source: str | None = None, root: Path | None = None) -> HostReport:
    """Decide for PCI ids, none scanned: for `target`, else the release under `root` (the host's own, as detect's
    --target help says), else for no release (a warning says why)."""
    warnings: list[str] = []
    if target is None and root is not None:
        try:
            target, warnings = host_target(read_distro(root))
        except HostUnreadable as exc:
            warnings = [str(exc)]
    decisions = [decide_gpu(p, target, kernel_modules=kernel_modules, source=source) for p in ids]
    return HostReport(root="", distro=None, target=target, gpus=[(None, d) for d in decisions], other_display=[],
                      driver=None, engines=[], fleet=decide_fleet(decisions), warnings=tuple(warnings))
