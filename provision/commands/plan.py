"""`gpuprov plan` and `gpuprov bootstrap`: the main job, planned first, applied idempotently."""
from __future__ import annotations

import dataclasses
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer

from provision import effects, errors
from provision.bundle.install import check_bundle, extract_base, kept_path
from provision.commands import summary
from provision.decide.targets import parse_target
from provision.errors import UsageError
from provision.facts.rootfs import is_live
from provision.hostlock import host_lock
from provision.options import CHOICES, param_rule, rule
from provision.output import emit_json, print_steps
from provision.plan import apply as ap
from provision.plan import resume as rs
from provision.plan.archive_preview import driver_origins
from provision.plan.build import build_plan
from provision.plan.driver import flavour_switch
from provision.plan.driver_on_host import held_driver
from provision.plan.options import Options
from provision.plan.packages import InstallWatch
from provision.plan.preflight import Preflight, preflight
from provision.plan.resume import Resume
from provision.report import detect_host


def _plan(root: Path, target: Optional[str], opt):
    src = None if opt.driver_source == "distro" else opt.driver_source
    pin = opt.driver if opt.driver.isdigit() else None
    tgt = parse_target(target) if target else None
    report = detect_host(root, target=tgt, kernel_modules=opt.kernel_modules, source=src, pin=pin,
                         for_gpus=opt.for_gpus, preview=driver_origins)  # engines: one found is kept
    # Without --driver the branch never changes: where gpuprov's series is installed and pinned, `auto` decides for
    # its branch (and, on Ubuntu, its module flavour unless --kernel-modules asks), so a kernel update's plan follows
    # that series instead of the newest branch (which apt could only install by removing the series: exit 14). A
    # branch that no longer drives the GPU found falls back to the usual decision.
    held = held_driver(root) if opt.driver == "auto" else None
    if held and held.branch.isdigit():
        modules = held.modules if opt.kernel_modules == "auto" and held.modules else opt.kernel_modules
        followed = detect_host(root, target=tgt, kernel_modules=modules, source=src, pin=held.branch,
                               for_gpus=opt.for_gpus, preview=driver_origins)
        if followed.gpus and all(d.packages for _, d in followed.gpus):
            report = followed
    return report, build_plan(report, opt)


def _preflight(report, steps, opt, other_target: bool = False) -> Preflight:
    """The questions that can stop the run, asked before its first change (plan/preflight.py)."""
    target = report.target if report is not None else None  # None: a plan with no host report (resume's own steps)
    return preflight(steps, target.package_manager if target else "", Path((report and report.root) or "/"),
                     bundle=bool(opt.bundle), other_target=other_target)


def _print_plan(report, steps, json_out: bool, resume: Resume | None = None, verbose: bool = False,
                pre: Preflight | None = None) -> None:
    """The plan as it will run: each step, the check that skips it and what it does in one line; with `verbose`
    its commands (shell-quoted, paste-able) and its file diffs against the host under the plan's root too (--json
    always has them). `pre`: the preflight's answer, said after the steps; a stop it found ends the command with
    the run's own line and exit code (4, 5), as `bootstrap --check` does."""
    root = Path(report.root or "/")
    doc = {"schema": "gpuprov.plan/v1", "root": str(root), "target": report.target.name if report.target else None,
           "steps": [s.to_dict(root) for s in steps]}
    if resume:
        doc["resume"] = resume.to_dict()
    if pre:
        doc["preflight"] = pre.to_dict()
    if json_out:
        emit_json(doc)
    else:
        if resume:
            print(f"Before the plan: {resume.bootstrap}")
        print_steps(f"Plan for {report.target.name}", doc["steps"], verbose=verbose)
        if pre:
            print(pre.line())
    if pre and pre.stop:
        raise pre.stop


