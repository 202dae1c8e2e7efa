"""One write path: file contents are replaced only by provision/fsutil.write_file (the hardened one). A rename
elsewhere is allowed only where it switches something that is not file content, each named here with its reason."""
from __future__ import annotations

import re

from tests.conftest import REPO

# path -> how many renames it may hold, and why they are not file writes
NOT_FILE_CONTENT = {
    "provision/inject/server.py": (1, "the editor's socket, bound under a temp name then renamed into place"),
    "provision/commands/runtime_cmds.py": (2, "driver-volume: a whole version directory, and the `current` symlink"),
    "provision/bundle/install.py": (1, "a verified, unpacked bundle directory moved to its content-named place"),
}
RENAME = re.compile(r"\bos\.(replace|rename)\(|\.rename\(|\bmkstemp\(|NamedTemporaryFile\(")


def test_only_fsutil_replaces_file_contents():
    found: dict[str, int] = {}
    for p in sorted((REPO / "provision").rglob("*.py")):
        rel = str(p.relative_to(REPO))
        if rel == "provision/fsutil.py":
            continue
        n = len(RENAME.findall(p.read_text()))
        if n:
            found[rel] = n
    assert found == {k: n for k, (n, _why) in NOT_FILE_CONTENT.items()}
