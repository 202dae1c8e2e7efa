"""kubelet and NVIDIA's k8s-device-plugin, built here from public source, offline, and cached.

Debian packages no kubelet, and Kubernetes' own repository is too large to bring here; KubeEdge's repository vendors
Kubernetes' kubelet (`k8s.io/kubernetes/cmd/kubelet/app`, from KubeEdge's fork tagged v1.32.10-kubeedge1), so a
five-line `main` beside its `vendor/` builds an upstream-shaped kubelet with `-mod=vendor` and nothing downloaded.
NVIDIA's k8s-device-plugin vendors its modules too. Go is Debian's (`golang-1.26-go` + `golang-1.26-src` from sid,
unpacked with `dpkg -x`: bookworm's 1.19 is too old for both); Debian's archive is the only thing reached.

Each source is pinned to one commit (a git directory holding it: the `fetch` tool's copy of the public repository,
named by --kubeedge / --device-plugin or GPUPROV_KUBEEDGE_GIT / GPUPROV_DEVICE_PLUGIN_GIT). CI reaches no code host,
so for kubelet the repository may carry the subset of that commit that its build reads (--export-kubelet-subset
writes tests/k8s/kubelet-<commit>-src.tar.xz; used when no git directory is named). Builds are cached under
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

from tests.cri.harness import newer_packages
from tests.shared_builds import CACHE, once

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


# KubeEdge's fork changes two things a standalone kubelet needs (edged hands them over in code), put back as
# upstream has them (v1.32.10): NewKubeletCommand parses --config and then ignores it (the lines that load the file
# are gone; the fork's loadConfigFile and kubeletConfigFlagPrecedence are still there), and NewMainKubelet refuses to
# start without a pod source config from its caller instead of making one (for static pods).
_CONFIG_ANCHOR = "\t\t\tverflag.PrintAndExitIfRequested()\n"
_NO_PODCONFIG = """\t} else {
\t\treturn nil, fmt.Errorf("KubeDeps.Podconfig is nil,static pod path list-watch failed")
\t}
"""
KUBELET_PATCHES = (
    ("vendor/k8s.io/kubernetes/cmd/kubelet/app/server.go", _CONFIG_ANCHOR, _CONFIG_ANCHOR + """
\t\t\t// load kubelet config file, if provided (upstream's lines, put back by gpuprov's tests/k8s/build.py)
\t\t\tif len(kubeletFlags.KubeletConfigFile) > 0 {
\t\t\t\tkubeletConfig, err = loadConfigFile(kubeletFlags.KubeletConfigFile)
\t\t\t\tif err != nil {
\t\t\t\t\treturn fmt.Errorf("failed to load kubelet config file, path: %s, error: %w", kubeletFlags.KubeletConfigFile, err)
\t\t\t\t}
\t\t\t\t// flags win over the file (upstream: issue #56171)
\t\t\t\tif err := kubeletConfigFlagPrecedence(kubeletConfig, args); err != nil {
\t\t\t\t\treturn fmt.Errorf("failed to precedence kubeletConfigFlag: %w", err)
\t\t\t\t}
\t\t\t}
"""),
    ("vendor/k8s.io/kubernetes/pkg/kubelet/kubelet.go", _NO_PODCONFIG, """\t} else {
\t\t// upstream's: no pod source from the caller, so make one (static pods; put back by gpuprov's tests)
\t\tkubeDeps.PodConfig = config.NewPodConfig(config.PodConfigNotificationIncremental, kubeDeps.Recorder,
\t\t\tkubeDeps.PodStartupLatencyTracker)
\t\tmakePodSourceConfig(kubeDeps.PodConfig, kubeCfg, kubeDeps, nodeName, nodeHasSynced)
\t}
"""),
)


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
    patch: str = ""  # a tag for what unpack() changes (part of the cache key)

    @property
    def key(self) -> str:
        return f"{self.name}-{self.commit[:12]}{self.patch}"


KUBELET = Source("kubelet", "kubeedge/kubeedge", "16cd8548eedb81af293b94f27844144c080eaa89", "GPUPROV_KUBEEDGE_GIT",
                 ("LICENSE", "go.mod", "go.sum", "vendor"), "./cmd/gpuprov-kubelet", False,
                 "k8s.io/component-base/version.gitVersion=v1.32.10-kubeedge1", "-patch2")
DEVICE_PLUGIN = Source("nvidia-device-plugin", "NVIDIA/k8s-device-plugin", "1b826acc6af3079d8923bac395c3124b8861a9a6",
                       "GPUPROV_DEVICE_PLUGIN_GIT", ("go.mod", "go.sum", "vendor", "api", "cmd", "internal"),
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


def subset_archive(src: Source) -> Path:
    return Path(__file__).with_name(f"{src.key}-src.tar.xz")


def source_dir(src: Source, git_dir: str | None) -> str | None:
    """A git directory that holds `src.commit`, else the repository's subset archive of it, else None."""
    for cand in (git_dir, os.environ.get(src.env)):
        if cand and subprocess.run(["git", "--git-dir", cand, "cat-file", "-e", f"{src.commit}^{{commit}}"],
                                   capture_output=True).returncode == 0:
            return cand
    return str(subset_archive(src)) if subset_archive(src).exists() else None


def licenses(work: Path, files: set[str]) -> set[str]:
    """The license and notice files of every vendored module that `files` take something from (the archive is
    redistributed source: each module's terms travel with it)."""
    roots = [ln.split()[1] for ln in (work / "vendor/modules.txt").read_text().splitlines() if ln.startswith("# ")]
    used = {r for r in roots if any(f.startswith(f"vendor/{r}/") for f in files)}
    return {f"vendor/{r}/{n.name}" for r in used for n in (work / "vendor" / r).glob("*")
            if n.is_file() and n.name.upper().startswith(("LICENSE", "LICENCE", "NOTICE", "COPYING", "PATENTS"))}


