"""gpuprov bundle install / bootstrap --bundle: preflight (release, kernel, arch), verify, then the normal plan with
package steps pointed at the bundle's repository alone. Fails closed: no other source is ever configured."""
from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path

from provision.bundle import aptrepo, manifest
from provision.errors import BUNDLE_MISMATCH, GpuprovError

EXTRACT_DIR = Path("/var/lib/gpuprov/bundles")


class BundleMismatch(GpuprovError):
    exit_code = BUNDLE_MISMATCH


def open_bundle(path: Path) -> Path:
    """A bundle directory as is; a .tar.gz is unpacked (member paths checked) under /var/lib/gpuprov/bundles."""
    if path.is_dir():
        return path.resolve()
    if not path.is_file():
        raise manifest.BundleInvalid(f"{path}: no such bundle (a directory or .tar.gz from `gpuprov bundle create`)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    dest = EXTRACT_DIR / digest
    if not (dest / "gpuprov-bundle" / "manifest.json").exists():
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                if m.name.startswith("/") or ".." in m.name.split("/") or m.issym() or m.islnk() or m.isdev():
                    raise manifest.BundleInvalid(f"{path}: unsafe member {m.name!r}; refusing to unpack")
            tar.extractall(dest)
    return dest / "gpuprov-bundle"


def preflight(target: dict, distro, kernel: str | None) -> None:
    want = f"{target['os_id']} {target['version']}"
    have = f"{distro.id} {distro.major}"
    if (target["os_id"], str(target["version"])) != (distro.id, distro.major):
        raise BundleMismatch(f"this bundle is for {target.get('name', want)} ({want}) but this host runs {have}: "
                             f"build one with `gpuprov bundle create --target {distro.id}-{distro.major}`")
    if target.get("arch") not in (None, "amd64") or os.uname().machine != "x86_64":
        raise BundleMismatch(f"this bundle is for {target.get('arch')}, this host is {os.uname().machine}")
    if target.get("kernel") and kernel and target["kernel"] != kernel:
        raise BundleMismatch(f"this bundle's driver parts are for kernel {target['kernel']} but this host runs "
                             f"{kernel}: build it with --kernel {kernel}")


def check_bundle(path: Path, keyring: str | None = None, root: Path = Path("/")) -> tuple[Path, dict]:
    from provision.facts.distro_facts import read_distro
    from provision.facts.driver_facts import kernel_release

    bundle = open_bundle(path)
    try:
        target = json.loads((bundle / "manifest.json").read_text())["target"]
    except (OSError, ValueError, KeyError) as exc:
        raise manifest.BundleInvalid(f"{bundle}: not a gpuprov bundle ({exc})") from None
    preflight(target, read_distro(root), kernel_release(root))
    res = manifest.verify(bundle, keyring)
    if not res.ok:
        raise manifest.BundleInvalid(f"{bundle}: " + "; ".join(res.problems[:5])
                                     + (f" (+{len(res.problems) - 5} more)" if len(res.problems) > 5 else ""))
    available = aptrepo.repo_packages(bundle / "repo")
    missing = [p for pkgs in res.manifest["components"].values() for p in pkgs if p not in available]
    if missing:
        raise manifest.BundleInvalid(f"{', '.join(missing)}: missing from bundle {bundle}; rebuild it with "
                                     "`gpuprov bundle create` (nothing was installed)")
    return bundle, res.manifest
