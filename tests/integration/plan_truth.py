"""Issue 39 item 2 as a property over the integration scenarios: check mode predicts the run. Each scenario that
bootstraps a real host runs its command through `check_then_run`: first `--check --json` (nothing changed), then the
run itself with `--json`, and the two must agree on

- whether the run stops, and with which exit code (check mode's `stop` against the run's exit status);
- which steps change the host: the ids check mode says `would_change` are exactly the ids the run reports changed.

A step whose outcome check mode cannot know before an earlier step has run is named in `unknowable` by the scenario,
with the reason, so that every exception is written down where it is made."""
from __future__ import annotations

import json


def check_then_run(h, cmd: str, *, timeout: int = 1800, unknowable: dict[str, str] | None = None):
    """`cmd --check --json`, then `cmd --json` on host `h`; asserts they agree; returns the run's CompletedProcess."""
    chk = h.exec(f"{cmd} --check --json", timeout=timeout)
    assert chk.returncode in (0, 14, 4, 5, 7, 16) and chk.stdout.strip(), chk.stdout[-2000:] + chk.stderr[-2000:]
    check = json.loads(chk.stdout)
    run = h.exec(f"{cmd} --json", timeout=timeout)
    stop = check.get("stop")
    if stop:
        assert run.returncode == stop["exit_code"], (stop, run.returncode, run.stderr[-2000:])
        return run
    assert run.returncode == 0, f"check mode predicted no stop; the run exited {run.returncode}:\n" + \
        run.stdout[-2000:] + run.stderr[-2000:]
    res = json.loads(run.stdout)
    skip = set(unknowable or {})
    predicted = {s["id"] for s in check["steps"] if s["would_change"]} - skip
    changed = {s["id"] for s in res["steps"] if s["status"] == "changed"} - skip
    assert changed == predicted, {"check mode said": sorted(predicted), "the run changed": sorted(changed)}
    return run
