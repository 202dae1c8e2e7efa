"""gpuprov bundle create: resolve the complete closure in a clean root of the target release (a container of
that release, so nothing the building machine already has is left out), download, index, describe, checksum."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import tomlkit

from provision import __version__, effects, engines, package_managers
from provision.bundle import aptrepo, manifest
from provision.bundle.images import ensure_image, image_name
from provision.decide.packages import debian_components
from provision.decide.targets import Target
from provision.errors import StepFailed, Unsupported, UsageError
from provision.fsutil import make_dirs, write_file
from provision.output import progress

COMPONENTS = ("driver", "engine", "runtime")
# CPython of each release (the wheels for gpuprov's own dependencies must match it).
TARGET_PYTHON = {"bullseye": "3.9", "bookworm": "3.11", "trixie": "3.13", "jammy": "3.10", "noble": "3.12",
                 "focal": "3.8"}
SOURCE_ROOT = Path(__file__).resolve().parents[2]
# Where install.sh keeps the wheel it installed gpuprov from: an installed gpuprov (no checkout) packs that one.
KEPT_WHEELS = Path(sys.prefix) / "wheels"
# Each tool a create may need and how to get it (which are needed when: prerequisites()). docker here is this
# machine's client for the target's clean root, not a node's engine.
HOW_TO_GET = (("docker", "docker.io"), ("debootstrap", "debootstrap"), ("dpkg-deb", "dpkg"), ("gpg", "gpg"))
BUNDLE_REPO = "/bundle/repo"  # where a build in the target's clean container puts the packages


@dataclass
class CreateOptions:
    target: Target
    components: tuple[str, ...]
    output: Path
    driver_packages: tuple[str, ...] = ()
    kernel: str | None = None
    sign_key: str | None = None
    gnupghome: str | None = None
    resume: bool = False  # --resume: a failed create keeps its work (OUTPUT.partial) and the next one goes on from it


# With --resume the create works in OUTPUT.partial (this file in it says for what) and renames or packs it to OUTPUT
# only when it is complete: OUTPUT never holds half a bundle, and a failed create's downloads stay for the next run
# (apt skips a .deb already in its archive directory whose hash matches, pip a wheel already downloaded).
PARTIAL_SUFFIX = ".partial"
STARTED = ".gpuprov-create.json"


def partial_dir(output: Path) -> Path:
    return output.with_name(output.name + PARTIAL_SUFFIX)


def _started_for(opt: CreateOptions, comps: dict[str, list[str]]) -> dict:
    """What a resumed create must agree with: the target, the packages, the kernel, this gpuprov."""
    return {"gpuprov": __version__, "target": opt.target.name, "kernel": opt.kernel if "driver" in comps else None,
            "packages": comps}


def apt_packages(opt: CreateOptions) -> dict[str, list[str]]:
    t = opt.target
    comps: dict[str, list[str]] = {}
    if "engine" in opt.components:
        comps["engine"] = list(engines.get("docker").packages(t, "distro"))
    if "runtime" in opt.components:
        comps["runtime"] = ["python3", "python3-venv"]  # to run gpuprov itself from the bundled wheels
    if "driver" in opt.components:
        if not opt.driver_packages:
            raise UsageError("the driver component needs --pci-id (the GPUs the target has) to choose packages")
        comps["driver"] = list(opt.driver_packages) + ([f"linux-headers-{opt.kernel}"] if opt.kernel else [])
    return comps


def _image(target: Target) -> str:
    return ensure_image(target)


def resolve_and_download(target: Target, packages: list[str], out: Path, enable_nonfree: bool) -> None:
    """apt in a pristine container of the target: `install --download-only` of everything a fresh host lacks."""
    image = _image(target)
    comps = " ".join(debian_components(target))
    prep = ""
    if enable_nonfree:
        prep = (f"sed -i -E '/^deb /s/ main( |$)/ main {comps}\\1/' /etc/apt/sources.list 2>/dev/null; "
                f"sed -i -E 's/^Components: main$/Components: main {comps}/' /etc/apt/sources.list.d/*.sources "
                "2>/dev/null; ")
    pm = package_managers.get(target.package_manager)
    (download,) = pm.download(tuple(packages), "/out")
    script = f"{prep}{shlex.join(pm.refresh())} -qq && DEBIAN_FRONTEND=noninteractive {shlex.join(download)} -qq"
    p = effects.run(["docker", "run", "--rm", "-v", f"{out}:/out", image, "bash", "-c", script], check=False)
    if p.returncode != 0:
        raise StepFailed(f"resolving {' '.join(packages)} for {target.name} failed:\n{p.stderr.strip()[-800:]}")
    for f in out.glob("lock"):
        f.unlink()
    shutil.rmtree(out / "partial", ignore_errors=True)


def py_deps() -> list[str]:
    """gpuprov's own dependencies, as its installed metadata lists them (written from pyproject.toml: one list, so a
    dependency added there is in every bundle; a hand-kept copy here once missed one, and the offline install failed
    on the air-gapped host). Extras are left out. An installed gpuprov has no pyproject.toml to read: reading it
    made `bundle create` fail for every installed user; only a checkout run without installing reads it."""
    try:
        reqs = metadata.requires("gpuprov")
    except metadata.PackageNotFoundError:
        doc = tomlkit.parse((SOURCE_ROOT / "pyproject.toml").read_text())
        return [str(d) for d in doc["project"]["dependencies"]]
    return [r for r in reqs or [] if "extra ==" not in r]


def own_wheel() -> Path | None:
    """The wheel an installed gpuprov was installed from (install.sh keeps it in KEPT_WHEELS), this version's."""
    found = sorted(KEPT_WHEELS.glob(f"gpuprov-{__version__}-*.whl"))
    return found[-1] if found else None


