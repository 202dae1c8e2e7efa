#!/usr/bin/python
"""Ansible module: run `gpuprov bootstrap` on the node (its decision code, not a copy of it in YAML), or with
`state: absent` `gpuprov uninstall` (bootstrap's inverse). Check mode runs `gpuprov bootstrap --check --json` (what
would change, with the daemon.json diff) or `gpuprov uninstall --dry-run --json`; otherwise `--yes --json`.
`changed` is true only when a step changed something. A failure names gpuprov's own error line and what to change in
the play (FIXES)."""
from __future__ import annotations

import json

from ansible.module_utils.basic import AnsibleModule

# gpuprov_errors.py is a link to gpuprov's provision/errors.py (it imports nothing): the exit codes below are
# gpuprov's own, on a node where gpuprov itself cannot be imported (the module runs with the node's system Python).
# gpuprov_values.py is a link to provision/values.py (it imports nothing of gpuprov's): the rules each free-form value
# must pass are gpuprov's own, checked here before any reaches the node's argv (values.PARAMS).
# This file is the module of the collection gpuprov.gpuprov (plugins/modules, its module_utils in plugins/module_utils)
# and, through the link roles/gpuprov/library/gpuprov_node.py, of the role used from the repository (site.yml's
# roles_path, its module_utils in roles/gpuprov/module_utils). Ansible packs the imports that resolve where the module
# runs and skips the others, because they are inside a try (optional imports).
try:
    from ansible_collections.gpuprov.gpuprov.plugins.module_utils import gpuprov_errors as codes
    from ansible_collections.gpuprov.gpuprov.plugins.module_utils import gpuprov_values as rules
except ImportError:  # the role from the repository: its own module_utils
    from ansible.module_utils import gpuprov_errors as codes
    from ansible.module_utils import gpuprov_values as rules

DOCUMENTATION = r"""
module: gpuprov_node
short_description: Bring a node to the state `gpuprov bootstrap` gives
description: Runs gpuprov on the node; reports changed steps, diffs in check mode, and whether a reboot is needed.
options:
  driver: {type: str, default: auto, description: "auto, skip, or a driver branch to pin (535, 570, ...)."}
  kernel_modules: {type: str, default: auto, choices: [auto, open, proprietary], description: Kernel modules.}
  driver_source: {type: str, default: distro, choices: [distro, elrepo, nvidia], description: Driver source.}
  engine: {type: str, default: docker, choices: [docker, containerd, podman, none], description: Container engine.}
  engine_source: {type: str, default: auto, choices: [auto, distro, docker-ce], description: Engine source.}
  runtime_name: {type: str, default: nvidia, description: Name of the runtime in the engine.}
  default_runtime: {type: bool, default: true, description: Make it the default runtime.}
  cdi: {type: bool, default: false, description: Enable CDI.}
  validate: {type: bool, default: true, description: Start a validation container.}
  persistence: {type: bool, default: true, description: "Install and enable nvidia-persistenced with the driver on
    data-centre GPUs."}
  replace_runtime: {type: bool, default: false, description: "Replace the operator's own runtime of that name or
    default-runtime (otherwise gpuprov refuses, exit 14)."}
  allow_remove: {type: bool, default: false, description: "Let a package install remove installed packages
    (otherwise an install that would remove any stops before it runs, exit 14)."}
  restart_engine: {type: bool, default: false, description: "Let gpuprov restart dockerd where a change needs it
    (features.cdi, a newer --gpus hook) although that stops its running containers (live-restore off); otherwise
    such a run stops before it writes anything, exit 14."}
  bundle: {type: path, description: Offline bundle directory on the node (the only package source).}
  bundle_keyring: {type: path, description: "Keyring on the node with the bundle's signer key: the bundle must be
    signed by it."}
  for_gpus: {type: list, elements: str, default: [], description: "Image baking: decide as if these GPUs
    (VENDOR:DEVICE) were present."}
  kernels: {type: list, elements: str, default: [], description: Build the driver for these installed kernels.}
  kubernetes: {type: bool, default: false, description: "Then `gpuprov k8s node` (CRI handler, CDI spec, NFD labels)."}
  stages:
    type: list
    elements: str
    choices: [driver, engine, runtime, validate]
    default: [driver, engine, runtime, validate]
    description: Only these stages (`gpuprov bootstrap --only`); the role derives them from the play's tags.
  mirrors: {type: dict, default: {}, description: "Repository name (elrepo, epel, cuda, docker-ce) -> base URL of a mirror."}
  engine_options: {type: dict, default: {}, description: "Docker: daemon.json key -> value, merged by gpuprov with its
    own keys and the file's others (`--engine-option KEY=JSON`); not runtimes, default-runtime or features."}
  engine_users: {type: list, elements: str, default: [], description: "Docker: existing users added to the docker
    group (`--engine-user`)."}
  gpuprov: {type: path, default: /usr/local/bin/gpuprov, description: The gpuprov command on the node.}
  state: {type: str, default: present, choices: [present, absent], description: "present: `gpuprov bootstrap`;
    absent: `gpuprov uninstall` (gpuprov's keys out of the engine configs, the operator's kept; packages stay)."}
  uninstall_driver: {type: bool, default: false, description: "With state absent: also purge the driver packages
    gpuprov installed (`uninstall --purge-driver`)."}
  uninstall_engine: {type: bool, default: false, description: "With state absent: also purge the engine packages
    gpuprov installed, never one it found (`uninstall --purge-engine`)."}
  uninstall_engine_data: {type: str, choices: ["", keep, delete], default: "", description: "With uninstall_engine:
    keep (remove, not purge, a package whose purge deletes the engine's data root: Debian's docker.io and
    /var/lib/docker) or delete (purge it, deleting the containers, images and volumes there). Empty: such a purge
    stops (exit 14) while the data root holds any of the operator's (`uninstall --keep-engine-data`/`--delete-engine-data`)."}
author: gpuprov developers
"""
RETURN = r"""
steps: {description: Each step with its status (ok/changed/verified) or, in check mode, would_change., type: list}
reboot_required: {description: A reboot is needed to finish (driver installed / nouveau blacklisted)., type: bool}
rc: {description: gpuprov's exit code (provision/errors.py), type: int}
busy: {description: Another gpuprov run held the node's lock (exit 11); the role's task retries while this is true., type: bool}
"""

