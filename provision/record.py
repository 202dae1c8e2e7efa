"""What gpuprov changed on this host, kept for `gpuprov uninstall` (paths.INSTALL_RECORD, 0600: it holds copies of
engine configs). Written through the one write path; read leniently (a missing or unreadable record is an empty
one: uninstall then finds gpuprov's keys by what they are, see the engine adapters' `unplan`).

- `configs`: per engine config that `engine configure` (and so bootstrap) wrote, keyed by the config's path: the
  engine, the runtime's name and every runtime path registered there, every file written with its text before
  gpuprov's first write (`old`, null when gpuprov created it) and after its last (`written`), the operator's texts
  before later writes (`later`: what a later --replace-runtime replaced), and the directories it created. `old`
  is never restored blindly: the adapters use it only to give back the operator's exact bytes where the file is
  still what gpuprov wrote, or where their own edits since then apply cleanly to it (engines/base.py: undo_text).
- `enabled`: the units bootstrap enabled that were not enabled before it ran (nvidia-persistenced); uninstall
  disables these and no other.
- `packages`: per stage (driver, engine), the packages a bootstrap installed that were not installed before it ran;
  `holds`: the packages it held. `uninstall --driver/--engine` remove these and nothing else.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from provision import paths
from provision.fsutil import write_file

SCHEMA = "gpuprov.installed/v1"


@dataclass
class Record:
    configs: dict[str, dict] = field(default_factory=dict)
    packages: dict[str, list[str]] = field(default_factory=dict)
    holds: list[str] = field(default_factory=list)
    enabled: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, "configs": self.configs, "packages": self.packages,
                           "holds": self.holds, "enabled": self.enabled}, indent=2, sort_keys=True) + "\n"


def read(path: str | None = None) -> Record:
    try:
        with open(path or paths.INSTALL_RECORD) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return Record()
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        return Record()
    return Record(dict(doc.get("configs") or {}), dict(doc.get("packages") or {}), list(doc.get("holds") or []),
                  [u for u in doc.get("enabled") or [] if isinstance(u, str)])


def _save(rec: Record) -> None:
    write_file(paths.INSTALL_RECORD, rec.to_json(), mode=0o600, keep_mode=False, backup=False)


def note_config(config: str, engine: str, runtime_name: str, runtime_path: str,
                files: list[tuple[str, str | None, str]], made_dirs: list[str]) -> None:
    """An engine config written: `files` as (path, text before, text written). The first `old` of a file is kept
    (the operator's, before any gpuprov write); `written` is the latest."""
    rec = read()
    entry = rec.configs.setdefault(config, {"engine": engine, "files": {}, "made_dirs": [], "runtime_paths": []})
    entry.update(engine=engine, runtime_name=runtime_name)
    entry["runtime_paths"] = list(dict.fromkeys([*entry.get("runtime_paths", []), runtime_path]))
    for path, old, new in files:
        f = entry["files"].setdefault(path, {"old": old})
        if old is not None and old != f.get("written") and old != f["old"]:
            f.setdefault("later", []).append(old)  # the operator's text before a later write (--replace-runtime)
        f["written"] = new
    entry["made_dirs"] = list(dict.fromkeys([*entry.get("made_dirs", []), *made_dirs]))
    _save(rec)


def note_packages(stage: str, installed: list[str], held: list[str] = ()) -> None:
    if not installed and not held:
        return
    rec = read()
    rec.packages[stage] = list(dict.fromkeys([*rec.packages.get(stage, []), *installed]))
    rec.holds = list(dict.fromkeys([*rec.holds, *held]))
    _save(rec)


def note_enabled(unit: str) -> None:
    rec = read()
    if unit not in rec.enabled:
        rec.enabled.append(unit)
        _save(rec)
