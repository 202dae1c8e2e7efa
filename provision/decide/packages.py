"""Which packages a host gets, per distro family: the archive components the driver's packages come from (the
driver's own names: provision.decide.driver; an engine's: its adapter, provision/engines). Pure: plan and bundle both
decide from here."""
from __future__ import annotations

from provision.decide.targets import Target


def debian_components(target: Target) -> tuple[str, ...]:
    if target.os_id == "ubuntu":
        return ("restricted", "multiverse")
    return ("contrib", "non-free") + (("non-free-firmware",) if int(target.version) >= 12 else ())
