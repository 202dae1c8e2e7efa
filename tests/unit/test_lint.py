"""The code and the Ansible content stay lint-clean (ruff; ansible-lint at the production profile)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import REPO


@pytest.mark.skipif(not shutil.which("ruff"), reason="ruff not installed (pip install -e '.[test]')")
def test_ruff_clean():
    r = subprocess.run(["ruff", "check", "."], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


@pytest.mark.skipif(not shutil.which("ansible-lint"), reason="ansible-lint not installed (pip install -e '.[test]')")
def test_ansible_lint_production():
    r = subprocess.run(["ansible-lint", "--profile", "production", "--nocolor", "site.yml", "roles/", "inventories/"],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
