"""uninstall_steps: bootstrap's inverse, as the same typed steps (plan/steps.py), so what `uninstall --dry-run`
prints is what `uninstall` runs. Built from what is on the host now (read under `root`) and from gpuprov's install
record (provision/record.py); a step exists only where there is something of gpuprov's to take away, so a second
uninstall plans nothing but releasing its own lock.

Order: the engines first (their configs without gpuprov's keys, each engine reloaded only where its config changed),
so that no engine names the runtime once it is gone; then the validation images, the MPS daemon, the refresh units,
the CDI specs, the NFD labels, the runtime (its warm editor stopped first), the packages when asked (only those
gpuprov installed: the record), and last gpuprov's state, caches and logs. Packages stay unless asked.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

from provision import engines, paths, record
from provision.engines import validate
from provision.engines.base import RuntimeRequest
from provision.facts.rootfs import is_live, under
from provision.hostlock import LOCK_NAME, lock_dirs
from provision.inject import cdi, devchar, server
from provision.inject.install import EDITOR_LIB
from provision.inject.modify import HOOK_MARKER, HOOK_NAME
from provision.inject.settings import settings_path
from provision.k8s.labels import NFD_FILE
from provision.options import Stage
from provision.plan import persistence
from provision.plan.apply import LOG_FILE
from provision.plan.driver import NOUVEAU_CONF
from provision.plan.packages import APT_ENV
from provision.plan.steps import (
    Command,
    Never,
    ReloadEngine,
    Step,
    StopSharing,
    Undone,
    WriteFile,
    packages_installed,
    read_or_empty,
)
from provision.probe.cache import cache_dir

UNIT_DIR = "/etc/systemd/system"
UNITS = ("gpuprov-cdi-refresh.path", "gpuprov-cdi-refresh.service", "gpuprov-mps.service", devchar.UNIT)
LABELS_HEADER = "# GPU node labels"  # k8s/labels.py: nfd_file's first line


@dataclass(frozen=True)
class UninstallOptions:
    driver: bool = False  # --driver: purge the driver packages gpuprov installed, and their holds
    engine: bool = False  # --engine: purge the engine packages gpuprov installed (never ones it found)


def _exists(root: Path, path: str) -> bool:
    return os.path.lexists(under(root, path))


def _rm(*paths_: str, tree: bool = False) -> Command:
    return Command(("rm", "-rf" if tree else "-f", "--", *paths_))


# ---------------------------------------------------------------- engines


def _configs(rec: record.Record) -> list[tuple[str, str]]:
    """(engine, config path): every config the record names, then each adapter's default config."""
    out = [(e.get("engine"), c) for c, e in rec.configs.items() if e.get("engine") in engines.names()]
    for name in engines.names():  # every adapter's default config
        eng = engines.get(name)
        out.append((name, str(eng.config_path(None, RuntimeRequest("nvidia", "/")))))
    return list(dict.fromkeys(out))


def _backups(root: Path, path: str) -> list[str]:
    """gpuprov's backups beside a config it edited (fsutil: `<name>.gpuprov-<stamp>[-N].bak`)."""
    found = glob.glob(glob.escape(str(under(root, path))) + ".gpuprov-*.bak")
    return sorted("/" + os.path.relpath(p, root) for p in found)


def engine_steps(root: Path, rec: record.Record) -> list[Step]:
    steps = []
    for name, config in _configs(rec):
        eng = engines.get(name)
        entry = rec.configs.get(config) if rec.configs.get(config, {}).get("engine") == name else None
        plan = eng.unplan(Path(config), entry, root=root)
        files = sorted({str(e.path) for e in plan.edits} | {str(p) for p in plan.removals}
                       | set((entry or {}).get("files", {})))
        baks = [b for f in files for b in _backups(root, f)]
        if not plan.changed and not baks:
            continue
        gone = [str(p) for p in plan.removals]
        dirs = [d for d in (entry or {}).get("made_dirs", []) if _empty_after(root, d, gone)]
        actions: list = [WriteFile(str(e.path), e.new, backup=False) for e in plan.edits if e.changed]
        actions += [_rm(*gone)] if gone else []
        actions += [_rm(*baks)] if baks else []
        actions += [Command(("rmdir", "--", *dirs))] if dirs else []
        if plan.changed:
            actions.append(ReloadEngine(name, config, restart=plan.needs_restart))
        what = ", ".join(str(c) for c in plan.changes) or "gpuprov's backups"
        steps.append(Step(f"uninstall.engine.{name}", Stage.RUNTIME,
                          f"Take gpuprov out of {name}'s config {config} ({what})", actions=tuple(actions),
                          check=Undone(tuple((str(e.path), e.new) for e in plan.edits if e.changed),
                                       tuple(gone + baks + dirs)),
                          notes=tuple(plan.warnings)))
    return steps


