"""A local OCI image for CRI tests (no registry here): this host's sh, ls, cat, sleep and the C libraries they load,
packed as an OCI image archive that `ctr images import` reads. It serves as the pod sandbox ("pause") image —
its entrypoint sleeps — and as the workload image."""
from __future__ import annotations

import io
import os
import shutil
import tarfile

from provision.engines import validate
from provision.engines.validate import ldd_deps

BINARIES = ("sh", "ls", "cat", "sleep", "echo")
NAME = "docker.io/gpuprov-test/ctrd-pause:1"  # the normalised name CRI resolves "gpuprov-test/ctrd-pause:1" to


_libs = ldd_deps  # a module attribute: tests/k8s_cri.py swaps it for images that need more


def _layer() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        done: set[str] = set()

        def add_dir(d: str) -> None:
            parts = d.strip("/").split("/")
            for i in range(1, len(parts) + 1):
                p = "/".join(parts[:i])
                if p and p not in done:
                    info = tarfile.TarInfo(p)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
                    tar.addfile(info)
                    done.add(p)

        def add_file(src: str, arc: str) -> None:
            arc = arc.lstrip("/")
            if arc in done:
                return
            add_dir(os.path.dirname(arc))
            info = tar.gettarinfo(os.path.realpath(src), arcname=arc)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(os.path.realpath(src), "rb") as fh:
                tar.addfile(info, fh)
            done.add(arc)

        for d in ("bin", "dev", "proc", "sys", "tmp", "etc", "usr/lib/x86_64-linux-gnu", "run", "var/run"):
            add_dir(d)
        for b in BINARIES:
            path = shutil.which(b)
            add_file(path, f"/bin/{b}")
            for lib in _libs(path):
                add_file(lib, lib)
        # Debian's loader layout: the runtime mounts driver libraries where this image's loader looks.
        add_file("/etc/debian_version", "/etc/debian_version")
    return buf.getvalue()


def oci_archive(name: str = NAME) -> bytes:
    """An OCI image layout (index.json, oci-layout, blobs) in a tar, named `name` for `ctr images import`: the
    layout bootstrap's validation step imports into containerd, with this image's layer and entrypoint."""
    return validate.oci_archive(_layer(), name, {"Entrypoint": ["/bin/sleep", "infinity"], "Env": ["PATH=/bin"],
                                                 "WorkingDir": "/"})
