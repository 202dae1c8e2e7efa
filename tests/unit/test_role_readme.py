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


def test_the_collections_metadata_is_gpuprovs_and_the_roles():
    """galaxy.yml at the root is the collection's one description: gpuprov's version, the role's words."""
    from provision import __version__

    meta = build_collection.galaxy()
    role = yaml.safe_load((REPO / "roles/gpuprov/meta/main.yml").read_text())["galaxy_info"]
    assert (meta["namespace"], meta["name"], meta["version"]) == ("gpuprov", "gpuprov", __version__.split("+")[0])
    assert (meta["description"], meta["authors"], meta["license"], meta["tags"]) == \
        (role["description"], [role["author"]], [role["license"]], role["galaxy_tags"])
    assert (REPO / meta["readme"]).read_text() == role_readme.expected()


# What the collection holds (galaxy.yml's build_ignore keeps the rest of the repository out): a new file in the
# repository that would slip into it fails here.
COLLECTION = {"meta/runtime.yml", "plugins/modules/gpuprov_node.py", "plugins/module_utils/gpuprov_errors.py",
              "plugins/module_utils/gpuprov_values.py", "provision/errors.py", "provision/values.py",
              "roles/gpuprov/README.md", "roles/gpuprov/defaults/main.yml", "roles/gpuprov/handlers/main.yml",
              "roles/gpuprov/meta/argument_specs.yml", "roles/gpuprov/meta/main.yml", "roles/gpuprov/vars/main.yml",
              *(f"roles/gpuprov/tasks/{t}.yml" for t in ("bootstrap", "controller", "install", "main", "remove"))}


def _installed_collection_works(coll_root, tmp_path) -> None:
    """The collection installed under coll_root (an ansible_collections tree): its module_utils are gpuprov's own
    files, ansible-doc loads its module, a play with its role passes --syntax-check, and its module runs from it
    (its module_utils packed by Ansible from the collection): a value gpuprov's rules refuse fails the task with
    gpuprov's exit 2 line, before anything runs on the host."""
    coll = coll_root / "ansible_collections/gpuprov/gpuprov"
    files = {str(p.relative_to(coll)) for p in coll.rglob("*") if not p.is_dir()} - {"MANIFEST.json", "FILES.json"}
    assert files == COLLECTION, files ^ COLLECTION
    assert (coll / "plugins/module_utils/gpuprov_errors.py").read_text() == (REPO / "provision/errors.py").read_text()
    env = {"ANSIBLE_COLLECTIONS_PATH": str(coll_root), "PATH": f"{sys.prefix}/bin:/usr/bin:/bin",
           "ANSIBLE_NOCOLOR": "1", "HOME": str(tmp_path)}
    r = subprocess.run(["ansible-doc", "gpuprov.gpuprov.gpuprov_node"], capture_output=True, text=True, timeout=300,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0 and "gpuprov_node" in r.stdout, r.stdout + r.stderr
    play = tmp_path / "play.yml"
    play.write_text("- hosts: localhost\n  gather_facts: false\n  roles:\n    - role: gpuprov.gpuprov.gpuprov\n")
    r = subprocess.run(["ansible-playbook", "--syntax-check", str(play)], capture_output=True, text=True, timeout=300,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(["ansible", "localhost", "-c", "local", "-m", "gpuprov.gpuprov.gpuprov_node", "-a",
                        '{"engine_options": {"runtimes": {}}, "gpuprov": "/nonexistent/gpuprov"}'],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode != 0 and "engine_options 'runtimes={}': KEY=JSON" in r.stdout and "(exit 2). Fix: " in r.stdout, \
        r.stdout + r.stderr


@needs("ansible-galaxy")
def test_the_collection_builds_from_the_root_and_installs_from_its_tarball(tmp_path):
    tarball = build_collection.build(tmp_path / "dist")
    with tarfile.open(tarball) as tar:
        names = {m.name for m in tar.getmembers() if not m.isdir()} - {"MANIFEST.json", "FILES.json"}
        assert names == COLLECTION, names ^ COLLECTION
        for mu in ("gpuprov_errors.py", "gpuprov_values.py"):  # links into provision/, packed beside them
            assert tar.getmember(f"plugins/module_utils/{mu}").linkname == f"../../provision/{mu[8:]}", mu
    r = subprocess.run(["ansible-galaxy", "collection", "install", "-p", str(tmp_path / "c"), str(tarball)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    _installed_collection_works(tmp_path / "c", tmp_path)


@needs("ansible-galaxy")
def test_the_collection_installs_from_the_repository(tmp_path):
    """`ansible-galaxy collection install PATH-TO-CHECKOUT`, as the README says (was: galaxy.yml only inside the
    tarball scripts/build_collection.py staged, and installing from the repository failed)."""
    r = subprocess.run(["ansible-galaxy", "collection", "install", "-p", str(tmp_path / "c"), str(REPO)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    _installed_collection_works(tmp_path / "c", tmp_path)
