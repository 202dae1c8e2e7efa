"""The driver installed for real: `gpuprov bootstrap --for-gpu 10de:2330` (an H100: a datacentre GPU, baked as on a
CPU builder) on fresh systemd Debian hosts that carry a Debian kernel from the point release, its metapackage and no
headers (as the installer leaves a server). Everything is asserted against what apt offers at test time, never
against hard-coded versions.

Debian 12, one host through two stages of a server's life (module-scoped, in order; each stage starts where the
one before left the host, so the DKMS builds are the only ones these claims need):
1. Install: the open kernel module (the GPU allows it) built by DKMS for the kernel that boots, with that kernel's
   headers and the headers metapackage that follows linux-image-amd64; `modprobe nvidia` loading that flavour,
   signed by DKMS's key, nouveau blacklisted inside that kernel's initramfs, the packages held, the reboot recorded
   with its reason; a second run changes nothing; after the host restarts bootstrap resumes and exits 15 (no device
   to verify).
2. A security kernel (issue 31): the security suite added, the real `unattended-upgrade` run, then `apt-get
   full-upgrade`: a newer kernel ABI arrives with its headers (the metapackage followed it); the pinned open
   535.261.03 does not build for it and bookworm-security has no open 535.309.01. Both exit 0, `dpkg --audit` is
   empty, the kernel is configured completely (its initramfs made), the failed build recorded by gpuprov's DKMS hook
   guard and named by `gpuprov verify` (exit 10). `gpuprov bootstrap` then brings the series to the archive's 535
   (the proprietary flavour, since bookworm's open module does not follow the driver's updates), built for both
   kernels, pinned again; verify is green; a second bootstrap changes nothing.

A second Debian 12 host, installed with the security suite already on (issue 31's second path), as Debian 12's
installer leaves it (`main non-free-firmware`: the lists show no driver package before gpuprov enables contrib and
non-free): the proprietary 535 the security suite carries (the flavour it updates with the driver; the open one was
chosen before and apt refused it), built for the point release's kernel and, since the headers metapackage follows
the security suite, for the security kernel's headers too (seen: apt's install transaction upgraded
linux-image-amd64 as well, so the security kernel arrived there and the module package's own build covered it); the
real `unattended-upgrade` then applies the rest: exit 0, `dpkg --audit` empty, the security kernel configured
completely with its module, verify green, a second bootstrap changes nothing. (The kernel arriving through
unattended-upgrades itself is stage 2's path.) Then, on the same host, after the reboot the install recorded:
3. Branch change: `bootstrap --driver 470` for a Tesla T4 (10de:1eb8, which both 535 and 470 drive): the pinned 535
   series unpinned and swapped for nvidia-tesla-470-driver in one apt transaction, the 470 module built for both
   installed kernels, the new series pinned, the reboot recorded; verify's next-boot check green again.

Each host's chain ends by checking that it left the host consistent (dpkg, apt, DKMS's tree). The two bookworm hosts
and trixie's are independent: each is an xdist group of its own, so the parallel run (run-tests.sh) gives each its
own worker. NVIDIA's build of each flavour, version and kernel is made once per machine and reused by any other host
that needs it (stage 2 and the security-on host both build the proprietary 535 for both kernels):
driver_hosts.dkms_build_cache says how.

How long gpuprov's install takes against a plain `apt-get install` of the same packages is measured by
bench/driver_install_bench.py, not asserted here.

Debian 13: the same install, or, while trixie's open module does not build against trixie's kernel, the honest
failure: exit 16 naming package, kernel and the compiler's first error line, dpkg consistent, the ways out.

Slow (NVIDIA's DKMS builds: the open 535 for the point release's kernel and its failed build for the security
kernel, the proprietary 535 and the Tesla 470 for both kernels, trixie's open module): marked `slow`, all run in CI.
"""
from __future__ import annotations

import json
import re
import time

import pytest

