"""kubelet and NVIDIA's k8s-device-plugin, built here from public source, offline, and cached.

Debian packages no kubelet, and Kubernetes' own repository is too large to bring here; KubeEdge's repository vendors
Kubernetes' kubelet (`k8s.io/kubernetes/cmd/kubelet/app`, from KubeEdge's fork tagged v1.32.10-kubeedge1), so a
five-line `main` beside its `vendor/` builds an upstream-shaped kubelet with `-mod=vendor` and nothing downloaded.
NVIDIA's k8s-device-plugin vendors its modules too. Go is Debian's (`golang-1.26-go` + `golang-1.26-src` from sid,
unpacked with `dpkg -x`: bookworm's 1.19 is too old for both); Debian's archive is the only thing reached.

Each source is pinned to one commit (a git directory holding it: the `fetch` tool's copy of the public repository,
named by --kubeedge / --device-plugin or GPUPROV_KUBEEDGE_GIT / GPUPROV_DEVICE_PLUGIN_GIT). Builds are cached under
/var/cache/gpuprov-tests/k8s-bin/<name>-<commit>-go<version>/ (a new commit or Go is a new build).

    nice -n 10 python -m tests.k8s.build [--kubeedge GIT_DIR] [--device-plugin GIT_DIR]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.cri.harness import CACHE, newer_packages

GO_SUITE, GO_PACKAGES = "sid", ("golang-1.26-go", "golang-1.26-src")
BIN = CACHE / "k8s-bin"

KUBELET_MAIN = """package main

import (
\t"os"

\t"k8s.io/kubernetes/cmd/kubelet/app"
)

// Upstream's cmd/kubelet/kubelet.go, less component-base/cli (not vendored): the same command, run by cobra.
func main() {
\tif err := app.NewKubeletCommand().Execute(); err != nil {
\t\tos.Exit(1)
\t}
}
"""


@dataclass(frozen=True)
class Source:
    name: str  # the binary's name
    repo: str  # the public repository (owner/name)
    commit: str  # pinned
    env: str  # the variable naming a git directory that holds `commit`
    paths: tuple[str, ...]  # what `git archive` takes from the commit
    package: str  # what `go build` builds
    cgo: bool
    version_flag: str  # -X for the version the binary reports

    @property
    def key(self) -> str:
        return f"{self.name}-{self.commit[:12]}"


KUBELET = Source("kubelet", "kubeedge/kubeedge", "16cd8548eedb81af293b94f27844144c080eaa89", "GPUPROV_KUBEEDGE_GIT",
                 ("go.mod", "go.sum", "vendor"), "./cmd/gpuprov-kubelet", False,
                 "k8s.io/component-base/version.gitVersion=v1.32.10-kubeedge1")
DEVICE_PLUGIN = Source("nvidia-device-plugin", "NVIDIA/k8s-device-plugin", "1b826acc6af3079d8923bac395c3124b8861a9a6",
                       "GPUPROV_DEVICE_PLUGIN_GIT", ("go.mod", "go.sum", "vendor", "api", "cmd", "internal", "pkg"),
                       "./cmd/nvidia-device-plugin", True,
                       "github.com/NVIDIA/k8s-device-plugin/internal/info.version=1b826acc")


def go_root() -> Path:
    return newer_packages(GO_SUITE, *GO_PACKAGES) / "usr/lib/go-1.26"


def go_version(goroot: Path) -> str:
    return (goroot / "VERSION").read_text().split()[0]  # "go1.26.10"


def cached(src: Source) -> Path | None:
    """The newest cached build of `src`'s pinned commit (any Go), or None: what tests use without building."""
    hits = sorted(BIN.glob(f"{src.key}-go*/{src.name}"), key=lambda p: p.stat().st_mtime)
    return hits[-1] if hits else None


def source_dir(src: Source, git_dir: str | None) -> str | None:
    """A git directory that holds `src.commit`, or None."""
    for cand in (git_dir, os.environ.get(src.env)):
        if cand and subprocess.run(["git", "--git-dir", cand, "cat-file", "-e", f"{src.commit}^{{commit}}"],
                                   capture_output=True).returncode == 0:
            return cand
    return None


def absent_files(git_dir: str, src: Source) -> list[str]:
    """Files of the pinned commit whose contents the git directory lacks (`fetch`'s copy leaves out its largest
    files: seen, go-sqlite3's amalgamation, which neither binary builds)."""
    tree = subprocess.run(["git", "--git-dir", git_dir, "ls-tree", "-r", "-z", src.commit, *src.paths],
                          capture_output=True, check=True, text=True).stdout.split("\0")
    entries = [(line.split()[2], line.split("\t", 1)[1]) for line in tree if line and " blob " in line]
    check = subprocess.run(["git", "--git-dir", git_dir, "cat-file", "--batch-check"], capture_output=True,
                           check=True, text=True, input="".join(f"{obj}\n" for obj, _ in entries)).stdout
    return [path for (_, path), line in zip(entries, check.splitlines()) if line.endswith(" missing")]


def build(src: Source, git_dir: str) -> tuple[Path, float]:
    """Builds `src` at its pinned commit with Debian's Go; returns the binary and the seconds the build took (0 when
    it was cached)."""
    goroot = go_root()
    out = BIN / f"{src.key}-{go_version(goroot)}" / src.name
    if out.exists():
        return out, 0.0
    work = Path(tempfile.mkdtemp(prefix=f"gpuprov-build-{src.name}-", dir=CACHE))
    try:
        archive = subprocess.Popen(["git", "--git-dir", git_dir, "archive", src.commit, *src.paths,
                                    *(f":(exclude){p}" for p in absent_files(git_dir, src))], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(work)], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise RuntimeError(f"git archive {src.commit} failed in {git_dir}")
        if src is KUBELET:
            (work / "cmd/gpuprov-kubelet").mkdir(parents=True)
            (work / "cmd/gpuprov-kubelet/main.go").write_text(KUBELET_MAIN)
        env = {"PATH": f"{goroot}/bin:/usr/bin:/bin", "HOME": str(work), "GOROOT": str(goroot),
               "GOFLAGS": "-mod=vendor", "GOPROXY": "off", "GOTOOLCHAIN": "local", "GOTELEMETRY": "off",
               "GOCACHE": str(CACHE / "go-build-cache"), "GOPATH": str(work / ".gopath"),
               "CGO_ENABLED": "1" if src.cgo else "0"}
        out.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        subprocess.run(["nice", "-n", "10", "go", "build", "-trimpath", "-o", f"{out}.tmp",
                        "-ldflags", f"-s -w -X {src.version_flag}", src.package], cwd=work, env=env, check=True)
        took = time.monotonic() - t0
        os.replace(f"{out}.tmp", out)
        (out.parent / "SOURCE").write_text(f"{src.repo} {src.commit}\n{go_version(goroot)}\n{took:.0f}s\n")
        return out, took
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kubeedge", help=f"git directory holding {KUBELET.repo} {KUBELET.commit}")
    ap.add_argument("--device-plugin", help=f"git directory holding {DEVICE_PLUGIN.repo} {DEVICE_PLUGIN.commit}")
    args = ap.parse_args()
    missing = 0
    for src, given in ((KUBELET, args.kubeedge), (DEVICE_PLUGIN, args.device_plugin)):
        git_dir = source_dir(src, given)
        if git_dir is None:
            print(f"{src.name}: no git directory holds {src.repo} {src.commit} (option or {src.env})")
            missing += 1
            continue
        out, took = build(src, git_dir)
        print(f"{src.name}: {out} ({'cached' if not took else f'built in {took:.0f}s'})")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
