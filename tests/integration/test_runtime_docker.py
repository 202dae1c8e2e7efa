"""The injection runtime through the real Docker engine (no GPU here: a fake driver root built from the H200
capture, real mknod device nodes). Registered with `gpuprov engine configure docker`."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import needs, run_cli
from tests.inject_helpers import settings

pytestmark = [pytest.mark.integration, needs("runc", docker=True)]
DAEMON = Path("/etc/docker/daemon.json")
SETTINGS = Path("/etc/gpuprov/runtime.json")


def docker(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpuhost")
    saved = {p: p.read_bytes() if p.exists() else None for p in (DAEMON, SETTINGS)}
    s = settings(base)
    r = run_cli("runtime", "install", "--prefix", "/usr/local", "--driver-root", s["driver_root"], "--dev-root",
                s["dev_root"], "--proc-root", s["proc_root"], "--json")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(SETTINGS.read_text())
    cfg["cache"] = str(base / "discovery.json")
    SETTINGS.write_text(json.dumps(cfg))
    r = run_cli("engine", "configure", "docker", "--runtime-path", "/usr/local/bin/gpuprov-runtime", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["verified"] is True
    from provision.plan.validate import IMAGE, ensure_image

    ensure_image()
    yield IMAGE
    for p, data in saved.items():
        if data is None:
            p.unlink(missing_ok=True)
        else:
            p.write_bytes(data)
    pid = int(Path("/var/run/docker.pid").read_text())
    os.kill(pid, signal.SIGHUP)


def test_runtime_listed_by_docker_info(registered):
    assert "nvidia" in json.loads(docker("info", "--format", "{{json .Runtimes}}").stdout)


def test_gpu_container_gets_files_and_nodes(registered):
    out = docker("run", "--rm", "--runtime", "nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=all", registered, "sh", "-c",
                 "ls /dev; cat /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/bin/nvidia-smi; cat /proc/mounts; "
                 "echo NVD=$NVIDIA_VISIBLE_DEVICES").stdout
    for node in ("nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools"):
        assert node in out.split(), out
    assert "fake libcuda.so.580.159.04" in out and "fake nvidia-smi" in out
    lib_line = next(ln for ln in out.splitlines() if "/usr/lib/x86_64-linux-gnu/libcuda.so.1" in ln)
    assert " ro," in lib_line and "nosuid" in lib_line and "nodev" in lib_line
    assert "NVD=GPU-266c8396-dfbe-13b3-5ad6-311117e6bd98" in out


def test_void_gets_nothing(registered):
    out = docker("run", "--rm", "--runtime", "nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=void", registered, "sh", "-c",
                 "ls /dev; cat /proc/mounts").stdout
    assert "nvidia" not in out


def test_plain_container_untouched(registered):
    out = docker("run", "--rm", registered, "sh", "-c", "ls /dev; cat /proc/mounts").stdout
    assert "nvidia" not in out
    out = docker("run", "--rm", "--runtime", "nvidia", registered, "sh", "-c", "ls /dev; cat /proc/mounts").stdout
    assert "nvidia" not in out


def test_gpus_flag_through_runtime(registered):
    """`--gpus all`: dockerd adds the prestart hook it finds on PATH (ours); the runtime removes it and injects."""
    assert shutil.which("nvidia-container-runtime-hook", path="/usr/local/bin:/usr/bin")
    r = docker("run", "--rm", "--runtime", "nvidia", "--gpus", "all", registered, "sh", "-c", "ls /dev", check=False)
    assert r.returncode == 0, r.stderr
    assert "nvidia0" in r.stdout.split()


def test_gpus_flag_without_runtime_explains(registered):
    r = docker("run", "--rm", "--gpus", "all", registered, "true", check=False)
    assert r.returncode != 0 and "--runtime nvidia" in r.stderr


def test_unsatisfied_requirement_refuses_start(registered):
    r = docker("run", "--rm", "--runtime", "nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=all", "-e",
               "NVIDIA_REQUIRE_CUDA=cuda>=13.1", registered, "true", check=False)
    assert r.returncode != 0 and "NVIDIA_REQUIRE_CUDA" in r.stderr and "cuda 13.0" in r.stderr


def test_docker_args_fallback(registered):
    r = run_cli("docker-args", "--gpus", "0", "--driver-root", json.loads(SETTINGS.read_text())["driver_root"])
    assert r.returncode == 0, r.stderr
    assert "--device=/dev/nvidiactl" in r.stdout and ":/usr/bin/nvidia-smi:ro" in r.stdout
