"""Issue 39 item 1: before `uninstall --purge-engine` purges an engine's package, the plan counts what the engine keeps
under the data root that purge deletes (containers, images, volumes), from the live engine or, with the engine
stopped, from its files; gpuprov's own (the validation image and what ran from it) is not counted. While anything of
the operator's is there and they said neither --keep-engine-data nor --delete-engine-data, the uninstall stops
before any change (exit 14) naming it, its dry run too; otherwise the package is removed, not purged (the data root
kept), unless --delete-engine-data. The real engines and apt: tests/integration/test_purge_keeps_engine_data.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from provision import effects, paths, record
from provision.engines.containerd import ContainerdEngine
from provision.engines.docker import DockerEngine
from provision.engines.podman import PodmanEngine
from provision.engines.validate import IMAGE
from provision.facts.engine_data import StoredData, containerd_store, containers_storage, docker_store
from provision.plan import engine_data as ed
from provision.plan import uninstall as un
from tests.conftest import REPO, run_cli

OURS = "gpuprov-validate"
IDS = {n: "sha256:" + (c * 64) for n, c in (("app", "a"), ("old", "b"), ("val", "c"), ("both", "d"))}


def dockerd_tree(root: Path, data: str = "/var/lib/docker") -> Path:
    """/var/lib/docker as dockerd 20.10 (Debian's docker.io) leaves it stopped: the operator's container `web` (from
    op/app:1), a container gpuprov's validation left (from its image), op/app:1, an untagged image, gpuprov's image,
    an image tagged both gpuprov's and the operator's; the named volume `opdata`, an anonymous one, and the files
    dockerd keeps beside them (metadata.db, the image driver's other directories)."""
    top = root / data.lstrip("/")
    img = top / "image/overlay2"
    (img / "imagedb/content/sha256").mkdir(parents=True)
    (img / "layerdb/sha256").mkdir(parents=True)
    for i in IDS.values():
        (img / "imagedb/content/sha256" / i.split(":")[1]).write_text("{}")
    (img / "repositories.json").write_text(json.dumps({"Repositories": {
        "op/app": {"op/app:1": IDS["app"]}, OURS: {IMAGE: IDS["val"], f"{OURS}:0.0.9-1": IDS["both"]},
        "op/base": {"op/base:latest": IDS["both"]}}}))
    for cid, name, image, asked in (("1" * 64, "/web", IDS["app"], "op/app:1"), ("2" * 64, "/sad_turing", IDS["val"],
                                                                              IMAGE)):
        (top / "containers" / cid).mkdir(parents=True)
        (top / "containers" / cid / "config.v2.json").write_text(json.dumps(
            {"ID": cid, "Name": name, "Image": image, "Config": {"Image": asked}}))
    (top / "containers" / ("3" * 64)).mkdir()  # a container whose config is unreadable: counted by its id
    for v in ("opdata", "e" * 64):
        (top / "volumes" / v / "_data").mkdir(parents=True)
    (top / "volumes/metadata.db").write_bytes(b"\0" * 32)
    (top / "network/files").mkdir(parents=True)
    return top


def test_dockerd_stopped_is_counted_from_its_files_without_gpuprovs_own(tmp_path):
    dockerd_tree(tmp_path)
    got = docker_store(tmp_path, "/var/lib/docker", OURS)
    assert got == StoredData("/var/lib/docker", "the files under /var/lib/docker",
                             containers=("333333333333", "web"),
                             images=("bbbbbbbbbbbb", "gpuprov-validate:0.0.9-1, op/base:latest", "op/app:1"),
                             volumes=("e" * 64, "opdata"))
    assert got.counts() == ("2 containers (333333333333, web), 3 images (bbbbbbbbbbbb, gpuprov-validate:0.0.9-1, "
                            "op/base:latest, op/app:1), 2 volumes (" + "e" * 64 + ", opdata)")
    assert docker_store(tmp_path, "/var/lib/nothing", OURS) is None


def test_only_gpuprovs_own_is_nothing_of_the_operators(tmp_path):
    top = tmp_path / "var/lib/docker"
    (top / "image/overlay2/imagedb/content/sha256").mkdir(parents=True)
    (top / "image/overlay2/imagedb/content/sha256" / IDS["val"].split(":")[1]).write_text("{}")
    (top / "image/overlay2/repositories.json").write_text(json.dumps({"Repositories": {OURS: {IMAGE: IDS["val"]}}}))
    (top / "volumes").mkdir()
    got = docker_store(tmp_path, "/var/lib/docker", OURS)
    assert got.empty and got.counts() == "nothing"


def test_docker_adapter_reads_the_files_under_a_root_and_asks_no_daemon(tmp_path, monkeypatch):
    dockerd_tree(tmp_path)
    monkeypatch.setattr(effects, "try_run", lambda *a, **k: pytest.fail("a --root tree is not the live host"))
    assert DockerEngine().stored(tmp_path).containers == ("333333333333", "web")


def test_a_stopped_dockerd_on_the_live_host_is_counted_from_its_files(tmp_path, monkeypatch):
    """The live host, dockerd not answering (`docker info` fails): the files under /var/lib/docker."""
    dockerd_tree(tmp_path)
    monkeypatch.setattr("provision.engines.docker.is_live", lambda root: True)
    asked = []
    monkeypatch.setattr(effects, "try_run", lambda argv, **k: asked.append(argv) or effects.CommandResult(
        list(argv), 1, "", "Cannot connect to the Docker daemon"))
    got = DockerEngine().stored(tmp_path)
    assert asked == [["docker", "info", "--format", "{{.DockerRootDir}}"]]
    assert got.source == "the files under /var/lib/docker" and got.volumes == ("e" * 64, "opdata")


def test_the_live_dockerd_is_asked_where_it_answers(tmp_path, monkeypatch):
    """dockerd's own answers (its CLI's formats) give the same names as its files: gpuprov's image and the container
    that ran from it left out, an untagged image by its short id, an image also tagged the operator's counted."""
    answers = {"{{.DockerRootDir}}": "/var/lib/docker\n",
               "{{.Names}}\t{{.Image}}": f"web\top/app:1\nsad_turing\t{IMAGE}\n",
               "{{.ID}}\t{{.Repository}}:{{.Tag}}": f"{IDS['app']}\top/app:1\n{IDS['val']}\t{IMAGE}\n"
                                                  f"{IDS['old']}\t<none>:<none>\n{IDS['both']}\top/base:latest\n"
                                                  f"{IDS['both']}\t{OURS}:0.0.9-1\n",
               "ls": "opdata\n" + "e" * 64 + "\n"}
    monkeypatch.setattr("provision.engines.docker.is_live", lambda root: True)
    monkeypatch.setattr(effects, "try_run", lambda argv, **k: effects.CommandResult(
        list(argv), 0, "", stdout=answers[argv[-1] if argv[-1] != "-q" else "ls"]))
    got = DockerEngine().stored(tmp_path)
    assert got == StoredData("/var/lib/docker", "the running dockerd", ("web",),
                             ("bbbbbbbbbbbb", "gpuprov-validate:0.0.9-1, op/base:latest", "op/app:1"),
                             ("e" * 64, "opdata"))
    answers["{{.DockerRootDir}}"] = "/srv/docker\n"  # its data lie elsewhere: what a purge deletes is the files here
    dockerd_tree(tmp_path)
    assert DockerEngine().stored(tmp_path).source == "the files under /var/lib/docker"


@pytest.mark.skipif(not shutil.which("docker"), reason="no docker client here")
def test_the_files_say_what_this_machines_dockerd_says():
    """On a machine whose dockerd runs with /var/lib/docker (this CI's): counted from its files and counted by
    dockerd itself, the same names (real data, not a fixture's)."""
    live = DockerEngine()._stored_live()
    if live is None:
        pytest.skip("no dockerd answering with /var/lib/docker here")
    files = docker_store(Path("/"), "/var/lib/docker", OURS)
    assert (files.containers, files.images, files.volumes) == (live.containers, live.images, live.volumes)


def test_podman_store_from_its_files(tmp_path):
    """containers/storage's JSON indexes, as Podman 4.3 writes them (names with localhost/), and its volumes."""
    top = tmp_path / "var/lib/containers/storage"
    (top / "overlay-images").mkdir(parents=True)
    (top / "overlay-containers").mkdir()
    (top / "volumes/pgdata/_data").mkdir(parents=True)
    (top / "overlay-images/images.json").write_text(json.dumps([
        {"id": "a" * 64, "names": ["localhost/op/app:1"]}, {"id": "c" * 64, "names": [f"localhost/{IMAGE}"]},
        {"id": "b" * 64}]))
    (top / "overlay-containers/containers.json").write_text(json.dumps([
        {"id": "1" * 64, "names": ["db"], "image": "a" * 64}, {"id": "2" * 64, "names": ["x"], "image": "c" * 64}]))
    got = PodmanEngine().stored(tmp_path)
    assert got == StoredData("/var/lib/containers/storage", "the files under /var/lib/containers/storage", ("db",),
                             ("bbbbbbbbbbbb", "localhost/op/app:1"), ("pgdata",))
    (tmp_path / "etc/containers").mkdir(parents=True)
    (tmp_path / "etc/containers/storage.conf").write_text('[storage]\ndriver = "overlay"\ngraphroot = "/srv/c"\n')
    assert PodmanEngine().stored(tmp_path) is None  # storage.conf's graphroot: none there
    assert containers_storage(tmp_path, "/var/lib/containers/storage", OURS).containers == ("db",)


def test_containerd_without_its_daemon_counts_what_lies_on_disk(tmp_path):
    top = tmp_path / "var/lib/containerd"
    (top / "io.containerd.content.v1.content/blobs/sha256").mkdir(parents=True)
    for i in range(3):
        (top / f"io.containerd.content.v1.content/blobs/sha256/{i}").write_text("x")
    (top / "io.containerd.snapshotter.v1.overlayfs/snapshots/1").mkdir(parents=True)
    got = containerd_store(tmp_path, "/var/lib/containerd")
    assert not got.empty and got.note.startswith("3 content blobs and 1 snapshots")
    assert ContainerdEngine().stored(tmp_path) == got  # a --root tree: its files, no ctr asked


# ---------------------------------------------------------------- what the plan does with them


def store(data: StoredData, deleting=("docker.io",)) -> ed.Store:
    return ed.Store("Docker", data, ("docker.io",), deleting)


OPERATORS = StoredData("/var/lib/docker", "the running dockerd", ("web",), ("op/app:1",), ("opdata",))


def test_nothing_said_with_the_operators_data_at_stake_stops_naming_it():
    d = ed.decide((store(OPERATORS),), ("docker.io",), "", "apt")
    assert d.stop.startswith("docker.io's purge would delete /var/lib/docker, which holds 1 container (web), 1 image "
                             "(op/app:1), 1 volume (opdata) of yours (counted from the running dockerd)")
    assert "--keep-engine-data" in d.stop and "--delete-engine-data" in d.stop
    assert "stops, nothing changed (exit 14)" in d.title and "1 container, 1 image, 1 volume of yours" in d.title
    purge = un.Purge("apt", ("docker.io",), (), False, remove=d.remove, stop=d.stop)
    assert purge.commands() == []  # it runs nothing
    with pytest.raises(un.EngineDataAtStake) as exc:
        purge.execute()
    assert exc.value.exit_code == 14


def test_keep_removes_and_says_the_data_root_stays():
    d = ed.decide((store(OPERATORS),), ("docker.io",), ed.KEEP, "apt")
    assert not d.stop and d.remove
    assert d.title == ("Remove the engine packages gpuprov installed: docker.io (not purged: /var/lib/docker kept, "
                       "with 1 container, 1 image, 1 volume of yours)")
    assert d.notes[0] == ("/var/lib/docker: 1 container (web), 1 image (op/app:1), 1 volume (opdata) of yours "
                          "(counted from the running dockerd)")
    assert "`apt-get purge -y docker.io` would delete it later" in d.notes[-1]
    assert [c.argv for c in un.Purge("apt", ("docker.io",), (), False, remove=True).commands()] == [
        ("apt-get", "-s", "remove", "docker.io"), ("apt-get", "remove", "-y", "docker.io")]


def test_nothing_of_the_operators_is_removed_keeping_the_data_root_unasked():
    d = ed.decide((store(StoredData("/var/lib/docker", "the running dockerd")),), ("docker.io",), "", "apt")
    assert d.remove and not d.stop and "not purged: /var/lib/docker kept, nothing of yours in it" in d.title
    assert d.notes[-1].endswith("; --delete-engine-data purges now")


def test_delete_purges_and_names_what_goes():
    d = ed.decide((store(OPERATORS),), ("docker.io",), ed.DELETE, "apt")
    assert not d.remove and not d.stop
    assert d.title == ("Purge the engine packages gpuprov installed: docker.io (--delete-engine-data: /var/lib/docker "
                       "deleted, with 1 container, 1 image, 1 volume of yours)")
    assert d.notes == ("/var/lib/docker: 1 container (web), 1 image (op/app:1), 1 volume (opdata) of yours (counted "
                       "from the running dockerd)",)


def test_a_store_no_purge_deletes_is_purged_and_said_kept():
    """containerd's and Podman's purge delete nothing in their stores: purged as asked, the store named as kept."""
    ctr = ed.Store("containerd", StoredData("/var/lib/containerd", "the running containerd", ("op/web",),
                                            ("op/docker.io/library/app:1",)), ("containerd",), ())
    d = ed.decide((ctr,), ("containerd",), "", "apt")
    assert not d.remove and not d.stop and d.title == "Purge the engine packages gpuprov installed: containerd"
    assert d.notes == ("/var/lib/containerd kept (containerd's packages delete nothing there on purge): 1 container "
                       "(op/web), 1 image (op/docker.io/library/app:1) of yours (counted from the running containerd)",)


def test_dnf_has_no_purge_to_avoid():
    """On dnf `remove` is the only removal: the step's commands are the same whether kept or not."""
    keep = un.Purge("dnf", ("moby-engine",), (), False, remove=True)
    assert [c.argv for c in keep.commands()] == [c.argv for c in un.Purge("dnf", ("moby-engine",), (), False).commands()]


# ---------------------------------------------------------------- the command, on a host tree with dockerd stopped


@pytest.fixture
def tree(tmp_path):
    """A Debian 12 host tree: docker.io installed (dpkg's status) and in gpuprov's record, dockerd's files with the
    operator's container, images and volumes (dockerd not running: a tree is never asked)."""
    root = tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    shutil.copy(REPO / "tests/fixtures/distros/debian-12/etc/os-release", root / "etc/os-release")
    (root / "var/lib/dpkg").mkdir(parents=True)
    (root / "var/lib/dpkg/status").write_text(
        "Package: docker.io\nStatus: install ok installed\nVersion: 20.10.24+dfsg1-1+deb12u1+b6\nArchitecture: amd64\n"
        "Maintainer: Debian Go Packaging Team\n\n")
    rec = root / paths.INSTALL_RECORD.lstrip("/")
    rec.parent.mkdir(parents=True)
    rec.write_text(record.Record(packages={"engine": ["docker.io"]}).to_json())
    rec.chmod(0o600)
    dockerd_tree(root)
    return root


def cli(root: Path, *args: str):
    return run_cli("uninstall", "--dry-run", "--purge-engine", "--root", str(root), *args)


def test_dry_run_lists_them_and_exits_as_the_run_would(tree):
    r = cli(tree)
    assert r.returncode == 14, r.stdout + r.stderr
    plan = " ".join(r.stdout.split())  # the plan as printed, wrapped
    assert ("docker.io: stops, nothing changed (exit 14): docker.io's purge would delete /var/lib/docker, with 2 "
            "containers, 3 images, 2 volumes of yours (--keep-engine-data or --delete-engine-data)") in plan
    assert "$ " not in plan.split("2. ")[0]  # the step runs nothing
    assert "web" in r.stderr and "op/app:1" in r.stderr and "opdata" in r.stderr and "--keep-engine-data" in r.stderr
    assert "counted from the files under /var/lib/docker" in r.stderr and r.stderr.startswith("Error: ")
    r = cli(tree, "--json")
    assert r.returncode == 14
    doc = json.loads(r.stdout)
    [d] = doc["engine_data"]
    assert (d["engine"], d["path"], d["purge_deletes"], d["deleted"]) == ("Docker", "/var/lib/docker", ["docker.io"],
                                                                          False)
    assert d["containers"] == ["333333333333", "web"] and d["volumes"] == ["e" * 64, "opdata"]


def test_keep_and_delete_say_what_runs(tree):
    r = cli(tree, "--keep-engine-data", "--json")
    assert r.returncode == 0, r.stderr
    [step] = [s for s in json.loads(r.stdout)["steps"] if s["id"] == "uninstall.engine.packages"]
    assert step["commands"][-1].endswith("apt-get remove -y docker.io") and "not purged" in step["title"]
    r = cli(tree, "--delete-engine-data", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    [step] = [s for s in doc["steps"] if s["id"] == "uninstall.engine.packages"]
    assert step["commands"][-1].endswith("apt-get purge -y docker.io") and doc["engine_data"][0]["deleted"] is True
    r = cli(tree, "--keep-engine-data", "--delete-engine-data")
    assert r.returncode == 2 and "give one" in r.stderr
    r = run_cli("uninstall", "--dry-run", "--keep-engine-data", "--root", str(tree))
    assert r.returncode == 2 and "--purge-engine" in r.stderr
