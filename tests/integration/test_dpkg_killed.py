"""Issue 44: a dpkg run killed at any of its phases converges with one `gpuprov bootstrap`, through real apt and dpkg.

An operator's `apt-get install` (as unattended-upgrades or an ssh session runs one) is killed with SIGKILL while dpkg
is in the middle of a package, at a moment chosen deterministically: the stand-in package's maintainer script (built
here with dpkg-deb, served from a flat file: repository) says where it is and waits until it is killed. The three
moments dpkg can be cut off in:
- unpack: the package's preinst (dpkg has marked it half-installed and reinst-required: no apt run gets past it
  until it is unpacked again, which the issue saw with libdevmapper1.02.1);
- configure: its postinst (half-configured);
- triggers: another package's trigger, activated by this one, running (the watcher is half-configured while its
  postinst runs for the trigger, the trigger still pending).
Each time the state dpkg records is checked to be that phase's, then `gpuprov bootstrap` runs once: exit 0,
`dpkg --audit` empty, `apt-get check` clean, the package installed at its version, and a second bootstrap changes
nothing. The scripts wait only while /run/gpuprov-test-block names their phase, so the reinstall runs them through."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from provision.bundle.aptrepo import write_flat_repo
from tests.conftest import needs
from tests.integration.hosts import PIDS_OF, Host

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", "dpkg-deb", docker=True)]
BOOT = "gpuprov bootstrap --yes --driver skip --engine none"
BLOCK = "/run/gpuprov-test-block"
# A maintainer script's wait: say where it is, then wait (killed there) while the test's block file names this phase.
WAIT = f'''if grep -qx "$PHASE" {BLOCK} 2>/dev/null; then touch /run/gpuprov-test-in-$PHASE; \
while grep -qx "$PHASE" {BLOCK}; do sleep 0.2; done; fi'''


def deb(out: Path, name: str, version: str, scripts: dict[str, str], triggers: str = "", depends: str = "") -> None:
    root = out / f"{name}-src"
    (root / "DEBIAN").mkdir(parents=True)
    (root / f"usr/share/{name}").mkdir(parents=True)
    (root / f"usr/share/{name}/payload").write_text(f"{name} {version}\n")
    control = (f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: gpuprov tests <t@gpuprov.invalid>\n"
               + (f"Depends: {depends}\n" if depends else "") + f"Description: stand-in ({name})\n")
    (root / "DEBIAN/control").write_text(control)
    for script, body in scripts.items():
        path = root / "DEBIAN" / script
        path.write_text(f"#!/bin/sh\nset -e\n{body}\nexit 0\n")
        path.chmod(0o755)
    if triggers:
        (root / "DEBIAN/triggers").write_text(triggers)
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root),
                    str(out / f"{name}_{version}_all.deb")], check=True, capture_output=True)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dpkg-killed-repo")
    deb(out, "gpuprov-test-unpack", "1.0-1", {"preinst": f"PHASE=unpack; {WAIT}"})
    deb(out, "gpuprov-test-configure", "1.0-1", {"postinst": f"PHASE=configure; {WAIT}"})
    deb(out, "gpuprov-test-watcher", "1.0-1", {"postinst": f'if [ "$1" = triggered ]; then PHASE=triggers; {WAIT}; fi'},
        triggers="interest gpuprov-test-trigger\n")
    deb(out, "gpuprov-test-activator", "1.0-1", {}, triggers="activate-await gpuprov-test-trigger\n",
        depends="gpuprov-test-watcher")
    for src in out.glob("*-src"):
        subprocess.run(["rm", "-rf", str(src)], check=True)
    write_flat_repo(out)
    return out


@pytest.fixture(scope="module")
def host(repo):
    h = Host(volumes={str(repo): "/srv/standin"})
    try:
        assert h.install_gpuprov().returncode == 0
        h.exec("echo 'deb [trusted=yes] file:/srv/standin ./' > /etc/apt/sources.list.d/standin.list && "
               "apt-get update -qq", check=True, timeout=600)
        # the watcher first, so that the triggers case's own install is the activator's
        h.exec("DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gpuprov-test-watcher", check=True)
        yield h
    finally:
        h.remove()


def status(h: Host, package: str) -> str:
    return h.exec(f"dpkg-query -W -f '${{db:Status-Abbrev}}${{Status}}' {package}").stdout


def kill_during(h: Host, phase: str, package: str) -> None:
    """The operator's apt-get install of PACKAGE, killed (SIGKILL: apt, dpkg and the script) in PHASE."""
    h.exec(f"rm -f /run/gpuprov-test-in-*; echo {phase} > {BLOCK}", check=True)
    h.spawn(f"DEBIAN_FRONTEND=noninteractive apt-get install -y {package} > /tmp/operator-{phase}.log 2>&1")
    for _ in range(600):
        if h.exec(f"test -e /run/gpuprov-test-in-{phase}").returncode == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"dpkg never reached {phase}: {h.exec(f'cat /tmp/operator-{phase}.log').stdout[-2000:]}")
    left = h.exec("kill -9 $(" + PIDS_OF.format(names="apt-get dpkg sh preinst postinst") + ") 2>/dev/null; sleep 1; "
                  + PIDS_OF.format(names="apt-get dpkg"))
    assert left.stdout.strip() == "", "apt or dpkg survived kill -9"
    h.exec(f"rm -f {BLOCK}", check=True)


@pytest.mark.parametrize("phase, package, left, state", [
    ("unpack", "gpuprov-test-unpack", "gpuprov-test-unpack", "reinstreq half-installed"),
    ("configure", "gpuprov-test-configure", "gpuprov-test-configure", "half-configured"),
    # dpkg runs the watcher's postinst for the trigger with the watcher half-configured, its trigger still pending
    ("triggers", "gpuprov-test-activator", "gpuprov-test-watcher", "half-configured"),
])
def test_killed_dpkg_converges_with_one_bootstrap(host, phase, package, left, state):
    kill_during(host, phase, package)
    assert status(host, left).endswith(state), status(host, left)  # the kill landed where this case says
    assert left in host.exec("dpkg --audit").stdout  # dpkg itself says it is broken
    plan = host.exec(BOOT.replace("bootstrap --yes", "plan") + " --json")
    assert plan.returncode == 0, plan.stderr
    recover = next(s for s in json.loads(plan.stdout)["steps"] if s["id"] == "packages.recover")
    assert left in recover["title"], recover["title"]  # the plan names what it will finish

    r = host.exec(BOOT + " --json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert host.exec("dpkg --audit").stdout.strip() == "" and host.exec("apt-get check -q").returncode == 0
    for p in {package, left}:
        assert status(host, p) == "ii install ok installed", (p, status(host, p))
    assert host.exec(f"cat /usr/share/{package}/payload").stdout == f"{package} 1.0-1\n"
    again = json.loads(host.exec(BOOT + " --json").stdout)
    assert again["changed"] == 0, again
