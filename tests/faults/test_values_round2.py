"""Issue 19, items 2, 19 and 20: every value is checked against one table of rules (provision/values.py) before it
reaches a file or an argv, and the runtime's policy file is parsed strictly and fails closed.

- runtime.json: a value of the wrong type (`"accept_env_unprivileged": "false"`, truthy before), an unknown key (a
  typo that silently left the policy at its default), a relative path, a repeated key: every GPU container is
  refused (exit 6) with one line naming the file and the key, by both front-ends; runc never runs it.
- The CLI: `--mirror NAME=URL` with a newline (an apt line of the caller's own in docker.list), a scheme other than
  http/https/file, `--kernel ../../etc` (an `update-initramfs -k` argv), a runtime name, a namespace or a runtime
  path that breaks its rule: exit 2 with the value and the rule, and no plan printed.
- One table: the role's module refuses the same values with the same rules (its module_utils link), bootstrap's
  options take their module parameter's rule, runtime.json's keys and `runtime install`'s options share theirs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import IN_CI, REPO, run_cli
from tests.inject_helpers import (
    compiled_front_end,
    edited,
    fake_runc,
    gpu_bundle,
    python_front_end,
    runc_calls,
    settings_dict,
    stop_editors,
)

USAGE, CONFIG_INVALID = 2, 6  # the README's exit codes, spelled out so these tests also run against older code
H200 = REPO / "tests/fixtures/hosts/h200-vm"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod (fake device nodes)")

# --- item 2: runtime.json, strictly ---------------------------------------------------------------------------------

# (the key, the JSON text that sets it): each breaks its rule
BAD_SETTINGS = [
    ("accept_env_unprivileged", '"accept_env_unprivileged": "false"'),  # a string: truthy, the policy was off
    ("accept_env_unprivileged", '"accept_env_unprivileged": 0'),
    ("accept_env_unprivilegd", '"accept_env_unprivilegd": false'),  # a typo: ignored, the policy was off
    ("driver_root", '"driver_root": ["/usr/local/nvidia"]'),
    ("cache", '"cache": "relative/discovery.json"'),
    ("accept_env_unprivileged", '"accept_env_unprivileged": false, "accept_env_unprivileged": true'),  # repeated
]


def _write_raw(base, key: str, fragment: str):
    """runtime.json for the fake H200 host (runc: the recording stand-in) with `fragment` (raw JSON text) in place
    of `key`."""
    good = {k: v for k, v in {**settings_dict(base), "runc": str(base / "fake-runc")}.items() if k != key}
    p = base / "runtime.json"
    p.write_text(json.dumps(good)[:-1] + ", " + fragment + "}")
    return p


@pytest.fixture
def runtime(tmp_path):
    runc = fake_runc(tmp_path)
    exes = {"compiled": compiled_front_end(tmp_path, str(runc)), "python": python_front_end(tmp_path)}
    yield tmp_path, exes
    stop_editors(tmp_path / "runtime.json")


@needs_root
@pytest.mark.parametrize("key,fragment", BAD_SETTINGS, ids=[f for _, f in BAD_SETTINGS])
def test_a_bad_setting_refuses_gpu_containers_naming_file_and_key(runtime, key, fragment):
    base, exes = runtime
    sp = _write_raw(base, key, fragment)
    for kind, exe in exes.items():
        for attempt in ("cold", "warm"):  # the compiled front-end's second create asks the warm editor
            bundle = gpu_bundle(base, f"{kind}-{attempt}")  # unprivileged, NVIDIA_VISIBLE_DEVICES=all
            r = subprocess.run([str(exe), "create", "--bundle", str(bundle), "id"], capture_output=True, text=True,
                               timeout=60, env={"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(sp)})
            assert r.returncode == CONFIG_INVALID, (kind, attempt, r.returncode, r.stderr)
            line = r.stderr.strip()
            assert len(line.splitlines()) == 1 and str(sp) in line and repr(key) in line, (kind, line)
            assert not edited(bundle) and runc_calls(base) == [], (kind, "no GPU container may start")


@needs_root
def test_a_container_without_gpus_still_runs_and_a_bad_runc_runs_nothing(runtime):
    """Only GPU containers depend on the policy: the Python front-end hands a no-GPU create to the configured runc
    (as the compiled one, which has runc built in, does). A `runc` that breaks its rule runs nothing."""
    base, exes = runtime
    sp = _write_raw(base, "accept_env_unprivileged", '"accept_env_unprivileged": "false"')
    nogpu = base / "nogpu"
    nogpu.mkdir()
    (nogpu / "config.json").write_text(json.dumps({"process": {"env": ["PATH=/bin"]}, "root": {"path": "rootfs"}}))
    env = {"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(sp)}
    r = subprocess.run([str(exes["python"]), "create", "--bundle", str(nogpu), "id"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0 and runc_calls(base) == [f"create --bundle {nogpu} id"], r.stderr
    sp.write_text(json.dumps({**settings_dict(base), "runc": "fake-runc"}))  # relative: which fake-runc?
    r = subprocess.run([str(exes["python"]), "create", "--bundle", str(nogpu), "id"], capture_output=True, text=True,
                       timeout=60, env=env, cwd=base)
    assert r.returncode == CONFIG_INVALID and "'runc'" in r.stderr and len(runc_calls(base)) == 1, r.stderr


def test_settings_are_typed_and_frozen(tmp_path):
    from dataclasses import FrozenInstanceError

    from provision.inject.settings import Settings, SettingsInvalid, load_settings
    from provision.inject.settings_file import FIELDS

    assert tuple(Settings.__dataclass_fields__) == tuple(FIELDS)
    sp = tmp_path / "runtime.json"
    sp.write_text(json.dumps({"accept_env_unprivileged": False, "runc": "/usr/sbin/runc"}))
    s = load_settings(str(sp))
    assert s.accept_env_unprivileged is False and s.runc == "/usr/sbin/runc" and s.driver_root == "/"
    with pytest.raises(FrozenInstanceError):
        s.accept_env_unprivileged = True
    assert Settings.from_dict(s.to_dict()) == s
    for raw in ('[]', '{"runc": "/x",}', '{"share_state": null}', b'\xff'):
        sp.write_bytes(raw if isinstance(raw, bytes) else raw.encode())
        with pytest.raises(SettingsInvalid, match=str(sp)) as exc:
            load_settings(str(sp))
        assert exc.value.exit_code == CONFIG_INVALID and "\n" not in str(exc.value)


# --- item 19: every option value checked --------------------------------------------------------------------------

PLAN = ("plan", "--root", str(H200))
BAD_OPTIONS = [
    (PLAN + ("--mirror", "docker-ce=https://m.example/d\n[trusted=yes] http://evil.example/d"), "\\n[trusted=yes]"),
    (PLAN + ("--mirror", "docker-ce=ftp://m.example/docker-ce"), "ftp://"),
    (PLAN + ("--mirror", "cuda=https://m.example/a b"), "a b"),
    (PLAN + ("--kernel", "../../etc"), "'../../etc'"),
    (PLAN + ("--kernel", "6.1.0-28-amd64/../../x"), "'6.1.0-28-amd64/../../x'"),
    (PLAN + ("--runtime-name", 'nvidia" x'), "nvidia"),
    (("k8s", "manifests", "--namespace", "Kube System"), "'Kube System'"),
    (("engine", "configure", "docker", "--dry-run", "--runtime-path", "gpuprov-runtime"), "'gpuprov-runtime'"),
    (("engine", "configure", "docker", "--dry-run", "--runtime-name", "a.b"), "'a.b'"),
]


@pytest.mark.parametrize("argv,shown", BAD_OPTIONS, ids=[" ".join(a[-2:]) for a, _ in BAD_OPTIONS])
def test_bad_option_values_are_usage_errors_naming_value_and_rule(tmp_path, argv, shown):
    if argv[0] == "engine":
        (tmp_path / "daemon.json").write_text("{}\n")
        argv = (*argv, "--config", str(tmp_path / "daemon.json"))
    r = run_cli(*argv, env={"GPUPROV_LOCK_DIR": str(tmp_path), "GPUPROV_RUNTIME_CONFIG": str(tmp_path / "rt.json")},
                timeout=120)
    assert r.returncode == USAGE, (r.returncode, r.stderr, r.stdout[-500:])
    assert r.stdout == "", "nothing planned or written"
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and shown in line and ": " in line.split(shown, 1)[1], line
    if argv[0] == "engine":
        assert (tmp_path / "daemon.json").read_text() == "{}\n"


def test_good_values_pass(tmp_path):
    import shutil

    root = tmp_path / "host"  # the capture with the --kernel installed (a kernel that is not is exit 4: issue 28.12)
    shutil.copytree(H200, root, symlinks=True)
    (root / "lib/modules/6.1.0-28-amd64").mkdir(parents=True)
    r = run_cli("plan", "--root", str(root), "--mirror", "docker-ce=https://m.example/docker-ce/linux", "--mirror",
                "cuda=file:///srv/cuda", "--kernel", "6.1.0-28-amd64", "--runtime-name", "nvidia-gpu", timeout=120)
    assert r.returncode == 0, r.stderr


# --- item 20: one table ---------------------------------------------------------------------------------------------

# a value that breaks the rule of each module parameter (values.PARAMS)
MODULE_BAD = {"driver": "535; reboot", "runtime_name": "nvidia\n", "bundle": "/srv/b\x1b[2J", "bundle_keyring": "/k\n",
              "for_gpus": ["10de:2330\n"], "kernels": ["../../etc"],
              "mirrors": {"docker-ce": "https://m.example/d\n[trusted=yes] http://evil.example/d"},
              "engine_options": {"default-runtime": "runc"}, "engine_users": ["root\n"]}


def test_the_role_refuses_what_the_cli_refuses():
    """The module (as Ansible ships it, module_utils links included) checks each parameter with gpuprov's rules, and
    gpuprov's CLI, given the argv the module would build, exits 2 on the same value."""
    from provision import values
    from tests.unit.test_option_choices import _module, _module_defaults

    mod = _module()
    assert mod.rules.PARAMS is not None and set(MODULE_BAD) == set(values.PARAMS)
    defaults = _module_defaults(mod)
    assert mod.rules.check_params({**defaults, "gpuprov": "gpuprov"}) == []
    for param, bad in MODULE_BAD.items():
        said = mod.rules.check_params({**defaults, param: bad})
        assert len(said) == 1 and said[0].startswith(f"{param} "), (param, said)
        argv = mod.bootstrap_argv({**defaults, "gpuprov": "gpuprov", param: bad}, check_mode=True)
        r = run_cli(*argv[1:-1], "--dry-run", "--root", str(H200), timeout=120)
        assert r.returncode == USAGE, (param, r.stderr)


