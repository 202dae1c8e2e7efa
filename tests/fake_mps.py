"""Stand-ins for the two driver tools `gpuprov share` drives, for a machine without a GPU: `nvidia-smi` (a GPU's
compute mode: query and set) and `nvidia-cuda-mps-control` (the control daemon and its command pipe). Neither can
work here: both need an NVIDIA GPU. Everything above this boundary runs for real: gpuprov's CLI, the host lock, the
state file, the runtime's editor, and the daemon itself is a real background process that the kernel names as it names
NVIDIA's (comm `nvidia-cuda-mps`), with a real pid file and start time, so gpuprov's /proc checks meet what they meet
on a GPU host.

Built from real data: the GPUs are those of real hosts (`nvidia-smi -L` of one H200, tests/fixtures/hosts/h200-vm, or
of two, tests/fixtures/hosts/h200x2), in the compute mode the H200 capture's `nvidia-smi -q` shows (Default); the
command names and syntax are NVIDIA's (`nvidia-smi --query-gpu=... --format=csv,noheader`, `nvidia-smi -i ID -c MODE`,
`echo COMMAND | nvidia-cuda-mps-control`). What the fakes answer to a refused command (a message, a non-zero exit) is
this file's choice, not a capture: the tests assert what gpuprov does with a failure, not NVIDIA's wording.

`install(bindir)` writes both executables into `bindir`, with `fake.json` next to them: the GPUs and their modes (the
fake nvidia-smi changes them), `fail` (a command prefix the fakes refuse, e.g. "set_default_device_pinned_mem_limit 1",
"-c EXCLUSIVE_PROCESS" or "-i GPU-… -c EXCLUSIVE_PROCESS") and `calls` (every call, in order)."""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOSTS = {1: REPO / "tests/fixtures/hosts/h200-vm/commands/nvidia-smi-L.txt",
         2: REPO / "tests/fixtures/hosts/h200x2/nvidia-smi-L.txt"}
MODE_OF = {"0": "Default", "DEFAULT": "Default", "1": "Exclusive_Thread", "EXCLUSIVE_THREAD": "Exclusive_Thread",
           "2": "Prohibited", "PROHIBITED": "Prohibited", "3": "Exclusive_Process",
           "EXCLUSIVE_PROCESS": "Exclusive_Process"}
PID_FILE = "nvidia-cuda-mps-control.pid"


def files(n_gpus: int = 2, fail: str | None = None, python: str = sys.executable, repo: str = str(REPO)
          ) -> dict[str, str]:
    """name -> text of the two executables and fake.json, for a host whose Python and checkout are given (a host
    container has its own)."""
    gpus = [{"index": int(m.group(1)), "uuid": m.group(2), "mode": "Default"}
            for m in re.finditer(r"GPU (\d+): .* \(UUID: (GPU-[0-9a-f-]+)\)", HOSTS[n_gpus].read_text())]
    out = {"fake.json": json.dumps({"gpus": gpus, "fail": fail, "calls": []})}
    for name, role in (("nvidia-smi", "smi"), ("nvidia-cuda-mps-control", "control")):
        out[name] = f"#!{python}\nimport sys\nsys.path.insert(0, {repo!r})\nfrom tests.fake_mps import main\nmain({role!r})\n"
    return out


def install(bindir: Path, n_gpus: int = 2, fail: str | None = None) -> Path:
    bindir.mkdir(parents=True, exist_ok=True)
    for name, text in files(n_gpus, fail).items():
        (bindir / name).write_text(text)
        if name != "fake.json":
            (bindir / name).chmod(0o755)
    return bindir


def load(bindir: Path) -> dict:
    return json.loads((bindir / "fake.json").read_text())


def modes(bindir: Path) -> dict[str, str]:
    return {g["uuid"]: g["mode"] for g in load(bindir)["gpus"]}


def _save(doc: dict) -> None:
    path = Path(sys.argv[0]).parent / "fake.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _refused(doc: dict, call: str) -> bool:
    return bool(doc.get("fail")) and call.startswith(doc["fail"])


