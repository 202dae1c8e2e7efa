"""Effects: commands and services. Few, small and boring; everything else is decided before we get here."""
from __future__ import annotations

import difflib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from provision.errors import StepFailed


@dataclass
class CommandResult:
    argv: list[str]
    returncode: int
    output: str


def run(argv: list[str], *, check: bool = True, env: dict | None = None, timeout: float | None = None,
        input_text: str | bytes | None = None) -> CommandResult:
    """Run argv, output captured. `input_text` as bytes feeds binary stdin (e.g. an image tar to `docker import`)."""
    binary = isinstance(input_text, bytes)
    try:
        p = subprocess.run(argv, capture_output=True, env=env, timeout=timeout, input=input_text,
                           **({} if binary else {"text": True, "errors": "replace"}))
    except FileNotFoundError:
        raise StepFailed(f"command not found: {argv[0]} (needed for: {' '.join(argv)})") from None
    except subprocess.TimeoutExpired:
        raise StepFailed(f"timed out after {timeout}s: {' '.join(argv)}") from None
    out, err = ((p.stdout or b"").decode(errors="replace"), (p.stderr or b"").decode(errors="replace")) if binary \
        else (p.stdout or "", p.stderr or "")
    res = CommandResult(argv, p.returncode, out + err)
    if check and p.returncode != 0:
        tail = "\n".join(res.output.strip().splitlines()[-15:])
        raise StepFailed(f"`{' '.join(argv)}` failed with exit code {p.returncode}:\n{tail}")
    return res


def unified_diff(old: str, new: str, path: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"{path} (current)",
                                        f"{path} (gpuprov)"))


def has_systemd() -> bool:
    return Path("/run/systemd/system").is_dir()


def dockerd_pid() -> int | None:
    for pidfile in ("/var/run/docker.pid", "/run/docker.pid"):
        try:
            pid = int(Path(pidfile).read_text().strip())
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError):
            continue
    return None


def docker_runtimes() -> list[str] | None:
    import json

    try:
        p = subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    try:
        return list(json.loads(p.stdout))
    except ValueError:
        return None


def wait_for(pred, timeout: float = 30.0, interval: float = 0.3) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def start_dockerd() -> str:
    """Start dockerd the way this host does it: systemd, else the SysV script, else (containers without an init,
    or where the script cannot raise its ulimits) dockerd directly in the background."""
    if has_systemd():
        run(["systemctl", "enable", "--now", "docker"])
        how = "systemctl enable --now docker"
    else:
        how = ""
        if Path("/etc/init.d/docker").exists():
            r = run(["/etc/init.d/docker", "start"], check=False)
            if r.returncode == 0 and wait_for(lambda: docker_runtimes() is not None, 20):
                return "/etc/init.d/docker start"
        log = open("/var/log/gpuprov-dockerd.log", "ab")
        subprocess.Popen(["dockerd"], stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        how = "dockerd (background; log /var/log/gpuprov-dockerd.log)"
    if not wait_for(lambda: docker_runtimes() is not None, 60):
        raise StepFailed(f"dockerd did not come up after `{how}`; see `journalctl -u docker` or the log named there")
    return how


def restart_dockerd(pid: int | None = None) -> str:
    """A full restart (dockerd registers the --gpus device driver only at start, when it finds the hook). `pid`: the
    daemon to restart where there is no systemd (default: the one in the pid file)."""
    if has_systemd():
        run(["systemctl", "restart", "docker"])
        return "systemctl restart docker"
    pid = pid or dockerd_pid()
    if pid:
        os.kill(pid, signal.SIGTERM)
        if not wait_for(lambda: not _alive(pid), 60):
            raise StepFailed(f"dockerd (pid {pid}) did not stop within 60 s; restart it by hand")
    return "restarted dockerd: " + start_dockerd()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def which(name: str) -> str | None:
    return shutil.which(name)
