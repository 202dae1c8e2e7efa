"""What a person sees while a plan is applied (provision/progress.py, issue 28 items 8-10): each command's output
streams to the run's log and, on a terminal, to a live tail; piped, one clean line a step in words; --json nothing;
-v everything; and a reader that goes away (`| head -1`) never stops a host-changing run."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from provision import effects, progress
from provision.engines.configure import ConfigureResult
from provision.output import print_steps
from provision.plan import apply as ap
from provision.plan.build import build_plan
from provision.plan.options import Options
from provision.plan.packages import package_changes
from provision.plan.steps import Command, Step
from provision.report import detect_host
from tests.conftest import REPO, make_host

CHATTY = "echo 'Reading package lists...'; echo \"W: Invalid 'Date' entry in Release file\" >&2; " \
         "for i in $(seq 1 20); do echo line $i; done"


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _steps(n: int = 2) -> list[Step]:
    """Steps whose command talks as apt does (its script in a file: the step's line names the command)."""
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpuprov-test-chatty-{os.getpid()}.sh"
    script.write_text(CHATTY + "\n")
    return [Step(f"s.{i}", "engine", f"Step number {i}", actions=(Command(("sh", str(script))),)) for i in
            range(1, n + 1)]


def _apply(tmp_path: Path, mode: str | None, stream, steps=None) -> tuple[ap.ApplyResult, progress.Run]:
    with progress.Run("bootstrap", log_dir=tmp_path / "runs", mode=mode, stream=stream) as run:
        res = ap.apply_plan(steps or _steps(), logged=False, run=run)
    return res, run


def test_every_command_and_all_its_output_go_to_the_runs_log(tmp_path):
    res, run = _apply(tmp_path, "quiet", io.StringIO())
    log = Path(res.log).read_text()
    assert Path(res.log).parent == tmp_path / "runs" and oct(Path(res.log).stat().st_mode & 0o777) == "0o600"
    assert log.count("$ sh /") == 2 and log.count("  line 20") == 2 and "W: Invalid 'Date'" in log
    assert "(exit 0," in log and "[2/2] Step number 2: ran `sh /" in log


def test_watched_run_returns_what_a_plain_run_returns(tmp_path):
    argv = ["sh", "-c", "echo out; echo err >&2; printf partial; exit 3"]
    plain = effects.run(argv, check=False)
    with progress.Run("bootstrap", log_dir=tmp_path, mode="quiet"):
        watched = effects.run(argv, check=False)
        with pytest.raises(effects.StepFailed, match="exit code 3"):
            effects.run(argv)
        with pytest.raises(effects.StepFailed, match="timed out"):
            effects.run(["sleep", "5"], timeout=0.5)
        fed = effects.run(["cat"], input_text=b"\x00bytes")
    assert (watched.returncode, watched.stdout, watched.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert fed.stdout == "\x00bytes"


def test_piped_output_is_one_line_a_step_in_words(tmp_path):
    out = io.StringIO()  # not a terminal: plain
    _apply(tmp_path, None, out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and re.fullmatch(r"\[1/2\] Step number 1: ran `sh /\S+` \(\d+\.\ds\)", lines[0]), lines
    assert "Reading package lists" not in out.getvalue() and "W: Invalid" not in out.getvalue()


def test_json_shows_nothing_and_verbose_shows_everything(tmp_path):
    quiet, verbose = io.StringIO(), io.StringIO()
    _apply(tmp_path, "quiet", quiet)
    _apply(tmp_path, "verbose", verbose)
    assert quiet.getvalue() == ""
    shown = verbose.getvalue()
    assert shown.count("    line 20") == 2 and "W: Invalid 'Date' entry" in shown and "  $ sh /" in shown


def test_a_terminal_gets_a_live_tail_of_the_running_command(tmp_path):
    tty = Tty()
    seen = []
    step = Step("s.1", "engine", "Install the engine", actions=(Command(("sh", "-c", "seq 1 50")),))

    class Spy(progress.Run):
        def ended(self, shown, returncode, seconds):
            seen.append((self.tail(), self._render().plain))
            super().ended(shown, returncode, seconds)

    with Spy("bootstrap", log_dir=tmp_path, stream=tty) as run:
        assert run.mode == "live"
        ap.apply_plan([step], logged=False, run=run)
    tail, frame = seen[0]
    assert tail == [str(i) for i in range(51 - progress.TAIL, 51)]  # the last lines, replaced in place
    assert frame.startswith("[1/1] Install the engine  ") and frame.splitlines()[0].endswith("s")
    assert "    50" in frame.splitlines() and "    1" not in frame.splitlines()
    screen = tty.getvalue()
    assert "\x1b[" in screen and "50" in screen  # rich drew it on the terminal
    assert "[1/1] Install the engine: ran `sh -c 'seq 1 50'` (" in screen


def test_run_logs_rotate(tmp_path):
    d = tmp_path / "runs"
    d.mkdir()
    for i in range(progress.KEEP + 5):
        (d / f"bootstrap-2020010{i:02d}T000000Z-1.log").write_text("old\n")
    (d / "uninstall-20200101T000000Z-1.log").write_text("another command's\n")
    res, _ = _apply(tmp_path, "quiet", io.StringIO())
    kept = sorted(p.name for p in d.glob("bootstrap-*.log"))
    assert len(kept) == progress.KEEP and Path(res.log).name in kept and (d / "uninstall-20200101T000000Z-1.log").exists()


def test_a_log_that_cannot_be_written_never_stops_the_run(tmp_path):
    (tmp_path / "runs").write_text("a file where the directory should be")
    res, _ = _apply(tmp_path, "quiet", io.StringIO())
    assert res.log is None and res.changed == 2 and ap.log_named(res) == "no log file could be written"


def test_step_results_are_words_not_tool_output():
    """Seen: `changed: Reading package lists...; installed docker.io`, `changed: W: Invalid 'Date' entry in Release
    file`, `changed: verified  -`, `changed: changed    /etc/gpuprov/runtime.json`."""
    detail = _steps(1)[0].apply()
    assert re.fullmatch(r"ran `sh /\S+`", detail), detail
    res = ConfigureResult("docker", "/etc/docker/daemon.json", True, ["runtimes.nvidia -> /usr/local/bin/x"],
                          backup="/etc/docker/daemon.json.gpuprov-bak", restart="SIGHUP to dockerd (pid 7)",
                          verified=None)
    assert res.summary() == ("set runtimes.nvidia -> /usr/local/bin/x in /etc/docker/daemon.json; backup "
                             "/etc/docker/daemon.json.gpuprov-bak; SIGHUP to dockerd (pid 7)")
    before = {"libc6": "2.36-9", "curl": "7.88"}
    after = {**before, "docker.io": "20.10.24+dfsg1-1+b3", "containerd": "1.6.20", "runc": "1.1.5", "tini": "0.19",
             "curl": "7.89"}
    assert package_changes(before, after, ("docker.io",)) == (
        "installed docker.io 20.10.24+dfsg1-1+b3 and 3 dependencies (containerd, runc, tini); "
        "upgraded curl 7.88 -> 7.89; nothing removed")
    assert package_changes(after, after, ("docker.io",)) == "nothing installed (all of it was already there); " \
        "nothing removed"
    assert package_changes(after, {"libc6": "2.36-9"}, ()).endswith("removed containerd, curl, docker.io, runc, tini")


def test_a_step_line_wraps_at_100_columns():
    line = ap.step_line(3, 7, "Install the container engine: docker.io", ap.Status.CHANGED,
                        "installed docker.io 20.10.24+dfsg1-1+b3 and 9 dependencies (containerd, runc, tini, …); "
                        "nothing removed", 31.24)
    wrapped = progress.wrap(line)
    assert len(wrapped) == 2 and all(len(ln) <= progress.WIDTH for ln in wrapped)
    assert " ".join(w.strip() for w in wrapped) == line


def _plan_text(tmp_path, name: str = "debian-12", verbose: bool = False) -> tuple[str, Path]:
    root = make_host(tmp_path, name, "datacenter", kernel="6.1.0-27-amd64")
    (root / "run/systemd/system").mkdir(parents=True, exist_ok=True)
    steps = build_plan(detect_host(root, engines=False), Options())
    buf = io.StringIO()
    stdout, sys.stdout = sys.stdout, buf
    try:
        print_steps(f"Plan for {name}", [s.to_dict(root) for s in steps], verbose=verbose)
    finally:
        sys.stdout = stdout
    return buf.getvalue(), root


@pytest.mark.parametrize("verbose", [False, True])
@pytest.mark.parametrize("name", ["debian-12", "ubuntu-22.04", "rocky-9"])
def test_plan_lines_fit_100_columns(tmp_path, name, verbose):
    """Every line of a printed plan fits (a diff's lines are the file's own, a single word is never cut)."""
    text, _ = _plan_text(tmp_path, name, verbose)
    in_diff = False
    for line in text.splitlines():
        if re.match(r" ?\d+\. ", line):
            in_diff = False
        elif line.startswith("--- "):
            in_diff = True
        if not in_diff:  # (a single shell word longer than a line, e.g. an `sh -c` script, is never cut)
            assert len(line) <= progress.WIDTH or len(progress.SHELL_WORD.findall(line.removesuffix("\\"))) <= 1, \
                line


def test_a_wrapped_command_is_still_the_command():
    line = "$ DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends --no-remove " \
           "nvidia-open-kernel-dkms nvidia-driver 'a b c' nvidia-smi libcuda1 firmware-misc-nonfree linux-headers-6.1.0"
    wrapped = progress.wrap_command(line, "      ")
    assert len(wrapped) > 1 and all(len(ln) <= progress.WIDTH for ln in wrapped)
    joined = " ".join(ln.strip().removesuffix("\\").strip() for ln in wrapped)
    assert joined == line and "'a b c'" in "".join(wrapped)


def test_the_readme_plan_excerpt_is_real_output(tmp_path):
    """README's "What a plan looks like": every line but the `…` ones is a line of the real plan, in order."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## What a plan looks like", 1)[1].split("```\n", 2)[1]
    text, _ = _plan_text(tmp_path)
    real = text.splitlines()
    at = 0
    for line in block.splitlines():
        if line.strip() in ("…", ""):
            continue
        assert line in real[at:], line
        at = real.index(line, at) + 1


# The bootstrap command as an operator runs it, its plan replaced by slow steps (no host is changed): each step
# writes a file under DIR when it runs, and prints enough to fill a pipe.
PIPED = textwrap.dedent("""
    import sys
    from pathlib import Path
    from provision import cli
    from provision.commands import plan as cmd
    from provision.plan import apply as ap, resume as rs
    from provision.plan.steps import Command, Step
    d = Path(sys.argv[1])
    steps = [Step(f"s.{i}", "engine", f"Step {i}", actions=(Command(("sh", "-c",
             f"sleep 0.3; seq 1 3000; touch {d}/ran{i}")),)) for i in range(1, 6)]
    cmd._plan = lambda root, target, opt: (None, steps)
    rs.resume = lambda *a: None
    ap.missing_packages = lambda steps: {}
    ap.record_installed = lambda *a: None
    code = cli.main(["bootstrap", "--yes", *sys.argv[2:]])
    (d / "rc").write_text(str(code))
    (d / "rich").write_text(str("rich" in sys.modules))
    sys.exit(code)
""")


@pytest.mark.parametrize("args", [[], ["-v"]])
def test_a_closed_pipe_never_aborts_the_run(tmp_path, args):
    """`gpuprov bootstrap --yes 2>&1 | head -1`: the reader goes after one line; every step still runs, the run
    ends with its own exit code, and its log has all of it. (On main: exit 0 after step 1, steps 2-5 never ran.)"""
    env = {**os.environ, "GPUPROV_LOG": str(tmp_path / "log/bootstrap.log"), "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", PIPED, str(tmp_path), *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=env)
    first = p.stdout.readline()
    p.stdout.close()  # as `head -1` does
    assert p.wait(timeout=120) == 0, first
    assert first.startswith(b"[1/5] Step 1"), first
    assert sorted(x.name for x in tmp_path.glob("ran*")) == [f"ran{i}" for i in range(1, 6)]
    assert (tmp_path / "rc").read_text() == "0" and (tmp_path / "rich").read_text() == "False"  # piped: no rich
    (log,) = (tmp_path / "log/runs").glob("bootstrap-*.log")
    text = log.read_text()
    assert text.count("  3000") == 5 and "[5/5] Step 5: ran `sh -c" in text
    assert len((tmp_path / "log/bootstrap.log").read_text().splitlines()) == 5


def test_bootstrap_json_names_the_log(tmp_path):
    env = {**os.environ, "GPUPROV_LOG": str(tmp_path / "log/bootstrap.log"), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", PIPED.replace("seq 1 3000", "echo hi").replace("sleep 0.3;", ""),
                        str(tmp_path), "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert r.stderr == "" and Path(doc["log"]).is_file() and doc["changed"] == 5


# Issue 39 item 6: a run without a terminal is never silent (under ssh pipes or CI a 45 s apt step printed nothing),
# and a terminal shows the line a command is still writing (the first 38 s of one were silent there). The
# heartbeat's interval is set short here (progress.HEARTBEAT; 10 s in a real run).
SLOW = textwrap.dedent("""
    import sys
    from provision import cli, progress
    from provision.commands import plan as cmd
    from provision.plan import apply as ap, resume as rs
    from provision.plan.steps import Command, Step
    progress.HEARTBEAT = 0.25
    steps = [Step("s.1", "engine", "Install the engine", actions=(Command(("sh", "-c",
             "echo Get:1 docker.io; printf 'Unpacking docker.io ...'; sleep 1.5; echo ' done'")),))]
    cmd._plan = lambda root, target, opt: (None, steps)
    rs.resume = lambda *a: None
    ap.missing_packages = lambda steps: {}
    ap.record_installed = lambda *a: None
    sys.exit(cli.main(["bootstrap", "--yes", *sys.argv[1:]]))
""")


@pytest.mark.parametrize("args", [[], ["-v"]])
def test_a_piped_run_prints_a_heartbeat_while_a_step_is_silent(tmp_path, args):
    """Piped (no terminal), a step whose command prints nothing new for longer than HEARTBEAT gets a line every
    HEARTBEAT: the step, its seconds so far and the last line of its output, the one still being written included
    (it has no newline yet). On main: nothing between the start and the step's one line."""
    env = {**os.environ, "GPUPROV_LOG": str(tmp_path / "log/bootstrap.log"), "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", SLOW, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env=env)
    lines = [ln.decode().rstrip("\n") for ln in p.stdout]
    assert p.wait(timeout=120) == 0, lines
    beats = [ln for ln in lines if ln.startswith("[1/1] Install the engine: running, ")]
    assert len(beats) >= 3, lines  # 1.5 s of silence, a beat every 0.25 s
    # (a beat before the command has started, on a loaded machine, has no output to name yet)
    assert all(re.fullmatch(r"\[1/1\] Install the engine: running, \d+s(; last: .+)?", b) for b in beats), beats
    assert sum(b.endswith("; last: Unpacking docker.io ...") for b in beats) >= 2, beats
    end = next(i for i, ln in enumerate(lines) if ln.startswith("[1/1] Install the engine: ran "))
    assert lines.index(beats[-1]) < end and all(len(b) <= progress.WIDTH for b in beats)
    log = next((tmp_path / "log/runs").glob("bootstrap-*.log")).read_text()
    assert "  Unpacking docker.io ... done" in log and "running, " not in log  # whole lines in the log only


def test_a_terminal_shows_the_line_a_command_is_still_writing(tmp_path):
    """On a terminal the live tail shows, from its first second, the line a command has begun and not ended
    (apt's `Reading package lists...`, DKMS's dots). On main the tail held only `$ sh -c …` until the newline."""
    frames: list[str] = []
    step = Step("s.1", "engine", "Install the driver", actions=(Command(("sh", "-c",
                "printf 'Building module: ....'; sleep 1.5; echo ' done'")),))
    done = threading.Event()

    with progress.Run("bootstrap", log_dir=tmp_path, stream=Tty()) as run:
        assert run.mode == "live"

        def sample() -> None:  # what the screen shows, every 50 ms, while the step runs
            while not done.wait(0.05):
                frames.append(run._render().plain)
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            ap.apply_plan([step], logged=False, run=run)
        finally:
            done.set()
            sampler.join()
    shown = [f.splitlines() for f in frames if f.startswith("[1/1] Install the driver  ")]
    assert any(f[-1] == "    Building module: ...." for f in shown), frames  # before its newline came
