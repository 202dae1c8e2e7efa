"""`gpuprov detect` runs without typer when its arguments are plain options, and `gpuprov --help` / `--version`
always do (provision/cli.py: fast_path). These tests hold the fast path to the typer command: the same options,
kinds, rules and defaults, and for every argv (good ones, bad options, bad values, --help at every terminal width,
Ctrl-C, a closed pipe) the same stdout, stderr and exit code with the fast path as with typer alone. The argvs the
fast path hands to typer are named, so a change in what it takes is seen here."""
from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
import typer.main

from provision import cli, hostlock
from provision.commands import detect
from tests.conftest import H200, gpuprov_bin

KINDS = {"flag": lambda p: p.is_flag, "list": lambda p: p.multiple and not p.is_flag,
         "path": lambda p: "Path" in type(p.type).__name__ and not p.multiple,
         "text": lambda p: type(p.type).__name__ == "StringParamType" and not p.multiple}


def _typer_command(name: str):
    return typer.main.get_command(cli.load_commands([cli.COMMANDS[name][0]])).commands[name]


@pytest.mark.parametrize("name", cli.FAST_COMMANDS)
def test_fast_options_are_the_typer_commands(name):
    """Every option of the typer command is in FAST_OPTIONS with its parameter, kind and rule, nothing else is, and
    `run`'s defaults are the values typer passes for an option not given."""
    module = sys.modules[f"provision.commands.{cli.COMMANDS[name][0]}"]
    params = [p for p in _typer_command(name).params if p.name != "help"]
    assert {p.opts[0] for p in params} == set(module.FAST_OPTIONS)
    defaults = {k: v.default for k, v in inspect.signature(module.run).parameters.items()}
    assert list(defaults) == [p.name for p in params]  # the typer command passes them positionally
    for p in params:
        param, kind, rule = module.FAST_OPTIONS[p.opts[0]]
        assert (param, len(p.opts), getattr(p.callback, "rule", None)) == (p.name, 1, rule), p.opts
        assert KINDS[kind](p), (p.opts, kind, p.type)
        assert defaults[param] == p.default, p.opts


def _run(argv: list[str], capsys, fast: bool, monkeypatch) -> tuple[int, str, str]:
    """main(argv)'s exit code (returned, or raised as SystemExit), stdout and stderr."""
    with monkeypatch.context() as m:
        m.setattr(hostlock, "_no_wait", False)
        m.setattr(sys, "stdout", sys.stdout)  # restored after a closed pipe's wrapper
        m.setattr(sys, "stderr", sys.stderr)
        if not fast:
            m.setattr(cli, "fast_path", lambda argv: None)
        try:
            rc = cli.main(argv)
        except SystemExit as exc:
            rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


ROOT = str(H200)
TAKEN = [  # the fast path runs these
    ["--help"], ["--version"],
    ["detect", "--root", ROOT, "--json"],
    ["detect", "--root", ROOT],
    ["--no-wait", "detect", "--root", ROOT, "--json"],
    ["detect", f"--root={ROOT}", "--json", "--json"],
    ["detect", "--json", "--pci-id", "10de:2330", "--pci-id=10de:2335:10de:18bf", "--target", "debian-12"],
    ["detect", "--pci-id", "10de:1db4", "--target=rocky-9", "--kernel-modules", "open", "--driver-source", "nvidia"],
    ["detect", "--pci-id", "10de:2330", "--driver-source", "distro", "--target", "ubuntu-24.04"],
    ["detect", "--root", "/nonexistent"],  # errors raised by the command itself: the same function
    ["detect", "--pci-id", "10de:2330", "--target", "no-such-9"],
    ["detect", "--root", ROOT, "--kernel-modules", "closed"],
    ["detect", "--root", ROOT, "--driver-source", "rpmfusion"],
]
HANDED_TO_TYPER = [  # anything but plain, valid options: typer's own messages and exit codes (a detect that runs
    # reads a fixture root: the live host can change between the two runs, as another worker's containerd starts)
    ["detect", "--help"], ["detect", "-h"], ["detect", "--bogus"], ["detect", "extra"], ["detect", "--json=1"],
    ["detect", "--root"], ["detect", "--root", ""], ["detect", "--root", "--json"], ["detect", "--pci-id"],
    ["detect", "--pci-id", "10de:zzzz"], ["detect", "--pci-id", "10de:2330", "--pci-id", "nvidia"],
    ["detect", "--root", "/tmp/a\x01b"], ["detect", "--target", "debian-12", "--target", "debian-13", "--pci-id",
                                          "10de:2330"], ["detect", "--json", "--", "--root"], ["detect", "--no-wait"],
    ["--version", "detect"], ["--help", "detect"], ["--no-wait", "--no-wait", "detect", "--root", ROOT, "--json"], [],
    ["--no-wait", "--help"], ["--help", "--version"], ["--bogus"], ["no-such-command"],
]


