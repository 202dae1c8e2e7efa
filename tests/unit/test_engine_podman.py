"""Podman: the drop-in containers.conf.d/99-gpuprov.conf (tomlkit; names and paths validated), the operator's runtimes
and default theirs (exit 14), a later file overriding gpuprov's keys refused, the undo, and bootstrap's plan for a
Podman node: the distribution's podman (+ uidmap), the runtime registered but not made the default, the CDI spec,
no service to start, and the validation containers through CDI from a local image."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import tomllib

from provision.engines import podman
from provision.engines.base import RuntimeRequest
from provision.engines.configure import configure
from provision.errors import GpuprovError
from tests.conftest import run_cli

RT = "/usr/local/bin/gpuprov-runtime"
H200 = Path(__file__).resolve().parents[1] / "fixtures/hosts/h200-vm"


def files(d) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def tree(tmp_path, main: str | None = None, dropins: dict[str, str] | None = None) -> Path:
    """An etc/containers tree: containers.conf (`main`) and drop-ins by name; returns the drop-in directory."""
    etc = tmp_path / "etc/containers"
    (etc / "containers.conf.d").mkdir(parents=True)
    if main is not None:
        (etc / "containers.conf").write_text(main)
    for name, text in (dropins or {}).items():
        (etc / "containers.conf.d" / name).write_text(text)
    return etc / "containers.conf.d"


def test_dropin_written_checked_and_idempotent(tmp_path):
    d = tree(tmp_path, main='[engine]\ncgroup_manager = "cgroupfs"\n')
    res = configure("podman", config=str(d), runtime_path=RT, cdi=True)
    assert res.changed and res.verified is True and res.path == str(d / "99-gpuprov.conf")
    assert tomllib.loads((d / "99-gpuprov.conf").read_text()) == {"engine": {"runtimes": {"nvidia": [RT]}}}
    assert res.restart == "podman not running: the change applies when it starts"
    snapshot = files(tmp_path)
    assert not configure("podman", config=str(d), runtime_path=RT, cdi=True).changed
    assert files(tmp_path) == snapshot


def test_default_runtime_on_request(tmp_path):
    d = tree(tmp_path, main='[engine]\nruntime = "crun"\n')  # Podman's own default: not the operator's to protect
    configure("podman", config=str(d), runtime_path=RT, default=True)
    assert tomllib.loads((d / "99-gpuprov.conf").read_text())["engine"]["runtime"] == "nvidia"
    assert podman.effective(d / "99-gpuprov.conf")["runtime"] == "nvidia"


def test_operators_runtime_of_that_name_is_theirs(tmp_path):
    d = tree(tmp_path, main='[engine.runtimes]\nnvidia = ["/opt/theirs/nvidia-container-runtime"]\n')
    before = files(tmp_path)
    with pytest.raises(GpuprovError) as e:
        configure("podman", config=str(d), runtime_path=RT)
    assert e.value.exit_code == 14 and "\n" not in str(e.value) and "nvidia-container-runtime" in str(e.value)
    assert files(tmp_path) == before
    assert configure("podman", config=str(d), runtime_path=RT, replace=True).changed  # ours is read later: wins
    assert podman.effective(d / "99-gpuprov.conf")["runtimes"]["nvidia"] == [RT]


def test_operators_default_is_theirs(tmp_path):
    d = tree(tmp_path, main='[engine]\nruntime = "kata"\n')
    with pytest.raises(GpuprovError) as e:
        configure("podman", config=str(d), runtime_path=RT, default=True)
    assert e.value.exit_code == 14 and "kata" in str(e.value)
    assert configure("podman", config=str(d), runtime_path=RT).changed  # without --default: nothing of theirs


@pytest.mark.parametrize("late", ['[engine.runtimes]\nnvidia = ["/opt/other"]\n', '[engine]\nruntime = "crun"\n'])
def test_a_later_file_setting_our_keys_is_refused_even_with_replace(tmp_path, late):
    d = tree(tmp_path, dropins={"zz-local.conf": late})
    with pytest.raises(GpuprovError) as e:
        configure("podman", config=str(d), runtime_path=RT, default=True, replace=True)
    assert e.value.exit_code == 14 and "zz-local.conf is read after 99-gpuprov.conf" in str(e.value)
    assert not (d / "99-gpuprov.conf").exists()


def test_a_later_file_agreeing_with_us_is_fine(tmp_path):
    d = tree(tmp_path, dropins={"zz-local.conf": f'[engine.runtimes]\nnvidia = ["{RT}"]\n'})
    assert configure("podman", config=str(d), runtime_path=RT).verified is True


@pytest.mark.parametrize("name,path", [('nv"idia', RT), ("a/b", RT), ("nvidia", "relative/runtime"),
                                       ("nvidia", '/usr/bin/x"]\n[engine]\nruntime = "x')])
def test_hostile_names_refused(tmp_path, name, path):
    d = tree(tmp_path)
    with pytest.raises(GpuprovError) as e:
        configure("podman", config=str(d), runtime_name=name, runtime_path=path)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    assert files(tmp_path) == {}


def test_invalid_operator_file_refused_untouched(tmp_path):
    d = tree(tmp_path, main="[engine\n")
    with pytest.raises(GpuprovError) as e:
        configure("podman", config=str(d), runtime_path=RT)
    assert e.value.exit_code == 6 and "not valid TOML" in str(e.value)
    assert not (d / "99-gpuprov.conf").exists()


def test_undo_removes_only_gpuprovs_dropin(tmp_path):
    d = tree(tmp_path)
    eng = podman.PodmanEngine()
    path = eng.config_path(str(d), RuntimeRequest("nvidia", RT))
    path.write_text('[engine.runtimes]\nnvidia = ["/opt/mine"]\n')  # the operator's file under that name
    assert not eng.unplan(path, None).changed
    configure("podman", config=str(d), runtime_path=RT, replace=True)
    plan = eng.unplan(path, None)
    assert plan.removals == [path] and not plan.edits


class Answers:
    """What `podman …` prints on a node (issue 27.13: verify asks Podman, never gpuprov's drop-in)."""

    def __init__(self, nvidia_path: str | None, default: str = "crun"):
        self.nvidia_path, self.default, self.ran = nvidia_path, default, []

    def __call__(self, argv):
        self.ran.append(argv)
        if argv[:3] == ["podman", "--runtime", "nvidia"]:
            if self.nvidia_path is None:
                return 125, "", 'Error: default OCI runtime "nvidia" not found: invalid argument'
            return 0, self.nvidia_path + "\n", ""
        if argv[:2] == ["podman", "info"]:
            return 0, self.default + "\n", ""
        return 1, "", "unexpected"


def test_verify_asks_podman_which_binary_it_runs():
    eng = podman.PodmanEngine()
    assert eng.node_runtime(Answers(RT), None, "nvidia", RT) == (RT, None)
    path, why = eng.node_runtime(Answers("/usr/bin/crun"), None, "nvidia", RT)  # an operator's later drop-in
    assert path is None and "Podman runs /usr/bin/crun for --runtime nvidia, not " + RT in why
    path, why = eng.node_runtime(Answers(None), None, "nvidia", RT)
    assert path is None and "not found" in why
    ran = Answers(RT)
    eng.node_runtime(ran, None, "nvidia", RT)
    assert not any(a[0] == "cat" for a in ran.ran)  # the drop-in is never read


def test_configure_check_asks_podman():
    class R:
        def __init__(self, rc, out):
            self.returncode, self.stdout, self.stderr = rc, out, ""

    def run(answers):
        return lambda argv: R(*answers(argv)[:2])

    req = RuntimeRequest("nvidia", RT)
    assert podman.asked_podman(run(Answers(RT)), req) is None
    assert "says /usr/bin/crun, not" in podman.asked_podman(run(Answers("/usr/bin/crun")), req)
    dflt = RuntimeRequest("nvidia", RT, default=True)
    assert "default OCI runtime 'crun'" in podman.asked_podman(run(Answers(RT)), dflt)
    assert podman.asked_podman(run(Answers(RT, default="nvidia")), dflt) is None


@pytest.mark.parametrize("name", ["50-x.toml", "99-gpuprov.conf.bak", "gpuprov"])
def test_config_podman_never_reads_is_exit_2(tmp_path, name):
    d = tree(tmp_path)
    r = run_cli("engine", "configure", "podman", "--config", str(d / name), "--runtime-path", RT, "--no-restart")
    assert r.returncode == 2 and "Podman reads only *.conf files in a containers.conf.d" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (d / name).exists()
    other = tmp_path / "elsewhere"
    other.mkdir()
    r = run_cli("engine", "configure", "podman", "--config", str(other / "x.conf"), "--runtime-path", RT)
    assert r.returncode == 2 and not (other / "x.conf").exists()


def test_run_argv_never_pulls_and_asks_cdi():
    assert podman.run_argv("img", ("nvidia-smi", "-L"), gpu="0") == (
        "podman", "run", "--rm", "--network", "none", "--pull", "never", "--device", "nvidia.com/gpu=0", "img",
        "nvidia-smi", "-L")


def test_bootstrap_plan_for_a_podman_node():
    r = run_cli("plan", "--root", str(H200), "--engine", "podman", "--driver", "skip", "--json")
    assert r.returncode == 0, r.stderr
    steps = {s["id"]: s for s in json.loads(r.stdout)["steps"]}
    argvs = {i: [shlex.split(c) for c in s["commands"]] for i, s in steps.items()}
    assert "engine.service" not in steps  # no daemon
    assert any(a[-2:] == ["podman", "uidmap"] for a in argvs["engine.packages"]), argvs["engine.packages"]
    cfg = steps["engine.config"]["actions"][0]  # run in-process, as `gpuprov engine configure podman` does
    assert cfg.startswith("merge runtime 'nvidia'") and "/etc/containers/containers.conf.d/99-gpuprov.conf" in cfg
    assert "default runtime" not in cfg  # podman's own OCI runtime stays its default
    assert steps["cdi.spec"]["actions"][0].startswith("write the CDI spec")  # without --cdi: CDI is the path
    image = argvs["validate"][1][-1]
    assert argvs["validate"][:2] == [["podman", "image", "exists", image], ["podman", "import", "-", image]]
    assert argvs["validate"][2:] == [list(podman.run_argv(image, ("sh", "-c", "echo gpuprov-validate-ok"))),
                                     list(podman.run_argv(image, ("nvidia-smi", "-L"), gpu="all"))]


def test_podman_is_not_in_dockers_repository():
    r = run_cli("plan", "--root", str(H200), "--engine", "podman", "--engine-source", "docker-ce", "--driver", "skip")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Podman comes from the distribution" \
        in r.stderr, r.stderr


def test_config_naming_the_main_file_means_the_dropin_beside_it(tmp_path):
    """An adopted Podman's config is the one detect reports, containers.conf: gpuprov's drop-in goes in the
    containers.conf.d beside it, and the operator's file keeps every byte (seen: bootstrap run again on an adopted
    podman overwrote containers.conf with the drop-in's text before this)."""
    d = tree(tmp_path, main='[engine]\ncgroup_manager = "cgroupfs"\n')
    before = (d.parent / "containers.conf").read_bytes()
    res = configure("podman", config=str(d.parent / "containers.conf"), runtime_path=RT)
    assert res.changed and res.path == str(d / "99-gpuprov.conf")
    assert (d.parent / "containers.conf").read_bytes() == before
    assert podman.PodmanEngine().config_path(None, RuntimeRequest("nvidia", RT)) == \
        Path("/etc/containers/containers.conf.d/99-gpuprov.conf")