def prerequisites(opt: CreateOptions) -> list[str]:
    """What this machine lacks for the create, each with how to get it; asked before anything is downloaded (seen:
    debootstrap missing after the fact, and "runs from a gpuprov checkout" after minutes of downloads)."""
    need = ["docker", "dpkg-deb"] + (["gpg"] if opt.sign_key else [])
    image = effects.which("docker") and effects.run(["docker", "image", "inspect", image_name(opt.target)],
                                                    check=False, timeout=60, probe=True).returncode == 0
    if not image:  # the clean root of the target is built once (debootstrap), then kept as an image
        need.append("debootstrap")
    how = package_managers.get("apt").how_to_get  # this machine builds bundles with debootstrap: Debian's family
    missing = [f"{t} ({how(dict(HOW_TO_GET)[t])})" for t in need if not effects.which(t)]
    unfit = [] if image else unfit_mount(tempfile.gettempdir())
    if unfit:  # (seen: debootstrap's bare `Permission denied` after its downloads, /tmp mounted noexec,nodev)
        missing.append(f"a temporary directory debootstrap can build the root in: {tempfile.gettempdir()} is "
                       f"mounted {','.join(unfit)} (debootstrap runs the new root's programs and makes its device "
                       "nodes there); point TMPDIR at a directory on a filesystem mounted without "
                       f"{' and '.join(unfit)}, e.g. TMPDIR=/var/tmp gpuprov bundle create …")
    if "runtime" in opt.components:
        if not (SOURCE_ROOT / "pyproject.toml").exists() and own_wheel() is None:
            missing.append(f"gpuprov's own wheel (none in {KEPT_WHEELS}: reinstall with install.sh, which keeps it, "
                           "or run from a gpuprov checkout)")
        if effects.try_run([sys.executable, "-m", "pip", "--version"], timeout=60, probe=True) is None:
            missing.append(f"pip for {sys.executable} (python3 -m ensurepip)")
    return missing


