"""Shared test helpers: fixture host trees built from real os-release files and real PCI IDs."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
DISTROS = FIXTURES / "distros"
H200 = FIXTURES / "hosts" / "h200-vm"
REPO = Path(__file__).resolve().parents[1]


def arch_report():
    """scripts/arch_report.py as a module (the layer rules, the import graph, its cycle finder)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("arch_report", REPO / "scripts/arch_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
# gpuprov's host lock for every gpuprov these tests start: a private one, so that the suite never queues behind (or
# makes wait) a real gpuprov run, or another checkout's test run, on the same machine. Hosts in containers have
# their own /run. Tests of the lock itself set their own.
# gpuprov's state (/var/lib/gpuprov, /run/gpuprov: provision/paths.py) likewise: the runtime's install stamp and
# discovery cache, reboot state, unpacked bundles of every gpuprov these tests start go to private directories.
# Each xdist worker gets its own (workers inherit the controller's environment: with one lock dir between them, one
# worker's bootstrap waited for another's, and said so on stderr).
_worker = os.environ.get("PYTEST_XDIST_WORKER")
for _var, _prefix in (("GPUPROV_LOCK_DIR", "gpuprov-test-lock-"), ("GPUPROV_STATE_DIR", "gpuprov-test-state-"),
                      ("GPUPROV_RUN_DIR", "gpuprov-test-run-")):
    if _worker and os.path.basename(os.environ.get(_var, "")).startswith(_prefix):
        os.environ[_var] = tempfile.mkdtemp(prefix=f"{_prefix}{_worker}-")
    else:
        os.environ.setdefault(_var, tempfile.mkdtemp(prefix=_prefix))

# sysfs setups: address -> (vendor, device, class, subvendor, subdevice, bound driver)
SYSFS_SETUPS: dict[str, dict[str, tuple]] = {
    "none": {"0000:00:00.0": (0x8086, 0x1237, 0x060000, 0x1AF4, 0x1100, None)},
    "datacenter": {"0000:3b:00.0": (0x10DE, 0x2330, 0x030200, 0x10DE, 0x16C1, "nvidia")},  # H100 SXM5 80GB
    "mixed-legacy": {  # Kepler (470) + Volta (580 legacy) + Ampere (current)
        "0000:01:00.0": (0x10DE, 0x1180, 0x030000, 0x1043, 0x83F6, "nouveau"),
        "0000:02:00.0": (0x10DE, 0x1DB4, 0x030200, 0x10DE, 0x1214, None),
        "0000:03:00.0": (0x10DE, 0x20B0, 0x030200, 0x10DE, 0x134F, None),
    },
    "volta": {"0000:04:00.0": (0x10DE, 0x1DB4, 0x030200, 0x10DE, 0x1214, None)},  # Tesla V100 PCIe (580 legacy)
    "geforce": {"0000:01:00.0": (0x10DE, 0x2684, 0x030000, 0x10DE, 0x167C, None)},  # GeForce RTX 4090
    "kepler": {"0000:04:00.0": (0x10DE, 0x102D, 0x030200, 0x10DE, 0x106C, None)},  # Tesla K80 (470 legacy)
    "blackwell": {"0000:17:00.0": (0x10DE, 0x2901, 0x030200, 0x10DE, 0x1999, None)},  # B200
    "unknown-new": {"0000:17:00.0": (0x10DE, 0x3FFF, 0x030200, 0x10DE, 0x0000, None)},
    "non-nvidia": {"0000:00:02.0": (0x8086, 0x46A6, 0x030000, 0x1028, 0x0B19, "i915"),
                   "0000:03:00.0": (0x1002, 0x73BF, 0x030000, 0x1002, 0x0E3A, "amdgpu")},
    "multi-gpu": {f"0000:{b:02x}:00.0": (0x10DE, 0x2335, 0x030200, 0x10DE, 0x18BF, "nvidia")
                  for b in (0x18, 0x2A, 0x3A, 0x5D)},
}


# apt entries as a fresh install writes them (mirror host replaced by a placeholder).
APT_SOURCES = {
    "debian": "deb http://mirror.invalid/debian {c} main\ndeb http://mirror.invalid/debian-security {c}-security main\n",
    "ubuntu": "deb http://mirror.invalid/ubuntu {c} main restricted\ndeb http://mirror.invalid/ubuntu {c}-updates main\n",
}


KERNEL_META = {"debian": "linux-image-amd64", "ubuntu": "linux-image-generic"}


def dpkg_status(root: Path, packages: dict[str, str], held: tuple[str, ...] = ()) -> None:
    """A dpkg status file under `root` listing `packages` (name -> source package) as installed (held: on hold)."""
    path = root / "var/lib/dpkg/status"
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.exists() else ""
    path.write_text(old + "".join(
        f"Package: {name}\nStatus: {'hold' if name in held else 'install'} ok installed\nPriority: optional\n"
        f"Maintainer: fixture\nArchitecture: amd64\nSource: {src}\nVersion: 1.0-1\nDescription: fixture\n\n"
        for name, src in packages.items()))


def make_host(base: Path, distro: str = "debian-12", sysfs: str = "none", *, modules: str = "",
              nvrm: str | None = None, kernel: str | None = None) -> Path:
    """A host root: a real os-release plus a sysfs tree for one of SYSFS_SETUPS (and apt entries, a kernel)."""
    root = base / f"{distro}-{sysfs}"
    shutil.copytree(DISTROS / distro, root)
    family = distro.split("-")[0]
    if family in APT_SOURCES:
        from provision.facts.distro_facts import read_distro

        (root / "etc/apt").mkdir(parents=True, exist_ok=True)
        (root / "etc/apt/sources.list").write_text(APT_SOURCES[family].format(c=read_distro(root).codename))
    if kernel:  # running, and installed by the package manager (its image and modules directory)
        (root / "proc/sys/kernel").mkdir(parents=True)
        (root / "proc/sys/kernel/osrelease").write_text(kernel + "\n")
        (root / f"lib/modules/{kernel}/kernel").mkdir(parents=True)
        (root / "boot").mkdir(exist_ok=True)
        (root / f"boot/vmlinuz-{kernel}").write_text("")
        if family in APT_SOURCES:  # dpkg lists the kernel and the metapackage it came with, as on an installed host
            dpkg_status(root, {f"linux-image-{kernel}": "linux-signed",
                               KERNEL_META[family]: "linux-meta"})
    for addr, (ven, dev, cls, sv, sd, drv) in SYSFS_SETUPS[sysfs].items():
        d = root / "sys/bus/pci/devices" / addr
        d.mkdir(parents=True)
        for name, val in (("vendor", ven), ("device", dev), ("subsystem_vendor", sv), ("subsystem_device", sd)):
            (d / name).write_text(f"0x{val:04x}\n")
        (d / "class").write_text(f"0x{cls:06x}\n")
        (d / "numa_node").write_text("0\n")
        if drv:
            os.symlink(f"../../../bus/pci/drivers/{drv}", d / "driver")
    (root / "proc").mkdir(exist_ok=True)
    (root / "proc/modules").write_text(modules)
    if nvrm:
        (root / "proc/driver/nvidia").mkdir(parents=True)
        (root / "proc/driver/nvidia/version").write_text(nvrm)
    return root


@pytest.fixture
def host(tmp_path):
    return lambda distro="debian-12", sysfs="none", **kw: make_host(tmp_path, distro, sysfs, **kw)


def gpuprov_bin() -> list[str]:
    exe = Path(sys.executable).with_name("gpuprov")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "provision"]


