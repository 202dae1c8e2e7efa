"""Issue 40: Debian's module flavour chosen from what the archive maintains (decide/debian.py: upkeep), from the apt
lists' suites (facts.packages.suite_versions); the plan's preview refresh (plan/archive_preview.py) as apt is asked;
the flavour-switch question (plan/driver.py: flavour_switch); verify's updates warning (verify/checks.py).

The origins below are bookworm's on 2026-11 (`apt-cache policy` on a host with bookworm and bookworm-security, contrib
and non-free): nvidia-driver and nvidia-kernel-dkms 535.261.03 in bookworm, 535.309.01-0+deb12u1 in
bookworm-security; nvidia-open-kernel-dkms 535.261.03 in bookworm only. trixie's: both flavours 550.163.01 in trixie."""
from __future__ import annotations

from pathlib import Path

import pytest

from provision.decide import debian
from provision.decide.driver import decide_gpu
from provision.decide.gputable import parse_pci_id
from provision.decide.targets import TARGETS
from provision.facts.packages import suite_versions
from provision.package_managers.apt import Apt
from provision.plan.dkms import DriverInstall
from provision.plan.driver import flavour_switch
from provision.plan.steps import Step
from provision.verify.checks import NodeHost, driver_updates

BOOKWORM = {"nvidia-driver": {"bookworm": frozenset({"535.261.03"}), "bookworm-security": frozenset({"535.309.01"})},
            "nvidia-kernel-dkms": {"bookworm": frozenset({"535.261.03"}),
                                   "bookworm-security": frozenset({"535.309.01"})},
            "nvidia-open-kernel-dkms": {"bookworm": frozenset({"535.261.03"})}}
POINT_RELEASE = {n: {"bookworm": by["bookworm"]} for n, by in BOOKWORM.items()}
TRIXIE = {n: {"trixie": frozenset({"550.163.01"})} for n in ("nvidia-driver", "nvidia-kernel-dkms",
                                                               "nvidia-open-kernel-dkms")}
H100, V100, B200 = "10de:2330", "10de:1db4", "10de:2901"  # either flavour; proprietary only; open only


def decide(pci: str, target: str, origins, **kw):
    offered = {n: frozenset().union(*by.values()) for n, by in origins.items()}
    return decide_gpu(parse_pci_id(pci), TARGETS[target], offered=offered, origins=origins, **kw)


def test_the_security_suite_decides_the_flavour():
    up = debian.upkeep(debian.SUITES["bookworm"].main, BOOKWORM, "bookworm")
    assert up.flavour == "proprietary"
    assert up.why == ("bookworm-security updates nvidia-kernel-dkms (535.309.01); nvidia-open-kernel-dkms 535.261.03 "
                      "gets no updates (bookworm)")
    d = decide(H100, "debian-12", BOOKWORM)
    assert d.modules == "proprietary" and d.packages[0] == "nvidia-kernel-dkms", d
    assert any(up.why in w and "installing the proprietary module" in w for w in d.warnings), d.warnings


def test_neither_maintained_keeps_todays_rule():
    assert debian.upkeep(debian.SUITES["bookworm"].main, POINT_RELEASE, "bookworm").flavour is None
    assert debian.upkeep(debian.SUITES["trixie"].main, TRIXIE, "trixie").flavour is None
    assert decide(H100, "debian-12", POINT_RELEASE).modules == "open"
    assert decide(H100, "debian-13", TRIXIE).modules == "open"


def test_the_open_flavour_where_only_it_is_maintained():
    opened = {**POINT_RELEASE, "nvidia-open-kernel-dkms": {"bookworm": frozenset({"535.261.03"}),
                                                           "bookworm-security": frozenset({"535.309.01"})},
              "nvidia-driver": BOOKWORM["nvidia-driver"]}
    assert debian.upkeep(debian.SUITES["bookworm"].main, opened, "bookworm").flavour == "open"
    assert decide(H100, "debian-12", opened).modules == "open"


def test_the_override_is_obeyed_and_warned():
    d = decide(H100, "debian-12", BOOKWORM, kernel_modules="open")
    assert d.modules == "open" and d.packages[0] == "nvidia-open-kernel-dkms"
    assert any("nvidia-open-kernel-dkms 535.261.03 gets no updates" in w and "--kernel-modules open" in w
               for w in d.warnings), d.warnings
    assert decide(H100, "debian-12", POINT_RELEASE, kernel_modules="proprietary").modules == "proprietary"


