"""The gpuprov users install is the one tested (issues 38 item 7, 39 item 4): the wheel built from this checkout,
installed as the README says (`install.sh` from a wheelhouse: a clean virtualenv, no extras), and the README's
commands run from it, with no checkout on its `sys.path`. The rest of the suite runs gpuprov from the checkout with
the test extras installed beside it, which is how `gpuprov metrics` (prometheus_client only in the test extra) and
`bundle create` (reading pyproject.toml from the source tree) came to fail for every installed user unseen.

Here: every command's `--help`; `plan`, `bootstrap --check` and `uninstall --dry-run` on a fixture host tree; `metrics`
once, NVML answering from the H200 capture (tests/fake_nvml.py, appended to `sys.path` after the virtualenv's own, so
it can never shadow the installed gpuprov); `bundle create` of the runtime component from the real archive, packing
the wheel install.sh kept. The install runs in a private mount namespace with a tmpfs over /usr/local/bin, and the
virtualenv and the command's link under tmp_path (GPUPROV_PREFIX, GPUPROV_BIN_DIR): the machine's own gpuprov is never
touched."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, make_host, needs

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("python3", "unshare", "debootstrap", docker=True)]


class Installed:
    def __init__(self, base: Path):
        self.venv, self.bin, self.cwd = base / "venv", base / "bin", base / "cwd"
        self.cwd.mkdir()

    def run(self, *args: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
        """The installed `gpuprov ARGS` as a user runs it: from a directory outside the checkout, with no
        PYTHONPATH."""
        e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        e["PATH"] = f"{self.bin}:/usr/sbin:/usr/bin:/sbin:/bin"
        return subprocess.run(["gpuprov", *args], capture_output=True, text=True, cwd=self.cwd, timeout=timeout,
                              env={**e, **env})

    def python(self, code: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.venv / "bin/python"), "-c", code], capture_output=True, text=True,
                              cwd=self.cwd, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    from tests.integration.hosts import ensure_wheelhouse

    base = tmp_path_factory.mktemp("installed")
    inst = Installed(base)
    env = {**os.environ, "GPUPROV_WHEELHOUSE": str(ensure_wheelhouse()), "GPUPROV_PREFIX": str(inst.venv),
           "GPUPROV_BIN_DIR": str(inst.bin), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    inst.bin.mkdir()
    script = 'mount -t tmpfs gpuprov-test /usr/local/bin && exec bash "$0" --install-only'
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                        str(REPO / "install.sh")], capture_output=True, text=True, env=env, timeout=900,
                       cwd=inst.cwd)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return inst


def test_installed_from_the_wheel_alone(installed):
    """The package comes from the virtualenv, not the checkout, and no test extra is there."""
    r = installed.python("import provision, importlib.util as u, sys; print(provision.__file__); "
                         "print(sorted(m for m in ('pytest', 'hypothesis', 'ansible', 'kubernetes') if u.find_spec(m)))")
    assert r.returncode == 0, r.stderr
    where, extras = r.stdout.splitlines()
    assert where.startswith(str(installed.venv)), where
    assert extras == "[]", extras
    assert list((installed.venv / "wheels").glob("gpuprov-*.whl")), "install.sh kept no wheel for bundle create"


# Modules of the package that are not imported by gpuprov: each is run, and runs at import.
NOT_IMPORTED = {
    "provision.__main__": "`python -m provision`: the command line",
    "provision.inject.modify_main": "the compiled runtime front-end's entry script (argv: the bundle)",
    "provision.verify.test_gpu_node": "a testinfra suite, run by pytest from the fleet extra over an inventory",
}


def test_every_runtime_import_is_a_runtime_dependency(installed):
    """Every module of the installed package imports (lazily imported ones included: metrics' prometheus_client)."""
    r = installed.python(
        "import pkgutil, importlib, provision\n"
        "bad = []\n"
        "for m in pkgutil.walk_packages(provision.__path__, 'provision.'):\n"
        f"    if m.name in {sorted(NOT_IMPORTED)!r}:\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{m.name}: {e!r}')\n"
        "print('\\n'.join(bad))")
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr


def test_every_commands_help(installed):
    r = installed.python("from provision import cli\nfrom provision.commands import COMMANDS\n"
                         "from provision.commands.helptext import commands\n"
                         "root = cli.click_command(cli.load_commands(sorted({m for m, _ in COMMANDS.values()})))\n"
                         "print('\\n'.join(' '.join(p) for p, _ in commands(root)))")
    assert r.returncode == 0, r.stderr
    paths = [ln.split() for ln in r.stdout.splitlines()]
    assert len(paths) > 20 and ["bundle", "create"] in paths and ["metrics"] in paths, paths
    for path in [[], *paths]:
        h = installed.run(*path, "--help")
        assert h.returncode == 0 and "Usage:" in h.stdout and h.stderr == "", (path, h.stdout[-500:], h.stderr)


def test_plan_check_and_uninstall_dry_run_on_a_host_tree(installed, tmp_path):
    root = make_host(tmp_path, "debian-12", "datacenter", kernel="6.1.0-50-amd64")
    plan = installed.run("plan", "--root", str(root), "--json")
    assert plan.returncode == 0 and "Traceback" not in plan.stderr, plan.stderr
    assert [s["id"] for s in json.loads(plan.stdout)["steps"]], plan.stdout[:500]
    check = installed.run("bootstrap", "--check", "--root", str(root))
    assert "Traceback" not in check.stderr and "internal error" not in check.stderr, check.stderr
    assert check.returncode != 1, check.stderr[-1000:]  # 1 is an internal error; a step's own stop is its code
    un = installed.run("uninstall", "--dry-run", "--root", str(root))
    assert un.returncode == 0 and "Traceback" not in un.stderr, un.stderr


def test_metrics_once(installed):
    """`gpuprov metrics` from the installed package: NVML's answers from the H200 capture, the text from the installed
    prometheus_client (before: `internal error: ModuleNotFoundError("No module named 'prometheus_client'")`)."""
    r = installed.python(
        "import sys\n"
        f"sys.path.append({str(REPO)!r})  # after site-packages: the installed gpuprov comes first\n"
        "import provision\n"
        f"assert provision.__file__.startswith({str(installed.venv)!r}), provision.__file__\n"
        "from tests.fake_nvml import FakeNVML\n"
        "from provision.metrics import nvml\n"
        "nvml.load = lambda: FakeNVML()\n"
        "from provision.cli import main\n"
        "sys.exit(main(['metrics']))")
    assert r.returncode == 0, r.stderr
    assert "# TYPE " in r.stdout and "H200" in r.stdout, r.stdout[:1000]


def test_bundle_create_packs_the_installed_wheel(installed, tmp_path):
    """`bundle create` from an installed gpuprov: its dependencies from the installed metadata, its own wheel the one
    install.sh kept (before: FileNotFoundError on the source tree's pyproject.toml)."""
    out = tmp_path / "bundle"
    r = installed.run("bundle", "create", "--target", "debian-12", "--components", "runtime", "--output", str(out),
                      "--json", timeout=1200)
    assert r.returncode == 0, r.stdout[-1000:] + r.stderr[-2000:]
    wheels = {p.name.split("-")[0].lower().replace("_", "-") for p in out.rglob("*.whl")}
    assert {"gpuprov", "prometheus-client", "typer"} <= wheels, wheels
    kept = next((installed.venv / "wheels").glob("gpuprov-*.whl")).read_bytes()
    assert next(out.rglob("gpuprov-*.whl")).read_bytes() == kept
