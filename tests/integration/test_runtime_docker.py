"""The injection runtime through a real Docker engine, on a bare Debian 12 server: a systemd host container with no
compiler and no pip, where `./install.sh --yes` (from the wheelhouse built on this machine, as an offline host gets
it) installs gpuprov, docker.io and the runtime. Everything happens inside that host: the test machine's own
gpuprov, /etc/gpuprov, daemon.json and dockerd are never touched (tests/conftest.py checks that after every run).

No GPU here: after the install, the runtime is pointed at a fake driver root built from the H200 capture (real
mknod device nodes inside the host), then containers are started with `docker run` as users start them."""
from __future__ import annotations

import json
import re
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


# ---------------------------------------------------------------- issue 26 item 1: the GPU across daemon-reload
# Nodes with NVIDIA's majors in the host's own /dev (no driver: open() answers ENXIO while the container's device
# cgroup allows the node, EPERM once it denies it; TESTING.md). These hosts run cgroup v1; v2 cannot be had here.
RELOAD_NODES = ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
HAS_ALL = " ".join(f"/dev/{n}" for n in RELOAD_NODES)
# the image has sh and no grep: each node's open() error, parsed here
PROBE = f'for n in {HAS_ALL}; do echo "$n=$( (exec 3<$n) 2>&1)"; done'


def _probe(host: Host, exec_prefix: str) -> dict[str, str]:
    """{node: 'No such device or address' (allowed) | 'Operation not permitted' (denied)} inside a container. An
    exec that answers nothing (seen once in ten runs, right after the start) is tried again; its error is kept."""
    errors = []
    for _ in range(5):
        r = host.exec(f"{exec_prefix} sh -c {shlex.quote(PROBE)}")
        got = {k: v.rsplit(": ", 1)[-1] for k, _, v in (ln.partition("=") for ln in r.stdout.splitlines()) if v}
        if got:
            return got
        errors.append(f"exit {r.returncode}: {r.stderr.strip()}")
        time.sleep(1)
    return {"errors": "; ".join(errors)}


ALLOWED = {f"/dev/{n}": "No such device or address" for n in RELOAD_NODES}
DENIED = {f"/dev/{n}": "Operation not permitted" for n in RELOAD_NODES}


def _across_reload(host: Host, start: str, exec_prefix: str, stop: str) -> tuple[dict, dict]:
    """Start a GPU container, probe its nodes, `systemctl daemon-reload`, probe again."""
    host.exec(start, check=True)
    try:
        before = _probe(host, exec_prefix)
        host.exec("systemctl daemon-reload", check=True)
        time.sleep(1)
        return before, _probe(host, exec_prefix)
    finally:
        host.exec(stop)


@pytest.fixture(scope="module")
def systemd_cgroups(host, installed):
    """Nodes in the host's /dev, the runtime reinstalled for them (`--dev-root /`: its links and boot unit), Docker
    on `native.cgroupdriver=systemd`; every change undone afterwards for the module's other tests."""
    mk = " && ".join(f"mknod -m 666 /dev/{n} c {a} {b}" for n, (a, b) in NODES.items())
    host.exec(f"{mk} && cp /etc/docker/daemon.json /etc/docker/daemon.json.devchar", check=True)
    r = host.exec(f"gpuprov runtime install --driver-root {FIXTURE}/usr/local/nvidia --dev-root / "
                  f"--proc-root {FIXTURE} --json")
    assert r.returncode == 0, r.stdout + r.stderr
    host.exec("/opt/gpuprov/bin/python -c 'import json; p=\"/etc/docker/daemon.json\"; d=json.load(open(p)); "
              "d[\"exec-opts\"]=[\"native.cgroupdriver=systemd\"]; json.dump(d, open(p, \"w\"))' && "
              "systemctl restart docker", check=True, timeout=300)
    # the check image's files plus `sleep`: a Docker image and, unpacked, a rootfs for ctr
    host.exec("/opt/gpuprov/bin/python -c 'import sys; from provision.engines import validate; sys.stdout.buffer."
              "write(validate.build_image_tar(validate.BINARIES + (\"sleep\",)))' > /tmp/devchar.tar && "
              "docker import /tmp/devchar.tar devchar-sleep && mkdir -p /opt/devchar-rootfs && "
              "tar -C /opt/devchar-rootfs -xf /tmp/devchar.tar", check=True, timeout=300)
    assert docker(host, "info", "--format", "{{.CgroupDriver}} {{.CgroupVersion}}").stdout.split() == ["systemd", "1"]
    try:
        yield json.loads(r.stdout)
    finally:
        host.exec("docker rmi devchar-sleep; rm -rf /opt/devchar-rootfs /tmp/devchar.tar; "
                  "mv /etc/docker/daemon.json.devchar /etc/docker/daemon.json && systemctl restart docker; "
                  f"rm -f /dev/char/* {HAS_ALL}; gpuprov runtime install --driver-root {FIXTURE}/usr/local/nvidia "
                  f"--dev-root {FAKE_DEV} --proc-root {FIXTURE}", timeout=300)