def test_a_gpu_one_flavour_drives_keeps_it():
    assert decide(V100, "debian-12", {**BOOKWORM, "nvidia-open-kernel-dkms": {
        "bookworm-security": frozenset({"535.309.01"})}}).modules == "proprietary"
    assert decide(B200, "debian-12", BOOKWORM).modules == "open"


def test_suites_are_read_from_the_lists_names(tmp_path):
    lists = tmp_path / "var/lib/apt/lists"
    lists.mkdir(parents=True)
    stanza = "Package: {}\nVersion: {}\nArchitecture: amd64\n\n"
    (lists / "deb.debian.org_debian_dists_bookworm_non-free_binary-amd64_Packages").write_text(
        stanza.format("nvidia-kernel-dkms", "535.261.03-1") + stanza.format("nvidia-driver", "535.261.03-1"))
    (lists / "deb.debian.org_debian_dists_bookworm_contrib_binary-amd64_Packages").write_text(
        stanza.format("nvidia-open-kernel-dkms", "535.261.03-1"))
    (lists / "deb.debian.org_debian-security_dists_bookworm-security_non-free_binary-amd64_Packages").write_text(
        stanza.format("nvidia-kernel-dkms", "535.309.01-0+deb12u1") + stanza.format("nvidia-driver",
                                                                                  "535.309.01-0+deb12u1"))
    got = suite_versions(tmp_path, debian.debian_driver_packages("bookworm"))
    assert {n: got[n] for n in BOOKWORM} == BOOKWORM


def test_the_preview_refresh_runs_no_hook():
    state = Path("/var/tmp/gpuprov-archive-preview-x")
    (conf, first), (main, text) = Apt().preview_config(state, 'Acquire::http::Proxy "http://proxy:3128";')
    assert conf == f"{state}/apt.conf" and f'Dir::Etc::main "{main}";' in first
    # the host's own apt.conf first (a proxy the fetch needs), then every update hook cleared
    assert text.startswith("Acquire::http::Proxy") and "#clear APT::Update::Post-Invoke;" in text \
        and "#clear APT::Update::Post-Invoke-Success;" in text and "#clear APT::Update::Pre-Invoke;" in text


def _install(remove: tuple[str, ...], dkms: str = "nvidia-kernel-dkms", previous=("nvidia-driver=535.261.03-1",)):
    return Step("driver.packages", "driver", "Update the driver", actions=(DriverInstall(
        ("nvidia-kernel-dkms", "nvidia-driver"), ("6.1.0-50-amd64",), dkms, (), "", remove=remove,
        previous=previous),), notes=("update: kernel 6.1.0-57-amd64 has no nvidia module",))


def test_a_flavour_switch_is_a_question():
    said = flavour_switch([_install(("nvidia-open-kernel-dkms", "nvidia-open-kernel-support"))])
    assert said and "from nvidia-open-kernel-dkms to nvidia-kernel-dkms" in said and "6.1.0-57-amd64" in said
    assert flavour_switch([_install(())]) is None  # an update within the flavour: no question
    assert flavour_switch([_install(("nvidia-open-kernel-dkms",), previous=())]) is None  # a branch change: asked


class ListsHost(NodeHost):
    def __init__(self, pins: str | None, lists: list[str]):
        self.pins, self.lists = pins, lists

    def run(self, argv):
        if argv[0] == "cat":
            return (0, self.pins, "") if self.pins is not None else (1, "", "No such file or directory")
        return 0, "\n".join(self.lists), ""


SEC = "deb.debian.org_debian-security_dists_bookworm-security_{}_binary-amd64_Packages"
BRANCH_PIN = "Package: src:nvidia-graphics-drivers:any\nPin: version 535.*\nPin-Priority: 990\n\n" \
             "Package: src:nvidia-graphics-drivers:any\nPin: version *\nPin-Priority: -1\n"


@pytest.mark.parametrize("pins, lists, status, words", [
    (None, [], "skip", "no driver series pinned"),
    (BRANCH_PIN, [SEC.format("main")], "warn", "apt fetches bookworm-security without non-free"),
    (BRANCH_PIN, [SEC.format("main"), SEC.format("non-free")], "pass", "bookworm-security carries non-free"),
    (BRANCH_PIN.replace("535.*", "535.261.03-1"), [SEC.format("non-free")], "warn", "pinned at exactly 535.261.03-1"),
])
def test_verify_warns_when_the_drivers_updates_cannot_reach_the_node(pins, lists, status, words):
    r = driver_updates(ListsHost(pins, lists))
    assert r.status == status and words in r.detail, r


