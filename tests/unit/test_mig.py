"""MIG: discovery from /proc (tests/fixtures/hosts/h100-mig: a real H100 capture, MIG disabled, with a MIG layout
overlaid), NVML identities (FakeMigNVML),
each selector form, a missing instance, the admin capabilities, a changed layout and the CDI spec.
Fails on the commit before mig.py: every MIG selector there was refused ("no MIG instances are configured")."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from provision.inject import discover, edits, mig
from provision.inject.cdi import generate_spec
from provision.inject.edits import Refused
from tests.cdi_check import apply_spec, validate
from tests.conftest import H200
from tests.fake_nvml import FakeMigNVML
from tests.inject_helpers import MIG_FIXTURE as MIG_FIX
from tests.inject_helpers import mig_proc

ROOT = str(H200 / "usr/local/nvidia")
GPU0 = "GPU-72078e36-3be8-e850-3cb6-446d44c26b39"
UUIDS = ["MIG-feb88891-0321-5fef-9c87-d4af3b54259e", "MIG-a25704ba-3a06-5299-a795-fd7cf4d13973",
         "MIG-50f1c4c9-1508-5e8d-bb06-d08145b22e01", "MIG-36c795f2-5cf7-55d6-af30-e535e79b7bb6"]
BASE = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0"]


@pytest.fixture
def proc(tmp_path):
    return mig_proc(tmp_path)


def scan_only(proc_root: str) -> discover.Discovery:
    return discover.discover(ROOT, proc_root=proc_root, dev_root=str(MIG_FIX))


def with_nvml(disc: discover.Discovery) -> discover.Discovery:
    """What a refresh with pynvml present records (identify's child runs read_nvml; here in-process, on the fake)."""
    return replace(disc, mig=mig.merge(disc.mig, mig.read_nvml(FakeMigNVML(), [GPU0]), disc.gpus))


def nodes(e: edits.Edits) -> list[str]:
    return [d.path for d in e.devices]


def cap(minor: int) -> str:
    return f"/dev/nvidia-caps/nvidia-cap{minor}"


def test_scan_reads_the_documented_proc_layout(proc):
    disc = scan_only(proc)
    got = [(d.gpu, d.gi, d.ci, [tuple(n) for n in disc.mig.nodes(d)], d.uuid) for d in disc.mig.devices]
    assert got == [(0, gi, 0, [(cap(3 + 9 * gi), 241, 3 + 9 * gi), (cap(4 + 9 * gi), 241, 4 + 9 * gi)], None)
                   for gi in (2, 3, 9, 10)]
    assert tuple(disc.mig.admin_node("config")) == (cap(1), 241, 1)
    assert tuple(disc.mig.admin_node("monitor")) == (cap(2), 241, 2)


@pytest.mark.parametrize("host", [MIG_FIX, H200], ids=["h100-mig-disabled", "h200-no-caps-tree"])
def test_host_without_instances_is_as_before(host):
    """The real H100 capture (MIG disabled: config/monitor only, gpu0/mig empty) and the H200 capture (no
    capabilities tree captured): no MIG device, the cache key unchanged, whole-GPU edits as before."""
    disc = scan_only(str(host))
    assert disc.mig is None or disc.mig.devices == ()
    assert mig.layout_key(str(host)) == "" and " mig " not in discover.host_key(str(host))  # the key as before
    for sel in ("0", "all"):
        e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": sel})
        assert nodes(e) == BASE and dict(e.env)["NVIDIA_VISIBLE_DEVICES"] == disc.gpus[0].uuid


def test_nvml_names_uuids_profiles_and_indices(proc):
    disc = with_nvml(scan_only(proc))
    by_gi = {d.gi: d for d in disc.mig.devices}
    assert [(by_gi[gi].index, by_gi[gi].uuid, by_gi[gi].profile) for gi in (9, 10, 3, 2)] == [
        (0, UUIDS[0], "1g.10gb"), (1, UUIDS[1], "1g.10gb"), (2, UUIDS[2], "2g.20gb"), (3, UUIDS[3], "3g.40gb")]
    assert mig.profile_of("NVIDIA A100-SXM4-80GB MIG 1g.10gb") == "1g.10gb" and mig.profile_of("NVIDIA H200") is None


@pytest.mark.parametrize("selector,gi", [
    (UUIDS[0], 9), ("MIG-" + UUIDS[3][4:].upper(), 2), ("0:0", 9), ("0:3", 2), ("0:2:0", 2), ("0:9:0", 9),
])
def test_each_selector_gives_exactly_its_instance(proc, selector, gi):
    disc = with_nvml(scan_only(proc))
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": selector})
    assert nodes(e) == BASE + [cap(3 + 9 * gi), cap(4 + 9 * gi)]
    assert {(r.major, r.minor) for r in e.rules} == {(d.major, d.minor) for d in e.devices}
    uuid = next(d.uuid for d in disc.mig.devices if d.gi == gi)
    assert dict(e.env)["NVIDIA_VISIBLE_DEVICES"] == uuid  # the container sees that instance, not the whole GPU


def test_two_instances_and_a_whole_gpu_selector(proc):
    disc = with_nvml(scan_only(proc))
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "0:2:0,0:3:0"})
    assert nodes(e) == BASE + [cap(21), cap(22), cap(30), cap(31)]
    assert edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "0"}).devices[-1].path == "/dev/nvidia0"
    assert len(nodes(edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "0"}))) == 4  # no caps for the whole GPU


