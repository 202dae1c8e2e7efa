"""The role as users install roles (issue 28 item 14): its README lists every variable, generated from
meta/argument_specs.yml (so it cannot drift), and the collection gpuprov.gpuprov that scripts/build_collection.py
builds installs with `ansible-galaxy collection install`, the role's module and module_utils as real files."""
from __future__ import annotations

import subprocess
import sys
import tarfile

import yaml

from tests.conftest import REPO, needs

sys.path.insert(0, str(REPO / "scripts"))
import build_collection  # noqa: E402
import role_readme  # noqa: E402


def test_role_readme_is_generated_from_the_argument_specs():
    readme = (REPO / "roles/gpuprov/README.md").read_text()
    assert readme == role_readme.expected(), "run python3 scripts/role_readme.py"
    options = yaml.safe_load((REPO / "roles/gpuprov/meta/argument_specs.yml").read_text())["argument_specs"]["main"]
    for name in options["options"]:
        assert f"| `{name}` |" in readme, name


@needs("ansible-galaxy")
def test_the_collection_installs_with_ansible_galaxy(tmp_path):
    tarball = build_collection.build(tmp_path / "dist")
    with tarfile.open(tarball) as tar:
        names = tar.getnames()
        assert "plugins/modules/gpuprov_node.py" in names and "roles/gpuprov/tasks/main.yml" in names
        for mu in ("gpuprov_errors.py", "gpuprov_values.py"):
            member = tar.getmember(f"plugins/module_utils/{mu}")
            assert member.isfile(), mu  # a link into provision/ in the repository, a file here
    r = subprocess.run(["ansible-galaxy", "collection", "install", "-p", str(tmp_path / "c"), str(tarball)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    coll = tmp_path / "c/ansible_collections/gpuprov/gpuprov"
    assert (coll / "plugins/module_utils/gpuprov_errors.py").read_text() == (REPO / "provision/errors.py").read_text()
    # the module runs from the collection: its module_utils import resolves there (ansible-doc loads the module)
    env = {"ANSIBLE_COLLECTIONS_PATH": str(tmp_path / "c"), "PATH": f"{sys.prefix}/bin:/usr/bin:/bin"}
    r = subprocess.run(["ansible-doc", "gpuprov.gpuprov.gpuprov_node"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0 and "gpuprov_node" in r.stdout, r.stdout + r.stderr
    play = tmp_path / "play.yml"
    play.write_text("- hosts: localhost\n  gather_facts: false\n  roles:\n    - role: gpuprov.gpuprov.gpuprov\n")
    r = subprocess.run(["ansible-playbook", "--syntax-check", str(play)], capture_output=True, text=True, timeout=300,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
