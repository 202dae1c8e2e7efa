"""Issue 38 items 5 and 6: the discovery cache follows what it depends on, read before it is built; a wedged driver
costs one deadline, not two. On copies of the H200 capture (real /proc text, real mknod nodes, the driver root's
file names) whose nvidia-smi (tests/fake_nvidia_smi.py, NVML's boundary) can also change the host while discovery
waits for it: the race made deterministic, without timing. Each test failed on main before this change (488315c).

5. a) the host changes while the cache is being rebuilt (nvidia-uvm or nvidia-modeset loads, nvidia-persistenced
      starts, a userspace upgrade lands): main read the key after discovery and stored the old answer under the new
      key (every compute container refused until the next reboot, or display and utility containers silently short);
   b) the userspace is upgraded under the loaded module after the cache was built: main kept mounting library paths
      that no longer existed (no libcuda, silently); now the container is refused in one line naming both versions;
   c) a /dev entry discovery looked for appears later (the runtime makes /dev/nvidia-modeset, udev makes /dev/dri/*,
      nvidia-persistenced starts): main kept the cached "absent" for the whole boot.
6. nvidia-smi never answers: main asked for the arch, then the brand, 5 s each; now one deadline in all, and a
   one-line warning."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from provision.errors import Refused
from provision.inject import discover, modify
from tests.conftest import H200
from tests.inject_helpers import (
    compiled_front_end,
    driver_root_with_smi,
    fake_dev,
    fake_runc,
    gpu_bundle,
    runc_calls,
    settings,
    stop_editors,
    write_settings,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, a root-owned nvidia-smi)")

OLD, NEW = "580.159.04", "580.200.01"  # the loaded module's version; the upgrade's (an unattended upgrade)
COMPUTE = ["NVIDIA_DRIVER_CAPABILITIES=compute,utility"]
DISPLAY = ["NVIDIA_DRIVER_CAPABILITIES=display,utility"]
GRAPHICS = ["NVIDIA_DRIVER_CAPABILITIES=graphics,utility"]
FAKE_SMI = Path(__file__).resolve().parents[1] / "fake_nvidia_smi.py"
REFUSED = 10  # the runtime's exit code for a refused container (README)


class Host:
    """A host copy: proc (its /proc and /sys), dev (its /dev), drv (its driver root, nvidia-smi answering the
    capture), cache; `smi_does(code)` makes nvidia-smi first run `code` (Python, once) when discovery asks it."""

    def __init__(self, base: Path, uvm: bool = True, modules: tuple[str, ...] = ()):
        self.base = base
        self.proc = base / "host"
        shutil.copytree(H200 / "proc", self.proc / "proc", symlinks=True)
        shutil.copytree(H200 / "sys", self.proc / "sys", symlinks=True)
        if not uvm:
            for name, needle in (("devices", "nvidia-uvm"), ("modules", "nvidia_uvm")):
                p = self.proc / "proc" / name
                p.write_text("".join(x for x in p.read_text().splitlines(True) if needle not in x))
        for m in modules:
            self.load(m)
        self.dev = fake_dev(base)
        self.drv = driver_root_with_smi(base)
        self.cache = base / "discovery.json"

    def load(self, module: str) -> None:
        p = self.proc / "proc/modules"
        p.write_text(f"{module} 1 - - Live 0x0 (O)\n" + p.read_text())

    def settings(self, **over):
        return settings(self.base, driver_root=str(self.drv), proc_root=str(self.proc), dev_root=str(self.dev),
                        cache=str(self.cache), **over)

    def smi_does(self, code: str) -> None:
        flip = self.base / "flip.py"
        flip.write_text(code)
        smi = self.drv / "bin/nvidia-smi"  # both queries run it, at once: the marker lets one of them do it
        smi.write_text(f"#!/bin/sh\nmkdir {self.base}/flipped 2>/dev/null && {sys.executable} -I -S {flip}\n"
                       f'exec {sys.executable} -I -S {FAKE_SMI} "$@"\n')
        smi.chmod(0o755)

    def smi_hangs(self, only: str | None = None) -> None:
        """nvidia-smi never answers (a wedged GPU), or only to queries whose first argument is `only`; each call is
        counted (smi_calls)."""
        smi = self.drv / "bin/nvidia-smi"
        hang = "exec sleep 600\n"
        body = f'[ "$1" = "{only}" ] || {hang}' if only else hang
        smi.write_text(f'#!/bin/sh\necho "$*" >> {self.base}/smi-calls\n{body}'
                       f'exec {sys.executable} -I -S {FAKE_SMI} "$@"\n')
        smi.chmod(0o755)

    def smi_calls(self) -> int:
        p = self.base / "smi-calls"
        return len(p.read_text().splitlines()) if p.exists() else 0

    def fake_modprobe(self) -> None:
        """The kernel's modprobe: `modprobe nvidia-uvm` lists the module and its major, as the kernel does."""
        exe = self.base / "modprobe"
        exe.write_text(f'#!/bin/sh\n[ "$1" = nvidia-uvm ] || exit 1\n'
                       f'echo "nvidia_uvm 1830912 - - Live 0xffffffffc080c000 (O)" >> {self.proc}/proc/modules\n'
                       f'sed -i "s/^195 nvidiactl$/195 nvidiactl\\n238 nvidia-uvm/" {self.proc}/proc/devices\n')
        exe.chmod(0o755)
        (self.proc / "proc/sys/kernel").mkdir(parents=True, exist_ok=True)
        (self.proc / "proc/sys/kernel/modprobe").write_text(f"{exe}\n")

    def start(self, env: list[str], warn=None, **over) -> dict:
        """One container create through the runtime's modifiers (the editor's code); the edited config."""
        b = gpu_bundle(self.base, f"b{len(list(self.base.glob('b*')))}", env)
        kw = {"warn": warn} if warn is not None else {}
        modify.modify_bundle(str(b), self.settings(**over), **kw)
        return json.loads((b / "config.json").read_text())