def unfit_mount(path: str) -> list[str]:
    """The mount options of the filesystem holding `path` that stop a root being built there: noexec (its programs
    cannot run) and nodev (its device nodes cannot be opened). [] when it cannot tell."""
    try:
        flags = os.statvfs(path).f_flag
    except OSError:
        return []
    return [name for name, bit in (("noexec", os.ST_NOEXEC), ("nodev", os.ST_NODEV)) if flags & bit]


def build_wheels(target: Target, wheels: Path) -> None:
    py = TARGET_PYTHON.get(target.codename)
    if not py:
        raise Unsupported(f"no Python version known for {target.name}")
    if (SOURCE_ROOT / "pyproject.toml").exists():
        effects.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(SOURCE_ROOT), "-w", str(wheels)])
    else:  # an installed gpuprov: the wheel it was installed from (prerequisites() checked there is one)
        kept = own_wheel()
        if kept is None:
            raise UsageError(f"no gpuprov wheel in {KEPT_WHEELS} to pack: reinstall with install.sh, which keeps it")
        make_dirs(wheels, 0o755)
        shutil.copy2(kept, wheels / kept.name)
    plats = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "any"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", py,
           "--implementation", "cp", "-d", str(wheels), *[a for p in plats for a in ("--platform", p)], *py_deps()]
    p = effects.run(cmd, check=False)
    if p.returncode != 0:
        raise StepFailed(f"downloading gpuprov's Python dependencies for Python {py} failed: {p.stderr[-500:]}")


def create(opt: CreateOptions) -> dict:
    if opt.target.family != "debian":
        raise Unsupported(f"bundle create builds apt bundles; for {opt.target.name} see `gpuprov bundle plan` "
                          "(dnf download --resolve --alldeps + createrepo_c)")
    t0 = time.monotonic()
    comps = apt_packages(opt)
    tar_out = opt.output.name.endswith((".tar.gz", ".tgz"))
    if not tar_out and opt.output.exists() and any(opt.output.iterdir()):
        raise UsageError(f"{opt.output} exists and is not empty: choose a new directory or a .tar.gz name")
    partial = partial_dir(opt.output)
    if partial.exists() and not opt.resume:
        raise UsageError(f"{partial} holds what an earlier `bundle create --resume` downloaded: run the same command "
                         f"with --resume to go on from it, or remove {partial}")
    missing = prerequisites(opt)
    if missing:
        raise Unsupported(f"bundle create needs {'; '.join(missing)}; nothing was downloaded")
    if opt.resume:
        return _create_resumable(opt, comps, partial, tar_out, t0)
    existed = opt.output.exists()
    work = Path(tempfile.mkdtemp(prefix="gpuprov-bundle-")) if tar_out else opt.output
    try:
        return _create(opt, comps, work, tar_out, t0)
    except BaseException:  # a failed or interrupted create leaves nothing of its own behind (seen: "exists and is
        # not empty" on the next try): its work directory goes, an --output directory it made or found empty too
        if tar_out or not existed:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for child in work.iterdir():
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() and not child.is_symlink() \
                    else child.unlink(missing_ok=True)
        raise


