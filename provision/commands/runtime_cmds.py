"""`gpuprov runtime …`, `gpuprov cdi …`, `gpuprov docker-args`, `gpuprov driver-volume`: the injection side."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from provision import paths
from provision.commands import summary
from provision.errors import CONFIG_INVALID, REQUIREMENT_FAILED, GpuprovError, UsageError
from provision.fsutil import link_or_copy, make_dirs, point_link, publish_dir, write_file
from provision.hostlock import changes_host, host_lock
from provision.inject import devchar
from provision.inject.cdi import generate_spec, render
from provision.inject.discover import write_manifests
from provision.inject.edits import Refused, compute_edits
from provision.inject.mig import describe as describe_mig
from provision.options import rule
from provision.output import emit_json, kv
from provision.plan import runtime as runtime_host

if TYPE_CHECKING:
    from provision.inject.discover import Discovery

runtime_app = typer.Typer(help="The injection runtime (gpuprov-runtime): install, discover.", no_args_is_help=True)
cdi_app = typer.Typer(help="CDI specs for engines that consume CDI natively.", no_args_is_help=True)


def _discover(driver_root: Optional[str], arch: bool = False) -> Discovery:
    return runtime_host.discover_host(driver_root, arch)


@runtime_app.command("install", short_help=summary("runtime install"))
@changes_host("runtime install")
def runtime_install(
    prefix: str = typer.Option("/usr/local", callback=rule("abs_path"),
                               help="Install gpuprov-runtime and the --gpus hook under PREFIX/bin."),
    runc: Optional[str] = typer.Option(None, callback=rule("abs_path"),
                                       help="Low-level runtime to hand over to (default: runc on PATH, else crun)."),
    driver_root: Optional[str] = typer.Option(None, callback=rule("abs_path"),
                                         help="Driver root (default: detected: /, /usr/local/nvidia…)."),
    dev_root: Optional[str] = typer.Option(None, callback=rule("abs_path"),
                                           help="Where the host's /dev lives (tests; default: as set, else /)."),
    proc_root: Optional[str] = typer.Option(None, callback=rule("abs_path"),
                                            help="Where the host's /proc lives (tests; default: as set, else /)."),
    env_unprivileged: Optional[bool] = typer.Option(
        None, "--env-unprivileged/--no-env-unprivileged",
        help="Whether unprivileged containers may pick GPUs with NVIDIA_VISIBLE_DEVICES (off: multi-tenant, as "
             "`gpuprov k8s node` sets it). Default: as set, else on."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Install gpuprov-runtime (the wheel's compiled front-end; else compiled here; else Python) and refresh discovery.
    Every runtime setting not given keeps its value in runtime.json."""
    doc, lines = runtime_host.install(prefix, driver_root=driver_root, runc=runc, dev_root=dev_root,
                                      proc_root=proc_root, accept_env_unprivileged=env_unprivileged)
    if json_out:
        emit_json(doc)
    else:
        print("\n".join(lines))


