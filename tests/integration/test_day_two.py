"""Day two on one fresh Debian 12 systemd host (a container; Debian's docker.io and containerd really installed and
running, with the operator's own daemon.json and containerd config.toml), shared by the checks below to keep CI
short:

- the uninstall round trip: bootstrap for docker and for containerd, an operator edit in both configs, then
  `gpuprov uninstall`: every path gpuprov touched is byte-identical to before (content, mode, owner, links) but for
  the operator's edit, which is kept; both engines run with the operator's settings; `uninstall --dry-run` printed
  what ran; a second uninstall changes nothing.
- then, on the same host made a GPU host (the H200 capture), the upgrade of gpuprov itself under running GPU
  containers and concurrent GPU container starts.
"""
from __future__ import annotations

import json
import shlex

import pytest

from provision.effects import unified_diff
from tests.conftest import needs
from tests.integration.hosts import Host

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]

DAEMON = "/etc/docker/daemon.json"
CONTAINERD = "/etc/containerd/config.toml"
OPERATOR_DAEMON = {"log-driver": "json-file", "log-opts": {"max-size": "10m", "max-file": "3"},
                   "registry-mirrors": ["https://mirror.lab.invalid"], "live-restore": False}
OPERATOR_CONTAINERD = """# containerd, as this site runs it
version = 2
oom_score = -999

[grpc]
  max_recv_message_size = 16777216

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.lab.invalid/pause:3.9"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
"""
CONTAINERD_EDIT = '\n[debug]\n  level = "info"\n'
LOCK_DIR = "/run/gpuprov"
LOCK = f"{LOCK_DIR}/host.lock"
# Every tree gpuprov writes in (and /etc whole): what the round trip compares, path by path.
ROOTS = ("/etc", "/usr/local", "/var/lib/gpuprov", "/run/gpuprov", "/var/log/gpuprov", "/var/cache/gpuprov",
         "/run/cdi", "/var/run/cdi")
SNAPSHOT = r"""
import hashlib, json, os, stat, sys
def entry(p):
    st = os.lstat(p)
    d = [oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid]
    if stat.S_ISLNK(st.st_mode):
        return d + ["link", os.readlink(p)]
    if stat.S_ISREG(st.st_mode):
        with open(p, "rb") as fh:
            return d + ["file", hashlib.sha256(fh.read()).hexdigest()]
    return d + ["dir" if stat.S_ISDIR(st.st_mode) else "other"]
out = {}
for r in sys.argv[1:]:
    if os.path.lexists(r):
        out[r] = entry(r)
    if os.path.isdir(r) and not os.path.islink(r):
        for dp, dns, fns in os.walk(r):
            for x in dns + fns:
                out[os.path.join(dp, x)] = entry(os.path.join(dp, x))
print(json.dumps(out))
"""


