"""The plan tells the truth: what `plan` prints is exactly what `apply` runs, and building a plan writes nothing.

- printed == executed: every step of whole-host plans is applied with `effects.run` (and the background spawn, file
  writes and gpuprov's in-process operations: the runtime's install, the CDI refresh, the engine's configure) recorded
  instead of done; the recorded argvs, in order, must be the ones the plan lists, each printed shell-quoted so that
  pasting it runs the same argv, and the recorded operations the ones the plan's actions name.
- the engine's config: the step's diff is its adapter's FileEdits, and applying the step (nothing stubbed: the
  real configure, on a config of this test's own) writes exactly those bytes.
- no writes: plans are built (a) under a read-only view of the whole filesystem (a mount namespace where every
  mount is remounted read-only) and (b) under a Python audit hook that fails on any open-for-write, mkdir, rename,
  unlink, chmod or subprocess.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from provision import effects, paths
from provision.bundle import manifest
from provision.engines import validate
from provision.engines.base import FileEdit
from provision.errors import GpuprovError
from provision.facts.distro_facts import read_distro
from provision.plan import dkms, driver, kmods
from provision.plan import runtime as runtime_host
from provision.plan import steps as st
from provision.plan.apply import check_plan
from provision.plan.build import build_plan
from provision.plan.options import Options
from provision.report import detect_host
from tests import bundles
from tests.bundles import small_bundle, tar_of
from tests.conftest import DISTROS, REPO, gpuprov_bin, make_host, needs, run_cli
from tests.unit.test_golden_plans import LEGACY_GPU

KERNEL = "6.1.0-27-amd64"


class Configured:
    def __init__(self, engine):
        self.engine = engine

    def lines(self):
        return [f"configured {self.engine}"]

    def summary(self):
        return f"configured {self.engine}"


def _planned_ops(step: st.Step) -> list[tuple]:
    """gpuprov's in-process operations the step's actions name, as the Recorder records them."""
    ops = []
    for a in step.actions:
        if isinstance(a, st.InstallRuntime):
            ops.append(("runtime install", a.prefix, a.driver_root))
        elif isinstance(a, st.RefreshCdi):
            ops.append(("cdi refresh", a.driver_root, True))
        elif isinstance(a, st.ConfigureEngine):
            ops.append(("engine configure", a.engine, {"config": a.config, "runtime_name": a.runtime_name,
                                                       "runtime_path": a.runtime_path, "default": a.default,
                                                       "cdi": a.cdi, "replace": a.replace,
                                                       "restart_engine": a.restart_engine, "options": a.options}))
    return ops


class Recorder:
    """Stands in for the host: records what apply would do, answers like a fresh host where everything runs
    (the image is missing, the SysV script fails, so the background daemon is spawned)."""

    def __init__(self, monkeypatch, dkms_builds: bool = True):
        self.argvs: list[tuple[str, ...]] = []
        self.envs: list[dict] = []
        self.writes: list[tuple[str, str]] = []
        self.write_kw: list[dict] = []
        real_run = effects.run

        def run(argv, *, check=True, env=None, timeout=None, input_text=None, private_stdout=False, probe=False):
            if probe:  # a question asked of the host (the package database before and after an install): no step's
                return effects.CommandResult(list(argv), 0, "", "")
            if argv[0] == "ldd":  # the read that finds the libraries of the image's binaries, as printed
                return real_run(argv, check=check)
            self.argvs.append(tuple(argv))
            self.envs.append(env or {})
            failing = argv[:3] == ["docker", "image", "inspect"] or argv[0].startswith("/etc/init.d/")
            if argv[:2] == ["dkms", "status"]:  # DKMS built the module (or, when told, did not: nothing listed)
                out = f"nvidia/1.0, {argv[-1]}, x86_64: installed\n" if dkms_builds else ""
                return effects.CommandResult(list(argv), 0, out, out)
            if "--log-uri" in argv:  # containerd's shim writes the container's output where ctr run says
                log = Path(argv[argv.index("--log-uri") + 1].removeprefix("file://"))
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(f"{validate.OK_WORD}\n")
            return effects.CommandResult(list(argv), 1 if failing else 0, "done\n", "done\n")

        monkeypatch.setattr(effects, "run", run)
        # the kernel's module files, which KmodServes reads after ELRepo's kmod is installed: there, as DKMS's are
        monkeypatch.setattr(kmods, "nvidia_module", lambda root, kernel: "/lib/modules/K/extra/nvidia.ko" if dkms_builds
                            else None)
        # gpuprov's in-process operations touch the host where these functions do: recorded there, with the
        # arguments the step's action passes (what it printed)
        self.ops: list[tuple] = []
        monkeypatch.setattr(runtime_host, "install", lambda prefix, driver_root: self.ops.append(
            ("runtime install", prefix, driver_root)) or ({"runtime_path": f"{prefix}/bin/gpuprov-runtime", "compiled": False,
                                                   "front_end_origin": None, "changed": []}, ["done"]))
        monkeypatch.setattr(runtime_host, "refresh_cdi", lambda driver_root, install_units: self.ops.append(
            ("cdi refresh", driver_root, install_units)) or ["done"])
        monkeypatch.setattr(st, "configure", lambda engine, **kw: self.ops.append(("engine configure", engine, kw)) or
                            Configured(engine))
        monkeypatch.setattr(effects, "spawn", lambda argv, log: self.argvs.append(tuple(argv)))
        def write(path, text, **kw):
            self.writes.append((str(path), text))
            self.write_kw.append(kw)

        monkeypatch.setattr(st, "write_file", write)
        monkeypatch.setattr(dkms, "build_logs", lambda: [])  # no DKMS build log of this machine's is read
        monkeypatch.setattr(effects, "wait_for", lambda pred, *a, **kw: True)


def _printed_argvs(step: st.Step, prompt: str = "$ ") -> list[tuple[str, ...]]:
    """The argvs as a reader of the printed plan sees them: `$ ` lines split on shell operators, `K=V` prefixes
    and output redirections dropped, plus the fallback named in backquotes. prompt="  $ ": the commands printed
    under "on a failed …" instead (a rollback)."""
    out = []
    for line in step.lines():
        if line.startswith(prompt):
            text = line[len(prompt):].split(" < <", 1)[0]
            cmd: list[str] = []
            redirect = False
            for tok in shlex.split(text.removesuffix(" || true")) + ["||"]:
                if redirect:  # `> FILE`: where the output goes, not an argument
                    redirect = False
                elif tok == ">":
                    redirect = True
                elif tok in ("||", ">/dev/null"):
                    if cmd:
                        out.append(tuple(cmd))
                    cmd = []
                elif not (not cmd and "=" in tok and tok.split("=")[0].isupper()):
                    cmd.append(tok)
        elif "`" in line and prompt == "$ ":
            out.append(tuple(shlex.split(line.split("`")[1])))
    return out


def _planned_writes(step: st.Step) -> list[tuple[str, str]]:
    """The files the step writes, in order: WriteFile's content, and a command's output ("done" from Recorder)
    where it is written to a file."""
    return [w for a in step.actions for w in ([(a.path, a.content)] if isinstance(a, st.WriteFile) else
                                              [(c.stdout_to, "done\n") for c in a.commands() if c.stdout_to])]


def secure_boot(root: Path) -> None:
    var = root / "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
    var.parent.mkdir(parents=True)
    var.write_bytes(b"\x06\x00\x00\x00\x01")


CASES = [("debian-12", "datacenter", Options()), ("debian-12", "none", Options(engine_source="docker-ce")),
         ("ubuntu-24.04", "datacenter", Options(cdi=True)), ("rocky-9", "datacenter", Options()),
         ("rocky-9", "none", Options(driver_source="nvidia", engine="containerd")),
         ("debian-12", "datacenter", Options(engine="containerd")),  # containerd's validation with the GPU
         ("debian-12", "datacenter+secureboot", Options()),  # the MOK import, its one-time password redacted
         # the operator's daemon.json keys (merged by engine.config) and users added to the docker group
         ("debian-12", "none+users", Options(engine_options=(("log-driver", '"local"'),), engine_users=("alice", "bob")))]
PASSWORD = "0badc0de"


@pytest.mark.parametrize("distro,sysfs,opt", CASES, ids=[f"{d}-{s}-{i}" for i, (d, s, _) in enumerate(CASES)])
def test_printed_equals_executed(tmp_path, monkeypatch, distro, sysfs, opt):
    root = make_host(tmp_path, distro, sysfs.split("+")[0], kernel=KERNEL)
    if sysfs.endswith("+secureboot"):
        secure_boot(root)
    if sysfs.endswith("+users"):
        (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n"
                                         "bob:x:1001:1001::/home/bob:/bin/sh\n")
    steps = build_plan(detect_host(root, engines=False), opt)
    if opt.engine_users:
        assert [c.argv for s in steps if s.id == "engine.users" for c in s.commands] == \
            [("usermod", "-aG", "docker", u) for u in opt.engine_users]
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(driver.secrets, "token_hex", lambda n: PASSWORD)
    for step in steps:
        step.apply()
    # the one-time password is the only token that differs between what ran and what was printed
    assert sum(PASSWORD in t for a in rec.argvs for t in a) == (1 if sysfs.endswith("+secureboot") else 0)
    ran = [tuple(t.replace(PASSWORD, driver.ONE_TIME_PASSWORD) for t in a) for a in rec.argvs]
    expected = [a for s in steps for a in st.executed_argvs(s)]
    assert ran == expected
    assert ran == [a for s in steps for a in _printed_argvs(s)]
    assert rec.writes == [w for s in steps for w in _planned_writes(s)]
    assert rec.ops == [o for s in steps for o in _planned_ops(s)]
    assert {o[0] for o in rec.ops} >= {"runtime install", "engine configure"}
    # a command's output written to a file (the MOK password's hash) is 0600 from its first byte, never a backup
    for (path, _), kw in zip(rec.writes, rec.write_kw):
        if path == driver.MOK_HASH:
            assert kw == {"mode": 0o600, "keep_mode": False, "backup": False}
    # each environment assignment printed before a command is in that command's environment
    cmds = [c for s in steps for c in s.commands]
    for c in cmds:
        i = ran.index(c.argv)
        assert all(rec.envs[i].get(k) == v for k, v in c.env)
        # shell-quoted: pasting it gives this argv (and `|| true` exactly when its failure is not the step's)
        assert shlex.split(c.shell().removesuffix(" || true"))[len(c.env):] == \
            list(c.argv) + ([">", c.stdout_to] if c.stdout_to else [])
        assert c.shell().endswith(" || true") == c.may_fail


# The module package DKMS builds, which the rollback purges: named in Debian's package list; on Ubuntu a dependency
# of the metapackage (nvidia-headless-B-server-open -> nvidia-dkms-B-server-open), purged with it.
DKMS_PACKAGE = {"debian-12": re.compile(r"nvidia-open-kernel-dkms"),
                "ubuntu-24.04": re.compile(r"nvidia-dkms-\d+-server-open")}


@pytest.mark.parametrize("distro", sorted(DKMS_PACKAGE))
def test_dkms_rollback_runs_what_is_printed(tmp_path, monkeypatch, distro):
    """A failed DKMS build: after the step's commands, exactly the rollback commands printed under "on a failed
    DKMS build" run, with their printed environment, and the step stops with exit 16."""
    root = make_host(tmp_path, distro, "datacenter", kernel=KERNEL)
    step = next(s for s in build_plan(detect_host(root, engines=False), Options()) if s.id == "driver.packages")
    rollback = _printed_argvs(step, prompt="  $ ")
    assert [c.argv for c in step.on_failure] == rollback and rollback[0][:3] == ("apt-get", "purge", "-y")
    assert any(DKMS_PACKAGE[distro].fullmatch(p) for p in rollback[0][3:]), rollback[0]
    assert ("dkms", "status", "-k", KERNEL) in st.executed_argvs(step)
    assert rollback[1:] == [("dpkg", "--configure", "-a"), ("dpkg", "--audit")]
    rec = Recorder(monkeypatch, dkms_builds=False)
    with pytest.raises(GpuprovError) as e:
        step.apply()
    assert e.value.exit_code == 16
    assert rec.argvs == [*st.executed_argvs(step), *rollback]
    for c, env in zip(step.on_failure, rec.envs[-3:]):
        assert all(env.get(k) == v for k, v in c.env)
    assert step.to_dict(root)["on_failure"] == [c.shell() for c in step.on_failure]


