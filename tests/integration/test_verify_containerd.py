"""`gpuprov verify` on a containerd node (the multi-cluster inventory's training pool runs containerd): a private
containerd (tests/cri harness, bookworm's 1.6) configured by `gpuprov engine configure containerd`, then verify's
own checks through it: the engine answers, its merged config lists handler `nvidia` pointing at an installed
runtime, and a container starts through gpuprov-runtime from the check image built out of this host's own files
(`ctr run --rootfs`: nothing pulled, no registry)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from provision import engines
from provision.verify import checks
from tests.conftest import needs

pytestmark = [pytest.mark.integration, needs("containerd", "ctr", "runc")]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from tests import k8s_cri
    from tests.cri.harness import Containerd

    base = tmp_path_factory.mktemp("verifyctrd")
    env = k8s_cri.private_runtime(base)
    c = Containerd(Path(shutil.which("containerd")).parent, env=env)
    cfg = c.base / "config.toml"
    cfg.write_text(k8s_cri.base_config(c))
    r = k8s_cri.gpuprov("engine", "configure", "containerd", "--config", str(cfg), "--runtime-path",
                        str(base / "rt/bin/gpuprov-runtime"), "--no-restart", "--json",
                        env={**env, "GPUPROV_LOCK_DIR": str(base)})
    assert r.returncode == 0, r.stderr
    c.start(cfg)

    class Node(checks.LocalHost):
        """This machine's commands, aimed at the private containerd (its socket, its config)."""
        engine = engines.get("containerd")
        runtime_path = str(base / "rt/bin/gpuprov-runtime")
        rootfs = str(base / "check-rootfs")
        log_dir = str(base / "logs")

        def run(self, argv):
            if argv == ["containerd", "config", "dump"]:
                argv = [str(c.binary), "--config", str(cfg), "config", "dump"]
            elif argv[:2] == ["ctr", "--namespace"]:
                argv = [str(c.bindir / "ctr"), "-a", str(c.socket), *argv[1:]]
            return super().run(argv)

    yield Node()
    c.cleanup()


def test_verify_checks_on_a_containerd_node(node):
    results = {r.name: r for r in (checks.engine_running(node), checks.runtime_registered(node),
                                   checks.plain_container(node))}
    print("\n" + json.dumps({k: [r.status, r.detail] for k, r in results.items()}, indent=1))
    assert results["engine running"].status == "pass", results
    assert results["runtime registered"].status == "pass", results
    assert results["runtime registered"].detail.endswith("rt/bin/gpuprov-runtime")
    assert results["container through the runtime"].status == "pass", results
    assert "(containerd)" in results["container through the runtime"].detail
    assert Path(node.log_dir).is_dir() and not list(Path(node.log_dir).glob("*"))  # its output file: read, removed
