"""`gpuprov bootstrap --engine podman` on a fresh Debian 12 systemd host (a container; /var/lib/containers and /home on
tmpfs, as on a real disk) made a GPU host from the H200 capture (its /proc/driver, driver root and real device nodes):
Debian's podman 4.3 installed from the archive, the CDI spec written, the validation container from the host's own
files (no registry). Then Podman itself, rootful and rootless, asks for GPUs through CDI: `--device nvidia.com/gpu=0`
(and by UUID) gets that GPU's device nodes and the driver's files, no request gets none, an unknown device and a
conflicting runtime are refused in one line; `verify` passes; `uninstall` takes gpuprov out and leaves Podman and the
user's own images. A rootless user's run writes nothing as root under that user's home.

Two things only a nested host needs (a real host has neither): Docker mounts the outer /proc/sys read-only (crun
writes the container's net.ipv4.ping_group_range there), and masks parts of /proc with mounts that keep an
unprivileged user namespace from mounting its own proc (the rootless container's); the test remounts the first and
lifts the masks before the rootless part."""
from __future__ import annotations

import json
import re

import pytest

from tests.conftest import needs
from tests.integration.hosts import Host, steps

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
FIXTURE = "/src/tests/fixtures/hosts/h200-vm"
NODES = {"nvidiactl": (195, 255), "nvidia0": (195, 0), "nvidia-uvm": (238, 0), "nvidia-uvm-tools": (238, 1)}
UUID = "GPU-266c8396-dfbe-13b3-5ad6-311117e6bd98"  # the capture's GPU (commands/nvidia-smi-L.txt)
DROPIN = "/etc/containers/containers.conf.d/99-gpuprov.conf"
CHECK = "gpuprov-check"  # the image both users import from the same tar (the validation image's files)
LOOK = "ls /dev; test -x /usr/bin/nvidia-smi && echo smi; test -e /usr/lib/x86_64-linux-gnu/libcuda.so.1 && echo cuda; true"
USER = "alice"
PODMAN_RT = "/usr/local/bin/gpuprov-runtime-podman"  # Podman's own front-end: it wraps Podman's OCI runtime
AS_USER = f"runuser -l {USER} -c 'export XDG_RUNTIME_DIR=/tmp/run-{USER}; mkdir -p -m 700 $XDG_RUNTIME_DIR; {{}}'"


def run(argv: str, gpu: str | None = None) -> str:
    """A podman run as the tests spell it (no network, never a pull)."""
    return f"podman run --rm --network none --pull never {f'--device nvidia.com/gpu={gpu} ' if gpu else ''}{argv}"


@pytest.fixture(scope="module")
def host():
    h = Host(systemd=True, tmpfs=("/var/lib/containers", "/home"))
    try:
        r = h.install_gpuprov()
        assert r.returncode == 0, r.stdout + r.stderr
        mk = " && ".join(f"mknod -m 666 /dev/{n} c {a} {b}" for n, (a, b) in NODES.items())
        h.exec(f"useradd -m -s /bin/bash {USER} && mount --bind {FIXTURE}/proc/driver /proc/driver && {mk} && "
               f"cp -a {FIXTURE}/usr/local/nvidia /usr/local/nvidia && mount -o remount,rw /proc/sys", check=True)
        h.exec("/opt/gpuprov/bin/python -c 'import sys; from provision.engines.validate import build_image_tar; "
               "sys.stdout.buffer.write(build_image_tar())' > /tmp/check.tar && chmod 644 /tmp/check.tar", check=True)
        yield h
    finally:
        h.remove()


