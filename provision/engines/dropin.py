"""What the engines gpuprov configures through a drop-in file of its own share (CRI-O's crio.conf.d, Podman's
containers.conf.d): where the file goes, the operator's TOML read strictly, the request checked before anything is
read, and the undo: gpuprov's keys taken out of its drop-in, the operator's lines added there since kept (the file
removed only when nothing of theirs is left); the operator's other files are never edited."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import tomlkit

from provision.engines import cri as cri_names
from provision.engines.base import Change, Engine, EnginePlan, FileEdit, RuntimeRequest, read_config
from provision.errors import ConfigInvalid
from provision.facts.rootfs import under


def config_path(config: str | None, directory: str, name: str, main: str = "") -> Path:
    """--config names the drop-in file, or the drop-in directory (then gpuprov's file `name` goes in it), or the
    engine's main file `main` (by its name: the one detect reports, and an adopted engine's config): then gpuprov's
    file goes in the drop-in directory beside it (`main`.d), never into the operator's file."""
    p = Path(config or directory)
    if main and p.name == Path(main).name:
        p = p.with_name(p.name + ".d")
    return p / name if p.is_dir() or p.name.endswith(".d") else p


def document(header: str, req: RuntimeRequest) -> tomlkit.TOMLDocument:
    """A new drop-in for `req` (its name and path checked first: exit 2), opening with gpuprov's header."""
    cri_names.validate(req.name, req.path)
    doc = tomlkit.document()
    for line in header.splitlines():
        doc.add(tomlkit.comment(line))
    return doc


def load(path: Path) -> dict:
    """A TOML file as the engine reads it (missing: empty); what the engine would refuse is exit 6."""
    text = read_config(path)
    try:
        return tomlkit.parse(text or "").unwrap()
    except Exception as exc:  # tomlkit's ParseError subclasses (duplicate keys included)
        raise ConfigInvalid(f"{path} is not valid TOML ({exc}); fix it, then run again (nothing was "
                            "changed)") from None


def read_ours(path: Path, req: RuntimeRequest) -> str | None:
    """The request's name and path checked (exit 2), then gpuprov's drop-in as it is now (None: not there yet);
    hand-edited into something the engine cannot read: exit 6, untouched."""
    cri_names.validate(req.name, req.path)
    old = read_config(path)
    if old is not None:
        load(path)
    return old


def _strip(cur, ours: dict) -> None:
    """Take out of the parsed TOML `cur` (in place) every key of `ours` that still holds gpuprov's value, and the
    tables that leaves empty; a key the operator changed, and every key gpuprov did not write, stay."""
    for key, value in ours.items():
        if key not in cur:
            continue
        mine = cur[key]
        if isinstance(value, dict) and isinstance(mine, dict):
            _strip(mine, value)
            if not len(mine):
                del cur[key]
        elif (mine.unwrap() if hasattr(mine, "unwrap") else mine) == value:
            del cur[key]


def without_ours(current: str, written: str, header_lines: list[str]) -> str | None:
    """The drop-in `current` with gpuprov's keys (those of `written`, gpuprov's last write, still with the values it
    wrote) and its header comment taken out: the operator's keys and lines kept. None when nothing but blank lines
    is left (the file then goes). Text that is not TOML: None only when it is still exactly what gpuprov wrote."""
    if current == written:
        return None
    try:
        doc = tomlkit.parse(current)
        _strip(doc, tomlkit.parse(written).unwrap())
    except Exception:  # tomlkit's ParseError subclasses: keep the operator's file as it is
        return current
    left = [ln for ln in tomlkit.dumps(doc).splitlines(keepends=True) if ln.rstrip("\n") not in header_lines]
    return "".join(left).lstrip("\n") if any(ln.strip() for ln in left) else None


def undo_dropin(path: Path, current: str | None, written: str | None, header_lines: list[str],
                *, reload: bool) -> EnginePlan:
    """The undo of gpuprov's drop-in at host path `path`: removed when nothing of the operator's is left in it,
    else only gpuprov's keys and header taken out (without_ours). `written` None: no record; the file is then
    gpuprov's only while it starts with gpuprov's header, and its keys are what it holds (removed whole)."""
    if current is None or written is None and not current.startswith(header_lines[0]):
        return EnginePlan([], [])
    new = without_ours(current, written if written is not None else current, header_lines)
    if new is None:
        return EnginePlan([], [Change(str(path), "removed", reload=reload)], removals=[path])
    if new == current:
        return EnginePlan([], [])
    return EnginePlan([FileEdit(path, current, new)], [Change(str(path), "gpuprov's keys removed, yours kept",
                                                              reload=reload)])


def header_lines(header: str) -> list[str]:
    """A drop-in header as the comment lines dropin.document writes."""
    return ["# " + ln for ln in header.splitlines()]


def unplan(path: Path, root: Path, header: str, entry: dict | None, *, reload: bool) -> EnginePlan:
    """gpuprov's drop-in at host path `path` (read under `root`): its keys out (undo_dropin), by the record's
    `written` text when there is one."""
    written = ((entry or {}).get("files", {}).get(str(path)) or {}).get("written")
    return undo_dropin(path, read_config(under(root, str(path))), written, header_lines(header), reload=reload)


class DropinEngine(Engine):
    """An adapter whose whole configuration is gpuprov's own drop-in: `default_config` is the drop-in directory or
    the engine's main file `main_config` (the drop-in directory is beside it: `main_config`.d), `dropin_name`
    gpuprov's file in that directory, `header` its first comment lines (what marks it gpuprov's)."""
    dropin_name: ClassVar[str]
    header: ClassVar[str]
    main_config: ClassVar[str]  # the engine's own main file: never written, a --config naming it means its .d
    undo_reload: ClassVar[bool] = False  # True: taking the file out needs no restart (the engine reads it each time)

    def config_path(self, config: str | None, req: RuntimeRequest) -> Path:
        return config_path(config, self.default_config, self.dropin_name, self.main_config)

    def unplan(self, path: Path, entry: dict | None, *, root: Path = Path("/")) -> EnginePlan:
        """gpuprov's keys out of its drop-in (the file removed when nothing else is left in it); the operator's other
        files are never edited."""
        return unplan(path, root, self.header, entry, reload=self.undo_reload)
