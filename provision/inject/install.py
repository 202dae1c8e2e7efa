"""Install the runtime on a host: settings, the editor's code, the compiled front-end (the wheel's, else built here,
else a Python fallback), the --gpus hook stand-in, and a fresh discovery cache. Idempotent: files are only written
when their content differs.

Upgrades never disturb container starts. The editor runs from its own copy of its files (inject/sources.py), in
PREFIX/lib/gpuprov-runtime/<hash of their content>/, not from the installed package: installing a newer gpuprov
(pip replacing the package's files one by one) never changes the code a starting container runs. A copy is made
whole in a hidden directory and renamed into place; the front-end that names it is then renamed over the old one
(fsutil), so every start runs either the old front-end and editor or the new ones, never a mix. `current` (a symlink
swapped atomically) names the copy in use: a warm editor serving an older copy stops taking requests and exits
(inject/server.py), and containers created by the old runtime are stopped, exec'd into and removed by the new
front-end, which hands every command but `create` to runc unchanged."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from provision import __version__, effects, paths
from provision.fsutil import read_trusted, write_file
from provision.hook_presence import note_hook_rewritten
from provision.inject import discover
from provision.inject.frontend_build import compile_front_end
from provision.inject.modify import HOOK_MARKER, HOOK_NAME
from provision.inject.nodes import prepare_host
from provision.inject.settings import Settings, kept_settings, settings_path
from provision.inject.sources import PKG, source_files

HERE = Path(__file__).resolve().parent
STAMP = paths.INSTALL_STAMP
EDITOR_LIB = "lib/gpuprov-runtime"  # under the prefix: the editor's copies and `current`
KEEP_COPIES = 2  # the copy in use and the one before it (a start that began just before an upgrade may still run it)


def _stamp(prefix: str, driver_root: str, front_ends: dict[str, str] | None = None) -> str:
    srcs = b"".join(p.read_bytes() for p in source_files())
    srcs += SHIPPED.read_bytes() if SHIPPED.exists() else b""
    return json.dumps({"version": __version__, "src": hashlib.sha256(srcs).hexdigest()[:16], "prefix": prefix,
                       "driver_root": driver_root, "python": sys.executable,
                       "runc": default_oci_runtime(), "front_ends": front_ends or {},
                       "settings": settings_path()}, sort_keys=True)


def default_oci_runtime() -> str | None:
    """The low-level runtime the front-end hands over to, when none is named: runc on PATH, else crun (Debian's
    podman brings crun alone: Depends crun | runc), so the runtime wraps the OCI runtime the host has."""
    return shutil.which("runc") or shutil.which("crun")


def is_installed(driver_root: str = "/", prefix: str = "/usr/local", front_ends: dict[str, str] | None = None) -> bool:
    """Fast check for re-runs: same sources, paths and settings as the last install, and the files still there."""
    try:  # a stamp nobody but root could have written (fsutil.open_trusted); any other is a miss
        same = read_trusted(STAMP) == _stamp(prefix, driver_root, front_ends).encode()
    except OSError:
        return False
    return same and all((Path(prefix) / "bin" / n).exists() for n in ("gpuprov-runtime", *(front_ends or {}))) \
        and Path(settings_path()).exists() \
        and (Path(prefix) / EDITOR_LIB / "current" / "provision/inject/modify_main.py").exists()


def install_editor(prefix: str, changed: list[str]) -> Path:
    """The editor's files copied to PREFIX/lib/gpuprov-runtime/<content hash>/ (complete before it has that name)
    and `current` pointed at it (a symlink renamed into place); older copies but the previous one removed. Returns
    the copy's root (what goes on the editor's sys.path)."""
    files = [(p.relative_to(PKG.parent), p.read_bytes()) for p in source_files()]
    digest = hashlib.sha256(b"".join(str(r).encode() + b"\0" + d for r, d in files)).hexdigest()[:16]
    base = Path(prefix) / EDITOR_LIB
    dest = base / digest
    if not dest.is_dir():
        tmp = base / f".{digest}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for rel, data in files:
            write_file(tmp / rel, data, mode=0o644, keep_mode=False, backup=False)
        try:
            os.rename(tmp, dest)
        except OSError:  # another install made the same copy meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        changed.append(str(dest))
    current = base / "current"
    before = os.readlink(current) if current.is_symlink() else None
    if before != digest:
        link = base / f".current.{os.getpid()}.tmp"
        link.unlink(missing_ok=True)
        os.symlink(digest, link)
        os.replace(link, current)
        changed.append(str(current))
    for old in base.iterdir():
        if old.is_dir() and not old.is_symlink() and old.name not in (digest, before) and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    return dest


@dataclass
class InstallResult:
    runtime_path: str
    compiled: bool
    origin: str | None = None  # "wheel" (shipped binary), "built-here" (compiled at install), None (Python)
    changed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dev_root: str = "/"  # the settings' dev root as written (given, or kept from runtime.json)


def _write_if_changed(path: Path, data: bytes, mode: int, changed: list[str]) -> None:
    try:
        if path.read_bytes() == data and (path.stat().st_mode & 0o777) == mode:
            return
    except OSError:
        pass
    write_file(path, data, mode=mode, keep_mode=False, backup=False)
    changed.append(str(path))


def _write_hook(hook: Path, changed: list[str]) -> None:
    """gpuprov's --gpus hook; where it rewrites one already there, the path's first presence is kept
    (engines/docker.note_hook_rewritten), so that dockerd is not restarted for a hook it already finds."""
    try:
        there_since = hook.stat().st_mtime
    except OSError:
        there_since = None
    before = len(changed)
    _write_if_changed(hook, (HERE / "hook.sh").read_bytes(), 0o755, changed)
    if there_since is not None and len(changed) > before:
        note_hook_rewritten(str(hook), there_since)


# The front-end as shipped in the wheel (compiled from shim.c when the wheel was built: setup.py), with empty slots.
SHIPPED = HERE / "gpuprov-runtime.bin"
SLOT = 4096  # shim.c's SLOT
SLOTS = ("runc", "python", "modify")


def patch_slots(binary: bytes, **paths: str) -> bytes:
    """Write runc/python/modify paths into the binary's fixed-size slots (NUL-padded). Raises ValueError when the
    binary does not hold exactly one empty slot of each."""
    out = bytearray(binary)
    for name in SLOTS:
        marker = f"@@GPUPROV-SLOT:{name}@@".encode()
        at = out.find(marker)
        if at < 0 or out.find(marker, at + 1) >= 0 or any(out[at + len(marker):at + SLOT]):
            raise ValueError(f"front-end binary: no single empty slot for {name}")
        value = paths[name].encode()
        if len(value) >= SLOT or b"\0" in value:
            raise ValueError(f"front-end binary: path too long for its slot: {paths[name]}")
        out[at:at + SLOT] = value.ljust(SLOT, b"\0")
    return bytes(out)


def _compile(argv: list[str]) -> int:
    """One compiler run for frontend_build's recipe (a compiler that cannot start or hangs counts as a failure)."""
    r = effects.try_run(argv, timeout=120)
    return 127 if r is None else r.returncode


