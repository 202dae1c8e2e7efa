"""`gpuprov plan` and `gpuprov bootstrap`: the main job, planned first, applied idempotently."""
from __future__ import annotations

import dataclasses
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import typer

from provision import effects, errors
from provision.bundle.install import check_bundle
from provision.commands import summary
from provision.commands.detect import check_choice
from provision.decide.gputable import parse_pci_id
from provision.decide.targets import parse_target
from provision.errors import NoDeviceToVerify, StepFailed, UsageError
from provision.facts.pci import scan_display_devices
from provision.hostlock import host_lock
from provision.options import CHOICES, Mirror, Stage, values
from provision.output import emit_json
from provision.plan import apply as ap
from provision.plan.build import Options, build_plan
from provision.report import detect_host
from provision.verify.checks import LocalHost, driver_loaded, versions_coherent

# Deferred inside the commands (measured with `python -X importtime`, on top of what `gpuprov detect` already
# loads, since cli imports every command module at start-up): plan.build +38 ms, plan.apply +19 ms, bundle.install
# +20 ms, verify.checks +17 ms; `gpuprov detect` must start within 150 ms (bench/detect_bench.py).


def _parse_mirrors(mirror: list[str]) -> dict[str, str]:

    out = {}
    for item in mirror:
        name, sep, url = item.partition("=")
        if not sep or name not in values(Mirror) or "://" not in url:
            raise UsageError(f"--mirror {item!r}: use NAME=URL with NAME one of {', '.join(values(Mirror))} "
                             "(e.g. docker-ce=https://mirror.example/docker-ce/linux)")
        out[name] = url
    return out


def _parse_stages(only: Optional[str]) -> tuple[str, ...]:

    if only is None:
        return values(Stage)
    stages = tuple(s.strip() for s in only.split(",") if s.strip())
    bad = [s for s in stages if s not in values(Stage)]
    if bad or not stages:
        raise UsageError(f"--only {only!r}: a comma list of {', '.join(values(Stage))}")
    return stages


def _options(driver, kernel_modules, driver_source, engine, engine_source, runtime_name, no_default, cdi, validate,
             replace_runtime=False, only=None, mirror=(), for_gpus=None, kernels=None):
    check_choice(kernel_modules, CHOICES["kernel_modules"], "--kernel-modules")
    check_choice(driver_source, CHOICES["driver_source"], "--driver-source")
    check_choice(engine, CHOICES["engine"], "--engine")
    check_choice(engine_source, CHOICES["engine_source"], "--engine-source")
    if driver not in ("auto", "skip") and not driver.isdigit():
        raise UsageError(f"--driver {driver!r}: use auto, skip or a driver branch such as 535")

    for p in for_gpus or ():
        parse_pci_id(p)  # a malformed id is a usage error before anything is planned
    return Options(driver=driver, kernel_modules=kernel_modules, driver_source=driver_source, engine=engine,
                   engine_source=engine_source, runtime_name=runtime_name, default_runtime=not no_default, cdi=cdi,
                   validate=validate, replace_runtime=replace_runtime, stages=_parse_stages(only),
                   mirrors=_parse_mirrors(list(mirror or ())), for_gpus=tuple(for_gpus or ()),
                   kernels=tuple(kernels or ()))


def _plan(root: Path, target: Optional[str], opt):
    src = None if opt.driver_source == "distro" else opt.driver_source
    pin = opt.driver if opt.driver.isdigit() else None
    report = detect_host(root, target=parse_target(target) if target else None, kernel_modules=opt.kernel_modules,
                         source=src, engines=False, pin=pin, for_gpus=opt.for_gpus)
    return report, build_plan(report, opt)


def _print_plan(report, steps, json_out: bool) -> None:
    """The plan as it will run: each step's commands (shell-quoted, paste-able), its file diffs against the host
    under the plan's root, and the check that skips it."""
    root = Path(report.root or "/")
    doc = {"schema": "gpuprov.plan/v1", "root": str(root), "target": report.target.name if report.target else None,
           "steps": [s.to_dict(root) for s in steps]}
    if json_out:
        emit_json(doc)
        return
    print(f"Plan for {report.target.name} ({len(steps)} steps):")
    for i, s in enumerate(doc["steps"], 1):
        print(f"{i:2}. {s['title']}{'  [reboot]' if s['reboot'] else ''}  ({s['check']})")
        for line in s["actions"]:
            print(f"      {line}")
        for p, diff in s["diffs"].items():
            print(diff.rstrip("\n") if diff else f"      (file {p} unchanged)")


