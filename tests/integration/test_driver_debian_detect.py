"""gpuprov's Debian decisions against Debian's own tool: the real `nvidia-detect` script from the bullseye,
bookworm and trixie packages (the exact versions the vendored lists name, fetched by scripts/
debian_nvidia_detect.py), run over every id in its lists, each in a container that is that suite as far as the
script can tell (/etc/debian_version, /usr/share/nvidia). One script call per id: the script accepts several ids
in one call, but it never resets its recommendation between them, so an id Debian gives no package inherits the
previous id's (seen: bullseye 10de:06e0, a 340-legacy GeForce, "recommended" nvidia-legacy-390xx-driver). The
calls run in two loops per suite container, the three suites at once.

Agreement means: the package Debian recommends is the driver package gpuprov installs, and where Debian
recommends none gpuprov installs none. Where Debian is shown wrong the id is in EXCEPTIONS with the reason.
"""
from __future__ import annotations

import concurrent.futures
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from provision.decide import debian
from provision.decide.driver import decide_gpu
from provision.decide.gputable import PciId
from provision.decide.targets import TARGETS
from tests.conftest import REPO, needs
from tests.integration.hosts import ensure_image

pytestmark = [pytest.mark.integration, needs("apt-get", "dpkg-deb", docker=True)]
SUITE_TARGET = {"bullseye": "debian-11", "bookworm": "debian-12", "trixie": "debian-13"}
DEBIAN_VERSION = {"bullseye": "11.11", "bookworm": "12.12", "trixie": "13.2"}  # what /etc/debian_version says
# (suite, device) -> why Debian's recommendation is wrong. Empty: gpuprov agrees on every id Debian knows.
EXCEPTIONS: dict[tuple[str, int], str] = {}
CHECK_RE = re.compile(r"^Checking driver support for PCI ID \[10de:([0-9A-Fa-f]{4})\]$")


@pytest.fixture(scope="module")
def detect(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("nvidia-detect")
    r = subprocess.run([sys.executable, str(REPO / "scripts/debian_nvidia_detect.py"), "fetch", str(dest),
                        "--vendored"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return dest


LOOPS = 2  # concurrent loops per suite container (2 cores; 3 suites at once)


def run_nvidia_detect(root: Path, suite: str, ids: list[int]) -> dict[int, str | None]:
    """device -> the package the real script recommends (None: none), one script call per id."""
    (root / "debian_version").write_text(DEBIAN_VERSION[suite] + "\n")
    loops = []
    for n in range(LOOPS):
        chunk = " ".join(f"10de:{i:04x}" for i in ids[n::LOOPS])
        loops.append(f"(for id in {chunk}; do bash /usr/bin/nvidia-detect $id; done > /tmp/out.{n}) &")
    script = " ".join(loops) + " wait; cat " + " ".join(f"/tmp/out.{n}" for n in range(LOOPS))
    name = f"driver-nvidia-detect-{suite}-{time.monotonic_ns() % 10**8}"
    argv = ["docker", "run", "--rm", "--name", name, "--network", "none",
            "-v", f"{root / 'usr/share/nvidia'}:/usr/share/nvidia:ro",
            "-v", f"{root / 'debian_version'}:/etc/debian_version:ro",
            "-v", f"{root / 'usr/bin/nvidia-detect'}:/usr/bin/nvidia-detect:ro",
            ensure_image(), "bash", "-c", script]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1200).stdout
    result: dict[int, str | None] = {}
    cur = None
    lines = out.splitlines()
    for i, line in enumerate(lines):
        m = CHECK_RE.match(line)
        if m:
            cur = int(m.group(1), 16)
            result[cur] = None
        elif line == "It is recommended to install the" and cur is not None:
            result[cur] = lines[i + 1].strip().removesuffix(":amd64")
    return result


def gpuprov_package(suite: str, device: int) -> str | None:
    d = decide_gpu(PciId(0x10DE, device), TARGETS[SUITE_TARGET[suite]], kernel_modules="proprietary")
    drivers = {drv.package for drv in debian.SUITES[suite].drivers}
    pkgs = [p for p in d.packages if p in drivers]
    assert len(pkgs) <= 1, (suite, hex(device), d.packages)
    return pkgs[0] if pkgs else None


def test_vendored_lists_are_the_packages(detect):
    """The vendored lists are exactly the ones in the nvidia-detect packages they name."""
    sys.path.insert(0, str(REPO / "scripts"))
    import debian_nvidia_detect as dnd

    for suite in debian.SUITES:
        assert dnd.read_lists(detect / suite) == dnd.regen(detect, {s: "" for s in debian.SUITES}
                                                           )["suites"][suite]["lists"]
        vendored = {n: " ".join(f"{i:04x}" for i in sorted(v)) for n, v in debian._lists()[suite].items()}
        assert dnd.read_lists(detect / suite) == vendored, suite


def test_agrees_with_nvidia_detect_on_every_id(detect):
    t0 = time.monotonic()
    ids = {s: sorted(debian.known_ids(s)) for s in debian.SUITES}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futs = {s: pool.submit(run_nvidia_detect, detect / s, s, ids[s]) for s in debian.SUITES}
        real = {s: f.result() for s, f in futs.items()}
    took = time.monotonic() - t0
    report = []
    for suite in debian.SUITES:
        assert set(real[suite]) == set(ids[suite]), f"{suite}: the script did not answer for every id"
        agree = disagree = excepted = 0
        for dev, want in real[suite].items():
            got = gpuprov_package(suite, dev)
            if got == want:
                agree += 1
                assert (suite, dev) not in EXCEPTIONS, f"stale exception {suite} {dev:04x}"
            elif (suite, dev) in EXCEPTIONS:
                excepted += 1
            else:
                disagree += 1
                report.append(f"{suite} 10de:{dev:04x}: Debian {want}, gpuprov {got}")
        recommended = sum(v is not None for v in real[suite].values())
        print(f"{suite}: {len(ids[suite])} ids ({recommended} with a package): {agree} agree, {excepted} "
              f"exceptions, {disagree} disagree")
    print(f"nvidia-detect over {sum(map(len, ids.values()))} ids in 3 suites: {took:.1f}s")
    assert not report, "\n".join(report[:40])