# The option choices are gpuprov's own (provision/options.py); tests/unit/test_option_choices.py holds these to them
# and parses the argv below with gpuprov's CLI.
STAGES = ["driver", "engine", "runtime", "validate"]
ARGUMENT_SPEC = dict(
    driver=dict(type="str", default="auto"),
    kernel_modules=dict(type="str", default="auto", choices=["auto", "open", "proprietary"]),
    driver_source=dict(type="str", default="distro", choices=["distro", "elrepo", "nvidia"]),
    engine=dict(type="str", default="docker", choices=["docker", "containerd", "podman", "none"]),
    engine_source=dict(type="str", default="auto", choices=["auto", "distro", "docker-ce"]),
    runtime_name=dict(type="str", default="nvidia"),
    default_runtime=dict(type="bool", default=True),
    cdi=dict(type="bool", default=False),
    validate=dict(type="bool", default=True),
    persistence=dict(type="bool", default=True),
    replace_runtime=dict(type="bool", default=False),
    allow_remove=dict(type="bool", default=False),
    restart_engine=dict(type="bool", default=False),
    bundle=dict(type="path"),
    bundle_keyring=dict(type="path"),
    for_gpus=dict(type="list", elements="str", default=[]),
    kernels=dict(type="list", elements="str", default=[]),
    kubernetes=dict(type="bool", default=False),
    stages=dict(type="list", elements="str", choices=STAGES, default=STAGES),
    mirrors=dict(type="dict", default={}),
    engine_options=dict(type="dict", default={}),
    engine_users=dict(type="list", elements="str", default=[]),
    gpuprov=dict(type="path", default="/usr/local/bin/gpuprov"),
    state=dict(type="str", default="present", choices=["present", "absent"]),
    uninstall_driver=dict(type="bool", default=False),
    uninstall_engine=dict(type="bool", default=False),
    uninstall_engine_data=dict(type="str", choices=["", "keep", "delete"], default=""),
)

