"""Docker's daemon.json: a structural merge that keeps every existing key, value and order."""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from provision.errors import ConfigInvalid

DAEMON_JSON = "/etc/docker/daemon.json"
UNIT_FILES = ("/lib/systemd/system/docker.service", "/usr/lib/systemd/system/docker.service",
              "/etc/systemd/system/docker.service")
DROPIN_DIR = "/etc/systemd/system/docker.service.d"
# dockerd flags that have a daemon.json twin; both at once stops dockerd ("directives are specified both as a
# flag and in the configuration file").
FLAG_KEYS = {
    "-H": "hosts", "--host": "hosts", "--default-runtime": "default-runtime", "--add-runtime": "runtimes",
    "--data-root": "data-root", "-g": "graph", "--storage-driver": "storage-driver", "-s": "storage-driver",
    "--exec-opt": "exec-opts", "--log-driver": "log-driver", "--log-opt": "log-opts",
    "--insecure-registry": "insecure-registries", "--registry-mirror": "registry-mirrors",
    "--containerd": "containerd", "--dns": "dns", "--bip": "bip", "--mtu": "mtu", "--iptables": "iptables",
    "--cgroup-parent": "cgroup-parent", "--live-restore": "live-restore", "--debug": "debug", "-D": "debug",
}


@dataclass
class MergeResult:
    text: str  # the new file content (== old content when nothing changed)
    changed: bool
    changes: list[str] = field(default_factory=list)  # human summary: "runtimes.nvidia added"


def parse(text: str, path: str = DAEMON_JSON) -> dict:
    if not text.strip():
        return {}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigInvalid(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                            "fix it or move it aside, then run again (the file was not changed)") from None
    if not isinstance(doc, dict):
        raise ConfigInvalid(f"{path} must hold a JSON object at the top level; the file was not changed")
    return doc


def merge(text: str, *, runtime_name: str = "nvidia", runtime_path: str, default: bool = False,
          cdi: bool = False, path: str = DAEMON_JSON) -> MergeResult:
    """Add runtimes.<name>, optionally default-runtime and features.cdi. Existing keys keep their order and values;
    a runtime of the same name is updated in place (its other fields kept)."""
    doc = parse(text, path)
    changes = []
    runtimes = doc.get("runtimes")
    if runtimes is not None and not isinstance(runtimes, dict):
        raise ConfigInvalid(f"{path}: \"runtimes\" must be an object; the file was not changed")
    runtimes = dict(runtimes or {})
    entry = dict(runtimes.get(runtime_name) or {})
    want = {"path": runtime_path, "runtimeArgs": entry.get("runtimeArgs", [])}
    if entry.get("path") != runtime_path or "runtimeArgs" not in entry:
        entry.update(want)
        runtimes[runtime_name] = entry
        doc["runtimes"] = runtimes
        changes.append(f"runtimes.{runtime_name} -> {runtime_path}")
    if default and doc.get("default-runtime") != runtime_name:
        doc["default-runtime"] = runtime_name
        changes.append(f"default-runtime -> {runtime_name}")
    if cdi:
        feats = doc.get("features")
        if feats is not None and not isinstance(feats, dict):
            raise ConfigInvalid(f"{path}: \"features\" must be an object; the file was not changed")
        feats = dict(feats or {})
        if feats.get("cdi") is not True:
            feats["cdi"] = True
            doc["features"] = feats
            changes.append("features.cdi -> true")
    if not changes:
        return MergeResult(text, False, [])
    return MergeResult(json.dumps(doc, indent=2) + "\n", True, changes)


def unit_flags(root: Path = Path("/")) -> dict[str, str]:
    """daemon.json keys that the docker.service unit (or its drop-ins) also sets as dockerd flags -> the file."""
    files = [root / p.lstrip("/") for p in UNIT_FILES]
    dropins = root / DROPIN_DIR.lstrip("/")
    if dropins.is_dir():
        files += sorted(dropins.glob("*.conf"))
    found: dict[str, str] = {}
    for f in files:
        try:
            text = f.read_text()
        except OSError:
            continue
        execs = [m.group(1) for m in re.finditer(r"^\s*ExecStart\s*=\s*(.*)$", text, re.M)]
        for line in execs:
            if not line.strip():
                found.clear()  # `ExecStart=` resets the command in drop-ins
                continue
            try:
                words = shlex.split(line.replace("\\\n", " "))
            except ValueError:
                words = line.split()
            for w in words:
                flag = w.split("=", 1)[0]
                if flag in FLAG_KEYS:
                    found[FLAG_KEYS[flag]] = str(f)
    return found


def conflicts(doc: dict, flags: dict[str, str]) -> list[str]:
    return [f"{k!r} is set in daemon.json and as a dockerd flag in {flags[k]}" for k in doc if k in flags]
