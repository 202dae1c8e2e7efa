"""Attacks on the injection runtime, each reproduced (REFERENCE.md §6)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from provision.inject import discover, modify
from provision.inject.edits import Refused
from tests.inject_helpers import fake_dev, settings, settings_dict

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod")


def rootfs(tmp_path: Path) -> Path:
    r = tmp_path / "bundle" / "rootfs"
    for d in ("usr/lib", "usr/bin", "etc", "dev"):
        (r / d).mkdir(parents=True, exist_ok=True)
    (r / "etc/debian_version").write_text("12.0\n")
    return r


def config(env: list[str], **extra) -> dict:
    return {"root": {"path": "rootfs"}, "process": {"env": ["PATH=/usr/bin:/bin", *env],
                                                   "capabilities": {"bounding": ["CAP_CHOWN"]}},
            "mounts": [], "linux": {}, **extra}


def run_modify(tmp_path, cfg, **over):
    s = settings(tmp_path, **over)
    modify.modify_config(cfg, str(tmp_path / "bundle"), s)
    return cfg


def test_symlinked_libdir_points_to_host_path(tmp_path):
    r = rootfs(tmp_path)
    host_target = tmp_path / "host-secret-dir"
    host_target.mkdir()
    os.symlink(str(host_target), r / "usr/lib/x86_64-linux-gnu")  # absolute link to a *host* path
    os.symlink("../../../../../../../../etc", r / "usr/bin/nvidia-smi")  # `..` can't climb out either
    cfg = run_modify(tmp_path, config(["NVIDIA_VISIBLE_DEVICES=all"]))
    dests = [m["destination"] for m in cfg["mounts"]]
    # resolved inside the container: the host path string is reinterpreted under rootfs
    assert f"{host_target}/libcuda.so.1" in dests
    assert "/etc" in dests and "/usr/bin/nvidia-smi" not in dests
    for d in dests:  # no destination goes through a symlink any more: runc gets plain paths
        parts = Path(d).parts
        for i in range(1, len(parts) + 1):
            p = r.joinpath(*parts[1:i])
            assert not p.is_symlink(), d
    assert list(host_target.iterdir()) == []  # and nothing was created on the host


def test_sources_never_from_the_image(tmp_path):
    r = rootfs(tmp_path)
    s = settings(tmp_path)
    disc = modify.load_discovery(s)
    lib = disc.libraries["compute"][0]
    inside = r / "compat-libcuda.so"  # e.g. a CUDA compat library shipped in the image
    inside.write_text("image-controlled")
    link = tmp_path / "link-to-lib.so"
    os.symlink(lib.path, link)
    evil = (discover.Library("libcuda", str(inside), "libcuda-evil.so.1"), discover.Library("x", str(link), "libx.so.1"))
    libs = {**disc.libraries, "compute": disc.libraries["compute"] + evil}
    with open(s.cache, "w") as fh:  # the cache the runtime reads
        fh.write(replace(disc, libraries=libs, key=discover.host_key(str(tmp_path / "noproc"), disc.watch)).to_json())
    cfg = run_modify(tmp_path, config(["NVIDIA_VISIBLE_DEVICES=all"]), proc_root=str(tmp_path / "noproc"))
    srcs = [m["source"] for m in cfg["mounts"]]
    assert str(inside) not in srcs and str(link) not in srcs
    assert lib.path in srcs


def test_device_node_must_match_major_minor(tmp_path):
    rootfs(tmp_path)
    dev = fake_dev(tmp_path)
    os.unlink(dev / "dev/nvidia0")
    os.mknod(dev / "dev/nvidia0", 0o666 | 0o020000, os.makedev(1, 3))  # /dev/null's numbers
    with pytest.raises(Refused, match="not the expected character device 195:0"):
        run_modify(tmp_path, config(["NVIDIA_VISIBLE_DEVICES=0"]))


def test_unprivileged_env_ignored_when_policy_off(tmp_path):
    rootfs(tmp_path)
    cfg = run_modify(tmp_path, config(["NVIDIA_VISIBLE_DEVICES=all"]), accept_env_unprivileged=False)
    assert cfg["mounts"] == [] and "devices" not in cfg["linux"]
    listed = config(["NVIDIA_VISIBLE_DEVICES=all"])
    listed["mounts"] = [{"destination": "/var/run/nvidia-container-devices/0", "source": "/dev/null",
                         "type": "bind", "options": ["bind"]}]
    cfg = run_modify(tmp_path, listed, accept_env_unprivileged=False)
    assert [d["path"] for d in cfg["linux"]["devices"]][-1] == "/dev/nvidia0"
    priv = config(["NVIDIA_VISIBLE_DEVICES=all"])
    priv["process"]["capabilities"]["bounding"].append("CAP_SYS_ADMIN")
    assert run_modify(tmp_path, priv, accept_env_unprivileged=False)["mounts"]


def test_no_hooks_added_and_gpus_hook_removed(tmp_path):
    rootfs(tmp_path)
    hook = tmp_path / "nvidia-container-runtime-hook"
    shutil.copy(Path(modify.__file__).with_name("hook.sh"), hook)
    cfg = config(["NVIDIA_VISIBLE_DEVICES=all", "LD_PRELOAD=/evil.so"],
                 hooks={"prestart": [{"path": str(hook), "args": ["nvidia-container-runtime-hook", "prestart"]}]})
    run_modify(tmp_path, cfg)
    assert cfg["hooks"]["prestart"] == [] and cfg["mounts"]


def test_nvidia_toolkit_hook_left_alone(tmp_path):
    rootfs(tmp_path)
    theirs = tmp_path / "usr/bin/nvidia-container-runtime-hook"
    theirs.parent.mkdir(parents=True)
    theirs.write_text("#!/bin/sh\n# NVIDIA's hook\n")
    cfg = config(["NVIDIA_VISIBLE_DEVICES=all"], hooks={"prestart": [{"path": str(theirs)}]})
    run_modify(tmp_path, cfg)
    assert cfg["hooks"]["prestart"] == [{"path": str(theirs)}] and cfg["mounts"] == []


@pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler")
def test_ld_preload_from_image_reaches_no_privileged_step(tmp_path):
    """The image's LD_PRELOAD names a library that, if ever loaded by the shim or its editor, leaves a marker."""
    from tests.inject_helpers import compiled_front_end, stop_editors

    marker = tmp_path / "PWNED"
    evil_c = tmp_path / "evil.c"
    evil_c.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void f(void) '
                      f'{{ FILE *fp = fopen("{marker}", "w"); if (fp) fclose(fp); }}\n')
    evil = tmp_path / "evil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(evil), str(evil_c)], check=True)
    shim = compiled_front_end(tmp_path, "/bin/true")
    rootfs(tmp_path)
    bundle = tmp_path / "bundle"
    (bundle / "config.json").write_text(json.dumps(config(["NVIDIA_VISIBLE_DEVICES=all", f"LD_PRELOAD={evil}",
                                                           f"LD_LIBRARY_PATH={tmp_path}"])))
    sp = tmp_path / "runtime.json"
    sp.write_text(json.dumps(settings_dict(tmp_path)))
    r = subprocess.run([str(shim), "create", "--bundle", str(bundle), "x"], capture_output=True, text=True,
                       env={"PATH": os.environ["PATH"], "GPUPROV_RUNTIME_CONFIG": str(sp)})
    stop_editors(sp)
    assert r.returncode == 0, r.stderr
    out = json.loads((bundle / "config.json").read_text())
    assert out["mounts"] and not out.get("hooks")  # edited, and no hook was added
    assert not marker.exists()


