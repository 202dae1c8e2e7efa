"""One write path: file contents are replaced only by provision/fsutil.write_file (the hardened one). A rename
elsewhere is allowed only where it switches something that is not file content, each named here with its reason."""
from __future__ import annotations

import re

from tests.conftest import REPO

# path -> how many renames it may hold, and why they are not file writes
NOT_FILE_CONTENT = {
    "provision/inject/server.py": (1, "the editor's socket, bound under a temp name then renamed into place"),
    "provision/bundle/create.py": (1, "a completed `--resume` bundle directory (OUTPUT.partial) renamed to OUTPUT"),
    "provision/bundle/install.py": (1, "a verified, unpacked bundle directory moved to its content-named place"),
    "provision/inject/install.py": (2, "the editor's copy: a whole directory moved to its content-named place, and "
                                       "the `current` symlink"),
    "provision/inject/compat.py": (1, "a new file named by its own sha256 (an image's compat library copied for runc),"
                                      " renamed into place once whole: nothing existing is replaced"),
}
RENAME = re.compile(r"\bos\.(replace|rename)\(|\.rename\(|\bmkstemp\(|NamedTemporaryFile\(")


def matches_outside_fsutil(pattern: re.Pattern) -> dict[str, int]:
    """module path -> how many times `pattern` occurs in it, for every provision module but fsutil.py."""
    found: dict[str, int] = {}
    for p in sorted((REPO / "provision").rglob("*.py")):
        rel = str(p.relative_to(REPO))
        n = len(pattern.findall(p.read_text())) if rel != "provision/fsutil.py" else 0
        if n:
            found[rel] = n
    return found


def test_only_fsutil_replaces_file_contents():
    found = matches_outside_fsutil(RENAME)
    assert found == {k: n for k, (n, _why) in NOT_FILE_CONTENT.items()}


# Direct writes that are not a host file's content being replaced, each with why it may bypass write_file. Anything
# else that writes (write_text/write_bytes, open(..., "w"/"a")) must go through provision/fsutil.write_file.
DIRECT_WRITE = re.compile(r"\.write_(text|bytes)\(|\bopen\([^)]*[\"'][wa]b?[\"']")
DIRECT_WRITES_ALLOWED = {
    "provision/bundle/aptrepo.py": (3, "a bundle being built: files in the new bundle's own directory"),
    "provision/bundle/manifest.py": (2, "a bundle being built: manifest.json and SHA256SUMS in its own directory"),
    "provision/bundle/create.py": (1, "a bundle being built: install-offline.sh in its own directory"),
    "provision/engines/containerd.py": (2, "a private temporary copy of the config for `containerd config dump`; "
                                        "verify's check image stamp, written last into the tree it just built"),
    "provision/inject/install.py": (1, "a candidate front-end in a private temporary directory, run once to test it"),
    "provision/engines/validate.py": (2, "the check image's tar and its OCI archive (containerd), in memory"),
    "provision/effects.py": (1, "a background daemon's log (effects.spawn: dockerd, …), appended to"),
    "provision/plan/apply.py": (1, "bootstrap's log, appended to"),
    "provision/plan/archive_preview.py": (2, "the plan's private apt refresh: sources and apt.conf copies in its own "
                                             "temporary directory, removed after"),
    "provision/inject/shim.py": (1, "the runtime's debug log, appended to"),
}


def test_host_files_are_written_only_by_fsutil():
    found = matches_outside_fsutil(DIRECT_WRITE)
    unexpected = {k: v for k, v in found.items() if DIRECT_WRITES_ALLOWED.get(k, (0,))[0] != v}
    missing = {k: v for k, (v, _why) in DIRECT_WRITES_ALLOWED.items() if k not in found}
    assert not unexpected and not missing, (
        f"direct writes outside fsutil.write_file: {unexpected} (route them through it, or name them here with the "
        f"reason); listed here but gone: {missing}")
