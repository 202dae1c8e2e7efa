"""The one write path for every file gpuprov changes on a host (engine configs, state, caches, units, the runtime's
files), and the one way state and caches are read back. Whatever happens — a crash, SIGKILL, a full disk, a
read-only mount, a second writer, another local user, an operator saving the same file — the file is the old one
or the new one, never half, and nothing the operator had is lost:

- a symlink is followed (its target is edited and the link stays a link: operators keep configs in git checkouts)
  only when nobody else could have planted it: the link is root's and every directory on its way is private
  (`private_dir`). Any other link is refused (UntrustedPath, exit 6), as is a directory where a file is expected;
- the target's directory is opened without following links (O_NOFOLLOW at each step) and everything after happens
  relative to that directory, so a directory swapped meanwhile changes nothing; a directory a non-root user can
  write and that lacks the sticky bit is refused (exit 6) unless the caller allows it (`--allow-shared-dir`);
- missing directories are created with explicit modes (0755, or what the caller names), whatever the umask;
- mode and owner are kept, on the new file and on its backup (in a shared directory the new file is ours, `mode`);
- the new content is staged in an unnamed file (O_TMPFILE) beside the target, or else under a private random name
  created with O_EXCL|O_NOFOLLOW, fsync'd, then renamed over the target, and the directory is fsync'd, so a power cut
  after we return cannot bring the old file back;
- with `expect` (a `Seen` from the read the new content was merged from) the target is compared just before the
  rename — inode, size, mtime and content hash — and a change is ConcurrentEdit (exit 14) with nothing written:
  `edit_file` (and engines.configure) then read and merge again, a few times, before refusing;
- a backup `<name>.gpuprov-<YYYYmmddHHMMSS>[-N].bak` sits beside the edited file: staged the same way and then
  hard-linked to a name that does not exist yet (link(2) never replaces), so backups are never overwritten (two
  edits in one second get -1, -2…) and a backup name never holds a partial copy;
- ENOSPC, EDQUOT, EROFS, EACCES, EPERM → WriteFailed (exit 13, one line) with the target untouched and no backup
  left from this attempt.

State and caches are read back only through `open_trusted`: the file and every directory above it must be root's
and writable by no one else; otherwise a cache is a miss and state is refused.
"""
from __future__ import annotations

import errno
import io
import os
import stat
import time
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path

from provision.errors import ConcurrentEdit, ConfigInvalid, UntrustedPath, WriteFailed

BACKUP_STAMP = "%Y%m%d%H%M%S"
# Errors that mean "the disk or the mount won't take it", not "gpuprov has a bug": exit 13 with the file untouched.
NOT_WRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
HINTS = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space (quota)",
         errno.EROFS: "remount it read-write", errno.EACCES: "check its permissions and attributes (lsattr)",
         errno.EPERM: "check its attributes (lsattr: immutable?)", errno.EFBIG: "free some space"}
SHARED_DIR_OPTION = "--allow-shared-dir"  # the CLI's name for write_file(shared_dir_ok=True)
SHARED_DIR_HELP = ("Write into DIR even when a non-root user can write it and it has no sticky bit (a collector "
                   "directory of another user). Links there are still refused, and files are replaced, never "
                   "written through.")
EDIT_TRIES = 5  # reads-merges-writes before an edit that keeps being overtaken is refused (exit 14)
MAX_LINKS = 40  # as the kernel's own limit on links in one lookup (ELOOP)
DIR_MODE = 0o755
_PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


# --- trust: who could have put this here? ------------------------------------------------------------------------

def _ours(uid: int) -> bool:
    """root's, or this process's own user's (gpuprov-runtime under a rootless engine writes its user's bundles)."""
    return uid == 0 or uid == os.geteuid()


def private_dir(st: os.stat_result) -> bool:
    """Nobody but root (or this process's user) can add, rename or remove names in this directory: it is theirs and
    not group- or other-writable, or it is theirs and sticky (/tmp: others may add names, never replace ours)."""
    return _ours(st.st_uid) and (not st.st_mode & 0o022 or bool(st.st_mode & stat.S_ISVTX))


