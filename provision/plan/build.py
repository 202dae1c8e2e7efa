"""build_plan: facts + options -> ordered steps. Commands and file contents are decided here from the facts
alone; the checks and actions each step carries do the I/O at apply time."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from provision import engines, package_managers
from provision.decide.targets import Target
from provision.engines import base, validate
from provision.engines.base import Engine
from provision.errors import Unsupported, UsageError
from provision.facts.engines import EngineOrigin
from provision.facts.rootfs import is_live, read_text, under
from provision.inject.cdi import SpecCurrent
from provision.options import Stage
from provision.plan import repos
from provision.plan.driver import check_driver_pin, check_kernels, driver_steps
from provision.plan.options import Options
from provision.plan.packages import RemovalGuard, package_step
from provision.plan.persistence import persistence_steps
from provision.plan.steps import (
    Already,
    Command,
    ConfigureEngine,
    EngineConfigured,
    FilesMatch,
    ImportImage,
    InGroup,
    InstallRuntime,
    Never,
    PackagesFinished,
    RefreshCdi,
    RunContainer,
    RuntimeInstalled,
    ServiceAnswers,
    StartService,
    Step,
    WriteFile,
)
from provision.report import HostReport

RUNTIME_PATH = base.RUNTIME_PATH


def recover_step(stage: Stage, allow_remove: bool = False, manager: str = "apt",
                 root: Path = Path("/")) -> Step | None:
    """What a run of the package manager killed part-way left (an ssh session dropped, the OOM killer, a power cut),
    finished before the first change with the packages named in the title, in the adapter's words (`recover_what`).
    dpkg: its journal and packages part-way (facts.packages.UNFINISHED_STATES): the adapter's `recover` replays the
    journal (allowed to fail: it does for a package whose dependency, or whose own unpack, was cut off), unpacks
    again at its version each package dpkg needs reinstalled, then has apt repair the rest. rpm: a name-arch listed
    twice (the older header beside the newer) and the packages a transaction that never ended brought in
    (facts/rpm_unfinished.py): dnf removes the older duplicates (its dry run first: nothing else may go) and installs
    those again at their version, their scriptlets whole. A version the package manager can no longer fetch stops
    the run here, before any change, naming the package and the way out. The step is done when nothing is part-way;
    None where the adapter has no command to run now (dnf's are those of what is part-way: none, nothing to plan)."""
    pm = package_managers.get(manager)
    unfinished = pm.unfinished(root)
    gone = pm.unfetchable(root, [u for u in unfinished if u.reinstall])
    if gone:
        names = ", ".join(f"{u.name} {u.version}" for u in gone)
        raise Unsupported(f"a killed {pm.database} run left {names} half-installed, and {pm.name} can no longer fetch "
                          f"that version: {pm.refetch_hint(tuple(dict.fromkeys(u.name for u in gone)))}; then run "
                          "bootstrap again")
    what = pm.recover_what(unfinished)
    dry_run = None if allow_remove else pm.recover_dry_run(unfinished)
    guard = (RemovalGuard(manager, dry_run, pm.recover_removes(unfinished)),) if dry_run else ()
    commands = pm.recover(allow_remove, unfinished)
    if not commands:
        return None
    return Step("packages.recover", stage, f"Finish an interrupted {pm.database} run"
                + (f": {what}" if what else " (packages left part-way)"),
                actions=(*guard, *(Command(argv, pm.env, may_fail=pm.recover_may_fail(argv)) for argv in commands)),
                check=PackagesFinished(manager))


def found_engine(report: HostReport, engine: str) -> EngineOrigin | None:
    """The engine already on the host (its package, snap, static binaries or running daemon), as detected."""
    return next((e.origin for e in report.engines if e.name == engine and e.origin), None)


def adopted(report: HostReport, opt: Options) -> EngineOrigin | None:
    """The engine gpuprov keeps and configures where it is: one found on the host, unless --engine-source asks for
    an install (which then stops with exit 14 before it would remove the one there; --allow-remove lets it)."""
    return found_engine(report, opt.engine) if opt.engine_source == "auto" else None


def adapter(opt: Options) -> Engine | None:
    """The adapter of the engine asked for (None: --engine none)."""
    return None if opt.engine == "none" else engines.get(opt.engine)


def engine_steps(report: HostReport, target: Target, opt: Options) -> list[Step]:
    """The engine's repository (docker-ce) and packages, or the engine found on the host, kept. Its service starts
    after the runtime is configured."""
    eng = adapter(opt)
    if eng is None:
        return []
    found = adopted(report, opt)
    if found:
        where = f"its config {found.config}" + (f", unit {found.unit}" if found.unit else "") + \
            (f", running as pid {found.pid}" if found.pid else ", not running")
        return [Step("engine.present", Stage.ENGINE, f"{found.describe()}: kept", check=Already("found on the host"),
                     verify_only=True, notes=(f"no engine installed: gpuprov configures the one found ({where})",))]
    steps = []
    source = opt.engine_source
    if opt.bundle:
        source = "distro"  # bundles carry the distro's engine
    if source == "auto":
        source = eng.default_source(target)
    pkgs = eng.packages(target, source)
    pre: tuple[Command, ...] = ()
    opts: tuple[str, ...] = ()
    post: tuple[Command, ...] = ()
    kept = ""
    if source == "docker-ce":
        if target.family == "debian":
            src = WriteFile("/etc/apt/sources.list.d/docker.list", repos.docker_ce_apt_source(target, opt.mirrors))
            steps.append(Step("engine.repo", Stage.ENGINE, "Add Docker CE's apt repository with a signed-by keyring",
                              actions=(Command(("install", "-m", "0755", "-d", "/etc/apt/keyrings")),
                                       Command(("curl", "-fsSL", repos.docker_ce_gpg(target, opt.mirrors), "-o",
                                                "/etc/apt/keyrings/docker.asc")), src),
                              check=FilesMatch(((src.path, src.content),))))
        else:
            # Added disabled, enabled for this install alone, and for good once it succeeded: a refused install
            # (exit 14) must not leave an enabled repository whose containerd.io replaces the distribution's runc at
            # the operator's next `dnf upgrade` (a real dnf does: tests/integration/test_el_dnf.py).
            cm, rid = package_managers.get(target.package_manager).config_manager(), repos.DOCKER_CE_REPO_ID
            pre = (Command((*cm, "--add-repo", repos.docker_ce_repo_file(target, opt.mirrors))),
                   Command((*cm, "--save", *repos.docker_ce_setopts(target, opt.mirrors),
                            f"--setopt={rid}.enabled=0")))
            opts, post = (f"--enablerepo={rid}",), (Command((*cm, "--save", f"--setopt={rid}.enabled=1")),)
            kept = (f"Docker CE's repository file {repos.DOCKER_CE_REPO_FILE} was written and stays, disabled: no "
                    "dnf run uses it unless asked")
    steps.append(package_step("engine.packages", Stage.ENGINE, f"Install the container engine: {' '.join(pkgs)}"
                              + (" (from the bundle)" if opt.bundle else ""), target, pkgs, pre=pre, bundle=opt.bundle,
                              opts=opts, post=post, kept_before=kept))
    return steps


def service_steps(report: HostReport, target: Target, opt: Options) -> list[Step]:
    """The engine's daemon started (and enabled at boot) once its runtime is configured; without systemd the
    daemon in the background, so a host without an init still gets a daemon to validate against."""
    eng = adapter(opt)
    if eng is None or eng.unit is None:  # no engine, or one without a daemon (each command is the engine)
        return []
    found = adopted(report, opt)
    if found and not found.unit:  # static binaries: no unit to start them with, and their flags are the operator's
        if found.pid is None:
            raise Unsupported(f"{found.describe()} is not running, and there is no unit to start it with: start "
                              f"{eng.daemon} as you run it, then run bootstrap again")
        return []
    systemd = under(Path(report.root or "/"), "/run/systemd/system").is_dir()
    return [Step("engine.service", Stage.ENGINE, f"Start {eng.daemon} (and enable it at boot)",
                 actions=(StartService(eng.unit, eng.daemon, eng.ready_argv, systemd),),
                 check=ServiceAnswers(eng.ready_argv))]


DOCKER_GROUP = "docker"  # the group dockerd gives its socket to (docker.io's and docker-ce's packages create it)


def group_steps(report: HostReport, opt: Options) -> list[Step]:
    """--engine-user (the role's gpuprov_engine_users, geerlingguy.docker's docker_users): each user added to the
    docker group, after the engine's packages made it. Users that do not exist are refused while planning."""
    if not opt.engine_users:
        return []
    root = Path(report.root or "/")
    known = {ln.split(":", 1)[0] for ln in (read_text(root, "/etc/passwd") or "").splitlines()}
    missing = [u for u in opt.engine_users if u not in known]
    if missing:
        raise UsageError(f"--engine-user {', '.join(missing)}: no such user on this host (/etc/passwd); create "
                         f"{'them' if len(missing) > 1 else 'it'} first (the role: ansible.builtin.user)")
    return [Step("engine.users", Stage.ENGINE, f"Add {', '.join(opt.engine_users)} to group {DOCKER_GROUP} (its "
                 "members use the docker socket: root-equivalent)",
                 actions=tuple(Command(("usermod", "-aG", DOCKER_GROUP, u)) for u in opt.engine_users),
                 check=InGroup(DOCKER_GROUP, opt.engine_users))]


def restart_plan(report: HostReport, eng, action: ConfigureEngine) -> tuple[str, tuple[str, ...]]:
    """On the live host, what the engine's config step will do to its daemon, as the run will do it (configure:
    the same restart_reasons, restart_stops and hold_blocker): (the words for ConfigureEngine.how, "" where the
    file's keys say it all; the notes). A restart of a daemon that runs containers with live-restore off keeps them
    by holding live-restore on for it; where it cannot, the note says how many stop and that it needs
    --restart-engine (exit 14 without)."""
    if not is_live(Path(report.root or "/")):
        return "", ()
    daemon = eng.live_daemon(eng.config_path(action.config, action.request()))
    # no dockerd yet (this run installs it): it starts before runtime.install puts the --gpus hook in
    why = action.restart_reasons(daemon)
    if not why:
        return "", ()
    how = f"restart {eng.daemon_names[0]} ({'; '.join(why)})"
    stops = eng.restart_stops(daemon) if daemon and eng.restart_stops_containers else 0
    if not stops:
        return how, ()
    blocker = eng.hold_blocker(daemon)
    if blocker is None:
        return eng.apply_how(True, keeps=stops), (
            f"{'; '.join(why)}: live-restore is off, so it is turned on by a reload for the restart (its {stops} "
            "running container(s) keep running), and back off by a reload after it",)
    return how, (f"{'; '.join(why)}: that stops its {stops} running container(s) (live-restore off, and it cannot "
                 f"be turned on for the restart: {blocker}): "
                 + ("--restart-engine given" if action.restart_engine else
                    "without --restart-engine the step stops before writing anything, exit 14"),)


def restart_notes(report: HostReport, eng, action: ConfigureEngine) -> tuple[str, ...]:
    """restart_plan's notes."""
    return restart_plan(report, eng, action)[1]


def runtime_steps(report: HostReport, target: Target, opt: Options) -> list[Step]:
    """The runtime, then its registration in the engine's config: both run in-process, as the `gpuprov runtime
    install` and `gpuprov engine configure` commands do."""
    droot = (report.driver.driver_root if report.driver else None) or "/"
    eng = adapter(opt)
    steps = [Step("runtime.install", Stage.RUNTIME,
                  "Install gpuprov-runtime (+ --gpus hook) and its discovery cache",
                  actions=(InstallRuntime(droot, own=eng.own_front_end if eng else None),),
                  check=RuntimeInstalled(droot))]
    cdi = opt.cdi or bool(eng and eng.gpus_through_cdi)  # an engine whose GPUs come through CDI needs the spec
    if eng is not None:
        found = adopted(report, opt)
        config = found.config if found and found.config != eng.default_config else None
        default = opt.default_runtime and not eng.gpus_through_cdi  # its own OCI runtime stays its default
        action = ConfigureEngine(opt.engine, opt.runtime_name, eng.front_end(RUNTIME_PATH), default, opt.cdi,
                                 opt.replace_runtime, config, opt.restart_engine, opt.engine_options)
        how, notes = restart_plan(report, eng, action)
        action = replace(action, how=how)
        steps.append(Step("engine.config", Stage.RUNTIME,
                          f"Register runtime {opt.runtime_name!r} in {opt.engine}'s config (merge)"
                          + (f", and set {', '.join(k for k, _ in opt.engine_options)}" if opt.engine_options else "")
                          + (f": {config}, the file the running {opt.engine} reads" if config else ""),
                          actions=(action,), check=EngineConfigured(action),
                          notes=notes))
    if cdi and report.driver and report.driver.loaded:  # (caps) a spec needs the loaded driver; its units
        steps.append(Step("cdi.spec", Stage.RUNTIME, "Write the CDI spec (/etc/cdi, /var/run/cdi) and its refresh units",
                          actions=(RefreshCdi(droot),), check=SpecCurrent(droot)))
    return steps


def validate_steps(report: HostReport, target: Target, opt: Options, runtime_path: str = RUNTIME_PATH) -> list[Step]:
    """A container through the runtime just registered, from an image built out of this host's files: the engine
    adapter's validation (docker: by the runtime's name; containerd: with `runtime_path`, the binary its handler
    names, as runc, in gpuprov's namespace; tests give a private runtime's path)."""
    eng = adapter(opt)
    val = eng.validation(opt.runtime_name, runtime_path, bool(report.gpus)) if eng and opt.validate else None
    if val is None:
        return []
    has_gpu = bool(report.gpus)
    actions = (ImportImage(val.image, validate.BINARIES),
               *(RunContainer(r.argv, r.log, r.expect) if r.log else Command(r.argv, may_fail=r.may_fail, result=True)
                 for r in val.runs))
    return [Step("validate", Stage.VALIDATE, f"Start a validation container {val.route}"
                 + (" with the GPU" if has_gpu else " (no GPU on this host: plain container)") + val.where,
                 actions=actions, check=Never("always runs: it proves the node works"), verify_only=True,
                 notes=() if has_gpu else ("no GPU on this host: checked a plain container",))]


def build_plan(report: HostReport, opt: Options) -> list[Step]:
    """The steps in the order they run. The runtime and its --gpus hook go in before dockerd starts, so a fresh
    host starts dockerd once, already configured (dockerd looks for the hook only at start-up)."""
    if report.target is None:
        d = report.distro
        raise Unsupported(f"unsupported distribution {d.id if d else '?'} {d.version if d else ''}: "
                          "gpuprov has rules for Debian 11-13, Ubuntu 18.04-24.04, EL 7-10, Amazon Linux 2023")

    target = report.target
    on = set(opt.stages)
    if Stage.DRIVER in on and opt.driver != "skip":  # values that cannot work, refused whether or not a GPU is here
        if not report.gpus:  # (with GPUs, each decision refuses the branch naming the ones that drive it)
            check_driver_pin(target, opt)
        check_kernels(Path(report.root or "/"), opt.kernels)
    installs = [s for s in (Stage.DRIVER, Stage.ENGINE) if s in on]  # the stages that install packages
    driver = driver_steps(report, target, opt) if Stage.DRIVER in on else []
    systemd = under(Path(report.root or "/"), "/run/systemd/system").is_dir()
    recover = recover_step(installs[0], opt.allow_remove, target.package_manager, Path(report.root or "/")) \
        if package_managers.get(target.package_manager).recoverable and installs else None
    return ([recover] if recover else []) \
        + driver + persistence_steps(driver, [d for _, d in report.gpus], target, opt, systemd) \
        + (engine_steps(report, target, opt) if Stage.ENGINE in on else []) \
        + (runtime_steps(report, target, opt) if Stage.RUNTIME in on else []) \
        + (service_steps(report, target, opt) + group_steps(report, opt) if Stage.ENGINE in on else []) \
        + (validate_steps(report, target, opt) if Stage.VALIDATE in on else [])
