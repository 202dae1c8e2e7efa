"""Exit codes by name (provision/errors.py), never as bare numbers: a number given as an exit code in provision/ is
a finding; Ctrl-C is INTERRUPTED (130), as the README's table says."""
from __future__ import annotations

import re

from provision import cli, errors
from tests.conftest import REPO

BARE = re.compile(r"exit_code\s*=\s*\d|Exit\(\s*\d|SystemExit\(\s*\d")


def test_no_bare_exit_code_numbers():
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in sorted((REPO / "provision").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if BARE.search(line)]
    assert found == []
    assert BARE.search('raise GpuprovError("x", exit_code=1)')  # the guard sees what it looks for


def test_interrupted_is_130(monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "fast_path", interrupted)  # the first thing main does with the arguments
    assert cli.main(["detect"]) == errors.INTERRUPTED == 130
    assert capsys.readouterr().err.startswith("Error: interrupted")
