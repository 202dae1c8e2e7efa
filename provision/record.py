"""What gpuprov changed on this host, kept for `gpuprov uninstall` (paths.INSTALL_RECORD, 0600: it holds copies of
engine configs). Written through the one write path; read back through the one trusted reader
(fsutil.read_trusted: the file and every directory above it root's and writable by no one else, else exit 6 naming
the file and the rule) and strictly, as a typed value: every field is checked by values.py's rules, and a field of
the wrong shape is exit 6 naming the file and the field (RecordInvalid), never a guess. Root acts on this file
(it restores configs from it, and purges the packages it names), so it is trusted no more than runtime.json is.
A missing record is an empty one: uninstall then finds gpuprov's keys by what they are (the adapters' `unplan`).

- `configs`: per engine config that `engine configure` (and so bootstrap) wrote, keyed by the config's path: the
  engine, the runtime's name and every runtime path registered there, every file written with its text before
  gpuprov's first write (`old`, null when gpuprov created it) and after its last (`written`), the operator's texts
  before later writes (`later`: what a later --replace-runtime replaced), and the directories it created. `old`
  is never restored blindly: the adapters use it only to give back the operator's exact bytes where the file is
  still what gpuprov wrote, or where their own edits since then apply cleanly to it (engines/base.py: undo_text).
- `enabled`: the units bootstrap enabled that were not enabled before it ran (nvidia-persistenced, ENABLED_UNITS);
  uninstall disables these and no other.
- `packages`: per stage (driver, engine), the packages a bootstrap installed that were not installed before it ran;
  `holds`: the packages it held. `uninstall --purge-driver/--purge-engine` remove these and nothing else; an
  uninstall that keeps them keeps this part of the record (`packages_only`), so that a later uninstall can still
  purge what gpuprov installed.
- `repo_config`: per stage, the package manager's configuration files (the adapter's `config_globs`: repository files,
  apt's sources, keyrings and pins, dnf's versionlock list) that the stage's steps added or changed, keyed by path:
  the text before gpuprov's first change (`old`, null when gpuprov's step created the file) and the text after its
  last (`written`, null for a file that is not text). `uninstall --purge-driver/--purge-engine` takes the stage's
  out again once its packages are gone (plan/pkgconfig.py): added files, and what the package manager leaves of
  them (.rpmsave, .dpkg-old), removed; changed ones given back as they were.
- `keys`: per stage, the signing keys its steps imported into the package manager's keyring (rpm's
  `gpg-pubkey-VERSION-RELEASE`); the same purge removes them.
- `boot`: the default boot entry gpuprov keeps on a kernel with an NVIDIA module while the kernel that would boot
  next has none (plan/boot_default.py): `method` "drop-in" (its file, `file`, sets GRUB_DEFAULT) or "saved"
  (grub-set-default, where the operator's GRUB_DEFAULT=saved; `saved_before`: grubenv's saved_entry before it, null
  when none), `kernel`, `unserved`, `entry`. Bootstrap takes it out once that kernel has its module, and so does
  `uninstall` (the drop-in removed, or saved_entry given back, then update-grub / grub-set-default).
- `streams`: the dnf module streams (by module name: `nvidia-driver`) a bootstrap enabled where the module had none
  enabled before it (a stream the operator enabled is not in it); `uninstall --purge-driver` resets these
  (`dnf module reset`) once the packages are gone, and no other.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from provision import paths, values
from provision.errors import ConfigInvalid
from provision.fsutil import read_trusted, write_file

SCHEMA = "gpuprov.installed/v1"
STAGES = ("driver", "engine")
BOOT_METHODS = ("drop-in", "saved")  # plan/boot_default.py: how the default boot entry was kept
ENABLED_UNITS = ("nvidia-persistenced.service",)  # the units a record may name in `enabled`


class RecordInvalid(ConfigInvalid):
    """The install record is not what gpuprov writes (a field missing or of the wrong type): exit 6."""


def _bad(path: str, where: str, want: str, got: object) -> RecordInvalid:
    return RecordInvalid(f"{path}: field '{where}' must be {want} (got {str(repr(got))[:60]}); it is not a record "
                         "gpuprov wrote: fix or remove it (uninstall then finds gpuprov's keys by what they are)")


def _rule(path: str, where: str, rule: str, value: object) -> object:
    """`value` when it passes values.py's `rule`; else RecordInvalid naming the field and the rule."""
    try:
        return values.RULES[rule](value)
    except values.BadValue as exc:
        raise _bad(path, where, exc.rule, value) from None


def _list(path: str, where: str, value: object, check) -> list:
    """A list whose every item passes `check(path, where, item)`."""
    if not isinstance(value, list):
        raise _bad(path, where, "a list", value)
    return [check(path, f"{where}[{i}]", v) for i, v in enumerate(value)]