def run_cli(*args: str, check: bool = False, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, **kw.pop("env", {})}
    return subprocess.run([*gpuprov_bin(), *args], capture_output=True, text=True, check=check, env=env, **kw)


def have_docker() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True).returncode == 0


IN_CI = os.environ.get("CI") == "true"


def needs(*binaries: str, docker: bool = False):
    """Skip on a workstation that lacks the tools; in CI (CI=true, where .ci/run installs them) never skip, so a
    missing tool fails loudly instead of passing as a skip."""
    missing = [b for b in binaries if not shutil.which(b)] + (["a running Docker engine"] if docker and
                                                              not have_docker() else [])
    return pytest.mark.skipif(bool(missing) and not IN_CI,
                              reason=f"needs {', '.join(missing)} (run-tests.sh installs them)")


# --- The test machine's own gpuprov is not the tests' to change (issue 12) ---------------------------------------
# Tests install and configure gpuprov only inside host containers (tests/integration/hosts.py) or under tmp paths
# (GPUPROV_RUNTIME_CONFIG, --config, --prefix). After every run these paths must be exactly as the run found them
# (so `./run-tests.sh` and `./install.sh --yes` work in either order); otherwise the run fails, naming them.
# GPUPROV_TEST_WATCH (colon-separated globs) replaces the list: tests/unit/test_host_untouched.py uses it.
HOST_GPUPROV = ("/usr/local/bin/gpuprov*", "/usr/local/bin/nvidia-container-runtime-hook", "/etc/gpuprov",
                "/etc/docker/daemon.json", "/var/lib/gpuprov", "/run/gpuprov", "/opt/gpuprov", "/etc/containerd",
                "/etc/cdi", "/var/run/cdi", "/etc/nvidia-container-runtime")