def private_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and _ours(st.st_uid) and not st.st_mode & 0o022


def _who_writes(st: os.stat_result) -> str:
    if not _ours(st.st_uid):
        return f"uid {st.st_uid} (its owner)"
    return "everyone" if st.st_mode & 0o002 else f"group {st.st_gid}"


def resolve(path: str | os.PathLike, *, private_dirs: bool = False) -> str:
    """`path` made absolute with every symlink on the way resolved, as os.path.realpath does, except that a link is
    followed only when nobody else could have planted it: the link is root's and every directory on its way is
    private (private_dir). Any other link is UntrustedPath (exit 6). `private_dirs`: every directory on the way must
    be private, links or not (state and caches read back). A tail that does not exist yet is kept as given."""
    return resolve_way(path, private_dirs)[0]


def resolve_way(path: str | os.PathLike, private_dirs: bool = False) -> tuple[str, bool]:
    """resolve(), and whether every directory up to the last name exists and is private: then nobody but root can
    change the way (the directory holding the last name is opened in one call: _open_parent; the warm editor keeps
    what it learnt about a driver directory: inject/modify.py's SOURCE_DIRS)."""
    given = os.fspath(path)
    todo = [p for p in reversed((given if given.startswith("/") else os.path.join(os.getcwd(), given)).split("/"))
            if p]
    cur, links = "/", 0
    weak = None if private_dir(os.lstat("/")) else "/"  # the first directory on the way that is not private
    if weak and private_dirs:
        raise UntrustedPath(f"{given}: / can be written by others, so gpuprov does not trust what is under it")
    while todo:
        name = todo.pop()
        if name == ".":
            continue
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = cur + name if cur == "/" else f"{cur}/{name}"  # not os.path.join: this loop runs on every GPU start
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return os.path.normpath(os.path.join(nxt, *reversed(todo))), weak is None and not todo
        kind = st.st_mode & 0o170000
        if kind == stat.S_IFLNK:
            if weak is not None or not _ours(st.st_uid):
                why = f"owned by uid {st.st_uid}" if not _ours(st.st_uid) else f"in {weak}, which others can write"
                where = "" if not todo else f"{given}: "  # the link is on the way, not the file itself
                raise UntrustedPath(f"{where}{nxt} is a symlink another user could have planted ({why}); gpuprov "
                                    "does not follow it: remove it, or keep links root's in directories only root "
                                    "can write, then run again (nothing was changed)")
            links += 1
            if links > MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), given)
            target = os.readlink(nxt)
            todo.extend(p for p in reversed(target.split("/")) if p)
            if target.startswith("/"):  # what led here was trusted: the lookup starts afresh at /
                cur = "/"
            continue
        if kind == stat.S_IFDIR and weak is None and not private_dir(st):
            weak = nxt
            if private_dirs:
                raise UntrustedPath(f"{given}: {nxt} can be written by {_who_writes(st)} (mode "
                                    f"{stat.S_IMODE(st.st_mode):04o}), so gpuprov does not trust what is under it "
                                    f"(`chown root {nxt}; chmod go-w {nxt}` makes it root's)")
        cur = nxt
    return cur, weak is None