# ---------------------------------------------------------------- gpuprov's series on a host (plan through _plan)

OLD, NEW = "6.1.0-50-amd64", "6.1.0-57-amd64"
SERIES = {"nvidia-driver": "nvidia-graphics-drivers", "libcuda1": "nvidia-graphics-drivers",
          "nvidia-smi": "nvidia-graphics-drivers", "nvidia-driver-libs": "nvidia-graphics-drivers",
          "nvidia-open-kernel-dkms": "nvidia-open-gpu-kernel-modules",
          "nvidia-open-kernel-support": "nvidia-graphics-drivers"}


def _open_node(tmp_path: Path, served: bool) -> Path:
    """gpuprov's open 535.261.03 series, pinned, built for OLD; NEW (the security kernel) boots next, with a module or
    not; the lists of bookworm and of bookworm-security with non-free (the origins above)."""
    from tests.conftest import dpkg_status, make_host

    root = make_host(tmp_path, "debian-12", "none", kernel=OLD)
    for k in (OLD, NEW) if served else (OLD,):
        (root / f"lib/modules/{k}/updates/dkms").mkdir(parents=True)
        (root / f"lib/modules/{k}/updates/dkms/nvidia-current-open.ko").write_text("")
    (root / f"lib/modules/{NEW}/kernel").mkdir(parents=True, exist_ok=True)
    (root / f"boot/vmlinuz-{NEW}").write_text("")
    (root / "vmlinuz").symlink_to(f"boot/vmlinuz-{NEW}")
    dpkg_status(root, SERIES)
    status = root / "var/lib/dpkg/status"
    status.write_text(status.read_text().replace("Version: 1.0-1", "Version: 535.261.03-1"))
    pin = root / "etc/apt/preferences.d/gpuprov-nvidia"
    pin.parent.mkdir(parents=True, exist_ok=True)
    pin.write_text("".join(f"Package: src:{s}:any\nPin: version 535.*\nPin-Priority: 990\n\n"
                           f"Package: src:{s}:any\nPin: version *\nPin-Priority: -1\n\n"
                           for s in ("nvidia-graphics-drivers", "nvidia-open-gpu-kernel-modules")))
    lists = root / "var/lib/apt/lists"
    lists.mkdir(parents=True, exist_ok=True)
    stanza = "Package: {}\nVersion: {}\nDepends: nvidia-support\n\n"
    (lists / "deb.debian.org_debian_dists_bookworm_non-free_binary-amd64_Packages").write_text(
        stanza.format("nvidia-driver", "535.261.03-1") + stanza.format("nvidia-kernel-dkms", "535.261.03-1"))
    (lists / "deb.debian.org_debian_dists_bookworm_contrib_binary-amd64_Packages").write_text(
        stanza.format("nvidia-open-kernel-dkms", "535.261.03-1"))
    (lists / "deb.debian.org_debian-security_dists_bookworm-security_non-free_binary-amd64_Packages").write_text(
        stanza.format("nvidia-driver", "535.309.01-0+deb12u1")
        + stanza.format("nvidia-kernel-dkms", "535.309.01-0+deb12u1"))
    return root


def _driver_step(root: Path):
    from provision.commands.plan import _plan
    from provision.plan.options import Options

    _, steps = _plan(root, None, Options(for_gpus=(H100,)))
    return steps, next(s for s in steps if s.id == "driver.packages")


def test_a_node_keeps_its_flavour_while_it_serves_every_kernel(tmp_path):
    steps, step = _driver_step(_open_node(tmp_path, served=True))
    install = next(a for a in step.actions if isinstance(a, DriverInstall))
    assert "nvidia-open-kernel-dkms" in install.packages and not install.remove, install
    assert flavour_switch(steps) is None
    assert any("not the maintained one" in n for n in step.notes), step.notes  # the risk is said


def test_a_node_moves_to_the_maintained_flavour_when_a_kernel_needs_it(tmp_path):
    steps, step = _driver_step(_open_node(tmp_path, served=False))
    install = next(a for a in step.actions if isinstance(a, DriverInstall))
    assert install.dkms_package == "nvidia-kernel-dkms" and "nvidia-open-kernel-dkms" in install.remove, install
    assert install.previous and all(k in install.kernels for k in (OLD, NEW))  # rollback target, every kernel
    assert any("decision: bookworm-security updates nvidia-kernel-dkms" in n for n in step.notes), step.notes
    said = flavour_switch(steps)
    assert said and "from nvidia-open-kernel-dkms to nvidia-kernel-dkms" in said and NEW in said