_HOST_STATE = pytest.StashKey[dict]()
_STARTED = pytest.StashKey[float]()


def host_gpuprov_state() -> dict[str, str]:
    """path -> what it is (type, mode, owner, content hash or link target), for every watched path that exists."""
    import glob
    import hashlib
    import stat

    watch = os.environ.get("GPUPROV_TEST_WATCH")
    out: dict[str, str] = {}
    for pattern in watch.split(":") if watch else HOST_GPUPROV:
        for top in glob.glob(pattern):
            paths = [Path(top)]
            if os.path.isdir(top) and not os.path.islink(top):
                paths += sorted(Path(top).rglob("*"))
            for p in paths:
                try:
                    st = os.lstat(p)
                    if stat.S_ISLNK(st.st_mode):
                        desc = f"link -> {os.readlink(p)}"
                    elif stat.S_ISREG(st.st_mode):
                        desc = f"file {st.st_mode & 0o7777:o} {st.st_uid}:{st.st_gid} " \
                               f"{hashlib.sha256(p.read_bytes()).hexdigest()[:16]}"
                    else:
                        desc = f"{stat.S_IFMT(st.st_mode):o} {st.st_mode & 0o7777:o} {st.st_uid}:{st.st_gid}"
                except OSError as exc:
                    desc = f"unreadable: {exc.strerror}"
                out[str(p)] = desc
    return out


def pytest_sessionstart(session):
    session.config.stash[_HOST_STATE] = host_gpuprov_state()
    session.config.stash[_STARTED] = time.time()


def pytest_sessionfinish(session, exitstatus):
    before = session.config.stash.get(_HOST_STATE, None)
    if before is None:
        return
    after = host_gpuprov_state()
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    if not changed:
        return
    lines = [f"  {p}: {before.get(p, 'absent')} => {after.get(p, 'absent')}" for p in changed]
    msg = "the tests changed the host's own gpuprov (they must work inside host containers):\n" + "\n".join(lines)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter:
        reporter.write_line("\nFAILED host untouched: " + msg, red=True)
    else:
        sys.stderr.write(msg + "\n")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _stop_gpg_agents():
    """Each test stops the gpg agents it started (issue 32): only where tests/bundles.py made a gpg home."""
    yield
    bundles = sys.modules.get("tests.bundles")
    if bundles is not None:
        bundles.stop_agents()


@pytest.fixture(scope="session")
def debian12_bundle(tmp_path_factory):
    """The real Debian 12 bundle (engine + runtime), built once for every test that needs one (tests/bundles.py)."""
    from tests.bundles import build_debian12

    return build_debian12(tmp_path_factory.mktemp("bundles") / "debian-12")