def _open_dir(real: str, mode: int | None = None, leaf_mode: int | None = None) -> int:
    """An fd of directory `real` (already resolved), reached one name at a time without following any link, so
    nothing swapped in meanwhile is entered. `mode`: create what is missing, each new directory with exactly that
    mode (`leaf_mode` for `real` itself; made 0700 first, then chmod'ed: the umask never decides). The fd is O_RDONLY
    (it can be fsync'd)."""
    fd = os.open("/", _PATH_FLAGS)
    try:
        names = [p for p in real.split("/") if p]
        for i, name in enumerate(names):
            try:
                nfd = os.open(name, _PATH_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if mode is None:
                    raise
                nfd = _make_dir_at(fd, name, leaf_mode if leaf_mode is not None and i == len(names) - 1 else mode)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise ConfigInvalid(f"{real}: {name} is not a directory (or became a link while gpuprov opened it); "
                                    "nothing was changed") from None
            os.close(fd)
            fd = nfd
        dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    return dfd


def _make_dir_at(parent_fd: int, name: str, mode: int) -> int:
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        made = True
    except FileExistsError:  # made by someone else meanwhile: theirs, left as it is (and opened without following)
        made = False
    nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    if made:
        os.fchmod(nfd, mode)
    return nfd


def make_dirs(path: str | os.PathLike, mode: int = DIR_MODE) -> None:
    """mkdir -p with explicit modes, whatever the umask: `path` gets `mode` (state 0755, private ones 0700), the
    missing ones above it 0755; existing ones are left as they are. Links on the way: as resolve() allows."""
    os.close(_open_dir(resolve(path), DIR_MODE, mode))


def open_private_dir(path: str | os.PathLike, mode: int = 0o700) -> int:
    """An fd (O_RDONLY) of directory `path`, made with `mode` when missing, reached without following a link that
    anyone but root could have planted and with every directory on the way root's alone (UntrustedPath otherwise):
    what is written in it and read back later (copies handed to runc) no other user can have replaced."""
    return _open_dir(resolve(path, private_dirs=True), DIR_MODE, mode)


def open_trusted(path: str | os.PathLike) -> io.BufferedReader:
    """A state or cache file gpuprov wrote, opened for reading only when nobody but root could have written it or
    anything above it: the file and every directory on its way are root's and not group- or other-writable (root's
    sticky directories such as /tmp count: others cannot replace root's names there); links only as resolve()
    allows. FileNotFoundError when it is absent; UntrustedPath otherwise (a cache treats it as a miss, state as a
    refusal). Costs one lstat per path component and one fstat: cheap enough for the container-start path."""
    fd, _ = open_trusted_fd(path)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_trusted_fd(path: str | os.PathLike) -> tuple[int, os.stat_result]:
    """open_trusted's checks, and the raw descriptor (the caller closes it) with its fstat: for the warm editor's
    discovery check on every GPU start, which mostly needs only the file's identity (a file object costs three more
    system calls: fstat, ioctl, lseek)."""
    if not os.fspath(path):  # as open("") says: no such file (a setting left empty)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "")
    real = resolve(path, private_dirs=True)
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not private_file(st):
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else \
                f"writable by {_who_writes(st)} (mode {stat.S_IMODE(st.st_mode):04o})"
            raise UntrustedPath(f"{path} is {what}, so gpuprov does not trust it")
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def read_fd(fd: int) -> bytes:
    """Everything left to read from `fd`, with os.read (no file object: fewer system calls on the start path)."""
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def read_trusted(path: str | os.PathLike) -> bytes | None:
    """open_trusted's content; None when the file is absent."""
    try:
        with open_trusted(path) as fh:
            return fh.read()
    except FileNotFoundError:
        return None


# --- what a file was when read: for the compare before the rename ------------------------------------------------

def _sha256(blob: bytes) -> bytes:
    import hashlib  # lazy: 1.5 ms (-X importtime) on the runtime's start path, which never compares

    return hashlib.sha256(blob).digest()


class Seen:
    """A file as gpuprov read it (the token a merge was computed from): enough to tell, just before the rename,
    whether anyone changed it since. `digest` None: it did not exist. `ident` None: compare the content only (a
    caller that kept the text it read but not its stat). Immutable by use; a plain class, not a dataclass: fsutil
    loads on every cold GPU start, and building a frozen dataclass costs about 0.7 ms at import."""

    __slots__ = ("digest", "size", "ident")

    def __init__(self, digest: bytes | None, size: int = -1, ident: tuple[int, int, int] | None = None):
        self.digest, self.size, self.ident = digest, size, ident  # ident: st_dev, st_ino, st_mtime_ns

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Seen) and (self.digest, self.size, self.ident) == (other.digest, other.size,
                                                                                    other.ident)

    def __hash__(self) -> int:
        return hash((self.digest, self.size, self.ident))

    def __repr__(self) -> str:
        return f"Seen(size={self.size}, ident={self.ident})"

    @classmethod
    def of(cls, data: bytes | str | None, st: os.stat_result | None = None) -> Seen:
        if data is None:
            return cls(None)
        blob = data.encode() if isinstance(data, str) else bytes(data)
        return cls(_sha256(blob), len(blob), (st.st_dev, st.st_ino, st.st_mtime_ns) if st is not None else None)

    def matches(self, st: os.stat_result | None, data: bytes | None) -> bool:
        if st is None or data is None:
            return self.digest is None
        if self.digest is None or self.size != len(data) or self.size != st.st_size:
            return False
        if self.ident is not None and self.ident != (st.st_dev, st.st_ino, st.st_mtime_ns):
            return False
        return _sha256(data) == self.digest


