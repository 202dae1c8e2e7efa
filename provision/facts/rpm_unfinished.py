"""What a killed dnf run leaves in rpm's database and dnf's history (issue 44's dnf half), read without running dnf.

rpm installs an upgrade's new package first (its %pre, its files, its header, its %post) and erases the old one after
(%preun, the files the new one does not have, the header, %postun); %posttrans comes once every package is in. A run
killed anywhere between the first new header and the last erase leaves both headers of a name-arch in rpm's database:
duplicates (`dnf check` says "X is a duplicate with Y"), the new one's %post perhaps cut off. A run killed after the
erases, in %posttrans, leaves no duplicate; only dnf's history tells: its transaction never ended. One killed before
the first new header (%pretrans, the first package's %pre) changed nothing in rpm's database: the host is as it was
before that transaction, and nothing is left to finish (the operator's next dnf run starts it anew). What was seen on
real dnf 4.14 and rpm 4.18: tests/fixtures/dnf-killed.

- `rpm_rows` reads the adapter's `rpm -qa --qf ROW_FORMAT` (rpm's database is rpm's to read: sqlite on EL 9, Berkeley
  DB on EL 8); `rpm_duplicates` finds the name-archs installed more than once, as dnf does: never the packages dnf
  installs side by side on purpose (kernels: installonlypkgs) nor rpm's signing keys (`gpg-pubkey`);
- `cut_transaction` reads dnf's history database (sqlite, Python's own reader; no process): the packages the last
  transaction was bringing in when it was cut off (it has no end: libdnf writes the end and the DONE state last);
- `dnf_running`: a dnf holds its rpmdb lock now (its transaction is under way, not cut off)."""
from __future__ import annotations

import os
import re
from functools import cmp_to_key
from pathlib import Path
from typing import NamedTuple

from provision.facts.packages import UnfinishedPackage
from provision.facts.rootfs import is_live, read_text, under
from provision.versions import rpm_evr_cmp

ROW_FORMAT = "%{NAME} %{EPOCHNUM}:%{VERSION}-%{RELEASE} %{ARCH}\n"  # one installed header a line
DNF_HISTORY = "var/lib/dnf/history.sqlite"  # dnf 4's (libdnf's swdb) on EL 8-10 and Amazon Linux 2023
DNF_LOCK = "var/lib/dnf/rpmdb_lock.pid"  # dnf 4's lock on rpm's database: the pid of the dnf that holds it
# libdnf's TransactionItemAction values (its Types.hpp; the same in dnf 4.14's Python bindings) of the items a
# transaction brings in: Install, Downgrade, Obsolete (the obsoleting package), Upgrade, Reinstall. The others are the
# packages it takes out (Downgraded, Obsoleted, Upgraded, Removed, Reinstalled) and reason changes.
INCOMING = (1, 2, 4, 6, 9)
STATE_UNKNOWN = 0  # libdnf's TransactionState while a transaction runs: DONE (1) or ERROR (2) is written at its end
# The states of a package a killed rpm transaction left, for the recover step's words and commands:
OLDER = "older duplicate"  # installed beside a newer one of its name-arch: rpm never erased it
NEWEST = "newest duplicate"  # the newer one: its %post may have been cut off (dnf remove --duplicates reinstalls it)
CUT = "transaction cut off"  # brought in by the transaction that never ended: its %post or %posttrans may not have run
NOT_PACKAGES = ("gpg-pubkey",)  # a signing key as rpm lists it: one "package" per key, all of one name


class RpmRow(NamedTuple):
    name: str
    evr: str  # EPOCH:VERSION-RELEASE, the epoch always there (0 when none)
    arch: str