def devices(cfg: dict) -> set[str]:
    return {d["path"] for d in cfg.get("linux", {}).get("devices", [])}


def sources(cfg: dict) -> dict[str, str]:
    return {m["destination"]: m["source"] for m in cfg.get("mounts", [])}


# --- what changes the host, as Python run by nvidia-smi while discovery waits for it (or by the test itself) ---

def uvm_loads(h: Host) -> str:
    return (f"from pathlib import Path\nroot = Path({str(h.proc)!r}) / 'proc'\n"
            "(root / 'modules').write_text('nvidia_uvm 1830912 - - Live 0x0 (O)\\n' + (root / 'modules').read_text())\n"
            "d = root / 'devices'\nd.write_text(d.read_text().replace('195 nvidiactl\\n', "
            "'195 nvidiactl\\n238 nvidia-uvm\\n'))\n")


def modeset_loads(h: Host) -> str:
    return (f"import os\nfrom pathlib import Path\nm = Path({str(h.proc)!r}) / 'proc/modules'\n"
            "m.write_text('nvidia_modeset 1 - - Live 0x0 (O)\\n' + m.read_text())\n"
            f"os.mknod({str(h.dev / 'dev/nvidia-modeset')!r}, 0o20666, os.makedev(195, 254))\n")


def persistenced_starts(h: Host) -> str:
    sock = h.dev / "var/run/nvidia-persistenced/socket"
    return (f"import os, socket\nos.makedirs({str(sock.parent)!r}, exist_ok=True)\nos.chdir({str(sock.parent)!r})\n"
            "socket.socket(socket.AF_UNIX).bind('socket')\n")  # relative: a pytest path passes AF_UNIX's 108 bytes


def upgrade_lands(h: Host, old: str = OLD, new: str = NEW) -> str:
    """What dpkg's unpack of the new userspace does to the driver root: every versioned name renamed, every link
    that named one retargeted (and the old firmware directory replaced by the new one)."""
    return f"""import os
from pathlib import Path
root = Path({str(h.drv)!r})
for p in sorted((root / "lib64").iterdir()):
    if p.is_symlink() and os.readlink(p).endswith({old!r}):
        target = os.readlink(p)[:-len({old!r})] + {new!r}
        p.unlink()
        os.symlink(target, p)
    elif p.name.endswith({old!r}):
        p.rename(p.with_name(p.name[:-len({old!r})] + {new!r}))
fw = root / "firmware/nvidia" / {old!r}
if fw.exists():
    fw.rename(fw.with_name({new!r}))
"""


