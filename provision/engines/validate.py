"""The last bootstrap step: a container started through the registered runtime, from an image built locally out
of the host's own files (no registry needed). docker imports the files as a root filesystem (`docker import`);
containerd gets the same files as a one-layer OCI image archive (`ctr images import`) in gpuprov's own namespace, and
runs it with gpuprov's runtime as runc (`ctr run --runc-binary`), the binary its `nvidia` handler names."""
from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import tarfile

from provision import __version__, effects, paths

# What build_image_tar puts in, numbered: docker reuses an image of the same name, so a host that has an image of an
# older layout must get a new name (2: glibc's companions, without which the driver's nvidia-smi cannot start).
IMAGE_LAYOUT = 2
IMAGE = f"gpuprov-validate:{__version__}-{IMAGE_LAYOUT}"
BINARIES = ("sh", "cat", "ls", "echo")
OK_WORD = "gpuprov-validate-ok"
# containerd: the name its clients (CRI, nerdctl) resolve IMAGE to, in a namespace of gpuprov's own (verify's too), so
# nothing of the operator's (k8s.io, moby, default) is touched; one fixed container id, removed by `--rm`
CTR_IMAGE = f"docker.io/library/{IMAGE}"
CTR_NAMESPACE = "gpuprov"
CTR = ("ctr", "--namespace", CTR_NAMESPACE)
CONTAINER = "gpuprov-validate"
RUNC_SHIM = "io.containerd.runc.v2"  # the shim whose runc binary `--runc-binary` replaces
GPU_ENV = "NVIDIA_VISIBLE_DEVICES=all"
ARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}


def ctr_log() -> str:
    """Where the shim writes the validation container's output (ctr run --log-uri)."""
    return f"{paths.RUN_DIR}/validate.log"


def run_argvs(runtime: str, gpu: bool) -> list[tuple[str, ...]]:
    base = ("docker", "run", "--rm", "--runtime", runtime)
    cmds = [base + (IMAGE, "sh", "-c", f"echo {OK_WORD}")]
    if gpu:
        cmds.append(base + ("-e", GPU_ENV, IMAGE, "nvidia-smi", "-L"))
    return cmds


def ctr_reachable() -> bool:
    """`ctr` is installed and containerd's socket (CONTAINERD_ADDRESS, else ctr's default) is there. Without the
    socket every ctr command waits its 10 s dial timeout before failing: a docker-only host's uninstall spent 20 s
    so, and a test run 60 s."""
    address = os.environ.get("CONTAINERD_ADDRESS") or "/run/containerd/containerd.sock"
    path = address[len("unix://"):] if address.startswith("unix://") else address
    return effects.which("ctr") is not None and os.path.exists(path)


def leftover_image_argvs() -> list[tuple[tuple[str, ...], bool]]:
    """(argv, may fail) removing every gpuprov validation image (any gpuprov version's tag) from each engine that
    answers now: Podman's (rootful store) and docker's, then containerd's in gpuprov's namespace with the namespace
    itself (the operator's namespaces, and rootless users' Podman stores, are never touched). For `gpuprov
    uninstall`; reads only."""
    out: list[tuple[tuple[str, ...], bool]] = []
    for client in ("podman", "docker"):
        r = effects.try_run([client, "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", IMAGE.split(":")[0]],
                            timeout=30)
        tags = sorted(set(r.stdout.split())) if r and r.returncode == 0 else []
        if tags:
            out.append(((client, "image", "rm", *tags), False))
    r = effects.try_run(["ctr", "namespaces", "ls", "-q"], timeout=20) if ctr_reachable() else None
    if r and r.returncode == 0 and CTR_NAMESPACE in r.stdout.split():
        r = effects.try_run([*CTR, "images", "ls", "-q"], timeout=20)
        refs = sorted(set(r.stdout.split())) if r and r.returncode == 0 else []
        if refs:  # --sync: their content is collected before the namespace is removed (it must be empty)
            out.append(((*CTR, "images", "rm", "--sync", *refs), False))
        out.append((("ctr", "namespaces", "rm", CTR_NAMESPACE), True))  # fails while it holds anything else
    return out


def ctr_remove_argv() -> tuple[str, ...]:
    """Removes the validation container a killed run left behind (with its stopped task and its snapshot); it fails
    when there is none, which is the usual case."""
    return (*CTR, "containers", "delete", CONTAINER)


def ctr_run_argvs(runtime_path: str, gpu: bool, log: str = "") -> list[tuple[str, ...]]:
    """The validation containers on containerd: runc's shim with gpuprov's runtime as its runc binary, `--rm`
    removing each container and its snapshot (the image stays, as docker's does), the output written by the shim to
    `log` (steps.RunContainer says why)."""
    base = (*CTR, "run", "--rm", "--log-uri", f"file://{log or ctr_log()}", "--runtime", RUNC_SHIM, "--runc-binary",
            runtime_path)
    cmds = [base + (CTR_IMAGE, CONTAINER, "sh", "-c", f"echo {OK_WORD}")]
    if gpu:
        cmds.append(base + ("--env", GPU_ENV, CTR_IMAGE, CONTAINER, "nvidia-smi", "-L"))
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


def glibc_companions(libs: list[str]) -> list[str]:
    """libm/libdl/libpthread/librt beside the libc a program loads, as every distribution's base image has them:
    the driver's programs and libraries the runtime puts in the container load them (nvidia-smi on Ubuntu 24.04:
    "libpthread.so.0: cannot open shared object file" without)."""
    libc = next((x for x in libs if os.path.basename(x) == "libc.so.6"), None)
    if not libc:
        return []
    d = os.path.dirname(libc)
    return [os.path.join(d, n) for n in ("libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")
            if os.path.exists(os.path.join(d, n))]


def build_image_tar(binaries: tuple[str, ...] = BINARIES) -> bytes:
    """A tiny rootfs: sh/cat/ls and the C libraries they load (with glibc's companions), taken from this host.
    /etc/debian_version marks the loader layout when the host is Debian-family (so driver libraries land where its
    loader looks)."""
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
            libs = ldd_deps(path)
            for lib in libs + glibc_companions(libs):
                add(lib)
        if os.path.exists("/etc/debian_version"):
            add("/etc/debian_version")
    return buf.getvalue()


def oci_archive(layer: bytes, name: str = CTR_IMAGE, config: dict | None = None) -> bytes:
    """`layer` (a root filesystem tar, e.g. build_image_tar's) as a one-layer OCI image layout in a tar, named `name`
    (`ctr images import` names the image after the index's `io.containerd.image.name`); `config` replaces the image
    config's default (docker's default PATH, working directory /)."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    arch = ARCH.get(platform.machine(), platform.machine())
    image_config = json.dumps({  # a bare root filesystem has no image config: PATH as docker would default it
        "architecture": arch, "os": "linux",
        "config": config or {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                             "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **blob(image_config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **blob(layer)}]}).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", **blob(manifest),
        "platform": {"architecture": arch, "os": "linux"},
        "annotations": {"io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}}]}).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        files = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": index}
        files.update({f"blobs/sha256/{d.split(':')[1]}": data for d, data in blobs.items()})
        for d in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for arc, data in files.items():
            info = tarfile.TarInfo(arc)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()
