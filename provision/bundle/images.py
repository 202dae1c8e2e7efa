"""Clean roots of target releases as container images (debootstrap --variant=minbase, imported locally)."""
from __future__ import annotations

import subprocess
import tempfile

from provision.decide.targets import Target
from provision.errors import StepFailed


def image_name(target: Target) -> str:
    return f"gpuprov-root/{target.os_id}:{target.codename}"


def ensure_image(target: Target) -> str:
    name = image_name(target)
    if subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0:
        return name
    with tempfile.TemporaryDirectory() as td:
        p = subprocess.run(["debootstrap", "--variant=minbase", target.codename, td], capture_output=True, text=True)
        if p.returncode != 0:
            raise StepFailed(f"debootstrap of {target.codename} failed: {p.stderr.strip()[-500:]}")
        tar = subprocess.Popen(["tar", "-C", td, "-c", "."], stdout=subprocess.PIPE)
        p = subprocess.run(["docker", "import", "-", name], stdin=tar.stdout, capture_output=True, text=True)
        tar.wait()
        if p.returncode != 0:
            raise StepFailed(f"docker import of the {target.codename} root failed: {p.stderr.strip()}")
    return name