def test_all_gives_every_instance(proc):
    e = edits.compute_edits(with_nvml(scan_only(proc)), {"NVIDIA_VISIBLE_DEVICES": "all"})
    assert nodes(e) == BASE + [cap(m) for gi in (2, 3, 9, 10) for m in (3 + 9 * gi, 4 + 9 * gi)]


@pytest.mark.parametrize("selector", ["0:4", "0:5:0", "0:2:1", "1:0", "MIG-00000000-0000-0000-0000-000000000000",
                                      "0:x", "0:1:2:3", ":"])
def test_missing_instance_refused_in_one_line_listing_those_that_exist(proc, selector):
    with pytest.raises(Refused) as exc:
        edits.compute_edits(with_nvml(scan_only(proc)), {"NVIDIA_VISIBLE_DEVICES": selector})
    msg = str(exc.value)
    assert "\n" not in msg and repr(selector) in msg and "does not exist" in msg
    assert f"{UUIDS[0]} = 0:0 = 0:9:0 (1g.10gb)" in msg and "0:2:0" in msg


def test_without_nvml_only_gpu_gi_ci_works(proc):
    """A refresh that could not ask NVML (no pynvml, or no answer in time): the /proc facts still select by IDs;
    NVML's index and UUID are refused (never guessed: a wrong guess would hand over another tenant's instance)."""
    disc = scan_only(proc)
    assert nodes(edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "0:3:0"})) == BASE + [cap(30), cap(31)]
    for s in ("0:0", UUIDS[0]):
        with pytest.raises(Refused, match="only GPU:GI:CI names work"):
            edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": s})


def test_identify_without_pynvml_keeps_the_proc_layout(proc, monkeypatch):
    disc = scan_only(proc)
    from provision import effects

    monkeypatch.setattr(effects, "try_run", lambda *a, **k: None)  # no answer within the deadline
    assert mig.identify(disc.mig, disc.gpus) == disc.mig
    found = mig.read_nvml(FakeMigNVML(), [GPU0])
    monkeypatch.setattr(effects, "try_run", lambda argv, **k: effects.CommandResult(argv, 0, "", json.dumps(found), ""))
    assert [d.uuid for d in mig.identify(disc.mig, disc.gpus).devices] == [UUIDS[3], UUIDS[2], UUIDS[0], UUIDS[1]]


