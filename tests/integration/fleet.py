"""A fleet of fresh Debian 12 hosts (containers) driven by ansible-playbook over `docker exec`."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

import yaml

from tests.integration.hosts import REPO, Host, ensure_wheelhouse

RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


CONTAINERS = REPO / "inventories/containers/nodes.py"


def write_inventory(path: Path, hosts: list[Host], **extra_vars) -> Path:
    """inventories/containers (the README's inventory for container nodes: its group and variables, as the script
    prints them) with these hosts, and this checkout's wheelhouse."""
    group = json.loads(subprocess.run([sys.executable, str(CONTAINERS), "--list"], capture_output=True, text=True,
                                      check=True).stdout)["gpu_nodes"]
    group_vars = {**group["vars"], "gpuprov_wheelhouse": str(ensure_wheelhouse()),
                  "gpuprov_wheel_archive": str(path.parent / "gpuprov-wheels.tar"), **extra_vars}
    inv = {"all": {"children": {"gpu_nodes": {"hosts": {h.name: None for h in hosts}, "vars": group_vars}}}}
    path.write_text(yaml.safe_dump(inv))
    return path


def playbook(inventory: Path, *args: str, timeout: float = 1800,
             on_line: Callable[[str], None] | None = None) -> tuple[int, str, dict]:
    """ansible-playbook site.yml; `on_line` sees each line of its output as it comes (a test acting mid-run)."""
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_HOST_KEY_CHECKING": "False",
           "ANSIBLE_RETRY_FILES_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    argv = ["ansible-playbook", "-i", str(inventory), str(REPO / "site.yml"), *args]
    with tempfile.TemporaryFile("w+") as err, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True,
                                                               env=env, cwd=REPO) as p:
        lines = []
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        try:
            for line in p.stdout:
                lines.append(line)
                if on_line:
                    on_line(line)
            rc = p.wait()
        finally:
            timer.cancel()
        err.seek(0)
        stdout, stderr = "".join(lines), err.read()
    recap = {m.group(1): {"ok": int(m.group(2)), "changed": int(m.group(3)), "unreachable": int(m.group(4)),
                          "failed": int(m.group(5))} for m in RECAP.finditer(stdout)}
    return rc, stdout + stderr, recap