def test_json_and_check_list_every_actions_commands(tmp_path):
    """`plan --json` and `--check` list the commands of every action, not only of plain commands: the driver's
    install (with its rollback), the engine's start, the validation image (Ansible's check mode reads them)."""
    root = make_host(tmp_path, "debian-12", "datacenter", kernel=KERNEL)
    (root / "run/systemd/system").mkdir(parents=True)
    steps = build_plan(detect_host(root, engines=False), Options())
    doc = {s.id: s.to_dict(root) for s in steps}
    checked = {i["id"]: i for i in check_plan(steps, root)["steps"]}
    for sid in ("driver.packages", "engine.service"):
        step = next(s for s in steps if s.id == sid)
        want = [c.shell() for c in step.commands]
        assert want and doc[sid]["commands"] == want and checked[sid]["commands"] == want
    assert doc["engine.service"]["commands"] == ["systemctl enable --now docker"]
    pkgs = ("linux-headers-6.1.0-27-amd64 linux-headers-amd64 nvidia-open-kernel-dkms nvidia-driver nvidia-smi libcuda1 "
            "firmware-misc-nonfree")
    assert doc["driver.packages"]["commands"][-4:] == [  # the dry run that refuses removals, the install, the builds
        f"DEBIAN_FRONTEND=noninteractive NEEDRESTART_MODE=a apt-get -s install -y --no-install-recommends {pkgs}",
        f"DEBIAN_FRONTEND=noninteractive NEEDRESTART_MODE=a apt-get install -y --no-install-recommends --no-remove "
        f"{pkgs}", "dkms autoinstall -k 6.1.0-27-amd64", "dkms status -k 6.1.0-27-amd64"]
    assert checked["driver.packages"]["on_failure"][-1] == "dpkg --audit"
    assert doc["validate"]["commands"][:2] == [f"docker image inspect {validate.IMAGE}",
                                               f"docker import - {validate.IMAGE}"]


