"""The command line's dispatch, registered by provision.cli when it builds the app, used by bootstrap to run its
`gpuprov …` steps in-process (provision/plan/steps.run_gpuprov). A module of its own, importing nothing, so the
plan layer reaches the CLI without importing it (no package cycle, no start-up cost for `gpuprov detect`)."""
from __future__ import annotations

from typing import Callable, Optional

# dispatch(args) -> exit code or None; a command's GpuprovError propagates as raised.
_dispatch: Optional[Callable[[list], object]] = None


def register(dispatch: Callable[[list], object]) -> None:
    global _dispatch
    _dispatch = dispatch


def current() -> Optional[Callable[[list], object]]:
    return _dispatch
