"""`gpuprov bundle create | verify | install | plan`: air-gapped hosts."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from provision import engines, package_managers, paths
from provision.bundle.create import BUNDLE_REPO, COMPONENTS, CreateOptions, create
from provision.bundle.install import check_bundle, open_verified
from provision.commands import summary
from provision.decide.driver import decide_gpu
from provision.decide.gputable import parse_pci_id
from provision.decide.targets import parse_target
from provision.errors import BundleInvalid, UsageError
from provision.hostlock import changes_host
from provision.options import rule
from provision.output import emit_json, kv
from provision.plan import apply as ap
from provision.plan import persistence
from provision.plan.build import build_plan
from provision.plan.options import Options
from provision.report import detect_host

KEYRING_HELP = ("The signer's key (`gpg --export KEY > FILE`): the bundle must then be signed by it, a missing "
                "SHA256SUMS.sig is refused (exit 8).")
bundle_app = typer.Typer(help="Offline bundles: create (connected machine), verify, install (network off), plan (EL).",
                         no_args_is_help=True)


@bundle_app.command("create", short_help=summary("bundle create"))
def create_cmd(
    target: str = typer.Option(..., "--target", metavar="RELEASE", help="Release to build for, e.g. debian-12."),
    components: str = typer.Option("engine,runtime", "--components", metavar="COMPONENT,COMPONENT",
                                   help="Comma list of driver,engine,runtime."),
    output: Path = typer.Option(..., "--output", callback=rule("path"), help="A new directory, or FILE.tar.gz."),
    pci_id: Optional[List[str]] = typer.Option(None, "--pci-id", "--for-gpu", callback=rule("pci_id"),
                                               help="GPUs the target has (for the driver); as bootstrap --for-gpu."),
    kernel: Optional[str] = typer.Option(None, "--kernel", callback=rule("kernel_release"),
                                         help="The target's `uname -r` (driver: headers)."),
    driver: str = typer.Option("auto", "--driver", callback=rule("driver"),
                               help="auto or a driver branch (535): as bootstrap --driver."),
    sign_key: Optional[str] = typer.Option(None, "--sign-key", callback=rule("gpg_key"), help="gpg key to sign SHA256SUMS with."),
    resume: bool = typer.Option(False, "--resume", help="Work in OUTPUT.partial and keep it when the create fails, "
                                "then go on from it when the same command is run again with --resume (what was "
                                "downloaded is not downloaded again); OUTPUT appears only when complete. Without "
                                "it a failed create removes what it wrote."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Resolve the full closure in a clean root of TARGET, download it, build a local repo, write the manifest."""
    comps = tuple(c.strip() for c in components.split(",") if c.strip())
    bad = [c for c in comps if c not in COMPONENTS]
    if bad or not comps:
        raise UsageError(f"--components takes {','.join(COMPONENTS)} (got {components!r})")
    tgt = parse_target(target)
    drv: list[str] = []
    decided = []
    if driver != "auto" and not driver.isdigit():
        raise UsageError(f"--driver {driver!r}: use auto or a driver branch such as 535")
    for p in pci_id or []:
        d = decide_gpu(parse_pci_id(p), tgt, pin=driver if driver.isdigit() else None)
        if not d.packages:
            raise UsageError(f"no driver package for {p} on {tgt.name}: {'; '.join(d.warnings)}")
        drv += [x for x in d.packages if x not in drv]
        decided.append(d)
    if persistence.datacenter(decided):  # bootstrap installs it with the driver there (plan/persistence.py)
        drv += [x for x in persistence.package(tgt, "distro") if x not in drv]
    res = create(CreateOptions(tgt, comps, output, tuple(drv), kernel, sign_key, resume=resume))
    if json_out:
        emit_json(res)
    else:
        print(kv([("bundle", res["output"]), ("target", res["target"]["name"]), ("packages", res["packages"]),
                  ("size", f"{res['bytes'] / 1e6:.1f} MB"), ("built in", f"{res['seconds']} s"),
                  ("signed", res["signed"])]))