def front_end(runc: str, python: str, compile_shim: bool = True,
              editor: Path = HERE.parent.parent) -> tuple[bytes | None, str | None, list[str]]:
    """(binary, origin, notes): the wheel's binary when it runs on this host, else one compiled here, else None.
    Each candidate is run once (`--gpuprov-front-end`) before it is trusted with every container start. `editor`:
    the root of the editor's code (install_editor's copy; by default the package itself)."""
    notes: list[str] = []
    paths = {"runc": runc, "python": python, "modify": str(editor / "provision/inject/modify_main.py")}
    with tempfile.TemporaryDirectory() as td:
        built = Path(td) / "built"
        candidates = [("wheel", lambda: SHIPPED.read_bytes() if SHIPPED.exists() else None)]
        if compile_shim:
            candidates.append(("built-here", lambda: built.read_bytes() if compile_front_end(built, _compile) else None))
        for origin, get in candidates:
            raw = get()
            if raw is None:
                continue
            try:
                data = patch_slots(raw, **paths)
            except ValueError as exc:
                notes.append(str(exc))
                continue
            exe = Path(td) / f"check-{origin}"
            exe.write_bytes(data)
            exe.chmod(0o755)
            r = effects.try_run([str(exe), "--gpuprov-front-end"], timeout=10)
            if r is not None and r.returncode == 0:
                return data, origin, notes
            notes.append(f"the {origin} front-end does not run on this host")
    return None, None, notes


