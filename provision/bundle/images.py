"""Clean roots of target releases as container images (debootstrap --variant=minbase, imported locally)."""
from __future__ import annotations

import tempfile

from provision import effects
from provision.decide.targets import Target
from provision.errors import StepFailed


def image_name(target: Target) -> str:
    return f"gpuprov-root/{target.os_id}:{target.codename}"


def ensure_image(target: Target) -> str:
    name = image_name(target)
    if effects.run(["docker", "image", "inspect", name], check=False, timeout=60).returncode == 0:
        return name
    with tempfile.TemporaryDirectory() as td:
        p = effects.run(["debootstrap", "--variant=minbase", target.codename, td], check=False)
        if p.returncode != 0:
            raise StepFailed(f"debootstrap of {target.codename} failed: {p.stderr.strip()[-500:]}")
        try:
            effects.pipe(["tar", "-C", td, "-c", "."], ["docker", "import", "-", name])
        except StepFailed as exc:
            raise StepFailed(f"docker import of the {target.codename} root failed: {exc}") from None
    return name