from tests.conftest import needs
from tests.integration.driver_hosts import KernelHost, kernel_image

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
GPU = "10de:2330"
BOOT = f"gpuprov bootstrap --yes --for-gpu {GPU} --engine none --no-validate"
T4 = "10de:1eb8"  # Turing: driven by bookworm's nvidia-driver (535) and by nvidia-tesla-470-driver
SECURITY = "deb http://deb.debian.org/debian-security bookworm-security main contrib non-free non-free-firmware"
INSTALLER_SECURITY = SECURITY.replace("main contrib non-free non-free-firmware", "main non-free-firmware")
NEXT_BOOT = "next-boot kernel module"
# One xdist group per host (conftest.py): each chain runs in order on one worker, beside the others.
CHAIN, SECURITY_CHAIN, TRIXIE = (pytest.mark.xdist_group(g) for g in
                                 ("driver-bookworm", "driver-bookworm-security", "driver-trixie"))
# With --engine none there is no engine: these checks fail in every verify here, whatever the kernel's module.
NO_ENGINE = {"engine running", "runtime registered", "container through the runtime"}


def _timed(host: KernelHost, script: str, timeout: float = 3600):
    t = time.monotonic()
    r = host.exec(script, timeout=timeout)
    return r, time.monotonic() - t


def _planned_packages(host: KernelHost, extra: str = "") -> tuple[list[str], list[str]]:
    """(the packages driver.packages installs, its actions) from `gpuprov plan --json`."""
    r = host.exec(f"gpuprov plan --for-gpu {GPU} --engine none --json {extra}")
    assert r.returncode == 0, r.stdout + r.stderr
    step = next(s for s in json.loads(r.stdout)["steps"] if s["id"] == "driver.packages")
    cmd = next(a for a in step["actions"] if "apt-get install" in a)
    return [a for a in cmd.split("--no-install-recommends", 1)[1].split() if a != "--no-remove"], step["actions"]


def _verify(h: KernelHost) -> tuple[int, dict, str]:
    """`gpuprov verify --json`: (exit code, the next-boot check, stderr)."""
    r = h.exec("gpuprov verify --json")
    assert "Traceback" not in r.stderr, r.stderr
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    failed = {n for n, c in checks.items() if c["status"] == "fail"}
    assert failed - {NEXT_BOOT} <= NO_ENGINE, checks
    return r.returncode, checks[NEXT_BOOT], r.stderr


def _held(h: KernelHost) -> set[str]:
    return set(h.exec("apt-mark showhold").stdout.split())


def _pinned(h: KernelHost, *packages: str) -> bool:
    """apt's policy gives each package's installed version gpuprov's branch pin (990)."""
    for p in packages:
        inst = h.exec(f"dpkg-query -W -f '${{Version}}' {p}").stdout.strip()
        if not inst or not re.search(rf"^\W*{re.escape(inst)} 990$", h.exec(f"apt-cache policy {p}").stdout, re.M):
            return False
    return True


def _consistent(h: KernelHost, what: str) -> None:
    audit = h.exec("dpkg --audit").stdout.strip()
    assert audit == "" and h.exec("apt-get check").returncode == 0, f"{what}: dpkg --audit says {audit}"


def _complete(h: KernelHost, k: str) -> None:
    """The kernel is configured completely: dpkg says installed, its initramfs was made (the hook after DKMS's)."""
    assert h.exec(f"dpkg-query -W -f '${{Status}}' linux-image-{k}").stdout == "install ok installed"
    assert h.exec(f"test -s /boot/initrd.img-{k}").returncode == 0, f"no initramfs for {k}"


def _unchanged(h: KernelHost) -> str:
    return h.exec("md5sum /var/lib/dpkg/status /etc/apt/preferences.d/gpuprov-nvidia /etc/sysconfig/dkms "
                  "/etc/modprobe.d/nvidia.conf; apt-mark showhold; ls /lib/modules/*/updates/dkms").stdout


