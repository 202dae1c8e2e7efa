"""CUDA forward compatibility (issue 30 item 4): an image with NVIDIA's compat libraries gets them in place of the host
driver's exactly when NVIDIA's rules (nvidia-container-toolkit's enable-cuda-compat) and the data-centre rule say so,
and NVIDIA_REQUIRE_CUDA is judged against the CUDA it will really have. The compat libcuda is a real ELF shared
object built here (gcc), with NVIDIA's `.note.cuda.fwd_compatibility` note added by objcopy where a test needs it.
On main every one of these fails: the container always got the host's libcuda and cuda>=13.1 was refused."""
from __future__ import annotations

import json
import os
import struct
import subprocess
from dataclasses import replace

import pytest

from provision.errors import Refused
from provision.inject import compat, discover, edits
from tests.conftest import H200, needs

ROOT = str(H200 / "usr/local/nvidia")  # driver 580.159.04, one "NVIDIA H200"
NOTE = compat.NOTE


@pytest.fixture(scope="module")
def disc():
    return discover.discover(ROOT, proc_root=str(H200), dev_root=str(H200))


def build_lib(path, soname: str = "libcuda.so.1", note: dict | None = None) -> None:
    src = path.parent / "stub.c"
    src.write_text('const char *gpuprov_stand_in = "compat libcuda";\n')
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(path), str(src), f"-Wl,-soname,{soname}"], check=True)
    if note is not None:
        name, desc = b"NVIDIA Corporation\0", json.dumps(note).encode() + b"\0"
        pad = (-len(name)) % 4
        blob = struct.pack("<III", len(name), len(desc), 1) + name + b"\0" * pad + desc + b"\0" * ((-len(desc)) % 4)
        (path.parent / "note.bin").write_bytes(blob)
        subprocess.run(["objcopy", "--add-section", f"{NOTE}={path.parent / 'note.bin'}",
                        "--set-section-alignment", f"{NOTE}=4", str(path)], check=True)


def image(tmp_path, version: str, note: dict | None = None, extra: tuple[str, ...] = ()) -> str:
    rootfs = tmp_path / "rootfs"
    d = rootfs / "usr/local/cuda/compat"
    d.mkdir(parents=True)
    build_lib(d / f"libcuda.so.{version}", note=note)
    for lib in extra:
        build_lib(d / f"{lib}.so.{version}", soname=f"{lib}.so.1")
    os.symlink(f"libcuda.so.{version}", d / "libcuda.so.1")  # as the package ships it
    return str(rootfs)


def libcuda_source(e: edits.Edits) -> str:
    return next(m.source for m in e.mounts if m.destination == f"{edits.DEBIAN_LIBDIR}/libcuda.so.1")


@needs("gcc", "objcopy")
@pytest.mark.parametrize("version,note,used", [
    ("590.44.01", None, True),  # no note: a newer major than the host's 580
    ("580.200.01", None, False),  # no note: same major, never (NVIDIA's fallback compares majors)
    ("575.57.08", None, False),  # older
    ("590.44.01", {"Format": 1, "CUDA Version": "13.1", "Driver": [535, 570, 580], "Device": []}, True),
    ("590.44.01", {"Format": 1, "CUDA Version": "13.1", "Driver": [535, 570], "Device": []}, False),  # not 580
    ("580.200.01", {"Format": 1, "CUDA Version": "13.0", "Driver": [580], "Device": []}, True),  # newer 580
    ("580.100.01", {"Format": 1, "CUDA Version": "13.0", "Driver": [580], "Device": []}, False),  # older 580
])
def test_compat_used_exactly_when_the_rules_say(tmp_path, disc, version, note, used):
    rootfs = image(tmp_path, version, note, extra=("libnvidia-ptxjitcompiler",))
    found = compat.find(rootfs)
    assert found.version == version and found.drivers == (tuple(note["Driver"]) if note else None)
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "all"}, compat=found)
    want = f"/usr/local/cuda/compat/libcuda.so.{version}" if used else f"{ROOT}/lib64/libcuda.so.580.159.04"
    assert libcuda_source(e) == want
    ptx = next(m.source for m in e.mounts if m.destination.endswith("/libnvidia-ptxjitcompiler.so.1"))
    assert ptx.endswith(f"compat/libnvidia-ptxjitcompiler.so.{version}") == used
    nvvm = next(m.source for m in e.mounts if m.destination.endswith("/libnvidia-nvvm.so.4"))
    assert nvvm.startswith(ROOT)  # not in this image's compat dir: the host's