def test_graphics_manifests_stay_inside_the_image_and_come_from_the_driver_root(tmp_path):
    """Loader manifests (graphics) obey the same rules: an image whose /usr/share/vulkan is a link to a host path,
    or whose glvnd directory climbs with `..`, still gets them inside itself; their sources are the driver root's."""
    r = rootfs(tmp_path)
    host_target = tmp_path / "host-vulkan"
    host_target.mkdir()
    (r / "usr/share").mkdir(parents=True)
    os.symlink(str(host_target), r / "usr/share/vulkan")
    os.symlink("../../../../../../../etc", r / "usr/share/glvnd")
    cfg = run_modify(tmp_path, config(["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=graphics"]))
    by_dest = {m["destination"]: m["source"] for m in cfg["mounts"]}
    assert f"{host_target}/icd.d/nvidia_icd.json" in by_dest  # reinterpreted under rootfs, not the host's dir
    assert "/etc/egl_vendor.d/10_nvidia.json" in by_dest
    assert list(host_target.iterdir()) == []
    root = settings(tmp_path).driver_root
    assert all(src.startswith(root + "/") for src in by_dest.values()), by_dest


def test_persistenced_socket_is_mounted_when_it_exists(tmp_path):
    """nvidia-persistenced's socket on the host reaches `utility` containers (it used to be discovered, then dropped
    as "not a regular file"); a symlink standing in for it is still never bound."""
    import socket

    rootfs(tmp_path)
    run_dir = Path(fake_dev(tmp_path)) / "var/run/nvidia-persistenced"
    run_dir.mkdir(parents=True)
    cwd = os.getcwd()
    os.chdir(run_dir)  # a relative bind: unix socket paths are limited to 108 bytes
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind("socket")
    finally:
        os.chdir(cwd)
    try:
        cfg = run_modify(tmp_path, config(["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=utility"]))
    finally:
        sock.close()
    mounts = {m["destination"]: m for m in cfg["mounts"]}
    m = mounts["/var/run/nvidia-persistenced/socket"]
    assert m["source"] == str(run_dir / "socket") and "nosuid" in m["options"]
    os.unlink(run_dir / "socket")
    os.symlink("/etc/shadow", run_dir / "socket")
    (tmp_path / "discovery.json").unlink(missing_ok=True)
    cfg = run_modify(tmp_path, config(["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=utility"]))
    assert "/var/run/nvidia-persistenced/socket" not in {m["destination"] for m in cfg["mounts"]}
