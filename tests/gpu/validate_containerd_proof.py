"""GPU proof of bootstrap's containerd validation (run on a lent GPU host by tests/gpu/validate_containerd_proof.sh;
results in $OUT/validate-containerd.json): the `validate` step that `build_plan` makes for `--engine containerd` on
this host (its real GPUs, found by detect), applied as bootstrap applies it, against a private containerd (Debian's
1.6, tests/cri harness) with gpuprov's runtime installed under /tmp/rt (GPUPROV_PROOF_PREFIX): `nvidia-smi -L`
inside the container lists the host's GPUs. The control: the same step with plain runc as the runc binary fails."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from provision.engines import validate
from provision.errors import StepFailed
from provision.plan.build import Options, validate_steps
from provision.report import detect_host
from tests import k8s_cri
from tests.cri.harness import Containerd

OUT = Path(os.environ.get("OUT", "/tmp/validate-proof"))
PREFIX = os.environ.get("GPUPROV_PROOF_PREFIX", "/tmp/rt")  # gpuprov's runtime, installed for this proof only
RT = f"{PREFIX}/bin/gpuprov-runtime"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    res: dict = {"host_gpus": smi.stdout.splitlines() if smi else []}
    env = {"GPUPROV_RUNTIME_CONFIG": f"{PREFIX}/runtime.json"}
    r = k8s_cri.gpuprov("runtime", "install", "--prefix", PREFIX, "--json", env=env)
    res["runtime_install"] = [r.returncode, (r.stdout or r.stderr)[-300:]]
    os.environ.update(env)
    c = Containerd(Path(os.environ["CKIT"]), env=env)
    res["containerd"] = c.version()
    cfg = c.base / "config.toml"
    cfg.write_text(k8s_cri.base_config(c))
    r = k8s_cri.gpuprov("engine", "configure", "containerd", "--config", str(cfg), "--runtime-path", RT,
                        "--no-restart", "--json", env={**env, "GPUPROV_LOCK_DIR": PREFIX})
    res["engine_configure_rc"] = r.returncode
    try:
        c.start(cfg)
        os.environ.update(CONTAINERD_ADDRESS=c.socket, PATH=c.path_env)  # the step's `ctr` reaches this containerd
        report = detect_host(Path("/"), engines=False)
        (step,) = validate_steps(report, report.target, Options(engine="containerd"), runtime_path=RT)
        res["plan"] = [step.title, *step.lines()]
        t = time.monotonic()
        try:
            res["detail"] = step.apply()
        except StepFailed as exc:
            res["detail"] = f"FAILED: {exc}"
        res["seconds"] = round(time.monotonic() - t, 2)
        res["gpus_in_container"] = [ln for ln in res["host_gpus"] if ln in res["detail"]]
        try:
            validate_steps(report, report.target, Options(engine="containerd"),
                           runtime_path=shutil.which("runc"))[0].apply()
            res["control_plain_runc"] = "passed (it must not)"
        except StepFailed as exc:
            res["control_plain_runc"] = f"failed as it must: {str(exc)[-240:]}"
        ctr = [str(c.bindir / "ctr"), "-a", c.socket, *validate.CTR[1:]]
        res["left"] = {what: subprocess.run([*ctr, what, "ls", "-q"], capture_output=True, text=True).stdout.split()
                       for what in ("containers", "tasks", "images")}
    finally:
        (OUT / "validate-containerd.json").write_text(json.dumps(res, indent=2))
        print(json.dumps(res, indent=2))
        c.cleanup()


if __name__ == "__main__":
    main()
