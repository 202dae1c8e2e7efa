"""Kubernetes node side: GFD labels from the H200 capture (fake NVML at pynvml's boundary), the NFD local-source
file read back the way NFD reads it, RuntimeClass/ConfigMap validated strictly against Kubernetes' own API models,
the device plugin config against its Go structs' contract, and the CLI writing them.

`kubectl apply --dry-run=client --validate=strict` was tried (kubectl 1.32): it needs the API server's OpenAPI
document even in client dry-run ("failed to download openapi … connection refused"), so without a cluster the
manifests are checked with the Kubernetes Python client's models, generated from that same OpenAPI."""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from provision.errors import USAGE, GpuprovError, Unsupported, UsageError
from provision.k8s import labels as L
from provision.k8s import manifests as M
from provision.metrics import nvml
from provision.share.state import MpsState
from tests.conftest import needs
from tests.fake_nvml import FakeNVML
from tests.inject_helpers import MIG_FIXTURE
from tests.k8s_contract import device_plugin_config as dpc
from tests.k8s_contract.nfd_local import parse_feature_file, read_features_dir


def snap(tmp_path, n_gpus=1):
    nv = FakeNVML()
    nv.gpus = nv.gpus * n_gpus
    return nvml.snapshot(nv, kmsg=str(tmp_path / "none"))


def settings(share=None, env=True, cdi=False):
    return M.NodeSettings(share_state=share, accept_env_unprivileged=env, engine_cdi=cdi, driver_root="/usr/local/nvidia")


SHARE_ON = MpsState(control="/usr/bin/nvidia-cuda-mps-control", pipe_dir="/run/gpuprov/mps",
                    log_dir="/var/log/gpuprov/mps", max_clients=8, supervisor="background process", daemon_pid=1)


def test_gfd_labels_of_the_h200(tmp_path):
    got = L.gfd_labels(snap(tmp_path), L.Sharing())
    assert got == {
        "nvidia.com/cuda.driver-version.full": "580.159.04", "nvidia.com/cuda.driver-version.major": "580",
        "nvidia.com/cuda.driver-version.minor": "159", "nvidia.com/cuda.driver-version.revision": "04",
        "nvidia.com/cuda.runtime-version.full": "13.0", "nvidia.com/cuda.runtime-version.major": "13",
        "nvidia.com/cuda.runtime-version.minor": "0",
        "nvidia.com/gpu.compute.major": "9", "nvidia.com/gpu.compute.minor": "0", "nvidia.com/gpu.count": "1",
        "nvidia.com/gpu.family": "hopper", "nvidia.com/gpu.memory": "143771", "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none", "nvidia.com/mig.capable": "true", "nvidia.com/mps.capable": "false"}


def test_shared_gpus_labelled_like_gfd(tmp_path):
    sharing = M.decide_sharing(settings(share=SHARE_ON))
    got = L.gfd_labels(snap(tmp_path, 2), sharing)
    assert got["nvidia.com/gpu.product"] == "NVIDIA-H200-SHARED" and got["nvidia.com/gpu.count"] == "2"
    assert (got["nvidia.com/gpu.replicas"], got["nvidia.com/gpu.sharing-strategy"]) == ("8", "mps")
    ts = L.gfd_labels(snap(tmp_path), M.decide_sharing(settings(), "time-slicing", 3))
    assert (ts["nvidia.com/gpu.replicas"], ts["nvidia.com/gpu.sharing-strategy"]) == ("3", "time-slicing")


