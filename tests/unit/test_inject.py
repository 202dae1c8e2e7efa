"""Discovery and edits against the fake driver root built from the real H200 capture."""
from __future__ import annotations

import pytest

from provision.inject import discover, edits
from provision.inject.cdi import generate_spec
from provision.inject.edits import Refused
from tests.cdi_check import apply_spec
from tests.conftest import H200

ROOT = str(H200 / "usr/local/nvidia")


@pytest.fixture(scope="module")
def disc():
    return discover.discover(ROOT, proc_root=str(H200), dev_root=str(H200))


def test_discovery(disc):
    assert disc.version == "580.159.04"
    libs = {lib.name: lib.soname for cap in disc.libraries.values() for lib in cap}
    assert libs["libcuda"] == "libcuda.so.1" and libs["libnvidia-ml"] == "libnvidia-ml.so.1"
    assert libs["libnvidia-nvvm"] == "libnvidia-nvvm.so.4" and libs["libEGL_nvidia"] == "libEGL_nvidia.so.0"
    assert libs["libnvidia-glcore"] == "libnvidia-glcore.so.580.159.04"  # no SONAME link: the versioned name
    assert all(lib.path.startswith(ROOT + "/lib64/") for c in disc.libraries.values() for lib in c)
    assert [b.rsplit("/", 1)[1] for b in disc.binaries["utility"]] == ["nvidia-smi", "nvidia-debugdump",
                                                                           "nvidia-persistenced"]
    assert disc.nodes.ctl == discover.Node("/dev/nvidiactl", 195, 255)
    assert disc.nodes.uvm.major == 238 and disc.nodes.uvm_tools.minor == 1 and disc.nodes.modeset is None
    [g] = disc.gpus
    assert g.uuid == "GPU-266c8396-dfbe-13b3-5ad6-311117e6bd98" and g.bus_id == "0000:00:06.0"
    assert g.index == 0 and g.node == discover.Node("/dev/nvidia0", 195, 0) and g.model == "NVIDIA H200"
    assert [f.container_path for f in disc.firmware] == [
        "/lib/firmware/nvidia/580.159.04/gsp_ga10x.bin", "/lib/firmware/nvidia/580.159.04/gsp_tu10x.bin"]


def test_elf_soname_of_a_real_library():
    import ctypes.util
    import glob

    libc = glob.glob("/lib/x86_64-linux-gnu/libc.so.6") or glob.glob("/usr/lib64/libc.so.6")
    if not libc:
        pytest.skip("no libc.so.6 at a known path")
    assert discover.elf_soname(libc[0]) == "libc.so.6"
    assert discover.elf_soname(str(H200 / "etc/os-release")) is None
    assert ctypes.util  # imported only to make sure the module exists on this Python


@pytest.mark.parametrize("value,expect", [(None, None), ("", None), ("void", None), ("none", []), ("all", ["all"]),
                                          ("0,GPU-26", ["0", "GPU-26"])])
def test_visible_devices(value, expect):
    env = {} if value is None else {"NVIDIA_VISIBLE_DEVICES": value}
    assert edits.requested_devices(env) == expect


def test_edits_all(disc):
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "all"})
    assert [d.path for d in e.devices] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                                                 "/dev/nvidia0"]
    assert {(a.major, a.minor) for a in e.rules} == {(195, 255), (238, 0), (238, 1), (195, 0)}
    dests = {m.destination for m in e.mounts}
    assert "/usr/lib/x86_64-linux-gnu/libcuda.so.1" in dests and "/usr/bin/nvidia-smi" in dests
    assert not any("libnvidia-glcore" in d for d in dests)  # graphics not requested
    assert all(m.options == ("ro", "nosuid", "nodev", "bind") for m in e.mounts)
    assert e.env[0] == edits.EnvVar("NVIDIA_VISIBLE_DEVICES", "GPU-266c8396-dfbe-13b3-5ad6-311117e6bd98")


def test_edits_none_gives_driver_without_gpu(disc):
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "none"})
    assert "/dev/nvidia0" not in [d.path for d in e.devices] and e.mounts


def test_edits_capabilities_and_libdir(disc):
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "utility"},
                            libdir=edits.RHEL_LIBDIR)
    dests = {m.destination for m in e.mounts}
    assert "/usr/lib64/libnvidia-ml.so.1" in dests and not any("libcuda" in d for d in dests)
    assert "/dev/nvidia-uvm" not in [d.path for d in e.devices]
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "video"})
    assert any("libcuda" in m.destination for m in e.mounts)  # video implies compute


def test_unknown_gpu_and_mig_refused(disc):
    with pytest.raises(Refused, match="unknown GPU '3'"):
        edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "3"})
    with pytest.raises(Refused, match="MIG"):
        edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "0:1"})
    with pytest.raises(Refused, match="unknown NVIDIA_DRIVER_CAPABILITIES"):
        edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "warp"})


