"""The node checks. Each takes a host adapter (local commands, or testinfra's `host`) and returns a CheckResult;
a failure says what is wrong on that host in one line."""
from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import asdict, dataclass
from functools import cached_property


@dataclass
class CheckResult:
    name: str
    status: str  # pass | fail | skip
    detail: str

    def to_dict(self) -> dict:
        return asdict(self)


class NodeHost:
    """What the checks need from a host: run a command. Facts come from `gpuprov detect --json` on that host."""

    def run(self, cmd: str) -> tuple[int, str, str]:
        raise NotImplementedError

    def json_of(self, cmd: str) -> dict | None:
        """A command's JSON output, or None when it fails or prints something else."""
        rc, out, _ = self.run(cmd)
        try:
            return json.loads(out) if rc == 0 else None
        except ValueError:
            return None

    @cached_property
    def facts(self) -> dict | None:
        return self.json_of("gpuprov detect --json")

    @cached_property
    def runtimes(self) -> dict | None:
        return self.json_of("docker info --format '{{json .Runtimes}}'")


class LocalHost(NodeHost):
    def run(self, cmd: str) -> tuple[int, str, str]:
        try:
            p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return 124, "", f"timed out: {cmd}"
        return p.returncode, p.stdout, p.stderr


class TestinfraHost(NodeHost):
    __test__ = False  # not a pytest test class

    def __init__(self, host):
        self.host = host

    def run(self, cmd: str) -> tuple[int, str, str]:
        r = self.host.run(cmd)
        return r.rc, r.stdout, r.stderr


def _gpus(h: NodeHost) -> list:
    return (h.facts or {}).get("gpus") or []


def _skip_without_gpu(name: str, h: NodeHost) -> CheckResult | None:
    return None if _gpus(h) else CheckResult(name, "skip", "no NVIDIA GPU on this host")


def _driver(h: NodeHost) -> dict:
    return (h.facts or {}).get("driver") or {}


def gpuprov_installed(h: NodeHost) -> CheckResult:
    if h.facts is None:
        return CheckResult("gpuprov installed", "fail", "`gpuprov detect --json` does not run on this host: "
                           "run the gpuprov role (or install.sh) first")
    return CheckResult("gpuprov installed", "pass", f"target {h.facts.get('target')}")


def driver_loaded(h: NodeHost) -> CheckResult:
    skip = _skip_without_gpu("driver loaded", h)
    if skip:
        return skip
    drv = _driver(h)
    if not drv.get("loaded"):
        return CheckResult("driver loaded", "fail", "NVIDIA GPU present but no driver loaded: gpuprov bootstrap, "
                           "then reboot if it asks")
    return CheckResult("driver loaded", "pass", f"{drv.get('version')} ({drv.get('kernel_module')} module)")


def versions_coherent(h: NodeHost) -> CheckResult:
    skip = _skip_without_gpu("driver versions coherent", h)
    if skip:
        return skip
    drv = _driver(h)
    k, u = drv.get("version"), drv.get("userspace_version")
    if not k or not u or k != u:
        return CheckResult("driver versions coherent", "fail", f"kernel module {k} vs userspace {u}: a reboot is "
                           "pending or an upgrade replaced one of them (\"Driver/library version mismatch\")")
    return CheckResult("driver versions coherent", "pass", f"kernel module = userspace = {k}")


def engine_running(h: NodeHost) -> CheckResult:
    if h.runtimes is None:
        return CheckResult("engine running", "fail", "`docker info` fails: dockerd is not running or not installed")
    return CheckResult("engine running", "pass", "dockerd answers")


def runtime_registered(h: NodeHost, name: str = "nvidia") -> CheckResult:
    rts = h.runtimes
    if rts is None:
        return CheckResult("runtime registered", "fail", "cannot ask dockerd (not running)")
    if name not in rts:
        return CheckResult("runtime registered", "fail", f"runtime {name!r} is not registered in dockerd "
                           f"(has: {', '.join(rts)}): run gpuprov engine configure docker")
    path = (rts[name] or {}).get("path", "")
    rc, _, _ = h.run(f"test -x {shlex.quote(path)}")
    if rc != 0:
        return CheckResult("runtime registered", "fail", f"runtime {name!r} points to {path}, which is missing or "
                           "not executable: run gpuprov runtime install")
    return CheckResult("runtime registered", "pass", f"{name} -> {path}")


def plain_container(h: NodeHost) -> CheckResult:
    from provision.plan.validate import IMAGE

    rc, out, err = h.run(f"docker run --rm --runtime nvidia {IMAGE} sh -c 'echo gpuprov-verify-ok'")
    if rc != 0 or "gpuprov-verify-ok" not in out:
        last = (err or out).strip().splitlines()
        return CheckResult("container through the runtime", "fail",
                           f"`docker run --runtime nvidia` failed: {last[-1] if last else f'exit {rc}'}")
    return CheckResult("container through the runtime", "pass", "a plain container starts through runtime nvidia")


def gpu_container(h: NodeHost) -> CheckResult:
    from provision.plan.validate import IMAGE

    skip = _skip_without_gpu("GPU container", h)
    if skip:
        return skip
    rc, out, err = h.run(f"docker run --rm --runtime nvidia -e NVIDIA_VISIBLE_DEVICES=all {IMAGE} nvidia-smi -L")
    if rc != 0 or "GPU 0" not in out:
        return CheckResult("GPU container", "fail", f"nvidia-smi -L in a container failed: {(err or out).strip()[-200:]}")
    return CheckResult("GPU container", "pass", out.strip().splitlines()[0])


def cri_handler(h: NodeHost, name: str = "nvidia") -> CheckResult:
    """Kubernetes nodes (`gpuprov k8s node`): containerd's merged config (drop-ins included) or CRI-O's drop-in
    names handler `nvidia`, and the GPU labels file for NFD is there."""
    from provision.engines import containerd, crio

    rc, dump, _ = h.run("containerd config dump")
    if rc == 0:
        if not containerd.runtime_in_dump(dump, name):
            return CheckResult("CRI handler", "fail", f"containerd's merged config has no runtime {name!r}: "
                               "run gpuprov k8s node")
        where = "containerd"
    elif h.run(f"test -f {shlex.quote(crio.dropin_path(name))}")[0] == 0:
        where = "CRI-O"
    elif h.run("command -v crio")[0] == 0:
        return CheckResult("CRI handler", "fail", f"CRI-O has no gpuprov drop-in {crio.dropin_path(name)}: "
                           "run gpuprov k8s node")
    else:
        return CheckResult("CRI handler", "skip", "no containerd or CRI-O on this host")
    from provision.k8s.labels import NFD_FILE

    labels = "labels for NFD" if h.run(f"test -s {NFD_FILE}")[0] == 0 else "no NFD labels file (gpuprov k8s labels --write)"
    return CheckResult("CRI handler", "pass", f"{where} handler {name!r}; {labels}")


CHECKS = (gpuprov_installed, driver_loaded, versions_coherent, engine_running, runtime_registered, plain_container,
          gpu_container, cri_handler)


def run_checks(h: NodeHost) -> list[CheckResult]:
    return [c(h) for c in CHECKS]
