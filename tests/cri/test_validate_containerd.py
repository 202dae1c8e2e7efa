"""bootstrap's validation step on containerd, for real: the step `build_plan` makes for `--engine containerd`, applied
as bootstrap applies it, against a private containerd (tests/cri harness: Debian bookworm's 1.6 from PATH and sid's
2.x unpacked with `dpkg -x`) and gpuprov's runtime installed under this test's own prefix for the fake GPU host of
the H200 capture (real mknod device nodes).

What makes it fail when the container does not run through gpuprov's runtime: the check image holds no `nvidia-smi`
(only sh, cat, ls, echo of this host), so the GPU container's `nvidia-smi -L` runs only when the runtime injected the
driver's binary. In the fake driver root that binary is a program printing the capture's own `nvidia-smi -L` (the
capture's file holds only a size note); the same step with plain runc as the runc binary fails (the control).

Also: what ran is what the plan prints (argv for argv), the container and its snapshot are gone afterwards and the
image stays (as docker's does), a container left by a killed run does not stop the next one, a host without a GPU
runs the plain container and says so, and the output checked is the container's own (read from the file containerd's
shim writes, not ctr's stdout, which can drop it)."""
from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from provision import effects
from provision.engines import validate
from provision.errors import StepFailed
from provision.plan import steps as st
from provision.plan.build import Options, validate_steps
from provision.report import detect_host
from tests import k8s_cri
from tests.conftest import H200, make_host, needs
from tests.cri.harness import Containerd, newer_containerd

pytestmark = [pytest.mark.integration, needs("containerd", "ctr", "runc", "apt-get", "dpkg")]
GPU_LINE = (H200 / "commands/nvidia-smi-L.txt").read_text().strip()  # GPU 0: NVIDIA H200 (UUID: GPU-266c…)


class Node:
    def __init__(self, which: str, base: Path):
        # The capture's driver root with nvidia-smi as a program printing the capture's `nvidia-smi -L`.
        droot = base / "driver"
        shutil.copytree(H200 / "usr/local/nvidia", droot, symlinks=True)
        smi = droot / "bin/nvidia-smi"
        smi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{GPU_LINE}\nEOF\n")
        smi.chmod(0o755)
        env = k8s_cri.private_runtime(base, driver_root=droot)
        self.runtime = str(base / "rt/bin/gpuprov-runtime")
        self.c = Containerd(Path("/usr/bin") if which == "bookworm" else newer_containerd(which), env=env)
        cfg = self.c.base / "config.toml"
        cfg.write_text(k8s_cri.base_config(self.c))
        # as bootstrap's engine.config step does before validating: handler `nvidia` -> this runtime
        r = k8s_cri.gpuprov("engine", "configure", "containerd", "--config", str(cfg), "--runtime-path",
                            self.runtime, "--no-restart", "--json", env={**env, "GPUPROV_LOCK_DIR": str(base)})
        assert r.returncode == 0, r.stderr
        self.c.start(cfg)

    def ctr(self, *args: str, check: bool = True) -> str:
        """This containerd's ctr in gpuprov's namespace (the harness's own `ctr` is bound to k8s.io)."""
        return subprocess.run([str(self.c.bindir / "ctr"), "-a", self.c.socket, *validate.CTR[1:], *args],
                              capture_output=True, text=True, check=check).stdout

    def leftovers(self) -> dict[str, list[str]]:
        """What the validation may leave in its namespace: containers, tasks, active snapshots, images."""
        snaps = [ln.split() for ln in self.ctr("snapshots", "ls").splitlines()[1:]]
        return {"containers": self.ctr("containers", "ls", "-q").split(), "tasks": self.ctr("tasks", "ls", "-q").split(),
                "active snapshots": [s[0] for s in snaps if s[-1] != "Committed"],
                "images": self.ctr("images", "ls", "-q").split()}


@pytest.fixture(scope="module", params=["bookworm", "sid"])
def node(request, tmp_path_factory):
    n = Node(request.param, tmp_path_factory.mktemp(f"ctrval-{request.param}"))
    yield n
    n.c.cleanup()