OPTS = dict(
    driver=typer.Option("auto", "--driver", callback=param_rule("driver"),
                        help="auto | skip | a driver branch (535, 470, ...): refused where "
                        "that branch does not drive the GPU or the target does not package it"),
    for_gpus=typer.Option(None, "--for-gpu", callback=param_rule("for_gpus"),
                          help="Image baking: decide as if this GPU (VENDOR:DEVICE[:SUB:SUB]) "
                          "were present; repeat for several. The module is built for every installed kernel."),
    kernels=typer.Option(None, "--kernel", callback=param_rule("kernels"),
                         help="Build the driver for this installed kernel (repeatable); "
                         "default: the kernel that boots next (every installed kernel with --for-gpu)."),
    kernel_modules=typer.Option("auto", "--kernel-modules", help=" | ".join(CHOICES["kernel_modules"])),
    driver_source=typer.Option("distro", "--driver-source", help=" | ".join(CHOICES["driver_source"])),
    engine=typer.Option("docker", "--engine", help=" | ".join(CHOICES["engine"])),
    engine_source=typer.Option("auto", "--engine-source", help=" | ".join(CHOICES["engine_source"]) + " (auto: the distro's "
                               "docker.io on Debian/Ubuntu, docker-ce on EL)"),
    runtime_name=typer.Option("nvidia", "--runtime-name", callback=param_rule("runtime_name")),
    no_default=typer.Option(False, "--no-default-runtime", help="Register the runtime without making it default "
                            "(then --gpus needs --runtime nvidia)."),
    cdi=typer.Option(False, "--cdi", help="Enable CDI in the engine."),
    replace_runtime=typer.Option(False, "--replace-runtime", help="Replace your own runtime of that name (its "
                                 "runtimeArgs are dropped) or your default-runtime (without it: exit 14, nothing "
                                 "changed)."),
    no_persistence=typer.Option(False, "--no-persistence", help="Do not install and enable nvidia-persistenced "
                                "(planned with the driver on data-centre GPUs)."),
    allow_remove=typer.Option(False, "--allow-remove", help="Let a package install remove installed packages "
                              "(apt's or dnf's conflict resolution). Without it, an install that would remove any "
                              "stops before it runs: exit 14, the packages named."),
    restart_engine=typer.Option(False, "--restart-engine", help="Let gpuprov restart dockerd where a change needs it "
                                "(--cdi, a newer --gpus hook) although that stops its running containers "
                                "(live-restore off). Without it such a run stops before it writes anything: exit 14."),
    only=typer.Option(None, "--only", help="Only these stages, a comma list of driver, engine, runtime, validate "
                      "(the fleet role's tags)."),
    engine_option=typer.Option([], "--engine-option", metavar="KEY=JSON", callback=param_rule("engine_option"),
                               help="Docker: set this daemon.json key to this JSON value (e.g. "
                               "log-driver='\"local\"'), merged with gpuprov's keys and the file's others; "
                               "repeatable. A key dockerd reads only at start restarts it (see --restart-engine)."),
    engine_user=typer.Option([], "--engine-user", metavar="USER", callback=param_rule("engine_user"),
                             help="Docker: add this existing user to the docker group (usermod -aG); repeatable."),
    mirror=typer.Option([], "--mirror", help="NAME=URL: fetch repository NAME (elrepo, epel, cuda, docker-ce) from "
                        "a mirror of the same tree; repeatable."),
)


def plan_cmd(
    root: Path = typer.Option(Path("/"), "--root", callback=rule("path"), help="Plan for the host tree under ROOT (fixtures)."),
    target: Optional[str] = typer.Option(None, "--target"),
    json_out: bool = typer.Option(False, "--json"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print every command and file diff of every step "
                                 "(without it: a few lines a step; --json has them all)."),
    driver: str = OPTS["driver"], kernel_modules: str = OPTS["kernel_modules"],
    driver_source: str = OPTS["driver_source"], engine: str = OPTS["engine"],
    engine_source: str = OPTS["engine_source"], runtime_name: str = OPTS["runtime_name"],
    no_default: bool = OPTS["no_default"], cdi: bool = OPTS["cdi"], replace_runtime: bool = OPTS["replace_runtime"],
    allow_remove: bool = OPTS["allow_remove"], restart_engine: bool = OPTS["restart_engine"],
    only: Optional[str] = OPTS["only"], mirror: list[str] = OPTS["mirror"],
    no_persistence: bool = OPTS["no_persistence"],
    engine_option: list[str] = OPTS["engine_option"], engine_user: list[str] = OPTS["engine_user"],
    for_gpus: Optional[list[str]] = OPTS["for_gpus"], kernels: Optional[list[str]] = OPTS["kernels"],
) -> None:
    """Print the steps bootstrap would take, a few lines each (-v: every command and file diff); change nothing."""
    opt = Options.parse(driver=driver, kernel_modules=kernel_modules, driver_source=driver_source, engine=engine,
                        engine_source=engine_source, runtime_name=runtime_name, no_default=no_default, cdi=cdi,
                        replace_runtime=replace_runtime, allow_remove=allow_remove, only=only, mirror=mirror,
                        for_gpus=for_gpus, kernels=kernels, restart_engine=restart_engine,
                        no_persistence=no_persistence, engine_option=engine_option, engine_user=engine_user)
    report, steps = _plan(root, target, opt)
    _print_plan(report, steps, json_out, verbose=verbose, pre=_preflight(report, steps, opt, bool(target)))


