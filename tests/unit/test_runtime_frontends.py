"""Both front-ends (compiled shim.c and the Python fallback) over one table of runc command lines, as engines and
people write them: the same command is recognised, the same bundle edited, runc's `--log`/`--log-format` honoured
(containerd shows the log's last error; before, the Python parser stopped at `--root`'s value and every refusal
reached users as `unable to retrieve OCI runtime error (open …/log.json…)`), and runc gets the argv untouched.

Every row runs a bundle whose GPU request is refused (NVIDIA_REQUIRE_CUDA unmet on the fake H200 driver root), so
"the editor saw this bundle" shows as exit 10 with the reason in the log file; rows that are not a create of that
bundle go straight to runc (a recording stand-in)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.inject_helpers import (
    compiled_front_end,
    fake_runc,
    gpu_bundle,
    python_front_end,
    runc_calls,
    stop_editors,
    write_settings,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mknod")
REASON = "NVIDIA_REQUIRE_CUDA='cuda>=99.0' is not satisfied"

# argv with {B} = the refused bundle, {L} = a log file; expected: "refused/json", "refused/text", "refused/nolog"
# (the editor saw {B}; where its reason went) or "runc" (handed over untouched, no edit).
TABLE = [
    ("--root /run/containerd/runc/k8s.io --log {L} --log-format json create --bundle {B} id", "refused/json"),
    ("--root=/r --log={L} --log-format=json create --bundle={B} id", "refused/json"),
    ("--log {L} create -b {B} id", "refused/text"),
    ("-root /r -log {L} -log-format json create -bundle {B} id", "refused/json"),
    ("--debug --systemd-cgroup --root /r --log {L} create --pid-file /p --console-socket /s --bundle {B} id",
     "refused/text"),
    ("--log {L} create id --bundle {B}", "refused/text"),
    ("--log {L} create --preserve-fds 1 id -b={B}", "refused/text"),
    ("--log {L} --log-format json run --detach --bundle {B} id", "refused/json"),
    ("--criu /usr/sbin/criu --rootless auto --log {L} create --bundle {B} id", "refused/text"),
    ("-- create --bundle {B} id", "refused/nolog"),
    ("create --bundle {B} -- id", "refused/nolog"),
    ("--root /r --log {L} start id", "runc"),
    ("--root /r --log {L} delete --force id", "runc"),
    ("--log {L} state id", "runc"),
    ("--root {B} --log {L} kill id KILL", "runc"),
    ("--log {L} create --pid-file --bundle {B} id", "runc"),  # --bundle is the pid file's name: bundle = cwd
    ("--version", "runc"),
    ("--root", "runc"),
    ("", "runc"),
]


@pytest.fixture(scope="module")
def front_ends(tmp_path_factory):
    base = tmp_path_factory.mktemp("frontends")
    runc = fake_runc(base)
    settings = write_settings(base, runc=str(runc))
    yield base, settings, {"compiled": compiled_front_end(base, str(runc)), "python": python_front_end(base)}
    stop_editors(settings)


@pytest.mark.parametrize("kind", ["compiled", "python"])
@pytest.mark.parametrize("argv,expect", TABLE, ids=[t[0] or "(none)" for t in TABLE])
def test_front_end_parses_runc_argv(front_ends, tmp_path, kind, argv, expect):
    base, settings, exes = front_ends
    bundle = gpu_bundle(tmp_path, "b", ["NVIDIA_REQUIRE_CUDA=cuda>=99.0"])
    log = tmp_path / "log.json"
    words = [w.replace("{B}", str(bundle)).replace("{L}", str(log)) for w in argv.split()]
    cwd = tmp_path / "cwd"  # no config.json here: a create whose bundle is the cwd has nothing to edit
    cwd.mkdir()
    before = len(runc_calls(base))
    r = subprocess.run([str(exes[kind]), *words], cwd=cwd, capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "GPUPROV_RUNTIME_CONFIG": str(settings)})
    calls = runc_calls(base)[before:]
    if expect == "runc":
        assert r.returncode == 0, r.stderr
        assert calls == [" ".join(words)], "runc got the argv untouched"
        assert not log.exists()
        return
    assert r.returncode == 10 and calls == [], (r.returncode, r.stderr, calls)
    assert REASON in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    fmt = expect.split("/")[1]
    if fmt == "nolog":
        assert not log.exists()
        return
    line = log.read_text().strip()
    assert len(line.splitlines()) == 1
    if fmt == "json":
        rec = json.loads(line)
        assert rec["level"] == "error" and REASON in rec["msg"]
    else:
        assert line.startswith("gpuprov-runtime: ") and REASON in line


def test_both_front_ends_share_one_table():
    """shim.c and shim.py list the same options (the table above runs both; this names a drift at once)."""
    from provision.inject import shim

    src = (Path(shim.__file__).with_name("shim.c")).read_text()
    flat = " ".join(src.split())
    for table, opts in (("global_value_opts", shim.GLOBAL_VALUE_OPTS), ("create_value_opts", shim.CREATE_VALUE_OPTS),
                        ("triggers", shim.TRIGGERS)):
        body = flat.split(f" {table}[][", 1)[1].split("= {", 1)[1].split("}", 1)[0]
        assert [w.strip().strip('"') for w in body.split(",")][:-1] == list(opts), table


def test_the_compiled_scan_finds_what_the_python_one_finds(tmp_path):
    """shim.c's scan of config.json (read in 32 kB windows that overlap by a trigger's length, skipping bytes no
    trigger starts with, stopping at a NUL byte as runc's parser would refuse the file) says "edit" exactly where
    shim.py's needs_edit finds a trigger before the first NUL: each trigger across both window edges, none, after NUL."""
    import shutil

    from provision.inject import shim

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = Path(shim.__file__).with_name("shim.c").read_text()
    assert src.count("int main(int argc, char **argv) {") == 1
    harness = src.replace("int main(int argc, char **argv) {", "int shim_main(int argc, char **argv) {") + (
        '\nint main(int argc, char **argv) {\n'
        '    for (int i = 1; i < argc; i++) printf("%d\\n", scan_config(argv[i]));\n'
        '    return 0;\n}\n')
    (tmp_path / "scan.c").write_text(harness)
    subprocess.run([cc, "-O2", str(tmp_path / "scan.c"), "-o", str(tmp_path / "scan")], check=True)
    cases: list[bytes] = [b"", b'{"process":{"env":["PATH=/bin"]}}', b"x" * 70000]
    for t in shim.TRIGGERS:
        for edge in (32768, 65536 - 39):
            for off in (-len(t) - 1, -len(t), -len(t) + 1, -20, -1, 0, 1, 39):
                cases.append(b"y" * (edge + off) + t.encode() + b"z" * 50)
        cases.append(b"pad\0" + t.encode())  # after a NUL: runc refuses the file, nothing to edit
        cases.append(t.encode()[:-1] + b" " + t.encode()[:-1])  # a trigger less its last byte, twice
    dirs = []
    for i, data in enumerate(cases):
        d = tmp_path / f"b{i}"
        d.mkdir()
        (d / "config.json").write_bytes(data)
        dirs.append(str(d))
    out = subprocess.run([str(tmp_path / "scan"), *dirs], capture_output=True, text=True, check=True).stdout.split()
    want = [str(int(any(t.encode() in data.split(b"\0", 1)[0] for t in shim.TRIGGERS))) for data in cases]
    assert out == want