def test_bundle_plan_writes_its_source_list_only_when_applied(tmp_path, monkeypatch):
    root = make_host(tmp_path, "debian-12", "none", kernel=KERNEL)
    bundle = tmp_path / "bundle" / "repo"
    bundle.mkdir(parents=True)
    steps = build_plan(detect_host(root, engines=False), Options(bundle=str(bundle), validate=False))
    rec = Recorder(monkeypatch)
    for step in steps:
        step.apply()
    assert f"{paths.BUNDLE_APT}/bundle.list" in \
        [p for p, _ in rec.writes]
    assert rec.argvs == [a for s in steps for a in st.executed_argvs(s)]


def test_quoting_survives_a_shell():
    c = st.Command(("sh", "-c", 'echo "it\'s $A"; true'), (("A", "b c"),))
    out = subprocess.run(["bash", "-c", c.shell()], capture_output=True, text=True)
    assert out.stdout == "it's b c\n"


FORBID = textwrap.dedent("""
    import contextlib, io, json, os, sys
    def hook(event, args):
        if event == "open" and len(args) > 2 and isinstance(args[0], (str, bytes)):
            mode, flags = args[1] or "r", args[2] or 0
            if any(c in str(mode) for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise SystemExit(f"WRITE {args[0]!r}")
        elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.chmod", "os.chown",
                       "os.symlink", "os.link", "os.truncate", "shutil.copyfile", "subprocess.Popen", "os.exec",
                       "os.posix_spawn", "os.fork"):
            raise SystemExit(f"{event} {args[:2]!r}")
    from provision.cli import main
    runs = json.loads(sys.argv[1])
    sys.addaudithook(hook)
    results = []
    for argv in runs:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(argv)
        results.append([rc, out.getvalue()])
    print(json.dumps(results))
""")


