"""Since when a --gpus hook has been at its path (issue 39 item 2): dockerd looks the hook up once, when it starts, and
runs whatever is there at each container start, so a hook gpuprov rewrites in place needs no restart and one that
appeared after dockerd started does. Written by the runtime's install (inject/install.py), read by the docker adapter
(engines/docker.py: pending_restart). Stdlib and provision's base only: the install runs it without site-packages."""
from __future__ import annotations

import json
import os

from provision import paths
from provision.fsutil import read_trusted, write_file


def hook_present_since(hook: str) -> float:
    """Since when `hook`'s path has held a --gpus hook: its mtime, or earlier where gpuprov rewrote a hook that was
    already there (note_hook_rewritten). dockerd looks the path up once, at start, and runs whatever is there at each
    container start: a hook rewritten in place after dockerd started needs no restart, one that appeared later does."""
    since = os.stat(hook).st_mtime
    kept = _since(_recorded(), hook)
    return since if kept is None else min(since, kept)


def note_hook_rewritten(hook: str, was_there_since: float) -> None:
    """Record that `hook` was rewritten in place, and since when a hook has been at its path (for pending_restart)."""
    doc = _recorded()
    kept = _since(doc, hook)
    doc[hook] = was_there_since if kept is None else min(was_there_since, kept)
    write_file(paths.HOOK_SINCE, json.dumps(doc, sort_keys=True) + "\n", mode=0o644, keep_mode=False, backup=False)


def _recorded() -> dict:
    """The record (hook path -> since when), or {} where there is none or it is not one (root-owned only:
    read_trusted)."""
    try:
        doc = json.loads(read_trusted(paths.HOOK_SINCE) or b"{}")
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _since(doc: dict, hook: str) -> float | None:
    """The time the record keeps for `hook`, where it is a number."""
    kept = doc.get(hook)
    return kept if isinstance(kept, (int, float)) and not isinstance(kept, bool) else None
