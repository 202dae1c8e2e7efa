"""The injection runtime through a real Docker engine, on a bare Debian 12 server: a systemd host container with no
compiler and no pip, where `./install.sh --yes` (from the wheelhouse built on this machine, as an offline host gets
it) installs gpuprov, docker.io and the runtime. Everything happens inside that host: the test machine's own
gpuprov, /etc/gpuprov, daemon.json and dockerd are never touched (tests/conftest.py checks that after every run).

No GPU here: after the install, the runtime is pointed at a fake driver root built from the H200 capture (real
mknod device nodes inside the host), then containers are started with `docker run` as users start them."""
from __future__ import annotations

import json
import shlex
import subprocess
import time

import pytest

from provision.engines import validate
from tests.conftest import needs
from tests.integration.hosts import Host

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
FIXTURE = "/src/tests/fixtures/hosts/h200-vm"
FAKE_DEV = "/opt/fake-gpu"
NODES = {"nvidiactl": (195, 255), "nvidia0": (195, 0), "nvidia-uvm": (238, 0), "nvidia-uvm-tools": (238, 1)}
IMAGE = validate.IMAGE  # built by bootstrap's validation step from the host's own files


@pytest.fixture(scope="module")
def host():
    h = Host(systemd=True)
    try:
        yield h
    finally:
        h.remove()