def _host(suite: str):
    kernel_image(suite)
    h = KernelHost(suite, "gpuprov")
    try:
        h.install_gpuprov()
        yield h
    finally:
        h.remove()


@pytest.fixture(scope="module")
def bookworm():
    """Stages 1-2's host."""
    yield from _host("bookworm")


@pytest.fixture(scope="module")
def bookworm_security():
    """The host installed with the security suite on, then stage 3's."""
    yield from _host("bookworm")


def _left_consistent(h: KernelHost) -> None:
    """What a chain must leave: dpkg and apt consistent, and no gpuprov run or DKMS build still going."""
    _consistent(h, "at the end")
    running = h.exec("cat /proc/[0-9]*/comm 2>/dev/null | grep -xE 'gpuprov|dkms' || true").stdout.strip()
    assert running == "", running


@CHAIN
def test_bookworm_install_then_resume(bookworm):
    h = bookworm
    k = h.kernel()
    # a server from the point release: the kernel metapackage, no headers
    assert h.exec("dpkg -s linux-image-amd64").returncode == 0
    assert h.exec("dpkg -l 'linux-headers-*' | grep -q '^ii'").returncode != 0
    packages, _ = _planned_packages(h)
    assert packages[:2] == [f"linux-headers-{k}", "linux-headers-amd64"] and "nvidia-open-kernel-dkms" in packages, \
        packages
    r, took = _timed(h, BOOT + " --json")
    print(f"bookworm: gpuprov bootstrap {took:.1f}s")
    assert r.returncode == 7, r.stdout[-3000:] + r.stderr[-3000:]  # done; reboot required to load it
    assert "Traceback" not in r.stderr
    res = json.loads(r.stdout)
    assert {s["id"]: s["status"] for s in res["steps"]}["driver.packages"] == "changed"
    print("bookworm steps: " + ", ".join(f"{s['id']} {s.get('seconds', 0):.1f}s" for s in res["steps"]))

    # apt and dpkg consistent; what is installed is what apt offers now
    assert h.exec("dpkg --audit").stdout.strip() == ""
    assert h.exec("apt-get check").returncode == 0
    cand = h.exec("apt-cache policy nvidia-driver | awk '/Candidate:/{print $2}'").stdout.strip()
    inst = h.exec("dpkg-query -W -f '${Version}' nvidia-driver").stdout.strip()
    assert cand and inst == cand
    upstream = inst.split("-")[0]
    # the headers metapackage that follows the kernel metapackage is installed, and not held (it must move on)
    assert h.exec("dpkg-query -W -f '${Status}' linux-headers-amd64").stdout == "install ok installed"
    # DKMS built the open module for the kernel that boots, at the userspace's version, signed by DKMS's key
    assert re.search(rf"nvidia-current-open/{re.escape(upstream)}, {re.escape(k)}, x86_64: installed",
                     h.exec(f"dkms status -k {k}").stdout), h.exec("dkms status").stdout
    modver = h.exec(f"modinfo -k {k} -F version nvidia-current-open").stdout.strip()
    # the userspace libraries (NVML, CUDA) carry their version in their file names
    libver = set(h.exec("find /usr/lib/x86_64-linux-gnu -name 'libnvidia-ml.so.*.*' -o -name 'libcuda.so.*.*' "
                        "| sed -E 's/.*\\.so\\.//'").stdout.split())
    assert modver == upstream and libver == {upstream}, (modver, libver)
    assert h.exec("nvidia-smi").returncode == 9  # there, and says it has no device
    signer = h.exec(f"modinfo -k {k} -F signer nvidia-current-open").stdout.strip()
    key_cn = h.exec("openssl x509 -inform DER -in /var/lib/dkms/mok.pub -noout -subject -nameopt multiline "
                    "| sed -n 's/^ *commonName *= *//p'").stdout.strip()
    assert signer and signer == key_cn, (signer, key_cn)
    # `modprobe nvidia` loads the flavour gpuprov chose
    assert "install nvidia modprobe -i nvidia-current-open" in h.exec("cat /etc/modprobe.d/nvidia.conf").stdout
    # nouveau blacklisted inside that kernel's initramfs
    assert "etc/modprobe.d/gpuprov-blacklist-nouveau.conf" in h.exec(f"lsinitramfs /boot/initrd.img-{k}").stdout
    # pinned to its branch by source package (the whole series, what apt installed with it too), nothing on
    # apt-mark hold (it would keep the security suite's in-branch update from its kernel), the headers free
    assert _held(h) == set(), _held(h)
    assert _pinned(h, "nvidia-driver", "nvidia-open-kernel-dkms", "nvidia-driver-libs", "nvidia-alternative")
    assert not _pinned(h, "linux-headers-amd64")
    # DKMS's kernel hooks record a failed build instead of failing the kernel (its autoinstaller reads this file)
    assert h.exec("grep -q 'Written by gpuprov' /etc/sysconfig/dkms").returncode == 0
    # reboot state with its reason
    state = json.loads(h.exec("cat /var/lib/gpuprov/state.json").stdout)
    assert state["reboot_required"] is True and k in state["reason"], state

    # a second run changes nothing (the reboot is still pending: it says so, exit 7)
    before = h.exec(f"md5sum /var/lib/dpkg/status /boot/initrd.img-{k} /etc/apt/sources.list; apt-mark showhold")
    r2 = h.exec(BOOT)
    assert r2.returncode == 7 and "reboot is still pending" in r2.stderr, r2.stderr
    assert h.exec(f"md5sum /var/lib/dpkg/status /boot/initrd.img-{k} /etc/apt/sources.list; apt-mark showhold"
                  ).stdout == before.stdout

    # after a restart of the host: bootstrap resumes and says there is no device to verify (exit 15)
    h.restart()
    r3 = h.exec(BOOT)
    assert r3.returncode == 15, r3.stdout + r3.stderr
    assert "no NVIDIA device" in r3.stderr and "Traceback" not in r3.stderr
    assert len(r3.stderr.strip().splitlines()) == 1