def bootstrap_cmd(
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Same as `gpuprov plan`."),
    check: bool = typer.Option(False, "--check", help="Evaluate every step on this host and report what would "
                               "change, with diffs (Ansible's check mode); change nothing."),
    reboot: bool = typer.Option(False, "--reboot", help="Reboot by itself when the driver needs it."),
    json_out: bool = typer.Option(False, "--json"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print every command and all of its output as it "
                                 "runs (without it: a live tail on a terminal; the full output is in the run's "
                                 "log); with --dry-run, every command and file diff of the plan."),
    no_validate: bool = typer.Option(False, "--no-validate", help="Skip the validation container."),
    bundle: Optional[Path] = typer.Option(None, "--bundle", callback=param_rule("bundle"),
                                          help="Install packages from this offline bundle only "
                                          "(verified first; never falls back to the network)."),
    bundle_keyring: Optional[str] = typer.Option(None, "--bundle-keyring", callback=param_rule("bundle_keyring"),
                                                 help="The --bundle's signer key: the "
                                                 "bundle must then be signed by it (exit 8 otherwise)."),
    driver: str = OPTS["driver"], kernel_modules: str = OPTS["kernel_modules"],
    driver_source: str = OPTS["driver_source"], engine: str = OPTS["engine"],
    engine_source: str = OPTS["engine_source"], runtime_name: str = OPTS["runtime_name"],
    no_default: bool = OPTS["no_default"], cdi: bool = OPTS["cdi"], replace_runtime: bool = OPTS["replace_runtime"],
    allow_remove: bool = OPTS["allow_remove"], restart_engine: bool = OPTS["restart_engine"],
    only: Optional[str] = OPTS["only"], mirror: list[str] = OPTS["mirror"],
    no_persistence: bool = OPTS["no_persistence"],
    engine_option: list[str] = OPTS["engine_option"], engine_user: list[str] = OPTS["engine_user"],
    for_gpus: Optional[list[str]] = OPTS["for_gpus"], kernels: Optional[list[str]] = OPTS["kernels"],
    root: Path = typer.Option(Path("/"), "--root", callback=rule("path"),
                              help="With --dry-run or --check: plan or check the host tree "
                              "under ROOT (every read, diff and check through it); applying is for this host only."),
) -> None:
    """Take this host to a GPU container node: driver, engine, runtime, engine config, validation."""
    opt = Options.parse(driver=driver, kernel_modules=kernel_modules, driver_source=driver_source, engine=engine,
                        engine_source=engine_source, runtime_name=runtime_name, no_default=no_default, cdi=cdi,
                        no_validate=no_validate, replace_runtime=replace_runtime, allow_remove=allow_remove,
                        only=only, mirror=mirror, for_gpus=for_gpus, kernels=kernels, restart_engine=restart_engine,
                        no_persistence=no_persistence, engine_option=engine_option, engine_user=engine_user)
    if dry_run or check:  # they only report: no lock, no resume, no write
        _report(opt, root, check=check, json_out=json_out, bundle=bundle, bundle_keyring=bundle_keyring,
                verbose=verbose)
        return
    if not is_live(root):
        raise UsageError(f"--root {root}: bootstrap applies to this host only; use it with --dry-run or --check "
                         "to plan or check a host tree")
    # Held from planning to the end (the prompt included), so the plan shown is the one applied.
    with host_lock("bootstrap"):
        _bootstrap(opt, yes=yes, reboot=reboot, json_out=json_out, bundle=bundle, bundle_keyring=bundle_keyring,
                   verbose=verbose)


def _report(opt, root: Path, *, check: bool, json_out: bool, bundle: Optional[Path],
            bundle_keyring: Optional[str], verbose: bool = False) -> None:
    """--dry-run (the plan) and --check (each step evaluated): what bootstrap would do under `root`, changing
    nothing. The resume after a reboot is said, not done; a bundle is verified as a real run verifies it, a .tar.gz
    in a private temporary directory removed afterwards (see _bundle_repo)."""
    resume = rs.pending(root, plans_driver(opt))
    with _bundle_repo(bundle, bundle_keyring, root) as repo:
        if repo:
            opt = dataclasses.replace(opt, bundle=repo)
        report, steps = _plan(root, None, opt)
        pre = _preflight(report, steps, opt)
        if check:
            _print_check(ap.check_plan(steps, root), json_out, resume, pre)
        else:
            _print_plan(report, steps, json_out, resume, verbose=verbose, pre=pre)