OPTS = dict(
    driver=typer.Option("auto", "--driver", help="auto | skip | a driver branch (535, 470, ...): refused where "
                        "that branch does not drive the GPU or the target does not package it"),
    for_gpus=typer.Option(None, "--for-gpu", help="Image baking: decide as if this GPU (VENDOR:DEVICE[:SUB:SUB]) "
                          "were present; repeat for several. The module is built for every installed kernel."),
    kernels=typer.Option(None, "--kernel", help="Build the driver for this installed kernel (repeatable); "
                         "default: the kernel that boots next (every installed kernel with --for-gpu)."),
    kernel_modules=typer.Option("auto", "--kernel-modules", help=" | ".join(CHOICES["kernel_modules"])),
    driver_source=typer.Option("distro", "--driver-source", help=" | ".join(CHOICES["driver_source"])),
    engine=typer.Option("docker", "--engine", help=" | ".join(CHOICES["engine"])),
    engine_source=typer.Option("auto", "--engine-source", help=" | ".join(CHOICES["engine_source"]) + " (auto: the distro's "
                               "docker.io on Debian/Ubuntu, docker-ce on EL)"),
    runtime_name=typer.Option("nvidia", "--runtime-name"),
    no_default=typer.Option(False, "--no-default-runtime", help="Register the runtime without making it default "
                            "(then --gpus needs --runtime nvidia)."),
    cdi=typer.Option(False, "--cdi", help="Enable CDI in the engine."),
    replace_runtime=typer.Option(False, "--replace-runtime", help="Replace your own runtime of that name (its "
                                 "runtimeArgs are dropped) or your default-runtime (without it: exit 14, nothing "
                                 "changed)."),
    only=typer.Option(None, "--only", help="Only these stages, a comma list of driver, engine, runtime, validate "
                      "(the fleet role's tags)."),
    mirror=typer.Option([], "--mirror", help="NAME=URL: fetch repository NAME (elrepo, epel, cuda, docker-ce) from "
                        "a mirror of the same tree; repeatable."),
)


def plan_cmd(
    root: Path = typer.Option(Path("/"), "--root", help="Plan for the host tree under ROOT (fixtures)."),
    target: Optional[str] = typer.Option(None, "--target"),
    json_out: bool = typer.Option(False, "--json"),
    driver: str = OPTS["driver"], kernel_modules: str = OPTS["kernel_modules"],
    driver_source: str = OPTS["driver_source"], engine: str = OPTS["engine"],
    engine_source: str = OPTS["engine_source"], runtime_name: str = OPTS["runtime_name"],
    no_default: bool = OPTS["no_default"], cdi: bool = OPTS["cdi"], replace_runtime: bool = OPTS["replace_runtime"],
    only: Optional[str] = OPTS["only"], mirror: list[str] = OPTS["mirror"],
    for_gpus: Optional[list[str]] = OPTS["for_gpus"], kernels: Optional[list[str]] = OPTS["kernels"],
) -> None:
    """Print every command and file diff bootstrap would run; change nothing."""
    opt = _options(driver, kernel_modules, driver_source, engine, engine_source, runtime_name, no_default, cdi, True,
                   replace_runtime, only, mirror, for_gpus, kernels)
    report, steps = _plan(root, target, opt)
    _print_plan(report, steps, json_out)


def bootstrap_cmd(
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Same as `gpuprov plan`."),
    check: bool = typer.Option(False, "--check", help="Evaluate every step on this host and report what would "
                               "change, with diffs (Ansible's check mode); change nothing."),
    reboot: bool = typer.Option(False, "--reboot", help="Reboot by itself when the driver needs it."),
    json_out: bool = typer.Option(False, "--json"),
    no_validate: bool = typer.Option(False, "--no-validate", help="Skip the validation container."),
    bundle: Optional[Path] = typer.Option(None, "--bundle", help="Install packages from this offline bundle only "
                                          "(verified first; never falls back to the network)."),
    bundle_keyring: Optional[str] = typer.Option(None, "--bundle-keyring", help="The --bundle's signer key: the "
                                                 "bundle must then be signed by it (exit 8 otherwise)."),
    driver: str = OPTS["driver"], kernel_modules: str = OPTS["kernel_modules"],
    driver_source: str = OPTS["driver_source"], engine: str = OPTS["engine"],
    engine_source: str = OPTS["engine_source"], runtime_name: str = OPTS["runtime_name"],
    no_default: bool = OPTS["no_default"], cdi: bool = OPTS["cdi"], replace_runtime: bool = OPTS["replace_runtime"],
    only: Optional[str] = OPTS["only"], mirror: list[str] = OPTS["mirror"],
    for_gpus: Optional[list[str]] = OPTS["for_gpus"], kernels: Optional[list[str]] = OPTS["kernels"],
) -> None:
    """Take this host to a GPU container node: driver, engine, runtime, engine config, validation."""

    opt = _options(driver, kernel_modules, driver_source, engine, engine_source, runtime_name, no_default, cdi,
                   not no_validate, replace_runtime, only, mirror, for_gpus, kernels)
    # Held from planning to the end (the prompt included), so the plan shown is the one applied.
    with nullcontext() if dry_run or check else host_lock("bootstrap"):
        _bootstrap(opt, yes=yes, dry_run=dry_run, check=check, reboot=reboot, json_out=json_out, bundle=bundle,
                   bundle_keyring=bundle_keyring)