def snapshot(h: Host) -> dict[str, list]:
    r = h.exec("python3 - " + " ".join(ROOTS), input_text=SNAPSHOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def changed(a: dict, b: dict) -> set[str]:
    return {p for p in a.keys() | b.keys() if a.get(p) != b.get(p)}


def run_json(h: Host, cmd: str) -> dict:
    r = h.exec(cmd, timeout=900)
    assert r.returncode == 0, cmd + "\n" + r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def host():
    """The operator's server: docker.io from Debian's archive, their daemon.json and config.toml, both engines
    restarted on them; then gpuprov installed from the wheelhouse (install.sh --install-only)."""
    h = Host(systemd=True, tmpfs=("/var/lib/containerd",))
    try:
        r = h.exec("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                   "--no-install-recommends docker.io >/dev/null", timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr
        h.write(DAEMON, json.dumps(OPERATOR_DAEMON, indent=2) + "\n")
        h.write(CONTAINERD, OPERATOR_CONTAINERD)
        h.exec("chmod 600 /etc/containerd/config.toml && systemctl restart containerd docker", check=True)
        r = h.install_gpuprov()
        assert r.returncode == 0, r.stdout + r.stderr
        yield h
    finally:
        h.remove()


def test_uninstall_round_trip(host):
    h = host
    before = snapshot(h)
    run_json(h, "gpuprov bootstrap --yes --driver skip --json")
    run_json(h, "gpuprov bootstrap --yes --driver skip --engine containerd --json")
    assert "nvidia" in json.loads(h.exec("docker info --format '{{json .Runtimes}}'").stdout)
    assert "/usr/local/bin/gpuprov-runtime" in h.exec("containerd config dump").stdout
    assert changed(before, snapshot(h))  # gpuprov did touch the host

    # the operator's edits after bootstrap: a daemon.json key (their usual tool), a containerd table
    h.exec("python3 - <<'EOF'\nimport json\np = '/etc/docker/daemon.json'\nd = json.load(open(p))\n"
           "d['labels'] = ['site=lab']\nopen(p, 'w').write(json.dumps(d, indent=2) + '\\n')\nEOF", check=True)
    h.exec(f"printf '{CONTAINERD_EDIT}' >> {CONTAINERD}", check=True)
    edited = {DAEMON: h.read(DAEMON).decode(), CONTAINERD: h.read(CONTAINERD).decode()}
    containerd_pid = h.exec("systemctl show -p MainPID --value containerd").stdout.strip()

    mid = snapshot(h)
    plan = run_json(h, "gpuprov uninstall --dry-run --json")
    assert not changed(mid, snapshot(h))  # a dry run changes nothing
    res = run_json(h, "gpuprov uninstall --yes --json")
    after = snapshot(h)

    # byte-identical (content, mode, owner, links) but for the operator's edits, which are kept
    expected_daemon = json.dumps({**OPERATOR_DAEMON, "labels": ["site=lab"]}, indent=2) + "\n"
    # and the host lock, never removed (another run may hold it)
    assert changed(before, after) == {DAEMON, CONTAINERD, LOCK, LOCK_DIR}, sorted(changed(before, after))[:20]
    assert h.read(DAEMON).decode() == expected_daemon
    assert h.read(CONTAINERD).decode() == OPERATOR_CONTAINERD + CONTAINERD_EDIT
    for p in (DAEMON, CONTAINERD):
        assert after[p][:3] == before[p][:3], p  # mode and owner

    # both engines run with the operator's settings (dockerd reloaded live, containerd restarted: read at start only)
    info = json.loads(h.exec("docker info --format '{{json .}}'").stdout)
    assert info["DefaultRuntime"] == "runc" and "nvidia" not in info["Runtimes"]
    assert info["Labels"] == ["site=lab"] and info["RegistryConfig"]["Mirrors"] == ["https://mirror.lab.invalid/"]
    assert h.exec("systemctl is-active docker containerd").stdout.split() == ["active", "active"]
    assert h.exec("systemctl show -p MainPID --value containerd").stdout.strip() != containerd_pid
    dump = h.exec("containerd config dump").stdout
    assert 'sandbox_image = "registry.lab.invalid/pause:3.9"' in dump and "oom_score = -999" in dump
    assert 'level = "info"' in dump and "gpuprov" not in dump
    assert h.exec("ctr plugins ls | grep -E 'io.containerd.grpc.v1 +cri .* ok'").returncode == 0
    assert h.exec("docker image ls -q gpuprov-validate").stdout.strip() == ""  # its images went too
    assert "gpuprov" not in h.exec("ctr namespaces ls -q").stdout

    # `uninstall --dry-run` printed what ran: the same steps, the same file changes, every path it changed named
    planned = {s["id"]: s for s in plan["steps"]}
    ran = {s["id"]: s["status"] for s in res["steps"]}
    assert set(planned) == set(ran) and all(v == "changed" for v in ran.values()), ran
    diffs = {p: d for s in plan["steps"] for p, d in s["diffs"].items()}
    assert set(diffs) == {DAEMON, CONTAINERD}
    for p in diffs:
        assert diffs[p] == unified_diff(edited[p], h.read(p).decode(), p)
    argvs = [shlex.split(c) for s in plan["steps"] for c in s["commands"]]
    removed = [a for argv in argvs if argv[0] in ("rm", "rmdir") for a in argv[argv.index("--") + 1:]]
    for p in changed(mid, after) - {LOCK}:  # the lock names its holder: the uninstall run itself
        assert p in diffs or any(p == r or p.startswith(r + "/") for r in removed), p
    for r in removed:
        assert r not in after, r

    # a second uninstall changes nothing
    again = run_json(h, "gpuprov uninstall --yes --json")
    assert again["changed"] == 0 and again["steps"] == [], again
    assert not changed(after, snapshot(h)) - {LOCK}


# ---------------------------------------------------------------- containers that outlive uninstall

# A local image with nothing in it but the merged-/usr links: its containers run the host's /usr (read-only).
BASE_IMAGE = ("rm -rf /tmp/base && mkdir -p /tmp/base/usr && cd /tmp/base && ln -s usr/bin bin && ln -s usr/lib lib "
              "&& ln -s usr/lib64 lib64 && tar -c . | docker import - uninstall-base >/dev/null")
SLEEPER = "-v /usr:/usr:ro uninstall-base /bin/sh -c 'trap \"exit 0\" TERM; sleep 100000 & wait'"


def test_uninstall_keeps_containers_running_and_stoppable(host):
    """live-restore off, the operator's container (runc) and one started under gpuprov's runtime, both running;
    uninstall killed after it wrote daemon.json and before it reloaded dockerd (the file is the operator's again, the daemon still
    defaults to `nvidia`): the next uninstall reloads dockerd live (no restart: both containers keep their
    processes), dockerd forgets gpuprov's runtime and default, and gpuprov-runtime stays as a pass-through until
    the GPU container is stopped, which `docker stop` does cleanly (exit 0, not 137); the uninstall after that
    removes it."""
    h = host
    operators = h.read(DAEMON)
    run_json(h, "gpuprov bootstrap --yes --driver skip --json")
    h.exec(BASE_IMAGE, check=True)
    for name, rt in (("op", "runc"), ("gpu", "nvidia")):
        r = h.exec(f"docker run -d --name uninstall-{name} --runtime {rt} {SLEEPER}")
        assert r.returncode == 0, r.stderr
    pids = {c: h.exec(f"docker inspect -f '{{{{.State.Pid}}}}' uninstall-{c}").stdout.strip() for c in ("op", "gpu")}
    dockerd = h.exec("systemctl show -p MainPID --value docker").stdout.strip()
    # (a change that needs dockerd restarted now keeps both through the restart by holding live-restore on:
    # test_restart_keeps_containers.py; where it cannot, the exit 14: tests/unit/test_engine_options.py)
    h.write(DAEMON, operators.decode())  # what the killed run had written, without the reload

    res = run_json(h, "gpuprov uninstall --yes --json")
    steps = {s["id"]: s for s in res["steps"]}
    assert "uninstall.engine.docker" in steps and "Reload docker" in steps["uninstall.engine.docker"]["title"]
    assert h.exec("systemctl show -p MainPID --value docker").stdout.strip() == dockerd  # never restarted
    for c, pid in pids.items():
        assert h.exec(f"docker inspect -f '{{{{.State.Running}}}} {{{{.State.Pid}}}}' uninstall-{c}").stdout.split() \
            == ["true", pid], c
    info = json.loads(h.exec("docker info --format '{{json .}}'").stdout)
    assert info["DefaultRuntime"] == "runc" and "nvidia" not in info["Runtimes"], info["Runtimes"]
    assert h.read(DAEMON) == operators  # the file as the operator has it, byte for byte
    assert b"pass-through" in h.read("/usr/local/bin/gpuprov-runtime")
    assert h.exec("docker run --rm -v /usr:/usr:ro uninstall-base /bin/true").returncode == 0  # new ones: runc

    r = h.exec("docker stop -t 20 uninstall-gpu")
    assert r.returncode == 0, r.stderr
    assert h.exec("docker inspect -f '{{.State.ExitCode}}' uninstall-gpu").stdout.strip() == "0"
    again = run_json(h, "gpuprov uninstall --yes --json")
    assert [s["id"] for s in again["steps"]] == ["uninstall.runtime"], again
    assert h.exec("test -e /usr/local/bin/gpuprov-runtime").returncode == 1
    assert run_json(h, "gpuprov uninstall --yes --json")["steps"] == []
    assert h.exec("docker inspect -f '{{.State.Running}}' uninstall-op").stdout.strip() == "true"
    h.exec("docker rm -f uninstall-op uninstall-gpu; docker image rm uninstall-base")


# ---------------------------------------------------------------- upgrading gpuprov under running containers

FIXTURE = "/src/tests/fixtures/hosts/h200-vm"
NODES = {"nvidiactl": (195, 255), "nvidia0": (195, 0), "nvidia-uvm": (238, 0), "nvidia-uvm-tools": (238, 1)}
# utility only: this host shows the H200's /proc/driver but its kernel lists no nvidia-uvm (the real /proc/modules),
# and a compute container is refused without it since issue 26; the editor's path is the same either way
GPU_RUN = "docker run --rm --runtime nvidia -e NVIDIA_VISIBLE_DEVICES=all -e NVIDIA_DRIVER_CAPABILITIES=utility {image} ls /dev"
# Three workers start GPU containers back to back until /tmp/stop-starts exists; one line per start.
STARTS = ("rm -f /tmp/stop-starts; for w in 1 2 3; do (while [ ! -e /tmp/stop-starts ]; do "
          "if {run} 2>>/tmp/starts-$w.err | grep -qx nvidia0; then echo ok; else echo FAIL; fi; done "
          "> /tmp/starts-$w.log; echo done >> /tmp/starts-$w.log) & done; wait")


def bumped_wheel(out) -> tuple[str, str]:
    """A newer gpuprov: this checkout with its version's last number raised, built into `out`."""
    import re
    import shutil
    import subprocess
    import sys

    from provision import __version__
    from tests.integration.hosts import REPO, checkout_ignore

    new = re.sub(r"(\d+)$", lambda m: str(int(m.group(1)) + 1), __version__)
    src = out / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=checkout_ignore())
    for f in ("provision/__init__.py", "pyproject.toml"):
        p = src / f
        p.write_text(p.read_text().replace(f'"{__version__}"', f'"{new}"', 1))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src), "-w", str(out / "wheel")],
                   check=True, capture_output=True, timeout=900)
    (whl,) = (out / "wheel").glob(f"gpuprov-{new}-*.whl")
    return str(whl), new