@contextmanager
def _bundle_repo(bundle: Optional[Path], keyring: Optional[str], root: Path) -> Iterator[Optional[str]]:
    """The verified bundle's repository for a plan that only reports. A directory is verified where it is (a real
    run verifies and installs from a private copy of it). A .tar.gz is unpacked (members checked first) into a
    private temporary directory and verified there, as a real run does in /var/lib/gpuprov/bundles; the copy is
    removed afterwards. Either way the plan names the directory a real run keeps its copy in, so that what is
    printed is what runs."""
    if bundle is None:
        yield None
    elif not bundle.is_file():  # verified in place (read-only); a real run installs from its private copy
        checked, _ = check_bundle(bundle, keyring, root)
        yield str(kept_path(extract_base(), checked) / "repo")
    else:
        with tempfile.TemporaryDirectory(prefix="gpuprov-bundle-check-") as scratch:
            checked, _ = check_bundle(bundle, keyring, root, base=Path(scratch))
            yield str(kept_path(extract_base(), checked) / "repo")


def plans_driver(opt) -> bool:
    """The run plans the driver's steps (after the driver's reboot, it verifies the driver first)."""
    return opt.driver != "skip" and "driver" in opt.stages


def _bootstrap(opt, *, yes: bool, reboot: bool, json_out: bool, bundle: Optional[Path],
               bundle_keyring: Optional[str] = None, verbose: bool = False) -> None:
    if bundle is not None:
        checked, _ = check_bundle(bundle, bundle_keyring, private=True)  # installed from a verified private copy
        opt = dataclasses.replace(opt, bundle=str(checked / "repo"))
    rs.resume(plans_driver(opt))
    report, steps = _plan(Path("/"), None, opt)
    # every question that can stop the run, before its first change (and before the prompt: a plan that would stop
    # is not offered); where it could not be asked, the line says so and the run finds out at its step
    pre = _preflight(report, steps, opt)
    if pre.stop:
        raise pre.stop
    if not json_out and (pre.not_asked or pre.asked):
        print(pre.line(), file=sys.stderr)
    if not yes:
        switch = flavour_switch(steps)
        if switch and not sys.stdin.isatty():  # a question before the first change, with its reason
            raise errors.GpuprovError(f"{switch}: nothing changed; see `gpuprov plan`, then run `gpuprov bootstrap "
                                      "--yes` to switch", exit_code=errors.CONFLICT)
        if not sys.stdin.isatty():
            raise errors.UsageError("refusing to change the host without --yes when not on a terminal")
        _print_plan(report, steps, False)
        if not typer.confirm("Apply this plan?"):
            raise errors.Declined("declined at the prompt; nothing was changed")
    missing, res, watch = ap.missing_packages(steps), ap.ApplyResult(), InstallWatch()
    with ap.open_run("bootstrap", json_out=json_out, verbose=verbose) as run:
        try:
            res = ap.apply_plan(steps, run=run, watch=watch)
        except errors.GpuprovError:
            if not json_out:  # the failure's Error line follows: where all of its commands' output is
                print(f"bootstrap: stopped; full log: {run.log.path or 'none (it could not be written)'}",
                      file=sys.stderr)
            raise
        finally:  # what got installed is kept even when a later step fails (uninstall --driver/--engine read it)
            ap.record_installed(steps, missing, res, watch)
    if res.reboot_required:
        rs.reboot_pending(rs.reason_of(steps, res.changed_ids()))
    if json_out:
        emit_json(res.to_dict())
    else:
        print(f"bootstrap: {res.counts()}"
              + ("; REBOOT REQUIRED" if res.reboot_required else "") + f"; {ap.log_named(res)}")
    if res.reboot_required:
        if reboot:
            effects.run(["systemctl", "reboot"])
        raise errors.RebootRequired("reboot to load the NVIDIA driver, then run `gpuprov bootstrap` again to verify")


def _print_check(doc: dict, json_out: bool, resume: Resume | None = None, pre: Preflight | None = None) -> None:
    if resume:
        doc = {**doc, "resume": resume.to_dict()}
    if pre:  # the preflight's stop comes first: the run asks it before its first step
        doc = {**doc, "preflight": pre.to_dict(), "stop": pre.to_dict()["stop"] or doc["stop"]}
    if json_out:
        emit_json(doc)
    else:
        if resume:
            print(f"Before the steps: {resume.bootstrap}")
        for item in doc["steps"]:
            print(f"{'FAIL  ' if item.get('error') else 'CHANGE' if item['would_change'] else 'ok    '}  {item['title']}")
            if item.get("diff"):
                print(item["diff"].rstrip("\n"))
        if pre:
            print(pre.line())
        print(f"{doc['would_change']} step(s) would change" + (", and the run would stop" if doc["stop"] else ""))
    if doc["stop"]:  # the real run's line and exit code, after the report
        raise errors.GpuprovError(doc["stop"]["error"], exit_code=doc["stop"]["exit_code"])


def register(app: typer.Typer) -> None:
    app.command("plan", short_help=summary("plan"))(plan_cmd)
    app.command("bootstrap", short_help=summary("bootstrap"))(bootstrap_cmd)