@pytest.mark.parametrize("req,ok", [
    ("cuda>=12.2", True), ("cuda>=13.1", False), ("cuda>=13.1 brand=nvidia,driver>=580", True),
    ("driver>=580,driver<581", True), ("brand=tesla", False), ("arch>=9.0", False),
])
def test_requirements(disc, req, ok):
    from dataclasses import replace

    disc = replace(disc, gpus=tuple(replace(g, brand="nvidia") for g in disc.gpus))  # what the H200's driver says
    env = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_CUDA": req}
    if ok:
        edits.compute_edits(disc, env)
    else:
        with pytest.raises(Refused, match="NVIDIA_REQUIRE_CUDA"):
            edits.compute_edits(disc, env)
        edits.compute_edits(disc, {**env, "NVIDIA_DISABLE_REQUIRE": "true"})


@pytest.mark.parametrize("req,ok", [
    ("arch>=5.0", True), ("arch=9", True), ("arch=9.0.0", True), ("arch>9", False), ("arch>=9.0.1", False),
    ("arch<9.1", True), ("arch!=9.0", False), ("arch>=10.0 arch<=9.0", True), ("arch>=8.0,cuda>=13.1", False),
    ("brand!=tesla", True), ("brand=NVIDIA", True),
])
def test_arch_is_each_gpus_compute_capability(disc, req, ok):
    """Compared as libnvidia-container's dsl_compare_version: number by number, trailing zeros insignificant."""
    from dataclasses import replace

    sm90 = replace(disc, gpus=tuple(replace(g, arch="9.0", brand="nvidia") for g in disc.gpus))
    env = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_ARCH": req}
    if ok:
        edits.compute_edits(sm90, env)
    else:
        with pytest.raises(Refused, match="GPU 0: brand nvidia, arch 9.0"):
            edits.compute_edits(sm90, env)
    with pytest.raises(Refused, match="arch unknown"):  # not read from the driver: never passed blindly
        edits.compute_edits(disc, {**env, "NVIDIA_REQUIRE_ARCH": "arch>=5.0"})


@pytest.mark.parametrize("req", ["arch>=sm_90", "arch>=.9", "arch>=9.x", "brand>=tesla", "cuda~12"])
def test_malformed_requirements_are_refused(disc, req):
    with pytest.raises(Refused, match="malformed requirement"):
        edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_X": req})


def test_nvidia_smi_compute_cap_parsed():
    text = (H200 / "commands/query-gpu.csv").read_text()  # the capture's columns, cut to the two that are asked
    rows = [[c.strip() for c in line.split(",")] for line in text.splitlines()[1:]]
    out = "\n".join(f"{r[2]}, {r[9]}" for r in rows) + "\n"
    assert discover.parse_arches(out) == {"0000:00:06.0": "9.0"}
    assert discover.parse_arches('Field "compute_cap" is not a valid field to query.\n') == {}
    assert discover.parse_arches("00000000:3B:00.0, [N/A]\n00000001:18:00.0, 10.0\n") == {"0001:18:00.0": "10.0"}


def test_requirement_refusal_is_one_line(disc):
    with pytest.raises(Refused) as e:
        edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_CUDA": "cuda>=13.1"})
    assert "\n" not in str(e.value) and "cuda 13.0" in str(e.value)


def test_cdi_spec(disc):
    spec = generate_spec(disc)
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "nvidia.com/gpu"
    assert [d["name"] for d in spec["devices"]] == ["0", "GPU-266c8396-dfbe-13b3-5ad6-311117e6bd98", "all"]
    paths = {m["containerPath"] for m in spec["containerEdits"]["mounts"]}
    assert {"/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1"} <= paths
    cfg = {"process": {"env": []}}
    apply_spec(cfg, spec, ["all"])
    assert any(d["path"] == "/dev/nvidia0" for d in cfg["linux"]["devices"])
    with pytest.raises(KeyError):
        apply_spec({}, spec, ["7"])


def test_cdi_spec_validates_against_schema(disc):
    """Against the upstream CDI schema (vendored in tests/fixtures/cdi-schema, SOURCE names the commit)."""
    import jsonschema

    from tests.cdi_check import validate

    validate(generate_spec(disc))
    bad = generate_spec(disc)
    bad["containerEdits"]["mounts"][0]["hostPath"] = 7
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_real_h200_generated_spec_validates():
    """The spec `gpuprov cdi generate` wrote on a real H200 host (tests/fixtures/cdi) passes the schema."""
    import json

    import jsonschema

    from tests.cdi_check import validate
    from tests.conftest import FIXTURES

    spec = json.loads((FIXTURES / "cdi/h200-generated.json").read_text())
    validate(spec)
    assert {d["name"] for d in spec["devices"]} >= {"0", "all"}
    with pytest.raises(jsonschema.ValidationError):
        validate({**spec, "devices": [{"name": "0"}]})  # a device without containerEdits


def test_driver_volume_links_version_free_path(tmp_path):
    """nvidia-docker 1.0 / seed 002: BASE/current -> BASE/<version> with the driver files at their SONAMEs."""
    from tests.conftest import run_cli

    base = tmp_path / "driver"
    r = run_cli("driver-volume", "--base", str(base), "--driver-root", ROOT)
    assert r.returncode == 0, r.stderr
    cur = base / "current"
    assert cur.is_symlink() and (base / "580.159.04").is_dir()
    assert (cur / "lib64/libcuda.so.1").read_text().startswith("fake libcuda")
    assert (cur / "bin/nvidia-smi").exists()
    again = run_cli("driver-volume", "--base", str(base), "--driver-root", ROOT)
    assert again.returncode == 0 and cur.resolve() == (base / "580.159.04").resolve()
