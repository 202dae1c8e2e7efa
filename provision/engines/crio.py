"""CRI-O: a drop-in under /etc/crio/crio.conf.d/, never an edit of crio.conf itself."""
from __future__ import annotations

DROPIN_DIR = "/etc/crio/crio.conf.d"


def dropin_path(runtime_name: str = "nvidia") -> str:
    return f"{DROPIN_DIR}/99-gpuprov-{runtime_name}.toml"


def render(*, runtime_name: str = "nvidia", runtime_path: str, default: bool = False) -> str:
    lines = ["# Written by gpuprov: registers its GPU injection runtime. Remove this file to unregister.",
             "[crio.runtime]"]
    if default:
        lines.append(f'default_runtime = "{runtime_name}"')
    lines += ["", f"[crio.runtime.runtimes.{runtime_name}]", f'runtime_path = "{runtime_path}"',
              'runtime_type = "oci"', 'runtime_root = "/run/gpuprov-runtime"', ""]
    return "\n".join(lines)
