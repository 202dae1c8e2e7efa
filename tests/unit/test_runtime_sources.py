"""One list of the runtime's source files, derived from the package (provision/inject/sources.py): every gpuprov
module the editor really loads is in it, so `runtime install`'s stamp and the warm editor's upgrade check see a
change to any of them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from provision.inject import install, server
from provision.inject.sources import source_files
from tests.conftest import REPO

LOAD = """
import json, sys
from provision.inject import server, shim, modify  # what modify_main (the cold entry) and the warm editor run
from provision.share import limits
print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items() if n.startswith("provision") and m.__file__)))
"""


def test_every_module_the_editor_loads_is_listed():
    p = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr
    loaded = {str(f) for f in json.loads(p.stdout)}
    listed = {str(f) for f in source_files()}
    assert loaded <= listed, loaded - listed
    assert {"shim.c", "hook.sh"} <= {f.name for f in source_files()}


def test_install_stamp_and_editor_check_use_that_list(tmp_path, monkeypatch):
    """Touching a file the editor runs but that no hand-written list named (share/limits.py) changes both."""
    limits = next(f for f in source_files() if f.name == "limits.py")
    before_stamp, before_code = install._stamp("/usr/local", "/"), server._code_stamp()
    copy = tmp_path / "limits.py"
    copy.write_bytes(limits.read_bytes() + b"\n# changed\n")
    monkeypatch.setattr("provision.inject.install.source_files",
                        lambda: tuple(copy if f == limits else f for f in source_files()))
    monkeypatch.setattr("provision.inject.sources.source_files",
                        lambda: tuple(copy if f == limits else f for f in source_files()))
    assert install._stamp("/usr/local", "/") != before_stamp
    os.utime(copy, (1e10, 1e10))
    assert server._code_stamp() != before_code