@pytest.mark.parametrize("var,minor", [("NVIDIA_MIG_CONFIG_DEVICES", 1), ("NVIDIA_MIG_MONITOR_DEVICES", 2)])
def test_config_and_monitor_only_for_privileged(proc, var, minor):
    disc = with_nvml(scan_only(proc))
    env = {"NVIDIA_VISIBLE_DEVICES": "0", var: "all"}
    with pytest.raises(Refused, match=f"{var} is set but the container is not privileged"):
        edits.compute_edits(disc, env)
    assert nodes(edits.compute_edits(disc, env, privileged=True)) == BASE + [cap(minor)]
    with pytest.raises(Refused, match="offers no MIG"):  # the H200 capture has no capabilities tree
        edits.compute_edits(scan_only(str(H200)), env, privileged=True)
    assert nodes(edits.compute_edits(scan_only(str(MIG_FIX)), env, privileged=True)) == BASE + [cap(minor)]


CAPS = "/proc/driver/nvidia/capabilities"


def test_mig_container_sees_only_its_instance_in_proc(proc):
    """NVIDIA's runtime leaves a MIG container only its own instance's /proc/driver/nvidia/capabilities files (and
    its GPUs' gpus/ entries); gpuprov has runc mask the rest (linux.maskedPaths). main masked nothing: every
    instance's access file and mig/config were readable in every MIG container."""
    disc = with_nvml(scan_only(proc))
    admin = [f"{CAPS}/mig/config", f"{CAPS}/mig/monitor"]
    gi = {n: f"{CAPS}/gpu0/mig/gi{n}" for n in (2, 3, 9, 10)}
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "0:9:0"})
    assert e.masked == (gi[2], gi[3], gi[10], *admin)  # its own gi9 (with ci0) stays: NVML reads it
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": UUIDS[2] + ",0:3"})  # GI 3 by UUID, GI 2 by index
    assert e.masked == (gi[9], gi[10], *admin)
    env = {"NVIDIA_VISIBLE_DEVICES": "0:9:0", "NVIDIA_MIG_MONITOR_DEVICES": "all"}
    assert edits.compute_edits(disc, env, privileged=True).masked == (gi[2], gi[3], gi[10], admin[0])
    for whole in ("0", "none"):  # whole GPUs (or none) on a MIG host: /proc as before
        assert edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": whole}).masked == ()
    # a second CI in GI 9 and a second GPU: the other CI's directory (not its GI's) and the other GPU's gpus/ entry
    d9 = next(d for d in disc.mig.devices if d.gi == 9)
    ci1 = mig.MigDevice(0, 0, 9, 1, d9.gi_minor, d9.ci_minor + 1, "MIG-00000000-0000-0000-0000-000000000001",
                        "1g.10gb", 4)
    g1 = replace(disc.gpus[0], bus_id="0000:00:07.0", index=1, minor=1, uuid="GPU-1")
    two = replace(disc, gpus=(*disc.gpus, g1),
                  mig=mig.MigLayout(disc.mig.major, (*disc.mig.devices, ci1), disc.mig.config, disc.mig.monitor))
    e = edits.compute_edits(two, {"NVIDIA_VISIBLE_DEVICES": "0:9:0"})
    assert e.masked == (gi[2], gi[3], gi[10], f"{gi[9]}/ci1", *admin, "/proc/driver/nvidia/gpus/0000:00:07.0")