@pytest.fixture
def on_node(node, monkeypatch):
    """The step's `ctr` commands reach the private containerd (ctr reads CONTAINERD_ADDRESS; this containerd's own
    ctr first on PATH); every command that runs is recorded, and run for real."""
    monkeypatch.setenv("CONTAINERD_ADDRESS", node.c.socket)
    monkeypatch.setenv("PATH", node.c.path_env)
    ran: list[tuple[str, ...]] = []
    real = effects.run

    def run(argv, **kw):
        if argv[0] != "ldd":  # the image build's library lookup: not a step command
            ran.append(tuple(argv))
        return real(argv, **kw)

    monkeypatch.setattr(effects, "run", run)
    return node, ran


def step_for(root: Path, runtime_path: str) -> st.Step:
    report = detect_host(root, engines=False)
    (step,) = validate_steps(report, report.target, Options(engine="containerd"), runtime_path=runtime_path)
    return step


def printed_argvs(step: st.Step) -> list[tuple[str, ...]]:
    return [tuple(shlex.split(ln[2:].split(" < <", 1)[0].removesuffix(" || true"))) for ln in step.lines()
            if ln.startswith("$ ")]


def test_gpu_container_through_gpuprovs_runtime(on_node):
    node, ran = on_node
    step = step_for(H200, node.runtime)
    detail = step.apply()
    assert validate.OK_WORD in detail and GPU_LINE in detail, detail
    # what ran is what the plan prints, argv for argv (the leftover removal included: it found none)
    assert ran == st.executed_argvs(step) == printed_argvs(step)
    assert [a[:5] for a in ran[2:]] == [(*validate.CTR, "run", "--rm")] * 2
    assert all(a[a.index("--runc-binary") + 1] == node.runtime for a in ran[2:])
    # cleaned up: no container, task or active snapshot left; the image stays, as docker's validation image does
    assert node.leftovers() == {"containers": [], "tasks": [], "active snapshots": [], "images": [validate.CTR_IMAGE]}
    assert not Path(validate.ctr_log()).exists()  # the shim's output file, read and removed


def test_plain_runc_fails_it(on_node):
    """The control: the same step with plain runc as the runc binary gets no nvidia-smi, and the step fails."""
    node, _ = on_node
    with pytest.raises(StepFailed) as e:
        step_for(H200, shutil.which("runc")).apply()
    assert "nvidia-smi" in str(e.value) and e.value.exit_code == 5
    assert node.leftovers()["containers"] == []  # removed even though it failed


def test_container_left_by_a_killed_run(on_node):
    """A run killed between `ctr run` and its removal leaves the container (with a stopped task): the next
    validation removes it first instead of failing on "already exists"."""
    node, _ = on_node
    step_for(H200, node.runtime).apply()  # the image is there
    node.ctr("run", "-d", "--runtime", validate.RUNC_SHIM, validate.CTR_IMAGE, validate.CONTAINER, "sh", "-c", "exit 0")
    assert node.leftovers()["containers"] == [validate.CONTAINER]
    detail = step_for(H200, node.runtime).apply()
    assert validate.OK_WORD in detail and GPU_LINE in detail and "not found" not in detail
    assert node.leftovers()["containers"] == []


def test_host_without_a_gpu(on_node, tmp_path):
    node, ran = on_node
    step = step_for(make_host(tmp_path, "debian-12", "none"), node.runtime)
    assert "no GPU on this host" in step.title
    detail = step.apply()
    assert validate.OK_WORD in detail and "no GPU on this host: checked a plain container" in detail, detail
    assert ran == st.executed_argvs(step) and len(ran) == 3  # import, leftover removal, one plain container
    assert node.leftovers()["containers"] == []


def test_output_is_the_containers_own(on_node):
    """The output is read from the file the shim writes (ctr's own stdout can drop a short-lived container's): a
    file left holding the word by an earlier run does not pass a container that printed something else."""
    node, _ = on_node
    step_for(H200, node.runtime).apply()  # the image is there
    log = Path(validate.ctr_log())
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"{validate.OK_WORD}\n")
    argv = validate.ctr_run_argvs(node.runtime, False)[0]
    assert argv[-3:] == ("sh", "-c", f"echo {validate.OK_WORD}")
    with pytest.raises(StepFailed, match="output lacks 'gpuprov-validate-ok': 'something else'"):
        st.RunContainer((*argv[:-1], "echo something else"), str(log), expect=validate.OK_WORD).execute()
    assert not log.exists()
