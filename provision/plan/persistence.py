"""nvidia-persistenced with the driver on data-centre GPUs (issue 26 item 6).

NVIDIA recommends persistence mode on every data-centre GPU: without a process holding the device open, the driver
tears the GPU's state down when the last client exits and rebuilds it at the next, which makes container starts slow
or time out. Distributions ship the daemon as a Recommends of their driver package, which gpuprov's
`--no-install-recommends` leaves out. So with the driver it installs, bootstrap installs the distribution's
`nvidia-persistenced` (where the driver package does not carry it already) and enables its unit;
`--no-persistence` (role: `gpuprov_persistence: false`) leaves both out. The enable is kept in the install record
only when gpuprov made it (its enable step ran, or its package step installed the package, whose Debian postinst
enables the unit: seen on bookworm, nvidia-persistenced 535.171.04-1~deb12u1), and `uninstall` disables the unit
only then (plan/uninstall.py)."""
from __future__ import annotations

from provision.decide.driver import default_source, is_datacenter
from provision.decide.gputable import parse_pci_id, table_entry
from provision.decide.targets import Target
from provision.options import Stage
from provision.plan.packages import package_step
from provision.plan.steps import Command, PathExists, Step

UNIT = "nvidia-persistenced.service"
STEP = "driver.persistence"
PACKAGE_STEP = f"{STEP}.package"
# the unit's [Install] WantedBy= in Debian's, Ubuntu's and NVIDIA's packages: the link `systemctl enable` makes
WANTS = f"/etc/systemd/system/multi-user.target.wants/{UNIT}"


def package(target: Target, driver_source: str) -> tuple[str, ...]:
    """The package that carries the daemon, where the driver's packages do not: Ubuntu's nvidia-headless-B-server
    pulls in nvidia-compute-utils-B-server, which has it; ELRepo's nvidia-x11-drv has it. Debian and NVIDIA's own
    repositories package it apart (Debian: a Recommends of nvidia-driver)."""
    source = default_source(target) if driver_source == "distro" else driver_source  # `distro` on EL is ELRepo
    if target.os_id == "ubuntu" or source == "elrepo":
        return ()
    return ("nvidia-persistenced",)


def datacenter(gpus) -> bool:
    return any(is_datacenter(d.name, table_entry(parse_pci_id(d.pci_id).device)) for d in gpus)


def persistence_steps(driver_steps: list[Step], gpus, target: Target, opt, systemd: bool) -> list[Step]:
    """With a driver gpuprov installs (a `driver.packages` step) on a host with a data-centre GPU: the daemon's
    package, then its unit enabled (started now where it can be: before the reboot a new driver needs, it fails to
    start, which is no failure of the step)."""
    if not opt.persistence or not any(s.id == "driver.packages" for s in driver_steps) or not datacenter(gpus):
        return []
    steps = []
    pkgs = package(target, opt.driver_source)
    if pkgs:
        steps.append(package_step(PACKAGE_STEP, Stage.DRIVER, "Install nvidia-persistenced (data-centre GPU: "
                                  "persistence mode, as NVIDIA recommends; --no-persistence leaves it out)", target,
                                  pkgs, bundle=opt.bundle, allow_remove=opt.allow_remove))
    if systemd:
        steps.append(Step(STEP, Stage.DRIVER, f"Enable {UNIT} at boot and start it (it starts once the driver is "
                          "loaded)", actions=(Command(("systemctl", "enable", UNIT)),
                                              Command(("systemctl", "start", UNIT), may_fail=True)),
                          check=PathExists(WANTS)))
    return steps
