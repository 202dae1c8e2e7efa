"""A file of the image, opened inside its rootfs: what gpuprov reads from an image (the compat libraries it copies,
the ld.so.cache it scans) is reached one name at a time from an fd of the rootfs, each step an openat with
O_NOFOLLOW on the directory the step before opened. A link on the way is read and resolved within the rootfs (an
absolute target starts again at the rootfs, `..` never climbs above it), as openat2's RESOLVE_IN_ROOT does, so:
- a link in the image (or planted by a previous run of the container) never leads to a host path;
- a name swapped for a link between two steps changes nothing already opened (each step holds its parent's fd);
- the walk never enters another mount (a directory on another device stops it, RESOLVE_NO_XDEV's rule), and the
  image's own /proc is a plain directory here, so no magic link is ever followed;
- the last name is opened O_PATH first and reopened for reading only when it is a regular file: an image's device
  node or FIFO at that name is never opened (opening some devices acts, e.g. arms a watchdog).
openat2 itself is not used: Python has no binding, and ctypes costs ~2.5 ms of imports on the container-start path.
Every refusal is an OSError (ELOOP, EXDEV, ENOENT, EISDIR…): the callers fall back to the host's files."""
from __future__ import annotations

import errno
import os
import stat

MAX_LINKS = 40  # the kernel's own limit on links followed in one lookup
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def open_in_root(rootfs: str, path: str, directory: bool = False) -> int:
    """An fd (O_RDONLY, close it) of the regular file (or, with `directory`, the directory) at `path` inside the
    image at `rootfs`, reached as the module says. OSError when it is absent, a link loop, on another mount, or of
    another kind."""
    root = os.open(rootfs, _DIR & ~os.O_NOFOLLOW)  # the engine's path to the rootfs: the engine's, trusted
    stack = [root]  # fds of the directories walked, the rootfs first
    try:
        dev = os.fstat(root).st_dev
        todo = [p for p in reversed(path.split("/")) if p not in ("", ".")]
        links = 0
        if not todo:
            return _reopen(os.dup(root), directory)
        while todo:
            name = todo.pop()
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            fd = os.open(name, _PATH, dir_fd=stack[-1])
            st = os.fstat(fd)
            if stat.S_ISLNK(st.st_mode):
                try:
                    target = os.readlink("", dir_fd=fd)  # the link opened, not whatever has its name now
                finally:
                    os.close(fd)
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, f"more than {MAX_LINKS} links in the image's {path}")
                todo += [p for p in reversed(target.split("/")) if p not in ("", ".")]
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_dev != dev:
                os.close(fd)
                raise OSError(errno.EXDEV, f"the image's {path} crosses a mount")
            if not todo:
                return _reopen(fd, directory)
            if not stat.S_ISDIR(st.st_mode):
                os.close(fd)
                raise OSError(errno.ENOTDIR, f"the image's {path}: {name} is not a directory")
            stack.append(fd)
        return _reopen(os.dup(stack[-1]), directory)  # the path ended in `..`
    finally:
        for fd in stack:
            os.close(fd)


def _reopen(fd: int, directory: bool) -> int:
    """The O_PATH (or directory) fd `fd`, checked for its kind and reopened for reading through the fd itself
    (/proc/self/fd: the same inode, whatever its name is now). Consumes `fd`."""
    try:
        mode = os.fstat(fd).st_mode
        if directory != stat.S_ISDIR(mode) or not (directory or stat.S_ISREG(mode)):
            raise OSError(errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL,
                          "not a directory" if directory else "not a regular file")
        return os.open(f"/proc/self/fd/{fd}", (_DIR if directory else os.O_RDONLY | os.O_CLOEXEC) & ~os.O_NOFOLLOW)
    finally:
        os.close(fd)


def open_at(dir_fd: int, name: str) -> int:
    """An fd (O_RDONLY) of the regular file `name` in the directory `dir_fd` (one name, no link followed, never a
    device or FIFO opened). OSError otherwise."""
    if "/" in name or name in ("", ".", ".."):
        raise OSError(errno.EINVAL, f"{name!r} is not one name")
    return _reopen(os.open(name, _PATH, dir_fd=dir_fd), False)
