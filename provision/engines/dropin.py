"""What the engines gpuprov configures through a drop-in file of its own share (CRI-O's crio.conf.d, Podman's
containers.conf.d): where the file goes, the operator's TOML read strictly, the request checked before anything is
read, and the undo (the file removed when it is gpuprov's, by its header; the operator's files are never edited)."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import tomlkit

from provision.engines import cri as cri_names
from provision.engines.base import Change, Engine, EnginePlan, RuntimeRequest, read_config
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


def unplan(path: Path, root: Path, header: str, *, reload: bool) -> EnginePlan:
    """gpuprov's drop-in at host path `path` (read under `root`) removed, when its first line is gpuprov's header."""
    text = read_config(under(root, str(path)))
    if text is None or not text.startswith("# " + header.splitlines()[0]):
        return EnginePlan([], [])
    return EnginePlan([], [Change(str(path), "removed", reload=reload)], removals=[path])


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
        """gpuprov's drop-in removed, when it is gpuprov's (its header); the operator's files are never edited."""
        return unplan(path, root, self.header, reload=self.undo_reload)
