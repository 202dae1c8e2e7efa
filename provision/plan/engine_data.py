"""What `uninstall --purge-engine` does with the engines' data (issue 39 item 1: Debian's docker.io purge deleted an
operator's container, image and volume, exit 0, after a dry run that said only "Purge the engine packages").

Before a purge, the plan counts what each engine it removes keeps under its data root (the adapter's `stored`: from
the live engine, else from its files) and says which package's purge would delete it (`purge_deletes_data`: its
maintainer scripts do). Then, for the packages whose purge deletes a data root:
- nothing said (no --keep-engine-data, no --delete-engine-data): removed, not purged, so the data root stays, while it
  holds nothing of the operator's; once it does, the uninstall stops before any change (exit 14) naming what it holds;
- --keep-engine-data: removed, not purged: the data root stays with everything in it;
- --delete-engine-data: purged, as their scripts do it, deleting the data root (the plan names what goes).
Packages whose purge deletes nothing of an engine's store (containerd's, Podman's, Docker CE's) are purged as asked,
and the plan says the store stays and what it holds. gpuprov's own things (its validation image and what ran from
it) are not the operator's: the adapters leave them out of the count."""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from provision import engines, package_managers
from provision.facts.engine_data import StoredData

KEEP, DELETE = "keep", "delete"
OPTIONS = {KEEP: "--keep-engine-data", DELETE: "--delete-engine-data"}


@dataclass(frozen=True)
class Store:
    """An engine's store that removing `packages` meets: its title, what it holds that is not gpuprov's, and which
    of those packages' purge deletes it."""
    engine: str
    data: StoredData
    packages: tuple[str, ...]
    deleting: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.data.counts()} of yours (counted from {self.data.source})"

    def to_dict(self, deleted: bool) -> dict:
        return {"engine": self.engine, "packages": list(self.packages), "purge_deletes": list(self.deleting),
                "deleted": deleted, **self.data.to_dict()}


def stores(root, packages: tuple[str, ...]) -> tuple[Store, ...]:
    """The stores of the engines whose packages are among `packages`, where there is one under `root`."""
    out = []
    for eng in engines.every():
        mine = tuple(p for p in packages if p in eng.data_packages)
        data = eng.stored(root) if mine and eng.data_root else None
        if data is not None:
            out.append(Store(eng.title, data, mine, tuple(p for p in mine if p in eng.purge_deletes_data)))
    return tuple(out)


@dataclass(frozen=True)
class Decision:
    """What the engine packages' step does with the stores: remove (not purge) the packages, and why it stops
    (the refusal's message; "" when it goes on)."""
    remove: bool
    stop: str
    title: str
    notes: tuple[str, ...]


def decide(stores_: tuple[Store, ...], packages: tuple[str, ...], choice: str, manager: str) -> Decision:
    """Pure: the stores counted while planning, the packages to take away, the operator's choice ("" | keep |
    delete) and the host's package manager -> what the step does and how the plan says it (the title counts, the
    notes and the refusal name)."""
    hit = [s for s in stores_ if s.deleting]
    at_stake = [s for s in hit if not s.data.empty]
    names = " ".join(packages)
    deleting = tuple(p for s in hit for p in s.deleting)
    counted = [f"{s.data.path}: {s.describe()}" for s in at_stake]
    others = [f"{s.data.path} kept ({s.engine}'s packages delete nothing there on purge): {s.describe()}"
              for s in stores_ if not s.deleting and not s.data.empty]

    def held(s: Store) -> str:
        return f"with {s.data.counts(False)} of yours" if not s.data.empty else "nothing of yours in it"

    if at_stake and not choice:
        stop = "; ".join(f"{' '.join(s.deleting)}'s purge would delete {s.data.path}, which holds {s.describe()}"
                         for s in at_stake)
        stop += (f"; nothing was changed: {OPTIONS[KEEP]} removes {names} and keeps them, {OPTIONS[DELETE]} deletes "
                 "them with it")
        what = "; ".join(f"{' '.join(s.deleting)}'s purge would delete {s.data.path}, {held(s)}" for s in at_stake)
        return Decision(True, stop, f"Purge the engine packages gpuprov installed: {names}: stops, nothing changed "
                        f"(exit 14): {what} ({OPTIONS[KEEP]} or {OPTIONS[DELETE]})", tuple(others))
    if hit and choice != DELETE:
        later = shlex.join(package_managers.get(manager).purge(deleting))
        return Decision(True, "", f"Remove the engine packages gpuprov installed: {names} (not purged: "
                        + "; ".join(f"{s.data.path} kept, {held(s)}" for s in hit) + ")",
                        tuple(counted + others + [
                            f"{' '.join(deleting)}'s purge deletes {', '.join(s.data.path for s in hit)}: removed, "
                            f"not purged (`{later}` would delete it later)"
                            + ("" if choice else f"; {OPTIONS[DELETE]} purges now")]))
    gone = "; ".join(f"{s.data.path} deleted, {held(s)}" for s in hit)
    return Decision(False, "", f"Purge the engine packages gpuprov installed: {names}"
                    + (f" ({OPTIONS[DELETE]}: {gone})" if gone else ""), tuple(counted + others))