def test_1_bootstrap_installs_podman_and_validates(host):
    r = host.exec("gpuprov bootstrap --yes --driver skip --engine podman --json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    by_id = steps(r.stdout)
    assert by_id["engine.packages"]["status"] == "changed" and "engine.service" not in by_id
    assert by_id["cdi.spec"]["status"] == "changed" and by_id["engine.config"]["status"] == "changed"
    assert by_id["validate"]["status"] == "verified" and "gpuprov-validate-ok" in by_id["validate"]["detail"]
    assert host.exec("podman --version").stdout.split()[-1].startswith("4.3.")
    assert host.exec("dpkg-query -W -f '${Status}' podman uidmap").stdout == "install ok installedinstall ok installed"
    assert host.exec("dpkg -s docker.io").returncode != 0  # podman alone
    assert "/usr/local/bin/gpuprov-runtime" in host.read(DROPIN).decode()
    again = host.exec("gpuprov bootstrap --yes --driver skip --engine podman --json")
    assert [i for i, s in steps(again.stdout).items() if s["status"] == "changed"] == [], again.stdout[-2000:]
    assert "Podman 4.3" in steps(again.stdout)["engine.present"]["title"]  # the one there now: kept


def test_2_rootful_gpu_through_cdi(host):
    assert host.exec(f"podman import -q /tmp/check.tar {CHECK}").returncode == 0
    for gpu in ("0", UUID, "all"):
        r = host.exec(run(f"{CHECK} sh -c '{LOOK}'", gpu))
        assert r.returncode == 0 and {"nvidia0", "nvidiactl", "smi", "cuda"} <= set(r.stdout.split()), r.stderr
    r = host.exec(run(f"{CHECK} sh -c '{LOOK}'"))
    assert r.returncode == 0 and not {"nvidia0", "nvidiactl", "smi", "cuda"} & set(r.stdout.split()), r.stdout
    r = host.exec(run(f"{CHECK} true", "7"))
    assert r.returncode == 126 and r.stderr.strip().splitlines() == [
        "Error: setting up CDI devices: unresolvable CDI devices nvidia.com/gpu=7"], r.stderr


def test_3_verify_passes(host):
    r = host.exec("gpuprov verify --json")
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert r.returncode == 0, checks
    assert checks["engine running"]["status"] == "pass" and "podman" in checks["engine running"]["detail"]
    assert checks["container through the runtime"]["status"] == "pass"
    assert "CDI (podman" in checks["container through the runtime"]["detail"]


def test_2b_runtime_wraps_podmans_crun(host):
    """Issue 27.12: Debian's podman brings crun alone (Depends crun | runc): gpuprov-runtime hands over to crun,
    so `podman run --runtime nvidia` works (it failed with "cannot exec /usr/sbin/runc"), GPU request included.
    Podman's runtime is its own front-end, gpuprov-runtime-podman (test_4b: with runc installed too)."""
    assert host.exec("command -v runc").returncode != 0 and host.exec("command -v crun").returncode == 0
    assert json.loads(host.read("/etc/gpuprov/runtime.json"))["runc"] == "/usr/bin/crun"
    r = host.exec("podman --runtime nvidia info --format '{{.Host.OCIRuntime.Path}}'")
    assert r.returncode == 0 and r.stdout.strip() == PODMAN_RT, r.stderr
    r = host.exec(f"podman run --runtime nvidia --rm --network none --pull never {CHECK} echo through-nvidia")
    assert r.returncode == 0 and r.stdout.strip() == "through-nvidia", r.stderr
    # utility: the host's kernel lists no nvidia-uvm (only /proc/driver is the H200's), so compute would be refused
    r = host.exec(f"podman run --runtime nvidia --rm --network none --pull never -e NVIDIA_VISIBLE_DEVICES=0 "
                  "-e NVIDIA_DRIVER_CAPABILITIES=utility "
                  f"{CHECK} sh -c '{LOOK}'")
    assert r.returncode == 0 and {"nvidia0", "nvidiactl", "smi"} <= set(r.stdout.split()), r.stdout + r.stderr


def test_3b_verify_and_configure_ask_podman(host):
    """Issue 27.13: a later drop-in of the operator's points `nvidia` at crun: `podman --runtime nvidia info` says
    crun, so verify fails naming it (it read gpuprov's drop-in and passed before); engine configure's check is
    Podman's own answer; a --config Podman never reads is exit 2 and nothing is written."""
    assert host.exec("gpuprov engine configure podman").returncode == 0
    late = "/etc/containers/containers.conf.d/zz-operator.conf"
    host.write(late, '[engine.runtimes]\nnvidia = ["/usr/bin/crun"]\n')
    try:
        r = host.exec("gpuprov verify --json")
        checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
        assert r.returncode != 0 and checks["runtime registered"]["status"] == "fail", checks
        assert "Podman runs /usr/bin/crun for --runtime nvidia" in checks["runtime registered"]["detail"]
    finally:
        host.exec(f"rm -f {late}")
    r = host.exec("gpuprov engine configure podman --config /etc/containers/containers.conf.d/50-x.toml")
    assert r.returncode == 2 and "*.conf files in a containers.conf.d" in r.stderr, r.stderr
    assert host.exec("test -e /etc/containers/containers.conf.d/50-x.toml").returncode != 0
    r = host.exec("gpuprov verify --json")
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["runtime registered"]["status"] == "pass", checks


def test_4_refusals_in_one_line(host):
    host.write("/etc/containers/containers.conf.d/50-site.conf", '[engine.runtimes]\nnvidia = ["/opt/site/rt"]\n')
    try:
        host.exec(f"rm -f {DROPIN}", check=True)
        r = host.exec("gpuprov engine configure podman")
        assert r.returncode == 14 and len(r.stderr.strip().splitlines()) == 1 and "/opt/site/rt" in r.stderr, r.stderr
        assert host.exec(f"test -e {DROPIN}").returncode != 0  # nothing written
        host.write("/etc/containers/containers.conf.d/zz-late.conf", '[engine]\nruntime = "crun"\n')
        r = host.exec("gpuprov engine configure podman --default --replace-runtime")
        assert r.returncode == 14 and len(r.stderr.strip().splitlines()) == 1 and "zz-late.conf" in r.stderr, r.stderr
    finally:
        host.exec("rm -f /etc/containers/containers.conf.d/50-site.conf /etc/containers/containers.conf.d/zz-late.conf")
    assert host.exec("gpuprov engine configure podman").returncode == 0


def test_4b_podman_keeps_crun_where_runc_is_installed_too(host):
    """Issue 27.12, several engines' runtimes on one host: runc installed beside Podman's crun (as dockerd or
    containerd bring it). gpuprov-runtime wraps runc, theirs; Podman's runtime `nvidia` is gpuprov-runtime-podman,
    which wraps crun, the OCI runtime Podman itself runs (on main, Podman's `nvidia` wrapped runc: the one front-end
    had the one slot). The container's state is crun's (`status`), never runc's (`state.json`)."""
    r = host.exec("DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends runc", timeout=600)
    assert r.returncode == 0 and host.exec("command -v runc").stdout.strip() == "/usr/sbin/runc", r.stderr
    assert host.exec("podman info --format '{{.Host.OCIRuntime.Path}}'").stdout.strip() == "/usr/bin/crun"
    r = host.exec("gpuprov runtime install && gpuprov engine configure podman")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(host.read("/etc/gpuprov/runtime.json"))["runc"] == "/usr/sbin/runc"  # dockerd's, containerd's
    assert host.exec("/usr/local/bin/gpuprov-runtime --gpuprov-front-end").stdout.split()[-1] == "/usr/sbin/runc"
    assert host.exec(f"{PODMAN_RT} --gpuprov-front-end").stdout.split()[-1] == "/usr/bin/crun"
    r = host.exec("podman --runtime nvidia info --format '{{.Host.OCIRuntime.Path}}'")
    assert r.returncode == 0 and r.stdout.strip() == PODMAN_RT, r.stdout + r.stderr
    r = host.exec(f"podman run -d -i --runtime nvidia --network none --pull never -e NVIDIA_VISIBLE_DEVICES=0 "
                  f"-e NVIDIA_DRIVER_CAPABILITIES=utility {CHECK} cat")  # it waits on its stdin, which podman holds
    cid = r.stdout.strip()
    assert r.returncode == 0 and cid, r.stderr
    try:
        state = host.exec(f"for d in $(find /run -type d -name {cid}); do echo \"$d: $(ls $d | tr '\\n' ' ')\"; done"
                          ).stdout
        assert re.search(r"\bstatus\b", state) and "state.json" not in state, state  # crun's state, not runc's
        assert "nvidia0" in host.exec(f"podman exec {cid} ls /dev").stdout.split()  # the GPU request was served
        assert host.exec(f"podman stop -t 1 {cid}").returncode == 0  # and its kill through the same front-end
    finally:
        host.exec(f"podman rm -f {cid}")
    r = host.exec("gpuprov verify --json")
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["runtime registered"]["status"] == "pass" and PODMAN_RT in checks["runtime registered"]["detail"]


def test_5_rootless_gpu_through_cdi(host):
    # (a nested host's masks over /proc, see the module's docstring; the driver's /proc/driver goes too)
    host.exec("for m in $(awk '$5 ~ \"^/proc/\" {print $5}' /proc/self/mountinfo | sort -r); do umount -l $m; done",
              check=True)
    assert host.exec(AS_USER.format(f"podman import -q /tmp/check.tar {CHECK}")).returncode == 0
    r = host.exec(AS_USER.format(run(f"{CHECK} sh -c \"{LOOK}; cat /proc/self/uid_map\"", "0")))
    out = r.stdout.split()
    assert r.returncode == 0 and {"nvidia0", "nvidiactl", "smi", "cuda"} <= set(out), r.stdout + r.stderr
    assert out[-6:-3] == ["0", host.exec(f"id -u {USER}").stdout.strip(), "1"], out  # a user namespace: rootless
    r = host.exec(AS_USER.format(run(f"{CHECK} ls /dev")))
    assert r.returncode == 0 and "nvidia0" not in r.stdout.split()
    r = host.exec(AS_USER.format(run(f"{CHECK} true", "7")))
    assert r.returncode == 126 and r.stderr.strip().splitlines()[-1] == \
        "Error: setting up CDI devices: unresolvable CDI devices nvidia.com/gpu=7", r.stderr
    assert host.exec(f"find /home/{USER} ! -user {USER}").stdout == ""  # nothing under the home written by root


def test_5c_uninstall_refuses_while_podman_runs_a_container_under_the_runtime(host):
    """Issue 27.6 for Podman: Podman stops a container through the runtime its configuration names, so with
    gpuprov's drop-in and front-end gone `podman stop` of a container started with `--runtime nvidia` could not work.
    Uninstall (and its dry run, the plan) refuses while one runs: exit 14, one line naming it, nothing changed; once
    it is stopped, test_6's uninstall goes through. (On main uninstall removed both, exit 0.)"""
    r = host.exec(f"podman run -d -i --name held-gpu --runtime nvidia --network none --pull never {CHECK} cat")
    assert r.returncode == 0, r.stderr
    try:
        before = host.exec(f"md5sum {DROPIN} {PODMAN_RT} /etc/gpuprov/runtime.json").stdout
        for cmd in ("gpuprov uninstall --dry-run", "gpuprov uninstall --yes"):
            r = host.exec(cmd)
            assert r.returncode == 14 and len(r.stderr.strip().splitlines()) == 1, (cmd, r.stdout, r.stderr)
            assert "Podman: held-gpu" in r.stderr and "--force" in r.stderr, r.stderr
        assert host.exec(f"md5sum {DROPIN} {PODMAN_RT} /etc/gpuprov/runtime.json").stdout == before
        assert host.exec("podman stop -t 1 held-gpu").returncode == 0  # through gpuprov's runtime, still there
    finally:
        host.exec("podman rm -f held-gpu")


def test_5d_uninstall_refuses_while_crio_runs_a_container_under_the_runtime(host):
    """Issue 27.6 for CRI-O, which Debian does not package (so no CRI-O runs here): what uninstall reads of CRI-O's
    containers is real. CRI-O starts each container under a monitor, conmon, given the handler's runtime path (`-r`)
    and its root (`--runtime-arg --root=…`, gpuprov's drop-in: /run/gpuprov-runtime); here Debian's conmon is started
    with CRI-O's arguments for gpuprov's handler, creates a container through gpuprov-runtime, which is then started.
    CRI-O would stop it through the handler uninstall takes away, so uninstall (and its dry run) refuses: exit 14 naming
    it as CRI-O names it, nothing changed. Podman's own conmons (this host runs them in test_5c) are not CRI-O's.
    (On main: exit 0, the runtime removed under it.)"""
    b, rt = "/tmp/crio-bundle", "/usr/local/bin/gpuprov-runtime --root=/run/gpuprov-runtime"
    host.exec(f"set -e; mkdir -p {b}/rootfs /tmp/crio-exits /tmp/crio-sock /tmp/crio-persist; "
              f"podman create --name crio-src {CHECK} true >/dev/null; podman export crio-src | tar -C {b}/rootfs -x; "
              f"podman rm crio-src >/dev/null; mkfifo {b}/rootfs/tmp/hold; cd {b} && runc spec && "
              "/opt/gpuprov/bin/python -c 'import json; c=json.load(open(\"config.json\")); "
              "c[\"process\"].update(terminal=False, args=[\"cat\", \"/tmp/hold\"]); "
              "json.dump(c, open(\"config.json\", \"w\"))'", check=True)
    name = "k8s_held_gpu-pod_default_0"
    host.spawn(f"exec conmon -b {b} -c crio1 -u crio1 -n {name} --exit-dir /tmp/crio-exits -l {b}/ctr.log "
               f"-P {b}/conmon.pid -p {b}/pid --persist-dir /tmp/crio-persist -r /usr/local/bin/gpuprov-runtime "
               f"--runtime-arg --root=/run/gpuprov-runtime --socket-dir-path /tmp/crio-sock --syslog "
               f">{b}/conmon.out 2>&1")
    try:
        host.exec(f"for i in $(seq 100); do {rt} state crio1 2>/dev/null | grep -q created && exit 0; sleep 0.1; "
                  f"done; cat {b}/conmon.out; exit 1", check=True)
        host.exec(f"{rt} start crio1", check=True)
        before = host.exec(f"md5sum {DROPIN} {PODMAN_RT} /usr/local/bin/gpuprov-runtime /etc/gpuprov/runtime.json").stdout
        for cmd in ("gpuprov uninstall --dry-run", "gpuprov uninstall --yes"):
            r = host.exec(cmd)
            assert r.returncode == 14 and len(r.stderr.strip().splitlines()) == 1, (cmd, r.stdout, r.stderr)
            assert f"CRI-O: {name}" in r.stderr and "Podman:" not in r.stderr, r.stderr
        assert host.exec(f"md5sum {DROPIN} {PODMAN_RT} /usr/local/bin/gpuprov-runtime "
                         "/etc/gpuprov/runtime.json").stdout == before
        assert '"running"' in host.exec(f"{rt} state crio1").stdout  # still served by gpuprov's runtime
    finally:
        host.exec(f"{rt} kill crio1 KILL; sleep 0.5; {rt} delete -f crio1; "
                  f"for i in $(seq 50); do kill -0 $(cat {b}/conmon.pid) 2>/dev/null || exit 0; sleep 0.1; done")


def test_5e_uninstall_refuses_while_a_rootless_user_runs_one(host):
    """Issue 27.6 for a rootless user's Podman: their Podman reads the same drop-in and stops their container through
    gpuprov's front-end, and root's `podman ps` never lists it. Uninstall finds it by its conmon (owned by the user,
    started with gpuprov-runtime-podman) and refuses, naming the container and the user; nothing changed.
    (On the code before: exit 0.)"""
    r = host.exec(AS_USER.format(f"podman run -d -i --name alice-held --runtime nvidia --network none --pull never "
                                 f"{CHECK} cat"))
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        before = host.exec(f"md5sum {DROPIN} {PODMAN_RT} /etc/gpuprov/runtime.json").stdout
        r = host.exec("gpuprov uninstall --dry-run")
        assert r.returncode == 14 and len(r.stderr.strip().splitlines()) == 1, (r.stdout, r.stderr)
        assert f"Podman: alice-held (user {USER})" in r.stderr, r.stderr
        assert host.exec(f"md5sum {DROPIN} {PODMAN_RT} /etc/gpuprov/runtime.json").stdout == before
        assert host.exec(AS_USER.format("podman stop -t 1 alice-held")).returncode == 0
    finally:
        host.exec(AS_USER.format("podman rm -f alice-held"))


def test_6_uninstall_keeps_podman_and_the_users_images(host):
    r = host.exec("gpuprov uninstall --yes --json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert host.exec(f"test -e {PODMAN_RT}").returncode != 0  # Podman's front-end goes with gpuprov-runtime
    assert host.exec(f"test -e {DROPIN} || test -e /etc/cdi/nvidia.yaml").returncode != 0
    assert "gpuprov-validate" not in host.exec("podman image ls").stdout
    assert CHECK in host.exec("podman image ls").stdout  # the operator's image stays
    assert CHECK in host.exec(AS_USER.format("podman image ls")).stdout  # and the user's own store is not touched
    assert host.exec("dpkg-query -W -f '${Status}' podman").stdout == "install ok installed"  # not without --engine
