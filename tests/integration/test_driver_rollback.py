"""Issue 27 item 4, with real apt, dpkg and DKMS: a failed in-branch driver update keeps the driver that worked.

A Debian 12 systemd host (driver_hosts' prepared kernel image, plus DKMS, a compiler and that kernel's headers: one
cached image) and a stand-in of the driver's two Debian packages, built here with dpkg-deb, served over HTTP by a
local apt repository (gpuprov's own flat-repository writer), so apt downloads into its cache as from a mirror:
`nvidia-kernel-dkms` (source nvidia-graphics-drivers, a DKMS package whose postinst is DKMS's common.postinst, as
dh_dkms writes it) and the `nvidia-driver` metapackage that depends on exactly its version. 535.261.03 is a tiny
module that builds; 535.309.01, the in-branch update, stops at an `#error` in its source, as a driver that does not
build against the kernel does. NVIDIA's own module is not needed for what is proven here (and costs minutes per
build: tests/integration/test_driver_install.py builds it).

gpuprov installs 535.261.03 (its DriverInstall action, as `bootstrap` runs it) and pins the series (the hold step's
script). A kernel then arrives without headers (a kernel DKMS cannot build for: the case that makes gpuprov update
the series). The update, run as `bootstrap` plans it (DriverInstall with the series installed before), fails to
build; the rollback must reinstall 535.261.03 (from the archive, and in the second round, once the archive offers
only the update, from apt's cache), build it for the kernel again, pin exactly that version, leave dpkg consistent,
and name the kernel that still lacks a module (exit 16).

About a minute once the image is built (the image: the kernel image's, plus ~1 minute of apt).
"""
from __future__ import annotations

import hashlib
import re
import textwrap
import time
import uuid

import pytest

from tests.conftest import needs
from tests.integration.driver_hosts import SYSTEMD_FLAGS, KernelHost, kernel_image
from tests.integration.hosts import committed_image, ensure_wheelhouse, sh

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
GOOD, BAD = "535.261.03-1", "535.309.01-1"
SERIES = ("nvidia-driver", "nvidia-kernel-dkms")
MODULE = "nvidia-current"  # Debian's DKMS module name for the proprietary flavour
PORT = 8765
RECIPE = "v1 dkms gcc make linux-headers-K; sources.list kept aside"

# The stand-in packages, built inside the host (dpkg-deb) into /srv/standin/pool, one version per call.
MAKE_DEBS = textwrap.dedent(r"""
    set -e
    v=$1; good=$2; u=${v%-*}; out=/srv/standin/pool; mkdir -p $out
    d=$(mktemp -d); src=$d/usr/src/nvidia-current-$u; mkdir -p $d/DEBIAN $src
    printf 'PACKAGE_NAME="nvidia-current"\nPACKAGE_VERSION="%s"\nBUILT_MODULE_NAME[0]="nvidia-current"\n' $u > $src/dkms.conf
    printf 'DEST_MODULE_LOCATION[0]="/updates/dkms"\nAUTOINSTALL="yes"\n' >> $src/dkms.conf
    echo 'obj-m := nvidia-current.o' > $src/Makefile
    { echo '#include <linux/module.h>'; echo 'MODULE_LICENSE("GPL");'; echo "MODULE_VERSION(\"$u\");"
      [ "$good" = yes ] || echo '#error "stand-in: this driver version does not build against this kernel"'
      echo 'static int __init standin_init(void) { return 0; }'; echo 'module_init(standin_init);'
    } > $src/nvidia-current.c
    cat > $d/DEBIAN/control <<EOF
    Package: nvidia-kernel-dkms
    Source: nvidia-graphics-drivers
    Version: $v
    Architecture: amd64
    Maintainer: gpuprov tests <tests@gpuprov.invalid>
    Depends: dkms
    Description: stand-in for the driver's DKMS module package (gpuprov tests)
    EOF
    post='if [ "$1" = configure ]; then /usr/lib/dkms/common.postinst nvidia-current %s "" "" "$2"; fi'
    printf "#!/bin/sh\nset -e\n$post\n" $u > $d/DEBIAN/postinst
    printf '#!/bin/sh\nset -e\ndkms remove -m nvidia-current -v %s --all >/dev/null 2>&1 || true\n' $u > $d/DEBIAN/prerm
    chmod 755 $d/DEBIAN/postinst $d/DEBIAN/prerm
    dpkg-deb -Zxz -b $d $out/nvidia-kernel-dkms_${v}_amd64.deb >/dev/null
    m=$(mktemp -d); mkdir -p $m/DEBIAN
    cat > $m/DEBIAN/control <<EOF
    Package: nvidia-driver
    Source: nvidia-graphics-drivers
    Version: $v
    Architecture: amd64
    Maintainer: gpuprov tests <tests@gpuprov.invalid>
    Depends: nvidia-kernel-dkms (= $v)
    Description: stand-in for the driver's metapackage (gpuprov tests)
    EOF
    dpkg-deb -Zxz -b $m $out/nvidia-driver_${v}_amd64.deb >/dev/null
    rm -rf $d $m
""")

