"""Issue 26 on a real GPU host (run by tests/gpu/field_proof.sh; changes nothing but /dev/char links, which live in
/dev and go at reboot): every node a GPU container gets has its /dev/char/MAJ:MIN link, the driver's brand is read,
nvidia-uvm is there. Prints one JSON document; exit 1 when a check fails."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from provision.facts.driver_facts import find_driver_root
from provision.inject import discover, edits


def main() -> int:
    root = find_driver_root(Path("/"))[0] or "/"
    disc = discover.discover(root, arch=True)
    e = edits.compute_edits(disc, {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "all"})
    links = {}
    for d in e.devices:
        link = f"/dev/char/{d.major}:{d.minor}"
        try:
            same = os.stat(link).st_rdev == os.stat(d.path).st_rdev
        except OSError:
            same = False
        links[d.path] = {"link": link, "target": os.readlink(link) if os.path.islink(link) else None, "ok": same}
    doc = {"driver": disc.version, "gpus": [{"bus": g.bus_id, "arch": g.arch, "brand": g.brand} for g in disc.gpus],
           "uvm": disc.nodes.uvm is not None, "links": links,
           "cgroup": "v2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "v1"}
    ok = doc["uvm"] and all(v["ok"] for v in links.values()) and all(g["brand"] for g in doc["gpus"])
    print(json.dumps({**doc, "ok": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