@pytest.mark.skipif(not (Path(sys.executable).with_name("ansible")).exists() and not IN_CI,
                    reason="needs ansible (the [fleet] extra)")
def test_the_module_refuses_on_the_node_through_ansible(tmp_path):
    """Through Ansible itself (its module packaging follows the module_utils link): the bad value is refused before
    any gpuprov runs on the node (`gpuprov` here would record its calls)."""
    calls = tmp_path / "calls"
    fake = tmp_path / "gpuprov"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "ANSIBLE_LIBRARY": str(REPO / "roles/gpuprov/library"),
           "ANSIBLE_MODULE_UTILS": str(REPO / "roles/gpuprov/module_utils"), "ANSIBLE_LOCAL_TEMP": str(tmp_path)}
    args = json.dumps({"kernels": ["../../etc"], "gpuprov": str(fake)})
    r = subprocess.run([str(Path(sys.executable).with_name("ansible")), "localhost", "-c", "local", "-m",
                        "gpuprov_node", "-a", args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert "FAILED" in r.stdout and "kernels '../../etc': a kernel release" in r.stdout, r.stdout + r.stderr
    assert '"rc": 2' in r.stdout and not calls.exists()


def test_cli_options_take_the_rules_of_the_table():
    """bootstrap's options check with their module parameter's rule (values.PARAMS); `runtime install`'s options
    with the rule of the runtime.json key they write (settings_file.FIELDS)."""
    import typer.main

    from provision import values
    from provision.cli import load_commands
    from provision.inject.settings_file import FIELDS
    from provision.options import MODULE_PARAMS

    app = typer.main.get_command(load_commands(["plan", "runtime_cmds"]))
    boot = {p.name: p for p in app.commands["bootstrap"].params}
    for option, param in MODULE_PARAMS.items():
        if param in values.PARAMS and option != "mirror":  # NAME=URL: options.Options.parse checks the URL part
            assert getattr(boot[option].callback, "rule", None) == values.PARAMS[param], option
    install = {p.name: p for p in app.commands["runtime"].commands["install"].params}
    for key in ("runc", "driver_root", "dev_root", "proc_root"):
        rule = FIELDS[key][0]
        assert values.RULES[rule.__name__] is rule and install[key].callback.rule == rule.__name__, key
