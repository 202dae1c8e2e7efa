"""The typed runtime (issue 20, item 3): the edits' records and their OCI/CDI forms, each modifier of
modify.MODIFIERS on its own, the OCI shape table, the one version parser, and errors as exceptions with exit codes
(reported at the edge, the warm editor's reply built without touching sys.stderr)."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

from provision import errors, versions
from provision.inject import discover, edits, modify, server, shim
from provision.inject.settings_file import SettingsInvalid
from tests.conftest import H200
from tests.inject_helpers import settings, write_settings

ROOT = str(H200 / "usr/local/nvidia")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod (the fake host's device nodes)")


@pytest.fixture(scope="module")
def disc():
    return discover.discover(ROOT, proc_root=str(H200), dev_root=str(H200))


def config(env: list[str], **extra) -> dict:
    return {"root": {"path": "rootfs"}, "process": {"env": ["PATH=/usr/bin:/bin", *env],
                                                   "capabilities": {"bounding": ["CAP_CHOWN"]}},
            "mounts": [], "linux": {}, **extra}


def start(tmp_path, env: list[str], **over) -> modify.Start:
    r = tmp_path / "bundle" / "rootfs"
    for d in ("usr/lib", "usr/bin", "etc"):
        (r / d).mkdir(parents=True, exist_ok=True)
    (r / "etc/debian_version").write_text("12.0\n")
    cfg = over.pop("cfg", None) or config(env)
    return modify.Start(cfg, str(tmp_path / "bundle"), settings(tmp_path, **over), lambda m: None)


def planned(tmp_path, env: list[str], **over) -> modify.Start:
    """A Start that went through the modifiers up to plan_edits, as modify_config runs them."""
    s = start(tmp_path, env, **over)
    for m in (modify.remove_hook, modify.alias_aliyun, modify.select_devices, modify.plan_edits):
        assert m(s)
    return s


# --- the records ---

def test_records_and_their_json_forms():
    node = edits.DeviceNode("/dev/nvidia0", 195, 0)
    assert node.oci() == {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 0o666,
                          "uid": 0, "gid": 0}
    assert node.cdi() == {"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0,
                          "permissions": "rw"}
    assert edits.CgroupRule(195, 0, "rwm").oci() == {"allow": True, "type": "c", "major": 195, "minor": 0,
                                                     "access": "rwm"}
    m = edits.Mount("/host/libcuda.so.580", "/usr/lib64/libcuda.so.1", edits.LIB_RO)
    assert m.oci() == {"destination": "/usr/lib64/libcuda.so.1", "source": "/host/libcuda.so.580", "type": "bind",
                       "options": ["ro", "nosuid", "nodev", "bind"]}
    assert m.cdi("/usr/lib/x86_64-linux-gnu/libcuda.so.1") == {
        "hostPath": "/host/libcuda.so.580", "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "options": ["ro", "nosuid", "nodev", "bind"]}
    assert edits.EnvVar("NVIDIA_VISIBLE_DEVICES", "none").oci() == "NVIDIA_VISIBLE_DEVICES=none"
    with pytest.raises(AttributeError):
        node.path = "/dev/sda"  # immutable: the warm editor shares them between containers
    assert m.oci()["options"] is not m.oci()["options"]  # each config gets its own list


def test_compute_edits_gives_typed_records(disc):
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "0"})
    assert isinstance(e, edits.Edits)
    assert e.devices[-1] == edits.DeviceNode("/dev/nvidia0", 195, 0)
    assert [(r.major, r.minor) for r in e.rules] == [(d.major, d.minor) for d in e.devices]
    assert all(isinstance(m, edits.Mount) and m.options == edits.LIB_RO for m in e.mounts)
    assert [v.name for v in e.env] == ["NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"]
    assert edits.compute_edits(disc, {}) is None


def test_persistenced_socket_defined_once(disc, tmp_path):
    from dataclasses import replace

    from provision.inject.cdi import generate_spec

    d = replace(disc, persistenced="/run/nvidia-persistenced/socket")
    ipc = edits.persistenced_mount(d)
    assert ipc == edits.Mount("/run/nvidia-persistenced/socket", edits.PERSISTENCED_SOCKET, edits.IPC_OPTS)
    assert ipc in edits.compute_edits(d, {"NVIDIA_VISIBLE_DEVICES": "0"}).mounts
    assert ipc not in edits.compute_edits(d, {"NVIDIA_VISIBLE_DEVICES": "0",
                                              "NVIDIA_DRIVER_CAPABILITIES": "compute"}).mounts  # utility only
    assert ipc.cdi() in generate_spec(d)["containerEdits"]["mounts"]
    assert edits.persistenced_mount(disc) is None


# --- the modifiers, each on its own ---

def test_modifiers_run_in_order():
    assert [m.__name__ for m in modify.MODIFIERS] == ["remove_hook", "alias_aliyun", "select_devices", "plan_edits",
                                                      "add_devices", "add_mounts", "mask_paths", "override_image_cache",
                                                      "set_env", "share_gpus"]


@needs_root
def test_remove_hook(tmp_path):
    ours = tmp_path / modify.HOOK_NAME
    ours.write_bytes(b"#!/bin/sh\n# gpuprov-hook\n")
    other = {"path": "/usr/bin/other-hook"}
    s = start(tmp_path, [], cfg=config([], hooks={"prestart": [{"path": str(ours)}, other]}))
    assert modify.remove_hook(s) and s.changed and s.config["hooks"]["prestart"] == [other]
    nvidia = tmp_path / "nvidia" / modify.HOOK_NAME
    nvidia.parent.mkdir()
    nvidia.write_bytes(b"\x7fELF NVIDIA's own")
    s = start(tmp_path, [], cfg=config([], hooks={"prestart": [{"path": str(nvidia)}]}))
    assert not modify.remove_hook(s) and not s.changed  # NVIDIA's toolkit does the whole job
    assert s.config["hooks"]["prestart"] == [{"path": str(nvidia)}]
    s = start(tmp_path, [])
    assert modify.remove_hook(s) and not s.changed


@needs_root
def test_alias_aliyun(tmp_path):
    s = start(tmp_path, ["ALIYUN_COM_GPU_VISIBLE_DEVICES=0"])
    assert modify.alias_aliyun(s) and s.env["NVIDIA_VISIBLE_DEVICES"] == "0"
    s = start(tmp_path, ["ALIYUN_COM_GPU_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=none"])
    assert modify.alias_aliyun(s) and s.env["NVIDIA_VISIBLE_DEVICES"] == "none"  # NVIDIA's variable wins


@needs_root
def test_select_devices_policy(tmp_path):
    s = start(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"])
    assert modify.select_devices(s) and s.selectors == ["0"]
    s = start(tmp_path, ["PATH=/bin"])
    assert not modify.select_devices(s) and s.selectors is None  # no GPU: the other modifiers do not run
    s = start(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"], accept_env_unprivileged=False)
    assert not modify.select_devices(s)  # multi-tenant: an unprivileged container's env does not count
    listed = config(["NVIDIA_VISIBLE_DEVICES=0"])
    listed["mounts"] = [{"destination": f"{modify.DEVICE_LIST_DIR}/1", "source": "/dev/null", "type": "bind"}]
    s = start(tmp_path, [], cfg=listed, accept_env_unprivileged=False)
    assert modify.select_devices(s) and s.selectors == ["1"]  # the orchestrator's list counts
    s = start(tmp_path, ["GPUPROV_GPU_MEMORY=2G"])
    with pytest.raises(errors.Refused, match="requests no GPU"):
        modify.select_devices(s)


@needs_root
def test_plan_edits(tmp_path):
    s = planned(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"])
    assert s.changed and s.disc.version == "580.159.04" and isinstance(s.edits, edits.Edits)
    assert any(m.destination == f"{edits.DEBIAN_LIBDIR}/libcuda.so.1" for m in s.edits.mounts)  # the image's libdir
    assert s.config == config(["NVIDIA_VISIBLE_DEVICES=0"])  # planning changes nothing in the config


@needs_root
def test_add_devices(tmp_path):
    s = planned(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"])
    s.config["linux"]["devices"] = [{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255}]
    assert modify.add_devices(s)
    paths = [d["path"] for d in s.config["linux"]["devices"]]
    assert paths.count("/dev/nvidiactl") == 1 and "/dev/nvidia0" in paths
    assert {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rwm"} in \
        s.config["linux"]["resources"]["devices"]
    s = planned(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"], dev_root=str(tmp_path / "empty"))
    with pytest.raises(errors.Refused, match="missing on the host"):
        modify.add_devices(s)


@needs_root
def test_add_mounts(tmp_path):
    s = planned(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"])
    taken = f"{edits.DEBIAN_LIBDIR}/libcuda.so.1"
    s.config["mounts"] = [{"destination": taken, "source": "/theirs", "type": "bind"}]
    assert modify.add_mounts(s)
    mounts = s.config["mounts"]
    assert [m["source"] for m in mounts if m["destination"] == taken] == ["/theirs"]  # theirs kept
    assert {"destination": "/usr/bin/nvidia-smi", "source": f"{ROOT}/bin/nvidia-smi", "type": "bind",
            "options": ["ro", "nosuid", "nodev", "bind"]} in mounts
    assert len(mounts) == len({m["destination"] for m in mounts})


@needs_root
def test_set_env(tmp_path):
    s = planned(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=utility"])
    assert modify.set_env(s)
    assert s.env["NVIDIA_VISIBLE_DEVICES"] == "GPU-266c8396-dfbe-13b3-5ad6-311117e6bd98"
    assert s.env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


@needs_root
def test_share_gpus_off(tmp_path):
    s = planned(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0", "CUDA_MPS_PIPE_DIRECTORY=/tmp/theirs"],
                share_state=str(tmp_path / "none.json"))
    assert modify.share_gpus(s) and "CUDA_MPS_PIPE_DIRECTORY" not in s.env  # never the container's own pipes
    s = planned(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0", "GPUPROV_GPU_MEMORY=2G"],
                share_state=str(tmp_path / "none.json"))
    with pytest.raises(errors.Refused, match="sharing is off"):
        modify.share_gpus(s)


@needs_root
def test_modify_config_writes_env_once_and_only_for_a_gpu(tmp_path):
    s = start(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0", "ALIYUN_COM_GPU_VISIBLE_DEVICES=0"])
    cfg = s.config
    assert modify.modify_config(cfg, s.bundle, s.settings)
    assert cfg["process"]["env"][:2] == ["PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=GPU-266c8396-dfbe-13b3-5ad6-"
                                         "311117e6bd98"]
    plain = config(["PATH=/bin", "ALIYUN_X=1"])
    assert not modify.modify_config(plain, s.bundle, s.settings) and plain == config(["PATH=/bin", "ALIYUN_X=1"])


# --- the OCI shape ---

@pytest.mark.parametrize("cfg,where", [
    ({"process": {"env": ["A=1", 5]}}, "process.env[1] must be a JSON string"),
    ({"process": {"user": {"uid": True}}}, "process.user.uid must be a JSON number"),
    ({"mounts": [{"destination": 1}]}, "mounts[0].destination must be a JSON string"),
    ({"linux": {"resources": {"devices": {}}}}, "linux.resources.devices must be a JSON array"),
    ({"hooks": {"prestart": [{"path": ["x"]}]}}, "hooks.prestart[0].path must be a JSON string"),
    ({"root": []}, "root must be a JSON object"),
])
def test_check_shape_names_the_field(cfg, where):
    with pytest.raises(ValueError, match="^" + re.escape(f"config.json: {where}") + "$"):
        modify.check_shape(cfg)


def test_check_shape_passes_runc_configs():
    modify.check_shape(config(["A=1"], hooks={"prestart": [{"path": "/x", "args": ["x", 1]}]},
                              linux={"resources": {"devices": [{"allow": False, "access": "rwm"}]}}))
    modify.check_shape({"process": {"user": {"uid": 0}}, "mounts": [{"destination": "/x", "options": ["ro"]}]})


# --- one version parser ---

@pytest.mark.parametrize("text,nums", [("580.159.04", (580, 159, 4)), ("12.2", (12, 2)), ("6.1.0-18-amd64", (6, 1, 0, 18)),
                                       ("5.15.0rc1", (5, 15, 0)), ("6.8.0-rc3", (6, 8, 0)), ("", ()), ("x1", ()),
                                       ("5.4.0-150-generic", (5, 4, 0, 150)), ("²", ())])
def test_numbers(text, nums):
    assert versions.numbers(text) == nums


def test_release_key_sorts_kernels_numerically_and_always_compares():
    rels = ["6.1.0-18-amd64", "6.1.0-9-amd64", "6.1.0-18-rt-amd64", "5.10.0-28-amd64", "6.1.0-rc1"]
    assert sorted(rels, key=versions.release_key) == ["5.10.0-28-amd64", "6.1.0-rc1", "6.1.0-9-amd64",
                                                      "6.1.0-18-amd64", "6.1.0-18-rt-amd64"]


def test_no_other_version_parser_in_the_runtime():
    src = "".join(open(f).read() for f in (edits.__file__, discover.__file__))
    assert "_vtuple" not in src and "from provision.inject.edits" not in open(discover.__file__).read()


# --- errors: exceptions with exit codes, reported at the edge ---

def test_errors_carry_their_exit_codes(tmp_path, monkeypatch):
    assert (errors.Refused.exit_code, errors.EditFailed.exit_code) == (errors.REQUIREMENT_FAILED, errors.INTERNAL)
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"process": {"env": {"NVIDIA_VISIBLE_DEVICES=all": 1}}}))
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(tmp_path / "none.json"))
    with pytest.raises(errors.Refused, match="none.json does not exist"):  # no settings: refused before any work
        shim.create_edits(str(bundle), print)
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(write_settings(tmp_path)))
    with pytest.raises(errors.EditFailed, match="^cannot prepare the GPU edits: config.json: process.env"):
        shim.create_edits(str(bundle), print)
    (tmp_path / "bad.json").write_text('{"nope": 1}')
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(tmp_path / "bad.json"))
    with pytest.raises(SettingsInvalid) as exc:
        shim.create_edits(str(bundle), print)
    assert exc.value.exit_code == errors.CONFIG_INVALID


def test_warm_reply_is_built_without_touching_stderr(tmp_path, monkeypatch):
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "config.json").write_text("[1]")
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(write_settings(tmp_path)))
    err = sys.stderr
    reply = server.handle(f"{bundle}\t\t\n".encode())
    assert sys.stderr is err
    assert reply == "1\tgpuprov-runtime: cannot prepare the GPU edits: config.json is not a JSON object\n"
    lines: list[str] = []
    assert shim.run_create_edits(str(bundle), None, None, lines.append) == 1 and len(lines) == 1


@needs_root
def test_a_reply_fits_the_front_ends_buffer(tmp_path, monkeypatch):
    """A refusal can quote the image's own env value in full; the reply line is clipped to server.MAX_REPLY, which
    shim.c's 4096-byte reply buffer holds (a longer line was taken for a hang-up) and which an empty socket buffer
    takes at once, so the editor's one write never blocks on a client that does not read."""
    monkeypatch.setenv("GPUPROV_RUNTIME_CONFIG", str(write_settings(tmp_path)))
    b = tmp_path / "b"
    (b / "rootfs").mkdir(parents=True)
    value = "GPU-" + "x" * 600_000
    (b / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "process": {
        "env": [f"NVIDIA_VISIBLE_DEVICES={value}"]}}))
    reply = server.handle(f"{b}\t\t\n".encode())
    assert reply.split("\t")[0] not in ("", "0") and reply.endswith("...\n") and reply.count("\n") == 1, reply[:200]
    assert len(reply.encode()) <= server.MAX_REPLY < 4096