def test_family_table_and_sanitising():
    assert [L.family(*cc) for cc in ((7, 0), (7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (12, 0), (4, 0))] == [
        "volta", "turing", "ampere", "ada-lovelace", "hopper", "blackwell", "blackwell", "undefined"]
    assert L.sanitise("NVIDIA H100 80GB HBM3 (SXM5)") == "NVIDIA-H100-80GB-HBM3-SXM5"
    for key, value in (("nvidia.com/gpu.product", "x" * 64), ("nvidia.com/gpu product", "a")):
        with pytest.raises(GpuprovError) as exc:
            L.check_label(key, value)
        assert exc.value.exit_code == USAGE  # an invalid value, not an internal error


def test_nfd_file_reads_back_as_nfd_reads_it(tmp_path):
    labels = L.gfd_labels(snap(tmp_path), L.Sharing())
    d = tmp_path / "features.d"
    d.mkdir()
    from provision.k8s.node import write_if_changed

    assert write_if_changed(str(d / "gpuprov"), L.nfd_file(labels)) is True
    assert write_if_changed(str(d / "gpuprov"), L.nfd_file(labels)) is False  # unchanged: not rewritten
    (d / ".gpuprov.tmp-leftover").write_text("nvidia.com/gpu.count=99\n")  # a temp dot-file is never read
    assert read_features_dir(d) == labels
    assert parse_feature_file(L.nfd_file(labels)) == labels
    flag = L.kubelet_flag(labels)
    assert flag.startswith("--node-labels=") and dict(kv.split("=", 1) for kv in flag[14:].split(",")) == labels


def test_sharing_decisions():
    assert M.decide_sharing(settings()) == L.Sharing()
    s = M.decide_sharing(settings(share=replace(SHARE_ON, max_clients=None)))
    assert (s.strategy, s.replicas, s.plugin_section) == ("mps", M.DEFAULT_REPLICAS, "timeSlicing")
    with pytest.raises(UsageError, match="share disable"):
        M.decide_sharing(settings(share=SHARE_ON), "mps")
    assert M.decide_sharing(settings(), "mps", 4).plugin_section == "mps"
    with pytest.raises(UsageError):
        M.decide_sharing(settings(), "time-slicing", 1)
    assert M.decide_strategy(settings()) == "envvar"
    assert M.decide_strategy(settings(env=False)) == "volume-mounts"
    with pytest.raises(UsageError):
        M.decide_strategy(settings(env=False), "envvar")
    with pytest.raises(UsageError):
        M.decide_strategy(settings(cdi=False), "cdi-annotations")
    assert M.decide_strategy(settings(cdi=True), "cdi-annotations") == "cdi-annotations"


@pytest.mark.parametrize("share,asked,strategy_asked", [
    (None, "auto", "auto"), (SHARE_ON, "auto", "auto"), (None, "time-slicing", "auto"), (None, "mps", "auto"),
    (None, "auto", "cdi-annotations")])
def test_device_plugin_config_meets_the_plugins_contract(share, asked, strategy_asked):
    st = settings(share=share, env=strategy_asked != "volume-mounts", cdi=True)
    sharing = M.decide_sharing(st, asked, 4 if asked != "auto" else None)
    strategy = M.decide_strategy(st, strategy_asked)
    files = M.render_all(st, sharing, strategy)
    cfg = yaml.safe_load(files["device-plugin-config.yaml"])
    dpc.parse(cfg)
    assert cfg["flags"]["plugin"]["deviceListStrategy"] == strategy
    if sharing.plugin_section:
        (res,) = cfg["sharing"][sharing.plugin_section]["resources"]
        assert res == {"name": "nvidia.com/gpu", "replicas": sharing.replicas}
    else:
        assert "sharing" not in cfg
    cm = yaml.safe_load(files["device-plugin-configmap.yaml"])
    assert yaml.safe_load(cm["data"]["gpuprov"]) == cfg  # the ConfigMap carries exactly the file


def test_contract_catches_what_the_plugin_would_drop():
    with pytest.raises(dpc.ConfigError, match="unknown field"):
        dpc.parse({"version": "v1", "flags": {"plugin": {"deviceListStrategy": "envvar", "deviceIdStrategy": "uuid"}}})
    with pytest.raises(dpc.ConfigError, match="replicas"):
        dpc.parse({"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 1}]}}})
    with pytest.raises(dpc.ConfigError, match="mps-root"):
        dpc.parse({"version": "v1", "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}})


def _k8s_strict(doc: dict, klass: str):
    """Deserialize with the Kubernetes client's generated models (required fields, types) and refuse any field the
    model does not know, as `kubectl --validate=strict` would."""
    import kubernetes.client as kc

    api = kc.ApiClient()

    def walk(d, model_name, where):
        model = getattr(kc, model_name)
        known = {v: k for k, v in model.attribute_map.items()}
        for key, value in d.items():
            assert key in known, f"{where}{key}: unknown field in {model_name}"
            t = model.openapi_types[known[key]]
            m = re.fullmatch(r"(V\d\w+)", t)
            if m and isinstance(value, dict):
                walk(value, t, f"{where}{key}.")

    walk(doc, klass, "")
    return api._ApiClient__deserialize(doc, klass)


def test_runtimeclass_and_configmap_validate():
    files = M.render_all(settings(), L.Sharing(), "envvar")
    rc = _k8s_strict(yaml.safe_load(files["runtimeclass.yaml"]), "V1RuntimeClass")
    assert (rc.api_version, rc.kind, rc.handler, rc.metadata.name) == ("node.k8s.io/v1", "RuntimeClass", "nvidia", "nvidia")
    cm = _k8s_strict(yaml.safe_load(files["device-plugin-configmap.yaml"]), "V1ConfigMap")
    assert cm.kind == "ConfigMap" and set(cm.data) == {"gpuprov"}
    with pytest.raises(ValueError):  # the models do reject: a RuntimeClass without its handler
        _k8s_strict({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "x"}},
                    "V1RuntimeClass")
    with pytest.raises(AssertionError, match="unknown field"):
        _k8s_strict({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "handlr": "nvidia"}, "V1RuntimeClass")


def test_manifests_cli_writes_the_files(tmp_path):
    env = {"GPUPROV_RUNTIME_CONFIG": str(tmp_path / "runtime.json"), "PATH": "/usr/bin:/bin"}
    (tmp_path / "runtime.json").write_text('{"share_state": "%s", "accept_env_unprivileged": false}' %
                                           (tmp_path / "share.json"))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "provision", "k8s", "manifests", "--output", str(out)],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in out.iterdir()) == ["device-plugin-config.yaml", "device-plugin-configmap.yaml",
                                                     "device-plugin-helm-values.yaml", "runtimeclass.yaml"]
    cfg = dpc.parse(yaml.safe_load((out / "device-plugin-config.yaml").read_text()))
    assert cfg["flags"]["plugin"]["deviceListStrategy"] == "volume-mounts"  # the runtime ignores env here
    p = subprocess.run([sys.executable, "-m", "provision", "k8s", "manifests", "--sharing", "bogus"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 2 and p.stderr.startswith("Error: --sharing 'bogus'")


def test_labels_cli_with_nvml(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nvml, "load", FakeNVML)
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(tmp_path / "runtime.json"))
    (tmp_path / "runtime.json").write_text('{"share_state": "%s"}' % (tmp_path / "share.json"))
    from provision.cli import main

    assert main(["k8s", "labels", "--format", "kubelet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--node-labels=") and "nvidia.com/gpu.product=NVIDIA-H200," in out


@needs("containerd")
def test_node_setup_idempotent_with_real_containerd(tmp_path):
    """`k8s node` on a scratch containerd config (the real `containerd config dump` checks it): handler nvidia
    through the engine adapter, the CDI spec and the labels file written under a scratch root; a second run changes
    nothing; the user's own setting survives."""

    from provision.inject import discover
    from provision.k8s import node
    from tests.conftest import H200

    disc = discover.discover(str(H200 / "usr/local/nvidia"), proc_root=str(H200), dev_root=str(H200))
    cfg = tmp_path / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('version = 2\nroot = "%s"\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
                   "  SystemdCgroup = true\n" % (tmp_path / "croot"))
    labels = L.gfd_labels(snap(tmp_path), L.Sharing())
    kw = dict(runtime_path="/usr/local/bin/gpuprov-runtime", default=False, cdi=True, disc=disc, labels=labels,
              config=str(cfg), root=str(tmp_path))
    first = node.setup("containerd", dry_run=False, **kw)
    assert any(c.startswith("containerd: ") for c in first.changed)
    assert f"wrote CDI spec {node.CDI_SPEC}" in first.changed and f"wrote labels {L.NFD_FILE}" in first.changed
    dump = subprocess.run(["containerd", "--config", str(cfg), "config", "dump"], capture_output=True, text=True)
    assert dump.returncode == 0, dump.stderr
    merged = __import__("tomllib").loads(dump.stdout) if sys.version_info >= (3, 11) else None
    if merged is not None:
        cri = merged["plugins"]["io.containerd.grpc.v1.cri"]
        nv = cri["containerd"]["runtimes"]["nvidia"]
        assert nv["options"]["BinaryName"] == "/usr/local/bin/gpuprov-runtime"
        assert nv["options"]["SystemdCgroup"] is True  # the runc entry's options carried over
        ver = re.search(r" v?(\d+)\.(\d+)", subprocess.run(["containerd", "--version"], capture_output=True,
                                                            text=True).stdout)
        # containerd learnt enable_cdi in 1.7: bookworm's 1.6 drops the key from its merged config
        assert cri.get("enable_cdi") is (True if tuple(map(int, ver.groups())) >= (1, 7) else None)
    spec = yaml.safe_load((tmp_path / node.CDI_SPEC.lstrip("/")).read_text())
    assert spec["kind"] == "nvidia.com/gpu" and {d["name"] for d in spec["devices"]} >= {"0", "all"}
    assert read_features_dir(tmp_path / L.NFD_FEATURES_DIR.lstrip("/")) == labels
    again = node.setup("containerd", dry_run=False, **kw)
    assert again.changed == []


@needs("containerd")
def test_node_cli_before_the_driver_loads(tmp_path):
    """A fresh node (no driver yet: Ansible's check mode, or before the reboot): the engine side is done, labels and
    the CDI spec are skipped with a warning, not a failure."""

    cfg = tmp_path / "config.toml"
    cfg.write_text("version = 2\n")
    env = {"GPUPROV_RUNTIME_CONFIG": str(tmp_path / "runtime.json"), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
           "GPUPROV_LOCK_DIR": str(tmp_path / "lock")}
    p = subprocess.run([sys.executable, "-m", "provision", "k8s", "node", "--engine", "containerd", "--config", str(cfg),
                        "--runtime-path", "/usr/local/bin/gpuprov-runtime", "--no-cdi", "--dry-run", "--json"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert "warning: no GPU labels" in p.stderr
    doc = __import__("json").loads(p.stdout)
    assert doc["labels_file"] is None and any("runtimes.nvidia" in c for c in doc["changed"])
    assert cfg.read_text() == "version = 2\n"  # a dry run changes nothing


@needs("containerd")
def test_verify_checks_the_cri_handler(tmp_path):
    """`gpuprov verify`'s CRI check on a node whose containerd config (a scratch one, read by the real
    `containerd config dump`) has, then lacks, gpuprov's handler."""

    from provision import engines
    from provision.engines.configure import configure
    from provision.verify.checks import LocalHost, cri_handler

    cfg = tmp_path / "config.toml"
    cfg.write_text("version = 2\n")

    class Node(LocalHost):  # this host's commands, with containerd reading the scratch config
        engine = engines.get("containerd")  # a containerd node (this machine's dockerd answers too: verify would call it Docker)

        def run(self, argv):
            scratch = ["containerd", "--config", str(cfg), "config", "dump"]
            return super().run(scratch if argv == ["containerd", "config", "dump"] else argv)

    r = cri_handler(Node())
    assert (r.status, r.detail) == ("fail", "containerd's merged config has no runtime 'nvidia': run gpuprov k8s node")
    configure("containerd", config=str(cfg), runtime_path="/usr/local/bin/gpuprov-runtime")
    r = cri_handler(Node())
    assert r.status == "pass" and r.detail.startswith("containerd handler 'nvidia'")


@pytest.mark.parametrize("mig", ["none", "single", "mixed"])
def test_mig_strategy_goes_into_the_plugin_config(mig):
    """`k8s manifests --mig-strategy`: the plugin's flags.migStrategy (main wrote "none" whatever was asked)."""
    st = settings()
    cfg = dpc.parse(yaml.safe_load(M.render_all(st, L.Sharing(), "envvar", mig_strategy=mig)["device-plugin-config.yaml"]))
    assert cfg["flags"]["migStrategy"] == mig
    with pytest.raises(UsageError, match="--mig-strategy 'both'"):
        M.decide_mig_strategy("both", L.Sharing())
    with pytest.raises(UsageError, match="cannot go with the device plugin's MPS"):  # the plugin refuses it too
        M.decide_mig_strategy("mixed", M.decide_sharing(st, "mps", 4))


def test_mig_labels_follow_gfd():
    """GFD's MIG labels, from the MIG devices' profiles (the h100-mig fixture's: 1g.10gb x2, 2g.20gb, 3g.40gb)."""
    snap = nvml.snapshot(FakeNVML())
    profiles = ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert "nvidia.com/mig.strategy" not in L.gfd_labels(snap, L.Sharing(), "none", profiles)
    mixed = L.gfd_labels(snap, L.Sharing(), "mixed", profiles)
    assert mixed["nvidia.com/mig.strategy"] == "mixed" and mixed["nvidia.com/mig-1g.10gb.count"] == "2"
    assert mixed["nvidia.com/mig-3g.40gb.product"] == "NVIDIA-H200-MIG-3g.40gb" and mixed["nvidia.com/gpu.count"] == "1"
    single = L.gfd_labels(snap, L.Sharing(), "single", ["1g.10gb"] * 7)
    assert single["nvidia.com/gpu.product"] == "NVIDIA-H200-MIG-1g.10gb" and single["nvidia.com/gpu.count"] == "7"
    with pytest.raises(Unsupported, match="one profile"):
        L.gfd_labels(snap, L.Sharing(), "single", profiles)
    with pytest.raises(Unsupported, match="profiles are unknown"):
        L.gfd_labels(snap, L.Sharing(), "mixed", [None])


def test_mig_attribute_labels_match_nvidias_h100_node():
    """GFD's per-profile MIG labels (memory, multiprocessors, slices, engines, replicas, sharing-strategy), from NVML's
    attributes of each MIG device (the fake answers the real H100's `nvidia-smi mig -lgip`), equal the labels NVIDIA's
    GPU Operator page shows for an H100 80GB HBM3 node with this layout's 1g.10gb x2 and 2g.20gb (fixture
    h100-mig/commands/gfd-labels-h100-mixed.txt). main wrote count and product only."""
    from tests.fake_nvml import FakeMigNVML

    snap = nvml.snapshot(FakeMigNVML(), kmsg="/nonexistent")
    profiles = [d.profile for d in snap.gpus[0].mig_devices]
    mixed = L.gfd_labels(snap, L.Sharing(), "mixed", profiles)
    doc = MIG_FIXTURE / "commands/gfd-labels-h100-mixed.txt"
    want = dict(line.split("=", 1) for line in doc.read_text().splitlines() if line and not line.startswith("#"))
    assert len(want) == 20 and {k: mixed.get(k) for k in want} == want
    assert (mixed["nvidia.com/mig-3g.40gb.memory"], mixed["nvidia.com/mig-3g.40gb.multiprocessors"],
            mixed["nvidia.com/mig-3g.40gb.slices.gi"]) == ("40448", "60", "3")  # -lgip's 3g.40gb row
    single = L.gfd_labels(snap, L.Sharing(), "single", ["1g.10gb"] * 7)
    assert (single["nvidia.com/gpu.memory"], single["nvidia.com/gpu.multiprocessors"],
            single["nvidia.com/gpu.slices.ci"], single["nvidia.com/gpu.engines.jpeg"],
            single["nvidia.com/gpu.engines.ofa"]) == ("9984", "16", "1", "1", "0")  # the MIG device's, not the GPU's
    assert not any(".engines." in k for k in L.gfd_labels(snap, L.Sharing(), "none", profiles))


def test_labels_cli_mixed_reads_the_mig_layout(tmp_path, monkeypatch, capsys):
    """`k8s labels --mig-strategy mixed` on the h100-mig fixture: the profiles come from the runtime's discovery."""
    import json

    from provision.inject import mig
    from tests.conftest import H200
    from tests.fake_nvml import FakeMigNVML
    from tests.inject_helpers import MIG_FIXTURE, mig_proc

    monkeypatch.setattr(nvml, "load", FakeMigNVML)
    monkeypatch.setattr(mig, "identify", lambda layout, gpus: mig.merge(
        layout, mig.read_nvml(FakeMigNVML(), [g.uuid for g in gpus]), gpus))
    (tmp_path / "p").mkdir()
    cfg = {"share_state": str(tmp_path / "share.json"), "driver_root": str(H200 / "usr/local/nvidia"),
           "proc_root": mig_proc(tmp_path / "p"), "dev_root": str(MIG_FIXTURE)}
    (tmp_path / "runtime.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(tmp_path / "runtime.json"))
    from provision.cli import main

    assert main(["k8s", "labels", "--format", "json", "--mig-strategy", "mixed"]) == 0
    labels = json.loads(capsys.readouterr().out)
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert (labels["nvidia.com/mig-1g.10gb.count"], labels["nvidia.com/mig-2g.20gb.count"],
            labels["nvidia.com/mig-3g.40gb.count"]) == ("2", "1", "1")
    assert (labels["nvidia.com/mig-2g.20gb.memory"], labels["nvidia.com/mig-1g.10gb.engines.decoder"]) == ("20096", "1")


@needs("containerd")
@pytest.mark.parametrize("keep", [False, True])
def test_node_turns_env_selection_off_unless_kept(tmp_path, keep):
    """A Kubernetes node is multi-tenant: `k8s node` turns accept_env_unprivileged off (a pod's own
    NVIDIA_VISIBLE_DEVICES=all would otherwise reach every GPU, the other tenants' too); --accept-env-unprivileged
    keeps it on. Dry run: said, not done; set_setting does it, checked as the runtime reads the file."""
    import json

    from provision.inject.settings import load_settings, set_setting

    cfg = tmp_path / "config.toml"
    cfg.write_text("version = 2\n")
    rt = tmp_path / "runtime.json"
    rt.write_text(json.dumps({"runc": "/usr/sbin/runc", "accept_env_unprivileged": True}))
    env = {"GPUPROV_RUNTIME_CONFIG": str(rt), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
           "GPUPROV_LOCK_DIR": str(tmp_path / "lock")}
    p = subprocess.run([sys.executable, "-m", "provision", "k8s", "node", "--engine", "containerd", "--config", str(cfg),
                        "--runtime-path", "/usr/local/bin/gpuprov-runtime", "--no-cdi", "--dry-run", "--json",
                        *(["--accept-env-unprivileged"] if keep else [])], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    said = [c for c in json.loads(p.stdout)["changed"] if "accept_env_unprivileged" in c]
    assert said == ([] if keep else [f"would set accept_env_unprivileged false in {rt}"])
    assert json.loads(rt.read_text())["accept_env_unprivileged"] is True  # a dry run changes nothing
    assert set_setting("accept_env_unprivileged", keep, str(rt)) is (not keep)
    assert load_settings(str(rt)).accept_env_unprivileged is keep and load_settings(str(rt)).runc == "/usr/sbin/runc"