def _empty_after(root: Path, d: str, removed: list[str]) -> bool:
    """A directory gpuprov made that holds nothing but what this uninstall removes."""
    try:
        left = {e.name for e in os.scandir(under(root, d))}
    except OSError:
        return False
    return left <= {os.path.basename(p) for p in removed if os.path.dirname(p) == d.rstrip("/")}


# ---------------------------------------------------------------- what bootstrap and its siblings left


def image_steps(root: Path) -> list[Step]:
    """The validation images (every gpuprov version's tag), in each engine that answers. Only on the live host."""
    if not is_live(root):
        return []
    argvs = validate.leftover_image_argvs()
    if not argvs:
        return []
    return [Step("uninstall.images", Stage.VALIDATE, "Remove gpuprov's validation images",
                 actions=tuple(Command(a, may_fail=may) for a, may in argvs),
                 check=Never("the images were listed while planning"))]


def service_steps(root: Path) -> list[Step]:
    steps = []
    if _exists(root, paths.SHARE_STATE):
        steps.append(Step("uninstall.mps", Stage.RUNTIME, "Stop GPU sharing (the MPS control daemon) and remove "
                          "its state", actions=(StopSharing(),),
                          check=Undone(gone=(paths.SHARE_STATE,))))
    units = [f"{UNIT_DIR}/{u}" for u in UNITS if _exists(root, f"{UNIT_DIR}/{u}")]
    if units:
        systemd = under(root, "/run/systemd/system").is_dir()
        names = tuple(os.path.basename(u) for u in units)
        acts = ([Command(("systemctl", "disable", "--now", *names), may_fail=True)] if systemd else []) \
            + [_rm(*units)] + ([Command(("systemctl", "daemon-reload"))] if systemd else [])
        steps.append(Step("uninstall.units", Stage.RUNTIME, f"Stop and remove gpuprov's units: {' '.join(names)}",
                          actions=tuple(acts), check=Undone(gone=tuple(units))))
    return steps


def persistence_steps(root: Path, rec: record.Record) -> list[Step]:
    """nvidia-persistenced disabled, only where bootstrap enabled it (the record) and it is enabled still."""
    if persistence.UNIT not in rec.enabled or not os.path.lexists(under(root, persistence.WANTS)):
        return []
    return [Step("uninstall.persistence", Stage.DRIVER, f"Disable {persistence.UNIT} (gpuprov enabled it)",
                 actions=(Command(("systemctl", "disable", "--now", persistence.UNIT)),),
                 check=Undone(gone=(persistence.WANTS,)))]


def dev_char_steps(root: Path) -> list[Step]:
    """The /dev/char links gpuprov made (its record in /run), only those still pointing where gpuprov pointed them,
    and its udev rule. A link udev or the operator made is never in the record."""
    links = devchar.ours_now(str(under(root, devchar.RECORD)), str(root))
    rule = [devchar.UDEV_RULE] if _exists(root, devchar.UDEV_RULE) else []
    if not links and not rule:
        return []
    return [Step("uninstall.dev-char", Stage.RUNTIME, "Remove the /dev/char links gpuprov made for NVIDIA's nodes "
                 "and its udev rule", actions=(_rm(*links, *rule),), check=Undone(gone=tuple(links + rule)))]


def file_steps(root: Path) -> list[Step]:
    """The CDI specs and the NFD labels file, each only when gpuprov wrote it (its marker)."""
    specs = [f"{d}/{cdi.SPEC_NAME}" for d in cdi.SPEC_DIRS
             if cdi.MARKER in read_or_empty(under(root, f"{d}/{cdi.SPEC_NAME}"))]
    labels = [NFD_FILE] if read_or_empty(under(root, NFD_FILE)).startswith(LABELS_HEADER) else []
    steps = []
    if specs:
        steps.append(Step("uninstall.cdi", Stage.RUNTIME, "Remove the CDI specs gpuprov wrote",
                          actions=(_rm(*specs),), check=Undone(gone=tuple(specs))))
    if labels:
        steps.append(Step("uninstall.labels", Stage.RUNTIME, "Remove gpuprov's NFD labels file",
                          actions=(_rm(*labels),), check=Undone(gone=tuple(labels))))
    return steps


def _prefix(root: Path) -> str:
    try:
        return json.loads(read_or_empty(under(root, paths.INSTALL_STAMP)) or "{}").get("prefix") or "/usr/local"
    except ValueError:
        return "/usr/local"


def _editor_pid(root: Path) -> int | None:
    """The warm editor's pid (its lock file names it), when it is running (only on the live host)."""
    if not is_live(root):
        return None
    try:
        pid = int(read_or_empty(server.lock_path(server.socket_path())).split()[0])
        os.kill(pid, 0)
    except (IndexError, ValueError, OSError):
        return None
    return pid


