"""gpuprov bundle install / bootstrap --bundle: preflight (release, kernel, arch), verify, then the normal plan with
package steps pointed at the bundle's repository alone. Fails closed: no other source is ever configured."""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from provision import paths
from provision.bundle import aptrepo, manifest
from provision.bundle.unpack import TOP, copy_dir, unpack
from provision.errors import BundleInvalid, BundleMismatch
from provision.facts.distro_facts import read_distro
from provision.facts.driver_facts import kernel_release


def extract_base() -> Path:
    """Where .tar.gz bundles are unpacked: a root-only directory (GPUPROV_BUNDLE_DIR overrides it; a user who is
    not root gets a private directory in the temporary directory)."""
    if os.environ.get("GPUPROV_BUNDLE_DIR"):
        return Path(os.environ["GPUPROV_BUNDLE_DIR"])
    if os.geteuid() == 0:
        return Path(paths.BUNDLES)
    return Path(tempfile.gettempdir()) / f"gpuprov-bundles-{os.geteuid()}"


@dataclass
class OpenBundle:
    """A verified bundle: its directory, and whether gpuprov unpacked it (then `discard` removes the copy)."""
    path: Path
    result: manifest.VerifyResult
    unpacked: bool = False

    def discard(self) -> None:
        if self.unpacked:
            shutil.rmtree(self.path.parent, ignore_errors=True)


def kept_path(base: Path, bundle: Path) -> Path:
    """Where a verified bundle's private copy (a .tar.gz unpacked, a directory copied) is kept under `base`: one
    directory per bundle content."""
    return base / manifest.sha256(bundle / "SHA256SUMS")[:16] / TOP


def open_verified(path: Path, keyring: str | None = None, base: Path | None = None, *,
                  private: bool = False) -> OpenBundle:
    """A bundle directory, or a .tar.gz unpacked (members filtered) into a private directory under `base`
    (extract_base() unless given), then verified (manifest.verify). `private` (what an install uses): a directory
    too is copied there first, and the copy verified, so that no other user can change what is installed after it
    was verified. Raises BundleInvalid (exit 8) when anything fails, after removing what was unpacked or copied."""
    base = extract_base() if base is None else base
    lacks = [m for m in manifest.META[:2] if not (os.path.isfile(path / m) and not os.path.islink(path / m))] \
        if path.is_dir() else []
    if lacks:  # (seen: `bundle install /root` named a link it met copying /root, not that /root is no bundle)
        raise BundleInvalid(f"{path}: not a gpuprov bundle (it has no {' and no '.join(lacks)}): give the "
                            "directory or .tar.gz that `gpuprov bundle create` made")
    if path.is_dir() and private:
        bundle, unpacked = copy_dir(path, base), True
    elif path.is_dir():
        bundle, unpacked = path.resolve(), False
    elif path.is_file():
        bundle, unpacked = unpack(path, base), True
    else:
        raise BundleInvalid(f"{path}: no such bundle (a directory or .tar.gz from `gpuprov bundle create`)")
    opened = OpenBundle(bundle, manifest.VerifyResult(False, None), unpacked)
    try:
        opened.result = manifest.verify(bundle, keyring)
    except BaseException:
        opened.discard()
        raise
    if not opened.result.ok:
        opened.discard()
        problems = opened.result.problems
        exc = BundleInvalid(f"{path}: " + "; ".join(problems[:5])
                                     + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
                                     + (" (the unpacked copy was removed)" if unpacked else ""))
        exc.problems = problems
        raise exc
    if unpacked:  # one copy per bundle content: a re-run replaces it instead of piling up copies
        final = kept_path(base, bundle)
        shutil.rmtree(final.parent, ignore_errors=True)
        os.rename(bundle.parent, final.parent)
        opened.path = final
    return opened


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


def check_bundle(path: Path, keyring: str | None = None, root: Path = Path("/"),
                 base: Path | None = None, *, private: bool = False) -> tuple[Path, dict]:
    """Verify first (nothing is read from an unverified bundle), then the preflight (against the host under
    `root`) and the repository. `base`: where a .tar.gz is unpacked (open_verified); `private`: a directory is
    copied there too (installs: what was verified is what is installed)."""
    opened = open_verified(path, keyring, base, private=private)
    bundle, man = opened.path, opened.result.manifest
    try:
        target = man["target"]
        preflight(target, read_distro(root), kernel_release(root))
        available = aptrepo.repo_packages(bundle / "repo")
        missing = [p for pkgs in man["components"].values() for p in pkgs if p not in available]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        opened.discard()
        raise BundleInvalid(f"{path}: not a gpuprov bundle ({exc!r})") from None
    except BaseException:
        opened.discard()
        raise
    if missing:
        opened.discard()
        raise BundleInvalid(f"{', '.join(missing)}: missing from bundle {bundle}; rebuild it with "
                                     "`gpuprov bundle create` (nothing was installed)")
    return bundle, man
