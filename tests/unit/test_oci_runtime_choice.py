"""Issue 27.12: the runtime wraps the OCI runtime the host has. Debian's podman brings crun alone (Depends
crun | runc); gpuprov-runtime handed over to /usr/sbin/runc regardless, and `podman run --runtime nvidia` failed with
"cannot exec /usr/sbin/runc". The proof with Podman and crun: tests/integration/test_podman.py::test_2b."""
from __future__ import annotations

import os

import pytest

from provision.inject import install


def _bin(d, name):
    p = d / name
    p.write_text("#!/bin/sh\n")
    p.chmod(0o755)
    return str(p)


@pytest.mark.parametrize("present,want", [(("crun",), "crun"), (("runc", "crun"), "runc"), ((), None)])
def test_the_low_level_runtime_is_one_the_host_has(tmp_path, monkeypatch, present, want):
    paths = {n: _bin(tmp_path, n) for n in present}
    monkeypatch.setenv("PATH", str(tmp_path))
    assert install.default_oci_runtime() == paths.get(want)
    assert (f'"runc": "{paths[want]}"' if want else '"runc": null') in install._stamp("/usr/local", "/")
    assert os.environ["PATH"] == str(tmp_path)