def runtime_steps(root: Path) -> list[Step]:
    bindir = f"{_prefix(root)}/bin"
    hook = f"{bindir}/{HOOK_NAME}"
    files = [p for p in (f"{bindir}/gpuprov-runtime", settings_path()) if _exists(root, p)]
    lib = f"{_prefix(root)}/{EDITOR_LIB}"  # the editor's copies (inject/install.py)
    trees = [lib] if _exists(root, lib) else []
    if HOOK_MARKER.decode() in read_or_empty(under(root, hook), 4096):  # NVIDIA's own hook is never gpuprov's
        files.append(hook)
    etc = os.path.dirname(settings_path())
    dirs = [etc] if _exists(root, etc) and _empty_after(root, etc, files) else []
    pid = _editor_pid(root)
    if not files and not dirs and not trees and pid is None:
        return []
    acts: list = [Command(("kill", "-TERM", str(pid)), may_fail=True)] if pid else []
    acts += [_rm(*files)] if files else []
    acts += [_rm(*trees, tree=True)] if trees else []
    acts += [Command(("rmdir", "--", *dirs))] if dirs else []
    return [Step("uninstall.runtime", Stage.RUNTIME, "Remove gpuprov-runtime, its editor's code, its --gpus hook "
                 "stand-in and its settings" + (f" (the warm editor, pid {pid}, stopped first)" if pid else ""),
                 actions=tuple(acts), check=Undone(gone=tuple(files + trees + dirs)))]


def package_steps(root: Path, rec: record.Record, opt: UninstallOptions) -> list[Step]:
    """Only what the record says gpuprov installed and held, and only what is still installed."""
    steps = []
    for stage, asked in ((Stage.DRIVER, opt.driver), (Stage.ENGINE, opt.engine)):
        pkgs = tuple(p for p in rec.packages.get(stage.value, []) if packages_installed("apt", (p,), root))
        holds = tuple(p for p in rec.holds if p in pkgs) if stage == Stage.DRIVER else ()
        extra = (NOUVEAU_CONF,) if stage == Stage.DRIVER and _exists(root, NOUVEAU_CONF) else ()
        if not asked or not (pkgs or extra):
            continue
        acts: list = [Command(("apt-mark", "unhold", *holds))] if holds else []
        acts += [Command(("apt-get", "purge", "-y", *pkgs), APT_ENV)] if pkgs else []
        acts += [_rm(*extra)] if extra else []
        steps.append(Step(f"uninstall.{stage.value}.packages", stage,
                          f"Purge the {stage.value} packages gpuprov installed: {' '.join(pkgs) or 'none'}",
                          actions=tuple(acts), check=Undone(gone=extra) if not pkgs else Never()))
    return steps


def state_steps(root: Path) -> list[Step]:
    """gpuprov's state (the install record included), caches, logs and /run/gpuprov (but the lock this run holds:
    see release_step)."""
    lock = lock_path()
    run = [os.path.join(paths.RUN_DIR, e.name) for e in _scan(under(root, paths.RUN_DIR))
           if os.path.join(paths.RUN_DIR, e.name) != lock]
    trees = [d for d in (paths.STATE_DIR, str(LOG_FILE.parent), str(cache_dir())) if _exists(root, d)] + run
    if not trees:
        return []
    return [Step("uninstall.state", Stage.RUNTIME, "Remove gpuprov's state, discovery cache, logs and /run/gpuprov",
                 actions=(_rm(*trees, tree=True),), check=Undone(gone=tuple(trees)))]


def _scan(d: Path) -> list[os.DirEntry]:
    try:
        return sorted(os.scandir(d), key=lambda e: e.name)
    except OSError:
        return []


def lock_path() -> str:
    return os.path.join(lock_dirs()[0], LOCK_NAME)


def release_step() -> Step:
    """Run once the host lock is released: its file, and its directory when nothing else is in it. It removes only
    what the uninstall run itself made (taking the lock creates it), so it never counts as a change."""
    lock = lock_path()
    return Step("uninstall.lock", Stage.RUNTIME, f"Remove the host lock {lock} once released",
                actions=(_rm(lock), Command(("rmdir", "--ignore-fail-on-non-empty", "--", os.path.dirname(lock)))),
                check=Never("runs after the host lock is released"), verify_only=True)


def uninstall_steps(root: Path, opt: UninstallOptions, rec: record.Record | None = None) -> list[Step]:
    """The steps in the order they run, the release of the host lock last (the command runs it after the others,
    with the lock released)."""
    rec = rec if rec is not None else record.read(str(under(root, paths.INSTALL_RECORD)))
    return (engine_steps(root, rec) + image_steps(root) + service_steps(root) + dev_char_steps(root)
            + persistence_steps(root, rec) + file_steps(root)
            + runtime_steps(root) + package_steps(root, rec, opt) + state_steps(root) + [release_step()])

