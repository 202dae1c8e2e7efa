"""build_plan: facts + options -> ordered steps. Commands and file contents are decided here from the facts
alone; the checks and actions each step carries do the I/O at apply time."""
from __future__ import annotations

from pathlib import Path

from provision import checkimage
from provision.decide.packages import engine_packages
from provision.decide.targets import Target
from provision.engines import base
from provision.errors import Unsupported
from provision.facts.engines import EngineOrigin, spec
from provision.facts.rootfs import under
from provision.inject.cdi import SpecCurrent
from provision.options import Options, Stage
from provision.plan import repos
from provision.plan.driver import driver_steps
from provision.plan.packages import APT_ENV, package_step
from provision.plan.steps import (
    Already,
    Command,
    DirEmpty,
    EngineConfigured,
    FilesMatch,
    ImportImage,
    Never,
    RunContainer,
    RuntimeInstalled,
    ServiceAnswers,
    StartService,
    Step,
    WriteFile,
)
from provision.report import HostReport

RUNTIME_PATH = base.RUNTIME_PATH


def dpkg_recover_step(stage: Stage, allow_remove: bool = False) -> Step:
    """A run killed in the middle of dpkg leaves its journal and packages half-installed: replay the journal (it
    fails for a package whose dependency was cut off mid-unpack), then let apt repair exactly those (removing
    nothing: a repair that needs a removal fails and names it)."""
    return Step("packages.recover", stage, "Finish an interrupted dpkg run (packages left half-configured)",
                actions=(Command(("dpkg", "--configure", "-a"), APT_ENV, may_fail=True),
                         Command(("apt-get", "install", "-f", "-y", "--no-install-recommends",
                                  *(() if allow_remove else ("--no-remove",))), APT_ENV)),
                check=DirEmpty("/var/lib/dpkg/updates"))


def found_engine(report: HostReport, engine: str) -> EngineOrigin | None:
    """The engine already on the host (its package, snap, static binaries or running daemon), as detected."""
    return next((e.origin for e in report.engines if e.name == engine and e.origin), None)


def adopted(report: HostReport, opt: Options) -> EngineOrigin | None:
    """The engine gpuprov keeps and configures where it is: one found on the host, unless --engine-source asks for
    an install (which then stops with exit 14 before it would remove the one there; --allow-remove lets it)."""
    return found_engine(report, opt.engine) if opt.engine_source == "auto" else None


def engine_steps(report: HostReport, target: Target, opt: Options) -> list[Step]:
    """The engine's repository (docker-ce) and packages, or the engine found on the host, kept. Its service starts
    after the runtime is configured."""
    if opt.engine == "none":
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
        source = "docker-ce" if target.family == "rhel" and target.os_id != "amzn" and opt.engine == "docker" \
            else "distro"
    pkgs = engine_packages(target, opt.engine, source)
    pre: tuple[Command, ...] = ()
    if source == "docker-ce":
        if target.family == "debian":
            src = WriteFile("/etc/apt/sources.list.d/docker.list", repos.docker_ce_apt_source(target, opt.mirrors))
            steps.append(Step("engine.repo", Stage.ENGINE, "Add Docker CE's apt repository with a signed-by keyring",
                              actions=(Command(("install", "-m", "0755", "-d", "/etc/apt/keyrings")),
                                       Command(("curl", "-fsSL", repos.docker_ce_gpg(target, opt.mirrors), "-o",
                                                "/etc/apt/keyrings/docker.asc")), src),
                              check=FilesMatch(((src.path, src.content),))))
        else:
            cm = ("dnf", "config-manager") if target.package_manager == "dnf" else ("yum-config-manager",)
            pre = (Command((*cm, "--add-repo", repos.docker_ce_repo_file(target, opt.mirrors))),)
    steps.append(package_step("engine.packages", Stage.ENGINE, f"Install the container engine: {' '.join(pkgs)}"
                              + (" (from the bundle)" if opt.bundle else ""), target, pkgs, pre=pre, bundle=opt.bundle))
    return steps


# The daemon each engine's service runs (CRI-O is configured for an existing node, not started by gpuprov).
DAEMONS = {"docker": "dockerd", "containerd": "containerd"}


