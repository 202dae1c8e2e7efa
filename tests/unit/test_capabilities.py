"""Driver capabilities (graphics, video, display, ngx, compat32, all) against the fake driver root built from the
real H200 capture: what each capability mounts, that nothing unasked is mounted, loader manifests (and rewritten
copies), firmware only on old kernels, CDI spec and refresh, docker-args and driver-volume."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest

from provision.errors import ConfigInvalid
from provision.inject import cdi, discover, edits
from tests.conftest import H200, run_cli

ROOT = str(H200 / "usr/local/nvidia")
GRAPHICS_MANIFESTS = {"/usr/share/vulkan/icd.d/nvidia_icd.json", "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
                      "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json"}


@pytest.fixture(scope="module")
def disc():
    return discover.discover(ROOT, proc_root=str(H200), dev_root=str(H200))


def _dests(disc, caps: str, libdir=edits.DEBIAN_LIBDIR) -> set[str]:
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": caps}, libdir=libdir)
    return {m.destination for m in e.mounts}


def test_manifests_found_with_the_library_they_name(disc):
    by_path = {m.container_path: m for m in disc.manifests}
    assert set(by_path) == GRAPHICS_MANIFESTS  # the capture has no EGL platform JSONs, no nvoptix.bin, no OpenCL icd
    assert by_path["/usr/share/vulkan/icd.d/nvidia_icd.json"].library == "libGLX_nvidia.so.0"
    assert by_path["/usr/share/glvnd/egl_vendor.d/10_nvidia.json"].library == "libEGL_nvidia.so.0"
    assert all(m.rewrite is None and m.cap == "graphics" for m in disc.manifests)  # bare SONAMEs


def test_graphics_gets_libraries_and_manifests(disc):
    d = _dests(disc, "graphics")
    lib = edits.DEBIAN_LIBDIR
    assert GRAPHICS_MANIFESTS <= d
    for so in ("libEGL_nvidia.so.0", "libGLX_nvidia.so.0", "libGLESv2_nvidia.so.2", "libnvidia-eglcore.so.580.159.04",
               "libnvidia-glcore.so.580.159.04", "libnvidia-glsi.so.580.159.04", "libnvidia-tls.so.580.159.04",
               "libnvidia-rtcore.so.580.159.04", "libnvoptix.so.1", "libnvidia-glvkspirv.so.580.159.04",
               "libnvidia-fbc.so.1", "libnvidia-gpucomp.so.580.159.04"):
        assert f"{lib}/{so}" in d, so
    assert f"{lib}/libcuda.so.1" not in d and f"{lib}/libnvidia-ml.so.1" not in d  # graphics alone: no CUDA


def test_video_gets_decode_encode_and_cuda(disc):
    d = _dests(disc, "video")
    for so in ("libnvcuvid.so.1", "libnvidia-encode.so.1", "libnvidia-opticalflow.so.1", "libvdpau_nvidia.so.1",
               "libcuda.so.1"):
        assert f"{edits.DEBIAN_LIBDIR}/{so}" in d, so
    assert not d & GRAPHICS_MANIFESTS


@pytest.mark.parametrize("caps", ["utility", "compute", "utility,compute", "video", "display", "ngx"])
def test_nothing_unasked_is_mounted(disc, caps):
    d = _dests(disc, caps)
    if "graphics" not in caps:
        assert not d & GRAPHICS_MANIFESTS and not any("libEGL_nvidia" in x or "libGLX_nvidia" in x for x in d)
    if "video" not in caps:
        assert not any("libnvcuvid" in x or "libnvidia-encode" in x for x in d)
    if caps in ("display", "ngx"):  # neither implies CUDA or NVML
        assert not any("libcuda" in x or "libnvidia-ml" in x for x in d)
    assert not any("/firmware/" in x for x in d)  # kernel 6.18 loads GSP firmware itself


def test_all_is_every_capability(disc):
    everything = _dests(disc, "utility,compute,video,graphics,display,ngx,compat32")
    assert _dests(disc, "all") == everything
    assert GRAPHICS_MANIFESTS <= everything and f"{edits.DEBIAN_LIBDIR}/libnvcuvid.so.1" in everything
    caps = dict(edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "all"}).env)
    assert caps["NVIDIA_DRIVER_CAPABILITIES"].split(",") == list(edits.CAPABILITIES)


def test_display_adds_modeset_node_only_when_asked(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "nvidia-modeset", 0o666 | 0o020000, os.makedev(195, 254))
    d = discover.discover(ROOT, proc_root=str(H200), dev_root=str(tmp_path))
    paths = [n.path for n in edits.compute_edits(d, {"NVIDIA_VISIBLE_DEVICES": "0",
                                                    "NVIDIA_DRIVER_CAPABILITIES": "display"}).devices]
    assert "/dev/nvidia-modeset" in paths
    paths = [n.path for n in edits.compute_edits(d, {"NVIDIA_VISIBLE_DEVICES": "0"}).devices]
    assert "/dev/nvidia-modeset" not in paths


@pytest.mark.parametrize("release,needed", [("6.18.44-fc-v657-gpu", False), ("5.7.0", False), ("5.4.0-150", True),
                                            ("4.18.0-553.el8_10.x86_64", True), ("", True)])
def test_firmware_only_for_kernels_before_5_7(disc, release, needed):
    assert discover.firmware_needed(release) is needed
    d = replace(disc, firmware_needed=needed)
    fw = {m for m in _dests(d, "utility") if "/firmware/" in m}
    assert bool(fw) is needed
    if needed:
        assert "/lib/firmware/nvidia/580.159.04/gsp_ga10x.bin" in fw


@pytest.fixture
def copied_root(tmp_path):
    """A copy of the fake driver root that a test can change (32-bit libs, manifests naming absolute paths)."""
    root = tmp_path / "nvidia"
    shutil.copytree(ROOT, root, symlinks=True)
    return root


def test_compat32_only_where_32bit_libraries_exist(disc, copied_root):
    assert disc.libraries32 == {} and _dests(disc, "compute,compat32") == _dests(disc, "compute")
    lib32 = copied_root / "lib32"
    lib32.mkdir()
    (lib32 / "libcuda.so.580.159.04").write_bytes(b"\x7fELF\x01" + b"\0" * 59)  # ELFCLASS32
    (lib32 / "libcuda.so.1").symlink_to("libcuda.so.580.159.04")
    (lib32 / "libGLX_nvidia.so.580.159.04").write_bytes(b"\x7fELF\x01" + b"\0" * 59)
    (lib32 / "libGLX_nvidia.so.0").symlink_to("libGLX_nvidia.so.580.159.04")
    d = discover.discover(str(copied_root), proc_root=str(H200), dev_root=str(H200))
    got = _dests(d, "compute,compat32")
    assert "/usr/lib/i386-linux-gnu/libcuda.so.1" in got
    assert "/usr/lib/i386-linux-gnu/libGLX_nvidia.so.0" not in got  # graphics not asked for
    assert "/usr/lib/libcuda.so.1" in _dests(d, "compute,compat32", libdir=edits.RHEL_LIBDIR)
    assert not any("i386" in x for x in _dests(d, "compute"))


def test_manifest_naming_an_absolute_path_gets_a_rewritten_copy(copied_root, tmp_path):
    icd = copied_root / "share/vulkan/icd.d/nvidia_icd.json"
    doc = json.loads(icd.read_text())
    doc["ICD"]["library_path"] = "/usr/local/nvidia/lib64/libGLX_nvidia.so.0"
    icd.write_text(json.dumps(doc))
    d = discover.discover(str(copied_root), proc_root=str(H200), dev_root=str(H200))
    [m] = [m for m in d.manifests if m.container_path.endswith("nvidia_icd.json")]
    assert m.rewrite == "libGLX_nvidia.so.0" and m.source is None
    # not written yet: never mount a manifest that would send the loader to a host path
    assert "/usr/share/vulkan/icd.d/nvidia_icd.json" not in _dests(d, "graphics")
    gen = tmp_path / "gen"
    assert discover.write_manifests(d, str(gen)) != d  # a new record: `d` itself is never changed
    d = discover.write_manifests(d, str(gen))
    [mount] = [x for x in edits.driver_mounts(d, ["graphics"]) if x.destination.endswith("nvidia_icd.json")]
    assert mount.source == str(gen / "580.159.04" / "nvidia_icd.json")
    assert json.loads(open(mount.source).read())["ICD"]["library_path"] == "libGLX_nvidia.so.0"
    assert (gen / "580.159.04").stat().st_mode & 0o777 == 0o755
    assert os.stat(mount.source).st_mode & 0o777 == 0o644


def test_generated_manifest_dir_writable_by_others_is_refused(copied_root, tmp_path):
    icd = copied_root / "share/vulkan/icd.d/nvidia_icd.json"
    icd.write_text(icd.read_text().replace('"libGLX_nvidia.so.0"', '"/opt/x/libGLX_nvidia.so.0"'))
    d = discover.discover(str(copied_root), proc_root=str(H200), dev_root=str(H200))
    gen = tmp_path / "gen"
    (gen / "580.159.04").mkdir(parents=True)
    os.chmod(gen / "580.159.04", 0o777)  # someone else could swap the file a container mounts
    with pytest.raises(OSError, match="only it can write"):
        discover.write_manifests(d, str(gen))


def test_egl_platform_manifest_brings_its_library(copied_root):
    plat = copied_root / "share/egl/egl_external_platform.d"
    plat.mkdir(parents=True)
    (plat / "15_nvidia_gbm.json").write_text(json.dumps(
        {"file_format_version": "1.0.0", "ICD": {"library_path": "libnvidia-egl-gbm.so.1"}}))
    (copied_root / "lib64/libnvidia-egl-gbm.so.1.1.2").write_text("fake")
    (copied_root / "lib64/libnvidia-egl-gbm.so.1").symlink_to("libnvidia-egl-gbm.so.1.1.2")
    d = discover.discover(str(copied_root), proc_root=str(H200), dev_root=str(H200))
    got = {m.destination: m.source for m in edits.driver_mounts(d, ["graphics"])}
    assert "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json" in got
    assert got[f"{edits.DEBIAN_LIBDIR}/libnvidia-egl-gbm.so.1"].endswith("libnvidia-egl-gbm.so.1.1.2")


def test_cdi_spec_has_every_capability_and_validates(disc):
    from tests.cdi_check import validate

    spec = cdi.generate_spec(disc)
    validate(spec)
    paths = {m["containerPath"] for m in spec["containerEdits"]["mounts"]}
    assert GRAPHICS_MANIFESTS <= paths
    for so in ("libEGL_nvidia.so.0", "libnvcuvid.so.1", "libnvidia-encode.so.1", "libcuda.so.1"):
        assert {f"/usr/lib/x86_64-linux-gnu/{so}", f"/usr/lib64/{so}"} <= paths, so
    assert not any("/firmware/" in p for p in paths)
    assert "hooks" not in spec["containerEdits"]  # no ldconfig, no symlink hook: SONAME mounts
    names = {lib.soname for v in disc.libraries.values() for lib in v}
    assert len(names) == 26  # every versioned library of the capture's lib64 (what nvidia-ctk mounts)


def test_cdi_refresh_writes_both_dirs_once_and_keeps_foreign_specs(tmp_path):
    etc, run = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    kw = {"dirs": (str(etc), str(run)), "proc_root": str(H200), "dev_root": str(H200), "gen_dir": str(tmp_path / "g")}
    assert cdi.refresh_specs(ROOT, **kw) == [str(etc / "nvidia.yaml"), str(run / "nvidia.yaml")]
    assert cdi.refresh_specs(ROOT, **kw) == []  # same driver: nothing rewritten
    (run / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\n")  # nvidia-ctk's, say
    with pytest.raises(ConfigInvalid, match="not written by gpuprov"):
        cdi.refresh_specs(ROOT, **kw)
    assert "devices: []" in (run / "nvidia.yaml").read_text()


def test_refresh_units_are_the_one_definition():
    from provision.k8s.node import refresh_unit

    units = cdi.refresh_units("/usr/local/bin/gpuprov", "containerd.service")
    assert "ExecStart=/usr/local/bin/gpuprov cdi refresh" in units["gpuprov-cdi-refresh.service"]
    assert "Before=containerd.service" in units["gpuprov-cdi-refresh.service"]
    assert "PathChanged=/lib/modules/%v/modules.dep.bin" in units["gpuprov-cdi-refresh.path"]
    assert refresh_unit("containerd", "/usr/local/bin/gpuprov") == units["gpuprov-cdi-refresh.service"]


def test_docker_args_graphics(tmp_path):
    from tests.inject_helpers import write_settings

    r = run_cli("docker-args", "--gpus", "0", "--capabilities", "graphics", "--driver-root", ROOT,
                env={"GPUPROV_RUNTIME_CONFIG": str(write_settings(tmp_path))})
    assert r.returncode == 0, r.stderr
    assert f"{ROOT}/share/vulkan/icd.d/nvidia_icd.json:/usr/share/vulkan/icd.d/nvidia_icd.json:ro" in r.stdout
    assert "libEGL_nvidia.so.0:ro" in r.stdout and "libcuda" not in r.stdout


def test_driver_volume_carries_manifests(tmp_path):
    r = run_cli("driver-volume", "--base", str(tmp_path / "drv"), "--driver-root", ROOT,
                env={"GPUPROV_LOCK_DIR": str(tmp_path / "lock")})
    assert r.returncode == 0, r.stderr
    cur = tmp_path / "drv/current"
    assert json.loads((cur / "share/vulkan/icd.d/nvidia_icd.json").read_text())["ICD"]["library_path"] == \
        "libGLX_nvidia.so.0"
    assert (cur / "lib64/libnvidia-gpucomp.so.580.159.04").exists()  # in two capabilities, linked once


def test_graphics_gbm_backend(disc):
    got = {m.destination: m.source for m in edits.driver_mounts(disc, ["graphics"])}
    assert got[f"{edits.DEBIAN_LIBDIR}/gbm/nvidia-drm_gbm.so"].endswith("libnvidia-allocator.so.580.159.04")


def test_real_specs_nvidia_ctk_vs_gpuprov():
    """The two specs generated side by side on a 2x H200 host (tests/gpu/device_caps.sh, 2026-11-21): every device
    node and container path of nvidia-ctk's is in gpuprov's, or the difference has its reason."""
    import yaml

    from tests.cdi_check import validate
    from tests.conftest import FIXTURES
    from tests.gpu.cdi_compare import compare

    theirs = yaml.safe_load((FIXTURES / "cdi/h200x2-nvidia-ctk.yaml").read_text())
    ours = yaml.safe_load((FIXTURES / "cdi/h200x2-gpuprov.yaml").read_text())
    validate(ours)
    validate(theirs)
    r = compare(theirs, ours)
    assert r["unexplained"] == [] and r["device_names_missing"] == []
    assert r["their_nodes"] == r["our_nodes"] == ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0",
                                                  "/dev/nvidia1", "/dev/nvidiactl"]
    assert r["their_mounts"] == 35 and len(r["same_file_other_path"]) == 32
    assert [e["path"].rsplit("/", 1)[1] for e in r["explained"]] == ["gsp_ga10x.bin", "gsp_tu10x.bin"]
    broken = dict(ours, containerEdits=dict(ours["containerEdits"], mounts=[
        m for m in ours["containerEdits"]["mounts"] if "libnvcuvid" not in m["containerPath"]]))
    assert [u["path"] for u in compare(theirs, broken)["unexplained"]] == [
        "/usr/local/nvidia/lib64/libnvcuvid.so.580.159.04"]  # a library we lost would be caught


@pytest.mark.parametrize("version,warned", [("20.10.24+dfsg1", True), ("26.1.5+dfsg1", False)])
def test_engine_configure_docker_cdi_warns_on_old_dockerd(tmp_path, version, warned):
    """`engine configure docker --cdi` writes features.cdi; a dockerd older than 25 is told it has no CDI."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "dockerd").write_text(f"#!/bin/sh\necho 'Docker version {version}, build 1a2b3c4'\n")
    (bindir / "dockerd").chmod(0o755)
    cfg = tmp_path / "daemon.json"
    cfg.write_text("{}")
    r = run_cli("engine", "configure", "docker", "--config", str(cfg), "--cdi", "--dry-run", "--runtime-path",
                "/usr/local/bin/gpuprov-runtime", env={"PATH": f"{bindir}:{os.environ['PATH']}",
                                                       "GPUPROV_LOCK_DIR": str(tmp_path / "lock")})
    assert r.returncode == 0, r.stderr
    assert '"cdi": true' in r.stdout
    assert ("has no CDI support" in r.stdout) is warned, r.stdout


def test_bootstrap_plans_the_cdi_spec_only_with_cdi_and_a_loaded_driver(tmp_path):
    env = {"GPUPROV_LOCK_DIR": str(tmp_path / "lock")}

    def steps(*args):
        r = run_cli("plan", "--root", str(H200), *args, "--json", env=env)
        assert r.returncode == 0, r.stderr
        return {s["id"]: s for s in json.loads(r.stdout)["steps"]}

    with_cdi = steps("--cdi")
    assert with_cdi["cdi.spec"]["commands"] == []  # gpuprov's own operation, run in-process (steps.RefreshCdi)
    assert with_cdi["cdi.spec"]["actions"][-1].endswith("as gpuprov cdi refresh --install-units does")
    assert "/etc/cdi/nvidia.yaml" in with_cdi["cdi.spec"]["check"]
    assert "cdi.spec" not in steps()
    assert not cdi.SpecCurrent(ROOT).satisfied(tmp_path)  # a fixture tree is never the live host