def lines(h: Host) -> list[str]:
    return h.exec("cat /tmp/starts-*.log").stdout.split()


def wait_for(cond, what: str, seconds: float = 600) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(1)


def test_upgrade_under_running_containers_and_concurrent_starts(host, tmp_path_factory):
    """A GPU host (the H200 capture's driver files and /proc/driver, real device nodes) with GPU containers running
    through gpuprov's runtime: a newer gpuprov installed and bootstrap re-run while three workers keep starting GPU
    containers. Every start succeeds; the front-end and the editor's copy are replaced; the old editor exits; the
    containers the old runtime created are exec'd into, stopped, killed and removed."""
    h = host
    from provision.engines.validate import IMAGE

    whl, version = bumped_wheel(tmp_path_factory.mktemp("v2"))
    mk = " && ".join(f"mknod -m 666 /dev/{n} c {a} {b}" for n, (a, b) in NODES.items())
    h.exec(f"mount --bind {FIXTURE}/proc/driver /proc/driver && {mk} && "
           f"cp -a {FIXTURE}/usr/local/nvidia /usr/local/nvidia", check=True)
    boot = run_json(h, "gpuprov bootstrap --yes --driver skip --json")
    assert {s["id"]: s["status"] for s in boot["steps"]}["runtime.install"] == "changed"
    assert "nvidia0" in h.exec(GPU_RUN.format(image=IMAGE)).stdout.split()
    for i in (1, 2, 3):
        r = h.exec(f"docker run -d -i --name uninstall-upg-{i} --runtime nvidia -e NVIDIA_VISIBLE_DEVICES=all "
                   f"-e NVIDIA_DRIVER_CAPABILITIES=utility {IMAGE} sh -c 'read x'")
        assert r.returncode == 0, r.stderr
    copy_before = h.exec("readlink /usr/local/lib/gpuprov-runtime/current").stdout.strip()
    editor_before = h.exec("cut -d' ' -f1 /run/gpuprov/runtime-editor.sock.lock").stdout.strip()
    assert editor_before and h.exec(f"test -d /proc/{editor_before}").returncode == 0, "a warm editor serves"

    h.exec("mkdir -p /tmp/v2", check=True)
    import subprocess
    subprocess.run(["docker", "cp", whl, f"{h.name}:/tmp/v2/"], check=True)
    h.spawn(STARTS.format(run=GPU_RUN.format(image=IMAGE)))
    wait_for(lambda: len(lines(h)) >= 6, "three workers starting containers")
    during = len(lines(h))
    up = h.exec("/opt/gpuprov/bin/pip install -q --no-index --no-deps --force-reinstall /tmp/v2/*.whl && "
                "gpuprov bootstrap --yes --driver skip --json", timeout=900)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    steps = {s["id"]: s["status"] for s in json.loads(up.stdout)["steps"]}
    assert steps["runtime.install"] == "changed" and steps["engine.config"] == "ok", steps
    after = len(lines(h))
    wait_for(lambda: len(lines(h)) >= after + 6, "starts after the upgrade")
    h.exec("touch /tmp/stop-starts", check=True)
    wait_for(lambda: lines(h).count("done") == 3, "the workers to stop")
    results = [x for x in lines(h) if x != "done"]
    print(f"\nGPU container starts: {len(results)} in all, {after - during} while the upgrade ran")
    assert results.count("ok") == len(results) and after - during >= 3, (results, h.exec("cat /tmp/starts-*.err").stdout)

    assert h.exec("gpuprov --version").stdout.split()[-1] == version
    assert h.exec("readlink /usr/local/lib/gpuprov-runtime/current").stdout.strip() not in ("", copy_before)
    wait_for(lambda: h.exec(f"test -d /proc/{editor_before}").returncode != 0, "the old editor to exit", 30)
    for i in (1, 2, 3):  # what the old runtime created, handled by the new one
        assert "nvidia0" in h.exec(f"docker exec uninstall-upg-{i} ls /dev").stdout.split()
    assert h.exec("docker stop -t 1 uninstall-upg-1").returncode == 0
    assert h.exec("docker kill uninstall-upg-2").returncode == 0
    assert h.exec("docker rm uninstall-upg-1 uninstall-upg-2 && docker rm -f uninstall-upg-3").returncode == 0
    assert h.exec("docker ps -aq --filter name=uninstall-upg").stdout.strip() == ""