# --- The parallel run (issue 37): files, order, a scheduler that parks nothing, where the time went ----------------
# run-tests.sh runs the suite with pytest-xdist (`-n N --dist loadfile`): a file is what one worker runs, in order
# (module-scoped hosts and their ordered stages stay together; tests on different hosts are in different files).
# Files are handed out longest first, so the long ones start at once and the short ones fill in beside them; the
# seconds are a cold run's on a 2-core machine (docs/PROOFS.md); the files not named are short and keep their order.
# (Not xdist_group: pytest 9.2 keeps a node's id where xdist 3.8's loadgroup no longer changes it, so loadgroup
# silently split every group: seen, one chain's stages on three workers.)
FILE_SECONDS = {  # session 12's cold fresh-clone run (2026-12-07), the tests' own seconds per file
    "tests/integration/test_driver_security_suite.py": 2052, "tests/integration/test_driver_install.py": 1503,
    "tests/integration/test_driver_trixie.py": 533, "tests/integration/test_fleet_ansible.py": 486,
    "tests/integration/test_ubuntu_apt.py": 462, "tests/integration/test_kubelet.py": 390,
    "tests/integration/test_el_cuda.py": 239, "tests/integration/test_fleet_readme.py": 171,
    "tests/integration/test_bootstrap_e2e.py": 151, "tests/integration/test_el_cuda_releases.py": 135,
    "tests/integration/test_bundle_e2e.py": 130, "tests/integration/test_podman.py": 129,
    "tests/integration/test_driver_debian_detect.py": 118, "tests/integration/test_runtime_docker.py": 107,
    "tests/integration/test_day_two.py": 97, "tests/integration/test_bootstrap_containerd.py": 96,
    "tests/integration/test_driver_rollback.py": 93, "tests/integration/test_dpkg_killed.py": 90,
    "tests/integration/test_el_dnf.py": 87, "tests/integration/test_el_elrepo_kernel.py": 78,
    "tests/integration/test_adopt_engines.py": 71,
    "tests/faults/test_discovery_follows_driver.py": 22,  # session 13: deadlines waited out on purpose
    "tests/integration/test_purge_keeps_engine_data.py": 162,  # session 13: two hosts, docker.io three times
    "tests/integration/test_dnf_killed.py": 120,  # session 13: one EL host, nine kills (132, 120, 103 s)
    "tests/integration/test_restart_keeps_containers.py": 85,  # session 14: one docker.io host, + uninstall (84 s)
    "tests/faults/test_ldcache_hostile.py": 15,  # session 13: slow starts made on purpose (alone)
    "tests/integration/test_ubuntu_day_two.py": 201,  # session 13: three hosts, five bootstraps that install
    "tests/unit/test_loaded_driver_day_two.py": 1,  # session 13: 0.5 s of tests
    "tests/integration/test_driver_flavour_follows.py": 270,  # issue 40: one bookworm host, every DKMS build reused
}
TIERS = (  # (the first of these a test's path starts with, its tier in the summary)
    ("tests/unit/", "unit"), ("tests/faults/", "faults"), ("tests/installed/", "the installed wheel"),
    ("tests/cri/", "containerd (CRI)"),
    ("tests/k8s", "kubernetes"), ("tests/gpu/", "gpu"),
    ("tests/integration/test_driver_", "integration: drivers on Debian"),
    ("tests/integration/test_el_", "integration: EL (dnf)"), ("tests/integration/test_ubuntu_", "integration: Ubuntu (apt)"),
    ("tests/integration/test_fleet_", "integration: fleets (ansible)"),
    ("tests/integration/test_kubelet", "integration: kubernetes"), ("tests/integration/test_k8s", "integration: kubernetes"),
    ("tests/integration/test_bundle_", "integration: bundles"), ("tests/integration/", "integration: engines and runtime"),
)


def test_file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda it: -FILE_SECONDS.get(test_file(it.nodeid), 0))  # stable: each file keeps its order


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a run without xdist has no such hook
def pytest_xdist_make_scheduler(config, log):
    """loadfile, except that a worker gets its next file only when it is on the last test of the one it has (xdist
    hands one out at two left: a file parked behind a 20-minute stage waits there while another worker idles)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # xdist's own order (most tests first) put the 3-test driver files last

    class LastTestScheduling(LoadFileScheduling):
        def _reschedule(self, node):
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

    return LastTestScheduling(config, log)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Where the time went: the tests' seconds (setup, call, teardown) by tier, and by file for the files over a
    minute; the DKMS builds the hosts made or reused (driver_hosts.dkms_build_cache)."""
    if hasattr(config, "workerinput"):
        return
    tiers: dict[str, list] = {}
    files: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            nodeid, secs = getattr(r, "nodeid", None), getattr(r, "duration", None)
            if not nodeid or secs is None or getattr(r, "when", None) not in ("setup", "call", "teardown"):
                continue
            tier = next((t for prefix, t in TIERS if nodeid.startswith(prefix)), "other")
            entry = tiers.setdefault(tier, [0.0, set()])
            entry[0] += secs
            entry[1].add(nodeid)
            files[test_file(nodeid)] = files.get(test_file(nodeid), 0.0) + secs
    if not tiers:
        return
    tw = terminalreporter
    wall = time.time() - config.stash.get(_STARTED, time.time())
    tw.write_sep("=", f"where the time went (tests' own seconds; the run took {wall:.0f} s of wall time)")
    for tier, (secs, ids) in sorted(tiers.items(), key=lambda kv: -kv[1][0]):
        tw.write_line(f"{secs:9.1f} s  {len(ids):5d} tests  {tier}")
    long = sorted(((secs, f) for f, secs in files.items() if secs >= 60), reverse=True)
    if long:
        tw.write_line("files over 60 s (each on one worker; conftest's FILE_SECONDS orders them):")
    for secs, f in long:
        tw.write_line(f"{secs:9.1f} s  {f}")
    from tests.integration.driver_hosts import dkms_uses  # [] where no host used the DKMS build cache

    for u in (u for u in dkms_uses() if u["at"] >= time.time() - wall):
        tw.write_line(f"DKMS {u['how']:6s} {u['module']}/{u['version']} for {u['kernel']}: exit {u['rc']}, "
                      f"{u['seconds']} s (waited {u['waited']} s) on {u['host']}")