def userspace_removed(h: Host) -> str:
    return (f"from pathlib import Path\nfor p in (Path({str(h.drv)!r}) / 'lib64').iterdir():\n"
            f"    if {OLD!r} in p.name or {OLD!r} in str(p.readlink() if p.is_symlink() else ''):\n"
            "        p.unlink()\n")


def run(code: str) -> None:
    subprocess.run([sys.executable, "-I", "-S", "-c", code], check=True)


def assert_cache_tells_the_truth(h: Host) -> None:
    """Whatever the cache holds under the current key is what discovery finds now."""
    cached = discover.load_cached(str(h.cache), str(h.proc))
    if cached is None:
        return
    now = discover.discover(str(h.drv), proc_root=str(h.proc), dev_root=str(h.dev))
    for part in ("version", "userspace", "nodes", "libraries", "persistenced"):
        assert getattr(cached, part) == getattr(now, part), f"the cache lies about {part}"


# --- 5 a) the key is read before discovery, and the result stored only if it did not move ---

def test_uvm_loading_while_the_cache_is_rebuilt_is_never_stored_as_absent(tmp_path):
    """The field case: nvidia-uvm loads while the first compute start rebuilds the cache. main stored "no uvm" under
    the key of a host that has it, and refused every compute container from then on."""
    h = Host(tmp_path, uvm=False)
    h.smi_does(uvm_loads(h))
    for _ in range(2):  # the start that rebuilt the cache, and the next one, from the cache
        cfg = h.start(COMPUTE)
        assert {"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} <= devices(cfg)
    assert (tmp_path / "flipped").exists()  # the host did change during discovery
    assert discover.load_cached(str(h.cache), str(h.proc)).nodes.uvm is not None
    assert_cache_tells_the_truth(h)


@pytest.mark.parametrize("change", ["nvidia-modeset loads", "nvidia-persistenced starts", "an upgrade lands"])
def test_a_host_changing_during_discovery_never_leaves_a_cache_that_lies(tmp_path, change):
    h = Host(tmp_path)
    h.smi_does({"nvidia-modeset loads": modeset_loads, "nvidia-persistenced starts": persistenced_starts,
                "an upgrade lands": upgrade_lands}[change](h))
    if change == "an upgrade lands":  # the refresh saw the new userspace: this start is refused, not short of libcuda
        with pytest.raises(Refused) as exc:
            h.start(COMPUTE)
        assert OLD in str(exc.value) and NEW in str(exc.value)
    else:
        cfg = h.start(DISPLAY if change == "nvidia-modeset loads" else COMPUTE)
        if change == "nvidia-modeset loads":
            assert "/dev/nvidia-modeset" in devices(cfg)
        else:
            assert sources(cfg)["/var/run/nvidia-persistenced/socket"] == \
                str(h.dev / "var/run/nvidia-persistenced/socket")
    assert (tmp_path / "flipped").exists()
    assert_cache_tells_the_truth(h)


def test_refresh_stores_only_under_a_key_that_held(tmp_path):
    """The mechanism itself: a refresh whose host moved under it rediscovers, and what it stores is current."""
    h = Host(tmp_path, uvm=False)
    h.smi_does(uvm_loads(h))
    disc = discover.refresh(str(h.drv), str(h.cache), str(h.proc), str(h.dev))
    assert disc.nodes.uvm is not None  # this start's answer is the host after the change
    assert discover.load_cached(str(h.cache), str(h.proc)) == disc
    assert_cache_tells_the_truth(h)


# --- 5 b) the userspace upgraded under the loaded module, after the cache was built ---

@pytest.mark.parametrize("change", ["upgraded", "downgraded", "removed"])
def test_userspace_changed_under_the_loaded_module_is_refused_not_mounted_from_memory(tmp_path, change):
    h = Host(tmp_path)
    assert "/usr/lib/x86_64-linux-gnu/libcuda.so.1" in sources(h.start(COMPUTE))  # the cache is built and used
    assert discover.load_cached(str(h.cache), str(h.proc)) is not None
    run({"upgraded": upgrade_lands(h), "downgraded": upgrade_lands(h, OLD, "570.195.03"),
         "removed": userspace_removed(h)}[change])
    with pytest.raises(Refused) as exc:
        h.start(COMPUTE)
    msg = str(exc.value)
    assert "\n" not in msg and OLD in msg
    if change == "removed":
        assert f"no libcuda.so.{OLD}" in msg
    else:
        new = NEW if change == "upgraded" else "570.195.03"
        assert f"loaded kernel module is {OLD} but the driver's libraries are {new}" in msg
        assert "reboot" in msg and f"reinstall the {OLD} userspace" in msg
    assert_cache_tells_the_truth(h)


# --- 5 c) a /dev entry discovery looked for appears after the cache was built ---

def test_modeset_node_made_by_the_runtime_reaches_display_containers(tmp_path):
    """After a boot with nvidia-modeset loaded but /dev/nvidia-modeset never made: the runtime makes it on the first
    display start; main's cached "no modeset" then kept it from every display container, without a word."""
    h = Host(tmp_path, modules=("nvidia_modeset",))
    assert not (h.dev / "dev/nvidia-modeset").exists()
    said = []
    for _ in range(2):
        cfg = h.start(DISPLAY, warn=said.append)
        assert "/dev/nvidia-modeset" in devices(cfg), said
    assert os.stat(h.dev / "dev/nvidia-modeset").st_rdev == os.makedev(195, 254)
    assert said == []
    assert_cache_tells_the_truth(h)


@pytest.mark.parametrize("late", ["nvidia-persistenced", "udev's /dev/dri nodes"])
def test_dev_entries_that_appear_later_are_picked_up(tmp_path, late):
    h = Host(tmp_path, modules=("nvidia_drm",))
    drm = h.proc / "sys/bus/pci/devices/0000:00:06.0/drm"
    (drm / "card1").mkdir(parents=True)
    (drm / "renderD128").mkdir()
    env = GRAPHICS if late.startswith("udev") else COMPUTE
    cfg = h.start(env)  # the cache is built before the entry is there
    assert "/dev/dri/card1" not in devices(cfg) and "/var/run/nvidia-persistenced/socket" not in sources(cfg)
    if late == "nvidia-persistenced":
        run(persistenced_starts(h))
    else:
        (h.dev / "dev/dri").mkdir()
        os.mknod(h.dev / "dev/dri/card1", 0o20666, os.makedev(226, 1))
        os.mknod(h.dev / "dev/dri/renderD128", 0o20666, os.makedev(226, 128))
    cfg = h.start(env)
    if late == "nvidia-persistenced":
        assert "/var/run/nvidia-persistenced/socket" in sources(cfg)
    else:
        assert {"/dev/dri/card1", "/dev/dri/renderD128"} <= devices(cfg)
    assert_cache_tells_the_truth(h)


# --- 6. a wedged driver: one deadline ---

DEADLINE_S = 2.0  # discover.ARCH_TIMEOUT_S for the in-process cases (the front-end case below runs at the real 5 s)


@pytest.mark.parametrize("case", ["wedged", "wedged, nvidia-uvm not loaded yet", "wedged, MIG instances to name",
                                  "only the XML report hangs"])
def test_a_wedged_driver_costs_one_deadline(tmp_path, monkeypatch, case):
    monkeypatch.setattr(discover, "ARCH_TIMEOUT_S", DEADLINE_S)
    if "MIG" in case:  # NVML's child for the MIG names (mig.identify) waits out its own deadline on a wedged driver
        from provision.inject import mig

        monkeypatch.setattr(mig, "identify", lambda layout, gpus: time.sleep(DEADLINE_S) or layout)
    h = Host(tmp_path, uvm="uvm" not in case)
    h.smi_hangs(only="--query-gpu=pci.bus_id,compute_cap" if case.startswith("only") else None)
    if "uvm" in case:
        h.fake_modprobe()  # the start loads nvidia-uvm, and the host key moves: rediscovered, not asked twice
    said = []
    t = time.monotonic()
    cfg = h.start(COMPUTE, warn=said.append)
    took = time.monotonic() - t
    assert took < 1.6 * DEADLINE_S, f"{took:.1f} s: more than one deadline ({DEADLINE_S} s)"
    assert "/dev/nvidia0" in devices(cfg) and "/dev/nvidia-uvm" in devices(cfg)
    assert len(said) == 1 and "\n" not in said[0] and f"within {DEADLINE_S:g} s" in said[0], said
    assert h.smi_calls() == 2  # each question once, however many times this start rediscovered
    disc = discover.load_cached(str(h.cache), str(h.proc))
    if case.startswith("only"):  # the arch came, the brand did not: one lost, not both
        assert [g.arch for g in disc.gpus] == ["9.0"] and [g.brand for g in disc.gpus] == [None]
        assert "brand" in said[0] and "compute capability" not in said[0]
    else:
        assert [g.arch for g in disc.gpus] == [None]
    h.start(COMPUTE, warn=said.append)  # the cache answers: the driver is not asked again
    assert h.smi_calls() == 2 and len(said) == 1


@pytest.fixture
def front(tmp_path):
    rt = compiled_front_end(tmp_path, str(fake_runc(tmp_path)))
    yield rt
    stop_editors(tmp_path / "runtime.json")


def create(front: Path, base: Path, bundle: Path) -> tuple[subprocess.CompletedProcess, list[dict], float]:
    """`gpuprov-runtime create` as an engine runs it (the compiled front-end, its editor, the runc stand-in)."""
    log = base / f"{bundle.name}.log.json"
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "GPUPROV_RUNTIME_CONFIG": str(base / "runtime.json")}
    calls = len(runc_calls(base))
    t = time.monotonic()
    r = subprocess.run([str(front), "--root", "/run/x", "--log", str(log), "--log-format", "json", "create", "--bundle",
                        str(bundle), bundle.name], env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t
    assert (len(runc_calls(base)) > calls) == (r.returncode == 0), r.stderr  # runc runs exactly when not refused
    return r, [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else [], took


def test_first_start_on_a_wedged_driver_through_the_runtime(tmp_path, front):
    """The field case end to end: the first GPU start on a driver whose nvidia-smi never answers took 10.0-10.3 s on
    main (the arch query, then the brand query, 5 s each); now about one deadline, with one warning in the log."""
    h = Host(tmp_path)
    h.smi_hangs()
    write_settings(tmp_path, runc=str(tmp_path / "fake-runc"), driver_root=str(h.drv), proc_root=str(h.proc),
                   dev_root=str(h.dev), cache=str(h.cache))
    r, log, took = create(front, tmp_path, gpu_bundle(tmp_path, "first", COMPUTE))
    assert r.returncode == 0, r.stderr
    assert took < 1.6 * discover.ARCH_TIMEOUT_S, f"{took:.1f} s: more than one deadline"
    warnings = [x["msg"] for x in log if x["level"] == "warning"]
    assert len(warnings) == 1 and "did not answer within 5 s" in warnings[0], log


def test_upgrade_under_the_warm_editor_is_refused_in_one_line(tmp_path, front):
    """The warm editor keeps its parse of the cache: the upgrade must still reach it, as a one-line refusal naming
    both versions and the fix (main started the container without libcuda)."""
    h = Host(tmp_path)
    write_settings(tmp_path, runc=str(tmp_path / "fake-runc"), driver_root=str(h.drv), proc_root=str(h.proc),
                   dev_root=str(h.dev), cache=str(h.cache))
    for name in ("cold", "warm"):
        r, _, _ = create(front, tmp_path, gpu_bundle(tmp_path, name, COMPUTE))
        assert r.returncode == 0, r.stderr
    run(upgrade_lands(h))
    b = gpu_bundle(tmp_path, "upgraded", COMPUTE)
    r, log, _ = create(front, tmp_path, b)
    assert r.returncode == REFUSED, r.stderr
    errors = [x["msg"] for x in log if x["level"] == "error"]
    assert len(errors) == 1 and "\n" not in errors[0], log
    assert OLD in errors[0] and NEW in errors[0] and "reboot" in errors[0] and "reinstall" in errors[0]