def _ruled(rule: str):
    return lambda path, where, v: _rule(path, where, rule, v)


def _unit(path: str, where: str, v: object) -> str:
    if v not in ENABLED_UNITS:
        raise _bad(path, where, f"one of {', '.join(ENABLED_UNITS)}", v)
    return v


def _dict(path: str, where: str, value: object) -> dict:
    if not isinstance(value, dict):
        raise _bad(path, where, "an object", value)
    return value


def _text_or_null(path: str, where: str, value: object, null: bool = True) -> str | None:
    if value is None and null or isinstance(value, str):
        return value
    raise _bad(path, where, "a text" + (" or null" if null else ""), value)


def _entry(path: str, where: str, entry: object) -> dict:
    """One config's entry, every field checked; the keys the adapters read, as written (configure: note_config)."""
    e = _dict(path, where, entry)
    # an engine's name (the adapters' registry sits above this layer: uninstall skips names it has no adapter for)
    out = {"engine": _rule(path, f"{where}.engine", "runtime_name", e.get("engine"))}
    if "runtime_name" in e:
        out["runtime_name"] = _rule(path, f"{where}.runtime_name", "runtime_name", e["runtime_name"])
    out["runtime_paths"] = _list(path, f"{where}.runtime_paths", e.get("runtime_paths", []), _ruled("abs_path"))
    out["made_dirs"] = _list(path, f"{where}.made_dirs", e.get("made_dirs", []), _ruled("abs_path"))
    files = {}
    for f, fe in _dict(path, f"{where}.files", e.get("files", {})).items():
        at = f"{where}.files.{f}"
        _rule(path, at, "abs_path", f)
        fe = _dict(path, at, fe)
        files[f] = {"old": _text_or_null(path, f"{at}.old", fe.get("old")),
                    "written": _text_or_null(path, f"{at}.written", fe.get("written"), null=False)}
        if "later" in fe:
            files[f]["later"] = _list(path, f"{at}.later", fe["later"],
                                      lambda p, w, t: _text_or_null(p, w, t, null=False))
    out["files"] = files
    return out


def _repo_file(path: str, where: str, value: object) -> dict:
    e = _dict(path, where, value)
    return {"old": _text_or_null(path, f"{where}.old", e.get("old")),
            "written": _text_or_null(path, f"{where}.written", e.get("written"))}


def _by_stage(path: str, where: str, value: object, check) -> dict:
    """{stage: check(path, where.stage, item)} for each stage."""
    out = {}
    for stage, v in _dict(path, where, value or {}).items():
        if stage not in STAGES:
            raise _bad(path, f"{where}.{stage}", f"a stage ({', '.join(STAGES)})", stage)
        out[stage] = check(path, f"{where}.{stage}", v)
    return out


def _files(path: str, where: str, value: object) -> dict:
    return {f: _repo_file(path, f"{where}.{f}", e) for f, e in _dict(path, where, value).items()
            if _rule(path, f"{where}.{f}", "abs_path", f)}


def _boot(path: str, where: str, value: object) -> dict:
    """The boot pin's entry (empty: none), every field checked."""
    e = _dict(path, where, value or {})
    if not e:
        return {}
    if e.get("method") not in BOOT_METHODS:
        raise _bad(path, f"{where}.method", f"one of {', '.join(BOOT_METHODS)}", e.get("method"))
    out = {"method": e["method"]}
    for k in ("kernel", "unserved"):
        out[k] = _rule(path, f"{where}.{k}", "kernel_release", e.get(k))
    out["entry"] = _text_or_null(path, f"{where}.entry", e.get("entry"), null=False)
    out["saved_before"] = _text_or_null(path, f"{where}.saved_before", e.get("saved_before"))
    if "file" in e:
        out["file"] = _rule(path, f"{where}.file", "abs_path", e["file"])
    return out


def entry_names(entry: str, name: str) -> bool:
    """A recorded package `entry` is package `name`: the name itself, or one of its side-by-side versions, which
    dnf's record keeps by NAME-VERSION-RELEASE.ARCH (kernel-devel-5.14.0-503.14.1.el9_5.x86_64)."""
    return entry == name or (entry.startswith(f"{name}-") and entry[len(name) + 1:][:1].isdigit())

