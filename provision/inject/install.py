"""Install the runtime on a host: settings, the compiled front-end (the wheel's, else built here, else a Python
fallback), the --gpus hook stand-in, and a fresh discovery cache. Idempotent: files are only written when their
content differs."""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from provision import __version__, effects, paths
from provision.fsutil import read_trusted, write_file
from provision.inject import discover
from provision.inject.frontend_build import compile_front_end
from provision.inject.modify import HOOK_MARKER, HOOK_NAME
from provision.inject.settings import Settings, settings_path
from provision.inject.sources import source_files

HERE = Path(__file__).resolve().parent
STAMP = paths.INSTALL_STAMP


def _stamp(prefix: str, driver_root: str) -> str:
    srcs = b"".join(p.read_bytes() for p in source_files())
    srcs += SHIPPED.read_bytes() if SHIPPED.exists() else b""
    return json.dumps({"version": __version__, "src": hashlib.sha256(srcs).hexdigest()[:16], "prefix": prefix,
                       "driver_root": driver_root, "python": sys.executable,
                       "runc": shutil.which("runc"), "settings": settings_path()}, sort_keys=True)


def is_installed(driver_root: str = "/", prefix: str = "/usr/local") -> bool:
    """Fast check for re-runs: same sources, paths and settings as the last install, and the files still there."""
    try:  # a stamp nobody but root could have written (fsutil.open_trusted); any other is a miss
        same = read_trusted(STAMP) == _stamp(prefix, driver_root).encode()
    except OSError:
        return False
    return same and (Path(prefix) / "bin" / "gpuprov-runtime").exists() and Path(settings_path()).exists()


@dataclass
class InstallResult:
    runtime_path: str
    compiled: bool
    origin: str | None = None  # "wheel" (shipped binary), "built-here" (compiled at install), None (Python)
    changed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _write_if_changed(path: Path, data: bytes, mode: int, changed: list[str]) -> None:
    try:
        if path.read_bytes() == data and (path.stat().st_mode & 0o777) == mode:
            return
    except OSError:
        pass
    write_file(path, data, mode=mode, keep_mode=False, backup=False)
    changed.append(str(path))


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


def front_end(runc: str, python: str, compile_shim: bool = True) -> tuple[bytes | None, str | None, list[str]]:
    """(binary, origin, notes): the wheel's binary when it runs on this host, else one compiled here, else None.
    Each candidate is run once (`--gpuprov-front-end`) before it is trusted with every container start."""
    notes: list[str] = []
    paths = {"runc": runc, "python": python, "modify": str(HERE / "modify_main.py")}
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


def python_fallback(python: str) -> bytes:
    root = HERE.parent.parent
    # one shebang argument only (Linux passes the rest as a single word): -IS = isolated, no site
    return (f"#!{python} -IS\n# gpuprov-runtime (Python fallback: no compiled front-end runs on this host)\n"
            f"import sys\nsys.path.insert(0, {str(root)!r})\nfrom provision.inject.shim import main\n"
            "raise SystemExit(main())\n").encode()


def install_runtime(prefix: str = "/usr/local", *, runc: str | None = None, driver_root: str = "/",
                    dev_root: str = "/", proc_root: str = "/", accept_env_unprivileged: bool = True,
                    compile_shim: bool = True) -> InstallResult:
    changed: list[str] = []
    notes: list[str] = []
    runc = runc or shutil.which("runc") or "/usr/sbin/runc"
    python = sys.executable
    # checked as the runtime will read it back: a value it would refuse is never written
    settings = Settings.from_dict({"runc": runc, "driver_root": driver_root, "dev_root": dev_root,
                                   "proc_root": proc_root, "accept_env_unprivileged": accept_env_unprivileged},
                                  settings_path())
    _write_if_changed(Path(settings_path()), (json.dumps(settings.to_dict(), indent=2) + "\n").encode(), 0o644,
                      changed)
    bindir = Path(prefix) / "bin"
    shim, origin, notes = front_end(runc, python, compile_shim)
    target = bindir / "gpuprov-runtime"
    _write_if_changed(target, shim or python_fallback(python), 0o755, changed)
    if shim is None:
        notes.append("no usable compiled front-end (none in the wheel, no C compiler): installed the Python fallback "
                     "runtime (a Python start-up on every container start)")
    existing = shutil.which(HOOK_NAME)
    if existing and HOOK_MARKER not in Path(existing).read_bytes()[:4096]:
        notes.append(f"NVIDIA's {existing} is installed: left alone; --gpus containers use NVIDIA's hook")
    else:
        _write_if_changed(bindir / HOOK_NAME, (HERE / "hook.sh").read_bytes(), 0o755, changed)
    try:
        discover.refresh(driver_root, settings.cache, proc_root, dev_root)
    except OSError as exc:
        notes.append(f"discovery cache not written: {exc}")
    try:
        write_file(STAMP, _stamp(prefix, driver_root), mode=0o644, keep_mode=False, backup=False)  # dirs: 0755
    except OSError:
        pass
    return InstallResult(str(target), shim is not None, origin, changed, notes)