@CHAIN
def test_bookworm_security_kernel_never_breaks_apt(bookworm):
    """Issue 31, the point release -> security suite path: the pending security updates applied by the real
    unattended-upgrades, then `apt-get full-upgrade`. A newer kernel ABI arrives (6.1.0-56); the pinned open 535.261.03
    cannot build for it, and bookworm-security's 535.309.01 has no open module. Both exit 0, dpkg stays consistent,
    the kernel is configured completely (its initramfs made), the failed build recorded and named by verify. Then
    `gpuprov bootstrap` brings the series to the archive's 535 for every kernel; a second one changes nothing."""
    h = bookworm
    old = h.kernel()
    rc, check, _ = _verify(h)
    assert check["status"] == "pass" and old in check["detail"], check
    h.exec(f"echo '{SECURITY}' >> /etc/apt/sources.list", check=True)
    r = h.exec("apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q unattended-upgrades")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    upstream = h.exec("dpkg-query -W -f '${Version}' nvidia-driver").stdout.split("-")[0]
    offered = h.exec("apt-cache policy nvidia-driver | awk '/Candidate:/{print $2}'").stdout.strip().split("-")[0]
    print(f"bookworm: installed nvidia-driver {upstream}, candidate under the pin {offered}")

    # the real unattended-upgrades, security origin, as its timer runs it
    r, took = _timed(h, "unattended-upgrade -v 2>&1; echo rc=$?")
    print(f"bookworm: unattended-upgrade {took:.1f}s\n{r.stdout[-4000:]}")
    assert r.stdout.rstrip().endswith("rc=0"), r.stdout[-3000:]
    _consistent(h, "after unattended-upgrade")
    new = h.kernel()
    assert new != old, (old, new)
    _complete(h, new)
    failed = h.exec(f"cat /var/lib/gpuprov/dkms-failed/{new}")
    built = "installed" in h.exec(f"dkms status -k {new}").stdout
    print(f"bookworm: after unattended-upgrade, module for {new}: {built}; recorded failure: {failed.stdout.strip()}")
    log = h.exec("cat /var/log/unattended-upgrades/unattended-upgrades-dpkg.log").stdout
    if not built:  # the failure reached the kernel's hook, was recorded there and did not fail the kernel
        assert failed.returncode == 0 and "exit 11" in failed.stdout, failed.stdout
        assert "gpuprov: DKMS could not build a module for kernel " + new in log, log[-3000:]
        rc, check, err = _verify(h)
        assert rc == 10 and check["status"] == "fail" and f"kernel {new} boots next" in check["detail"], check
        assert "gpuprov bootstrap" in check["detail"]

    # `apt-get full-upgrade` (the issue's own reproduction) after it: exit 0, consistent
    r, took = _timed(h, "DEBIAN_FRONTEND=noninteractive apt-get full-upgrade -y -q")
    print(f"bookworm: apt-get full-upgrade {took:.1f}s, exit {r.returncode}\n{r.stdout[-3000:]}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _consistent(h, "after apt-get full-upgrade")
    _complete(h, new)

    # bootstrap: a module for every kernel, the branch pinned (no hold), verify green
    r, took = _timed(h, BOOT + " --json")
    print(f"bookworm: bootstrap after the security updates {took:.1f}s, exit {r.returncode}")
    assert r.returncode in (0, 7), r.stdout[-3000:] + r.stderr[-3000:]
    _consistent(h, "after bootstrap")
    now = h.exec("dpkg-query -W -f '${Version}' nvidia-driver").stdout.split("-")[0]
    assert now.split(".")[0] == upstream.split(".")[0], (now, upstream)  # within the branch
    for k in (old, new):
        assert "installed" in h.exec(f"dkms status -k {k}").stdout, h.exec("dkms status").stdout
    assert _held(h) == set() and _pinned(h, "nvidia-driver")
    rc, check, _ = _verify(h)
    assert check["status"] == "pass" and new in check["detail"], check
    # after the reboot, a second bootstrap changes nothing: it resumes after the reboot the update recorded (verifies,
    # finds no device: exit 15), or, where apt's full-upgrade already brought the module (seen: it swapped the open
    # module for the proprietary 535.309.01 in its own transaction), finds nothing to do (exit 0)
    first = r.returncode
    h.restart()
    before = _unchanged(h)
    r2 = h.exec(BOOT)
    assert r2.returncode == (15 if first == 7 else 0) and "Traceback" not in r2.stderr, (first, r2.stderr)
    assert _unchanged(h) == before


@CHAIN
def test_bookworm_host_left_consistent(bookworm):
    _left_consistent(bookworm)


@SECURITY_CHAIN
def test_bookworm_security_suite_on_from_the_start(bookworm_security):
    h = bookworm_security
    old = h.kernel()
    # as Debian 12's installer leaves a server: the point release and the security suite, `main
    # non-free-firmware` (neither contrib nor non-free: the lists show no driver package yet)
    h.exec("sed -i 's/ main$/ main non-free-firmware/' /etc/apt/sources.list && "
           f"echo '{INSTALLER_SECURITY}' >> /etc/apt/sources.list", check=True)
    r = h.exec("apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q unattended-upgrades")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert h.exec("apt-cache madison nvidia-driver").stdout.strip() == ""  # none before gpuprov's components
    # the flavour bookworm-security updates with the driver, chosen before contrib is there to show the lag
    packages, _ = _planned_packages(h)
    assert packages[2:4] == ["nvidia-kernel-dkms", "nvidia-driver"], packages
    r, took = _timed(h, BOOT + " --json")
    print(f"bookworm+security: gpuprov bootstrap {took:.1f}s, exit {r.returncode}")
    assert r.returncode == 7, r.stdout[-3000:] + r.stderr[-3000:]
    _consistent(h, "after bootstrap")
    # the flavour the suite can update: the proprietary module, at the suite's version
    assert h.exec("dpkg-query -W -f '${Status}' nvidia-kernel-dkms").stdout == "install ok installed"
    assert _held(h) == set() and _pinned(h, "nvidia-driver", "nvidia-kernel-dkms")
    installed = h.kernel()  # seen: the security kernel already, apt brought it in gpuprov's own transaction
    r, took = _timed(h, "unattended-upgrade -v 2>&1; echo rc=$?")
    print(f"bookworm+security: unattended-upgrade {took:.1f}s\n{r.stdout[-3000:]}")
    assert r.stdout.rstrip().endswith("rc=0"), r.stdout[-3000:]
    _consistent(h, "after unattended-upgrade")
    new = h.kernel()
    print(f"bookworm+security: kernel {old}; after gpuprov's install {installed}; after unattended-upgrade {new}")
    assert new != old, (old, new)  # the security kernel, whichever of the two apt runs brought it
    _complete(h, new)
    # the pinned driver's module is there for the new kernel before any further gpuprov run: the headers
    # metapackage from the security suite brought that kernel's headers with the install, so DKMS built for it then
    # (seen), or in the kernel's own hook
    assert "installed" in h.exec(f"dkms status -k {new}").stdout, h.exec("dkms status").stdout
    rc, check, _ = _verify(h)
    assert check["status"] == "pass" and new in check["detail"], check
    h.restart()  # the reboot the install recorded; then a second bootstrap changes nothing (exit 15: no device)
    before = _unchanged(h)
    r2 = h.exec(BOOT)
    assert r2.returncode == 15 and "Traceback" not in r2.stderr, r2.stderr
    assert _unchanged(h) == before


@SECURITY_CHAIN
def test_bookworm_branch_change_rebuilds_for_every_kernel(bookworm_security):
    h = bookworm_security
    kernels = h.exec("ls /lib/modules").stdout.split()
    assert len(kernels) == 2, kernels  # the point release's and the security suite's
    # the host rebooted after the test above: nothing to do, or the resume of a recorded reboot (exit 15: no device)
    assert h.exec(BOOT).returncode in (0, 15)
    change = f"--for-gpu {T4} --driver 470"
    plan = h.exec(f"gpuprov plan {change} --engine none --json")
    assert plan.returncode == 0, plan.stderr
    step = next(s for s in json.loads(plan.stdout)["steps"] if s["id"] == "driver.packages")
    # the old series' pin goes before apt sees the new one (nothing is on apt-mark hold since the pin replaced it)
    pin_gone = step["actions"].index("$ rm -f /etc/apt/preferences.d/gpuprov-nvidia")
    assert pin_gone < next(i for i, a in enumerate(step["actions"]) if "apt-get install" in a), step["actions"]
    install = next(a for a in step["actions"] if "apt-get install" in a)
    assert "nvidia-tesla-470-driver" in install and " nvidia-driver- " in install + " ", install
    assert all(f"$ dkms autoinstall -k {k}" in step["actions"] for k in kernels), step["actions"]

    r, took = _timed(h, f"gpuprov bootstrap --yes {change} --engine none --no-validate --json")
    print(f"bookworm: branch change 535 -> 470 {took:.1f}s")
    assert r.returncode == 7, r.stdout[-3000:] + r.stderr[-3000:]  # replaced; reboot required to load it
    assert h.exec("dpkg --audit").stdout.strip() == "" and h.exec("apt-get check").returncode == 0
    # the old series is gone but for what the new one depends on (nvidia-egl-common), and nothing of it is held;
    # the new one is installed and held, whole
    srcs = h.exec("dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${source:Package}\n' | awk '$1 ~ /^[ih]i$/'").stdout
    left = set(re.findall(r"^\S+ (\S+) nvidia-(?:graphics-drivers|open-gpu-kernel-modules)$", srcs, re.M))
    assert not left & {"nvidia-driver", "nvidia-open-kernel-dkms", "libcuda1", "nvidia-smi", "nvidia-alternative",
                       "nvidia-driver-libs"}, left
    tesla = h.exec("dpkg-query -W -f '${Version}' nvidia-tesla-470-driver").stdout.split("-")[0]
    assert tesla.startswith("470."), tesla
    assert _held(h) == set() and _pinned(h, "nvidia-tesla-470-driver", "nvidia-tesla-470-kernel-dkms",
                                         "nvidia-tesla-470-driver-libs")
    assert "nvidia-graphics-drivers:any" not in h.exec("cat /etc/apt/preferences.d/gpuprov-nvidia").stdout
    # DKMS built 470 for both kernels, the one that boots next included
    for k in kernels:
        assert re.search(rf"nvidia-tesla-470/{re.escape(tesla)}, {re.escape(k)}, x86_64: installed",
                         h.exec(f"dkms status -k {k}").stdout), h.exec("dkms status").stdout
        mods = h.exec(f"find /lib/modules/{k}/updates/dkms -name 'nvidia*.ko*'").stdout.split()
        main = [m for m in mods if m.rsplit("/", 1)[-1].split(".ko")[0] == "nvidia-tesla-470"]  # not its helpers
        assert main and h.exec(f"modinfo -F version {main[0]}").stdout.strip() == tesla, mods
    assert "tesla-470" in h.exec("cat /etc/modprobe.d/nvidia.conf").stdout
    state = json.loads(h.exec("cat /var/lib/gpuprov/state.json").stdout)
    assert state["reboot_required"] is True and "replaced" in state["reason"], state
    rc, check, _ = _verify(h)
    assert check["status"] == "pass" and h.kernel() in check["detail"], check


@SECURITY_CHAIN
def test_bookworm_security_host_left_consistent(bookworm_security):
    _left_consistent(bookworm_security)


@TRIXIE
def test_trixie_open_module_built_or_failure_met_honestly():
    kernel_image("trixie")
    h = KernelHost("trixie", "gpuprov")
    try:
        h.install_gpuprov()
        k = h.kernel()
        r, took = _timed(h, BOOT)
        print(f"trixie: gpuprov bootstrap exit {r.returncode} in {took:.1f}s")
        assert "Traceback" not in r.stderr
        assert h.exec("dpkg --audit").stdout.strip() == "", "dpkg left inconsistent"
        if r.returncode == 16:
            err = r.stderr.strip()
            assert "nvidia-open-kernel-dkms" in err and k in err and "error:" in err, err
            assert "Rolled back" in err and "`dpkg --audit` is empty" in err
            assert "--kernel-modules proprietary" in err and "--driver-source nvidia" in err
            assert h.exec("dpkg -s nvidia-open-kernel-dkms").returncode != 0  # purged, not half-configured
            # no silent switch to the other flavour: no kernel module package and no metapackage left behind
            left = h.exec("dpkg-query -W -f '${Package} ${Status}\\n' 'nvidia-*kernel-dkms' nvidia-driver 2>/dev/null"
                          " | grep 'install ok installed'").stdout
            assert left.strip() == "", left
            log = re.search(r"full log: (\S+)\)", err).group(1)
            assert h.exec(f"test -s {log}").returncode == 0
        else:
            assert r.returncode == 7, r.stdout[-3000:] + r.stderr[-3000:]
            assert "installed" in h.exec(f"dkms status -k {k}").stdout
            assert "etc/modprobe.d/gpuprov-blacklist-nouveau.conf" in h.exec(
                f"lsinitramfs /boot/initrd.img-{k}").stdout
            h.restart()
            assert h.exec(BOOT).returncode == 15
    finally:
        h.remove()