@needs("gcc", "objcopy")
def test_require_cuda_judged_against_the_cuda_the_container_gets(tmp_path, disc):
    env = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_CUDA": "cuda>=13.1"}
    with pytest.raises(Refused, match="cuda 13.0"):
        edits.compute_edits(disc, env)  # the host's 580 driver: CUDA 13.0
    found = compat.find(image(tmp_path, "590.44.01"))
    assert edits.compute_edits(disc, env, compat=found) is not None  # 590's CUDA 13.1, from the branch table
    env["NVIDIA_REQUIRE_CUDA"] = "cuda>=13.2"
    with pytest.raises(Refused, match="cuda 13.1"):
        edits.compute_edits(disc, env, compat=found)


@needs("gcc", "objcopy")
def test_note_cuda_version_is_the_one_judged(tmp_path, disc):
    found = compat.find(image(tmp_path, "590.44.01", {"CUDA Version": "13.2", "Driver": [580]}))
    assert found.cuda == "13.2"
    assert edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_CUDA": "cuda>=13.2"},
                               compat=found) is not None


@needs("gcc")
@pytest.mark.parametrize("model,used", [("NVIDIA H200", True), ("NVIDIA A100-SXM4-80GB", True),
                                        ("Tesla T4", True), ("NVIDIA RTX PRO 6000 Blackwell Server Edition", True),
                                        ("NVIDIA GeForce RTX 4090", False), ("NVIDIA TITAN RTX", False),
                                        ("Quadro RTX 6000", False), ("NVIDIA RTX A6000", False), (None, False)])
def test_only_data_centre_gpus(tmp_path, disc, model, used):
    found = compat.find(image(tmp_path, "590.44.01"))
    d = replace(disc, gpus=tuple(replace(g, model=model) for g in disc.gpus))
    assert libcuda_source(edits.compute_edits(d, {"NVIDIA_VISIBLE_DEVICES": "all"}, compat=found)).startswith(
        ROOT) != used


@needs("gcc")
def test_no_gpu_or_no_compute_gets_the_hosts(tmp_path, disc):
    found = compat.find(image(tmp_path, "590.44.01"))
    assert libcuda_source(edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "none"}, compat=found)).startswith(ROOT)
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "utility"},
                            compat=found)
    assert not any("compat" in m.source for m in e.mounts)


@needs("gcc")
def test_what_the_image_could_plant_is_not_taken(tmp_path):
    rootfs = tmp_path / "rootfs"
    d = rootfs / "usr/local/cuda/compat"
    d.mkdir(parents=True)
    os.symlink("/usr/lib/x86_64-linux-gnu/libc.so.6", d / "libcuda.so.590.44.01")  # a link out: not a file of its own
    assert compat.find(str(rootfs)) is None
    (d / "libcuda.so.590.44.01").unlink()
    build_lib(d / "libcuda.so.590.44.01")
    build_lib(d / "libcuda.so.595.10.01")  # two: NVIDIA's hook uses none, so does this
    assert compat.find(str(rootfs)) is None
    (d / "libcuda.so.595.10.01").unlink()
    os.symlink("/etc/passwd", d / "libnvidia-nvvm.so.590.44.01")
    assert set(compat.find(str(rootfs)).files) == {"libcuda"}
    # the compat directory a link to an absolute path: resolved inside the image, never on the host
    other = tmp_path / "rootfs2"
    (other / "opt/c").mkdir(parents=True)
    build_lib(other / "opt/c/libcuda.so.590.44.01")
    (other / "usr/local/cuda").mkdir(parents=True)
    os.symlink("/opt/c", other / "usr/local/cuda/compat")
    assert compat.find(str(other)).files["libcuda"] == "/usr/local/cuda/compat/libcuda.so.590.44.01"
    assert compat.fwd_note(str(other / "opt/c/libcuda.so.590.44.01")) is None  # no note
    (other / "junk.so").write_bytes(b"\x7fELF\x02\x01" + b"\xff" * 58)
    assert compat.fwd_note(str(other / "junk.so")) is None