@pytest.mark.parametrize("argv", TAKEN + HANDED_TO_TYPER, ids=lambda a: " ".join(a) or "(none)")
def test_fast_path_and_typer_agree(argv, capsys, monkeypatch):
    assert (cli.fast_path(argv) is not None) == (argv in TAKEN)
    fast, slow = _run(argv, capsys, True, monkeypatch), _run(argv, capsys, False, monkeypatch)
    assert fast == slow
    assert fast[1] or fast[2]  # something was said (the comparison is not of two empty runs)
    if argv in TAKEN[:9]:
        assert fast[0] == 0 and not fast[2]
    if "--json" in argv and fast[0] == 0:
        assert json.loads(fast[1])["schema"] == "gpuprov.detect/v1"


@pytest.mark.parametrize("columns", ["0", "20", "49", "50", "51", "64", "79", "80", "81", "200", "wide"])
def test_help_at_every_width(columns, capsys, monkeypatch):
    """The listing is wrapped to the terminal (COLUMNS here) as click wraps it: 48 to 78 columns of text."""
    monkeypatch.setenv("COLUMNS", columns)
    fast, slow = _run(["--help"], capsys, True, monkeypatch), _run(["--help"], capsys, False, monkeypatch)
    assert fast == slow and fast[0] == 0 and "k8s " in fast[1]


def _raises(exc: BaseException):
    def run(*args, **kwargs):
        print("partial output")
        raise exc
    return run


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), BrokenPipeError(32, "Broken pipe"), OSError(5, "I/O error")],
                         ids=repr)
def test_interrupted_or_cut_off_ends_alike(exc, capsys, monkeypatch):
    """Ctrl-C is exit 130 with main's one line on both paths (typer >= 0.26 returns it as a code: main raises it
    again); a write to a closed pipe is exit 1 and nothing more, as typer's main has it; another OSError is an
    internal error."""
    monkeypatch.setattr(detect, "run", _raises(exc))
    argv = ["detect", "--pci-id", "10de:2330"]
    fast, slow = _run(argv, capsys, True, monkeypatch), _run(argv, capsys, False, monkeypatch)
    assert fast == slow
    assert fast[0] == {"KeyboardInterrupt": 130, "BrokenPipeError": 1, "OSError": 1}[type(exc).__name__]
    assert ("interrupted" in fast[2]) == isinstance(exc, KeyboardInterrupt)


def test_fast_path_sets_no_wait(monkeypatch):
    monkeypatch.setattr(hostlock, "_no_wait", False)
    monkeypatch.setattr(detect, "run", lambda **kw: None)
    cli.fast_path(["--no-wait", "detect", "--json"])()
    assert hostlock._no_wait is True


def test_completion_is_typers(monkeypatch):
    """click's main answers shell completion (_GPUPROV_COMPLETE): the fast path leaves that to it."""
    monkeypatch.setenv("_GPUPROV_COMPLETE", "bash_complete")
    assert cli.fast_path(["detect", "--json"]) is None


def test_the_installed_command_takes_the_fast_path():
    """`gpuprov detect --json` as a process: the fast path's output, and typer never loaded."""
    code = ("import sys\nfrom provision.cli import main\nrc = main(sys.argv[1:])\n"
            "print('typer' in sys.modules, 'typer._click' in sys.modules, rc, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code, "detect", "--json", "--root", ROOT], capture_output=True,
                       text=True, timeout=60)
    assert r.stderr.split() == ["False", "False", "0"], r.stderr[-2000:]
    via_script = subprocess.run([*gpuprov_bin(), "detect", "--json", "--root", ROOT], capture_output=True, text=True,
                                timeout=60)
    assert (via_script.returncode, via_script.stdout) == (0, r.stdout)


def test_the_script_ends_without_teardown_but_says_everything(tmp_path):
    """cli.script ends a fast-path command with os._exit once its output is flushed: the whole JSON document and the
    exit code arrive through a pipe as main gives them, an error's line and code too, and a command typer parsed
    (here a usage error) ends the interpreter's ordinary way with its own code."""
    from provision.errors import HOST_UNREADABLE, USAGE

    whole = subprocess.run([*gpuprov_bin(), "detect", "--json", "--root", ROOT], capture_output=True, text=True,
                           timeout=60)
    assert whole.returncode == 0 and json.loads(whole.stdout)["schema"] == "gpuprov.detect/v1", whole.stderr
    missing = subprocess.run([*gpuprov_bin(), "detect", "--root", str(tmp_path / "none")], capture_output=True,
                             text=True, timeout=60)
    assert (missing.returncode, missing.stdout) == (HOST_UNREADABLE, ""), missing
    assert missing.stderr.startswith("Error: --root ") and missing.stderr.count("\n") == 1, missing.stderr
    bad = subprocess.run([*gpuprov_bin(), "detect", "--bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == USAGE and "No such option: --bogus" in bad.stderr, bad
    for closed in (">&-", "2>&-"):  # started with stdout or stderr closed: that stream is None, nothing to flush
        r = subprocess.run(["sh", "-c", f'exec "$@" {closed}', "sh", *gpuprov_bin(), "--version"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (closed, r)