def rpm_rows(text: str) -> list[RpmRow]:
    """`rpm -qa --qf ROW_FORMAT`'s lines, in rpm's order; a line of another shape (a warning) is left out."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and re.fullmatch(r"\d+:[^-\s]+-\S+", parts[1]):
            out.append(RpmRow(*parts))
    return out


def duplicated_names(rows: list[RpmRow]) -> set[str]:
    seen: dict[tuple[str, str], int] = {}
    for r in rows:
        seen[(r.name, r.arch)] = seen.get((r.name, r.arch), 0) + 1
    return {name for (name, _), n in seen.items() if n > 1}


def rpm_duplicates(rows: list[RpmRow], installonly: set[str] = frozenset()) -> list[UnfinishedPackage]:
    """Each name-arch installed more than once (but the names dnf installs side by side, `installonly`, and rpm's
    keys): its older headers (OLDER) and its newest (NEWEST), newest by rpm's own version order, as `dnf remove
    --duplicates` picks the one it keeps. In rpm's order of the rows."""
    groups: dict[tuple[str, str], list[RpmRow]] = {}
    for r in rows:
        if r.name not in installonly and r.name not in NOT_PACKAGES:
            groups.setdefault((r.name, r.arch), []).append(r)
    out = []
    for same in groups.values():
        if len(same) < 2:
            continue
        newest = max(same, key=cmp_to_key(lambda a, b: rpm_evr_cmp(a.evr, b.evr)))
        out += [UnfinishedPackage(r.name, r.evr, r.arch, NEWEST if r is newest else OLDER, r is newest, "rpm")
                for r in same]
    return out


def cut_transaction(root: Path) -> list[RpmRow]:
    """The packages (name, EPOCH:VERSION-RELEASE, arch) the last transaction in dnf's history under `root` was
    bringing in, where that transaction never ended (killed: no end time, state still UNKNOWN); [] where it ended, or
    where there is no history to read. Read-only: the database is opened as sqlite's read-only URI."""
    path = under(root, DNF_HISTORY)
    if not path.is_file():
        return []
    import sqlite3  # lazy: ~3 ms (-X importtime), on rpm hosts only (the only ones with this file)

    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return []
    try:
        last = db.execute("SELECT id, dt_end, state FROM trans ORDER BY id DESC LIMIT 1").fetchone()
        if not last or last[1] or last[2] != STATE_UNKNOWN:
            return []
        marks = ",".join("?" * len(INCOMING))
        rows = db.execute(f"SELECT r.name, r.epoch, r.version, r.release, r.arch FROM trans_item ti "
                          f"JOIN rpm r ON r.item_id = ti.item_id WHERE ti.trans_id = ? AND ti.action IN ({marks}) "
                          f"ORDER BY ti.id", (last[0], *INCOMING)).fetchall()
    except sqlite3.Error:  # not dnf 4's schema, or unreadable: nothing known to finish
        return []
    finally:
        db.close()
    return [RpmRow(n, f"{e or 0}:{v}-{r}", a) for n, e, v, r, a in rows]


def dnf_running(root: Path, tools: tuple[str, ...]) -> bool:
    """A dnf holds its rpmdb lock on this live host now: the lock file names a live process (not a zombie) whose
    program, or the script its Python runs, is named after one of `tools` (the adapter's: dnf, dnf-automatic, EL's
    yum that is dnf). A killed dnf leaves the file behind, naming a process that is gone; a tree that is not this
    host's `/` runs nothing."""
    pid = (read_text(root, DNF_LOCK) or "").strip()
    if not pid.isdigit() or not is_live(root):
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[:1]  # the field after (comm), which may itself hold spaces
    words = [os.path.basename(w) for w in cmdline.split()[:2]]  # dnf is a Python script: python3 /usr/bin/dnf …
    return state != ["Z"] and any(tool in w for w in words for tool in tools)


def installonly_extra(root: Path) -> tuple[str, ...]:
    """What dnf.conf's `installonlypkgs` adds to dnf's own list (dnf appends it to the defaults)."""
    text = read_text(root, "etc/dnf/dnf.conf") or ""
    main = re.search(r"^\[main\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    m = re.search(r"^installonlypkgs\s*=\s*(.+)$", main.group(1) if main else "", re.M)
    return tuple(w for w in re.split(r"[\s,]+", m.group(1)) if w) if m else ()
