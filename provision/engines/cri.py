"""What the two CRI engines (containerd, CRI-O) share: the handler name and runtime path gpuprov writes into their
drop-ins, checked before anything is read or written (a name becomes a TOML key and a Kubernetes RuntimeClass
handler; the path becomes a string that the engine executes)."""
from __future__ import annotations

import os
import re
from pathlib import PurePosixPath

from provision.errors import UsageError

# Kubernetes' RuntimeClass.handler is a DNS label: lowercase letters, digits and '-', at most 63.
HANDLER_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def validate(name: str, path: str) -> None:
    """UsageError (exit 2) for a handler name or runtime path an engine would choke on or misread."""
    if not HANDLER_RE.match(name):
        raise UsageError(f"runtime name {name!r} is not a CRI handler name (lowercase letters, digits and '-', at "
                         "most 63, like Kubernetes' RuntimeClass.handler): e.g. --runtime-name nvidia")
    bad = [c for c in path if ord(c) < 32 or c in "\x7f\"'\\"]
    if not os.path.isabs(path) or bad or ".." in PurePosixPath(path).parts:
        raise UsageError(f"runtime path {path!r} must be an absolute path without '..', quotes, backslashes or "
                         "control characters: e.g. --runtime-path /usr/local/bin/gpuprov-runtime")
