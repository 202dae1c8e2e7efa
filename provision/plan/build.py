"""build_plan: facts + options -> ordered steps. Commands and file contents are decided here from the facts
alone; the checks and actions each step carries do the I/O at apply time."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from provision.decide.targets import Target
from provision.errors import Unsupported
from provision.facts.host import HostReport
from provision.plan import repos
from provision.plan.steps import Step, files_match, packages_installed

NOUVEAU_CONF = "/etc/modprobe.d/gpuprov-blacklist-nouveau.conf"
NOUVEAU_TEMPLATE = "nouveau-blacklist.conf.j2"
RUNTIME_PATH = "/usr/local/bin/gpuprov-runtime"


@dataclass(frozen=True)
class Options:
    driver: str = "auto"  # auto | skip | <branch>
    kernel_modules: str = "auto"
    driver_source: str = "distro"  # distro | elrepo | nvidia
    engine: str = "docker"  # docker | containerd | none
    engine_source: str = "auto"  # auto | distro | docker-ce (auto: the distro's Docker; EL ships none -> docker-ce)
    runtime_name: str = "nvidia"
    default_runtime: bool = True
    cdi: bool = False
    validate: bool = True
    bundle: str | None = None  # an offline bundle's repository: packages come from it alone
    replace_runtime: bool = False  # --replace-runtime: the operator's runtime of that name / default may be replaced


def _install_cmds(target: Target, packages: tuple[str, ...], bundle: str | None = None) -> list[list[str]]:
    if target.package_manager == "apt" and bundle:
        from provision.bundle.aptrepo import apt_options

        opts = apt_options(Path(bundle), Path("/var/lib/gpuprov/bundle-apt"))
        return [["apt-get", *opts, "update"], ["apt-get", *opts, "install", "-y", "--no-install-recommends", *packages]]
    if bundle:
        from provision.bundle.create import dnf_install_cmd

        return [dnf_install_cmd(bundle, list(packages))]
    if target.package_manager == "apt":
        return [["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *packages]]
    pm = target.package_manager
    mods = [p for p in packages if ":" in p]
    plain = [p for p in packages if ":" not in p]
    cmds = [[pm, "install", "-y", *plain]] if plain else []
    cmds += [[pm, "module", "install", "-y", m] for m in mods]
    return cmds


def _pkg_step(sid: str, title: str, target: Target, packages: tuple[str, ...], pre: list[list[str]] | None = None,
              bundle: str | None = None, **kw) -> Step:
    cmds = ([] if bundle else (pre or [])) + _install_cmds(target, packages, bundle)
    step = Step(sid, title, commands=cmds, check=lambda: packages_installed(target.package_manager, packages), **kw)
    if target.package_manager == "apt":
        step.action = lambda: _apt_apply(step, bundle)
    return step


def _apt_apply(step: Step, bundle: str | None = None) -> None:
    from provision import effects
    from provision.errors import StepFailed

    # A run killed in the middle of dpkg leaves packages half-configured: finish that first, then install.
    if any(Path("/var/lib/dpkg/updates").glob("*")):
        effects.run(["dpkg", "--configure", "-a"], env=_apt_env())
    for argv in step.commands:
        if argv == ["apt-get", "update"] and _apt_lists_fresh():
            continue  # another step just refreshed them: one update per run is enough
        try:
            effects.run(argv, env=_apt_env(), timeout=3600)
        except StepFailed as exc:
            if bundle and ("not installable" in str(exc) or "Unable to locate package" in str(exc)):
                from provision.bundle.manifest import BundleInvalid

                raise BundleInvalid(f"a package is missing from bundle {bundle} (apt: {str(exc).splitlines()[-1]}); "
                                    "rebuild it with `gpuprov bundle create`; nothing was fetched from the network"
                                    ) from None
            raise


def _apt_lists_fresh(max_age: float = 1800) -> bool:
    """apt's lists were refreshed in the last half hour, after the last change to the sources."""
    import time

    lists = [p for p in Path("/var/lib/apt/lists").glob("*_InRelease")] + \
        [p for p in Path("/var/lib/apt/lists").glob("*_Packages*")]
    if not lists:
        return False
    newest = max(p.stat().st_mtime for p in lists)
    srcs = [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
    changed = max((p.stat().st_mtime for p in srcs if p.exists()), default=0)
    return time.time() - newest < max_age and newest > changed


def _apt_env() -> dict:
    import os

    return {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "NEEDRESTART_MODE": "a"}


def driver_steps(report: HostReport, target: Target, opt: Options) -> list[Step]:
    drv = report.driver
    gpus = [d for _, d in report.gpus]
    if opt.driver == "skip":
        return []
    if not gpus:
        return [Step("driver.none", "No NVIDIA GPU on the PCI bus: no driver to install", check=lambda: True,
                     verify_only=True)]
    if drv and drv.loaded and (drv.driver_root or drv.userspace_version):
        return [Step("driver.present", f"NVIDIA driver {drv.version} ({drv.kernel_module}) already loaded with "
                     f"userspace in {drv.driver_root}: left alone", check=lambda: True, verify_only=True)]
    packages: list[str] = []
    for d in gpus:
        if not d.packages:
            raise Unsupported(f"no driver package for {d.name} ({d.pci_id}) on {target.name}: "
                              + "; ".join(d.warnings))
        packages += [p for p in d.packages if p not in packages]
    dkms = not (opt.driver_source == "elrepo" or (target.family == "rhel" and opt.driver_source == "distro"))
    if drv and drv.secure_boot and dkms:
        raise Unsupported(
            "Secure Boot is on and the chosen driver is built by DKMS (unsigned): the kernel would reject it. "
            "Use signed precompiled modules (Ubuntu linux-modules-nvidia-*, ELRepo kmods: --driver-source elrepo), "
            "or enroll a MOK: `mokutil --import /var/lib/dkms/mok.pub`, reboot, confirm in MokManager, run again")
    steps: list[Step] = []
    krel = drv.kernel_release if drv else None
    if target.family == "debian":
        comps = repos.debian_components(target)
        src_files = {}
        root = Path(report.root or "/")
        lists = root / "etc/apt/sources.list.d"
        for p in [root / "etc/apt/sources.list", *sorted(lists.glob("*.sources")), *sorted(lists.glob("*.list"))]:
            try:
                old = p.read_text()
            except OSError:
                continue
            from provision.plan.sources import enable_components

            new = enable_components(old, comps, target.codename)
            if new != old:
                src_files["/" + str(p.relative_to(root))] = new
        if src_files and not opt.bundle:
            steps.append(Step("driver.components", f"Enable {' '.join(comps)} in the existing apt entries",
                              files=src_files, check=lambda f=src_files: files_match(f)))
        if dkms and krel:
            packages.insert(0, f"linux-headers-{krel}")
    else:
        el = target.el_major
        if opt.bundle:
            pass  # the bundle's repository already holds the kmod / module packages
        elif opt.driver_source in ("distro", "elrepo") and el:
            pre = [["rpm", "--import", repos.ELREPO_KEY[el]],
                   [target.package_manager, "install", "-y", repos.elrepo_release(el)]]
            steps.append(_pkg_step("driver.repo", "Add ELRepo (elrepo-release + its key)", target, (),
                                   pre=pre, notes=["ELRepo kmods are kABI-tracking and signed"]))
            steps[-1].check = lambda: packages_installed("dnf", ("elrepo-release",))
        else:
            pm = target.package_manager
            pre = ([[pm, "install", "-y", repos.epel_release(el)]] if el else []) + \
                  ([["dnf", "config-manager", "--add-repo", repos.cuda_repo(target)]] if pm == "dnf" else
                   [["yum-config-manager", "--add-repo", repos.cuda_repo(target)]])
            steps.append(Step("driver.repo", "Add NVIDIA's CUDA repository (and EPEL for dkms)", commands=pre,
                              check=lambda: Path("/etc/yum.repos.d").joinpath(
                                  repos.cuda_repo(target).rsplit("/", 1)[1]).exists()))
            if krel:
                packages[:0] = [f"kernel-devel-{krel}", f"kernel-headers-{krel}", "dkms"]
    steps.append(_pkg_step("driver.packages", f"Install the driver: {' '.join(packages)}", target,
                           tuple(packages), bundle=opt.bundle, reboot=True))
    initramfs = ["update-initramfs", "-u"] if target.family == "debian" else ["dracut", "-f"]
    from provision.render import render

    nouveau = {NOUVEAU_CONF: render(NOUVEAU_TEMPLATE)}
    steps.append(Step("driver.nouveau", "Blacklist nouveau and rebuild the initramfs",
                      files=nouveau, commands=[initramfs], check=lambda: files_match(nouveau),
                      reboot=bool(drv and drv.nouveau_loaded)))
    return steps


def engine_steps(report: HostReport, target: Target, opt: Options) -> list[Step]:
    if opt.engine == "none":
        return []
    steps = []
    source = opt.engine_source
    if opt.bundle:
        source = "distro"  # bundles carry the distro's engine
    if source == "auto":
        source = "docker-ce" if target.family == "rhel" and target.os_id != "amzn" and opt.engine == "docker" \
            else "distro"
    pkgs = repos.engine_packages(target, opt.engine, source)
    pre: list[list[str]] = []
    if source == "docker-ce":
        if target.family == "debian":
            steps.append(Step("engine.repo", "Add Docker CE's apt repository with a signed-by keyring",
                              commands=[["install", "-m", "0755", "-d", "/etc/apt/keyrings"],
                                        ["curl", "-fsSL", repos.DOCKER_CE_GPG[target.os_id], "-o",
                                         "/etc/apt/keyrings/docker.asc"]],
                              files={"/etc/apt/sources.list.d/docker.list": repos.docker_ce_apt_source(target)},
                              check=lambda: files_match({"/etc/apt/sources.list.d/docker.list":
                                                         repos.docker_ce_apt_source(target)})))
        else:
            cm = ["dnf", "config-manager"] if target.package_manager == "dnf" else ["yum-config-manager"]
            pre = [[*cm, "--add-repo", repos.docker_ce_repo_file(target)]]
    steps.append(_pkg_step("engine.packages", f"Install the container engine: {' '.join(pkgs)}"
                           + (" (from the bundle)" if opt.bundle else ""), target, pkgs, pre=pre, bundle=opt.bundle))
    if opt.engine == "docker":
        from provision import effects

        steps.append(Step("engine.service", "Start dockerd (and enable it at boot)",
                          commands=[["systemctl", "enable", "--now", "docker"]],
                          check=lambda: effects.docker_runtimes() is not None,
                          action=lambda: effects.start_dockerd()))
    return steps


def runtime_steps(report: HostReport, target: Target, opt: Options) -> list[Step]:
    from provision.inject import install

    droot = (report.driver.driver_root if report.driver else None) or "/"
    steps = [Step("runtime.install", "Install gpuprov-runtime (+ --gpus hook) and its discovery cache",
                  commands=[["gpuprov", "runtime", "install", "--driver-root", droot]],
                  check=lambda: install.is_installed(droot),
                  action=lambda: ", ".join(install.install_runtime(driver_root=droot).changed) or None)]
    if opt.engine in ("docker", "containerd"):
        from provision.engines import configure as cfg

        argv = ["gpuprov", "engine", "configure", opt.engine, "--runtime-name", opt.runtime_name]
        argv += ["--default"] if opt.default_runtime else []
        argv += ["--cdi"] if opt.cdi else []
        argv += ["--replace-runtime"] if opt.replace_runtime else []

        def check() -> bool:
            r = cfg.configure(opt.engine, runtime_name=opt.runtime_name, runtime_path=RUNTIME_PATH,
                              default=opt.default_runtime, cdi=opt.cdi,
                              replace=opt.replace_runtime, dry_run=True)
            if r.changed:
                return False
            if opt.engine == "docker":
                from provision import effects

                return opt.runtime_name in (effects.docker_runtimes() or [])
            return True

        def act() -> str:
            r = cfg.configure(opt.engine, runtime_name=opt.runtime_name, runtime_path=RUNTIME_PATH,
                              default=opt.default_runtime, cdi=opt.cdi,
                              replace=opt.replace_runtime)
            return "; ".join(r.changes) + (f" ({r.restart})" if r.restart else "")

        def preview() -> str:
            return cfg.configure(opt.engine, runtime_name=opt.runtime_name, runtime_path=RUNTIME_PATH,
                                 default=opt.default_runtime, cdi=opt.cdi,
                                 replace=opt.replace_runtime, dry_run=True).diff

        steps.append(Step("engine.config", f"Register runtime {opt.runtime_name!r} in {opt.engine}'s config (merge)",
                          commands=[argv], check=check, action=act, preview=preview))
    if opt.validate and opt.engine == "docker":
        from provision.plan import validate

        has_gpu = bool(report.gpus)
        steps.append(Step("validate", "Start a validation container through the runtime"
                          + (" with the GPU" if has_gpu else " (no GPU on this host: plain container)"),
                          commands=validate.commands(opt.runtime_name, has_gpu),
                          action=lambda: validate.run(opt.runtime_name, has_gpu), verify_only=True))
    return steps


def build_plan(report: HostReport, opt: Options) -> list[Step]:
    if report.target is None:
        d = report.distro
        raise Unsupported(f"unsupported distribution {d.id if d else '?'} {d.version if d else ''}: "
                          "gpuprov has rules for Debian 11-13, Ubuntu 18.04-24.04, EL 7-10, Amazon Linux 2023")
    target = report.target
    steps = driver_steps(report, target, opt) + engine_steps(report, target, opt) + runtime_steps(report, target, opt)
    # The runtime and its --gpus hook go in before dockerd starts, so a fresh host starts dockerd once, already
    # configured (dockerd looks for the hook only at start-up).
    rank = {"runtime.install": 1, "engine.config": 2, "engine.service": 3, "validate": 4}
    return sorted(steps, key=lambda s: rank.get(s.id, 0))