_LIST = ('{{if not .Standard}}{{.Dir}}|{{join .GoFiles ","}},{{join .CgoFiles ","}},{{join .SFiles ","}},'
         '{{join .HFiles ","}},{{join .CFiles ","}},{{join .EmbedFiles ","}}{{end}}')


def export_subset(src: Source, git_dir: str) -> Path:
    """Only the files `go build` reads for `src.package` at the pinned commit (`go list -deps`: each non-standard
    package's Go, cgo, assembly, C and embedded files) with go.mod, go.sum and vendor/modules.txt, as an xz tar beside
    this script: what an offline build needs when the public repository cannot be brought (CI)."""
    goroot, dest = go_root(), subset_archive(src)
    work = Path(tempfile.mkdtemp(prefix=f"gpuprov-subset-{src.name}-", dir=CACHE))
    try:
        unpack(src, git_dir, work)
        listed = subprocess.run(["go", "list", "-deps", "-f", _LIST, src.package], cwd=work, check=True, text=True,
                                capture_output=True, env=go_env(goroot, work, src.cgo)).stdout
        files = {"LICENSE", "go.mod", "go.sum", "vendor/modules.txt"}
        for line in filter(None, listed.splitlines()):
            d, names = line.split("|")
            rel = os.path.relpath(d, work)
            files.update(f"{rel}/{n}" for n in names.split(",") if n)
        files |= licenses(work, files)
        names = "".join(f"{f}\n" for f in sorted(files))
        subprocess.run(["tar", "--sort=name", "--mtime=@0", "--owner=0", "--group=0", "--numeric-owner", "-C",
                        str(work), "-cJf", str(dest), "-T", "-"], input=names, text=True, check=True,
                       env={**os.environ, "XZ_OPT": "-9"})
        return dest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def absent_files(git_dir: str, src: Source) -> list[str]:
    """Files of the pinned commit whose contents the git directory lacks (`fetch`'s copy leaves out its largest
    files: seen, go-sqlite3's amalgamation, which neither binary builds)."""
    tree = subprocess.run(["git", "--git-dir", git_dir, "ls-tree", "-r", "-z", src.commit, *src.paths],
                          capture_output=True, check=True, text=True).stdout.split("\0")
    entries = [(line.split()[2], line.split("\t", 1)[1]) for line in tree if line and " blob " in line]
    check = subprocess.run(["git", "--git-dir", git_dir, "cat-file", "--batch-check"], capture_output=True,
                           check=True, text=True, input="".join(f"{obj}\n" for obj, _ in entries)).stdout
    return [path for (_, path), line in zip(entries, check.splitlines()) if line.endswith(" missing")]


def unpack(src: Source, origin: str, work: Path) -> None:
    """`src`'s pinned tree into `work`, from a git directory or from a subset archive (export_subset's)."""
    if origin.endswith(".tar.xz"):
        subprocess.run(["tar", "-xJf", origin, "-C", str(work)], check=True)
        return  # the subset was exported patched
    archive = subprocess.Popen(["git", "--git-dir", origin, "archive", src.commit, *src.paths,
                                *(f":(exclude){p}" for p in absent_files(origin, src))], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(work)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {src.commit} failed in {origin}")
    if src is KUBELET:
        (work / "cmd/gpuprov-kubelet").mkdir(parents=True)
        (work / "cmd/gpuprov-kubelet/main.go").write_text(KUBELET_MAIN)
        for rel, old, new in KUBELET_PATCHES:
            text = (work / rel).read_text()
            if text.count(old) != 1:
                raise RuntimeError(f"{rel}: not the fork's file this patch was written for")
            (work / rel).write_text(text.replace(old, new))


def go_env(goroot: Path, work: Path, cgo: bool) -> dict[str, str]:
    return {"PATH": f"{goroot}/bin:/usr/bin:/bin", "HOME": str(work), "GOROOT": str(goroot),
            "GOFLAGS": "-mod=vendor", "GOPROXY": "off", "GOTOOLCHAIN": "local", "GOTELEMETRY": "off",
            "GOCACHE": str(CACHE / "go-build-cache"), "GOPATH": str(work / ".gopath"), "CGO_ENABLED": "1" if cgo else "0"}


def build(src: Source, origin: str) -> tuple[Path, float]:
    """Builds `src` at its pinned commit with Debian's Go, from a git directory or a subset archive; returns the
    binary and the seconds the build took (0 when it was cached)."""
    goroot = go_root()
    out = BIN / f"{src.key}-{go_version(goroot)}" / src.name
    if out.exists():
        return out, 0.0
    with once(str(out)):
        return (out, 0.0) if out.exists() else _build(src, origin, goroot, out)


def _build(src: Source, origin: str, goroot: Path, out: Path) -> tuple[Path, float]:
    work = Path(tempfile.mkdtemp(prefix=f"gpuprov-build-{src.name}-", dir=CACHE))
    try:
        unpack(src, origin, work)
        env = go_env(goroot, work, src.cgo)
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
    ap.add_argument("--export-kubelet-subset", action="store_true",
                    help=f"write {subset_archive(KUBELET).name} (what CI builds kubelet from) from the git directory")
    args = ap.parse_args()
    if args.export_kubelet_subset:
        git_dir = source_dir(KUBELET, args.kubeedge)
        if not git_dir or git_dir.endswith(".tar.xz"):
            print(f"kubelet: no git directory holds {KUBELET.repo} {KUBELET.commit}")
            return 1
        out = export_subset(KUBELET, git_dir)
        print(f"kubelet: {out} ({out.stat().st_size >> 10} KiB)")
        return 0
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