def _written_for(partial: Path) -> dict | None:
    """What the manifest a failed resumable create already wrote says it was for (as _started_for), or None."""
    try:
        doc = json.loads((partial / "manifest.json").read_text())
        return {"gpuprov": doc["gpuprov"], "target": doc["target"]["name"], "kernel": doc["target"]["kernel"],
                "packages": {c: list(pkgs) for c, pkgs in doc["components"].items()}}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _create_resumable(opt: CreateOptions, comps: dict[str, list[str]], partial: Path, tar_out: bool,
                      t0: float) -> dict:
    """--resume: work in OUTPUT.partial, started afresh or gone on with when it was started for the same bundle;
    kept when this run fails too; renamed (a directory) or packed (a .tar.gz) to OUTPUT when complete."""
    want = _started_for(opt, comps)
    marker = partial / STARTED
    if partial.exists():
        try:
            had = json.loads(marker.read_text())
        except (OSError, ValueError):
            had = _written_for(partial)  # it failed while signing: its manifest (the marker gone) says for what
        if had != want:
            raise UsageError(f"{partial} was not started by `bundle create --resume` for this bundle (target, "
                             f"packages, kernel and gpuprov version must be the same): remove it, or run the command "
                             f"that started it")
        progress(f"resuming in {partial}: {len(list((partial / 'repo').glob('*.deb')))} packages already there")
    else:
        make_dirs(partial, 0o755)
        write_file(marker, json.dumps(want, indent=2) + "\n", mode=0o644, keep_mode=False, backup=False)
    for name in manifest.META:  # a run that failed while signing: written again from the files
        (partial / name).unlink(missing_ok=True)
    try:
        res = _create(opt, comps, partial, tar_out, t0, started=marker)
    except BaseException:
        progress(f"bundle create: kept what it downloaded in {partial}; run the same command with --resume to go on")
        raise
    if not tar_out:
        partial.rename(opt.output)  # (an empty OUTPUT directory is replaced; a non-empty one was refused above)
        res["output"] = str(opt.output)
    return res


def _create(opt: CreateOptions, comps: dict[str, list[str]], work: Path, tar_out: bool, t0: float,
            started: Path | None = None) -> dict:
    """`started`: the resumable create's marker, removed before the manifest lists the files."""
    if not tar_out:
        make_dirs(work, 0o755)
    repo = work / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    all_pkgs = [p for pkgs in comps.values() for p in pkgs]
    progress(f"[1/4] resolving and downloading {len(all_pkgs)} packages (+ dependencies) in a clean "
             f"{opt.target.name} root …")
    resolve_and_download(opt.target, all_pkgs, repo, "driver" in comps)
    progress(f"[2/4] indexing {len(list(repo.glob('*.deb')))} packages (flat apt repository) …")
    index = aptrepo.write_flat_repo(repo)
    progress("[3/4] packing gpuprov and its Python dependencies …")
    if "runtime" in comps:
        build_wheels(opt.target, work / "wheels")
    (work / "install-offline.sh").write_text((Path(__file__).with_name("install-offline.sh")).read_text())
    (work / "install-offline.sh").chmod(0o755)
    versions = {e["package"]: e["version"] for e in index}
    target = {"os_id": opt.target.os_id, "version": opt.target.version, "codename": opt.target.codename,
              "arch": "amd64", "kernel": opt.kernel if "driver" in comps else None, "name": opt.target.name}
    components = {c: {p: versions.get(p) for p in pkgs} for c, pkgs in comps.items()}
    progress("[4/4] writing manifest.json and SHA256SUMS" + (" and signing" if opt.sign_key else "") + " …")
    if started is not None:
        started.unlink(missing_ok=True)
    manifest.write_manifest(work, target, components)
    keys = []
    if opt.sign_key:
        fpr = manifest.sign(work, opt.sign_key, opt.gnupghome)
        keys = [{"fingerprint": fpr}]
        manifest.write_manifest(work, target, components, keys)
        manifest.sign(work, opt.sign_key, opt.gnupghome)
    if tar_out:
        def pack(fh) -> None:
            with tarfile.open(fileobj=fh, mode="w:gz") as tar:
                tar.add(work, arcname="gpuprov-bundle")

        # Through the one write path: never through a link planted at --output, old or new file, never half.
        write_file(opt.output, pack, mode=0o644, keep_mode=False, backup=False)
        shutil.rmtree(work)
    size = opt.output.stat().st_size if tar_out else sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
    return {"output": str(opt.output), "target": target, "packages": len(index), "bytes": size,
            "seconds": round(time.monotonic() - t0, 1), "components": {c: len(v) for c, v in comps.items()},
            "signed": bool(opt.sign_key)}
