"""The fleet role fails with gpuprov's own error line and the fix in the play's terms, for every exit code gpuprov
has: the module's FIXES table is keyed by provision/errors.py's constants, which reach the node as the module_utils
link to that very file (the module cannot import gpuprov there)."""
from __future__ import annotations

import ast
import os

import yaml

from provision import errors
from tests.conftest import REPO
from tests.unit.test_option_choices import ROLE, _module

LINK = ROLE / "module_utils/gpuprov_errors.py"


def _codes() -> dict[str, int]:
    return {k: v for k, v in vars(errors).items() if k.isupper() and isinstance(v, int)}


def test_module_utils_is_a_link_to_errors_py():
    assert LINK.is_symlink() and not os.path.isabs(os.readlink(LINK))  # relative: survives a copy of the checkout
    assert LINK.resolve() == (REPO / "provision/errors.py").resolve()


def test_errors_py_imports_nothing_the_node_lacks():
    """The node runs it with its system Python and no gpuprov: standard library only, nothing from provision."""
    tree = ast.parse((REPO / "provision/errors.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__"}, imported


def test_every_failure_code_has_a_fix():
    fixes = _module().FIXES
    failing = {k: v for k, v in _codes().items() if k not in ("OK", "REBOOT_REQUIRED")}
    assert set(fixes) == set(failing.values()), {k: v for k, v in failing.items() if v not in fixes}
    assert all(len(fix) > 30 for fix in fixes.values())


def test_failure_names_gpuprovs_line_and_the_play_fix():
    mod = _module()
    err = ("engine: configuring docker\nError: /etc/docker/daemon.json: runtime 'nvidia' is yours "
           "(/usr/bin/other-runtime); --replace-runtime overrides\n")
    msg = mod.failure(errors.CONFLICT, err, "gpuprov bootstrap")
    assert msg.startswith("/etc/docker/daemon.json: runtime 'nvidia' is yours")
    assert "(exit 14)" in msg and "gpuprov_replace_runtime: true" in msg
    assert "gpuprov_busy_retries" in mod.failure(errors.HOST_BUSY, "Error: busy\n", "gpuprov bootstrap")
    assert "read-write" in mod.failure(errors.WRITE_FAILED, "Error: full\n", "gpuprov bootstrap")
    assert "gpuprov_driver: skip" in mod.failure(errors.NO_DEVICE, "", "gpuprov bootstrap")
    assert mod.failure(errors.DKMS_FAILED, "", "gpuprov bootstrap").startswith("gpuprov bootstrap exited 16")
    assert mod.failure(99, "Error: odd\n", "gpuprov bootstrap") == "odd (exit 99)"


def test_fixes_name_real_role_variables():
    """A fix that tells the operator to set gpuprov_x must name a variable the role has."""
    known = set(yaml.safe_load((ROLE / "defaults/main.yml").read_text()))
    words = {w.strip(".,:;()`") for fix in _module().FIXES.values() for w in fix.split()}
    named = {w for w in words if w.startswith("gpuprov_") and w != "gpuprov_*"}
    assert named and named <= known, named - known


def test_busy_is_retried_by_the_task():
    """Exit 11 comes back as `busy`; the task retries while it is set, and only then."""
    (task,) = yaml.safe_load((ROLE / "tasks/bootstrap.yml").read_text())
    assert task["until"] == "not (gpuprov_result.busy | default(false))"
    assert task["retries"] == "{{ gpuprov_busy_retries }}" and task["delay"] == "{{ gpuprov_busy_delay }}"
    assert "--no-wait" in _module().bootstrap_argv({**{k: v.get("default") for k, v in
                                                      _module().ARGUMENT_SPEC.items()}}, check_mode=False)


class _Failed(Exception):
    pass


class _Node:
    """AnsibleModule's two calls run_gpuprov makes, recorded: run_command answers as gpuprov did, fail_json stops."""

    def __init__(self, rc: int, out: str, err: str):
        self.answer, self.failed = (rc, out, err), None

    def run_command(self, argv):
        return self.answer

    def fail_json(self, **kw):
        self.failed = kw
        raise _Failed


def test_run_gpuprov_fails_the_task_with_gpuprovs_line_and_the_fix():
    """bootstrap and uninstall both go through run_gpuprov: an exit code outside `ok` fails with gpuprov's own
    error line, its code and the fix; output that is no JSON fails as such; JSON comes back parsed."""
    mod = _module()
    node = _Node(errors.CONFLICT, "", "Error: dockerd's default-runtime is runc\n")
    try:
        mod.run_gpuprov(node, ["gpuprov", "uninstall"], (errors.OK,), "gpuprov uninstall")
    except _Failed:
        pass
    assert node.failed["rc"] == errors.CONFLICT and node.failed["cmd"] == ["gpuprov", "uninstall"]
    assert node.failed["msg"].startswith(f"dockerd's default-runtime is runc (exit {errors.CONFLICT}). Fix: ")
    node = _Node(errors.OK, "not json", "")
    try:
        mod.run_gpuprov(node, ["gpuprov"], (errors.OK,), "gpuprov bootstrap")
    except _Failed:
        pass
    assert node.failed["msg"] == "gpuprov printed no JSON"
    node = _Node(errors.REBOOT_REQUIRED, '{"changed": 1}', "")
    assert mod.run_gpuprov(node, ["gpuprov"], (errors.OK, errors.REBOOT_REQUIRED), "x") == (
        errors.REBOOT_REQUIRED, {"changed": 1})
