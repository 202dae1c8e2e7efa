"""The runtime's settings, typed: `Settings`, read strictly from /etc/gpuprov/runtime.json (inject/settings_file.py
holds the keys, their rules and the reading; GPUPROV_RUNTIME_CONFIG overrides the path, for tests).

    s = load_settings()        # the file (defaults without one); SettingsInvalid (exit 6) names the file and the key
    s.driver_root, s.accept_env_unprivileged, s.share_state …   # attribute access, frozen
    Settings.from_dict({...}, source)   # the same strict checks on a dict; s.to_dict() is the file's form"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from provision.inject.settings_file import (  # noqa: F401 - DEFAULT_PATH, settings_path: this module's API too
    DEFAULT_PATH,
    DEFAULTS,
    SettingsInvalid,
    check_fields,
    read_fields,
    runc_program,
    settings_path,
)


@dataclass(frozen=True)
class Settings:
    """runtime.json, checked: each field as settings_file.FIELDS says (rule, default); the same keys, in the same
    order (tests/faults/test_values_round2.py)."""
    runc: str  # the low-level runtime the front-end execs (load_settings resolves null to runc on PATH)
    driver_root: str = DEFAULTS["driver_root"]
    dev_root: str = DEFAULTS["dev_root"]
    proc_root: str = DEFAULTS["proc_root"]
    cache: str = DEFAULTS["cache"]
    accept_env_unprivileged: bool = DEFAULTS["accept_env_unprivileged"]
    share_state: str = DEFAULTS["share_state"]

    @classmethod
    def from_dict(cls, raw: dict, source: str = "runtime settings") -> Settings:
        """Strictly, as the file is read: an unknown key or a value that breaks its rule is SettingsInvalid."""
        fields = check_fields(raw, source)
        return cls(**{**fields, "runc": runc_program(fields)})

    def to_dict(self) -> dict:
        return asdict(self)


# The last file read, by identity (path, device, inode, size, mtime, ctime), and its Settings: the warm editor loads
# the settings for every GPU container, and a stat costs ~1 us where reading and checking the file costs ~60.
_last: tuple[tuple, Settings] | None = None


def load_settings(path: str | None = None, required: bool = False) -> Settings:
    """The settings file, checked; the defaults when there is none, unless `required` (the runtime's GPU create:
    SettingsMissing, a refusal). Raises SettingsInvalid (never cached: every GPU container is refused until the file
    is fixed)."""
    global _last
    path = path or settings_path()
    try:
        st = os.stat(path)
        ident = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    except OSError:
        ident = None
    if ident is not None and _last is not None and _last[0] == ident:
        return _last[1]
    fields = read_fields(path, required=required)
    settings = Settings(**{**fields, "runc": runc_program(fields)})
    if ident is not None:
        _last = (ident, settings)
    return settings


def kept_settings(path: str | None = None) -> dict:
    """What runtime.json holds now, key by key: every known key whose value is valid on its own ({} without a file,
    or with one that is not a JSON object). What a re-install keeps: a setting it was not told to change stays as
    the operator or `gpuprov k8s node` set it (the multi-tenant policy first: a re-install once wrote
    accept_env_unprivileged back to true, and an unprivileged pod asking NVIDIA_VISIBLE_DEVICES=all got every GPU).
    An invalid key is not kept (the file refuses GPU containers until rewritten; the re-install rewrites it)."""
    path = path or settings_path()
    try:
        with open(path, "rb") as fh:
            raw = json.loads(fh.read())
    except (OSError, ValueError):
        return {}
    kept = {}
    for key, value in raw.items() if isinstance(raw, dict) else ():
        try:
            kept[key] = check_fields({key: value}, path)[key]
        except (SettingsInvalid, KeyError):
            continue
    return kept


def set_setting(key: str, value, path: str | None = None, dry_run: bool = False) -> bool:
    """Change one key of runtime.json (checked as the runtime reads it; the other keys as they are). Returns whether
    it changed; False, changing nothing, when there is no file yet (`gpuprov runtime install` writes it)."""
    from provision.fsutil import write_file  # lazy: 0.8 ms (-X importtime), only `gpuprov k8s node` writes a key

    path = path or settings_path()
    if not os.path.exists(path):
        return False
    current = read_fields(path)
    if current[key] == value:
        return False
    new = check_fields({**current, key: value}, path)
    if not dry_run:
        write_file(path, json.dumps(new, indent=2) + "\n", mode=0o644, keep_mode=False, backup=False)
    return True
