"""`gpuprov k8s node`: make a containerd or CRI-O node ready for a cluster's GPU pods, in one idempotent run:
the runtime as CRI handler `nvidia` (the engine adapter's drop-in, CDI enabled), the CDI spec in /var/run/cdi with a
boot-time refresh (the loaded driver can only change across a reboot, and /var/run is emptied by one), and the GPU
labels for NFD's local source."""
from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from provision import effects, engines
from provision.engines.base import Engine
from provision.engines.configure import configure
from provision.errors import UsageError
from provision.fsutil import write_file
from provision.inject.cdi import generate_spec, refresh_units, render
from provision.k8s.labels import NFD_FILE, nfd_file

if TYPE_CHECKING:
    from provision.inject.discover import Discovery

CDI_SPEC = "/var/run/cdi/nvidia.yaml"
REFRESH_UNIT = "/etc/systemd/system/gpuprov-cdi-refresh.service"


@dataclass
class NodeResult:
    engine: str
    changed: list[str] = field(default_factory=list)
    engine_result: dict | None = None
    cdi_spec: str | None = None
    labels_file: str | None = None
    labels: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def cri_engines() -> list[Engine]:
    """The adapters of the engines kubelet talks to (CRI), in the order `--engine auto` looks for them."""
    return [e for e in engines.every() if e.serves_cri]


def pick_engine(asked: str) -> str:
    cri = {e.name: e for e in cri_engines()}
    if asked in cri:
        return asked
    if asked != "auto":
        raise UsageError(f"--engine {asked!r}: use {', '.join(cri)} or auto")
    for e in cri.values():
        if shutil.which(e.daemon):
            return e.name
    raise UsageError("neither containerd nor CRI-O is installed: `gpuprov bootstrap --engine containerd` first, "
                     "or name one with --engine")


def engine_has_cdi(engine: str) -> bool:
    """Does this node's CRI engine apply CDI devices? (its adapter's has_cdi: containerd from 1.7; CRI-O always)"""
    return engines.get(engine).has_cdi()


def installed_engine_has_cdi() -> bool:
    """Whether a CRI engine installed here applies CDI devices."""
    return any(shutil.which(e.daemon) and e.has_cdi() for e in cri_engines())


def write_if_changed(path: str, text: str, mode: int = 0o644) -> bool:
    """Through the team's one write path (provision/fsutil.py: unnamed O_TMPFILE or hidden temp file, fsync,
    rename), so NFD's watcher and the engine never read half a file; unchanged content is not rewritten."""
    try:
        if Path(path).read_text() == text:
            return False
    except OSError:
        pass
    write_file(path, text, mode=mode, backup=False)
    return True


def cdi_spec_text(disc: Discovery) -> str:
    return render(generate_spec(disc))


def refresh_unit(engine: str, gpuprov: str) -> str:
    """The one CDI refresh unit (provision/inject/cdi.py: refresh_units), ordered before this node's engine."""
    return refresh_units(gpuprov, f"{engines.get(engine).unit}.service")["gpuprov-cdi-refresh.service"]


def setup(engine: str, *, runtime_path: str, default: bool, cdi: bool, dry_run: bool, disc: Discovery | None,
          labels: dict[str, str] | None, config: str | None = None, root: str = "/") -> NodeResult:
    res = NodeResult(engine)
    eng = configure(engine, config=config, runtime_name="nvidia", runtime_path=runtime_path, default=default,
                    cdi=cdi, dry_run=dry_run)
    res.engine_result = eng.to_dict()
    if eng.changed:
        res.changed.append(f"{engine}: " + "; ".join(eng.changes))
    res.labels = labels or {}
    files = [(NFD_FILE, nfd_file(labels), "labels")] if labels else []
    if cdi:
        if disc:  # no driver yet (a reboot pending): the refresh unit writes the spec at the next boot
            files.append((CDI_SPEC, cdi_spec_text(disc), "CDI spec"))
        if Path(root, "run/systemd/system").is_dir():
            gp = shutil.which("gpuprov") or "/usr/local/bin/gpuprov"
            files.append((REFRESH_UNIT, refresh_unit(engine, gp), "CDI refresh unit"))
    for path, text, what in files:
        target = os.path.join(root, path.lstrip("/"))
        if dry_run:
            try:
                same = Path(target).read_text() == text
            except OSError:
                same = False
            if not same:
                res.changed.append(f"would write {what} {path}")
        elif write_if_changed(target, text):
            res.changed.append(f"wrote {what} {path}")
            if path == REFRESH_UNIT:
                effects.run(["systemctl", "daemon-reload"], check=False)
                effects.run(["systemctl", "enable", "gpuprov-cdi-refresh.service"], check=False)
    res.cdi_spec = CDI_SPEC if cdi and disc else None
    res.labels_file = NFD_FILE if labels else None
    return res
