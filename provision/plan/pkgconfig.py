"""The package manager's configuration that gpuprov's steps change, watched while they run and taken out again by
`uninstall --purge-driver/--purge-engine` (issue 39 item 2, issue 43 item 3).

While bootstrap runs a driver or engine step, the files of the adapter's `config_globs` (repository files, apt's
sources, keyrings and pins, dnf's versionlock list) and its imported keys (rpm's gpg-pubkey) are read before and
after it; what the step added or changed goes into the install record by stage (record.note_repo_config), whatever
wrote it: gpuprov itself (a sources edit, a .repo file), `dnf config-manager`, a release package's payload
(elrepo-release's elrepo.repo), dnf importing a repository's key on first use.

Uninstall, in the stage's purge step, after the purge (plan/uninstall.py: package_steps): a file the stage added is
removed, with what the package manager leaves of it (`leftover_suffixes`: elrepo.repo.rpmsave once elrepo-release
is purged), unless a package that stays owns it; a file it changed is given back as it was (the operator's later
changes kept: engines/base.py's undo_text), or kept with a note where those changes touch gpuprov's; gpuprov's
backups beside it (`NAME.gpuprov-STAMP.bak`) go; the keys it imported are removed. Only paths of `config_globs` are
acted on, whatever the record says."""
from __future__ import annotations

import fnmatch
import glob
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from provision import package_managers, record
from provision.engines.base import undo_text
from provision.errors import GpuprovError
from provision.facts.distro_facts import read_distro
from provision.facts.rootfs import under
from provision.package_managers.base import PackageManager
from provision.plan.steps import Command, WriteFile

OURS = re.compile(r"(\.gpuprov-\d{14}(-\d+)?\.bak|\.gpuprov-[0-9a-f]{16}\.tmp)$")  # fsutil's backups, staged files
LARGEST = 1 << 20  # a config file larger than this is not read (not one of a package manager's)


def host_manager(root: Path = Path("/")) -> PackageManager | None:
    try:
        return package_managers.get(read_distro(root).package_manager)
    except GpuprovError:
        return None


@dataclass(frozen=True)
class Snapshot:
    files: dict[str, bytes]
    keys: frozenset[str]


def snapshot(pm: PackageManager, root: Path = Path("/")) -> Snapshot:
    files = {}
    for pattern in pm.config_globs:
        for p in glob.glob(str(under(root, pattern))):
            if OURS.search(p) or os.path.islink(p) or not os.path.isfile(p) or os.path.getsize(p) > LARGEST:
                continue
            try:
                files["/" + os.path.relpath(p, root)] = Path(p).read_bytes()
            except OSError:
                continue
    return Snapshot(files, frozenset(pm.imported_keys(root)))


def _text(data: bytes | None) -> str | None:
    try:
        return None if data is None else data.decode()
    except UnicodeDecodeError:
        return None


def changes(before: Snapshot, after: Snapshot) -> tuple[dict[str, tuple[str | None, str | None]], list[str]]:
    """What a step added or changed: path -> (text before or None where it was not there, text after or None where
    it is not text), and the keys it imported. A changed file whose text before is not text is left out (it could
    not be given back)."""
    files = {}
    for path, data in after.files.items():
        old = before.files.get(path)
        if old == data or old is not None and _text(old) is None:
            continue
        files[path] = (_text(old), _text(data))
    return files, sorted(after.keys - before.keys)


@contextmanager
def watched(stage: str, pm: PackageManager | None):
    """Notes in the install record what the body changed of the package manager's configuration (kept even when the
    body fails: what it changed is gpuprov's either way, and uninstall takes it out)."""
    if pm is None or stage not in record.STAGES:
        yield
        return
    before = snapshot(pm)
    try:
        yield
    finally:
        files, keys = changes(before, snapshot(pm))
        record.note_repo_config(stage, files, keys)


# ---------------------------------------------------------------- uninstall


@dataclass(frozen=True)
class Restore:
    """What uninstall does with a stage's recorded configuration: the actions (after the purge, in its step), the
    paths they remove, the files they give back (path, text), and notes for what stays."""
    actions: tuple
    gone: tuple[str, ...]
    files: tuple[tuple[str, str], ...]
    keys: tuple[str, ...]
    notes: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.actions)


def _managed(pm: PackageManager, path: str) -> bool:
    return any(fnmatch.fnmatchcase(path, g) for g in pm.config_globs)


def _read(root: Path, path: str) -> str | None:
    """`path`'s text under `root`; None where it is not there or not text."""
    try:
        return under(root, path).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def backups(root: Path, path: str) -> list[str]:
    found = glob.glob(glob.escape(str(under(root, path))) + ".gpuprov-*.bak")
    return sorted("/" + os.path.relpath(p, root) for p in found)


def restore(root: Path, pm: PackageManager, files: dict[str, dict], keys: list[str], purged: set[str]) -> Restore:
    """The actions that take a stage's recorded configuration (`files`, `keys`) out, where `purged` are the packages
    its purge removes (a file they own goes with them, and what rpm/dpkg leave of it after)."""
    gone: list[str] = []
    writes: list[tuple[str, str]] = []
    notes: list[str] = []
    for path, entry in sorted(files.items()):
        if not _managed(pm, path):
            continue
        exists = os.path.lexists(under(root, path))
        owners = pm.owners(root, path) if exists else set()
        staying = owners - purged
        left = [path + s for s in pm.leftover_suffixes if os.path.lexists(under(root, path + s))]
        if entry["old"] is None or owners and not staying:  # gpuprov's, or its package's that goes now
            if staying:
                notes.append(f"{path} stays: {', '.join(sorted(staying))} owns it")
                continue
            # what the purge leaves of it (rpm's .rpmsave of a changed config file) is named before it is there
            gone += ([path] if exists else []) + left + [path + s for s in pm.purge_leaves if owners]
        else:
            current = _read(root, path)
            if exists and current is not None and current != entry["old"]:
                back = undo_text(entry["old"], entry["written"], current) if entry["written"] is not None else None
                if back is None:
                    notes.append(f"{path} stays as it is: it was changed since gpuprov changed it, where gpuprov did")
                else:
                    writes.append((path, back))
        gone += backups(root, path)
    have = pm.imported_keys(root) if keys else set()
    forget = tuple(k for k in keys if k in have)
    gone = list(dict.fromkeys(gone))
    actions: list = [WriteFile(p, t, backup=False) for p, t in writes]
    # every path named: there now, or left by the purge before it (rm -f: one that is not there is no failure)
    actions += [Command(("rm", "-f", "--", *gone))] if gone else []
    actions += [Command(pm.forget_keys(forget))] if forget else []
    return Restore(tuple(actions), tuple(gone), tuple(writes), forget, tuple(notes))
