"""`./install.sh` from a checkout on a fresh Debian 12 server with no compiler, no pip and no gpuprov: the runtime's
compiled front-end is built anyway (install.sh fetches Debian's compiler into a throwaway directory for the wheel
build), and the host ends with no compiler installed and no toolchain left behind.

The server has no route to the Python package index here, so pip's index is a wheelhouse built on this machine
(PIP_NO_INDEX/PIP_FIND_LINKS: gpuprov's dependencies and setuptools for the build); gpuprov itself is built from the
checkout's source, as an operator's `./install.sh` builds it. The Debian archive is reached as on a real server."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import needs
from tests.integration.hosts import Host, ensure_wheelhouse

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
FIXTURE = "/src/tests/fixtures/hosts/h200-vm"
COMPILERS = "for t in gcc cc c99 clang tcc; do command -v $t; done"
TOOLCHAIN_PACKAGES = ("dpkg-query -W -f '${db:Status-Abbrev} ${Package}\\n' gcc 'gcc-[0-9]*[0-9]' cpp "
                      "'cpp-[0-9]*[0-9]' 'binutils*' libc6-dev 2>/dev/null | grep '^ii' || true")


@pytest.fixture(scope="module")
def build_wheels(tmp_path_factory):
    """gpuprov's dependencies (the test wheelhouse, minus gpuprov's own wheel) plus setuptools for the build."""
    d = tmp_path_factory.mktemp("build-wheels")
    for w in ensure_wheelhouse().glob("*.whl"):
        if not w.name.startswith("gpuprov-"):
            (d / w.name).write_bytes(w.read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "setuptools>=70.1",
                    "wheel", "-d", str(d)], check=True, capture_output=True, timeout=600)
    d.chmod(0o755)
    return d


@pytest.fixture(scope="module")
def host(build_wheels):
    h = Host(wheelhouse=False, volumes={str(build_wheels): "/bw"})
    try:
        yield h
    finally:
        h.remove()


def test_checkout_install_on_a_bare_server_gets_the_compiled_front_end(host):
    assert host.exec(COMPILERS).stdout == "", "not a bare host"
    assert host.exec(TOOLCHAIN_PACKAGES).stdout == ""
    r = host.exec("mkdir /tmp/checkout && cd /src && tar -c --exclude=./.venv --exclude=./.git --exclude='./.gpu-*' "
                  "--exclude=./build --exclude='*.egg-info' . | tar -x -C /tmp/checkout", timeout=300)
    assert r.returncode == 0, r.stderr
    r = host.exec("cd /tmp/checkout && PIP_NO_INDEX=1 PIP_FIND_LINKS=/bw ./install.sh --install-only", timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "fetching one into a temporary directory" in r.stderr
    assert "Python front-end" not in r.stderr, r.stderr[-2000:]
    # the wheel it installed from is kept beside the install: `gpuprov bundle create` packs it (issue 28 item 13)
    assert host.exec("ls /opt/gpuprov/wheels/gpuprov-*.whl").returncode == 0
    # the host is as bare as before: no compiler on PATH, none installed, no toolchain directory left
    assert host.exec(COMPILERS).stdout == ""
    assert host.exec(TOOLCHAIN_PACKAGES).stdout == ""
    assert host.exec("ls -d /tmp/gpuprov-toolchain.* 2>/dev/null").stdout == ""
    r = host.exec("mkdir -p /opt/fake-gpu/dev && gpuprov runtime install --driver-root "
                  f"{FIXTURE}/usr/local/nvidia --dev-root /opt/fake-gpu --proc-root {FIXTURE} --json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["front_end"] == "compiled" and res["front_end_origin"] == "wheel", res
    # a static binary: it runs whatever the host's glibc is
    assert host.exec("head -c 4 /usr/local/bin/gpuprov-runtime | od -c | head -1").stdout.split()[1:5] == \
        ["177", "E", "L", "F"]
    assert host.exec("/usr/local/bin/gpuprov-runtime --gpuprov-front-end").returncode == 0  # runs here, no loader