def _bootstrap(opt, *, yes: bool, dry_run: bool, check: bool, reboot: bool, json_out: bool,
               bundle: Optional[Path], bundle_keyring: Optional[str] = None) -> None:
    if bundle is not None:
        checked, _ = check_bundle(bundle, bundle_keyring)
        opt = dataclasses.replace(opt, bundle=str(checked / "repo"))
    _resume_after_reboot(ap)
    report, steps = _plan(Path("/"), None, opt)
    if dry_run:
        _print_plan(report, steps, json_out)
        return
    if check:
        _print_check(ap.check_plan(steps), json_out)
        return
    if not yes:
        if not sys.stdin.isatty():
            raise errors.UsageError("refusing to change the host without --yes when not on a terminal")
        _print_plan(report, steps, False)
        if not typer.confirm("Apply this plan?"):
            raise errors.Declined("declined at the prompt; nothing was changed")
    res = ap.apply_plan(steps, quiet=json_out)
    if res.reboot_required:
        changed = {o.id for o in res.outcomes if o.status == "changed"}
        reasons = [n.removeprefix("reboot: ") for s in steps if s.reboot and s.id in changed for n in s.notes
                   if n.startswith("reboot: ")]
        ap.write_state(ap.pending_reboot("; ".join(reasons) or "driver installed / nouveau blacklisted"))
    if json_out:
        emit_json(res.to_dict())
    else:
        print(f"bootstrap: {res.changed} change(s), {len(res.outcomes)} steps"
              + ("; REBOOT REQUIRED" if res.reboot_required else ""))
    if res.reboot_required:
        if reboot:
            effects.run(["systemctl", "reboot"])
        raise errors.RebootRequired("reboot to load the NVIDIA driver, then run `gpuprov bootstrap` again to verify")


def _resume_after_reboot(ap) -> None:
    """A run that asked for a reboot: refuse until the host rebooted, then check the driver it installed."""
    state = ap.read_state()
    if not state.get("reboot_required"):
        return
    if not ap.rebooted_since(state):
        raise errors.RebootRequired(f"a reboot is still pending ({state.get('reason')}): reboot, then run "
                                    "gpuprov bootstrap again")
    ap.write_state({**state, "reboot_required": False, "resumed_after_reboot": True})
    _verify_after_reboot(state)


def _print_check(doc: dict, json_out: bool) -> None:
    if json_out:
        emit_json(doc)
        return
    for item in doc["steps"]:
        print(f"{'CHANGE' if item['would_change'] else 'ok    '}  {item['title']}")
        if item.get("diff"):
            print(item["diff"].rstrip("\n"))
    print(f"{doc['would_change']} step(s) would change")


def _verify_after_reboot(state: dict) -> None:
    """Resuming after the driver's reboot: the module must be loaded, match the userspace, and nvidia-smi answer.
    Without an NVIDIA device (a baked image, a VM without its GPU) there is nothing to load it on: say so (exit
    15) rather than fail on the module that cannot load."""
    if not any(d.is_nvidia for d in scan_display_devices(Path("/"))):
        raise NoDeviceToVerify(f"resumed after the reboot ({state.get('reason')}): the driver is installed, but "
                               "this host has no NVIDIA device to load and verify it on; boot the image on a GPU "
                               "node and run `gpuprov bootstrap` (or `gpuprov verify`) there")
    h = LocalHost()
    for check in (driver_loaded, versions_coherent):
        r = check(h)
        if r.status == "fail":
            raise StepFailed(f"after the reboot: {r.name}: {r.detail}")
    if (h.facts or {}).get("gpus"):
        root = ((h.facts or {}).get("driver") or {}).get("driver_root") or "/"
        smi = effects.which("nvidia-smi") or f"{root.rstrip('/')}/bin/nvidia-smi"
        effects.run([smi, "-L"])


def register(app: typer.Typer) -> None:
    app.command("plan", short_help=summary("plan"))(plan_cmd)
    app.command("bootstrap", short_help=summary("bootstrap"))(bootstrap_cmd)
