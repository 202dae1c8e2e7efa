"""containerd's CRI, for real: a private containerd (Debian bookworm's 1.6, and trixie's 1.7 and sid's 2.x unpacked
with `dpkg -x`) configured by `gpuprov engine configure containerd`, then driven through its CRI gRPC API as kubelet
drives it (RunPodSandbox with runtime_handler "nvidia", CreateContainer, StartContainer), against a fake GPU host
built from the H200 capture (driver files of the capture, real mknod device nodes).

Each containerd runs with its own root, state, socket, runc root and CNI/opt directories (tests/cri/harness.py);
`restrict_oom_score_adj = true` because these machines lack CAP_SYS_RESOURCE; the sandbox ("pause") image is built
from this host's binaries and imported with `ctr images import` (no registry here). The operator's CRI settings live
in a file the main config imports, the case where gpuprov's edit used to be lost."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from provision.engines import containerd
from provision.inject import cdi, discover, edits
from tests.conftest import needs, run_cli
from tests.cri.client import CRI, log_text
from tests.cri.harness import Containerd, newer_containerd
from tests.inject_helpers import NODES, settings_dict

pytestmark = [pytest.mark.integration, needs("containerd", "ctr", "runc", "apt-get", "dpkg")]
IMAGE = "gpuprov-test/ctrd-pause:1"
UUID = "GPU-266c8396-dfbe-13b3-5ad6-311117e6bd98"  # the H200 capture's GPU
LIBDIR = "/usr/lib/x86_64-linux-gnu"
PROBE = ("echo DEV; ls /dev; echo MOUNTS; cat /proc/mounts; echo LIB; "
         "cat /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null || echo NOLIB; echo; echo END")
# What every container has (runc's and containerd's own mounts), not the runtime's doing.
STANDARD_MOUNTS = {"/", "/dev", "/dev/pts", "/dev/mqueue", "/dev/shm", "/dev/termination-log", "/etc/hosts",
                   "/etc/hostname", "/etc/resolv.conf"}
STANDARD_TREES = ("/proc", "/sys")

# The operator's own config: main file (daemon settings) + an imported file that defines the CRI plugin.
MAIN_V2 = """# the operator's containerd config
version = 2
root = "{b}/root"
state = "{b}/state"
imports = ["{b}/etc/cri.toml"]
[grpc]
  address = "{sock}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{b}/opt"
"""
CRI_V2 = """version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{image}"
  restrict_oom_score_adj = true
  stream_server_port = "0"
  max_container_log_line_size = 4321
  cdi_spec_dirs = ["{b}/cdi"]  # containerd 1.7 reads it; 1.6 has no CDI and ignores it
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{b}/cni/bin"
    conf_dir = "{b}/cni/conf"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      Root = "{b}/runc"
"""
MAIN_V3 = MAIN_V2.replace("version = 2", "version = 3") + """[plugins."io.containerd.nri.v1.nri"]
  disable = true
[plugins."io.containerd.grpc.v1.cri"]
  stream_server_port = "0"
