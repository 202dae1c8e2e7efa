"""The last bootstrap step: a container started through the registered runtime, from an image built locally out
of the host's own files (no registry needed)."""
from __future__ import annotations

import io
import os
import shutil
import tarfile

from provision import __version__, effects

IMAGE = f"gpuprov-validate:{__version__}"
BINARIES = ("sh", "cat", "ls", "echo")
OK_WORD = "gpuprov-validate-ok"


def run_argvs(runtime: str, gpu: bool) -> list[tuple[str, ...]]:
    base = ("docker", "run", "--rm", "--runtime", runtime)
    cmds = [base + (IMAGE, "sh", "-c", f"echo {OK_WORD}")]
    if gpu:
        cmds.append(base + ("-e", "NVIDIA_VISIBLE_DEVICES=all", IMAGE, "nvidia-smi", "-L"))
    return cmds


def ldd_deps(binary: str) -> list[str]:
    """The shared libraries (and loader) `binary` loads, as absolute paths, from `ldd`."""
    out = effects.run(["ldd", binary], check=False).output
    libs = []
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) > 2 and parts[2].startswith("/"):
            libs.append(parts[2])
        elif parts and parts[0].startswith("/"):
            libs.append(parts[0])
    return libs


def build_image_tar(binaries: tuple[str, ...] = BINARIES) -> bytes:
    """A tiny rootfs: sh/cat/ls and the C libraries they load, taken from this host. /etc/debian_version marks
    the loader layout when the host is Debian-family (so driver libraries land where its loader looks)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        added = set()

        def add(path: str, arc: str | None = None) -> None:
            arc = (arc or path).lstrip("/")
            if arc in added:
                return
            added.add(arc)
            tar.add(os.path.realpath(path), arcname=arc, recursive=False)

        for d in ("bin", "usr/bin", "usr/lib/x86_64-linux-gnu", "usr/lib64", "lib64", "etc", "tmp", "dev", "proc",
                  "sys"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
            added.add(d)
        for b in binaries:
            path = shutil.which(b)
            if not path:
                continue
            add(path, f"/bin/{b}")
            for lib in ldd_deps(path):
                add(lib)
        if os.path.exists("/etc/debian_version"):
            add("/etc/debian_version")
    return buf.getvalue()


def ensure_image() -> None:
    """The validation image, imported from this host's files when it is missing (tests and `verify` use it)."""
    from provision.plan.steps import ImportImage

    ImportImage(IMAGE, BINARIES).execute()
