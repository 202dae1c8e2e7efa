"""What the two CRI engines (containerd, CRI-O) share: the handler name and runtime path gpuprov writes into their
drop-ins, checked before anything is read or written (a name becomes a TOML key and a Kubernetes RuntimeClass
handler; the path becomes a string that the engine executes)."""
from __future__ import annotations

from provision.errors import UsageError
from provision.values import BadValue, abs_path, cri_handler


def validate(name: str, path: str) -> None:
    """UsageError (exit 2) for a handler name or runtime path an engine would choke on or misread (the rules of
    provision/values.py, which the CLI's options follow too)."""
    try:
        cri_handler(name)
    except BadValue as exc:
        raise UsageError(f"runtime name {name!r} is not {exc.rule}: e.g. --runtime-name nvidia") from None
    try:
        abs_path(path)
    except BadValue as exc:
        raise UsageError(f"runtime path {path!r} must be {exc.rule}: e.g. --runtime-path "
                         "/usr/local/bin/gpuprov-runtime") from None
