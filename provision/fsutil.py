"""The one write path for every file gpuprov changes on a host (engine configs, state, caches, units, the runtime's
files). Whatever happens — a crash, SIGKILL, a full disk, a read-only mount, a second writer — the file is the old
one or the new one, never half, and nothing the operator had is lost:

- a symlink is followed: its target is edited and the link stays a link (operators keep configs in git checkouts);
- mode and owner are kept, on the new file and on its backup;
- the new content is staged in an unnamed file (O_TMPFILE) beside the target, fsync'd, then renamed over it, and
  the directory is fsync'd, so a power cut after we return cannot bring the old file back;
- a backup `<name>.gpuprov-<YYYYmmddHHMMSS>[-N].bak` sits beside the edited file: staged the same way and then
  hard-linked to a name that does not exist yet (link(2) never replaces), so backups are never overwritten (two
  edits in one second get -1, -2…) and a backup name never holds a partial copy;
- ENOSPC, EDQUOT, EROFS, EACCES, EPERM → WriteFailed (exit 13, one line) with the target untouched and no backup
  left from this attempt.
"""
from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from provision.errors import ConfigInvalid, WriteFailed

BACKUP_STAMP = "%Y%m%d%H%M%S"
# Errors that mean "the disk or the mount won't take it", not "gpuprov has a bug": exit 13 with the file untouched.
NOT_WRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
HINTS = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space (quota)",
         errno.EROFS: "remount it read-write", errno.EACCES: "check its permissions and attributes (lsattr)",
         errno.EPERM: "check its attributes (lsattr: immutable?)", errno.EFBIG: "free some space"}


@dataclass(frozen=True)
class _Owner:
    mode: int
    uid: int | None
    gid: int | None
    times_ns: tuple[int, int] | None = None


def write_file(path: str | os.PathLike, data: str | bytes, *, mode: int = 0o644, backup: bool = True,
               keep_mode: bool = True, durable: bool = True) -> Path | None:
    """Replace `path`'s content with `data` (see the module docstring). A new file gets `mode`; an existing one keeps
    its own mode and owner (`keep_mode=False`: it gets `mode`, for files gpuprov owns such as its executables).
    `durable=False` skips the fsyncs, for files that do not outlive the host's uptime anyway (a container's
    config.json on every create). Returns the backup's path when one was made (`backup` and the file existed)."""
    link = Path(path)
    target = Path(os.path.realpath(link))  # edit through symlinks (chains and linked directories included)
    blob = data.encode() if isinstance(data, str) else bytes(data)
    try:
        return _write(target, blob, mode, backup, keep_mode, durable)
    except OSError as exc:
        if exc.errno not in NOT_WRITABLE:
            raise
        shown = f"{link} (-> {target})" if target != link.absolute() else str(link)
        raise WriteFailed(f"cannot write {shown}: {exc.strerror}; {HINTS.get(exc.errno, 'fix it')} and run again "
                          "(the file was not changed)") from None


def _write(target: Path, blob: bytes, mode: int, backup: bool, keep_mode: bool, durable: bool) -> Path | None:
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ConfigInvalid(f"{target} is not a regular file; move it aside and run again (nothing was changed)")
    target.parent.mkdir(parents=True, exist_ok=True)
    owner = (_Owner(stat.S_IMODE(st.st_mode) if keep_mode else mode, st.st_uid, st.st_gid) if st is not None
             else _Owner(mode, None, None))
    bak = None
    if backup and st is not None:
        with open(target, "rb") as fh:
            old = fh.read()
        bak = _publish_backup(target, old, _Owner(owner.mode, owner.uid, owner.gid,
                                                  (st.st_atime_ns, st.st_mtime_ns)), durable)
    try:
        staged = _Staged(target.parent, target.name, blob, owner, durable)
        try:
            staged.replace(target)
        finally:
            staged.close()
    except BaseException:
        if bak is not None:  # the target is untouched: leave no trace of this attempt
            _unlink_quiet(bak)
        raise
    if durable:
        fsync_dir(target.parent)
    return bak


def _publish_backup(target: Path, old: bytes, owner: _Owner, durable: bool) -> Path:
    stamp = time.strftime(BACKUP_STAMP)
    staged = _Staged(target.parent, target.name, old, owner, durable)
    try:
        for n in range(10000):
            bak = target.with_name(f"{target.name}.gpuprov-{stamp}{f'-{n}' if n else ''}.bak")
            try:
                staged.link(bak)
            except FileExistsError:
                continue
            if durable:
                fsync_dir(target.parent)
            return bak
        raise FileExistsError(errno.EEXIST, f"no free backup name for {target} in this second")
    finally:
        staged.close()


class _Staged:
    """`blob` in a file beside `name` in `dirpath` that has no name yet (O_TMPFILE: a crash leaves nothing
    behind), fsync'd, with the given mode and owner. Where O_TMPFILE is unsupported, a hidden named temp file."""

    def __init__(self, dirpath: Path, name: str, blob: bytes, owner: _Owner, durable: bool = True):
        self.dir, self.name, self.tmp = dirpath, name, None
        try:
            self.fd = os.open(dirpath, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            self.tmp = self._free_name()
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
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

    def _free_name(self) -> Path:
        return self.dir / f".{self.name}.gpuprov-{os.getpid()}-{time.monotonic_ns()}.tmp"

    def link(self, dest: Path) -> None:
        """Give the staged file the name `dest`, which must not exist (FileExistsError otherwise)."""
        if self.tmp is not None:
            os.link(self.tmp, dest)
        else:
            self._link_anonymous(dest)

    def _link_anonymous(self, dest: Path) -> None:
        # linkat(AT_SYMLINK_FOLLOW) on /proc/self/fd/N names an O_TMPFILE file (open(2)). Python calls plain
        # link(2), which does not follow the magic link, unless a dir fd is given: hence dst_dir_fd.
        dirfd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.link(f"/proc/self/fd/{self.fd}", dest.name, dst_dir_fd=dirfd, follow_symlinks=True)
        finally:
            os.close(dirfd)

    def replace(self, dest: Path) -> None:
        """Atomically put the staged file in place of `dest`."""
        if self.tmp is None:
            tmp = self._free_name()
            self._link_anonymous(tmp)
            self.tmp = tmp
        os.replace(self.tmp, dest)
        self.tmp = None  # consumed by the rename

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.tmp is not None:
            _unlink_quiet(self.tmp)
            self.tmp = None


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass
