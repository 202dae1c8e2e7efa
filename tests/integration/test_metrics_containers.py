"""The process->container mapping against real Docker containers (real cgroups, Docker's own records): a container
started the way kubelet starts one through cri-dockerd (its io.kubernetes.* labels) is named by its pod, namespace
and container; a plain one by its Docker name; a host process by nothing."""
from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from provision.metrics.containers import ContainerRef, container_of
from tests.conftest import needs

pytestmark = [pytest.mark.integration, needs(docker=True)]


def run(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def started():
    from provision.engines.validate import IMAGE
    from provision.verify.checks import prepare_image

    prepare_image("docker")
    names = []

    def start(*extra: str) -> tuple[str, int, str]:
        name = f"k8s-metrics-{uuid.uuid4().hex[:8]}"
        names.append(name)
        # the image has no sleep: sh waits on the open stdin (-i)
        cid = run("run", "-d", "-i", "--name", name, "--network", "none", *extra, IMAGE, "sh", "-c", "read x")
        pid = int(run("inspect", "-f", "{{.State.Pid}}", cid))
        return cid, pid, name

    yield start
    for n in names:
        subprocess.run(["docker", "rm", "-f", n], capture_output=True)


def test_plain_docker_container_by_its_name(started):
    cid, pid, name = started()
    assert container_of(pid) == ContainerRef(cid, "docker", name)


def test_kubelet_labels_name_pod_and_namespace(started):
    cid, pid, _ = started("--label", "io.kubernetes.container.name=trainer", "--label",
                          "io.kubernetes.pod.name=job-7", "--label", "io.kubernetes.pod.namespace=ml")
    assert container_of(pid) == ContainerRef(cid, "docker", "trainer", "job-7", "ml")


def test_host_process_is_no_container():
    assert container_of(os.getpid()) is None