def python_fallback(python: str, root: Path = HERE.parent.parent, runc: str | None = None) -> bytes:
    """`runc`: the low-level runtime it hands over to (an engine's own front-end); None: runtime.json's."""
    # one shebang argument only (Linux passes the rest as a single word): -IS = isolated, no site
    return (f"#!{python} -IS\n# gpuprov-runtime (Python fallback: no compiled front-end runs on this host)\n"
            f"import sys\nsys.path.insert(0, {str(root)!r})\nfrom provision.inject.shim import main\n"
            f"raise SystemExit(main({'' if runc is None else repr(runc)}))\n").encode()


def install_runtime(prefix: str = "/usr/local", *, runc: str | None = None, driver_root: str | None = None,
                    dev_root: str | None = None, proc_root: str | None = None,
                    accept_env_unprivileged: bool | None = None, compile_shim: bool = True,
                    front_ends: dict[str, str] | None = None) -> InstallResult:
    """`front_ends`: an engine's own front-end beside gpuprov-runtime (file name -> the OCI runtime it wraps; Podman's:
    engines.front_ends()), the same code with another low-level runtime in its slot. A setting given as None keeps
    what runtime.json holds (settings.kept_settings), else its default; a change to one is said in the notes. The
    low-level runtime and (plan/runtime.install) the driver root are found on the host again unless given."""
    changed: list[str] = []
    notes: list[str] = []
    before = kept_settings()
    given = {"driver_root": driver_root, "dev_root": dev_root, "proc_root": proc_root,
             "accept_env_unprivileged": accept_env_unprivileged}
    # the low-level runtime is what this host has now (runc, else crun), found again on every install as before: a
    # value found once is no operator's choice (seen: crun kept after runc arrived beside it for dockerd)
    runc = runc or default_oci_runtime() or "/usr/sbin/runc"
    python = sys.executable
    # checked as the runtime will read it back: a value it would refuse is never written
    settings = Settings.from_dict({**before, **{k: v for k, v in given.items() if v is not None}, "runc": runc},
                                  settings_path())
    _write_if_changed(Path(settings_path()), (json.dumps(settings.to_dict(), indent=2) + "\n").encode(), 0o644,
                      changed)
    said = [f"{settings_path()}: {k} {json.dumps(before[k])} -> {json.dumps(v)}"  # a setting changed, as asked
            for k, v in settings.to_dict().items() if k in before and before[k] != v]
    driver_root, dev_root, proc_root = settings.driver_root, settings.dev_root, settings.proc_root
    bindir = Path(prefix) / "bin"
    editor = install_editor(prefix, changed)  # first: the front-end written next names this copy
    shim, origin, notes = front_end(runc, python, compile_shim, editor)
    target = bindir / "gpuprov-runtime"
    _write_if_changed(target, shim or python_fallback(python, editor), 0o755, changed)
    if shim is None:
        notes.append("no usable compiled front-end (none in the wheel, no C compiler): installed the Python fallback "
                     "runtime (a Python start-up on every container start)")
    for name, oci in (front_ends or {}).items():  # an engine's own: the same code, another runtime in its slot
        own, _, more = front_end(oci, python, compile_shim, editor)
        _write_if_changed(bindir / name, own or python_fallback(python, editor, oci), 0o755, changed)
        notes += [n for n in more if n not in notes]
        if oci != runc:
            notes.append(f"{bindir / name} wraps {oci}, gpuprov-runtime {runc}")
    existing = shutil.which(HOOK_NAME)
    if existing and HOOK_MARKER not in Path(existing).read_bytes()[:4096]:
        notes.append(f"NVIDIA's {existing} is installed: left alone; --gpus containers use NVIDIA's hook")
    else:
        _write_hook(bindir / HOOK_NAME, changed)
    notes += prepare_host(proc_root, dev_root)  # nvidia-uvm and the nodes, as nvidia-modprobe would make them
    try:
        discover.refresh(driver_root, settings.cache, proc_root, dev_root, warn=notes.append)
    except OSError as exc:
        notes.append(f"discovery cache not written: {exc}")
    try:
        write_file(STAMP, _stamp(prefix, driver_root, front_ends), mode=0o644, keep_mode=False, backup=False)  # dirs: 0755
    except OSError:
        pass
    return InstallResult(str(target), shim is not None, origin, changed, said + notes, dev_root)

