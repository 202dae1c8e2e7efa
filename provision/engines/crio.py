"""CRI-O: a drop-in under /etc/crio/crio.conf.d/, never an edit of crio.conf itself."""
from __future__ import annotations

DROPIN_DIR = "/etc/crio/crio.conf.d"


def dropin_path(runtime_name: str = "nvidia") -> str:
    return f"{DROPIN_DIR}/99-gpuprov-{runtime_name}.toml"


def render(*, runtime_name: str = "nvidia", runtime_path: str, default: bool = False) -> str:
    from provision import render as tpl

    return tpl.render("crio-runtime.toml.j2", runtime_name=runtime_name, runtime_path=runtime_path, default=default)
