"""/dev/char/MAJ:MIN links for NVIDIA's nodes (issue 26 item 1; provision/inject/devchar.py), on fixture dev roots
with real nodes (mknod: the suite runs as root). The daemon-reload proof itself, with systemd, Docker and containerd:
tests/integration/test_runtime_docker.py::test_gpu_survives_daemon_reload_with_dev_char_links."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from provision.inject import devchar
from provision.plan import uninstall
from provision.verify.checks import dev_char_result

# the H200 capture's nodes (tests/fixtures/hosts/h200-vm/commands/dev_nvidia.txt), plus nvidia-modeset
NODES = {"nvidia0": (195, 0), "nvidiactl": (195, 255), "nvidia-uvm": (238, 0), "nvidia-uvm-tools": (238, 1),
         "nvidia-modeset": (195, 254), "nvidia-caps/nvidia-cap1": (241, 1), "nvidia-caps/nvidia-cap2": (241, 2)}

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")


def _dev_root(tmp_path: Path, nodes=NODES) -> Path:
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for name, (a, b) in nodes.items():
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(a, b))
    (dev / "nvidia-fake").symlink_to("nvidia0")  # a link is no node
    os.mkfifo(dev / "nvidia9")  # a FIFO with a node's name: never opened, never linked
    return tmp_path


def test_every_nvidia_node_gets_its_link_recorded(tmp_path):
    root = _dev_root(tmp_path)
    rec = tmp_path / "run" / "links"
    res = devchar.link_nodes(str(root), record=str(rec))
    want = {f"{a}:{b}": f"../{n}" for n, (a, b) in NODES.items()}
    got = {p.name: os.readlink(p) for p in (root / "dev/char").iterdir()}
    assert got == want
    assert stat.S_IMODE((root / "dev/char").stat().st_mode) == 0o755
    for key in want:  # each link resolves to its node, as systemd's DeviceAllow=/dev/char/MAJ:MIN needs
        assert (root / "dev/char" / key).stat().st_rdev == os.makedev(*map(int, key.split(":")))
    assert sorted(res.made) == sorted(f"{root}/dev/char/{k}" for k in want)
    assert devchar.recorded(str(rec)) == [(p, want[p.rsplit("/", 1)[1]]) for p in res.made]
    again = devchar.link_nodes(str(root), record=str(rec))
    assert again.made == [] and sorted(again.ok) == sorted(res.made)


def test_a_dev_root_keeps_its_record_under_it(tmp_path, monkeypatch):
    """`runtime install --dev-root D` (as tests/k8s_cri.py's private runtime does on the CI host) notes its links
    under D, never in the host's /run/gpuprov: a host record there made the host's uninstall plan a dev-char step
    for a test's links (CI of session 8). The host record is moved to tmp so a regression cannot write the host."""
    host_record = tmp_path / "host-run" / "dev-char-links"
    monkeypatch.setattr(devchar, "RECORD", str(host_record))
    root = _dev_root(tmp_path / "fixture")
    res = devchar.link_nodes(str(root))
    assert res.made and not host_record.exists()
    assert [link for link, _ in devchar.recorded(devchar.record_for(str(root)))] == res.made
    assert devchar.record_for(str(root)) == str(root) + str(host_record)
    assert devchar.record_for("/") == str(host_record)


def test_only_the_named_node(tmp_path):
    """What the start path calls after making one node (fieldrt): that node's link, nothing else."""
    root = _dev_root(tmp_path)
    res = devchar.link_nodes(str(root), ["/dev/nvidia-uvm"], record=None)
    assert res.made == [f"{root}/dev/char/238:0"] and os.listdir(root / "dev/char") == ["238:0"]


def test_links_of_others_are_left_alone_and_never_uninstalled(tmp_path):
    root = _dev_root(tmp_path)
    char = root / "dev/char"
    char.mkdir(mode=0o755)
    (char / "195:0").symlink_to(f"{root}/dev/nvidia0")  # udev's or the operator's (absolute): right, kept
    (char / "195:255").symlink_to("../nvidia-uvm")  # someone's wrong link: left, reported
    rec = tmp_path / "links"
    res = devchar.link_nodes(str(root), record=str(rec))
    assert res.ok == [f"{root}/dev/char/195:0"] and res.other == [f"{root}/dev/char/195:255"]
    assert os.readlink(char / "195:255") == "../nvidia-uvm"
    check = devchar.check_links(str(root))
    assert dev_char_result(check.to_dict()).status == "fail" and "195:255 (taken by something else)" in \
        dev_char_result(check.to_dict()).detail
    # uninstall: ours only, and only while they still point where gpuprov pointed them
    os.unlink(char / "238:0")
    (char / "238:0").symlink_to("../nvidia-uvm")  # replaced by udev meanwhile with the same target: indistinguishable
    (char / "195:254").unlink()
    (char / "195:254").symlink_to("/dev/nvidia-modeset")  # replaced by someone else: theirs now
    ours = devchar.ours_now(str(rec))
    assert f"{root}/dev/char/195:254" not in ours and f"{root}/dev/char/195:0" not in ours
    gone = devchar.remove_links(str(rec))
    assert sorted(os.listdir(char)) == ["195:0", "195:254", "195:255"] and not rec.exists()
    assert f"{root}/dev/char/241:1" in gone


@pytest.mark.parametrize("plant", ["symlink", "file", "writable"])
def test_planted_dev_char_is_refused(tmp_path, plant):
    root = _dev_root(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    char = root / "dev/char"
    if plant == "symlink":
        char.symlink_to(elsewhere)
    elif plant == "file":
        char.write_text("x")
    else:
        char.mkdir()
        char.chmod(0o777)
    with pytest.raises(devchar.DevCharRefused, match="dev/char"):
        devchar.link_nodes(str(root), record=None)
    assert os.listdir(elsewhere) == []
    if plant == "writable":
        assert os.listdir(char) == []


@pytest.mark.alone  # a time bound: run with nothing beside it (conftest)
def test_a_fifo_in_dev_never_blocks(tmp_path):
    """Only lstat'ed: a FIFO named like a node (or in nvidia-caps) is no node and is never opened."""
    root = _dev_root(tmp_path, {"nvidia0": (195, 0)})
    os.mkfifo(root / "dev/nvidia-caps/nvidia-cap2")
    t = time.monotonic()
    res = devchar.link_nodes(str(root), record=None)
    assert time.monotonic() - t < 2 and [os.path.basename(p) for p in res.made] == ["195:0"]


def test_verify_names_the_fix(tmp_path):
    root = _dev_root(tmp_path)
    r = dev_char_result(devchar.check_links(str(root)).to_dict())
    assert r.status == "fail" and "gpuprov runtime dev-char-links" in r.detail and "daemon-reload" in r.detail
    assert not (root / "dev/char").exists()  # a check changes nothing
    devchar.link_nodes(str(root), record=None)
    assert dev_char_result(devchar.check_links(str(root)).to_dict()).status == "pass"
    assert dev_char_result(devchar.check_links(str(tmp_path / "none")).to_dict()).status == "skip"


def test_command_check_exit_and_quiet(tmp_path):
    root = _dev_root(tmp_path)
    gp = [sys.executable, "-m", "provision"]
    r = subprocess.run([*gp, "runtime", "dev-char-links", "--check", "--dev-root", str(root)], capture_output=True,
                       text=True)
    assert r.returncode == 10 and "run `gpuprov runtime dev-char-links`" in r.stderr, r.stdout + r.stderr
    r = subprocess.run([*gp, "runtime", "dev-char-links", "--quiet", "--dev-root", str(root)], capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert subprocess.run([*gp, "runtime", "dev-char-links", "--check", "--dev-root", str(root)]).returncode == 0
    (root / "dev/char").rename(root / "dev/char.old")
    (root / "dev/char").symlink_to("/tmp")
    r = subprocess.run([*gp, "runtime", "dev-char-links", "--dev-root", str(root)], capture_output=True, text=True)
    assert r.returncode == 6 and "gpuprov does not write through it" in r.stderr, r.stderr


def test_units_run_before_the_engines():
    units = devchar.dev_char_units("/usr/local/bin/gpuprov")
    unit = units[f"/etc/systemd/system/{devchar.UNIT}"]
    assert "ExecStart=/usr/local/bin/gpuprov runtime dev-char-links --quiet" in unit
    assert "Before=docker.service containerd.service crio.service" in unit and "Type=oneshot" in unit
    assert 'DEVPATH=="/bus/pci/drivers/nvidia"' in units[devchar.UDEV_RULE]
    assert devchar.UNIT in uninstall.UNITS


def test_uninstall_plans_only_its_links(tmp_path):
    """uninstall's step removes the recorded links that still point where gpuprov pointed them, and its rule."""
    root = tmp_path / "host"
    _dev_root(root)
    rec = Path(str(root) + devchar.RECORD)
    devchar.link_nodes(str(root), record=str(rec))
    # the record names host paths (/dev/char/…): rewrite it as the live host's would read
    rec.write_text("".join(f"/dev/char/{k} {os.readlink(root / 'dev/char' / k)}\n"
                           for k in sorted(os.listdir(root / "dev/char"))))
    (root / "dev/char/195:0").unlink()
    (root / "dev/char/195:0").symlink_to("/dev/nvidia0")  # someone else's now
    (root / "etc/udev/rules.d").mkdir(parents=True)
    (root / devchar.UDEV_RULE.lstrip("/")).write_text("x")
    steps = uninstall.dev_char_steps(root)
    assert len(steps) == 1
    argv = steps[0].actions[0].argv
    assert "/dev/char/195:255" in argv and devchar.UDEV_RULE in argv and "/dev/char/195:0" not in argv