def test_plan_opens_nothing_for_writing(tmp_path):
    """Under an audit hook that stops the process at the first write or command, whole plans are built: every
    fixture distro, with docker, containerd + CDI, docker-ce."""
    runs = []
    for distro in sorted(p.name for p in DISTROS.iterdir() if p.name != "centos-7-legacy"):  # as the goldens
        root = make_host(tmp_path, distro, LEGACY_GPU.get(distro, "datacenter"), kernel=KERNEL)
        for extra in ([], ["--engine", "containerd", "--cdi"], ["--engine-source", "docker-ce"]):
            runs.append(["plan", "--json", "--root", str(root), *extra])
    p = subprocess.run([sys.executable, "-c", FORBID, json.dumps(runs)], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    results = json.loads(p.stdout)
    assert len(results) == len(runs)
    for argv, (rc, out) in zip(runs, results):
        assert rc == 0, argv
        assert json.loads(out)["steps"], argv


def host_bundle(base: Path) -> Path:
    """tests/bundles.small_bundle made for this machine's release, so that bootstrap's preflight passes here."""
    bundle = small_bundle(base)
    d = read_distro(Path("/"))
    target = {**bundles.TARGET, "os_id": d.id, "version": d.major, "codename": d.codename,
              "name": f"{d.id}-{d.major}"}
    manifest.write_manifest(bundle, target, bundles.COMPONENTS)
    return bundle


RO_SCRIPT = ("set -e; mount --make-rprivate /; "
             "awk '{print $2}' /proc/self/mounts | sort -u | "
             "while read -r mp; do mount -o remount,bind,ro \"$mp\" 2>/dev/null || true; done; "
             "if touch /tmp/.gpuprov-ro-probe 2>/dev/null; then echo NOT-READ-ONLY; exit 99; fi; "
             # the one writable place: an empty private tmpfs as TMPDIR, which must be empty again afterwards
             "mount -t tmpfs -o mode=0700,size=64m gpuprov-scratch \"$SCRATCH\"; "
             "rc=0; TMPDIR=\"$SCRATCH\" \"$@\" || rc=$?; "
             "if [ -n \"$(ls -A \"$SCRATCH\")\" ]; then echo \"left in TMPDIR: $(ls -A \"$SCRATCH\")\" >&2; exit 98; fi; "
             "exit $rc")


@needs("unshare")
def _without_restart_note(doc: dict) -> dict:
    """The plan without engine.config's note on a dockerd restart that stops this machine's running containers: the
    read-only run is in a private mount namespace, where this machine's dockerd is another namespace's daemon whose
    containers gpuprov does not count (and would not restart), so only the writable run has it; nor the words of
    how dockerd is told (a restart held with live-restore on for those containers, or a reload: issue 39 item 2),
    for the same reason."""
    for step in doc.get("steps", []):
        if step.get("id") == "engine.config" and "notes" in step:
            step["notes"] = [n for n in step["notes"] if "running container(s)" not in n]
        if step.get("id") == "engine.config":
            step["actions"] = step.get("actions", [])[:1]
            step.pop("effect", None)
    return doc


def test_plan_on_a_read_only_filesystem(tmp_path):
    """The whole host read-only (every mount remounted read-only in a private mount namespace; TMPDIR an empty
    private tmpfs that must be empty again afterwards): `plan` of this live host and of a fixture root,
    `bootstrap --dry-run` (also with a reboot-resume pending, and with a bundle directory or .tar.gz) and
    `bootstrap --check --root` all succeed and print the same as on a writable one."""
    root = make_host(tmp_path, "debian-12", "datacenter", kernel=KERNEL)
    state, run, scratch = tmp_path / "state", tmp_path / "run", tmp_path / "scratch"
    for d in (state, run, scratch):
        d.mkdir()
    # the last run asked for a reboot, and the host has rebooted since: a real run would resume (and write)
    (state / "state.json").write_text(json.dumps({"reboot_required": True, "boot_id": "before",
                                                  "reason": "driver installed"}))
    bundle = host_bundle(tmp_path / "bundle")
    archive = tar_of(bundle, tmp_path / "bundle.tar.gz")
    env = {**os.environ, "GPUPROV_STATE_DIR": str(state), "GPUPROV_RUN_DIR": str(run), "SCRATCH": str(scratch),
           "GPUPROV_BUNDLE_DIR": str(tmp_path / "bundles")}
    gp = gpuprov_bin()
    for args in (["plan", "--json"], ["plan", "--json", "--root", str(root)], ["bootstrap", "--dry-run", "--json"],
                 ["bootstrap", "--dry-run", "--json", "--bundle", str(bundle)],
                 ["bootstrap", "--dry-run", "--json", "--bundle", str(archive)],
                 ["bootstrap", "--check", "--json", "--root", str(root)]):
        ro = subprocess.run(["unshare", "-m", "bash", "-c", RO_SCRIPT, "ro", *gp, *args], capture_output=True,
                            text=True, env=env)
        if "Operation not permitted" in ro.stderr and "unshare" in ro.stderr:
            pytest.skip("no mount namespaces here (unprivileged)")
        assert ro.returncode == 0, (args, ro.stdout + ro.stderr)
        rw = subprocess.run([*gp, *args], capture_output=True, text=True, env=env)
        assert _without_restart_note(json.loads(ro.stdout)) == _without_restart_note(json.loads(rw.stdout)), args
        if args[0] == "bootstrap" and "--root" not in args:
            assert "records the resume" in json.loads(ro.stdout)["resume"]["bootstrap"]
    assert json.loads((state / "state.json").read_text())["reboot_required"] is True
    assert not (tmp_path / "bundles").exists() and not any(run.iterdir()) and not any(scratch.iterdir())


def test_dry_run_and_check_of_a_bundle_leave_nothing(tmp_path):
    """`bootstrap --dry-run|--check --bundle X.tar.gz` verify the bundle as a real run does (a tampered one is
    refused, exit 8) in a private temporary directory removed afterwards: nothing is left where a real run keeps
    its copy, and the plan names that copy's directory (what a real run would use)."""
    bundle = host_bundle(tmp_path / "b")
    archive = tar_of(bundle, tmp_path / "b.tar.gz")
    kept, scratch = tmp_path / "bundles", tmp_path / "scratch"
    scratch.mkdir()
    env = {"GPUPROV_BUNDLE_DIR": str(kept), "TMPDIR": str(scratch)}
    repo = f"{kept}/{manifest.sha256(bundle / 'SHA256SUMS')[:16]}/gpuprov-bundle/repo"
    for mode in ("--dry-run", "--check"):
        r = run_cli("bootstrap", mode, "--json", "--bundle", str(archive), "--driver", "skip", "--only", "engine",
                    "--engine-source", "distro", env=env)  # an install asked for, whatever engine this host has
        assert r.returncode == 0, r.stderr
        if mode == "--dry-run":
            pkgs = next(s for s in json.loads(r.stdout)["steps"] if s["id"] == "engine.packages")
            assert any(f"Dir::Etc::SourceList={paths.BUNDLE_APT}/bundle.list" in c for c in pkgs["commands"])
            assert f"+deb [trusted=yes] file:{repo} ./" in pkgs["diffs"][f"{paths.BUNDLE_APT}/bundle.list"]
        assert not kept.exists() and not any(scratch.iterdir()), (list(kept.rglob("*")), list(scratch.iterdir()))
    (bundle / "repo/python3.deb").write_bytes(b"!<arch>\ntampered\n")
    r = run_cli("bootstrap", "--dry-run", "--bundle", str(tar_of(bundle, tmp_path / "bad.tar.gz")), env=env)
    assert r.returncode == 8 and "python3.deb" in r.stderr, r.stderr
    assert not kept.exists() and not any(scratch.iterdir())


ENGINE_CONFIGS = {"docker": '{\n  "log-driver": "journald"\n}\n',
                  "containerd": 'version = 2\n\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "pause:3.9"\n'}


@pytest.mark.parametrize("engine", sorted(ENGINE_CONFIGS))
@pytest.mark.parametrize("cdi", [False, True])
def test_engine_config_writes_the_diff_it_prints(tmp_path, engine, cdi):
    """Nothing stubbed: the engine.config step of a plan, its config an operator's file of this test's own (as for
    an engine found with --config), is printed, then applied (the real configure: the adapter's merge, its check,
    the write); the files on disk afterwards are exactly the FileEdits printed, compared as objects, and the printed
    diff is the diff between the file before and after. No daemon reads this config: none is signalled."""
    if engine == "containerd" and not shutil.which("containerd"):
        pytest.skip("no containerd binary here: its adapter's plan asks it (config dump)")
    root = make_host(tmp_path, "debian-12", "datacenter", kernel=KERNEL)
    step = next(s for s in build_plan(detect_host(root, engines=False), Options(engine=engine, cdi=cdi))
                if s.id == "engine.config")
    (action,) = step.actions
    config = tmp_path / "operator" / ("daemon.json" if engine == "docker" else "config.toml")
    config.parent.mkdir()
    config.write_text(ENGINE_CONFIGS[engine])
    action = dataclasses.replace(action, config=str(config))
    step = dataclasses.replace(step, actions=(action,), check=st.EngineConfigured(action))
    before = {str(p): p.read_text() for p in config.parent.rglob("*") if p.is_file()}
    printed, diffs = action.edits(Path("/")), step.diffs(Path("/"))
    assert printed and not step.satisfied()
    out = action.execute()  # what step.apply() runs (it reports the last line)
    after = {str(p): p.read_text() for p in config.parent.rglob("*") if p.is_file() and ".bak" not in p.name
             and not p.name.endswith("~")}
    executed = [FileEdit(e.path, before.get(str(e.path)), after[str(e.path)]) for e in printed]
    assert executed == printed
    assert diffs == {str(e.path): effects.unified_diff(before.get(str(e.path)) or "", after[str(e.path)], str(e.path))
                     for e in printed}
    assert set(after) == set(before) | {str(e.path) for e in printed}  # nothing else written
    assert "not signalled" in out or "not running" in out
    assert step.satisfied() is (engine != "docker")  # the merge is done; dockerd would also have to list it


def test_plan_never_hangs_on_a_fifo_under_the_root(tmp_path):
    """Files a plan reads under `--root` are read as facts are (regular files only, bounded, non-blocking): a FIFO
    with no writer in place of the apt sources or an apt list is skipped, one in place of the engine's config is
    refused in one line (exit 6), instead of a plan that waits forever."""
    root = make_host(tmp_path, "debian-12", "datacenter", kernel=KERNEL)
    (root / "etc/apt/sources.list.d").mkdir()
    (root / "etc/apt/sources.list.d/extra.list").write_text("deb http://mirror.invalid/debian bookworm main\n")
    (root / "etc/apt/sources.list").unlink()
    os.mkfifo(root / "etc/apt/sources.list")
    os.mkfifo(root / "etc/apt/sources.list.d/fifo.list")
    r = run_cli("plan", "--json", "--root", str(root), timeout=60)
    assert r.returncode == 0, r.stderr
    comps = next(s for s in json.loads(r.stdout)["steps"] if s["id"] == "driver.components")
    assert comps["files"] == ["/etc/apt/sources.list.d/extra.list"]
    (root / "etc/docker").mkdir()
    os.mkfifo(root / "etc/docker/daemon.json")
    r = run_cli("plan", "--root", str(root), timeout=60)
    assert r.returncode == 6 and "daemon.json is not a regular file" in r.stderr, r.stderr


def test_check_reads_through_the_root(tmp_path):
    """`bootstrap --check --root TREE` evaluates every step against the tree (its apt sources: a minimal diff);
    `--root` without --dry-run/--check is a usage error (applying is for this host only)."""
    root = make_host(tmp_path, "debian-12", "datacenter", kernel=KERNEL)
    r = run_cli("bootstrap", "--check", "--json", "--root", str(root))
    assert r.returncode == 0, r.stderr
    steps = {s["id"]: s for s in json.loads(r.stdout)["steps"]}
    changed = [ln for ln in steps["driver.components"]["diff"].splitlines()
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert changed == ["-deb http://mirror.invalid/debian bookworm main",
                       "-deb http://mirror.invalid/debian-security bookworm-security main",
                       "+deb http://mirror.invalid/debian bookworm main contrib non-free non-free-firmware",
                       "+deb http://mirror.invalid/debian-security bookworm-security main contrib non-free "
                       "non-free-firmware"]
    assert steps["driver.packages"]["would_change"] and steps["packages.recover"]["would_change"] is False
    r = run_cli("bootstrap", "--yes", "--root", str(root))
    assert r.returncode == 2 and "--dry-run or --check" in r.stderr


# ---------------------------------------------------------------- uninstall


# What an uninstall step may run: the engines' own clients (there only where the engine is), coreutils, systemd and
# apt (every Debian host has them). No `kill`: a minimal host lacks procps (issue 28); signals go by os.kill.
MINIMAL_HOST_TOOLS = {"rm", "rmdir", "systemctl", "apt-get", "apt-mark", "docker", "podman", "ctr"}


def test_uninstall_runs_what_it_prints(tmp_path, monkeypatch):
    """Every uninstall action (the engine's undo and live reload, the editor's signal, the runtime's guard, the
    purges with their simulation, the state and the kept record of packages) applied with the host recorded: the
    argvs run are the ones printed, in order, the files written the ones planned, and no step needs a tool a
    minimal host lacks."""
    from provision import record
    from provision.plan import uninstall as un
    from tests.unit.test_uninstall import host as host_fixture

    tmp, cfg, original = host_fixture.__wrapped__(tmp_path, monkeypatch)
    monkeypatch.setattr(paths, "INSTALL_RECORD", str(tmp / "state/installed.json"))
    monkeypatch.setattr(un, "packages_installed", lambda pm, pkgs, root=Path("/"): True)
    record.note_packages("driver", ["nvidia-driver"], held=["nvidia-driver"])
    record.note_packages("engine", ["docker.io"])
    sleeper = subprocess.Popen(["sleep", "60"])  # the warm editor, as its lock file names it
    try:
        start = Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        (tmp / "etc/gpuprov/runtime.json.sock.lock").write_text(f"{sleeper.pid} {start} sleep\n")
        import fcntl

        fd = os.open(tmp / "etc/gpuprov/runtime.json.sock.lock", os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        steps = un.uninstall_steps(Path("/"), un.UninstallOptions(purge_driver=True))
        os.close(fd)
        rec = Recorder(monkeypatch)
        for step in steps:
            step.apply()
        assert sleeper.wait(timeout=10) == -15  # signalled in-process, as printed
    finally:
        sleeper.kill()
    assert rec.argvs == [a for s in steps for a in st.executed_argvs(s)]
    assert rec.argvs == [a for s in steps for a in _printed_argvs(s)]
    assert rec.writes == [w for s in steps for w in _planned_writes(s)]
    assert ("apt-get", "-s", "purge", "nvidia-driver") in rec.argvs  # the simulation before the purge
    assert [p for p, _ in rec.writes] == [str(cfg), str(tmp / "state/installed.json")]  # the engine record kept
    assert {a[0] for a in rec.argvs} <= MINIMAL_HOST_TOOLS, {a[0] for a in rec.argvs}
    assert any("SIGTERM" in ln for s in steps for ln in s.lines())