def test_changed_layout_rebuilds_the_cache(proc, tmp_path):
    from pathlib import Path

    cache = str(tmp_path / "cache" / "discovery.json")
    first = discover.refresh(ROOT, cache, proc_root=proc, dev_root=str(MIG_FIX))
    assert discover.load_cached(cache, proc) == first and len(first.mig.devices) == 4
    gi2 = Path(proc) / "proc/driver/nvidia/capabilities/gpu0/mig/gi2"
    (gi2 / "ci1").mkdir()
    (gi2 / "ci1/access").write_text("DeviceFileMinor: 23\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    assert discover.load_cached(cache, proc) is None  # the key saw the new compute instance
    second = discover.refresh(ROOT, cache, proc_root=proc, dev_root=str(MIG_FIX))
    assert [(d.gi, d.ci) for d in second.mig.devices] == [(2, 0), (2, 1), (3, 0), (9, 0), (10, 0)]
    e = edits.compute_edits(second, {"NVIDIA_VISIBLE_DEVICES": "0:2:0,0:2:1"})
    assert nodes(e) == BASE + [cap(21), cap(22), cap(23)]  # the GI's access node once
    shutil.rmtree(gi2)
    assert discover.load_cached(cache, proc) is None
    assert 2 not in {d.gi for d in discover.refresh(ROOT, cache, proc_root=proc, dev_root=str(MIG_FIX)).mig.devices}


def test_cache_round_trip_and_garbled_mig_is_a_miss(proc):
    disc = with_nvml(scan_only(proc))
    assert discover.Discovery.from_json(disc.to_json()) == disc
    doc = disc.to_dict()
    doc["mig"]["devices"][0]["gi"] = "2"
    with pytest.raises(ValueError):
        discover.Discovery.from_dict(doc)
    doc = disc.to_dict()
    doc["mig"]["devices"][0]["extra"] = 1
    with pytest.raises(ValueError):
        discover.Discovery.from_dict(doc)


def test_hostile_proc_entries_are_skipped(proc):
    from pathlib import Path

    caps = Path(proc) / "proc/driver/nvidia/capabilities"
    (caps / "gpu0/mig/gi9/ci0/access").write_text("DeviceFileMinor: -5\n")
    (caps / "gpu0/mig/gi١").mkdir()  # a non-ASCII digit
    (caps / "gpu0/mig/gix").mkdir()
    (caps / "gpu7/mig/gi1/ci0").mkdir(parents=True)  # a GPU the driver does not list
    (caps / "gpu7/mig/gi1/ci0/access").write_text("DeviceFileMinor: 16\n")
    assert [d.gi for d in scan_only(proc).mig.devices] == [2, 3, 10]


def test_cdi_spec_lists_each_mig_device_by_uuid_and_names(proc):
    spec = generate_spec(with_nvml(scan_only(proc)))
    validate(spec)
    names = [d["name"] for d in spec["devices"]]
    assert names[:2] == ["0", GPU0] and names[-1] == "all"
    assert {UUIDS[0], "0:0", "0:9:0", UUIDS[3], "0:3", "0:2:0"} <= set(names)
    cfg = {"process": {"env": []}}
    apply_spec(cfg, spec, ["0:9:0"])
    assert [d["path"] for d in cfg["linux"]["devices"]] == BASE + [cap(84), cap(85)]
    cfg = {"process": {"env": []}}
    apply_spec(cfg, spec, [UUIDS[0]])
    assert [d["path"] for d in cfg["linux"]["devices"]][-2:] == [cap(84), cap(85)]


def test_runtime_discover_shows_the_mig_devices(tmp_path, monkeypatch, capsys):
    (tmp_path / "p").mkdir()
    cfg = {"driver_root": ROOT, "proc_root": mig_proc(tmp_path / "p"), "dev_root": str(MIG_FIX)}
    (tmp_path / "runtime.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(tmp_path / "runtime.json"))
    monkeypatch.setattr(mig, "identify", lambda layout, gpus: mig.merge(
        layout, mig.read_nvml(FakeMigNVML(), [g.uuid for g in gpus]), gpus))
    from provision.cli import main

    assert main(["runtime", "discover"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("mig"))
    assert f"{UUIDS[0]} = 0:0 = 0:9:0 (1g.10gb)" in line and "0:2:0 (3g.40gb)" in line
    assert main(["runtime", "discover", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["mig"]["devices"]) == 4


def test_cdi_refresh_path_names_devices_by_uuid(proc, monkeypatch):
    """`gpuprov cdi refresh` discovers without arch: NVML is still asked where instances exist (a CDI spec without
    the UUID names would not serve the device plugin's uuid IDs); and the real child, where pynvml finds no driver,
    keeps the /proc layout."""
    real = mig.identify
    assert [d.uuid for d in real(scan_only(proc).mig, scan_only(proc).gpus).devices] == [None] * 4
    monkeypatch.setattr(mig, "identify", lambda layout, gpus: mig.merge(
        layout, mig.read_nvml(FakeMigNVML(), [g.uuid for g in gpus]), gpus))
    names = [d["name"] for d in generate_spec(discover.discover(ROOT, proc_root=proc, dev_root=str(MIG_FIX)))["devices"]]
    assert set(UUIDS) <= set(names)
