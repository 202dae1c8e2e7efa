"""The suite's costliest shared builds, each timed alone from nothing (issue 37): to see one grow before CI does.

Each is what a cold CI run pays once (tests/shared_builds.py, run-tests.sh): the images (debootstrap's minbase,
systemd, the driver hosts' kernel images, the stand-in distributions' build images), the wheelhouse, the stand-in
archives, the Docker CE stand-in packages, Go and the kubelet, the Debian 12 bundle, and NVIDIA's real DKMS build of
the open module for bookworm's kernel (`--dkms`: the single biggest cost; minutes).

Directory caches are rebuilt in a private temporary cache (GPUPROV_TEST_CACHE and the archives' own variables), so the
machine's stays as it was. Images live in Docker's one store: each is rebuilt in place (its tag kept aside, the image
built again from the same recipe, the old tag dropped), which leaves the store as a CI run would.

    python3 bench/fixture_costs.py [--only NAME ...] [--dkms] [--json]

Results: seconds per build, printed, and written to bench/results/<date>-fixture-costs-<commit>.json. Compare two
such files from the same machine; the seconds are wall time and move with the machine's load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRIVATE = Path(tempfile.mkdtemp(prefix="gpuprov-fixture-costs-"))
# before the tests' modules read them: every directory cache goes to PRIVATE
os.environ["GPUPROV_TEST_CACHE"] = str(PRIVATE / "cache")
os.environ["GPUPROV_TEST_WHEELHOUSE"] = str(PRIVATE / "wheelhouse")
os.environ["GPUPROV_TEST_UBUNTU_ARCHIVE"] = str(PRIVATE / "ubuntu-archive")
os.environ["GPUPROV_TEST_EL_REPOS"] = str(PRIVATE / "el-repos")
sys.path.insert(0, str(REPO))

from tests.integration import driver_hosts, el_hosts, hosts, ubuntu_hosts  # noqa: E402


def docker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True)


def rebuilt(name_of, build):
    """Time BUILD() with the image NAME_OF() names removed first (its tag kept aside meanwhile, then dropped)."""
    def run() -> None:
        name = name_of()
        aside = f"gpuprov-bench/aside:{abs(hash(name)) % 10**8}"
        had = docker("tag", name, aside).returncode == 0
        docker("rmi", name)
        try:
            build()
        finally:
            if had:
                docker("rmi", aside)
    return run


def kubelet() -> None:
    from tests.k8s import build

    build.build(build.KUBELET, build.source_dir(build.KUBELET, None))


def bundle() -> None:
    from tests.bundles import build_debian12

    build_debian12(PRIVATE / "bundle")


def dockerce() -> None:
    from tests.integration import dockerce as dce

    dce.build(PRIVATE)


def dkms_open() -> None:
    """NVIDIA's open module built by DKMS for the kernel image's kernel, through apt as a server gets it; the build
    cache off (driver_hosts.dkms_build_cache), so this is the compiler's own time."""
    h = driver_hosts.KernelHost("bookworm", "bench-dkms", share_builds=False)
    try:
        k = h.kernel()
        r = h.exec("sed -i 's/ main$/ main contrib non-free non-free-firmware/' /etc/apt/sources.list && "
                   "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "
                   f"--no-install-recommends linux-headers-{k} nvidia-open-kernel-dkms && dkms status -k {k}",
                   timeout=3600)
        if r.returncode != 0 or "installed" not in r.stdout:
            raise SystemExit(f"dkms: the build failed\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    finally:
        h.remove()


BUILDS = {  # name -> what builds it (the order: each after what it is made from)
    "minbase": rebuilt(lambda: hosts.IMAGE, hosts.ensure_image),
    "systemd-image": rebuilt(lambda: hosts.SYSTEMD_IMAGE, hosts.ensure_systemd_image),
    **{f"kernel-image-{suite}": rebuilt(lambda s=suite: driver_hosts.kernel_image_name(s),
                                        lambda s=suite: driver_hosts.kernel_image(s)) for suite in ("bookworm", "trixie")},
    "wheelhouse": hosts.ensure_wheelhouse,
    "ubuntu-archive": ubuntu_hosts.ubuntu_archive,
    "el-repos": el_hosts.el_repos,
    "dockerce-debs": dockerce,
    "go-and-kubelet": kubelet,
    "debian12-bundle": bundle,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=[*BUILDS, "dkms-open"], help="these builds only")
    ap.add_argument("--dkms", action="store_true", help="also NVIDIA's open module built by DKMS (minutes)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    todo = dict(BUILDS, **({"dkms-open": dkms_open} if args.dkms or "dkms-open" in (args.only or ()) else {}))
    if args.only:
        todo = {k: v for k, v in todo.items() if k in args.only}
    results = {}
    for name, build in todo.items():
        t0 = time.monotonic()
        build()
        results[name] = round(time.monotonic() - t0, 1)
        if not args.json:
            print(f"{results[name]:8.1f} s  {name}", flush=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "nogit"
    out = REPO / "bench/results" / f"{time.strftime('%Y-%m-%d')}-fixture-costs-{commit}.json"
    out.write_text(json.dumps({"commit": commit, "load": os.getloadavg(), "seconds": results}, indent=1) + "\n")
    if args.json:
        print(json.dumps(results, indent=1))
    subprocess.run(["rm", "-rf", str(PRIVATE)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
