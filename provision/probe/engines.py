"""Engine versions: each engine binary's `--version`, run only on the live host, cached per binary (FileKey)."""
from __future__ import annotations

import re

from provision.facts.engines import ENGINES, EngineFacts
from provision.probe import cache
from provision.probe.cache import FileKey

VERSION_RE = re.compile(r"(\d+\.\d+(?:\.\d+)?(?:[-+~][\w.+~-]*)?)")
CACHE = "engine-versions.json"  # {"entries": [{"key": FileKey, "version": "…"}]}


def _run_all(commands: dict[str, list[str]]) -> dict[str, str | None]:
    """Every `--version` at once (each engine binary takes tens of ms to start); a binary that cannot run or
    hangs for 5 s has no version."""
    from provision import effects  # lazy: 5.5 ms (-X importtime, min of 9) on every detect; only a cache miss runs one

    out: dict[str, str | None] = {}
    for name, res in effects.run_parallel(commands, timeout=5).items():
        m = VERSION_RE.search(res.output) if res else None
        out[name] = m.group(1) if m else None
    return out


def with_versions(engines: list[EngineFacts]) -> list[EngineFacts]:
    """The same facts with `version` filled in from each engine binary on the live host."""
    args = {s.name: s.version_args for s in ENGINES}
    keys = {e.name: FileKey.of(e.binary) for e in engines if e.binary}
    entries = [e for e in cache.load(CACHE).get("entries", []) if isinstance(e, dict)]
    known = {FileKey(**e["key"]): e.get("version") for e in entries if isinstance(e.get("key"), dict)
             and set(e["key"]) == {"path", "ino", "size", "mtime_ns"}}
    versions = {n: known[k] for n, k in keys.items() if k in known}
    missing = {e.name: [e.binary, *args[e.name]] for e in engines if e.binary and e.name not in versions}
    if missing:
        versions.update(_run_all(missing))
        fresh = {keys[n]: versions[n] for n in missing if keys.get(n) and versions.get(n)}
        kept = [{"key": k.to_json(), "version": v} for k, v in known.items()
                if k.path not in {f.path for f in fresh}]
        cache.store(CACHE, {"entries": kept + [{"key": k.to_json(), "version": v} for k, v in fresh.items()]})
    return [e._replace(version=versions.get(e.name)) for e in engines]
