"""A claim in the README or docs/ points at the test that proves it: every test file they name exists, and every
`file::test` they name is a test of that file (a renamed or never-written test would leave the claim unproven; the
AL2023 row once named `test_el_amzn.py`, which never existed)."""
from __future__ import annotations

import re

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# `tests/x/test_y.py`, `test_y.py`, either with `::test_z` (parametrised ids and classes left out; `::test_z_…`, a
# family of tests, names their common prefix). The testinfra checks a fleet runs live in provision/verify/.
NAMED = re.compile(r"((?:(?:tests|provision)/[\w/]+/)?(test_\w+\.py))(?:::(\w+))?")
WHERE = ("tests", "provision/verify")


def _files(name: str) -> list:
    return [p for d in WHERE for p in (REPO / d).rglob(name)]


def named_tests(text: str) -> set[tuple[str, str, str | None]]:
    return {(m.group(1), m.group(2), m.group(3)) for m in NAMED.finditer(text)}


def test_every_test_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        for path, name, func in sorted(named_tests(doc.read_text()), key=str):
            files = [REPO / path] if "/" in path else _files(name)
            files = [f for f in files if f.is_file()]
            if not files:
                missing.append(f"{doc.name}: {path}")
            elif func and not any(re.search(rf"^\s*(?:async )?def {re.escape(func)}" + ("" if func.endswith("_")
                                                                                         else r"\b"),
                                            f.read_text(), re.M) for f in files):
                missing.append(f"{doc.name}: {path}::{func}")
    assert not missing, "the docs name tests that do not exist:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_test():
    found = named_tests("proven (`tests/integration/test_el_amzn.py`; test_day_two.py::test_nothing_like_it)")
    assert ("tests/integration/test_el_amzn.py", "test_el_amzn.py", None) in found
    assert not _files("test_el_amzn.py") and _files("test_day_two.py")
    assert not re.search(r"^\s*def test_nothing_like_it\b", _files("test_day_two.py")[0].read_text(), re.M)
