"""Build the Ansible collection `gpuprov.gpuprov` as the tarball `ansible-galaxy collection install` takes: the
repository root is the collection (galaxy.yml there: the role gpuprov, its module plugins/modules/gpuprov_node.py and
its module_utils, links to provision/errors.py and provision/values.py), so this is `ansible-galaxy collection build`
of the root, the one way it is built. Run: python3 scripts/build_collection.py [OUTPUT_DIR]
(tests/unit/test_role_readme.py builds, installs, runs and checks it, and installs it from the checkout too)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def galaxy() -> dict:
    """The collection's metadata: galaxy.yml at the repository root."""
    return yaml.safe_load((REPO / "galaxy.yml").read_text())


def ansible_galaxy() -> str:
    """The ansible-galaxy beside this Python (a virtualenv's), else the one on PATH."""
    here = Path(sys.executable).with_name("ansible-galaxy")
    return str(here) if here.exists() else "ansible-galaxy"


def build(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([ansible_galaxy(), "collection", "build", str(REPO), "--output-path", str(out), "--force"],
                   check=True, capture_output=True, text=True)
    meta = galaxy()
    return out / f"{meta['namespace']}-{meta['name']}-{meta['version']}.tar.gz"


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "dist")))
