"""What the runtime's cold editor loads: `python3 -I -S provision/inject/modify_main.py BUNDLE`, which the compiled
front-end runs for a GPU create when no warm editor answers, imports only what such a create uses. Not the detect
layer (provision.facts: discovery needs it only when it rebuilds its cache), not the modules that only a copy, a
process or the warm editor's server need. bench/detect_bench.py times this start against a bare start of the same
interpreter (issue 20: <= 5x); this test holds the imports that got it there, not the time."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

# Never on a cold GPU create that finds the discovery cache current (prefixes: a package and all below it).
NOT_LOADED = ("provision.facts", "provision.effects", "provision.inject.server", "provision.share.state", "typing",
              "shutil", "subprocess", "bz2", "lzma", "glob", "struct", "rich", "provision.progress", "textwrap")

# modify_main.py's own steps, in a child started as the front-end starts it (-I -S), then the modules it loaded.
COLD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from provision.inject.shim import run_create_edits
rc = run_create_edits(sys.argv[2]) if len(sys.argv) > 2 else None
from provision.inject import modify, settings  # what a GPU create loads (shim.create_edits), also without a bundle
print(json.dumps({"rc": rc, "modules": sorted(sys.modules)}))
"""


def cold_modules(*bundle: str, env: dict | None = None) -> tuple[int | None, set[str]]:
    p = subprocess.run([sys.executable, "-I", "-S", "-c", COLD, str(REPO), *bundle], capture_output=True, text=True,
                       env=env)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    return out["rc"], set(out["modules"])


def loaded(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in NOT_LOADED))


def test_cold_editor_imports_nothing_a_create_does_not_use():
    _, modules = cold_modules()
    assert {"provision.inject.modify", "provision.inject.discover", "provision.fsutil"} <= modules  # it did load
    assert loaded(modules) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod (the fake H200 host's device nodes)")
def test_cold_create_loads_the_detect_layer_only_to_rebuild_discovery(tmp_path):
    """A real create on the fake H200 host: the first one rebuilds the discovery cache (and so loads the driver facts:
    the check sees what it looks for), the next one reads the cache and loads none of NOT_LOADED."""
    from tests.inject_helpers import edited, gpu_bundle, write_settings

    env = {"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(write_settings(tmp_path))}
    first = gpu_bundle(tmp_path, "first")
    rc, modules = cold_modules(str(first), env=env)
    assert rc == 0 and "provision.facts.driver_facts" in modules and (tmp_path / "discovery.json").exists()
    second = gpu_bundle(tmp_path, "second")
    rc, modules = cold_modules(str(second), env=env)
    assert rc == 0 and edited(second) and loaded(modules) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod (the fake H200 host's device nodes)")
@pytest.mark.parametrize("closed", ["", ">&-", "2>&-"])
def test_modify_main_exits_with_the_create_code_whatever_its_streams(tmp_path, closed):
    """modify_main.py itself, as the front-end runs it (-I -S, a bundle, runc's log and format), ends through
    os._exit with the create's code: 0 for a GPU create, 10 for a refusal (settings that do not exist), also when it
    was started with stdout or stderr closed (the stream is None then: nothing to flush, nothing to print to)."""
    from tests.inject_helpers import edited, gpu_bundle, write_settings

    main = str(REPO / "provision/inject/modify_main.py")
    for settings, want in ((write_settings(tmp_path), 0), (tmp_path / "none.json", 10)):
        bundle = gpu_bundle(tmp_path, f"b{want}")
        env = {"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(settings)}
        p = subprocess.run(["sh", "-c", f'exec "$@" {closed}', "sh", sys.executable, "-I", "-S", main, str(bundle),
                            str(tmp_path / "runc.log"), "json"], capture_output=True, text=True, env=env, timeout=60)
        assert p.returncode == want, (closed, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr and edited(bundle) == (want == 0)
        if want:  # the refusal reaches runc's log (where containerd reads it) whatever became of stderr
            assert "gpuprov-runtime: " in (tmp_path / "runc.log").read_text(), closed


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod (the fake H200 host's device nodes)")
@pytest.mark.parametrize("editor", ["cold", "python-front-end"])
def test_gpu_create_without_settings_is_refused_and_writes_nothing(tmp_path, editor):
    """Issue 32: a runtime with no runtime.json refuses a GPU container (exit 10, the file and the fix named) before
    it discovers anything, so no discovery cache appears under the state directory (here a fresh one, as on a machine
    that never ran gpuprov: before the fix the defaults' cache was written there, then the start refused)."""
    from tests.inject_helpers import gpu_bundle

    state = tmp_path / "state"  # absent, as /var/lib/gpuprov on a fresh machine
    bundle = gpu_bundle(tmp_path, "b")
    before = (bundle / "config.json").read_bytes()
    env = {"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(tmp_path / "none.json"),
           "GPUPROV_STATE_DIR": str(state), "GPUPROV_RUN_DIR": str(tmp_path / "run")}
    argv = [sys.executable, "-I", "-S", str(REPO / "provision/inject/modify_main.py"), str(bundle),
            str(tmp_path / "runc.log")] if editor == "cold" else \
        [sys.executable, "-c", "import sys; from provision.inject.shim import main; sys.exit(main())", "create",
         "--bundle", str(bundle), "x"]
    p = subprocess.run(argv, capture_output=True, text=True, env={**env, "PYTHONPATH": str(REPO)}, timeout=60)
    assert p.returncode == 10, (p.stdout, p.stderr)
    assert f"{tmp_path / 'none.json'} does not exist" in p.stderr and "gpuprov runtime install" in p.stderr
    assert not state.exists() and not (tmp_path / "run").exists()
    assert (bundle / "config.json").read_bytes() == before