# The repository's index of what pool/ holds now (gpuprov's flat-repository writer), then apt's lists.
PUBLISH = ("/opt/gpuprov/bin/python -c 'from pathlib import Path; from provision.bundle.aptrepo import "
           "write_flat_repo; write_flat_repo(Path(\"/srv/standin/pool\"))' && apt-get update -qq")

# The driver stage's DriverInstall as `bootstrap` builds it for this series (plan/driver.py, plan/dkms.py), run as it
# runs.
RUN_INSTALL = textwrap.dedent("""
    import sys
    from pathlib import Path
    from provision.errors import GpuprovError
    from provision.package_managers.apt import restore_sources
    from provision.plan.dkms import DriverInstall
    k, kernels, previous = sys.argv[1], tuple(sys.argv[2].split(",")), tuple(filter(None, sys.argv[3].split(",")))
    act = DriverInstall((f"linux-headers-{k}", "nvidia-driver", "nvidia-kernel-dkms"), kernels, "nvidia-kernel-dkms",
                        (f"linux-headers-{k}",), "another kernel", unhold=("nvidia-driver", "nvidia-kernel-dkms")
                        if previous else (), previous=previous, restore=restore_sources(Path("/"), previous))
    try:
        print(act.execute())
    except GpuprovError as exc:
        print(exc)
        raise SystemExit(exc.exit_code)
""")
PIN = "from provision.package_managers.apt import PIN_SERIES; print(PIN_SERIES)"


def dkms_image() -> str:
    """The prepared kernel image with DKMS, a compiler and the kernel's headers, Debian's sources put aside (the
    stand-in repository is then apt's only source: no mirror is asked during the test). Cached by its recipe."""
    base = kernel_image("bookworm")
    tag = hashlib.sha256(f"{RECIPE} {base}".encode()).hexdigest()[:10]
    return committed_image(f"gpuprov-test/driver-bookworm-dkms:{tag}", base,
                           "set -e; k=$(basename $(readlink -f /vmlinuz) | sed s/^vmlinuz-//); apt-get update -q && "
                           "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends dkms gcc make "
                           "linux-headers-$k && apt-get clean && mv /etc/apt/sources.list /etc/apt/sources.list.debian "
                           "&& rm -rf /var/lib/apt/lists/*", cmd='["/lib/systemd/systemd"]')


class DkmsHost(KernelHost):
    def __init__(self):  # KernelHost's, from the image with DKMS and the headers
        self.name = f"driver-rollback-{uuid.uuid4().hex[:10]}"  # unique across workers, as driver_hosts' names
        self.suite = "bookworm"
        sh("docker", "run", "-d", "--name", self.name, *SYSTEMD_FLAGS, "-v", f"{ensure_wheelhouse()}:/wh:ro",
           dkms_image())
        self.wait_systemd()

    def ok(self, script: str) -> str:
        r = self.exec(script)
        assert r.returncode == 0, f"{script}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
        return r.stdout

    def versions(self) -> dict[str, str]:
        out = self.exec("dpkg-query -W -f '${Package} ${Version} ${Status}\\n' " + " ".join(SERIES)).stdout
        return {p: v for p, v, *status in (ln.split(" ", 2) for ln in out.splitlines())
                if status == ["install ok installed"]}

    def install(self, kernels: tuple[str, ...], previous: tuple[str, ...] = ()) -> tuple[int, str]:
        self.ok(f"cat > /tmp/run_install.py <<'EOF'\n{RUN_INSTALL}EOF")
        r = self.exec(f"/opt/gpuprov/bin/python /tmp/run_install.py {kernels[0]} {','.join(kernels)} "
                      f"{','.join(previous) or ','}")
        assert "Traceback" not in r.stderr, r.stderr
        return r.returncode, (r.stdout + r.stderr).strip()