DOCKER_RUN = ("docker run -d --name devchar --runtime nvidia -e NVIDIA_VISIBLE_DEVICES=all devchar-sleep sleep 600",
              "docker exec devchar", "docker rm -f devchar")
# containerd's own runc shim with `SystemdCgroup = true` (ctr's --runc-systemd-cgroup), gpuprov's runtime as its runc
CTR = "ctr -n gpuprov"
CTR_RUN = (f"{CTR} run -d --runc-binary /usr/local/bin/gpuprov-runtime --runc-systemd-cgroup "
           "--cgroup system.slice:gpuprov:devchar --env PATH=/usr/bin:/bin --env NVIDIA_VISIBLE_DEVICES=all "
           "--rootfs /opt/devchar-rootfs devchar sleep 600",
           f"{CTR} task exec --exec-id probe$RANDOM devchar",
           f"{CTR} task kill -s KILL devchar; sleep 1; {CTR} task rm -f devchar; {CTR} container rm devchar")


@pytest.mark.parametrize("engine", ["docker", "containerd"])
def test_gpu_survives_daemon_reload_with_dev_char_links(host, systemd_cgroups, engine):
    """Issue 26 item 1 (nvidia-docker#1730, nvidia-container-toolkit#48/#251, gpu-operator#485): under the systemd
    cgroup driver a GPU container keeps its nodes across `systemctl daemon-reload` with the /dev/char links `runtime
    install` made, and loses them without (the control, same host, same runtime). Fails on main: no links."""
    made = systemd_cgroups["dev_char"]["made"]
    assert sorted(made) == sorted(f"/dev/char/{a}:{b}" for a, b in NODES.values()), systemd_cgroups
    links = {n: host.exec(f"readlink /dev/char/{a}:{b}").stdout.strip() for n, (a, b) in NODES.items()}
    assert links == {n: f"../{n}" for n in NODES}
    assert host.exec("systemctl is-enabled gpuprov-dev-char.service").stdout.strip() == "enabled"
    start, exec_prefix, stop = DOCKER_RUN if engine == "docker" else CTR_RUN

    before, after = _across_reload(host, start, exec_prefix, stop)
    assert before == ALLOWED and after == ALLOWED, (before, after)

    host.exec("mkdir -p /tmp/devchar && mv /dev/char/* /tmp/devchar/", check=True)  # the control: no links
    try:
        before, after = _across_reload(host, start, exec_prefix, stop)
    finally:
        host.exec("mv /tmp/devchar/* /dev/char/", check=True)
    assert before == ALLOWED and after == DENIED, (before, after)


def test_dev_char_verify_boot_unit_and_uninstall_scope(host, systemd_cgroups):
    """verify names a missing link and its fix; the boot unit makes the links again; uninstall's plan removes the
    links gpuprov made and never one udev or the operator made."""
    host.exec("rm /dev/char/195:0 && ln -s /dev/nvidiactl /dev/char/195:255.op && "
              "mv /dev/char/195:255 /tmp/devchar-ours && mv /dev/char/195:255.op /dev/char/195:255", check=True)
    r = host.exec("gpuprov runtime dev-char-links --check")
    assert r.returncode == 10 and "missing: /dev/char/195:0" in r.stdout and "run `gpuprov runtime dev-char-links`" \
        in r.stderr, r.stdout + r.stderr
    assert "docker.service" in host.exec("systemctl show -p Before gpuprov-dev-char.service").stdout
    assert host.exec("systemctl restart gpuprov-dev-char.service").returncode == 0
    assert host.exec("readlink /dev/char/195:0").stdout.strip() == "../nvidia0"
    assert host.exec("gpuprov runtime dev-char-links --check").returncode == 0
    host.exec("mv /dev/char/195:0 /tmp/devchar-195-0", check=True)
    r = host.exec("gpuprov verify --json")
    check = next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "/dev/char links")
    assert r.returncode == 10 and check["status"] == "fail" and "/dev/char/195:0" in check["detail"] and \
        "Fix: `gpuprov runtime dev-char-links`" in check["detail"], r.stdout
    host.exec("mv /tmp/devchar-195-0 /dev/char/195:0", check=True)
    r = host.exec("gpuprov uninstall --dry-run -v")  # -v: every command in full
    # (the `installed` fixture's --dev-root made its links in /opt/fake-gpu/dev/char: they are gpuprov's too)
    joined = re.sub(r" \\\n\s*", " ", r.stdout)  # a long command is wrapped at 100 columns with ` \`
    line = next((ln for ln in joined.splitlines() if ln.strip().startswith("$ rm -f --") and "/char/" in ln), "")
    assert " /dev/char/195:0" in line and " /dev/char/238:0" in line and " /dev/char/195:255" not in line, \
        r.stdout + r.stderr + host.exec("cat /run/gpuprov/dev-char-links; ls -l /dev/char").stdout
    # this server has no udev: no rule written, and no /etc/udev made for one (uninstall would leave it behind)
    assert host.exec("test -e /etc/udev").returncode != 0