# What to change in the play for each way gpuprov fails (gpuprov's own `Error:` line says what happened). Keyed by
# gpuprov's exit codes; tests/unit/test_role_exit_codes.py fails when errors.py has a code this table lacks.
FIXES = {
    codes.INTERNAL: "a bug in gpuprov: run `GPUPROV_DEBUG=1 gpuprov bootstrap --check` on the node for a "
                    "traceback and report it",
    codes.USAGE: "gpuprov refused an option: check the gpuprov_* variables against the role's "
                 "meta/argument_specs.yml",
    codes.HOST_UNREADABLE: "the node's /etc/os-release is missing or unreadable: repair it",
    codes.UNSUPPORTED: "gpuprov has no rules for this node's release or GPU: see the README's supported targets, "
                       "or set gpuprov_driver: skip to leave the driver alone",
    codes.STEP_FAILED: "a step failed (its command and output are in stderr; nothing after it ran): fix what it "
                       "names and run the play again (every step is idempotent)",
    codes.CONFIG_INVALID: "the config file named above is not valid and was left untouched: repair it by hand, "
                          "then run the play again",
    codes.BUNDLE_INVALID: "the offline bundle failed verification: rebuild it with `gpuprov bundle create`, and set "
                          "gpuprov_bundle_keyring to its signer's keyring when it is signed",
    codes.BUNDLE_MISMATCH: "the bundle is for another release, kernel or architecture: build one for this node "
                           "(`gpuprov bundle create --target ...`) and point gpuprov_bundle at it",
    codes.REQUIREMENT_FAILED: "the node failed verification: run `gpuprov verify` on it for each check's detail",
    codes.HOST_BUSY: "another gpuprov run holds the node's host lock (named above) and did not finish while the "
                     "task retried (gpuprov_busy_retries times, gpuprov_busy_delay seconds apart): let it finish, "
                     "or raise gpuprov_busy_retries",
    codes.DECLINED: "gpuprov was declined at its confirmation prompt (the module passes --yes): run the play again",
    codes.WRITE_FAILED: "the node's disk is full or read-only (the file is untouched): free space or remount it "
                        "read-write, then run the play again",
    codes.CONFLICT: "the node has its own runtime of that name or another default-runtime: set "
                    "gpuprov_replace_runtime: true to replace it, or choose another gpuprov_runtime_name or "
                    "gpuprov_default_runtime: false; or a package install would remove installed packages (named): "
                    "keep them, or set gpuprov_allow_remove: true; or an engine purge would delete containers, "
                    "images or volumes of yours (named): set gpuprov_uninstall_engine_data: keep or delete",
    codes.NO_DEVICE: "the driver is installed but the node has no NVIDIA GPU to verify it on: boot it with its GPU "
                     "and run the play again, or set gpuprov_driver: skip for nodes without a GPU",
    codes.DKMS_FAILED: "the NVIDIA kernel module did not build for the node's kernel (rolled back; the log is "
                       "under /var/log/gpuprov): install that kernel's headers, or set gpuprov_kernel_modules or "
                       "pin gpuprov_driver to another branch",
    codes.INTERRUPTED: "gpuprov was interrupted on the node (SIGINT): run the play again (every step is "
                       "idempotent)",
}


def bootstrap_argv(p: dict, check_mode: bool) -> list[str]:
    """The gpuprov command line for these module parameters. `--no-wait`: a node held by another gpuprov run fails
    at once (exit 11) and the role's task retries, rather than hanging silently inside one task."""
    argv = [p["gpuprov"], "--no-wait", "bootstrap", "--json", "--driver", p["driver"],
            "--kernel-modules", p["kernel_modules"], "--driver-source", p["driver_source"], "--engine", p["engine"],
            "--engine-source", p["engine_source"], "--runtime-name", p["runtime_name"]]
    argv += [] if p["default_runtime"] else ["--no-default-runtime"]
    argv += ["--cdi"] if p["cdi"] else []
    argv += [] if p["validate"] else ["--no-validate"]
    argv += [] if p["persistence"] else ["--no-persistence"]
    argv += ["--replace-runtime"] if p["replace_runtime"] else []
    argv += ["--allow-remove"] if p["allow_remove"] else []
    argv += ["--restart-engine"] if p["restart_engine"] else []
    argv += ["--bundle", p["bundle"]] if p["bundle"] else []
    argv += ["--bundle-keyring", p["bundle_keyring"]] if p["bundle_keyring"] else []
    argv += [a for gpu in p["for_gpus"] or () for a in ("--for-gpu", gpu)]
    argv += [a for kernel in p["kernels"] or () for a in ("--kernel", kernel)]
    argv += ["--only", ",".join(p["stages"])] if set(p["stages"]) != set(STAGES) else []
    argv += [a for name, url in sorted((p["mirrors"] or {}).items()) for a in ("--mirror", f"{name}={url}")]
    argv += [a for key, value in sorted((p["engine_options"] or {}).items())
             for a in ("--engine-option", rules.engine_option_text(key, value))]
    argv += [a for user in p["engine_users"] or () for a in ("--engine-user", user)]
    return argv + (["--check"] if check_mode else ["--yes"])


