"""Issue 44's dnf half: a dnf run killed at any moment of its rpm transaction converges with one `gpuprov bootstrap`,
through real dnf 4.14 and rpm 4.18 on a Rocky 9 host container (tests/integration/el_hosts.py).

An operator's `dnf upgrade` (or install) is killed with SIGKILL (dnf first, then the scriptlet's shell) at a moment
chosen deterministically: the stand-in packages' scriptlets (tests/fixtures/dnf-killed/stand-in.spec, built here with
rpmbuild in the EL image) say where they are and wait while /run/gpuprov-test-block names them. rpm installs an
upgrade's new package before it erases the old one, so the moments are:
- pre: the new package's %pre, before any of its files or its header: rpm's database as before the transaction,
  dnf's history says it never ended; nothing to finish (no recover step), and nothing is changed;
- post: the new package's %post: both headers in rpm's database (duplicates), the new one's %post cut off;
- preun / postun: the old package's erase: duplicates, the new one whole;
- posttrans: after the erase: no duplicate, only dnf's history tells (the %posttrans cut off);
- fresh: a fresh install (a package and its dependency) killed in the package's %post: no duplicate, history only;
- reinstall: a `dnf reinstall` (as the recovery's own) killed in %post: the same version's header twice;
- dependent: a library's upgrade killed in its %post while the package that needs its old version exactly (as
  nvidia-x11-drv needs nvidia-x11-drv-libs = V-R) still waits for its own: dnf finishes that upgrade too, and
  nothing is removed;
- gone: as post, and then the repository drops the new version and dnf's cache is cleaned: exit 4 with one line
  before any change, and once the version is back, the bootstrap converges.
Each time the kill is checked to have landed there (rpm's database, the scriptlets' log), the plan names what it will
finish, then one bootstrap (the EL tests' own arguments) exits 0: `dnf check` clean, `dnf repoquery --duplicates`
empty, `rpm -V` clean for the case's packages, each at its version with its %post and %posttrans run whole, and a
second bootstrap changes nothing."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import needs
from tests.integration.el_hosts import ElHost, el_image, url
from tests.integration.hosts import PIDS_OF, built_in_container, sh
from tests.shared_builds import CACHE

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dnf-killed"
GPU = "10de:2330"
DRIVER = (f"gpuprov bootstrap --yes --for-gpu {GPU} --engine none --no-validate "  # as tests/integration/test_el_dnf.py
          f"--mirror elrepo={url('elrepo')}")
PLAN = DRIVER.replace("bootstrap --yes", "plan").replace(" --no-validate", "") + " --json"
BLOCK = "/run/gpuprov-test-block"
LOG = "/var/log/gpuprov-test-scriptlets"  # each scriptlet that ran to its end: "NAME SCRIPTLET VERSION $1"
REPO = "/srv/www/killed"  # served at url('killed'); /srv/killed keeps every package built
# (name, version, Requires) of each stand-in built: a pair of versions per upgrade case
BUILT = [*((f"gpuprov-test-{c}", v, "") for c in ("pre", "post", "preun", "postun", "posttrans", "gone")
           for v in ("1.0", "2.0")),
         ("gpuprov-test-fresh-lib", "2.0", ""), ("gpuprov-test-fresh", "2.0", "gpuprov-test-fresh-lib"),
         ("gpuprov-test-again", "2.0", ""),
         ("gpuprov-test-lib", "1.0", ""), ("gpuprov-test-lib", "2.0", ""),
         ("gpuprov-test-app", "1.0", "gpuprov-test-lib = 1.0"), ("gpuprov-test-app", "2.0", "gpuprov-test-lib = 2.0")]
# Runs in a container of the EL image: every stand-in of BUILT with rpmbuild, as a repository (createrepo_c).
BUILD = f'''
import glob, json, shutil, subprocess, pathlib
out = pathlib.Path("/out/killed"); out.mkdir(parents=True)
for name, version, requires in json.loads({json.dumps(json.dumps(BUILT))}):
    defs = ["--define", f"pkg {{name}}", "--define", f"ver {{version}}"]
    defs += ["--define", f"req {{requires}}"] if requires else []
    subprocess.run(["rpmbuild", "-bb", "--quiet", "--define", "_topdir /tmp/rb", *defs, "/fx/stand-in.spec"],
                   check=True, capture_output=True)
for f in glob.glob("/tmp/rb/RPMS/noarch/*.rpm"):
    shutil.copy(f, out)
subprocess.run(["createrepo_c", "-q", str(out)], check=True)
'''


@dataclass(frozen=True)
class Case:
    operator: str  # the operator's dnf command that is killed
    block: str  # "NAME SCRIPTLET VERSION": where it is killed
    left: dict[str, list[str]]  # rpm's database after the kill: name -> its headers' EPOCH:VERSION-RELEASE, sorted
    done: dict[str, str] = field(default_factory=dict)  # after the bootstrap: name -> EPOCH:VERSION-RELEASE
    finishes: tuple[str, ...] = ()  # what the plan's recover step names (none: no recover step)


OLD_NEW = ["0:1.0-1", "0:2.0-1"]
CASES = {
    "pre": Case("dnf upgrade -y gpuprov-test-pre", "gpuprov-test-pre pre 2.0", {"gpuprov-test-pre": ["0:1.0-1"]},
                {"gpuprov-test-pre": "0:1.0-1"}),
    "post": Case("dnf upgrade -y gpuprov-test-post", "gpuprov-test-post post 2.0", {"gpuprov-test-post": OLD_NEW},
                 {"gpuprov-test-post": "0:2.0-1"},
                 ("gpuprov-test-post-0:1.0-1.noarch", "gpuprov-test-post-0:2.0-1.noarch")),
    "preun": Case("dnf upgrade -y gpuprov-test-preun", "gpuprov-test-preun preun 1.0",
                  {"gpuprov-test-preun": OLD_NEW}, {"gpuprov-test-preun": "0:2.0-1"},
                  ("gpuprov-test-preun-0:1.0-1.noarch", "gpuprov-test-preun-0:2.0-1.noarch")),
    "postun": Case("dnf upgrade -y gpuprov-test-postun", "gpuprov-test-postun postun 1.0",
                   {"gpuprov-test-postun": OLD_NEW}, {"gpuprov-test-postun": "0:2.0-1"},
                   ("gpuprov-test-postun-0:1.0-1.noarch", "gpuprov-test-postun-0:2.0-1.noarch")),
    "posttrans": Case("dnf upgrade -y gpuprov-test-posttrans", "gpuprov-test-posttrans posttrans 2.0",
                      {"gpuprov-test-posttrans": ["0:2.0-1"]}, {"gpuprov-test-posttrans": "0:2.0-1"},
                      ("gpuprov-test-posttrans-0:2.0-1.noarch",)),
    "fresh": Case("dnf install -y gpuprov-test-fresh", "gpuprov-test-fresh post 2.0",
                  {"gpuprov-test-fresh": ["0:2.0-1"], "gpuprov-test-fresh-lib": ["0:2.0-1"]},
                  {"gpuprov-test-fresh": "0:2.0-1", "gpuprov-test-fresh-lib": "0:2.0-1"},
                  ("gpuprov-test-fresh-0:2.0-1.noarch", "gpuprov-test-fresh-lib-0:2.0-1.noarch")),
    "dependent": Case("dnf upgrade -y gpuprov-test-app", "gpuprov-test-lib post 2.0",
                      {"gpuprov-test-lib": OLD_NEW, "gpuprov-test-app": ["0:1.0-1"]},
                      {"gpuprov-test-lib": "0:2.0-1", "gpuprov-test-app": "0:2.0-1"},
                      ("gpuprov-test-lib-0:1.0-1.noarch", "gpuprov-test-lib-0:2.0-1.noarch")),
    "reinstall": Case("dnf reinstall -y gpuprov-test-again", "gpuprov-test-again post 2.0",
                      {"gpuprov-test-again": ["0:2.0-1", "0:2.0-1"]}, {"gpuprov-test-again": "0:2.0-1"},
                      ("gpuprov-test-again-0:2.0-1.noarch",)),
    "gone": Case("dnf upgrade -y gpuprov-test-gone", "gpuprov-test-gone post 2.0", {"gpuprov-test-gone": OLD_NEW},
                 {"gpuprov-test-gone": "0:2.0-1"},
                 ("gpuprov-test-gone-0:1.0-1.noarch", "gpuprov-test-gone-0:2.0-1.noarch")),
}
OPERATOR_FIRST = ("kernel gpuprov-test-pre-1.0 gpuprov-test-post-1.0 gpuprov-test-preun-1.0 gpuprov-test-postun-1.0 "
                  "gpuprov-test-posttrans-1.0 gpuprov-test-gone-1.0 gpuprov-test-lib-1.0 gpuprov-test-app-1.0 "
                  "gpuprov-test-again-2.0")


@pytest.fixture(scope="module")
def repo() -> Path:
    return built_in_container(CACHE / "dnf-killed", FIXTURE, el_image(), BUILD)


@pytest.fixture(scope="module")
def host(repo):
    """A Rocky 9 host with its kernel and the stand-ins' 1.0 installed by the operator, and the driver installed by
    gpuprov (then a reboot, and the run that resumes after it), so that each case's one bootstrap is the recovery's
    and ends with exit 0."""
    h = ElHost("9")
    try:
        for dest in (REPO, "/srv/killed"):
            sh("docker", "cp", f"{repo}/killed", f"{h.name}:{dest}")
        h.write("/etc/yum.repos.d/standin-killed.repo",
                f"[standin-killed]\nname=stand-ins whose scriptlets wait\nbaseurl={url('killed')}\ngpgcheck=0\n")
        h.install_gpuprov()
        h.exec(f"dnf install -y -q {OPERATOR_FIRST}", check=True)
        r = h.exec(DRIVER)
        assert r.returncode == 7, r.stdout[-3000:] + r.stderr[-3000:]  # the driver is in: a reboot is due
        h.reboot()
        r = h.exec(DRIVER)  # the run that resumes after the reboot says there is no GPU to verify on (once)
        assert r.returncode == 15, r.stdout[-3000:] + r.stderr[-3000:]
        yield h
    finally:
        h.remove()


def headers(h: ElHost, names) -> dict[str, list[str]]:
    out = h.exec("rpm -q --qf '%{NAME} %{EPOCHNUM}:%{VERSION}-%{RELEASE}\\n' " + " ".join(names)).stdout
    got: dict[str, list[str]] = {}
    for line in out.splitlines():
        if " " in line and "not installed" not in line:
            name, evr = line.split(" ", 1)
            got.setdefault(name, []).append(evr)
    return {n: sorted(v) for n, v in got.items()}


def kill_during(h: ElHost, case: str, c: Case) -> None:
    """The operator's dnf, killed (SIGKILL: dnf, then the scriptlet's shell) while c.block's scriptlet waits. The
    bash that starts dnf outlives it and reaps it, as a login shell or systemd would (this host's PID 1 reaps
    nothing): dnf's lock then names a process that is gone."""
    name = c.block.split()[1]
    h.exec(f"rm -f /run/gpuprov-test-in-*; : > {LOG}; echo '{c.block}' > {BLOCK}", check=True)
    h.spawn(f"{c.operator} > /tmp/operator-{case}.log 2>&1; echo exit $? >> /tmp/operator-{case}.log")
    for _ in range(600):
        if h.exec(f"test -e /run/gpuprov-test-in-{name}").returncode == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"rpm never reached {c.block}: {h.exec(f'cat /tmp/operator-{case}.log').stdout[-2000:]}")
    left = h.exec("kill -9 $(" + PIDS_OF.format(names="dnf") + ") 2>/dev/null; sleep 0.5; kill -9 $("
                  + PIDS_OF.format(names="sh") + ") 2>/dev/null; sleep 1; " + PIDS_OF.format(names="dnf sh"))
    assert left.stdout.strip() == "", "dnf or its scriptlet survived kill -9"
    h.exec(f"rm -f {BLOCK}", check=True)