def read_file(path: str | os.PathLike) -> tuple[bytes | None, Seen]:
    """A file's bytes (None: absent) and the Seen token to pass back as write_file(expect=…). Links as resolve()
    allows; not a regular file → ConfigInvalid."""
    real = resolve(path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, Seen(None)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise UntrustedPath(f"{path} became a symlink while gpuprov read it; nothing was changed") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigInvalid(f"{path} is not a regular file; move it aside and run again (nothing was changed)")
        data = fh.read()
    return data, Seen.of(data, st)


def seen_as(path: str | os.PathLike, old: str | bytes | None) -> Seen:
    """The token for a file whose content a caller read earlier as `old` (an engine adapter keeps the text, not the
    stat): the file's identity now, when its content is still `old`; ConcurrentEdit when it is not."""
    data, seen = read_file(path)
    if seen.digest != Seen.of(old).digest:
        raise ConcurrentEdit(changed_line(path))
    return seen


def changed_line(path: str | os.PathLike, tries: int = 1) -> str:
    if tries <= 1:
        return f"{path} changed while gpuprov was editing it (someone saved it meanwhile); nothing was written: run again"
    return (f"{path} kept changing while gpuprov edited it ({tries} tries: someone keeps saving it); it is as they "
            "last saved it, with nothing of gpuprov's: run again when nobody is editing it")


def edit_file(path: str | os.PathLike, merge: Callable[[str | None], str | None], *, tries: int = EDIT_TRIES,
              **write_kw) -> Path | None:
    """Read, merge, write, and never lose an edit made in between: `merge(text or None)` returns the new text (None
    or the same text: nothing to do); the write renames only if the file is still what merge saw, else the file is
    read and merged again; after `tries` such changes, ConcurrentEdit (exit 14) naming the file. Returns the backup
    (write_file's keywords pass through)."""
    for _ in range(tries):
        data, seen = read_file(path)
        old = None if data is None else data.decode()
        new = merge(old)
        if new is None or new == old:
            return None
        try:
            return write_file(path, new, expect=seen, **write_kw)
        except ConcurrentEdit:
            continue
    raise ConcurrentEdit(changed_line(path, tries))


# --- the write ---------------------------------------------------------------------------------------------------

class _Owner(namedtuple("_Owner", "mode uid gid times_ns", defaults=(None,))):
    """A file's mode and owner, kept across a rewrite (mode: int, uid and gid: int or None), and the (atime, mtime)
    a backup keeps (`times_ns`). A NamedTuple from collections, not typing's: `gpuprov detect` loads this module (no
    dataclasses module, issue 20), and so does every cold GPU start (no typing module: ~2 ms, -X importtime -I -S)."""
    __slots__ = ()


class _How:
    """write_file's choices, passed down as one value (a plain class: see Seen)."""

    __slots__ = ("mode", "backup", "keep_mode", "durable", "expect", "shared_dir_ok")

    def __init__(self, mode: int, backup: bool, keep_mode: bool, durable: bool, expect: Seen | None,
                 shared_dir_ok: bool):
        self.mode, self.backup, self.keep_mode, self.durable = mode, backup, keep_mode, durable
        self.expect, self.shared_dir_ok = expect, shared_dir_ok


# A writer, Callable[[io.BufferedWriter], None], writes the new content into the staged file (large outputs: a tar).
# Spelled out in the annotations only: a subscripted Callable built at import would cost on every cold GPU start.

def write_file(path: str | os.PathLike, data: str | bytes | Callable[[io.BufferedWriter], None], *, mode: int = 0o644,
               backup: bool = True, keep_mode: bool = True, durable: bool = True, expect: Seen | None = None,
               shared_dir_ok: bool = False) -> Path | None:
    """Replace `path`'s content with `data` (see the module docstring). A new file gets `mode`; an existing one keeps
    its own mode and owner (`keep_mode=False`: it gets `mode` and our owner, for files gpuprov owns such as its
    executables, state and caches).
    `durable=False` skips the fsyncs, for files that do not outlive the host's uptime anyway (a container's
    config.json on every create). `expect`: the Seen of the read `data` was merged from; the rename happens only if
    the file is still that (ConcurrentEdit otherwise). `shared_dir_ok`: the operator allowed a directory other users
    can write (--allow-shared-dir). `data` may be a writer, called with the staged file (a bundle's tar, streamed).
    Returns the backup's path when one was made (`backup` and the file existed)."""
    blob = data.encode() if isinstance(data, str) else data if callable(data) else bytes(data)
    how = _How(mode, backup, keep_mode, durable, expect, shared_dir_ok)
    return _at_parent(Path(path), lambda dfd, target: _write_at(dfd, target, blob, how))


def _at_parent(link: Path, act, leaf: bool = True):
    """`act(dfd, target)` in the target's directory, opened without following links (made 0755 where missing); a
    full disk or a read-only mount becomes WriteFailed (exit 13). `leaf`: the target itself is resolved through
    trusted symlinks too (written through); else only its directory is (the name itself is replaced)."""
    target = link
    try:
        if leaf:
            real, private = resolve_way(link)
            target = Path(real)
        else:  # a missing directory is private by its way alone: _open_parent's open fails, and it is made
            real, private = resolve_way(link.parent)
            target = Path(real) / link.name
        dfd = _open_parent(str(target.parent), private)
        try:
            return act(dfd, target)
        finally:
            os.close(dfd)
    except UntrustedPath:
        raise
    except OSError as exc:
        if exc.errno not in NOT_WRITABLE:
            raise
        shown = f"{link} (-> {target})" if target != link.absolute() else str(link)
        raise WriteFailed(f"cannot write {shown}: {exc.strerror}; {HINTS.get(exc.errno, 'fix it')} and run again "
                          "(the file was not changed)") from None


def _open_parent(real: str, private: bool) -> int:
    """_open_dir(real, DIR_MODE); where every directory on the way is private (resolve found them all root's, not
    writable by others), in one call: nobody but root can swap a name on that way (for a container's config.json,
    12 fewer system calls on every GPU start)."""
    if private:
        try:
            return os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # changed meanwhile (removed, a link now): the careful walk, its making and its errors
            pass
    return _open_dir(real, DIR_MODE)


def _stat_at(dfd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _read_at(dfd: int, name: str, target: Path, content: bool = True) -> tuple[os.stat_result | None, bytes | None]:
    """The target's stat and (`content`) bytes, read without following a link; a link here was planted after
    resolve() had a look, or is one resolve() would not follow."""
    st = _stat_at(dfd, name)
    if st is None:
        return None, None
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedPath(f"{target} is a symlink another user could have planted; gpuprov does not write through "
                            "it: remove it and run again (nothing was changed)")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigInvalid(f"{target} is not a regular file; move it aside and run again (nothing was changed)")
    if not content:
        return st, None
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    with os.fdopen(fd, "rb") as fh:
        return os.fstat(fd), fh.read()


def _check_dir(dfd: int, target: Path, how: _How) -> bool:
    """Whether the target's directory is shared (others can write it); refused unless the caller allows that."""
    st = os.fstat(dfd)
    if private_dir(st):
        return False
    if not how.shared_dir_ok:
        raise UntrustedPath(f"{target.parent} can be written by {_who_writes(st)} (mode "
                            f"{stat.S_IMODE(st.st_mode):04o}, no sticky bit): another user could swap {target.name} "
                            f"under gpuprov; make it root's and not group/other-writable, or pass {SHARED_DIR_OPTION} "
                            "to write there anyway (nothing was written)")
    return True


def _write_at(dfd: int, target: Path, blob: bytes | Callable[[io.BufferedWriter], None], how: _How) -> Path | None:
    shared = _check_dir(dfd, target, how)
    name = target.name
    st, old = _read_at(dfd, name, target, content=how.expect is not None or how.backup)
    if how.expect is not None and not how.expect.matches(st, old):
        raise ConcurrentEdit(changed_line(target))
    if st is None or shared or not how.keep_mode:  # gpuprov's own file (or one in a shared directory): ours, `mode`
        owner = _Owner(how.mode, None, None)
    else:
        owner = _Owner(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
    bak = None
    if how.backup and st is not None and old is not None:
        bak = _publish_backup(dfd, target, old, _Owner(owner.mode, owner.uid, owner.gid,
                                                       (st.st_atime_ns, st.st_mtime_ns)), how.durable)
    try:
        staged = _Staged(dfd, name, blob, owner, how.durable)
        try:
            if how.expect is not None:  # the compare before the rename: an edit saved meanwhile is never lost
                now_st, now = _read_at(dfd, name, target)
                if not how.expect.matches(now_st, now):
                    raise ConcurrentEdit(changed_line(target))
            staged.replace(name)
        finally:
            staged.close()
    except BaseException:
        if bak is not None:  # the target is untouched: leave no trace of this attempt
            _unlink_quiet(bak.name, dfd)
        raise
    if how.durable:
        os.fsync(dfd)
    return bak


def _publish_backup(dfd: int, target: Path, old: bytes, owner: _Owner, durable: bool) -> Path:
    stamp = time.strftime(BACKUP_STAMP)
    staged = _Staged(dfd, target.name, old, owner, durable)
    try:
        for n in range(10000):
            bak = target.with_name(f"{target.name}.gpuprov-{stamp}{f'-{n}' if n else ''}.bak")
            try:
                staged.link(bak.name)
            except FileExistsError:
                continue
            if durable:
                os.fsync(dfd)
            return bak
        raise FileExistsError(errno.EEXIST, f"no free backup name for {target} in this second")
    finally:
        staged.close()


class _Staged:
    """`blob` in a file in the directory `dfd` that has no name yet (O_TMPFILE: a crash leaves nothing behind),
    fsync'd, with the given mode and owner. Where O_TMPFILE is unsupported, a hidden file under a private random
    name, created with O_EXCL|O_NOFOLLOW (nothing another user planted is opened)."""

    def __init__(self, dfd: int, name: str, blob: bytes | Callable[[io.BufferedWriter], None], owner: _Owner,
                 durable: bool = True):
        self.dfd, self.name, self.tmp = dfd, name, None
        try:
            self.fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            self.tmp = self._free_name()
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600,
                              dir_fd=dfd)
        try:
            if callable(blob):
                with os.fdopen(self.fd, "wb", closefd=False) as fh:
                    blob(fh)
            else:
                view = memoryview(blob)
                while view:
                    view = view[os.write(self.fd, view):]
            if owner.uid is not None:
                try:
                    os.fchown(self.fd, owner.uid, owner.gid)  # before chmod: chown clears setuid/setgid bits
                except PermissionError:
                    pass  # not root (tests): the file stays ours
            os.fchmod(self.fd, owner.mode)
            if owner.times_ns is not None:
                os.utime(self.fd, ns=owner.times_ns)
            if durable:
                os.fsync(self.fd)
        except BaseException:
            self.close()
            raise

    def _free_name(self) -> str:
        return f".{self.name}.gpuprov-{os.urandom(8).hex()}.tmp"

    def link(self, dest: str) -> None:
        """Give the staged file the name `dest` in its directory, which must not exist (FileExistsError otherwise)."""
        if self.tmp is not None:
            os.link(self.tmp, dest, src_dir_fd=self.dfd, dst_dir_fd=self.dfd, follow_symlinks=False)
        else:
            # linkat(AT_SYMLINK_FOLLOW) on /proc/self/fd/N names an O_TMPFILE file (open(2)). Python calls plain
            # link(2), which does not follow the magic link, unless a dir fd is given: hence dst_dir_fd.
            os.link(f"/proc/self/fd/{self.fd}", dest, dst_dir_fd=self.dfd, follow_symlinks=True)

    def replace(self, dest: str) -> None:
        """Atomically put the staged file in place of `dest` (rename(2) replaces a name, never follows it)."""
        if self.tmp is None:
            tmp = self._free_name()
            self.link(tmp)
            self.tmp = tmp
        os.replace(self.tmp, dest, src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
        self.tmp = None  # consumed by the rename

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.tmp is not None:
            _unlink_quiet(self.tmp, self.dfd)
            self.tmp = None


# --- a directory published whole, and a link switched atomically (gpuprov driver-volume) ------------------------

def publish_dir(dest: str | os.PathLike, fill: Callable[[Path], None], mode: int = DIR_MODE) -> bool:
    """Make directory `dest` whole or not at all: `fill(staging)` fills a staging directory beside it
    (`.<name>.tmp`, a killed run's leftover removed first), which is then renamed to `dest`. False, and nothing
    done, when `dest` is there already. Its directory must be private (a shared one: UntrustedPath, exit 6)."""
    dest = Path(dest)
    import shutil  # lazy: 1.6 ms (-X importtime -I -S, min of 15) on every cold GPU start, which publishes no dir

    def act(dfd: int, target: Path) -> bool:
        _check_dir(dfd, target, _How(mode, False, False, True, None, False))
        if _stat_at(dfd, target.name) is not None:
            return False
        staging = target.with_name(f".{target.name}.tmp")
        if _stat_at(dfd, staging.name) is not None:
            shutil.rmtree(staging, ignore_errors=True)  # its directory is private: nobody else put it there
        os.close(_make_dir_at(dfd, staging.name, mode))
        try:
            fill(staging)
            os.rename(staging.name, target.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        os.fsync(dfd)
        return True

    return _at_parent(dest, act, leaf=False)


def point_link(link: str | os.PathLike, to: str) -> bool:
    """Make `link` a symlink to `to`, switched atomically (a new link renamed over the old: a reader sees the old
    target or the new one, never none). False when it points there already."""
    def act(dfd: int, target: Path) -> bool:
        _check_dir(dfd, target, _How(0, False, False, True, None, False))
        st = _stat_at(dfd, target.name)
        if st is not None and stat.S_ISLNK(st.st_mode) and os.readlink(target.name, dir_fd=dfd) == to:
            return False
        tmp = f".{target.name}.tmp"
        _unlink_quiet(tmp, dfd)  # a killed run's leftover
        os.symlink(to, tmp, dir_fd=dfd)
        os.replace(tmp, target.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)
        return True

    return _at_parent(Path(link), act, leaf=False)


def link_or_copy(src: str | os.PathLike, dst: Path) -> None:
    """`dst` (inside a staging directory of publish_dir) as a hard link to `src`, or a copy across filesystems; a
    name already there is kept."""
    if os.path.lexists(dst):
        return
    make_dirs(dst.parent, DIR_MODE)
    try:
        os.link(src, dst)
    except OSError:
        import shutil  # lazy: 1.6 ms, as in publish_dir (only a copy across filesystems needs it)

        shutil.copy2(src, dst)


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(p: str | Path, dfd: int | None = None) -> None:
    try:
        os.unlink(p, dir_fd=dfd)
    except OSError:
        pass
