#!/usr/bin/env python3
"""Ansible inventory (a script, so the names can follow one variable): two test nodes as containers on the
controller, reached with `docker exec` (community.docker, which the `ansible` package carries). The README's
Fleets section starts them as $GPUPROV_NODES-1 and $GPUPROV_NODES-2 (default gpuprov-node-1, gpuprov-node-2), so two
sets of test nodes on one machine never collide: tests/integration/test_fleet_readme.py runs the README's commands
as written under its own GPUPROV_NODES; the fleet tests take VARS with hosts of their own (tests/integration/fleet.py).
Run: ansible-playbook -i inventories/containers site.yml"""
import json
import os
import sys

VARS = {
    "ansible_connection": "community.docker.docker",
    "ansible_python_interpreter": "/usr/bin/python3",
    # the nodes have no Python yet and no GPU: they fetch Python and the engine from Debian's archive
    "gpuprov_allow_network": True,
    "gpuprov_driver": "skip",
}

if __name__ == "__main__":
    nodes = os.environ.get("GPUPROV_NODES") or "gpuprov-node"
    doc = {"gpu_nodes": {"hosts": [f"{nodes}-1", f"{nodes}-2"], "vars": VARS}, "_meta": {"hostvars": {}}}
    print(json.dumps({} if "--host" in sys.argv else doc))
