"""A fake driver host built from the H200 capture: same file names (tiny contents), real /proc text, and real
character device nodes (mknod) with the capture's numbers."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import H200

NODES = {"nvidiactl": (195, 255), "nvidia0": (195, 0), "nvidia-uvm": (238, 0), "nvidia-uvm-tools": (238, 1)}


def fake_dev(base: Path) -> Path:
    dev = base / "devroot"
    (dev / "dev").mkdir(parents=True, exist_ok=True)
    for name, (ma, mi) in NODES.items():
        p = dev / "dev" / name
        if not p.exists():
            os.mknod(p, 0o666 | 0o020000, os.makedev(ma, mi))
    return dev


def settings_dict(base: Path) -> dict:
    """runtime.json's keys for the fake H200 host under `base` (the file's form)."""
    return {"runc": "/usr/sbin/runc", "driver_root": str(H200 / "usr/local/nvidia"), "dev_root": str(fake_dev(base)),
            "proc_root": str(H200), "cache": str(base / "discovery.json"), "accept_env_unprivileged": True}


def driver_root_with_smi(base: Path) -> Path:
    """A copy of the fake H200 driver root whose bin/nvidia-smi answers queries from the host's capture
    (tests/fake_nvidia_smi.py): what discovery asks the driver for each GPU's compute capability."""
    import shutil
    import sys

    root = base / "driver-root"
    if not root.exists():
        shutil.copytree(H200 / "usr/local/nvidia", root, symlinks=True)
        smi = root / "bin/nvidia-smi"
        smi.unlink()
        smi.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S {Path(__file__).parent / "fake_nvidia_smi.py"} "$@"\n')
        smi.chmod(0o755)
    return root


def settings(base: Path, **over):
    """The typed Settings the runtime reads from that file (checked as the file is)."""
    from provision.inject.settings import Settings

    return Settings.from_dict({**settings_dict(base), **over}, str(base / "runtime.json"))


def write_settings(base: Path, **over) -> Path:
    p = base / "runtime.json"
    p.write_text(json.dumps({**settings_dict(base), **over}))
    return p


# --- the runtime's front-ends, run as an engine runs them (tests/faults/test_runtime_*.py, test_runtime_frontends) ---

def fake_runc(base: Path) -> Path:
    """A stand-in for runc that records each call (one line of argv): the front-end's hand-over is what is tested."""
    p = base / "runc-calls"
    exe = base / "fake-runc"
    exe.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {p}\n')
    exe.chmod(0o755)
    return exe


def runc_calls(base: Path) -> list[str]:
    p = base / "runc-calls"
    return p.read_text().splitlines() if p.exists() else []


def compiled_front_end(base: Path, runc: str) -> Path:
    """gpuprov-runtime as `runtime install` makes it (shim.c compiled, slots patched): this Python, this checkout."""
    import sys

    from provision.inject.install import front_end

    data, origin, notes = front_end(runc, sys.executable)
    assert data is not None, notes
    exe = base / "gpuprov-runtime"
    exe.write_bytes(data)
    exe.chmod(0o755)
    return exe


def python_front_end(base: Path) -> Path:
    import sys

    from provision.inject.install import python_fallback

    exe = base / "gpuprov-runtime.py"
    exe.write_bytes(python_fallback(sys.executable))
    exe.chmod(0o755)
    return exe


def gpu_bundle(base: Path, name: str, env: list[str] | None = None) -> Path:
    """An OCI bundle asking for every GPU (Debian-like rootfs), as dockerd writes it for `-e NVIDIA_VISIBLE_DEVICES`."""
    b = base / name
    for d in ("usr/lib", "usr/bin", "etc", "dev"):
        (b / "rootfs" / d).mkdir(parents=True, exist_ok=True)
    (b / "rootfs/etc/debian_version").write_text("12.0\n")
    cfg = {"root": {"path": "rootfs"}, "process": {"env": ["PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=all",
                                                           *(env or [])],
                                                   "capabilities": {"bounding": ["CAP_CHOWN"]}},
           "mounts": [], "linux": {}}
    (b / "config.json").write_text(json.dumps(cfg))
    return b


def edited(bundle: Path) -> bool:
    """The GPU edits are in: device nodes and the driver's libraries."""
    cfg = json.loads((bundle / "config.json").read_text())
    devs = {d["path"] for d in cfg.get("linux", {}).get("devices", [])}
    return "/dev/nvidia0" in devs and any(m["destination"].endswith("libcuda.so.1") for m in cfg.get("mounts", []))


def editor_pid(runtime_json: Path) -> int | None:
    """The warm editor serving this settings file (its lock names it), if it is alive."""
    try:
        pid = int((Path(f"{runtime_json}.sock.lock")).read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    return pid


def editors_for(runtime_json: Path) -> list[int]:
    """Every live process whose environment names this settings file and runs the editor (servers included)."""
    needle = f"GPUPROV_RUNTIME_CONFIG={runtime_json}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            cmd = (d / "cmdline").read_bytes()
            state = (d / "stat").read_text().rsplit(") ", 1)[1][0]
        except (OSError, IndexError):
            continue
        if needle in env and b"modify_main.py" in cmd and state != "Z":
            pids.append(int(d.name))
    return pids


def stop_editors(runtime_json: Path) -> None:
    import signal

    for pid in editors_for(runtime_json):
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# --- MIG: the h100-mig fixture (a real H100 capture, MIG disabled) with its instances, and their caps nodes ---
MIG_FIXTURE = H200.parent / "h100-mig"
MIG_GIS = (2, 3, 9, 10)  # the fixture's GPU instances (one compute instance 0 each)


def mig_proc(base: Path) -> str:
    """A proc root: the H100's proc/ with the fixture's instances on top (the same host once GPU instances exist)."""
    import shutil

    shutil.copytree(MIG_FIXTURE / "proc", base / "proc", symlinks=True)
    shutil.copytree(MIG_FIXTURE / "instances/proc", base / "proc", dirs_exist_ok=True)
    return str(base)


def mig_caps_nodes(dev_root: Path) -> None:
    """/dev/nvidia-caps/nvidia-cap<minor> (nvidia-caps major 241, as on the H100) for every instance's GI and CI."""
    caps = dev_root / "dev/nvidia-caps"
    caps.mkdir(parents=True, exist_ok=True)
    for gi in MIG_GIS:
        for minor in (3 + 9 * gi, 4 + 9 * gi):
            if not (caps / f"nvidia-cap{minor}").exists():
                os.mknod(caps / f"nvidia-cap{minor}", 0o444 | 0o020000, os.makedev(241, minor))


def runc_image(base: Path) -> tuple[Path, Path]:
    """(rootfs, runc): gpuprov's check image unpacked at base/rootfs (busybox + glibc), and a runc that keeps its
    state under base (nothing on this machine's runc root is touched), for tests that run real containers."""
    import io
    import tarfile

    from provision.engines.validate import build_image_tar

    rootfs = base / "rootfs"
    with tarfile.open(fileobj=io.BytesIO(build_image_tar()), mode="r") as tar:
        tar.extractall(rootfs, filter="tar")
    runc = base / "runc"
    runc.write_text(f'#!/bin/sh\nexec runc --root {base / "runc-state"} "$@"\n')
    runc.chmod(0o755)
    return rootfs, runc
