"""Issue 44's dnf half: what a killed dnf run leaves, read as gpuprov reads it, from real dnf 4.14's and rpm 4.18's own
outputs and history database (tests/fixtures/dnf-killed/README.md says how each was captured): an operator's
`dnf upgrade gpuprov-test-app` (which upgrades gpuprov-test-base with it) killed in gpuprov-test-base's %post, on a
Rocky 9 host with two kernels (installed side by side on purpose) and rpm's signing key. The recover step removes the
older duplicate with dnf's own `remove --duplicates` (its dry run first: it may remove nothing else), reinstalls what
a transaction that never ended brought in, refuses (exit 4, one line) a version dnf can no longer fetch, and is not
planned at all where nothing is part-way. The real kills: tests/integration/test_dnf_killed.py."""
from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from provision import effects, package_managers
from provision.errors import RemovalRefused, Unsupported
from provision.facts import rpm_unfinished
from provision.facts.rpm_unfinished import (
    CUT,
    NEWEST,
    OLDER,
    cut_transaction,
    dnf_running,
    installonly_extra,
    rpm_duplicates,
    rpm_rows,
)
from provision.options import Stage
from provision.plan.build import build_plan, recover_step
from provision.plan.options import Options
from provision.plan.packages import RemovalGuard
from provision.report import detect_host
from provision.versions import rpm_evr_cmp, rpm_vercmp
from tests.conftest import make_host

FX = Path(__file__).resolve().parents[1] / "fixtures" / "dnf-killed"
KERNELS = {"kernel", "kernel-core"}  # what rpm answers for dnf's installonlypkgs on the captured host
BASE_OLD, BASE_NEW = "gpuprov-test-base-0:1.0-1.noarch", "gpuprov-test-base-0:2.0-1.noarch"


def host(tmp_path: Path, history: str) -> Path:
    """A Rocky 9 tree with rpm's database directory and dnf's history database as the capture left it."""
    root = make_host(tmp_path, "rocky-9", "datacenter", kernel="5.14.0-503.14.1.el9_5.x86_64")
    (root / "var/lib/rpm").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/dnf").mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(root / "var/lib/dnf/history.sqlite")
    db.executescript((FX / history).read_text())
    db.close()
    return root


@pytest.fixture
def answers(monkeypatch):
    """rpm's and dnf's answers as recorded (set rpm_qa, repoquery); every command asked is kept in `asked`."""
    state = {"rpm_qa": "", "repoquery": (FX / "repoquery.txt").read_text(), "asked": [], "dry_run": ""}

    def run(argv, **kw):
        argv = [str(a) for a in argv]
        state["asked"].append(argv)
        if argv[0] == "rpm" and "-qa" in argv:
            return effects.CommandResult(argv, 0, state["rpm_qa"])
        if argv[0] == "rpm" and "--whatprovides" in argv:
            return effects.CommandResult(argv, 0, "\n".join(sorted(KERNELS)) + "\n")
        if argv[0] == "dnf" and "repoquery" in argv:
            return effects.CommandResult(argv, 0, state["repoquery"])
        if argv[0] == "dnf" and "--assumeno" in argv:
            return effects.CommandResult(argv, 1, state["dry_run"])
        raise AssertionError(f"unexpected command {argv}")

    monkeypatch.setattr(effects, "run", run)
    return state


def actions(step) -> list[str]:
    return [ln.removeprefix("$ ") for ln in step.lines() if ln.startswith("$ ")]


# ---------------------------------------------------------------- the facts, from real outputs


