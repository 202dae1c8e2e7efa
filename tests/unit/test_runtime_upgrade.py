"""Upgrading gpuprov never changes the code a starting container runs: the editor runs from its own copy
(inject/install.py: install_editor), made whole before it is named, with `current` swapped atomically; a warm editor
serving a copy that is no longer current answers no request (the front-end then edits directly) and exits. The
end-to-end proof (a real dockerd, concurrent GPU container starts during the upgrade) is
tests/integration/test_day_two.py."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from provision.inject.install import EDITOR_LIB, install_editor
from provision.inject.sources import PKG, source_files


def test_editor_copy_is_whole_and_current_names_it(tmp_path):
    changed: list[str] = []
    copy = install_editor(str(tmp_path), changed)
    base = tmp_path / EDITOR_LIB
    assert os.readlink(base / "current") == copy.name and changed == [str(copy), str(base / "current")]
    for f in source_files():
        assert (copy / f.relative_to(PKG.parent)).read_bytes() == f.read_bytes()
    again: list[str] = []
    assert install_editor(str(tmp_path), again) == copy and again == []  # same code: nothing written
    for old in ("0000000000000001", "0000000000000002"):
        (base / old).mkdir()
    os.remove(base / "current")
    os.symlink("0000000000000002", base / "current")  # as if an older version were current
    assert install_editor(str(tmp_path), []) == copy
    assert sorted(p.name for p in base.iterdir()) == sorted([copy.name, "0000000000000002", "current"])


def _ask(sock: Path) -> bytes:
    with socket.socket(socket.AF_UNIX) as c:
        c.settimeout(5)
        c.connect(str(sock))
        c.sendall(b"/nonexistent-bundle\t\t\n")
        return c.recv(4096)


def test_editor_of_a_replaced_copy_answers_nothing_and_exits(tmp_path):
    copy = install_editor(str(tmp_path), [])
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    sock = run / "editor.sock"
    env = {"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(tmp_path / "runtime.json")}
    code = (f"import sys; sys.path.insert(0, {str(copy)!r}); from provision.inject.server import serve; "
            f"raise SystemExit(serve({str(sock)!r}))")  # the copy's server, as modify_main.py leaves it behind
    server = subprocess.Popen([sys.executable, "-I", "-S", "-c", code], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert time.monotonic() < deadline and server.poll() is None, "the editor never listened"
            time.sleep(0.05)
        assert _ask(sock).split(b"\t")[0].isdigit()  # current: it answers
        base = tmp_path / EDITOR_LIB
        os.symlink("0123456789abcdef", base / ".c")
        os.replace(base / ".c", base / "current")  # an upgrade made another copy current
        try:
            answer = _ask(sock)
        except OSError:  # (it may have gone already, on its idle poll)
            answer = b""
        assert answer == b""  # no answer: the front-end edits directly, with its own copy
        assert server.wait(timeout=10) == 0
    finally:
        if server.poll() is None:
            server.kill()


def test_only_an_editor_copy_skips_the_source_stat_after_each_request(tmp_path):
    """A copy's files never change (its directory is named by their hash): it notices an upgrade by `current` alone
    (the test above), without a stat of every source file after each request; the package's own editor keeps it."""
    copy = install_editor(str(tmp_path), [])
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from provision.inject import server; "
            "print(server.__file__, server._upgrade_stamp())")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(copy)], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0].startswith(str(copy)) and out[1] == "None"
    from provision.inject import server

    assert isinstance(server._upgrade_stamp(), float)