@bundle_app.command("verify", short_help=summary("bundle verify"))
def verify_cmd(path: Path = typer.Argument(..., callback=rule("path")),
               keyring: Optional[str] = typer.Option(None, "--keyring", callback=rule("path"), help=KEYRING_HELP),
               json_out: bool = typer.Option(False, "--json")) -> None:
    """Checksums, signature (required with --keyring), SHA256SUMS naming every file exactly once, manifest.
    Exit 8 when anything fails; a .tar.gz is unpacked into a private directory that is removed afterwards."""
    try:
        opened = open_verified(path, keyring)
    except BundleInvalid as exc:
        if json_out:
            emit_json({"ok": False, "signed": False, "problems": getattr(exc, "problems", [str(exc)])})
        raise
    opened.discard()
    res = opened.result
    if json_out:
        emit_json(res.to_dict())
    else:
        print(f"bundle OK: {len(res.manifest['files'])} files, target {res.manifest['target']['name']}"
              + (", signature good" if res.signed else ", unsigned"))


@bundle_app.command("install", short_help=summary("bundle install"))
@changes_host("bundle install")
def install_cmd(
    path: Path = typer.Argument(..., callback=rule("path"), help="Bundle directory or .tar.gz."),
    keyring: Optional[str] = typer.Option(None, "--keyring", callback=rule("path"), help=KEYRING_HELP),
    json_out: bool = typer.Option(False, "--json"),
    no_validate: bool = typer.Option(False, "--no-validate"),
) -> None:
    """Preflight, verify, then install from the bundle alone (never from the network) and configure the node."""
    bundle, man = check_bundle(path, keyring, private=True)  # installed from a verified private copy
    comps = man["components"]
    opt = Options(driver="auto" if "driver" in comps else "skip", engine="docker" if "engine" in comps else "none",
                  validate=not no_validate, bundle=str(bundle / "repo"))
    report = detect_host(Path("/"), engines=False)
    with ap.open_run("bundle-install", json_out=json_out) as run:
        res = ap.apply_plan(build_plan(report, opt), run=run)
    doc = {"bundle": str(bundle), "target": man["target"]["name"], **res.to_dict()}
    if json_out:
        emit_json(doc)
    else:
        print(f"bundle install: {res.counts()}, from {bundle} only; "
              f"{ap.log_named(res)}")


@bundle_app.command("plan", short_help=summary("bundle plan"))
def plan_cmd(target: str = typer.Option(..., "--target", metavar="RELEASE", help="The release the bundle is for, "
                                         "e.g. debian-12, rocky-9."),
             packages: Optional[str] = typer.Option(None, "--packages", metavar="PKG,PKG", callback=rule("packages"),
                                                    help="The packages to bundle (default: the engine packages "
                                                    "bootstrap installs on TARGET: docker.io on Debian/Ubuntu, "
                                                    "docker-ce on EL)."),
             json_out: bool = typer.Option(False, "--json")) -> None:
    """The commands a bundle for TARGET is built and installed with (the EL path: dnf download + createrepo_c)."""
    t = parse_target(target)
    if packages is None:  # what bootstrap's default --engine-source auto installs there, from the one adapter
        docker = engines.get("docker")
        pk = list(docker.packages(t, docker.default_source(t)))
    else:
        pk = [p for p in packages.split(",") if p]
    pm = package_managers.get(t.package_manager)  # the same adapter a bundle's build and install use
    build = pm.download(tuple(pk), BUNDLE_REPO, t.el_major)
    install = [pm.install(tuple(pk), pm.bundle_options(Path("/path/to/bundle/repo"), Path(paths.BUNDLE_APT)))]
    doc = {"target": t.name, "build": [" ".join(c) for c in build], "install": [" ".join(c) for c in install]}
    if json_out:
        emit_json(doc)
    else:
        print("build (in a clean container of the target):")
        print("\n".join(f"  $ {c}" for c in doc["build"]))
        print("install (network off):")
        print("\n".join(f"  $ {c}" for c in doc["install"]))


def register(app: typer.Typer) -> None:
    app.add_typer(bundle_app, name="bundle", short_help=summary("bundle"))
