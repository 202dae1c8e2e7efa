"""Build the Ansible collection `gpuprov.gpuprov` (the role gpuprov; its module `gpuprov_node` and its module_utils
as the collection's plugins, the module_utils links into provision/ as the files they name) as the tarball
`ansible-galaxy collection install` takes. Run: python3 scripts/build_collection.py OUTPUT_DIR
(tests/unit/test_role_readme.py builds, installs and checks it)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
COLLECTION_UTILS = "ansible_collections.gpuprov.gpuprov.plugins.module_utils"
sys.path.insert(0, str(REPO))
from provision import __version__  # noqa: E402  (the collection's version is gpuprov's)


def galaxy() -> dict:
    meta = yaml.safe_load((REPO / "roles/gpuprov/meta/main.yml").read_text())["galaxy_info"]
    return {"namespace": "gpuprov", "name": "gpuprov", "version": __version__.split("+")[0],
            "readme": "README.md", "authors": [meta["author"]], "description": meta["description"],
            "license": [meta["license"]], "tags": meta["galaxy_tags"], "dependencies": {},
            "repository": "https://example.invalid/gpuprov", "build_ignore": ["**/__pycache__"]}


def build(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpuprov-collection-") as td:
        stage = Path(td) / "gpuprov"
        # symlinks=False: module_utils' links into provision/ become the files they name
        shutil.copytree(REPO / "roles/gpuprov", stage / "roles/gpuprov", symlinks=False,
                        ignore=shutil.ignore_patterns("__pycache__"))
        # The module and its module_utils as collection plugins (a collection role's own library/ is not searched
        # for its tasks' modules; the role's unqualified `gpuprov_node` resolves in its collection first).
        role = stage / "roles/gpuprov"
        (stage / "plugins").mkdir()
        shutil.move(role / "module_utils", stage / "plugins/module_utils")
        (stage / "plugins/modules").mkdir()
        module = (role / "library/gpuprov_node.py").read_text()
        (stage / "plugins/modules/gpuprov_node.py").write_text(module.replace(
            "from ansible.module_utils import gpuprov_", f"from {COLLECTION_UTILS} import gpuprov_"))
        shutil.rmtree(role / "library")
        (stage / "meta").mkdir()
        (stage / "meta/runtime.yml").write_text("---\nrequires_ansible: \">=2.15\"\n")
        (stage / "README.md").write_text((REPO / "roles/gpuprov/README.md").read_text())
        (stage / "galaxy.yml").write_text("---\n" + yaml.safe_dump(galaxy(), sort_keys=False))
        subprocess.run([str(Path(sys.executable).with_name("ansible-galaxy")) if
                        Path(sys.executable).with_name("ansible-galaxy").exists() else "ansible-galaxy",
                        "collection", "build", str(stage), "--output-path", str(out), "--force"],
                       check=True, capture_output=True, text=True)
    (tarball,) = out.glob(f"gpuprov-gpuprov-{galaxy()['version']}.tar.gz")
    return tarball


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "dist")))
