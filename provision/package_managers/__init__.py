"""Package managers as adapters (provision/package_managers/base.py): the one registry. `get(name)` answers for
Target.package_manager's value; nothing outside this folder names a package-manager command or branches on a
package manager's name (tests/unit/test_engine_literals.py)."""
from __future__ import annotations

from provision.package_managers.apt import Apt
from provision.package_managers.base import PackageManager
from provision.package_managers.dnf import Dnf, Yum

ADAPTERS: tuple[type[PackageManager], ...] = (Apt, Dnf, Yum)
_BY_NAME = {cls.name: cls() for cls in ADAPTERS}


def names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def get(name: str) -> PackageManager:
    """The adapter for `name` (apt, dnf, yum); KeyError names the ones there are."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no package manager {name!r}: {', '.join(_BY_NAME)}") from None