def service_steps(report: HostReport, target: Target, opt: Options) -> list[Step]:
    """The engine's daemon started (and enabled at boot) once its runtime is configured; without systemd the
    daemon in the background, so a host without an init still gets a daemon to validate against."""
    daemon = DAEMONS.get(opt.engine)
    if daemon is None:
        return []
    found = adopted(report, opt)
    if found and not found.unit:  # static binaries: no unit to start them with, and their flags are the operator's
        if found.pid is None:
            raise Unsupported(f"{found.describe()} is not running, and there is no unit to start it with: start "
                              f"{daemon} as you run it, then run bootstrap again")
        return []
    systemd = under(Path(report.root or "/"), "/run/systemd/system").is_dir()
    return [Step("engine.service", Stage.ENGINE, f"Start {daemon} (and enable it at boot)",
                 actions=(StartService(opt.engine, daemon, systemd),), check=ServiceAnswers(opt.engine))]


def runtime_steps(report: HostReport, target: Target, opt: Options) -> list[Step]:
    """The runtime, then its registration in the engine's config: both run as the `gpuprov` commands printed."""
    droot = (report.driver.driver_root if report.driver else None) or "/"
    steps = [Step("runtime.install", Stage.RUNTIME,
                  "Install gpuprov-runtime (+ --gpus hook) and its discovery cache",
                  actions=(Command(("gpuprov", "runtime", "install", "--driver-root", droot)),),
                  check=RuntimeInstalled(droot))]
    if opt.engine in ("docker", "containerd"):
        found = adopted(report, opt)
        config = found.config if found and found.config != spec(opt.engine).config else None
        argv = ["gpuprov", "engine", "configure", opt.engine, *(("--config", config) if config else ()),
                "--runtime-name", opt.runtime_name, "--runtime-path", RUNTIME_PATH]
        argv += ["--default"] if opt.default_runtime else []
        argv += ["--cdi"] if opt.cdi else []
        argv += ["--replace-runtime"] if opt.replace_runtime else []
        steps.append(Step("engine.config", Stage.RUNTIME,
                          f"Register runtime {opt.runtime_name!r} in {opt.engine}'s config (merge)"
                          + (f": {config}, the file the running {opt.engine} reads" if config else ""),
                          actions=(Command(tuple(argv)),),
                          check=EngineConfigured(opt.engine, opt.runtime_name, RUNTIME_PATH, opt.default_runtime,
                                                 opt.cdi, opt.replace_runtime, config)))
    if opt.cdi and report.driver and report.driver.loaded:  # (caps) a spec needs the loaded driver; its units
        steps.append(Step("cdi.spec", Stage.RUNTIME, "Write the CDI spec (/etc/cdi, /var/run/cdi) and its refresh units",
                          actions=(Command(("gpuprov", "cdi", "refresh", "--install-units")),),
                          check=SpecCurrent(droot)))
    return steps


def validate_steps(report: HostReport, target: Target, opt: Options, runtime_path: str = RUNTIME_PATH) -> list[Step]:
    """A container through the runtime just registered, from an image built out of this host's files. docker: by the
    runtime's name; containerd: with `runtime_path` (the binary its handler names) as runc, in gpuprov's namespace
    (tests give a private runtime's path)."""
    if not opt.validate or opt.engine not in ("docker", "containerd"):
        return []
    has_gpu = bool(report.gpus)
    if opt.engine == "docker":
        actions: tuple = (ImportImage(checkimage.IMAGE, checkimage.BINARIES),
                          *(Command(a) for a in checkimage.run_argvs(opt.runtime_name, has_gpu)))
    else:
        actions = (ImportImage(checkimage.CTR_IMAGE, checkimage.BINARIES, engine="containerd"),
                   Command(checkimage.ctr_remove_argv(), may_fail=True),
                   *(RunContainer(a, checkimage.ctr_log(), expect=None if i else checkimage.OK_WORD)
                     for i, a in enumerate(checkimage.ctr_run_argvs(runtime_path, has_gpu))))
    return [Step("validate", Stage.VALIDATE, "Start a validation container through the runtime"
                 + (" with the GPU" if has_gpu else " (no GPU on this host: plain container)")
                 + (f" (containerd, namespace {checkimage.CTR_NAMESPACE})" if opt.engine == "containerd" else ""),
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
    installs = [s for s in (Stage.DRIVER, Stage.ENGINE) if s in on]  # the stages that install packages
    return ([dpkg_recover_step(installs[0], opt.allow_remove)] if target.package_manager == "apt" and installs else []) \
        + (driver_steps(report, target, opt) if Stage.DRIVER in on else []) \
        + (engine_steps(report, target, opt) if Stage.ENGINE in on else []) \
        + (runtime_steps(report, target, opt) if Stage.RUNTIME in on else []) \
        + (service_steps(report, target, opt) if Stage.ENGINE in on else []) \
        + (validate_steps(report, target, opt) if Stage.VALIDATE in on else [])
