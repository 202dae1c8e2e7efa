"""`gpuprov-runtime`: an OCI runtime with runc's command line. Only `create` edits config.json; every other
command is handed to runc at once (exec, same argv). Kept import-light: it runs on every container start.

The compiled front-end (shim.c, built by `gpuprov runtime install`) does the same hand-over in C and calls
`python3 -I -S …/modify_main.py` only when config.json mentions a GPU request."""
from __future__ import annotations

import os
import sys

# runc global options that take a value (everything else before the command is a flag).
VALUE_OPTS = {"--root", "--log", "--log-format", "--criu", "--rootless"}


def global_option(argv: list[str], name: str) -> str | None:
    """Value of a runc global option given before the command (`--log PATH` or `--log=PATH`)."""
    for i, a in enumerate(argv):
        if not a.startswith("-"):
            return None
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def report_error(msg: str, log: str | None, log_format: str | None) -> None:
    """Where the engine looks: runc's --log file (containerd shows its last error), and stderr."""
    sys.stderr.write(f"gpuprov-runtime: {msg}\n")
    if not log:
        return
    import json
    import time

    line = json.dumps({"level": "error", "msg": f"gpuprov-runtime: {msg}",
                       "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) \
        if log_format == "json" else f"gpuprov-runtime: {msg}"
    try:
        with open(log, "a") as fh:
            fh.write(line + "\n")
    except OSError:
        pass


def parse_command(argv: list[str]) -> tuple[str | None, str]:
    """(command, bundle) from runc-style argv (without argv[0])."""
    i, cmd = 0, None
    while i < len(argv):
        a = argv[i]
        if a in VALUE_OPTS:
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        cmd = a
        break
    bundle = os.getcwd()
    if cmd in ("create", "run"):
        rest = argv[i + 1:]
        for j, a in enumerate(rest):
            if a in ("--bundle", "-b") and j + 1 < len(rest):
                bundle = rest[j + 1]
            elif a.startswith("--bundle="):
                bundle = a.split("=", 1)[1]
    return cmd, bundle


def run_create_edits(bundle: str, log: str | None = None, log_format: str | None = None) -> int:
    from provision.inject.edits import Refused
    from provision.inject.modify import modify_bundle
    from provision.inject.settings import load_settings

    try:
        modify_bundle(bundle, load_settings())
    except Refused as exc:
        report_error(str(exc), log, log_format)
        return 10
    except (OSError, ValueError) as exc:  # unreadable bundle / config: say so in one line, don't start
        report_error(f"cannot prepare the GPU edits: {exc}", log, log_format)
        return 1
    return 0


def main() -> int:
    argv = sys.argv[1:]
    cmd, bundle = parse_command(argv)
    if cmd in ("create", "run"):  # `run` = create + start
        rc = run_create_edits(bundle, global_option(argv, "--log"), global_option(argv, "--log-format"))
        if rc:
            return rc
    from provision.inject.settings import load_settings

    runc = load_settings()["runc"]
    os.execv(runc, [runc, *argv])
    return 127  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