"""
CRI_V3 = """version = 3
[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{image}"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  max_container_log_line_size = 4321
  cdi_spec_dirs = ["{b}/cdi"]
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{b}/cni/bin"]
    conf_dir = "{b}/cni/conf"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
      Root = "{b}/runc"
"""


class Node:
    """One private containerd configured by gpuprov, with a CRI client and the fake GPU host's discovery."""

    def __init__(self, which: str):
        self.ctrd = Containerd(Path("/usr/bin") if which == "bookworm" else newer_containerd(which))
        self.version = tuple(int(x) for x in re.findall(r"\d+", self.ctrd.version())[:2])
        b = self.base = self.ctrd.base
        self.main, self.cri_file = b / "etc/config.toml", b / "etc/cri.toml"
        for d in ("etc", "cni/bin", "cni/conf", "cdi", "logs"):
            (b / d).mkdir(parents=True, exist_ok=True)
        v3 = self.version >= (2, 0)
        fmt = dict(b=b, sock=self.ctrd.socket, image=IMAGE)
        self.main.write_text((MAIN_V3 if v3 else MAIN_V2).format(**fmt))
        self.cri_file.write_text((CRI_V3 if v3 else CRI_V2).format(**fmt))
        self.main_before, self.cri_before = self.main.read_text(), self.cri_file.read_bytes()
        # The fake GPU host and gpuprov's runtime, installed under this test's own prefix and settings file.
        s = settings_dict(b)
        self.runtime_cfg = b / "runtime.json"
        self.env = {"GPUPROV_RUNTIME_CONFIG": str(self.runtime_cfg)}
        self.ctrd.env = self.env
        r = run_cli("runtime", "install", "--prefix", str(b / "prefix"), "--driver-root", s["driver_root"],
                    "--dev-root", s["dev_root"], "--proc-root", s["proc_root"], "--json", env=self.env)
        assert r.returncode == 0, r.stderr
        self.runtime = str(b / "prefix/bin/gpuprov-runtime")
        self.disc = discover.discover(s["driver_root"], proc_root=s["proc_root"], dev_root=s["dev_root"])
        (b / "cdi/nvidia.yaml").write_text(yaml.safe_dump(cdi.generate_spec(self.disc)))
        # gpuprov configures it (the containerd of this PATH is the one whose version decides the drop-in).
        self.configured = run_cli("engine", "configure", "containerd", "--config", str(self.main), "--runtime-path",
                                  self.runtime, "--cdi", "--json",
                                  env={**self.env, "PATH": self.ctrd.path_env})
        assert self.configured.returncode == 0, self.configured.stderr
        self.ctrd.start(self.main)
        self.ctrd.import_image()
        self.cri = CRI(self.ctrd.socket)

    def run(self, name: str, *, handler: str = "nvidia", **create) -> str:
        """One pod with one container running PROBE; its output (the container's log)."""
        pc = self.cri.pod_config(name, str(self.base / "logs" / name))
        pod = self.cri.run_pod(pc, handler)
        try:
            cid = self.cri.create(pod, pc, name="probe", image=IMAGE, command=["sh", "-c", PROBE], **create)
            self.cri.start(cid)
            st = self.cri.wait_exited(cid)
            out = log_text(self.base / "logs" / name / "probe.log")
            assert st.exit_code == 0 and out.rstrip().endswith("END"), (st, out)
            return out
        finally:
            self.cri.remove_pod(pod)

    def close(self) -> None:
        self.cri.close()
        self.ctrd.cleanup()


# bookworm's containerd 1.6 (on PATH), trixie's 1.7 and sid's 2.x (unpacked from those suites).
@pytest.fixture(scope="module", params=["bookworm", "trixie", "sid"])
def node(request):
    n = Node(request.param)
    yield n
    n.close()


def section(out: str, name: str, nxt: str) -> str:
    return out.split(f"{name}\n", 1)[1].split(f"\n{nxt}\n", 1)[0]


def nvidia_nodes(out: str) -> set[str]:
    return {d for d in section(out, "DEV", "MOUNTS").split() if d.startswith("nvidia")}


def extra_mounts(out: str) -> dict[str, str]:
    """Mount points beyond what every container has -> their options."""
    got = {}
    for line in section(out, "MOUNTS", "LIB").splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] not in STANDARD_MOUNTS and not parts[1].startswith(STANDARD_TREES):
            got[parts[1]] = parts[3]
    return got


def expected_mounts(disc: dict, env: dict[str, str]) -> set[str]:
    return {m.destination for m in edits.compute_edits(disc, env, libdir=LIBDIR).mounts}