def _smi(args: list[str]) -> int:
    doc = load(Path(sys.argv[0]).parent)
    doc["calls"].append("nvidia-smi " + " ".join(args))
    _save(doc)
    if args[:1] == ["--query-gpu=index,uuid,compute_mode"] and "--format=csv,noheader" in args:
        for g in doc["gpus"]:
            print(f"{g['index']}, {g['uuid']}, {g['mode']}")
        return 0
    if len(args) == 4 and args[0] == "-i" and args[2] == "-c":
        gpu = next((g for g in doc["gpus"] if args[1] in (str(g["index"]), g["uuid"])), None)
        if gpu is None or args[3].upper() not in MODE_OF:
            print(f"No GPU or no mode: {' '.join(args)}", file=sys.stderr)
            return 2
        if _refused(doc, " ".join(args)) or _refused(doc, " ".join(args[2:])):
            print(f"Setting the compute mode of GPU {gpu['uuid']} failed (fake_mps: refused on purpose)")
            return 3
        gpu["mode"] = MODE_OF[args[3].upper()]
        _save(doc)
        print(f"Set compute mode to {args[3].upper()} for GPU {gpu['uuid']}.\nAll done.")
        return 0
    print(f"fake nvidia-smi: unknown arguments {args}", file=sys.stderr)
    return 2


def _daemon(pipe: Path) -> None:
    """Double fork, as `nvidia-cuda-mps-control -d` does: the caller returns, the daemon lives on (its stdio closed,
    so a caller capturing output is not held), under the kernel name of NVIDIA's daemon."""
    if os.fork():
        for _ in range(100):  # a well-behaved forking daemon: its pid file exists when the caller returns (systemd's
            if (pipe / PID_FILE).exists():  # Type=forking with PIDFile= reads it then)
                return
            time.sleep(0.05)
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    Path("/proc/self/comm").write_text("nvidia-cuda-mps")
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")

    def bye(*_):
        (pipe / PID_FILE).unlink(missing_ok=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, bye)
    while True:
        time.sleep(60)


def _alive(pipe: Path) -> int | None:
    try:
        pid = int((pipe / PID_FILE).read_text())
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (OSError, ValueError, IndexError):
        return None
    return pid if state != "Z" else None


def _control(args: list[str]) -> int:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    doc = load(Path(sys.argv[0]).parent)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    n = len(visible.split(",")) if visible else len(doc["gpus"])
    if args == ["-d"]:
        doc["calls"].append(f"control -d CUDA_VISIBLE_DEVICES={visible}")
        _save(doc)
        _daemon(pipe)
        return 0
    pid = _alive(pipe)
    rc = 0
    for line in sys.stdin.read().splitlines():
        cmd = line.strip()
        doc["calls"].append(f"control: {cmd}")
        if pid is None:
            print("Cannot find MPS control daemon process")
            rc = 1
            break
        words = cmd.split()
        if _refused(doc, cmd) or (words[:1] == ["set_default_device_pinned_mem_limit"] and int(words[1]) >= n):
            print(f"Invalid command or device: {cmd}")
            rc = 1
            break
        if cmd == "quit":
            os.kill(pid, signal.SIGTERM)
    _save(doc)
    return rc


def main(role: str) -> None:
    raise SystemExit(_smi(sys.argv[1:]) if role == "smi" else _control(sys.argv[1:]))


def stop_daemons(pipe: Path) -> None:
    """A test's teardown: the fake daemon of this pipe directory, if one is left."""
    pid = _alive(pipe)
    if pid:
        os.kill(pid, signal.SIGKILL)


def named_process(tmp: Path):
    """A real live process under the MPS control daemon's kernel name (a copy of `sleep` named as NVIDIA's binary),
    for runtime tests that need the daemon a state names to be running. Returns the Popen; kill() it when done."""
    import shutil
    import subprocess

    exe = tmp / "nvidia-cuda-mps-control"
    shutil.copy2(shutil.which("sleep"), exe)
    return subprocess.Popen([str(exe), "600"])