def ran(h: ElHost) -> list[str]:
    return h.exec(f"cat {LOG}").stdout.splitlines()


def converged(h: ElHost, c: Case) -> None:
    check = h.exec("dnf check")
    assert check.returncode == 0 and check.stdout.strip() == "", check.stdout + check.stderr
    dupes = h.exec("dnf -q repoquery --duplicates")
    assert dupes.returncode == 0 and dupes.stdout.strip() == "", dupes.stdout
    assert headers(h, c.done) == {n: [v] for n, v in c.done.items()}
    for name, evr in c.done.items():
        verify = h.exec(f"rpm -V {name}")
        assert verify.returncode == 0, verify.stdout  # every file as rpm's header says (none of the older left)
        version = evr.split(":")[1].split("-")[0]
        assert h.exec(f"cat /usr/share/{name}/payload").stdout == f"{name} {version}\n"


@pytest.mark.parametrize("case", list(CASES))
def test_killed_dnf_converges_with_one_bootstrap(host, case):
    c = CASES[case]
    kill_during(host, case, c)
    assert headers(host, c.left) == c.left  # the kill landed where this case says: rpm's database ...
    name, scriptlet, version = c.block.split()
    assert f"{name} {scriptlet} {version}" not in " ".join(ran(host))  # ... and that scriptlet never finished
    last = host.exec("dnf history info last").stdout
    assert "Return-Code    : Failure" in last and c.operator.split()[-1] in last, last  # dnf's history: never ended
    if case == "gone":  # the repository moves on, dnf's cache is cleaned: that version is nowhere to fetch
        host.exec(f"set -e; rm {REPO}/gpuprov-test-gone-2.0-1.noarch.rpm; createrepo_c -q --update {REPO}; "
                  "dnf clean all -q", check=True)
        before = headers(host, c.left)
        r = host.exec(DRIVER)
        assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-3000:]
        line = next(ln for ln in r.stderr.splitlines() if "gpuprov-test-gone 0:2.0-1" in ln)
        assert "can no longer fetch" in line and "dnf distro-sync gpuprov-test-gone" in line, r.stderr
        assert headers(host, c.left) == before  # nothing changed
        host.exec(f"set -e; cp /srv/killed/gpuprov-test-gone-2.0-1.noarch.rpm {REPO}/; "
                  f"createrepo_c -q --update {REPO}", check=True)

    plan = host.exec(PLAN)
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    recover = [s for s in json.loads(plan.stdout)["steps"] if s["id"] == "packages.recover"]
    if c.finishes:
        assert all(p in recover[0]["title"] for p in c.finishes), recover  # the plan names what it will finish
    else:
        assert recover == [], recover  # nothing rpm recorded is part-way: nothing to finish

    host.exec(f": > {LOG}")
    r = host.exec(DRIVER + " --json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    converged(host, c)
    finished = ran(host)
    for name, evr in c.done.items():  # each package the kill cut into has had its scriptlets whole since
        if name in c.left and c.finishes:
            version = evr.split(":")[1].split("-")[0]
            for s in ("pre", "post", "posttrans"):
                assert any(ln.startswith(f"{name} {s} {version} ") for ln in finished), (name, s, finished)
    if not c.finishes:
        assert finished == [], finished  # nothing ran: the package stays as the transaction found it
    again = json.loads(host.exec(DRIVER + " --json").stdout)
    assert again["changed"] == 0, again