def uninstall_argv(p: dict, check_mode: bool) -> list[str]:
    """`gpuprov uninstall` for `state: absent` (a dry run in check mode)."""
    argv = [p["gpuprov"], "--no-wait", "uninstall", "--json"]
    argv += ["--purge-driver"] if p["uninstall_driver"] else []
    argv += ["--purge-engine"] if p["uninstall_engine"] else []
    argv += [f"--{p['uninstall_engine_data']}-engine-data"] if p["uninstall_engine"] and p.get("uninstall_engine_data") \
        else []
    return argv + (["--dry-run"] if check_mode else ["--yes"])


def absent(m: AnsibleModule, p: dict) -> None:
    """state: absent. In check mode a step the dry run lists is a change (its plan lists only what is there to take
    away), the lock's own release aside."""
    rc, doc = run_gpuprov(m, uninstall_argv(p, m.check_mode), (codes.OK,), "gpuprov uninstall")
    if m.check_mode:
        steps = [s for s in doc["steps"] if not s["verify_only"]]
        diff = "".join(d for s in steps for d in s["diffs"].values())
        m.exit_json(changed=bool(steps), steps=steps, reboot_required=False, rc=rc,
                    diff={"prepared": diff} if diff else {})
    m.exit_json(changed=doc["changed"] > 0, steps=doc["steps"], reboot_required=False, rc=rc)


def run_gpuprov(m: AnsibleModule, argv: list[str], ok: tuple[int, ...], what: str) -> tuple[int, dict]:
    """Run gpuprov with --json: (its exit code, its JSON document); any other exit code, or no JSON, fails the task
    with gpuprov's own line and the fix."""
    rc, out, err = m.run_command(argv)
    if rc not in ok:
        m.fail_json(msg=failure(rc, err, what), rc=rc, busy=rc == codes.HOST_BUSY, stderr=err, stdout=out, cmd=argv)
    try:
        return rc, json.loads(out)
    except ValueError:
        m.fail_json(msg="gpuprov printed no JSON", rc=rc, stdout=out, stderr=err)
        raise  # fail_json exits; this keeps the type checker and a stubbed module honest


def failure(rc: int, err: str, what: str) -> str:
    """One line for the task's failure: gpuprov's own error line, then the fix in the play's terms."""
    errors = [ln[len("Error:"):].strip() for ln in err.splitlines() if ln.startswith("Error:")]
    said = errors[-1] if errors else f"{what} exited {rc}"
    fix = FIXES.get(rc)
    return f"{said} (exit {rc}). Fix: {fix}" if fix else f"{said} (exit {rc})"


def main() -> None:
    m = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = m.params
    bad = rules.check_params(p)
    if bad:  # gpuprov's own rules, as its CLI would say them (exit 2), before anything runs on the node
        m.fail_json(msg=f"{'; '.join(bad)} (exit {codes.USAGE}). Fix: {FIXES[codes.USAGE]}", rc=codes.USAGE)
    if p["state"] == "absent":
        absent(m, p)
    if not p["stages"]:
        m.exit_json(changed=False, steps=[], reboot_required=False, msg="no stage selected by the tags")
    rc, doc = run_gpuprov(m, bootstrap_argv(p, m.check_mode), (codes.OK, codes.REBOOT_REQUIRED), "gpuprov bootstrap")
    k8s = _kubernetes(m, p) if p["kubernetes"] and "runtime" in p["stages"] and rc == codes.OK else []
    if m.check_mode:
        changed = doc["would_change"] > 0 or bool(k8s)
        diff = "".join(s.get("diff", "") for s in doc["steps"])
        m.exit_json(changed=changed, steps=doc["steps"], reboot_required=False, rc=rc,
                    diff={"prepared": diff} if diff else {})
    m.exit_json(changed=doc["changed"] > 0 or bool(k8s), steps=doc["steps"], kubernetes=k8s, rc=rc,
                reboot_required=rc == codes.REBOOT_REQUIRED or doc.get("reboot_required", False))


def _kubernetes(m: AnsibleModule, p: dict) -> list:
    """A Kubernetes pool's node side after bootstrap: `gpuprov k8s node` (same engine, CDI, default handler)."""
    argv = [p["gpuprov"], "--no-wait", "k8s", "node", "--json", "--engine", p["engine"],
            "--cdi" if p["cdi"] else "--no-cdi"]
    argv += ["--default"] if p["default_runtime"] else []
    argv += ["--dry-run"] if m.check_mode else ["--yes"]  # (k8s node asks first, as bootstrap, without it)
    rc, out, err = m.run_command(argv)
    if rc != codes.OK:
        m.fail_json(msg=failure(rc, err, "gpuprov k8s node"), rc=rc, busy=rc == codes.HOST_BUSY, stderr=err,
                    cmd=argv)
    return json.loads(out)["changed"]


if __name__ == "__main__":
    main()