@pytest.fixture(scope="module")
def host():
    h = DkmsHost()
    try:
        h.install_gpuprov()
        h.exec(f"cd /srv 2>/dev/null || mkdir -p /srv; nohup python3 -m http.server {PORT} -d /srv/standin "
               ">/dev/null 2>&1 &")
        h.ok(f"mkdir -p /srv/standin/pool && echo 'deb [trusted=yes] http://127.0.0.1:{PORT}/pool ./' "
             "> /etc/apt/sources.list.d/standin.list")
        yield h
    finally:
        h.remove()


def _assert_kept(h: DkmsHost, k: str, lacking: str, code: int, out: str, took: float) -> None:
    """What a failed update must leave: exit 16 naming the compiler's error and the kernel without a module; the
    versions that worked installed, built for k, pinned exactly; nothing of the failed version; dpkg consistent."""
    assert code == 16, out
    assert "this driver version does not build" in out, out  # the compiler's first error line
    assert f"Rolled back to the driver that worked: reinstalled and pinned nvidia-driver={GOOD}" in out, out
    assert f"kernel {lacking} still has no nvidia module" in out, out
    assert h.versions() == dict.fromkeys(SERIES, GOOD), h.versions()
    status = h.exec(f"dkms status -k {k}").stdout
    assert re.search(rf"^{MODULE}/{GOOD.split('-')[0]}, {re.escape(k)}, x86_64: installed", status, re.M), status
    assert BAD.split("-")[0] not in h.exec("dkms status").stdout  # the failed version is gone from DKMS
    assert h.exec(f"modinfo -k {k} -F version {MODULE}").stdout.strip() == GOOD.split("-")[0]
    assert h.exec("dpkg --audit").stdout.strip() == "" and h.exec("apt-get check").returncode == 0
    # pinned exactly: apt proposes no update of the series while the archive offers the one that failed
    plan = h.exec("apt-get -s dist-upgrade").stdout
    assert not re.search(r"^Inst nvidia", plan, re.M), plan
    for p in SERIES:
        assert f"Candidate: {GOOD}" in h.exec(f"apt-cache policy {p}").stdout
    print(f"rollback round: {took:.1f}s")


def test_a_failed_update_reinstalls_rebuilds_and_pins_the_driver_that_worked(host):
    h = host
    k = h.kernel()
    h.ok(f"cat > /tmp/make_debs.sh <<'MAKEDEBS'\n{MAKE_DEBS}MAKEDEBS\nbash /tmp/make_debs.sh {GOOD} yes && {PUBLISH}")
    code, out = h.install((k,))
    assert code == 0, out
    assert h.versions() == dict.fromkeys(SERIES, GOOD)
    h.ok(f"pin=$(/opt/gpuprov/bin/python -c '{PIN}'); sh -c \"$pin\" pin-series {' '.join(SERIES)}")
    assert h.exec(f"modinfo -k {k} -F version {MODULE}").stdout.strip() == GOOD.split("-")[0]

    # a kernel arrives that DKMS cannot build for (no headers), and the archive offers the update in the branch
    lacking = re.sub(r"-(\d+)-", "-999-", k, count=1)
    h.ok(f"mkdir -p /lib/modules/{lacking}")
    h.ok(f"bash /tmp/make_debs.sh {BAD} no && {PUBLISH}")
    previous = tuple(f"{p}={GOOD}" for p in SERIES)

    # round 1: the archive still offers the version that worked
    t = time.monotonic()
    code, out = h.install((k, lacking), previous)
    _assert_kept(h, k, lacking, code, out, time.monotonic() - t)

    # round 2: the archive moved on (only the update is offered); the version that worked is in apt's cache only
    h.ok(f"rm /srv/standin/pool/*_{GOOD}_amd64.deb && {PUBLISH}")
    h.ok(f"pin=$(/opt/gpuprov/bin/python -c '{PIN}'); sh -c \"$pin\" pin-series {' '.join(SERIES)}")  # the branch
    h.ok(f"ls /var/cache/apt/archives/nvidia-driver_{GOOD}_amd64.deb")
    t = time.monotonic()
    code, out = h.install((k, lacking), previous)
    _assert_kept(h, k, lacking, code, out, time.monotonic() - t)
