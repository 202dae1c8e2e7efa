"""The Fleets walkthrough (docs/FLEETS.md, linked from the README's Fleets section), run as written: every `sh`
block of that section, in order, in one bash, in a copy of this checkout (the walkthrough's own venv from
`pip install '.[fleet]'`, its own wheelhouse, the test nodes started by its `docker run` lines, the play and the
testinfra suite through `inventories/containers`). The commands are read from the document here, so it and this test
cannot drift apart. Only GPUPROV_NODES, the containers' name prefix the walkthrough itself exports, is the test's
own: two runs on one machine never share nodes."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import needs
from tests.integration.fleet import RECAP
from tests.integration.hosts import REPO, checkout_ignore, ensure_image

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs("debootstrap", docker=True)]
SECTION = "## Fleets (Ansible)"


def readme_blocks() -> list[str]:
    text = (REPO / "docs/FLEETS.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```sh\n(.*?)^```$", section, re.S | re.M)


def checkout_copy(dest: Path) -> Path:
    """What a clone of this checkout holds (tracked and not-ignored files), without this checkout's venv or builds."""
    if not ((REPO / ".git").exists() and shutil.which("git")):  # a copy without git (bench/host_orders.py's hosts)
        return Path(shutil.copytree(REPO, dest, symlinks=True, ignore=checkout_ignore()))
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        src, dst = REPO / name, dest / name
        if not src.is_symlink() and not src.exists():  # deleted in the work tree, not yet committed
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    return dest


def test_readme_blocks_are_the_whole_walkthrough():
    """The blocks this test runs are the section's commands: setup, the nodes' docker run, the play, testinfra."""
    script = "\n".join(readme_blocks())
    for needle in ("pip install '.[fleet]'", "pip wheel . -w dist/wheelhouse", "docker run -d --name $GPUPROV_NODES-$n",
                   "ansible-playbook -i inventories/containers site.yml",
                   "--ansible-inventory=inventories/containers provision/verify/test_gpu_node.py"):
        assert needle in script, needle


def test_readme_fleet_section_runs_as_written(tmp_path):
    ensure_image()  # the README builds it when missing; here the shared one is built once for the whole suite
    work = checkout_copy(tmp_path / "gpuprov")
    nodes = f"role-readme-{os.getpid()}"
    # The test runner's venv is left off PATH: the README makes and activates its own.
    path = ":".join(p for p in os.environ["PATH"].split(":") if not p.startswith(str(REPO)))
    env = {**os.environ, "PATH": path, "GPUPROV_NODES": nodes, "ANSIBLE_NOCOLOR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("VIRTUAL_ENV", None)
    try:
        r = subprocess.run(["bash", "-eo", "pipefail", "-c", "\n".join(readme_blocks())], cwd=work, env=env,
                           capture_output=True, text=True, timeout=2400)
    finally:
        subprocess.run(["docker", "rm", "-f", f"{nodes}-1", f"{nodes}-2"], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    out = r.stdout + r.stderr
    # pip's notes about absent find-links directories would fill the message: left out of it
    assert r.returncode == 0, "\n".join(ln for ln in out.splitlines() if not ln.startswith("WARNING: Location"))[-5000:]
    recap = {m.group(1): (int(m.group(3)), int(m.group(5))) for m in RECAP.finditer(r.stdout)}
    assert set(recap) == {f"{nodes}-1", f"{nodes}-2"}, out[-3000:]
    assert all(changed > 0 and failed == 0 for changed, failed in recap.values()), recap
    summary = r.stdout.strip().splitlines()[-1]  # testinfra's: one test per check and node
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, summary
