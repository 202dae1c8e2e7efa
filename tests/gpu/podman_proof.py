"""GPU proof of the Podman path (run on a lent GPU host by tests/gpu/podman_proof.sh; results in
$OUT/podman-proof.json): Debian 12's podman 4.3 with crun and conmon (the kit of tests/gpu/podman_kit.sh), then
`gpuprov bootstrap --engine podman` (the engine found is kept; the CDI spec written; the validation containers from
this host's own files), `gpuprov verify`, and Podman's own `podman run --device nvidia.com/gpu=0|<uuid>|all`:
`nvidia-smi -L` and an nvcc-built CUDA program, rootful and as a rootless user; an unknown device refused in one
line; `gpuprov uninstall` at the end."""
from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from provision.engines import podman
from provision.engines.validate import build_image_tar

OUT = Path(os.environ.get("OUT", "/tmp/podman-proof"))
HERE = Path(__file__).resolve().parent
USER, HOME = "gpuuser", "/srv/podman-home/gpuuser"
RESULT: dict = {}


def save() -> None:
    (OUT / "podman-proof.json").write_text(json.dumps(RESULT, indent=2))


def sh(key: str, cmd: str, user: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """`cmd` through bash (as `user`, a login shell with its own runtime dir, when given), recorded under `key`."""
    if user:
        cmd = (f"runuser -l {user} -c " + shlex.quote(f"export XDG_RUNTIME_DIR=/tmp/run-{user}; "
                                                      f"mkdir -p -m 700 $XDG_RUNTIME_DIR; {cmd}"))
    t = time.monotonic()
    try:
        r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        r = subprocess.CompletedProcess(cmd, 124, str(exc.stdout or ""), f"timed out after {timeout} s")
    RESULT[key] = {"cmd": cmd, "rc": r.returncode, "s": round(time.monotonic() - t, 2),
                   "out": (r.stdout + r.stderr)[-3000:]}
    print(f"== {key}: rc {r.returncode} ({RESULT[key]['s']} s)\n{(r.stdout + r.stderr).strip()[-1500:]}", flush=True)
    save()
    return r


def run(image: str, argv: str, gpu: str | None = None) -> str:
    return shlex.join(podman.run_argv(image, shlex.split(argv), gpu))


def vadd_source() -> str:
    """The CUDA program of tests/gpu/test_gpu_runtime.py (read, not imported: that module needs pytest)."""
    tree = ast.parse((HERE / "test_gpu_runtime.py").read_text())
    return next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", "") == "VADD" for t in n.targets))


def images() -> None:
    """The check image (sh, ls, cat, echo from this host) and the CUDA image (the same + the nvcc-built program and
    the libraries it loads; libcuda comes from the CDI spec), as tars both users import."""
    Path("/tmp/check.tar").write_bytes(build_image_tar())
    Path("/tmp/vbin").mkdir(exist_ok=True)
    (Path("/tmp/vbin") / "vadd.cu").write_text(vadd_source())
    sh("nvcc", "nvcc -O2 -o /tmp/vbin/gpuprov-vadd /tmp/vbin/vadd.cu -Xcompiler -static-libgcc "
               "-Xcompiler -static-libstdc++", timeout=120)
    os.environ["PATH"] = "/tmp/vbin:" + os.environ["PATH"]
    Path("/tmp/cuda.tar").write_bytes(build_image_tar(("sh", "ls", "cat", "echo", "gpuprov-vadd")))
    for t in ("/tmp/check.tar", "/tmp/cuda.tar"):
        os.chmod(t, 0o644)


def containers(tag: str, user: str | None, uuid: str) -> None:
    """The same runs rootful (`user` None) and rootless."""
    sh(f"{tag}_import", "podman import -q /tmp/check.tar gpuprov-check && podman import -q /tmp/cuda.tar gpuprov-cuda",
       user)
    sh(f"{tag}_smi_gpu0", run("gpuprov-check", "nvidia-smi -L", "0"), user)
    sh(f"{tag}_smi_uuid", run("gpuprov-check", "nvidia-smi -L", uuid), user)
    sh(f"{tag}_smi_all", run("gpuprov-check", "nvidia-smi -L", "all"), user)
    sh(f"{tag}_no_request", run("gpuprov-check", "sh -c 'ls /dev; nvidia-smi -L'"), user)
    sh(f"{tag}_unknown_device", run("gpuprov-check", "true", "99"), user)
    sh(f"{tag}_cuda_gpu0", run("gpuprov-cuda", "gpuprov-vadd", "0"), user)
    sh(f"{tag}_ns", run("gpuprov-check", "cat /proc/self/uid_map", "0"), user)


def rootless_user() -> None:
    sh("user", f"mkdir -p {os.path.dirname(HOME)} && mount -t tmpfs tmpfs {os.path.dirname(HOME)} && "
               f"useradd -m -d {HOME} -s /bin/bash {USER} && "
               f"(grep -q ^{USER}: /etc/subuid || echo {USER}:300000:65536 >> /etc/subuid) && "
               f"(grep -q ^{USER}: /etc/subgid || echo {USER}:300000:65536 >> /etc/subgid) && "
               "ls -l /usr/bin/newuidmap /usr/bin/newgidmap")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines()
    RESULT["host_gpus"] = smi
    uuid = smi[0].split("UUID: ")[1].rstrip(")")
    sh("versions", "uname -r; grep PRETTY /etc/os-release; podman --version; crun --version | head -1; "
                   "conmon --version | head -1; findmnt -n -o FSTYPE /; python3 --version")
    rootless_user()  # before bootstrap: nothing gpuprov does may write under the user's home
    boot = sh("bootstrap", "gpuprov bootstrap --yes --driver skip --engine podman --json", timeout=150)
    try:
        RESULT["bootstrap_steps"] = {s["id"]: [s["status"], s.get("detail", "")[-300:]]
                                     for s in json.loads(boot.stdout)["steps"]}
    except (ValueError, KeyError):
        sh("cdi_fallback", "gpuprov cdi refresh")  # the runs below still need the spec
    save()
    sh("verify", "gpuprov verify --json")
    sh("cdi_list", "gpuprov cdi list 2>&1 | head -20; ls -l /etc/cdi")
    images()
    containers("rootful", None, uuid)
    t = []
    for _ in range(3):
        s = time.monotonic()
        subprocess.run(shlex.split(run("gpuprov-check", "nvidia-smi -L", "0")), capture_output=True)
        t.append(round(time.monotonic() - s, 3))
    RESULT["rootful_smi_gpu0_wall_s"] = t
    containers("rootless", USER, uuid)
    sh("home_written_by_root", f"find {HOME} ! -user {USER} | head")
    sh("uninstall", "gpuprov uninstall --yes --json | tail -c 2500; ls /etc/containers/containers.conf.d /etc/cdi")
    save()


if __name__ == "__main__":
    sys.exit(main())
