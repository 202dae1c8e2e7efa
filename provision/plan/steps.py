"""A step: what it will run or write (for plan/dry-run), how to tell it is already done, and how to do it."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from provision import effects
from provision.fsutil import atomic_write_text


@dataclass
class Step:
    id: str  # stable identifier: "driver.packages", "engine.config"
    title: str
    commands: list[list[str]] = field(default_factory=list)  # what apply runs, in order (shown by plan)
    files: dict[str, str] = field(default_factory=dict)  # path -> new content (shown as diffs by plan)
    check: Optional[Callable[[], bool]] = None  # True = already satisfied (nothing to do)
    action: Optional[Callable[[], str | None]] = None  # custom apply; default: write files, run commands
    verify_only: bool = False  # a check that changes nothing (validation): never counted as a change
    reboot: bool = False  # doing this step requires a reboot afterwards
    notes: list[str] = field(default_factory=list)
    preview: Optional[Callable[[], str]] = None  # a diff computed on the live host (check mode), when files won't say

    def satisfied(self) -> bool:
        return bool(self.check and self.check())

    def apply(self) -> str | None:
        if self.action:
            return self.action()
        for path, text in self.files.items():
            atomic_write_text(Path(path), text, mode=0o644)
        for argv in self.commands:
            effects.run(argv, timeout=3600)
        return None

    def to_dict(self, diffs: bool = True) -> dict:
        d = {"id": self.id, "title": self.title, "commands": [" ".join(c) for c in self.commands],
             "files": sorted(self.files), "reboot": self.reboot, "verify_only": self.verify_only,
             "notes": self.notes}
        if diffs:
            d["diffs"] = {p: effects.unified_diff(read_or_empty(p), t, p) for p, t in self.files.items()}
        return d


def read_or_empty(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def files_match(files: dict[str, str]) -> bool:
    return all(read_or_empty(p) == t for p, t in files.items())


def packages_installed(pm: str, packages: tuple[str, ...]) -> bool:
    """All packages installed (dpkg/rpm database; one fast query)."""
    if not packages:
        return True
    if pm == "apt":
        argv = ["dpkg-query", "-W", "-f", "${Package} ${Status}\n", *packages]
    else:
        argv = ["rpm", "-q", "--whatprovides", *[p.split(":")[0] for p in packages]]
    try:
        p = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        return False
    if pm == "apt":
        ok = {ln.split()[0] for ln in p.stdout.splitlines() if ln.endswith("install ok installed")}
        return all(pkg in ok for pkg in packages)
    return p.returncode == 0