@dataclass
class Record:
    configs: dict[str, dict] = field(default_factory=dict)
    packages: dict[str, list[str]] = field(default_factory=dict)
    holds: list[str] = field(default_factory=list)
    enabled: list[str] = field(default_factory=list)
    streams: list[str] = field(default_factory=list)
    repo_config: dict[str, dict[str, dict]] = field(default_factory=dict)  # stage -> path -> {old, written}
    keys: dict[str, list[str]] = field(default_factory=dict)  # stage -> imported signing keys
    boot: dict = field(default_factory=dict)  # the default boot entry gpuprov keeps (empty: none)

    def to_json(self) -> str:
        doc = {"schema": SCHEMA, "configs": self.configs, "packages": self.packages, "holds": self.holds,
               "enabled": self.enabled, "streams": self.streams, "repo_config": self.repo_config, "keys": self.keys}
        if self.boot:  # only where there is one: records written before it read back the same
            doc["boot"] = self.boot
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    def packages_only(self) -> Record:
        """What an uninstall that keeps the packages leaves of the record: the packages, holds, module streams and
        the package manager's configuration they came with, no configs."""
        return Record({}, {k: list(v) for k, v in self.packages.items() if v}, list(self.holds),
                      streams=list(self.streams), repo_config={k: dict(v) for k, v in self.repo_config.items() if v},
                      keys={k: list(v) for k, v in self.keys.items() if v})

    @classmethod
    def from_json(cls, text: str, path: str) -> Record:
        """The record in `text`, every field checked (values.py's rules); RecordInvalid (exit 6) naming `path` and
        the first field that is wrong."""
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise RecordInvalid(f"{path} is not JSON ({exc}); it is not a record gpuprov wrote: fix or remove "
                                "it") from None
        doc = _dict(path, "(top)", doc)
        if doc.get("schema") != SCHEMA:
            raise _bad(path, "schema", repr(SCHEMA), doc.get("schema"))
        configs = {c: _entry(path, f"configs.{c}", e)
                   for c, e in _dict(path, "configs", doc.get("configs") or {}).items() if _rule(
                       path, f"configs.{c}", "abs_path", c)}
        pkgs = {}
        for stage, lst in _dict(path, "packages", doc.get("packages") or {}).items():
            if stage not in STAGES:
                raise _bad(path, f"packages.{stage}", f"a stage ({', '.join(STAGES)})", stage)
            pkgs[stage] = _list(path, f"packages.{stage}", lst, _ruled("package"))
        return cls(configs, pkgs, _list(path, "holds", doc.get("holds") or [], _ruled("package")),
                   _list(path, "enabled", doc.get("enabled") or [], _unit),
                   _list(path, "streams", doc.get("streams") or [], _ruled("package")),
                   _by_stage(path, "repo_config", doc.get("repo_config"), _files),
                   _by_stage(path, "keys", doc.get("keys"),
                             lambda p, w, v: _list(p, w, v, _ruled("package"))),
                   _boot(path, "boot", doc.get("boot")))


def read(path: str | None = None) -> Record:
    """The install record at `path` (default paths.INSTALL_RECORD): empty when there is none; UntrustedPath (exit 6)
    when anyone but root could have written it or a directory above it; RecordInvalid (exit 6) for a wrong shape."""
    path = path or paths.INSTALL_RECORD
    data = read_trusted(path)
    if data is None:
        return Record()
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise RecordInvalid(f"{path} is not UTF-8 text; it is not a record gpuprov wrote: fix or remove it") from None
    return Record.from_json(text, path)


def save(rec: Record) -> None:
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
    save(rec)


def note_packages(stage: str, installed: list[str], held: list[str] = ()) -> None:
    if not installed and not held:
        return
    rec = read()
    rec.packages[stage] = list(dict.fromkeys([*rec.packages.get(stage, []), *installed]))
    rec.holds = list(dict.fromkeys([*rec.holds, *held]))
    save(rec)


def note_repo_config(stage: str, files: dict[str, tuple[str | None, str | None]], keys: list[str] = ()) -> None:
    """The package manager's configuration a step of `stage` changed: `files` as path -> (text before, text after),
    the first `old` of a path kept (the operator's, or null where gpuprov created it); `keys` it imported."""
    if not files and not keys:
        return
    rec = read()
    kept = rec.repo_config.setdefault(stage, {})
    for path, (old, written) in files.items():
        kept[path] = {"old": kept[path]["old"] if path in kept else old, "written": written}
    if keys:
        rec.keys[stage] = list(dict.fromkeys([*rec.keys.get(stage, []), *keys]))
    save(rec)


def note_boot(entry: dict) -> None:
    """The default boot entry kept (plan/boot_default.py); an empty `entry`: released."""
    rec = read()
    if rec.boot != entry:
        rec.boot = dict(entry)
        save(rec)


def note_streams(modules: list[str]) -> None:
    """Module streams a bootstrap enabled where none was (provision/plan/packages.py: InstallWatch)."""
    rec = read()
    if any(m not in rec.streams for m in modules):
        rec.streams = list(dict.fromkeys([*rec.streams, *modules]))
        save(rec)


def note_enabled(unit: str) -> None:
    rec = read()
    if unit not in rec.enabled:
        rec.enabled.append(unit)
        save(rec)