def test_a_request_on_a_descriptor_past_1023_is_served():
    """The editor waits for a request with poll, not select (which refuses a descriptor past FD_SETSIZE, 1024, with
    a ValueError that would have ended the editor)."""
    import resource
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), max(hard, 1200)))
    ours, theirs = socket.socketpair()
    try:
        high = os.dup2(ours.fileno(), 1100)
        theirs.sendall(b"/b\t\t\n")
        server._serve_one(high, lambda data: f"0\t{data.decode().strip()}\n")
        os.close(high)
        assert theirs.recv(100) == b"0\t/b\n"
    finally:
        ours.close()
        theirs.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_oversized_request_gets_its_refusal_and_the_end_at_once():
    """An oversized request's refusal is followed by the end of the editor's side (shutdown), while the editor
    drains a little of what the client still sends: a client reading to the end does not wait for the drain."""
    import socket
    import threading

    ours, theirs = socket.socketpair()
    t = threading.Thread(target=server._serve_one, args=(ours.fileno(), lambda data: "0\t\n"))
    try:
        theirs.sendall(b"x" * (server.MAX_REQUEST + 100))
        t.start()
        theirs.settimeout(5)
        got = b""
        while chunk := theirs.recv(4096):
            got += chunk
        assert got == server.OVERSIZED
        theirs.sendall(b"more")  # the editor is still draining: its side ended before it closed
        theirs.shutdown(socket.SHUT_WR)
        t.join(timeout=5)
        assert not t.is_alive()
    finally:
        ours.close()
        theirs.close()