def test_duplicates_are_the_ones_dnf_check_names():
    rows = rpm_rows((FX / "rpm-qa-killed-in-post.txt").read_text())
    found = rpm_duplicates(rows, KERNELS)
    assert [(u.spec, u.state, u.reinstall) for u in found] == [(BASE_OLD, OLDER, False), (BASE_NEW, NEWEST, True)]
    # dnf check's own words on the same host: "X-V-R.A is a duplicate with Y-V-R.A" (it leaves the epoch out)
    said = re.findall(r"^(\S+) is a duplicate with (\S+)$", (FX / "dnf-check-killed-in-post.txt").read_text(), re.M)
    assert {p for pair in said for p in pair} == {u.spec.replace("-0:", "-") for u in found}
    # kernels (installed side by side on purpose) and rpm's key are not duplicates; without the installonly answer
    # the two kernels would be
    assert {u.name for u in rpm_duplicates(rows)} == {"gpuprov-test-base", "kernel", "kernel-core"}
    assert rpm_duplicates(rpm_rows((FX / "rpm-qa-killed-in-posttrans.txt").read_text()), KERNELS) == []
    assert rpm_duplicates(rpm_rows((FX / "rpm-qa-recovered.txt").read_text()), KERNELS) == []


def test_a_killed_reinstall_leaves_the_same_version_twice():
    """`dnf reinstall` (the recovery's own) killed in %post: rpm lists that very version twice (seen on the harness
    host: tests/integration/test_dnf_killed.py's reinstall case); one header goes, the version is installed again."""
    rows = rpm_rows("gpuprov-test-post 0:2.0-1 noarch\ngpuprov-test-post 0:2.0-1 noarch\n")
    found = rpm_duplicates(rows)
    assert [u.state for u in found] == [NEWEST, OLDER] and {u.spec for u in found} == {
        "gpuprov-test-post-0:2.0-1.noarch"}
    assert package_managers.get("dnf").recover_what(found) == (
        "remove the second header of gpuprov-test-post-0:2.0-1.noarch (a killed reinstall) and reinstall it")


def test_the_transaction_that_never_ended(tmp_path):
    """dnf writes a transaction's end (time, DONE) last: a killed one has neither. Its items are all still UNKNOWN
    (dnf keeps their states in memory until the end), so every package it brought in is a suspect."""
    assert cut_transaction(host(tmp_path / "a", "history-killed-in-post.sql")) == [
        ("gpuprov-test-app", "0:2.0-1", "noarch"), ("gpuprov-test-base", "0:2.0-1", "noarch")]
    assert cut_transaction(host(tmp_path / "b", "history-killed-in-posttrans.sql")) == [
        ("gpuprov-test-killed", "0:2.0-1", "noarch")]
    # after `dnf remove --duplicates` the last transaction is that one, ended
    assert cut_transaction(host(tmp_path / "c", "history-recovered.sql")) == []
    assert cut_transaction(tmp_path) == []  # no history: nothing known


# ---------------------------------------------------------------- the step


def test_duplicates_are_removed_by_dnf_after_its_dry_run(tmp_path, answers):
    root = host(tmp_path, "history-killed-in-post.sql")
    answers["rpm_qa"] = (FX / "rpm-qa-killed-in-post.txt").read_text()
    pm = package_managers.get("dnf")
    # gpuprov-test-app-2.0 was not installed yet (the kill came first): it is the operator's to take, not finished
    assert [(u.spec, u.state) for u in pm.unfinished(root)] == [(BASE_OLD, OLDER), (BASE_NEW, NEWEST)]
    step = recover_step(Stage.DRIVER, manager="dnf", root=root)
    assert step.title == (f"Finish an interrupted rpm run: remove the older duplicate {BASE_OLD} and reinstall "
                          f"{BASE_NEW}")
    assert actions(step) == [
        "dnf --disableplugin=versionlock --setopt=clean_requirements_on_remove=0 remove --duplicates --assumeno",
        "dnf --disableplugin=versionlock --setopt=clean_requirements_on_remove=0 remove --duplicates -y"]
    assert not step.check.satisfied(root)
    # the newest was asked about from dnf's cached metadata only (it has it: no refresh)
    (query,) = [a for a in answers["asked"] if "repoquery" in a]
    assert "--cacheonly" in query and query[-1] == BASE_NEW
    # --allow-remove: no dry run to stop on
    assert len(actions(recover_step(Stage.DRIVER, allow_remove=True, manager="dnf", root=root))) == 1


