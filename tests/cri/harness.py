"""A private containerd for tests: its own root, state, socket, runc root, CNI and opt directories, so it never meets
the host's containerd (dockerd's) or another test's; the binaries are bookworm's (on PATH) or a newer containerd
unpacked from a newer Debian suite with `dpkg -x` (see `newer_containerd`). Stopped with everything it started:
its shims (found by the socket address in their argv) and its mounts."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.cri import image
from tests.shared_builds import CACHE, once

SUITE = "sid"  # where a containerd 2.x is (trixie has 1.7)
APT_SOURCE = "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {mirror} {suite} main\n"


def _mirror() -> str:
    """The Debian mirror this host's own apt uses (its sources name it; gpuprov's code never does)."""
    for f in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = f.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            if words[:1] == ["URIs:"] and words[1].rstrip("/").endswith("/debian"):
                return words[1]
            if words[:1] == ["deb"]:
                url = next((w for w in words[1:] if "://" in w), "")
                if url.rstrip("/").endswith("/debian"):
                    return url
    raise RuntimeError("no Debian mirror in this host's apt sources")


def _private_apt(suite: str) -> list[str]:
    """apt options for a private list and archive directory under CACHE for `suite` (the host's apt configuration
    and state are untouched); the lists are refreshed when older than six hours."""
    work = CACHE / f"apt-{suite}"
    for d in ("lists/partial", "archives/partial", "etc"):
        (work / d).mkdir(parents=True, exist_ok=True)
    (work / "etc/sources.list").write_text(APT_SOURCE.format(mirror=_mirror(), suite=suite))
    opts = [f"-oDir::Etc::SourceList={work}/etc/sources.list", "-oDir::Etc::SourceParts=/nonexistent",
            f"-oDir::State::Lists={work}/lists", f"-oDir::Cache={work}", "-oDir::Cache::archives="
            f"{work}/archives", "-oDebug::NoLocking=1", "-oAPT::Sandbox::User=root", "-qq"]
    fresh = (work / "lists").exists() and time.time() - (work / "lists").stat().st_mtime < 6 * 3600
    if not fresh or not any((work / "lists").glob("*Packages*")):
        subprocess.run(["apt-get", *opts, "update"], check=True, capture_output=True)
        os.utime(work / "lists")
    return opts


def newer_packages(suite: str, *packages: str) -> Path:
    """`packages` of `suite`, unpacked together with `dpkg -x` under CACHE, in a directory named by their
    versions (so a new upload is a new directory). Returns that directory (the unpacked root)."""
    with once(f"apt-{suite}"):  # one worker at a time in this suite's private apt (its own locking is off)
        opts, work = _private_apt(suite), CACHE / f"apt-{suite}"
        versions = []
        for pkg in packages:
            out = subprocess.run(["apt-cache", *opts, "show", "--no-all-versions", f"{pkg}/{suite}"], check=True,
                                 capture_output=True, text=True).stdout
            versions.append(next(ln.split(": ", 1)[1] for ln in out.splitlines() if ln.startswith("Version: ")))
        dest = CACHE / f"{packages[0]}-{versions[0]}" if len(packages) == 1 else CACHE / (
            f"{packages[0]}-{versions[0]}+{len(packages) - 1}")
        if dest.exists():
            return dest
        tmp = Path(tempfile.mkdtemp(dir=CACHE))
        for pkg, version in zip(packages, versions):
            subprocess.run(["apt-get", *opts, "download", f"{pkg}/{suite}"], check=True, capture_output=True, cwd=work)
            deb = next(work.glob(f"{pkg}_{version.split(':')[-1]}_*.deb"))
            subprocess.run(["dpkg", "-x", str(deb), str(tmp)], check=True)
            deb.unlink()
        tmp.rename(dest)
    return dest


def newer_containerd(suite: str = SUITE) -> Path:
    """The `containerd` package of `suite`, unpacked under CACHE. Returns the directory with its binaries."""
    return newer_packages(suite, "containerd") / "usr/bin"


def fs_type(path: str) -> str:
    """The type of the filesystem that holds `path` (its longest mount point in /proc/self/mounts)."""
    best, kind = "", ""
    real = os.path.realpath(path)
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mnt, typ = line.split()[:3]
        mnt = mnt.replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, typ
    return kind


@dataclass
class Containerd:
    bindir: Path
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gpuprov-ctrd-")))  # short: socket
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    own_mount: bool = False

    def __post_init__(self) -> None:
        # containerd's overlayfs snapshotter cannot put an overlay's upper directory on overlayfs, which is what the
        # temporary directory is on a host that is itself a container (bench/host_orders.py's; a real node in a
        # container mounts a volume at /var/lib/containerd for the same reason): there, the base gets its own tmpfs.
        if fs_type(str(self.base)) == "overlay":
            subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "gpuprov-ctrd", str(self.base)], check=True)
            self.own_mount = True

    @property
    def socket(self) -> str:
        return str(self.base / "c.sock")

    @property
    def binary(self) -> str:
        return str(self.bindir / "containerd")

    @property
    def path_env(self) -> str:
        # The shim (containerd-shim-runc-v2) is looked up on PATH: this containerd's own first.
        return f"{self.bindir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"

    def version(self) -> str:
        return subprocess.run([self.binary, "--version"], capture_output=True, text=True).stdout.split()[2]

    def start(self, config: Path, within: float = 30) -> None:
        log = open(self.base / "containerd.log", "ab")
        self.proc = subprocess.Popen([self.binary, "--config", str(config), "--log-level", "debug"],
                                     env={**os.environ, **self.env, "PATH": self.path_env}, stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited ({self.proc.returncode}): {self.log_tail()}")
            if os.path.exists(self.socket) and self.ctr("version", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"containerd did not answer on {self.socket} within {within}s: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return (self.base / "containerd.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def ctr(self, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bindir / "ctr"), "-a", self.socket, "-n", "k8s.io", *args],
                              capture_output=True, text=True, check=check, **kw)

    def import_image(self) -> str:
        tar = self.base / "image.tar"
        tar.write_bytes(image.oci_archive())
        self.ctr("images", "import", str(tar))
        return image.NAME

    def config_dump(self, config: Path) -> dict:
        import tomllib

        p = subprocess.run([self.binary, "--config", str(config), "config", "dump"], capture_output=True, text=True,
                           check=True)
        return tomllib.loads(p.stdout)

    def plugin_status(self, plugin_id: str) -> str | None:
        """`ctr plugins ls` status of a plugin (ok / error / skip)."""
        for line in self.ctr("plugins", "ls").stdout.splitlines()[1:]:
            cols = line.split()
            if len(cols) >= 4 and cols[1] == plugin_id:
                return cols[-1]
        return None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        # Shims started by this containerd outlive it by design; so does gpuprov's warm editor that a container
        # start spawned (it serves the settings file named in our environment).
        for pid in self.shim_pids() + self.editor_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.unmount_all()

    def shim_pids(self) -> list[int]:
        pids = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"-address" in argv and self.socket.encode() in argv and b"containerd-shim" in argv[0]:
                pids.append(int(entry.name))
        return pids

    def editor_pids(self) -> list[int]:
        mark = f"GPUPROV_RUNTIME_CONFIG={self.env.get('GPUPROV_RUNTIME_CONFIG', '-')}".encode()
        pids = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if mark in Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
                except OSError:
                    continue
        return pids

    def unmount_all(self) -> None:
        base = str(self.base) + "/"
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for m in reversed([m for m in mounts if m.startswith(base)]):
            subprocess.run(["umount", "-l", m], capture_output=True)

    def cleanup(self) -> None:
        self.stop()
        if self.own_mount:
            subprocess.run(["umount", "-l", str(self.base)], capture_output=True)
        shutil.rmtree(self.base, ignore_errors=True)
