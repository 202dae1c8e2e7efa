"""What the archive will offer the driver once the plan's source edits are made, asked at plan time.

On Debian the driver stage enables contrib and non-free in the host's existing apt entries (driver.components). Until
then the host's lists cannot show what a suite carries in those components: a security entry the operator added as
`bookworm-security main` hides that bookworm-security updates nvidia-kernel-dkms (535.309.01) and not
nvidia-open-kernel-dkms (535.261.03), which decides the module flavour (decide/debian.py: upkeep). So the plan asks
the archive itself: the entries as the components step will write them (`component_writes`, the one source of those
edits), refreshed by apt into a private directory seeded with the host's lists (hard links: only what is new is
fetched: the preflight's scratch configuration, package_managers' scratch_setup), the host's own lists, cache and
sources untouched and no update hook run. Live hosts only; where the
refresh cannot run or fetch (no network, no apt), the host's lists are read as they are.
"""
from __future__ import annotations

import os
import tempfile
from functools import lru_cache
from pathlib import Path

from provision import effects, package_managers
from provision.decide.packages import debian_components
from provision.decide.targets import Target
from provision.errors import StepFailed
from provision.facts.packages import suite_versions
from provision.facts.rootfs import is_live, read_text_file
from provision.plan.sources import components_present, enable_components
from provision.plan.steps import WriteFile

PREVIEW_TIMEOUT = 120.0  # seconds: a slow mirror costs the plan this much at most, then the host's lists decide


def source_files(root: Path) -> list[Path]:
    """The host's apt source files, in apt's order: sources.list, then sources.list.d's .sources and .list."""
    lists = root / "etc/apt/sources.list.d"
    return [root / "etc/apt/sources.list", *sorted(lists.glob("*.sources")), *sorted(lists.glob("*.list"))]


def component_writes(root: Path, target: Target) -> list[WriteFile]:
    """The driver components (contrib, non-free …) added to the host's existing apt entries that lack them, as the
    driver.components step writes them: one WriteFile per file that changes. A component is added only where no
    entry of the same source has it, in any of the host's files (plan/sources.py: components_present)."""
    comps = debian_components(target)
    texts: list[tuple[Path, str]] = []
    for p in source_files(root):
        try:
            texts.append((p, read_text_file(p)))
        except OSError:  # missing, or not a regular file (a FIFO never hangs the plan): nothing to edit there
            continue
    present = components_present([t for _, t in texts])
    writes = []
    for p, old in texts:
        new = enable_components(old, comps, target.codename, present)
        if new != old:
            writes.append(WriteFile("/" + str(p.relative_to(root)), new))
    return writes


def driver_origins(root: Path, target: Target, names: tuple[str, ...]) -> dict[str, dict[str, frozenset[str]]]:
    """Per package of `names`: the upstream versions each suite offers (facts.packages.suite_versions), from the
    lists as they will be after the components step: a private refresh where that step changes an entry (live
    hosts), else the host's lists."""
    if target.family == "debian" and is_live(root) and component_writes(root, target):
        previewed = _preview(str(root), target, names)
        if previewed is not None:
            return previewed
    return suite_versions(root, names)


@lru_cache(maxsize=4)
def _preview(root: str, target: Target, names: tuple[str, ...]) -> dict[str, dict[str, frozenset[str]]] | None:
    """The private refresh (once per process: a plan decides twice where gpuprov's series is installed), in the
    package manager's scratch configuration (the preflight's: sources, preferences, lists hard-linked, cache, fetch
    timeouts), with the components step's edits written into its sources and no update hook run. None when it
    cannot run."""
    pm = package_managers.get(target.package_manager)
    with tempfile.TemporaryDirectory(prefix="gpuprov-archive-preview-") as tmp:
        scratch = Path(tmp)
        try:
            setup = pm.scratch_setup(scratch)
            refresh = pm.scratch_refresh(scratch)
            if setup is None or refresh is None:
                return None
            for w in component_writes(Path(root), target):
                dest = pm.scratch_file(scratch, w.path)
                if dest is not None:
                    dest.write_text(w.content)
            try:
                main = read_text_file(Path(root) / "etc/apt/apt.conf")
            except OSError:
                main = ""
            for path, content in pm.preview_config(scratch, main):
                Path(path).write_text(content)
            env = {**os.environ, **dict(pm.env), "APT_CONFIG": str(scratch / "apt.conf")}
            effects.run([refresh[0], *setup[0], *refresh[1:]], check=False, env=env, timeout=PREVIEW_TIMEOUT,
                        probe=True)
            return suite_versions(Path("/"), names, lists=str(scratch / "lists"))
        except (OSError, StepFailed):
            return None
