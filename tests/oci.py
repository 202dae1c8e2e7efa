"""Helpers to run OCI bundles through runc or gpuprov-runtime directly (GPU hosts have no engine)."""
from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path


def make_config(rootfs: str, args: list[str], env: list[str] | None = None, *, readonly: bool = False) -> dict:
    """runc's default spec (`runc spec`), pointed at `rootfs`, running `args` without a terminal."""
    import tempfile

    env = env or []

    with tempfile.TemporaryDirectory() as td:
        subprocess.run(["runc", "spec"], cwd=td, check=True, capture_output=True)
        cfg = json.loads(Path(td, "config.json").read_text())
    cfg["root"] = {"path": rootfs, "readonly": readonly}
    cfg["process"]["terminal"] = False
    cfg["process"]["args"] = args
    cfg["process"]["env"] = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", *env]
    return cfg


def write_bundle(bundle: Path, cfg: dict) -> Path:
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(cfg))
    return bundle


def lifecycle(runtime: str, bundle: Path, *, env: dict | None = None, out: Path | None = None,
              phases: dict | None = None) -> tuple[int, str]:
    """create / start / wait / delete, as an engine does. Returns (create's rc, captured stdout+stderr).
    With `phases`, each phase's seconds are appended to phases[name]."""
    out = out or bundle / "out.txt"
    marks = [time.perf_counter()]
    cid, pid, text, rc = start(runtime, bundle, out, env=env, marks=marks)
    if pid is None:
        return rc, text
    text = finish(runtime, cid, pid, out, env=env, marks=marks)
    if phases is not None:
        for name, a, b in zip(("create", "state+start", "wait", "delete"), marks, marks[1:]):
            phases.setdefault(name, []).append(b - a)
    return 0, text


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def start(runtime: str, bundle: Path, out: Path, *, env: dict | None = None,
          marks: list | None = None) -> tuple[str, int | None, str, int]:
    """create + start without waiting: (container id, pid or None, error text, create's rc)."""
    marks = [] if marks is None else marks
    cid = "gp-" + uuid.uuid4().hex[:10]
    with open(out, "wb") as fh:
        rc = subprocess.run([runtime, "create", "--bundle", str(bundle), cid], stdout=fh, stderr=fh,
                            stdin=subprocess.DEVNULL, env=env).returncode
    marks.append(time.perf_counter())
    if rc != 0:
        return cid, None, out.read_text(errors="replace"), rc
    pid = json.loads(subprocess.run([runtime, "state", cid], capture_output=True, text=True, env=env).stdout)["pid"]
    subprocess.run([runtime, "start", cid], check=True, env=env)
    marks.append(time.perf_counter())
    return cid, pid, "", 0


def finish(runtime: str, cid: str, pid: int, out: Path, *, env: dict | None = None,
           marks: list | None = None) -> str:
    """wait for the container's process to end, then delete it; returns its captured output."""
    marks = [] if marks is None else marks
    while os.path.exists(f"/proc/{pid}") and _alive(pid):
        time.sleep(0.0005)
    marks.append(time.perf_counter())
    subprocess.run([runtime, "delete", "--force", cid], check=True, env=env)
    marks.append(time.perf_counter())
    return out.read_text(errors="replace")