@pytest.fixture(scope="module")
def installed(host):
    """`./install.sh --yes` on the bare server; returns `gpuprov runtime install --json` for the fake GPU host."""
    bare = host.exec("for t in gcc cc c99 clang tcc pip pip3 gpuprov; do command -v $t; done")
    assert bare.stdout == "", f"not a bare host: {bare.stdout}"
    assert host.exec("python3 -m pip --version").returncode != 0
    r = host.exec("cd /src && GPUPROV_WHEELHOUSE=/wh ./install.sh --yes", timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert host.exec("systemctl is-active docker").stdout.strip() == "active"
    assert host.exec("command -v gcc cc").stdout == "", "the install brought a compiler along"
    mk = " && ".join(f"mknod -m 666 {FAKE_DEV}/dev/{n} c {a} {b}" for n, (a, b) in NODES.items())
    host.exec(f"mkdir -p {FAKE_DEV}/dev && {mk}", check=True)
    r = host.exec(f"gpuprov runtime install --driver-root {FIXTURE}/usr/local/nvidia --dev-root {FAKE_DEV} "
                  f"--proc-root {FIXTURE} --json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def docker(host: Host, *args: str):
    return host.exec("docker " + " ".join(shlex.quote(a) for a in args), timeout=300)


def test_bare_server_gets_the_compiled_front_end(host, installed):
    assert installed["front_end"] == "compiled" and installed["front_end_origin"] == "wheel", installed
    assert host.exec("head -c 4 /usr/local/bin/gpuprov-runtime | od -c | head -1").stdout.split()[1:5] == \
        ["177", "E", "L", "F"]
    assert "compiled front-end" in host.exec("/usr/local/bin/gpuprov-runtime --gpuprov-front-end").stdout


def test_runtime_listed_by_docker_info(host, installed):
    assert "nvidia" in json.loads(docker(host, "info", "--format", "{{json .Runtimes}}").stdout)


def test_gpu_container_gets_files_and_nodes(host, installed):
    r = docker(host, "run", "--rm", "--runtime", "nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=all", IMAGE, "sh", "-c",
               "ls /dev; cat /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/bin/nvidia-smi; cat /proc/mounts; "
               "echo NVD=$NVIDIA_VISIBLE_DEVICES")
    out = r.stdout
    assert r.returncode == 0, r.stderr
    for node in NODES:
        assert node in out.split(), out
    assert "fake libcuda.so.580.159.04" in out and "fake nvidia-smi" in out
    lib_line = next(ln for ln in out.splitlines() if "/usr/lib/x86_64-linux-gnu/libcuda.so.1" in ln)
    assert " ro," in lib_line and "nosuid" in lib_line and "nodev" in lib_line
    assert "NVD=GPU-266c8396-dfbe-13b3-5ad6-311117e6bd98" in out
    assert host.exec("test -S /run/gpuprov/runtime-editor.sock && stat -c %a:%U /run/gpuprov/runtime-editor.sock"
                     ).stdout.strip() == "600:root", "the warm editor serves from a root-only socket"


def test_void_gets_nothing(host, installed):
    out = docker(host, "run", "--rm", "--runtime", "nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=void", IMAGE, "sh", "-c",
                 "ls /dev; cat /proc/mounts").stdout
    assert "nvidia" not in out


def test_plain_container_untouched(host, installed):
    """Whatever the default runtime (bootstrap makes it `nvidia`), a container asking for no GPU gets nothing."""
    for extra in ([], ["--runtime", "runc"], ["--runtime", "nvidia"]):
        r = docker(host, "run", "--rm", *extra, IMAGE, "sh", "-c", "ls /dev; cat /proc/mounts")
        assert r.returncode == 0 and "nvidia" not in r.stdout, (extra, r.stdout, r.stderr)


def test_gpus_flag_through_runtime(host, installed):
    """`--gpus all`: dockerd adds the prestart hook it finds on PATH (ours); the runtime removes it and injects."""
    assert host.exec("command -v nvidia-container-runtime-hook").stdout.strip() == \
        "/usr/local/bin/nvidia-container-runtime-hook"
    r = docker(host, "run", "--rm", "--runtime", "nvidia", "--gpus", "all", IMAGE, "sh", "-c", "ls /dev")
    assert r.returncode == 0, r.stderr
    assert "nvidia0" in r.stdout.split()


def test_gpus_flag_without_runtime_explains(host, installed):
    r = docker(host, "run", "--rm", "--runtime", "runc", "--gpus", "all", IMAGE, "true")
    assert r.returncode != 0 and "--runtime nvidia" in r.stderr


def test_refusal_reaches_docker_run_in_one_line(host, installed):
    """containerd passes runc `--log …/log.json --log-format json`; the front-end writes its reason there, so
    `docker run` shows gpuprov's sentence instead of `unable to retrieve OCI runtime error`."""
    r = docker(host, "run", "--rm", "--runtime", "nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=all", "-e",
               "NVIDIA_REQUIRE_CUDA=cuda>=13.1", IMAGE, "true")
    assert r.returncode != 0
    assert "gpuprov-runtime: NVIDIA_REQUIRE_CUDA='cuda>=13.1' is not satisfied by this host (cuda 13.0" in r.stderr
    assert "unable to retrieve OCI runtime error" not in r.stderr, r.stderr


MIG_PROC = "/opt/fake-mig-proc"


def test_mig_instance_gets_exactly_its_nodes(host, installed):
    """A MIG layout (tests/fixtures/hosts/h100-mig: the H100 capture's proc with instances; caps nodes by mknod): through
    dockerd and runc, `0:9:0` (env) and `--gpus device=0:2:0` each get the parent GPU's node, nvidiactl, the uvm nodes
    and exactly their instance's two nvidia-caps nodes; a missing instance is refused in one line naming those that
    exist. The runtime is pointed back at the plain capture afterwards. Fails before mig.py (all MIG refused)."""
    caps = " && ".join(f"mknod -m 444 {FAKE_DEV}/dev/nvidia-caps/nvidia-cap{m} c 241 {m}"
                       for gi in (2, 3, 9, 10) for m in (3 + 9 * gi, 4 + 9 * gi))
    mig_fix = "/src/tests/fixtures/hosts/h100-mig"
    host.exec(f"rm -rf {MIG_PROC} {FAKE_DEV}/dev/nvidia-caps && mkdir -p {MIG_PROC} {FAKE_DEV}/dev/nvidia-caps && "
              f"cp -a {mig_fix}/proc {MIG_PROC}/ && cp -a {mig_fix}/instances/proc {MIG_PROC}/ && {caps}", check=True)
    install = f"gpuprov runtime install --driver-root {FIXTURE}/usr/local/nvidia --dev-root {FAKE_DEV} --proc-root "
    try:
        r = host.exec(install + MIG_PROC + " --json")
        assert r.returncode == 0, r.stderr
        assert "0:9:0" in host.exec("gpuprov runtime discover").stdout
        want = {"nvidia-cap84", "nvidia-cap85"}
        for args in (["-e", "NVIDIA_VISIBLE_DEVICES=0:9:0"], ["--gpus", "device=0:9:0"]):
            r = docker(host, "run", "--rm", "--runtime", "nvidia", *args, IMAGE, "sh", "-c",
                       "ls /dev; echo caps: $(ls /dev/nvidia-caps); echo NVD=$NVIDIA_VISIBLE_DEVICES")
            assert r.returncode == 0, (args, r.stderr)
            caps_seen = set(next(ln for ln in r.stdout.splitlines() if ln.startswith("caps:")).split()[1:])
            assert caps_seen == want, (args, r.stdout)
            assert {"nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"} <= set(r.stdout.split())
            assert "NVD=0:9:0" in r.stdout
        r = docker(host, "run", "--rm", "--runtime", "nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=0:4:0", IMAGE, "true")
        assert r.returncode != 0 and "MIG device '0:4:0', which does not exist; this host has: 0:2:0" in r.stderr, \
            r.stderr
    finally:
        host.exec(install + FIXTURE + " --json", check=True)


def test_python_front_end_refusal_reaches_docker_run(host, installed):
    """The Python fallback (hosts where no compiled front-end runs) parses runc's options the same way: before, it
    stopped at `--root`'s value, never saw `--log`, and users read `unable to retrieve OCI runtime error`."""
    host.exec("/opt/gpuprov/bin/python -c 'import sys; from provision.inject.install import python_fallback; "
              "open(\"/usr/local/bin/gpuprov-runtime-py\", \"wb\").write(python_fallback(sys.executable))' && "
              "chmod 755 /usr/local/bin/gpuprov-runtime-py", check=True)
    r = host.exec("gpuprov engine configure docker --runtime-name gpuprov-py "
                  "--runtime-path /usr/local/bin/gpuprov-runtime-py --json")
    assert r.returncode == 0, r.stdout + r.stderr
    r = docker(host, "run", "--rm", "--runtime", "gpuprov-py", "-e", "NVIDIA_VISIBLE_DEVICES=all", "-e",
               "NVIDIA_REQUIRE_CUDA=cuda>=13.1", IMAGE, "true")
    assert r.returncode != 0
    assert "gpuprov-runtime: NVIDIA_REQUIRE_CUDA='cuda>=13.1' is not satisfied" in r.stderr, r.stderr
    r = docker(host, "run", "--rm", "--runtime", "gpuprov-py", "-e", "NVIDIA_VISIBLE_DEVICES=all", IMAGE, "ls", "/dev")
    assert r.returncode == 0 and "nvidia0" in r.stdout.split(), r.stderr


def test_docker_args_fallback(host, installed):
    r = host.exec(f"gpuprov docker-args --gpus 0 --driver-root {FIXTURE}/usr/local/nvidia")
    assert r.returncode == 0, r.stderr
    assert "--device=/dev/nvidiactl" in r.stdout and ":/usr/bin/nvidia-smi:ro" in r.stdout


def test_mps_share_under_systemd_restarts_and_follows(host, installed):
    """`gpuprov share` on a systemd server, with stand-ins for nvidia-smi and nvidia-cuda-mps-control (no GPU here:
    tests/fake_mps.py, serving the H200 capture's GPU): the daemon runs under gpuprov-mps.service; killed, systemd
    restarts it and the unit's ExecStartPost (`share follow`) gives the new daemon the ceiling and points the state
    at it. A container on the shared GPU gets the MPS settings while a daemon runs, and is refused in one line while
    none does (issue 19, item 6)."""
    from tests.fake_mps import files

    fake = "/opt/fake-mps/bin"
    for name, text in files(1, python="/opt/gpuprov/bin/python", repo="/src").items():
        host.write(f"{fake}/{name}", text)
    host.exec(f"chmod 755 {fake}/nvidia-smi {fake}/nvidia-cuda-mps-control", check=True)

    def calls() -> list[str]:
        return json.loads(host.read(f"{fake}/fake.json"))["calls"]

    def mps_env() -> subprocess.CompletedProcess:
        return docker(host, "run", "--rm", "--runtime", "nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=0", IMAGE, "sh",
                      "-c", 'echo "pipe=$CUDA_MPS_PIPE_DIRECTORY limit=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"')  # sh builtins only

    r = host.exec(f"PATH={fake}:$PATH gpuprov share enable --max-memory 2G --json")
    assert r.returncode == 0, r.stdout + r.stderr
    first = json.loads(r.stdout)
    assert first["supervisor"] == "systemd (gpuprov-mps.service)", first
    assert json.loads(host.read(f"{fake}/fake.json"))["gpus"][0]["mode"] == "Exclusive_Process"
    r = mps_env()
    # asked for no limit: no per-container one, the daemon's 2G ceiling holds it
    assert r.returncode == 0 and r.stdout == "pipe=/run/gpuprov/mps limit=\n", r.stdout + r.stderr

    host.exec(f"kill -9 {first['daemon_pid']}", check=True)
    state = first
    active = ""
    for _ in range(120):  # systemd's RestartSec=2, then ExecStartPost (the unit is active once it ends); a bound
        state = json.loads(host.read("/run/gpuprov/share.json"))
        active = host.exec("systemctl is-active gpuprov-mps").stdout.strip()
        if state["daemon_pid"] != first["daemon_pid"] and active == "active":
            break
        time.sleep(0.5)
    assert state["daemon_pid"] != first["daemon_pid"] and active == "active", \
        host.exec("journalctl -u gpuprov-mps --no-pager").stdout
    after = calls()[[i for i, c in enumerate(calls()) if c.startswith("control -d")][-1]:]
    assert "control: set_default_device_pinned_mem_limit 0 2048M" in after and "control: start_server -uid 0" in after
    r = mps_env()  # the state follows the new daemon: containers start again
    assert r.returncode == 0 and r.stdout == "pipe=/run/gpuprov/mps limit=\n", r.stdout + r.stderr

    host.exec("systemctl stop gpuprov-mps", check=True)  # a stop is no failure: no restart, the state stays
    r = mps_env()
    assert r.returncode != 0 and "no longer running: run `gpuprov share disable` then `gpuprov share enable`" \
        in r.stderr, r.stderr
    r = host.exec("gpuprov share disable --json")
    assert r.returncode == 0, r.stderr
    assert json.loads(host.read(f"{fake}/fake.json"))["gpus"][0]["mode"] == "Default"
    r = mps_env()
    assert r.returncode == 0 and r.stdout == "pipe= limit=\n", r.stdout + r.stderr  # sharing off: plain again
