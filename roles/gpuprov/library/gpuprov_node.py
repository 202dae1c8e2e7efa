#!/usr/bin/python
"""Ansible module: run `gpuprov bootstrap` on the node (its decision code, not a copy of it in YAML).
Check mode runs `gpuprov bootstrap --check --json` (what would change, with the daemon.json diff); otherwise
`--yes --json`. `changed` is true only when a step changed something."""
from __future__ import annotations

import json

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: gpuprov_node
short_description: Bring a node to the state `gpuprov bootstrap` gives
description: Runs gpuprov on the node; reports changed steps, diffs in check mode, and whether a reboot is needed.
options:
  driver: {type: str, default: auto, choices: [auto, skip], description: Install the NVIDIA driver or not.}
  kernel_modules: {type: str, default: auto, choices: [auto, open, proprietary], description: Kernel modules.}
  driver_source: {type: str, default: distro, choices: [distro, elrepo, nvidia], description: Driver source.}
  engine: {type: str, default: docker, choices: [docker, containerd, none], description: Container engine.}
  engine_source: {type: str, default: auto, choices: [auto, distro, docker-ce], description: Engine source.}
  runtime_name: {type: str, default: nvidia, description: Name of the runtime in the engine.}
  default_runtime: {type: bool, default: true, description: Make it the default runtime.}
  cdi: {type: bool, default: false, description: Enable CDI.}
  validate: {type: bool, default: true, description: Start a validation container.}
  bundle: {type: path, description: Offline bundle directory on the node (the only package source).}
  kubernetes: {type: bool, default: false, description: Then `gpuprov k8s node` (CRI handler, CDI spec, NFD labels).}
  stages:
    type: list
    elements: str
    choices: [driver, engine, runtime, validate]
    default: [driver, engine, runtime, validate]
    description: Only these stages (`gpuprov bootstrap --only`); the role derives them from the play's tags.
  mirrors: {type: dict, default: {}, description: "Repository name (elrepo, epel, cuda, docker-ce) -> base URL of a mirror."}
  gpuprov: {type: path, default: /usr/local/bin/gpuprov, description: The gpuprov command on the node.}
author: gpuprov developers
"""
RETURN = r"""
steps: {description: Each step with its status (ok/changed/verified) or, in check mode, would_change., type: list}
reboot_required: {description: A reboot is needed to finish (driver installed / nouveau blacklisted)., type: bool}
"""
REBOOT_REQUIRED = 7


# The option choices are gpuprov's own (provision/options.py); tests/unit/test_option_choices.py holds these to them
# (this module runs with the node's Python, where gpuprov cannot be imported).
STAGES = ["driver", "engine", "runtime", "validate"]
ARGUMENT_SPEC = dict(
    driver=dict(type="str", default="auto", choices=["auto", "skip"]),
    kernel_modules=dict(type="str", default="auto", choices=["auto", "open", "proprietary"]),
    driver_source=dict(type="str", default="distro", choices=["distro", "elrepo", "nvidia"]),
    engine=dict(type="str", default="docker", choices=["docker", "containerd", "none"]),
    engine_source=dict(type="str", default="auto", choices=["auto", "distro", "docker-ce"]),
    runtime_name=dict(type="str", default="nvidia"),
    default_runtime=dict(type="bool", default=True),
    cdi=dict(type="bool", default=False),
    validate=dict(type="bool", default=True),
    bundle=dict(type="path"),
    kubernetes=dict(type="bool", default=False),
    stages=dict(type="list", elements="str", choices=STAGES, default=STAGES),
    mirrors=dict(type="dict", default={}),
    gpuprov=dict(type="path", default="/usr/local/bin/gpuprov"),
)


def main() -> None:
    m = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = m.params
    argv = [p["gpuprov"], "bootstrap", "--json", "--driver", p["driver"], "--kernel-modules", p["kernel_modules"],
            "--driver-source", p["driver_source"], "--engine", p["engine"], "--engine-source", p["engine_source"],
            "--runtime-name", p["runtime_name"]]
    argv += [] if p["default_runtime"] else ["--no-default-runtime"]
    argv += ["--cdi"] if p["cdi"] else []
    argv += [] if p["validate"] else ["--no-validate"]
    argv += ["--bundle", p["bundle"]] if p["bundle"] else []
    argv += ["--only", ",".join(p["stages"])] if set(p["stages"]) != set(STAGES) else []
    argv += [a for name, url in sorted((p["mirrors"] or {}).items()) for a in ("--mirror", f"{name}={url}")]
    if not p["stages"]:
        m.exit_json(changed=False, steps=[], reboot_required=False, msg="no stage selected by the tags")
    argv += ["--check"] if m.check_mode else ["--yes"]
    rc, out, err = m.run_command(argv)
    errors = [ln for ln in err.splitlines() if ln.startswith("Error:")]
    if rc not in (0, REBOOT_REQUIRED):
        m.fail_json(msg=errors[-1] if errors else f"gpuprov exited {rc}", rc=rc, stderr=err, stdout=out, cmd=argv)
    try:
        doc = json.loads(out)
    except ValueError:
        m.fail_json(msg="gpuprov printed no JSON", rc=rc, stdout=out, stderr=err)
    k8s = _kubernetes(m, p) if p["kubernetes"] and "runtime" in p["stages"] and rc == 0 else []
    if m.check_mode:
        changed = doc["would_change"] > 0 or bool(k8s)
        diff = "".join(s.get("diff", "") for s in doc["steps"])
        m.exit_json(changed=changed, steps=doc["steps"], reboot_required=False,
                    diff={"prepared": diff} if diff else {})
    m.exit_json(changed=doc["changed"] > 0 or bool(k8s), steps=doc["steps"], kubernetes=k8s,
                reboot_required=rc == REBOOT_REQUIRED or doc.get("reboot_required", False))


def _kubernetes(m: AnsibleModule, p: dict) -> list:
    """A Kubernetes pool's node side after bootstrap: `gpuprov k8s node` (same engine, CDI, default handler)."""
    argv = [p["gpuprov"], "k8s", "node", "--json", "--engine", p["engine"], "--cdi" if p["cdi"] else "--no-cdi"]
    argv += ["--default"] if p["default_runtime"] else []
    argv += ["--dry-run"] if m.check_mode else []
    rc, out, err = m.run_command(argv)
    if rc != 0:
        errors = [ln for ln in err.splitlines() if ln.startswith("Error:")]
        m.fail_json(msg=errors[-1] if errors else f"gpuprov k8s node exited {rc}", rc=rc, stderr=err, cmd=argv)
    return json.loads(out)["changed"]


if __name__ == "__main__":
    main()