def test_the_dry_run_may_remove_nothing_but_the_older_duplicates(answers):
    guard = RemovalGuard("dnf", ("dnf", "remove", "--duplicates", "--assumeno"), ("gpuprov-test-base",))
    # real dnf's dry run on the captured host: it reinstalls base 2.0 "replacing" 1.0, and finishes app's upgrade
    answers["dry_run"] = (FX / "remove-duplicates-dry-run.txt").read_text()
    guard.check_removals()
    # where a package needing the older one had nothing else to go to, dnf itself refused (no removal named)
    answers["dry_run"] = (FX / "remove-duplicates-dry-run-dependent.txt").read_text()
    guard.check_removals()
    # a dry run that removes a dependent (real dnf's table for one): exit 14, naming it, before any change
    answers["dry_run"] = (FX / "remove-with-dependent-dry-run.txt").read_text()
    with pytest.raises(RemovalRefused) as err:
        RemovalGuard("dnf", ("dnf", "remove", "--duplicates", "--assumeno"), ("gpuprov-test-lib",)).check_removals()
    assert err.value.exit_code == 14 and "gpuprov-test-app" in str(err.value) and "--allow-remove" in str(err.value)


def test_a_transaction_cut_in_posttrans_is_reinstalled(tmp_path, answers):
    root = host(tmp_path, "history-killed-in-posttrans.sql")
    answers["rpm_qa"] = (FX / "rpm-qa-killed-in-posttrans.txt").read_text()
    answers["repoquery"] = "gpuprov-test-killed-0:2.0-1.noarch\n"
    step = recover_step(Stage.DRIVER, manager="dnf", root=root)
    spec = "gpuprov-test-killed-0:2.0-1.noarch"
    assert step.title == f"Finish an interrupted rpm run: reinstall {spec} (its transaction was cut off)"
    assert actions(step) == [f"dnf --disableplugin=versionlock reinstall -y {spec}"]  # no removal: no dry run
    assert [u.state for u in package_managers.get("dnf").unfinished(root)] == [CUT]


def test_a_version_dnf_cannot_fetch_stops_before_any_change(tmp_path, answers):
    root = host(tmp_path, "history-killed-in-post.sql")
    answers["rpm_qa"] = (FX / "rpm-qa-killed-in-post.txt").read_text()
    answers["repoquery"] = ""  # neither the cached metadata nor fresh metadata has it (the repository moved on)
    with pytest.raises(Unsupported) as err:
        recover_step(Stage.DRIVER, manager="dnf", root=root)
    msg = str(err.value)
    assert err.value.exit_code == 4 and "\n" not in msg, msg
    assert "gpuprov-test-base 0:2.0-1 half-installed" in msg and "dnf can no longer fetch" in msg
    assert "dnf distro-sync gpuprov-test-base" in msg
    # asked from the cache first, then from metadata dnf fetched anew: a stale cache alone never stops the run
    assert [next(w for w in a if w in ("--cacheonly", "--refresh")) for a in answers["asked"] if "repoquery" in a] \
        == ["--cacheonly", "--refresh"]


def test_nothing_part_way_plans_no_step(tmp_path, answers):
    root = host(tmp_path, "history-recovered.sql")
    answers["rpm_qa"] = (FX / "rpm-qa-recovered.txt").read_text()
    assert recover_step(Stage.DRIVER, manager="dnf", root=root) is None
    steps = build_plan(detect_host(root, engines=False), Options(engine="none"))
    assert "packages.recover" not in [s.id for s in steps]
    # the killed run's state read through the same plan: the step comes first, before any change
    answers["rpm_qa"] = (FX / "rpm-qa-killed-in-post.txt").read_text()
    (root / "var/lib/dnf/history.sqlite").unlink()
    assert build_plan(detect_host(root, engines=False), Options(engine="none"))[0].id == "packages.recover"


