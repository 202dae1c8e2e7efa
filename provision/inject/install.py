"""Install the runtime on a host: settings, the compiled front-end (or a Python fallback), the --gpus hook
stand-in, and a fresh discovery cache. Idempotent: files are only written when their content differs."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from provision.fsutil import write_file
from provision.inject import discover
from provision.inject.modify import HOOK_MARKER, HOOK_NAME
from provision.inject.settings import DEFAULTS, settings_path

HERE = Path(__file__).resolve().parent
STAMP = "/var/lib/gpuprov/runtime/install.stamp"


def _stamp(prefix: str, driver_root: str) -> str:
    from provision import __version__

    srcs = b"".join((HERE / n).read_bytes() for n in ("shim.c", "hook.sh", "modify.py", "edits.py", "discover.py"))
    return json.dumps({"version": __version__, "src": hashlib.sha256(srcs).hexdigest()[:16], "prefix": prefix,
                       "driver_root": driver_root, "python": sys.executable,
                       "runc": shutil.which("runc"), "settings": settings_path()}, sort_keys=True)


def is_installed(driver_root: str = "/", prefix: str = "/usr/local") -> bool:
    """Fast check for re-runs: same sources, paths and settings as the last install, and the files still there."""
    try:
        same = Path(STAMP).read_text() == _stamp(prefix, driver_root)
    except OSError:
        return False
    return same and (Path(prefix) / "bin" / "gpuprov-runtime").exists() and Path(settings_path()).exists()


@dataclass
class InstallResult:
    runtime_path: str
    compiled: bool
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


def build_shim(runc: str, python: str, out: Path) -> bytes | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    with tempfile.TemporaryDirectory() as td:
        exe = Path(td) / "gpuprov-runtime"
        cmd = [cc, "-O2", "-s", f'-DRUNC="{runc}"', f'-DPYTHON="{python}"',
               f'-DMODIFY="{HERE / "modify_main.py"}"', str(HERE / "shim.c"), "-o", str(exe)]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return None
        return exe.read_bytes()


def python_fallback(python: str) -> bytes:
    root = HERE.parent.parent
    # one shebang argument only (Linux passes the rest as a single word): -IS = isolated, no site
    return (f"#!{python} -IS\n# gpuprov-runtime (Python fallback: no C compiler was found at install time)\n"
            f"import sys\nsys.path.insert(0, {str(root)!r})\nfrom provision.inject.shim import main\n"
            "raise SystemExit(main())\n").encode()


def install_runtime(prefix: str = "/usr/local", *, runc: str | None = None, driver_root: str = "/",
                    dev_root: str = "/", proc_root: str = "/", accept_env_unprivileged: bool = True,
                    compile_shim: bool = True) -> InstallResult:
    changed: list[str] = []
    notes: list[str] = []
    runc = runc or shutil.which("runc") or "/usr/sbin/runc"
    python = sys.executable
    settings = {**DEFAULTS, "runc": runc, "driver_root": driver_root, "dev_root": dev_root, "proc_root": proc_root,
                "accept_env_unprivileged": accept_env_unprivileged}
    _write_if_changed(Path(settings_path()), (json.dumps(settings, indent=2) + "\n").encode(), 0o644, changed)
    bindir = Path(prefix) / "bin"
    shim = build_shim(runc, python, bindir) if compile_shim else None
    target = bindir / "gpuprov-runtime"
    _write_if_changed(target, shim or python_fallback(python), 0o755, changed)
    if shim is None:
        notes.append("no C compiler: installed the Python fallback runtime (slower container starts)")
    existing = shutil.which(HOOK_NAME)
    if existing and HOOK_MARKER not in Path(existing).read_bytes()[:4096]:
        notes.append(f"NVIDIA's {existing} is installed: left alone; --gpus containers use NVIDIA's hook")
    else:
        _write_if_changed(bindir / HOOK_NAME, (HERE / "hook.sh").read_bytes(), 0o755, changed)
    try:
        discover.refresh(driver_root, settings["cache"], proc_root, dev_root)
    except OSError as exc:
        notes.append(f"discovery cache not written: {exc}")
    try:
        Path(STAMP).parent.mkdir(parents=True, exist_ok=True)
        Path(STAMP).write_text(_stamp(prefix, driver_root))
    except OSError:
        pass
    return InstallResult(str(target), shim is not None, changed, notes)

