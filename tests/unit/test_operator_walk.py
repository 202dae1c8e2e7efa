"""Issue 39 item 7: the smaller things seen in the operator's walk. Each test fails on the code before (the
noexec /tmp ones: tests/faults/test_noexec_tmp.py; the --help listings: tests/unit/test_help.py)."""
from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from provision import progress, values
from provision.bundle.install import open_verified
from provision.errors import BundleInvalid
from provision.plan import apply as ap
from provision.plan.steps import Command, Step, Undone
from tests.conftest import REPO, needs


def _gpuprov(*args: str, stdin=subprocess.DEVNULL, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "provision", *args], stdin=stdin, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env}, timeout=120)


def test_a_directory_that_is_no_bundle_is_called_so(tmp_path):
    """`bundle install /root` said "…/driver: a link (a bundle holds no links)" (it began copying /root)."""
    home = tmp_path / "root"
    home.mkdir()
    (home / "driver").symlink_to("/usr/lib")
    (home / "notes.txt").write_text("mine\n")
    with pytest.raises(BundleInvalid) as exc:
        open_verified(home, base=tmp_path / "extract", private=True)  # what `bundle install DIR` does first
    assert str(exc.value) == (f"{home}: not a gpuprov bundle (it has no manifest.json and no SHA256SUMS): give the "
                              "directory or .tar.gz that `gpuprov bundle create` made")
    assert exc.value.exit_code == 8 and not (tmp_path / "extract").exists()  # nothing was copied
    r = _gpuprov("bundle", "verify", str(home))
    assert r.returncode == 8 and "not a gpuprov bundle" in r.stderr and "link" not in r.stderr, r.stderr


def test_a_root_that_is_no_host_tree_suggests_only_options_the_command_has(tmp_path):
    """`uninstall --root /tmp` suggested --target, which uninstall does not have; plan and detect have it."""
    r = _gpuprov("uninstall", "--dry-run", "--root", str(tmp_path))
    assert r.returncode == 3 and "no os-release under" in r.stderr and "--target" not in r.stderr, r.stderr
    for cmd in ("plan", "detect"):
        r = _gpuprov(cmd, "--root", str(tmp_path))
        assert r.returncode == 3 and "or use --target to name the release" in r.stderr, r.stderr


@needs("containerd")
def test_k8s_node_asks_first_as_bootstrap_does(tmp_path):
    """`k8s node` changed the host with no --yes and no question. Now: not on a terminal it refuses without --yes
    (exit 2), on one it shows what would change and asks (no: exit 12); nothing changes either way."""
    cfg = tmp_path / "config.toml"
    cfg.write_text("version = 2\n")
    rt = tmp_path / "runtime.json"
    env = {"GPUPROV_RUNTIME_CONFIG": str(rt), "GPUPROV_LOCK_DIR": str(tmp_path / "lock"),
           "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
    argv = ("k8s", "node", "--engine", "containerd", "--config", str(cfg), "--runtime-path",
            "/usr/local/bin/gpuprov-runtime", "--no-cdi")
    r = _gpuprov(*argv, **env)
    assert r.returncode == 2 and "refusing to change the host without --yes" in r.stderr, r.stdout + r.stderr
    assert cfg.read_text() == "version = 2\n" and not rt.exists()
    primary, secondary = os.openpty()  # a terminal on stdin, as an operator's
    try:
        os.write(primary, b"n\n")
        r = _gpuprov(*argv, stdin=secondary, **env)
    finally:
        os.close(primary)
        os.close(secondary)
    assert r.returncode == 12, r.stdout + r.stderr
    assert "runtimes.nvidia" in r.stdout and "Apply these changes?" in r.stdout and "declined" in r.stderr
    assert cfg.read_text() == "version = 2\n" and not rt.exists()


def test_the_engine_option_examples_survive_a_shell():
    """The error suggested log-driver="local": pasted into a shell, the quotes go and it fails again. Every example it
    gives now passes gpuprov's own rule after a shell has split it."""
    with pytest.raises(values.BadValue) as exc:
        values.engine_option("log-driver=local")  # what the shell made of log-driver="local"
    said = str(exc.value)
    examples = re.findall(r"--engine-option ('[^']*'|[^\s,)]+)", said + " " + values.ENGINE_OPTION_TEXT)
    assert len(examples) >= 3, said
    for example in examples:
        (arg,) = shlex.split(example)
        assert values.engine_option(arg) == arg
    assert said.endswith("--engine-option 'log-driver=\"local\"'")


def test_the_garbled_lines_read_as_sentences(tmp_path):
    """"skipped when /var/lib/gpuprov/installed.json hold this content"; "1 change(s), 1 steps"; uninstall counted
    [4/4] then [1/1] after a dry run of 5 steps (apply_plan numbers a plan applied in parts as one)."""
    assert Undone(files=(("/var/lib/gpuprov/installed.json", "{}"),)).describe() == \
        "skipped when /var/lib/gpuprov/installed.json holds this content"
    assert Undone(files=(("/a", ""), ("/b", ""))).describe() == "skipped when /a, /b hold this content"
    res = ap.ApplyResult([ap.StepOutcome("a", "A", ap.Status.CHANGED)])
    assert res.counts() == "1 change, 1 step"
    res.outcomes.append(ap.StepOutcome("b", "B", ap.Status.OK))
    assert res.counts() == "1 change, 2 steps"
    steps = [Step(f"s.{i}", "engine", f"Step {i}", actions=(Command(("true",)),)) for i in range(1, 6)]
    out = io.StringIO()
    with progress.Run("uninstall", log_dir=None, mode="plain", stream=out) as run:
        ap.apply_plan(steps[:4], logged=False, run=run, total=5)
        ap.apply_plan(steps[4:], logged=False, run=run, first=5, total=5)
    assert re.findall(r"^\[(\d/\d)\]", out.getvalue(), re.M) == ["1/5", "2/5", "3/5", "4/5", "5/5"]


def test_bootstrap_and_bundle_install_summaries_count_in_words():
    for name in ("plan.py", "bundle.py"):  # (uninstall.py's line is its owner's: see docs/PROOFS.md)
        text = (REPO / "provision/commands" / name).read_text()
        assert "change(s)" not in text and "{res.counts()}" in text, name


def test_ansible_lint_config_leaves_the_test_fixtures_out():
    """`ansible-lint` at the repository root read tests/fixtures/cdi/*.yaml (nvidia-ctk's own output, kept as it
    is) and failed with 123 YAML errors. tests/unit/test_lint.py runs it there too."""
    import yaml

    conf = yaml.safe_load((REPO / ".ansible-lint").read_text())
    assert "tests/fixtures/" in conf["exclude_paths"]
    assert json.dumps(conf["skip_list"])  # the skips it had stay
