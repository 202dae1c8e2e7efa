"""The code and the Ansible content stay lint-clean (ruff; ansible-lint at the production profile)."""
from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO, needs


@needs("ruff")
def test_ruff_clean():
    r = subprocess.run(["ruff", "check", "."], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


@needs("ansible-lint")
@pytest.mark.parametrize("profile", [["--profile", "production"], []])  # [] : ansible-lint's default, as users run it
def test_ansible_lint(profile):
    r = subprocess.run(["ansible-lint", *profile, "--nocolor", "site.yml", "roles/", "inventories/", "galaxy.yml", "meta/"],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs("ansible-lint")
def test_ansible_lint_at_the_repository_root():
    """`ansible-lint` with no arguments, at the root, as an operator first runs it: on main 123 YAML errors, all in
    tests/fixtures/ (captured CDI specs, data kept as nvidia-ctk wrote them), which .ansible-lint now leaves out."""
    r = subprocess.run(["ansible-lint", "--nocolor"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "tests/fixtures" not in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