def test_configured_through_the_dropin(node):
    """gpuprov's part is a drop-in: the operator's files keep their bytes (main config: one `imports` entry more),
    `containerd config dump` shows the merged runtime with the runc entry's options, and every setting of theirs;
    the CRI plugin runs and lists handler `nvidia` as kubelet sees it (CRI Status)."""
    res = json.loads(node.configured.stdout)
    assert res["verified"] is True and res["changed"] is True
    dropin = node.base / "etc/conf.d/99-gpuprov.toml"
    assert node.cri_file.read_bytes() == node.cri_before
    new_main = node.main.read_text()
    assert new_main == node.main_before.replace(f'imports = ["{node.base}/etc/cri.toml"]',
                                                f'imports = ["{node.base}/etc/cri.toml", "{dropin}"]')
    dump = node.ctrd.config_dump(node.main)
    v3 = node.version >= (2, 0)
    rt = dump["plugins"]["io.containerd.cri.v1.runtime" if v3 else "io.containerd.grpc.v1.cri"]
    nv = rt["containerd"]["runtimes"]["nvidia"]
    assert nv["options"]["BinaryName"] == node.runtime
    assert nv["options"]["Root"] == f"{node.base}/runc"  # the runc entry's options carried over
    assert rt["restrict_oom_score_adj"] is True and rt["max_container_log_line_size"] == 4321
    assert rt["containerd"]["runtimes"]["runc"]["options"]["Root"] == f"{node.base}/runc"
    if v3:
        assert dump["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == IMAGE
        assert rt["enable_cdi"] is True and rt["cdi_spec_dirs"] == [f"{node.base}/cdi"]  # theirs kept
        assert "sandbox_image" not in dropin.read_text()  # 2.x: only gpuprov's keys in the drop-in
    elif node.version >= (1, 7):  # 1.x with CDI: the drop-in carries the CRI section as it was, plus CDI
        assert rt["sandbox_image"] == IMAGE and rt["enable_cdi"] is True and rt["cdi_spec_dirs"] == [f"{node.base}/cdi"]
        assert "sandbox_image" in dropin.read_text()
    else:
        assert rt["sandbox_image"] == IMAGE and "enable_cdi" not in rt  # 1.6 has no CDI
        assert any("no CDI support" in w for w in res["warnings"])
    assert node.ctrd.plugin_status("cri") == "ok"
    status = node.cri.status()
    assert {c.type: c.status for c in status.status.conditions}["RuntimeReady"] is True
    info = json.loads(status.info["config"])
    assert info["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == node.runtime


@pytest.mark.parametrize("select", ["0", UUID, "all"])
def test_envvar_strategy_gets_exactly_the_gpu(node, select):
    """The device plugin's envvar strategy: NVIDIA_VISIBLE_DEVICES in the container's env, handler nvidia."""
    env = {"NVIDIA_VISIBLE_DEVICES": select}
    out = node.run(f"env-{select[:8].lower()}", env=env)
    assert nvidia_nodes(out) == set(NODES)  # nvidiactl, nvidia0, nvidia-uvm, nvidia-uvm-tools: no more
    mounts = extra_mounts(out)
    assert set(mounts) == expected_mounts(node.disc, env)  # exactly the libraries and binaries to serve
    assert all(o.startswith("ro,") and "nosuid" in o and "nodev" in o for o in mounts.values()), mounts
    assert "fake libcuda.so.580.159.04" in section(out, "LIB", "END")


def test_volume_mounts_strategy(node):
    """The device plugin's volume-mounts strategy: /dev/null mounted at /var/run/nvidia-container-devices/<id>,
    env pointing there (unprivileged containers can't pick GPUs through env alone on multi-tenant nodes)."""
    env = {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    out = node.run("volmounts", env=env, mounts=[("/dev/null", f"/var/run/nvidia-container-devices/{UUID}")])
    assert nvidia_nodes(out) == set(NODES)
    assert set(extra_mounts(out)) - {f"/var/run/nvidia-container-devices/{UUID}"} == \
        expected_mounts(node.disc, {"NVIDIA_VISIBLE_DEVICES": UUID})


def test_volume_mounts_from_the_pods_own_volume_are_ignored(node):
    """A pod's own volume (an emptyDir: a bind of one of kubelet's directories) at the device-list path, with the env
    the strategy sets: not the orchestrator's /dev/null, so no GPU (it got every GPU before; issue 19 item 1, whose
    fault test drives the front-end directly: tests/faults/test_runtime_round2.py)."""
    own = node.base / "emptydir"
    own.mkdir(exist_ok=True)
    env = {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    out = node.run("ownvol", env=env, mounts=[(str(own), "/var/run/nvidia-container-devices/all")])
    assert nvidia_nodes(out) == set()
    assert set(extra_mounts(out)) == {"/var/run/nvidia-container-devices/all"}  # the pod's volume, nothing else


def test_no_request_gets_nothing(node):
    """Handler nvidia without a GPU request, and a GPU request under handler runc: nothing injected."""
    for name, handler, env in (("plain", "nvidia", {}), ("void", "nvidia", {"NVIDIA_VISIBLE_DEVICES": "void"}),
                               ("runc", "runc", {"NVIDIA_VISIBLE_DEVICES": "all"})):
        out = node.run(name, handler=handler, env=env)
        assert nvidia_nodes(out) == set() and extra_mounts(out) == {}, (name, out)


@pytest.mark.parametrize("how", ["cdi-devices", "cdi-annotations"])
def test_cdi(node, how):
    """CDI (containerd 1.7+): the device plugin's CDI strategies, with the spec from gpuprov's CDI generator. On
    1.6, which has no CDI, the request gives the container nothing (why gpuprov warns and points at envvar)."""
    name = "nvidia.com/gpu=0"
    kw = {"cdi_devices": [name]} if how == "cdi-devices" else {"annotations": {"cdi.k8s.io/gpuprov": name}}
    out = node.run(how, handler="runc", **kw)
    if node.version < (1, 7):
        assert nvidia_nodes(out) == set()
        return
    assert nvidia_nodes(out) == set(NODES)
    spec = cdi.generate_spec(node.disc)
    want = {m["containerPath"] for m in spec["containerEdits"]["mounts"]}
    assert set(extra_mounts(out)) == want


def test_user_settings_survive_a_second_run(node):
    """Idempotent against a running node: nothing to change, not one byte written."""
    before = {p: p.read_bytes() for p in (node.main, node.cri_file, node.base / "etc/conf.d/99-gpuprov.toml")}
    r = run_cli("engine", "configure", "containerd", "--config", str(node.main), "--runtime-path", node.runtime,
                "--cdi", "--json", env={**node.env, "PATH": node.ctrd.path_env})
    assert r.returncode == 0 and json.loads(r.stdout)["changed"] is False, r.stderr
    assert {p: p.read_bytes() for p in before} == before
    backups = [f for f in os.listdir(node.base / "etc") if ".gpuprov-" in f]
    assert len(backups) == 1 and backups[0].startswith("config.toml.gpuprov-")  # the first run's, of theirs


def test_import_after_the_dropin(node, tmp_path):
    """A file imported after gpuprov's drop-in defines the CRI plugin. containerd 1.x lets it replace the drop-in's
    whole section: `config dump` shows it, both files are put back (main config byte-identical, drop-in removed),
    exit 5 with the way out. containerd 2.x merges key by key: the handler and the operator's setting both hold."""
    late, later, main = tmp_path / "late.toml", tmp_path / "later.toml", tmp_path / "config.toml"
    late.write_text(f'version = 2\nimports = ["{later}"]\n')
    later.write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  max_container_log_line_size = 777\n')
    main.write_text(f'version = 2\nimports = ["{late}"]\n')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    r = run_cli("engine", "configure", "containerd", "--config", str(main), "--runtime-path", node.runtime, "--json",
                env={**node.env, "PATH": node.ctrd.path_env})
    if node.version < (2, 0):
        assert r.returncode == 5 and "rolled back" in r.stderr and "drop-in last" in r.stderr, r.stderr
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
        return
    assert r.returncode == 0, r.stderr
    rt = node.ctrd.config_dump(main)["plugins"]["io.containerd.cri.v1.runtime"]
    assert rt["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == node.runtime
    assert rt["max_container_log_line_size"] == 777


def test_default_handler(node):
    """`--default`: the handler kubelet uses for pods without a RuntimeClass is gpuprov's (after a restart:
    containerd reads its config only at start)."""
    # PATH as it is (bookworm's containerd first): the live daemon that reads this config is found, and its own
    # binary decides the drop-in's shape; that daemon (and only it) is the one to restart.
    r = run_cli("engine", "configure", "containerd", "--config", str(node.main), "--runtime-path", node.runtime,
                "--cdi", "--default", "--json", env=node.env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert "default_runtime_name -> nvidia" in res["changes"] and res["verified"] is True
    assert not any(c.startswith("imports") for c in res["changes"])  # the main config already imports it
    assert f"pid {node.ctrd.proc.pid}" in res["restart"]
    copied = "max_container_log_line_size" in (node.base / "etc/conf.d/99-gpuprov.toml").read_text()
    assert copied is (node.version < (2, 0))  # 1.x: the CRI section copied; 2.x: gpuprov's keys only
    node.cri.close()
    node.ctrd.stop()
    node.ctrd.start(node.main)
    node.cri = CRI(node.ctrd.socket)
    assert containerd.cri_plugin_ok(node.ctrd.socket, str(node.ctrd.bindir / "ctr"))  # what verify asks
    out = node.run("default", handler="", env={"NVIDIA_VISIBLE_DEVICES": "0"})
    assert nvidia_nodes(out) == set(NODES)


def test_a_runtimes_table_without_runc_stops_the_cri_plugin():
    """Why the 1.x drop-in keeps a runc entry: a CRI section whose runtimes table lacks it (what a drop-in holding
    only `runtimes.nvidia` amounts to on containerd 1.6) leaves the default handler undefined, and the CRI plugin
    does not start — kubelet would find no runtime. `cri_plugin_ok` (what verify asks after a restart) sees it."""
    c = Containerd(Path("/usr/bin"))
    try:
        b = c.base
        (b / "config.toml").write_text(
            f'version = 2\nroot = "{b}/root"\nstate = "{b}/state"\n[grpc]\n  address = "{c.socket}"\n'
            f'[plugins."io.containerd.internal.v1.opt"]\n  path = "{b}/opt"\n'
            '[plugins."io.containerd.grpc.v1.cri"]\n  restrict_oom_score_adj = true\n  stream_server_port = "0"\n'
            '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
            '    runtime_type = "io.containerd.runc.v2"\n')
        c.start(b / "config.toml")
        assert c.plugin_status("cri") == "error"
        assert not containerd.cri_plugin_ok(c.socket, str(c.bindir / "ctr"))
    finally:
        c.cleanup()