def test_yum_has_no_recover_step():
    assert package_managers.get("yum").recoverable is False and package_managers.get("dnf").recoverable


def test_a_tree_without_rpms_database_runs_no_command(tmp_path, answers):
    root = make_host(tmp_path, "rocky-9", "datacenter")
    assert package_managers.get("dnf").unfinished(root) == [] and answers["asked"] == []


# ---------------------------------------------------------------- a dnf running now, dnf.conf, rpm's version order


def test_a_dnf_holding_its_lock_now_is_not_a_killed_one(tmp_path, monkeypatch):
    monkeypatch.setattr(rpm_unfinished, "is_live", lambda root: True)
    lock = tmp_path / "var/lib/dnf/rpmdb_lock.pid"
    lock.parent.mkdir(parents=True)
    dnf = subprocess.Popen(["bash", "-c", "exec -a /usr/bin/dnf sleep 30"])  # as a running dnf's cmdline reads
    other = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.2)
        lock.write_text(f"{dnf.pid}")
        assert dnf_running(tmp_path, ("dnf", "yum"))
        lock.write_text(f"{other.pid}")  # the killed dnf's pid, taken since by something else
        assert not dnf_running(tmp_path, ("dnf", "yum"))
        dnf.kill()
        time.sleep(0.2)  # not waited for: a zombie, as a killed dnf is until its parent reaps it
        lock.write_text(f"{dnf.pid}")
        assert not dnf_running(tmp_path, ("dnf", "yum"))
        dnf.wait()
        assert not dnf_running(tmp_path, ("dnf", "yum"))  # gone
    finally:
        for p in (dnf, other):
            p.kill()
            p.wait()
    assert os.path.exists(lock)  # read, never touched


def test_installonlypkgs_from_dnf_conf(tmp_path):
    (tmp_path / "etc/dnf").mkdir(parents=True)
    (tmp_path / "etc/dnf/dnf.conf").write_text("[main]\ngpgcheck=1\ninstallonlypkgs=kernel-rt, my-kmod  other\n"
                                               "[other]\ninstallonlypkgs=nope\n")
    assert installonly_extra(tmp_path) == ("kernel-rt", "my-kmod", "other")
    assert installonly_extra(tmp_path / "none") == ()


@pytest.mark.parametrize("a, b, want", [  # rpm's tests/rpmvercmp.at cases and EL's, each as rpm 4.18 answers
    ("1.0", "1.0", 0), ("1.0", "2.0", -1), ("2.0.1", "2.0", 1), ("2.0", "2.0.1", -1), ("2.0.1a", "2.0.1", 1),
    ("5.5p1", "5.5p10", -1), ("10xyz", "10.1xyz", -1), ("xyz10", "xyz10.1", -1), ("1.0010", "1.9", 1),
    ("1.05", "1.5", 0), ("1.0", "1", 1), ("2.50", "2.5", 1), ("fc4", "fc.4", 0), ("FC5", "fc4", -1),
    ("2a", "2.0", -1), ("1.0a", "1.0aa", -1), ("10b2", "10a1", 1), ("1.0~rc1", "1.0", -1),
    ("1.0~rc1", "1.0~rc2", -1), ("1.0~rc1~git123", "1.0~rc1", -1), ("1.0^", "1.0", 1), ("1.0^git1", "1.01", -1),
    ("1.0^git1~pre", "1.0^git1", -1), ("503.40.1.el9_5", "503.14.1.el9_5", 1), ("1.el9", "1.el9_5", -1)])
def test_rpm_version_order(a, b, want):
    assert rpm_vercmp(a, b) == want and rpm_vercmp(b, a) == -want


def test_rpm_epoch_version_release_order():
    assert rpm_evr_cmp("1:0.5-1", "0:9.0-1") == 1 and rpm_evr_cmp("0:2.0-1", "0:1.0-1") == 1
    assert rpm_evr_cmp("2.0-10", "2.0-9") == 1 and rpm_evr_cmp("0:2.0-1", "2.0-1") == 0
