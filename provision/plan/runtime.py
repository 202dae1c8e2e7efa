"""The runtime's host operations that both a command and a bootstrap step run: install gpuprov-runtime, refresh the
CDI spec and its units. One function each, so that `gpuprov runtime install`, `gpuprov cdi refresh` and the steps
`runtime.install` / `cdi.spec` (plan/steps.InstallRuntime, RefreshCdi) do the very same thing in-process."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from provision import effects, engines
from provision.errors import UNSUPPORTED, GpuprovError
from provision.facts.driver_facts import find_driver_root
from provision.fsutil import write_file
from provision.inject import devchar
from provision.inject.cdi import refresh_specs, refresh_units
from provision.inject.discover import discover
from provision.inject.install import install_runtime
from provision.inject.settings import load_settings, settings_path
from provision.output import kv

if TYPE_CHECKING:
    from provision.inject.discover import Discovery

CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
UNIT_DIR = Path("/etc/systemd/system")


def discover_host(driver_root: str | None, arch: bool = False) -> Discovery:
    """Discovery for this host, laid out as the runtime's settings describe it (driver/proc/dev roots)."""
    s = load_settings()  # the defaults (/proc and /dev under /) without a settings file
    if driver_root is None and os.path.exists(settings_path()):
        driver_root = s.driver_root
    if driver_root is None:
        found, _ = find_driver_root(Path("/"))
        driver_root = found or "/"
    disc = discover(driver_root, proc_root=s.proc_root, dev_root=s.dev_root, arch=arch)
    if not disc.version:
        raise GpuprovError(f"no NVIDIA driver found (driver root {driver_root}, /proc/driver/nvidia/version); "
                           "install one with `gpuprov bootstrap` or pass --driver-root", exit_code=UNSUPPORTED)
    return disc


def install(prefix: str = "/usr/local", *, driver_root: str | None = None, runc: str | None = None,
            dev_root: str | None = None, proc_root: str | None = None,
            accept_env_unprivileged: bool | None = None) -> tuple[dict, list[str]]:
    """Install gpuprov-runtime (and the --gpus hook) under PREFIX/bin and refresh discovery: (its record, the lines
    that say what was done, for people). A setting left None keeps runtime.json's (install_runtime), but the driver
    root and the low-level runtime, which are found on the host again (the driver's files move with the driver)."""
    if driver_root is None:
        driver_root = find_driver_root(Path("/"))[0] or "/"
    res = install_runtime(prefix, runc=runc, driver_root=driver_root, dev_root=dev_root, proc_root=proc_root,
                          accept_env_unprivileged=accept_env_unprivileged, front_ends=engines.front_ends())
    links, link_lines = dev_char(res.dev_root, install_units=res.dev_root == "/")
    front = "compiled" if res.compiled else "python"
    doc = {"runtime_path": res.runtime_path, "front_end": front, "front_end_origin": res.origin,
           "compiled": res.compiled, "changed": res.changed, "notes": res.notes, "dev_char": links}
    kind = f"compiled C ({res.origin})" if res.compiled else "Python fallback"
    lines = [kv([("runtime", res.runtime_path), ("front-end", kind), ("changed", ", ".join(res.changed) or "nothing")])]
    return doc, lines + link_lines + [f"note: {n}" for n in res.notes]


def dev_char(dev_root: str = "/", install_units: bool = True) -> tuple[dict, list[str]]:
    """The /dev/char links of NVIDIA's nodes now (devchar.link_nodes) and, when asked, the boot unit and udev rule
    that make them at every boot: (what was done, its lines for people). A planted dev/char is a refusal of the
    links alone (a note): the runtime itself is installed."""
    try:
        links = devchar.link_nodes(dev_root).to_dict()
        lines = [f"/dev/char links made: {', '.join(links['made']) or 'none needed'}"] + \
            [f"note: {p} is already something else: left alone" for p in links["other"]]
    except OSError as exc:
        links, lines = {"error": str(exc.strerror or exc)}, [f"note: /dev/char links not made: {exc.strerror or exc}"]
    if install_units:
        lines.append(install_dev_char_units())
    return links, lines


def install_dev_char_units() -> str:
    """gpuprov-dev-char.service (enabled where systemd runs) and the udev rule (udev told to reload), each only
    where its directory is (/etc/systemd/system, /etc/udev): a host without udev gets no rule, nor an /etc/udev made
    for it that uninstall would leave behind; the unit covers it at boot."""
    units = {p: t for p, t in devchar.dev_char_units(shutil.which("gpuprov") or "/usr/local/bin/gpuprov").items()
             if os.path.isdir(os.path.dirname(os.path.dirname(p)))}
    for path, text in units.items():
        write_file(path, text, backup=False)
    if os.path.isdir("/run/systemd/system"):
        effects.run(["systemctl", "daemon-reload"], check=False)
        effects.run(["systemctl", "enable", devchar.UNIT], check=False)
    if shutil.which("udevadm"):
        effects.run(["udevadm", "control", "--reload"], check=False)
    return f"installed {', '.join(units) or 'no boot unit or udev rule (neither systemd nor udev here)'}"


def refresh_cdi(driver_root: str | None, dirs: tuple[str, ...] = CDI_DIRS, install_units: bool = False) -> list[str]:
    """Write the CDI spec where engines read it (only when the driver changed) and, when asked, install and enable
    the gpuprov-cdi-refresh units; what was done, for people. The caller holds the host lock."""
    disc = discover_host(driver_root)
    s = load_settings()
    changed = refresh_specs(disc.driver_root, dirs=dirs, proc_root=s.proc_root, dev_root=s.dev_root)
    out = [f"wrote {p}" for p in changed] or ["CDI spec up to date"]
    return out + ([install_cdi_units()] if install_units else [])


def install_cdi_units(unit_dir: Path = UNIT_DIR) -> str:
    units = refresh_units(shutil.which("gpuprov") or "/usr/local/bin/gpuprov")
    for name, text in units.items():
        write_file(unit_dir / name, text, backup=False)
    if os.path.isdir("/run/systemd/system"):
        effects.run(["systemctl", "daemon-reload"], check=False)
        effects.run(["systemctl", "enable", "--now", "gpuprov-cdi-refresh.path"], check=False)
        effects.run(["systemctl", "enable", "gpuprov-cdi-refresh.service"], check=False)
    return f"installed {', '.join(units)} in {unit_dir}"
