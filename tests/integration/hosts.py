"""Fresh Debian 12 hosts as containers (debootstrap image, nested-engine flags from TESTING.md), reached through
`docker exec` only. gpuprov goes in from a wheelhouse built on this machine, as on an offline host."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from tests.shared_builds import once

REPO = Path(__file__).resolve().parents[2]
IMAGE = "gpuprov-test/bookworm-minbase:1"
SYSTEMD_IMAGE = "gpuprov-test/bookworm-systemd:1"  # minbase + systemd systemd-sysv dbus (TESTING.md), no compiler
# The pids of the live processes (zombies left out: a host whose PID 1 is `sleep` never reaps them) whose name is one of
# NAMES (space-separated), as a shell line for a host (minbase has no pgrep).
PIDS_OF = ('for p in /proc/[0-9]*; do case " {names} " in *" $(cat $p/comm 2>/dev/null) "*) '
           'grep -q "^State:.Z" $p/status || echo ${{p#/proc/}};; esac; done')
NESTED = ["--cap-add", "ALL", "--cap-drop", "SYS_RESOURCE", "--security-opt", "seccomp=unconfined",
          "--security-opt", "apparmor=unconfined", "--device-cgroup-rule", "a *:* rwm", "--cgroupns", "host",
          "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw", "--tmpfs", "/var/lib/docker:exec"]


def sh(*argv, check=True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, **kw)


def checkout_ignore():
    """For shutil.copytree: what a clone of this checkout would not hold (.git, and the .gitignore's patterns: venv,
    builds, caches), for copies made where the checkout is no git work tree (bench/host_orders.py's hosts)."""
    lines = (REPO / ".gitignore").read_text().splitlines() if (REPO / ".gitignore").exists() else []
    return shutil.ignore_patterns(".git", ".gpu-*", *(ln.strip().strip("/") for ln in lines
                                                         if ln.strip() and not ln.startswith("#")))


def ensure_image() -> str:
    return debootstrap_image(IMAGE, "bookworm")


def debootstrap_image(name: str, suite: str) -> str:
    """NAME: `debootstrap --variant=minbase SUITE` imported as an image, made when missing (once per machine)."""
    if sh("docker", "image", "inspect", name, check=False).returncode == 0:
        return name
    with once(name):
        if sh("docker", "image", "inspect", name, check=False).returncode == 0:
            return name  # another worker made it while this one waited
        with tempfile.TemporaryDirectory() as td:
            sh("debootstrap", "--variant=minbase", suite, td, timeout=1200)
            tar = subprocess.Popen(["tar", "-C", td, "-c", "."], stdout=subprocess.PIPE)
            subprocess.run(["docker", "import", "-", name], stdin=tar.stdout, check=True, capture_output=True)
            tar.wait()
    return name


def committed_image(name: str, base: str, script: str, cmd: str = '["sleep", "infinity"]',
                    volumes: tuple[str, ...] = ()) -> str:
    """NAME (its tag carries its recipe's hash), made when missing: bash runs SCRIPT in a container of BASE (VOLUMES:
    docker's `-v` values), which is then committed with CMD. A failed script makes no image."""
    if sh("docker", "image", "inspect", name, check=False).returncode == 0:
        return name
    with once(name):
        if sh("docker", "image", "inspect", name, check=False).returncode == 0:
            return name  # another worker made it while this one waited
        box = f"gpuprov-prep-{uuid.uuid4().hex[:8]}"
        try:
            r = sh("docker", "run", "--name", box, *(a for v in volumes for a in ("-v", v)), base, "bash", "-c",
                   script, check=False, timeout=1800)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            sh("docker", "commit", "-c", f"CMD {cmd}", box, name)
        finally:
            sh("docker", "rm", "-f", box, check=False)
    return name


def ensure_systemd_image() -> str:
    """The closest thing to a fresh Debian 12 server: minbase plus systemd as PID 1. No compiler, no pip."""
    if sh("docker", "image", "inspect", SYSTEMD_IMAGE, check=False).returncode == 0:
        return SYSTEMD_IMAGE
    return committed_image(SYSTEMD_IMAGE, ensure_image(),
                           "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                           "--no-install-recommends systemd systemd-sysv dbus >/dev/null && apt-get clean",
                           cmd='["/lib/systemd/systemd"]')


def checkout_key() -> str:
    """What the checkout holds now: git's HEAD and work-tree status, or, where there is no git or no git work tree
    (a copy of the checkout on a fresh host: bench/host_orders.py's), every file's path, size and mtime."""
    if shutil.which("git") and (REPO / ".git").exists():
        head = sh("git", "-C", str(REPO), "rev-parse", "HEAD", check=False).stdout.strip()
        # status names the changed files, the diff their changes: a second edit of an already changed file is a
        # new key too (status alone kept serving the wheel of the first edit)
        dirty = sh("git", "-C", str(REPO), "status", "--porcelain", check=False).stdout + \
            sh("git", "-C", str(REPO), "diff", "HEAD", check=False).stdout
        return head + hashlib.sha256(dirty.encode()).hexdigest()
    h = hashlib.sha256()
    ignore = checkout_ignore()
    for dirpath, dirnames, filenames in os.walk(REPO):
        left_out = ignore(dirpath, dirnames + filenames)
        dirnames[:] = sorted(d for d in dirnames if d not in left_out)
        for f in sorted(set(filenames) - left_out):
            st = os.lstat(os.path.join(dirpath, f))
            h.update(f"{dirpath}/{f} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def ensure_wheelhouse() -> Path:
    wh = Path(os.environ.get("GPUPROV_TEST_WHEELHOUSE", "/tmp/gpuprov-wheelhouse"))
    stamp = wh / ".built-from"
    key = checkout_key()
    if stamp.exists() and stamp.read_text() == key:
        return wh
    with once(str(wh)):
        if not (stamp.exists() and stamp.read_text() == key):
            _build_wheelhouse(wh)
            stamp.write_text(key)
    return wh


def _build_wheelhouse(wh: Path) -> None:
    shutil.rmtree(wh, ignore_errors=True)
    wh.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as td:  # build from a copy: the checkout may be read-only or dirty
        src = Path(td) / "src"
        shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(".git", ".venv", ".gpu-kit", ".whl", "*.egg-info",
                                                                 "__pycache__", "build"))
        sh(sys.executable, "-m", "pip", "wheel", "-q", str(src), "-w", str(wh), timeout=900)


def recipe_key(tree: Path, *parts: str) -> str:
    """A hash of a recipe's text (`parts`) and of every file under `tree` (names and contents): a cache key."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
    for f in sorted(tree.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(tree).as_posix().encode() + f.read_bytes())
    return h.hexdigest()[:12]


def built_in_container(cache_root: Path, tree: Path, image: str, script: str) -> Path:
    """What the Python `script` writes under /out, run once in a container of `image` (`--network none`, `tree`
    read-only at /fx), kept at CACHE_ROOT/<recipe key>: the stand-in archives (el_hosts, ubuntu_hosts) are built
    once per run and input, and a half-built one is never used (the .done stamp comes last)."""
    out = cache_root / recipe_key(tree, image, script)
    if (out / ".done").exists():
        return out
    with once(str(out)):
        if not (out / ".done").exists():
            _build_in_container(out, tree, image, script)
    return out


def _build_in_container(out: Path, tree: Path, image: str, script: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as td:
        r = sh("docker", "run", "--rm", "--network", "none", "-v", f"{tree}:/fx:ro", "-v", f"{td}:/out",
               image, "python3", "-c", script, check=False, timeout=1800)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        sh("chmod", "-R", "a+rX", td)
        os.rename(td, out)
        os.mkdir(td)  # TemporaryDirectory removes its own path
    (out / ".done").write_text("ok")


class StandInHost:
    """A host container of a stand-in distribution (el_hosts.ElHost, ubuntu_hosts.UbuntuHost): `--network none`,
    its package archive served on loopback inside it, gpuprov from the wheelhouse at /wh."""
    name: str

    def exec(self, script: str, check: bool = False, timeout: float = 900) -> subprocess.CompletedProcess:
        r = sh("docker", "exec", "-i", self.name, "bash", "-c", script, check=False, timeout=timeout)
        if check:
            assert r.returncode == 0, f"{script}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r

    def spawn(self, script: str) -> None:
        sh("docker", "exec", "-d", self.name, "bash", "-c", script)

    def write(self, path: str, text: str) -> None:
        r = sh("docker", "exec", "-i", self.name, "bash", "-c", f"mkdir -p $(dirname {path}) && cat > {path}",
               input=text, check=False)
        assert r.returncode == 0, r.stderr

    def install_gpuprov(self) -> None:
        self.exec("set -e; python3 -m venv /opt/gpuprov && /opt/gpuprov/bin/pip install -q --no-index --find-links /wh "
                  "gpuprov && ln -sf /opt/gpuprov/bin/gpuprov /usr/local/bin/gpuprov && gpuprov --version", check=True)

    def remove(self) -> None:
        sh("docker", "rm", "-f", self.name, check=False)


class Host:
    def __init__(self, name: str | None = None, network: str | None = None, volumes: dict | None = None,
                 wheelhouse: bool = True, systemd: bool = False, tmpfs: tuple[str, ...] = ()):
        self.name = name or f"gpuprov-host-{uuid.uuid4().hex[:8]}"
        args = ["docker", "run", "-d", "--name", self.name, *NESTED, "-v", f"{REPO}:/src:ro"]
        for d in tmpfs:  # an engine's store (e.g. /var/lib/containerd): overlayfs cannot stack on the host's overlay
            args += ["--tmpfs", f"{d}:exec"]
        if systemd:
            args += ["--tmpfs", "/run", "--tmpfs", "/run/lock", "-e", "container=docker"]
        if wheelhouse:
            args += ["-v", f"{ensure_wheelhouse()}:/wh:ro"]
        for src, dst in (volumes or {}).items():
            args += ["-v", f"{src}:{dst}:ro"]
        if network:
            args += ["--network", network]
        if systemd:
            sh(*args, ensure_systemd_image())
            self.exec("for i in $(seq 60); do s=$(systemctl is-system-running); "
                      "case $s in running|degraded) exit 0;; esac; sleep 1; done; exit 1", check=True)
        else:
            sh(*args, ensure_image(), "sleep", "infinity")

    def exec(self, script: str, check: bool = False, timeout: float = 900, input_text: str | None = None):
        return sh("docker", "exec", "-i", self.name, "bash", "-c", script, check=check, timeout=timeout,
                  input=input_text)

    def spawn(self, script: str) -> None:
        """Run in the background inside the host (outlives this call)."""
        sh("docker", "exec", "-d", self.name, "bash", "-c", script)

    def write(self, path: str, text: str) -> None:
        self.exec(f"mkdir -p $(dirname {path}) && cat > {path}", check=True, input_text=text)

    def read(self, path: str) -> bytes:
        return subprocess.run(["docker", "exec", self.name, "cat", path], capture_output=True, check=True).stdout

    def install_gpuprov(self) -> subprocess.CompletedProcess:
        """install.sh from the wheelhouse, installing gpuprov only (--install-only: no bootstrap run)."""
        return self.exec("GPUPROV_WHEELHOUSE=/wh /src/install.sh --install-only", timeout=900)

    def remove(self) -> None:
        sh("docker", "rm", "-f", self.name, check=False)


def steps(out: str) -> dict[str, dict]:
    """`gpuprov bootstrap --json`'s steps by id."""
    return {s["id"]: s for s in json.loads(out)["steps"]}


def export_rootfs(image: str, root) -> None:
    """An image's filesystem unpacked into the directory `root` (docker create + export), for runc bundles."""
    import subprocess

    cid = sh("docker", "create", image, "true").stdout.strip()
    try:
        exp = subprocess.Popen(["docker", "export", cid], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(root)], stdin=exp.stdout, check=True)
        exp.wait()
    finally:
        sh("docker", "rm", "-f", cid)