@runtime_app.command("dev-char-links", short_help=summary("runtime dev-char-links"))
def runtime_dev_char_links(
    dev_root: str = typer.Option("/", callback=rule("abs_path"), help="Where the host's /dev lives (tests)."),
    check: bool = typer.Option(False, "--check", help="Change nothing: list the NVIDIA nodes without a link "
                               "(exit 10 when one has none)."),
    quiet: bool = typer.Option(False, "--quiet", help="Print nothing (the boot unit and udev rule run it)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Make /dev/char/MAJ:MIN links for NVIDIA's device nodes (as udev does for the devices it knows), so that
    containers under the systemd cgroup driver keep their GPU across `systemctl daemon-reload`."""
    try:
        res = devchar.check_links(dev_root) if check else devchar.link_nodes(dev_root)
    except devchar.DevCharRefused as exc:
        raise GpuprovError(exc.strerror or str(exc), exit_code=CONFIG_INVALID) from None
    if json_out:
        emit_json(res.to_dict())
    elif not quiet:
        for word, items in (("made", res.made), ("ok", res.ok), ("missing", res.missing),
                            ("taken by something else (left alone)", res.other)):
            if items:
                print(f"{word}: {', '.join(items)}")
    if check and res.missing:
        raise GpuprovError(f"{len(res.missing)} NVIDIA device nodes have no /dev/char link (GPU containers lose "
                           "them at `systemctl daemon-reload`): run `gpuprov runtime dev-char-links`",
                           exit_code=REQUIREMENT_FAILED)


@runtime_app.command("discover", short_help=summary("runtime discover"))
def runtime_discover(driver_root: Optional[str] = typer.Option(None), json_out: bool = typer.Option(False, "--json")):
    """What the runtime would inject: driver version, libraries per capability, binaries, nodes, GPUs (with the
    compute capability the driver reports, which NVIDIA_REQUIRE_ARCH is checked against)."""
    disc = _discover(driver_root, arch=True)
    if json_out:
        emit_json(disc.to_dict())
        return
    print(kv([("driver", disc.version), ("driver root", disc.driver_root),
              ("gpus", ", ".join(f"{g.index}:{g.bus_id} {g.uuid} arch {g.arch or 'unknown'}" for g in disc.gpus)
               or "none"),
              ("nodes", " ".join(n.path for n in disc.nodes.present())),
              *((("mig", describe_mig(disc.mig.devices)),) if disc.mig is not None else ()),
              *((f"libs {c}", " ".join(x.soname for x in v)) for c, v in disc.libraries.items())]))


@cdi_app.command("generate", short_help=summary("cdi generate"))
def cdi_generate(
    driver_root: Optional[str] = typer.Option(None, callback=rule("abs_path"), help="Driver root (default: detected)."),
    output: Optional[Path] = typer.Option(None, callback=rule("path"),
                                          help="Write here (default: stdout), e.g. /etc/cdi/nvidia.yaml."),
    fmt: str = typer.Option("yaml", "--format", metavar="yaml|json", help="yaml | json"),
) -> None:
    """Write a CDI spec (kind nvidia.com/gpu; devices by index, UUID and `all`; every capability's files)."""
    if fmt not in ("yaml", "json"):
        raise UsageError("--format must be yaml or json")
    disc = _discover(driver_root)
    try:
        disc = write_manifests(disc)
    except OSError as exc:  # not root: manifests that need a rewritten copy are left out of the spec
        print(f"warning: {exc}; loader manifests naming absolute paths are left out", file=sys.stderr)
    spec = generate_spec(disc)
    text = render(spec, fmt)
    if output is None:
        print(text, end="")
    else:
        with host_lock("cdi generate"):
            write_file(output, text, mode=0o644, backup=False)
        print(f"wrote {output} ({len(spec['devices'])} devices)", file=sys.stderr)


@cdi_app.command("refresh", short_help=summary("cdi refresh"))
def cdi_refresh(
    driver_root: Optional[str] = typer.Option(None, callback=rule("abs_path"), help="Driver root (default: detected)."),
    spec_dirs: str = typer.Option("/etc/cdi:/var/run/cdi", callback=rule("abs_paths"),
                                  help="Colon-separated directories to write nvidia.yaml in."),
    install_units: bool = typer.Option(False, "--install-units",
                                       help="Also install and enable gpuprov-cdi-refresh.{service,path} (systemd)."),
) -> None:
    """Write the CDI spec where engines read it; rewrites only when the driver changed. Run at boot and on driver
    changes by the gpuprov-cdi-refresh systemd units (--install-units)."""
    with host_lock("cdi refresh"):
        done = runtime_host.refresh_cdi(driver_root, tuple(d for d in spec_dirs.split(":") if d), install_units)
    print("\n".join(done), file=sys.stderr)


@cdi_app.command("list", short_help=summary("cdi list"))
def cdi_list(spec_dirs: str = typer.Option("/etc/cdi:/var/run/cdi", callback=rule("abs_paths"),
                                           help="Colon-separated CDI spec directories.")):
    """List the qualified CDI device names found in the spec directories."""
    import yaml  # lazy: 11 ms at start-up (-X importtime, min of 15); bootstrap loads this module, only `cdi list` reads YAML

    for d in spec_dirs.split(":"):
        for p in sorted(Path(d).glob("*")) if Path(d).is_dir() else []:
            if p.suffix not in (".json", ".yaml", ".yml"):
                continue
            spec = yaml.safe_load(p.read_text())
            for dev in spec.get("devices", []):
                print(f"{spec['kind']}={dev['name']}")


def docker_args(
    gpus: str = typer.Option("all", "--gpus", help="all, or a comma list of indices/UUIDs."),
    capabilities: str = typer.Option("utility,compute", help="NVIDIA_DRIVER_CAPABILITIES to serve."),
    driver_root: Optional[str] = typer.Option(None, callback=rule("abs_path")),
) -> None:
    """Print --device/--volume flags for a plain `docker run` (nvidia-docker 1.0 style, no runtime needed)."""
    try:
        e = compute_edits(_discover(driver_root), {"NVIDIA_VISIBLE_DEVICES": gpus,
                                                   "NVIDIA_DRIVER_CAPABILITIES": capabilities})
    except Refused as exc:
        raise GpuprovError(str(exc), exit_code=REQUIREMENT_FAILED) from None
    flags = [f"--device={d.path}" for d in e.devices]
    flags += [f"--volume={m.source}:{m.destination}:ro" for m in e.mounts]
    flags += [f"--env={v.name}={v.value}" for v in e.env]
    print(" ".join(flags))


@changes_host("driver-volume")
def driver_volume(
    base: Path = typer.Option(Path(paths.DRIVER_VOLUMES), callback=rule("abs_path"),
                              help="Where versioned copies and `current` live."),
    driver_root: Optional[str] = typer.Option(None, callback=rule("abs_path")),
) -> None:
    """Keep BASE/current -> BASE/<version> (bin/, lib64/ at SONAMEs): mount BASE/current, survive upgrades."""
    disc = _discover(driver_root)
    version = disc.version or ""  # _discover refused a root without a driver

    def fill(tmp: Path) -> None:
        make_dirs(tmp / "bin", 0o755)  # explicit modes, whatever the umask
        make_dirs(tmp / "lib64", 0o755)
        for libs in disc.libraries.values():
            for lib in libs:
                link_or_copy(lib.path, tmp / "lib64" / lib.soname)  # a library of two capabilities: kept once
        for libs in disc.libraries32.values():
            for lib in libs:
                link_or_copy(lib.path, tmp / "lib32" / lib.soname)
        for bins in disc.binaries.values():
            for b in bins:
                link_or_copy(b, tmp / "bin" / os.path.basename(b))
        for man in disc.manifests:  # share/vulkan/icd.d/… : mount share/ at /usr/share for graphics
            if not man.rewrite:
                link_or_copy(man.path, tmp / man.container_path.lstrip("/").replace("usr/", "", 1))

    publish_dir(base / version, fill)
    cur = base / "current"
    point_link(cur, version)  # atomic switch: running manifests keep a valid path
    print(f"{cur} -> {version}  (docker run -v {cur}:/usr/local/nvidia:ro …)")


def register(app: typer.Typer) -> None:
    app.add_typer(runtime_app, name="runtime", short_help=summary("runtime"))
    app.add_typer(cdi_app, name="cdi", short_help=summary("cdi"))
    app.command("docker-args", short_help=summary("docker-args"))(docker_args)
    app.command("driver-volume", short_help=summary("driver-volume"))(driver_volume)
