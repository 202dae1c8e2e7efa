"""`gpuprov detect`: the host's facts and the driver each GPU needs.

The hot command: this module loads no typer. `run` is the command's body; provision/cli.py's fast path calls it with
the arguments it parsed from FAST_OPTIONS, and `register` declares the same options to typer for everything else
(--help, usage errors): tests/unit/test_fast_path.py holds the two to each other."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from provision.commands import summary
from provision.decide.gputable import parse_pci_id
from provision.decide.targets import parse_target
from provision.errors import HostUnreadable
from provision.facts.rootfs import is_live
from provision.options import CHOICES, check_choice, rule
from provision.output import emit_json, kv, table
from provision.probe.engines import with_versions
from provision.report import detect_host, detect_ids

MODULE_CHOICES = CHOICES["kernel_modules"]
SOURCE_CHOICES = CHOICES["driver_source"]


def render_human(report) -> str:
    out = []
    if report.distro:
        d = report.distro
        out.append(kv([
            ("distro", f"{d.pretty_name} ({d.id} {d.version}, family {d.family}, {d.package_manager})"),
            ("target", report.target.name if report.target else "unsupported"),
        ]))
    elif report.target:  # --pci-id: no host scanned, but packages decided for this release
        out.append(kv([("target", report.target.name)]))
    if report.driver:
        drv = report.driver
        out.append(kv([
            ("driver", f"{drv.version} ({drv.kernel_module} kernel module)" if drv.loaded else "not loaded"),
            ("driver root", drv.driver_root or "not found"),
            ("userspace", drv.userspace_version),
            ("nouveau", "loaded" if drv.nouveau_loaded else "not loaded"),
            ("kernel", f"{drv.kernel_release} (headers {'present' if drv.kernel_headers else 'missing'})"),
            ("next boot", f"{drv.next_boot_kernel} ({drv.next_boot_from}): NVIDIA module "
                          f"{drv.next_boot_module or 'missing'}" if drv.next_boot_kernel else "no installed kernel"),
            ("secure boot", {True: "on", False: "off", None: "no EFI"}[drv.secure_boot]),
        ]))
    if report.gpus:
        rows = []
        for dev, dec in report.gpus:
            rows.append([dev.address if dev else "", dec.pci_id + (":" + dec.subsystem if dec.subsystem else ""),
                         dec.name, dec.branch, dec.kernel_modules, (dev.driver if dev else None),
                         " ".join(dec.packages)])
        out.append(table(["ADDRESS", "PCI ID", "NAME", "DRIVER SERIES", "MODULES", "BOUND", "PACKAGES"], rows))
    else:
        out.append("gpus         none (no NVIDIA display-class device on the PCI bus)")
    if report.other_display:
        out.append("other display: " + ", ".join(f"{d.address} {d.pci_id}" for d in report.other_display))
    if report.engines:
        out.append(table(["ENGINE", "BINARY", "VERSION", "FROM", "CONFIG", "RUNTIMES"], [
            [e.name, e.binary, e.version, e.origin.describe() if e.origin else "config only",
             f"{e.config_path} ({'ok' if e.config_valid else 'INVALID' if e.config_valid is False else 'absent'})",
             ",".join(e.runtimes)] for e in report.engines]))
    if report.fleet:
        f = report.fleet
        out.append(f"single branch for all GPUs: {f.common_branch or 'none'}"
                   + (f" ({f.common_modules} modules)" if f.common_modules else ""))
        out.extend(f"note: {n}" for n in f.notes)
    doc = report.to_dict()
    out.extend(f"warning: {w}" for w in doc["warnings"])
    return "\n".join(out)


# option -> (parameter, how click takes it, provision.values rule): provision.cli.fast_args
FAST_OPTIONS = {
    "--root": ("root", "path", "path"),
    "--json": ("json_out", "flag", None),
    "--pci-id": ("pci_id", "list", "pci_id"),
    "--target": ("target", "text", None),
    "--kernel-modules": ("kernel_modules", "text", None),
    "--driver-source": ("driver_source", "text", None),
}


def run(root: Path = Path("/"), json_out: bool = False, pci_id: Optional[List[str]] = None, target: Optional[str] = None,
        kernel_modules: str = "auto", driver_source: Optional[str] = "distro") -> None:
    """Read-only facts: distro, NVIDIA GPUs and the driver each needs, driver state, container engines."""
    check_choice(kernel_modules, MODULE_CHOICES, "--kernel-modules")
    if driver_source is not None:
        check_choice(driver_source, SOURCE_CHOICES, "--driver-source")
        driver_source = None if driver_source == "distro" else driver_source
    tgt = parse_target(target) if target else None
    if pci_id:
        ids = [parse_pci_id(p) for p in pci_id]
        report = detect_ids(ids, tgt, kernel_modules=kernel_modules, source=driver_source, root=root)
    else:
        if not root.is_dir():
            raise HostUnreadable(f"--root {root} is not a directory")
        report = detect_host(root, target=tgt, kernel_modules=kernel_modules, source=driver_source)
        if is_live(root):  # versions take running each engine binary: the probe layer, live host only
            report = report._replace(engines=with_versions(report.engines))
    if json_out:
        emit_json(report.to_dict())
    else:
        print(render_human(report))


def register(app) -> None:
    import typer  # lazy: 0 ms here, typer loaded `app`; at the top it would cost the fast path 38 ms (-X importtime)

    def detect(
        root: Path = typer.Option(Path("/"), "--root", callback=rule("path"),
                                  help="Read the host through this root (a fixture tree works)."),
        json_out: bool = typer.Option(False, "--json", help="Print the documented JSON schema (gpuprov.detect/v1)."),
        pci_id: Optional[List[str]] = typer.Option(None, "--pci-id", callback=rule("pci_id"),
                                                   help="Decide for VENDOR:DEVICE[:SUBVENDOR:SUBDEVICE] without "
                                                   "scanning the host (repeatable), like nvidia-detect's argument."),
        target: Optional[str] = typer.Option(None, "--target", help="Release to decide packages for, e.g. debian-12, "
                                             "ubuntu-24.04, rocky-9 (default: the host's own)."),
        kernel_modules: str = typer.Option("auto", "--kernel-modules", help="auto|open|proprietary"),
        driver_source: str = typer.Option("distro", "--driver-source", help="distro | elrepo | nvidia (distro: "
                                          "Debian's or Ubuntu's own packages, ELRepo on EL; NVIDIA's "
                                          "repository on Amazon Linux 2023 and Alibaba Cloud Linux 3)"),
    ) -> None:
        """Read-only facts: distro, NVIDIA GPUs and the driver each needs, driver state, container engines."""
        run(root, json_out, pci_id, target, kernel_modules, driver_source)

    app.command("detect", short_help=summary("detect"))(detect)
