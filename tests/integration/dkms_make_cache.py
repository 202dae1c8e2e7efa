#!/usr/bin/python3
"""`make` for DKMS builds inside the driver test hosts: each build's result shared by every host that builds the same
module from the same inputs, once per machine (issue 37: NVIDIA's real build is the suite's biggest cost, and
several hosts build the same flavour, version and kernel).

Mounted as `make` in a directory of its own ahead of /usr/bin on the hosts' PATH and on apt's DPkg::Path, in the
hosts of tests/integration/driver_hosts.py (dkms_build_cache), with the cache at /var/cache/gpuprov-dkms (a directory
of the machine's, tests/shared_builds.py's CACHE). Everything else passes straight to /usr/bin/make.

What it caches: the build DKMS runs in a module's build directory (/var/lib/dkms/MODULE/VERSION/build, a fresh copy
of the module's source each time), not `make clean`, not a make inside a make. The key is everything the build's
result depends on:
- the build directory's files (names, modes, bytes; DKMS's own make.log left out: it holds the date),
- make's arguments (the job count left out: it changes how fast, not what),
- the variables a kernel module build reads (CC, ARCH, KCFLAGS, KBUILD_*, NV_*, ...),
- the installed versions of the kernel headers it builds against, kbuild, and the compiler and binutils,
- the machine.
The result is what DKMS reads of a build: its exit status, its output (DKMS writes it to make.log, where gpuprov
reads the compiler's first error), and every .ko it made, restored to the same place. A failed build is kept too:
it fails again, the same way, from the same inputs. DKMS then strips, signs (the host's own key) and installs the
modules as after any build. Each use is a line in uses.log (built or reused, the module, the seconds), which the
suite's summary counts.

A second host asking for a build that another is making waits for it (an flock per key) and reuses it."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

REAL_MAKE = "/usr/bin/make"
CACHE = "/var/cache/gpuprov-dkms"
ACTIVE = "GPUPROV_DKMS_CACHE_ACTIVE"  # set while a cached build runs: the makes it starts pass straight through
BUILD_DIR = re.compile(r"^/var/lib/dkms/([^/]+)/([^/]+)/build$")
NOT_CACHED_TARGETS = {"clean", "distclean", "mrproper", "install", "modules_install", "help"}
ENV_KEYS = re.compile(r"^(CC|CXX|LD|AR|NM|OBJCOPY|ARCH|SRCARCH|CROSS_COMPILE|LLVM|LLVM_IAS|KCFLAGS|KCPPFLAGS|KAFLAGS|"
                      r"CFLAGS.*|LDFLAGS.*|KBUILD_.*|KERNEL.*|SYSSRC|SYSOUT|IGNORE_.*|NV_.*|INSTALL_MOD_.*)$")
TOOLCHAIN = re.compile(r"^(linux-kbuild-.*|linux-compiler-.*|gcc(-\d+)?|cpp(-\d+)?|libgcc-\d+-dev|binutils.*|"
                       r"libc6-dev|make|dwarves|libelf-dev|libssl-dev|kmod)$")
KERNEL_ARG = re.compile(r"^(?:KERNELRELEASE|KERNEL_UNAME|KVER|KERNELVER|kernelver)=(.+)$")


def passthrough() -> None:
    os.execv(REAL_MAKE, [REAL_MAKE, *sys.argv[1:]])


def wanted(cwd: str, args: list[str]) -> re.Match | None:
    """The DKMS build directory's match when this make is a module build DKMS runs there, else None."""
    m = BUILD_DIR.match(cwd)
    if not m or os.environ.get(ACTIVE) or not os.path.isdir(CACHE):
        return None
    if NOT_CACHED_TARGETS & set(args) or "-f" in args or any(a.startswith(("-f", "--file", "--makefile")) for a in args):
        return None
    return m


def normal_args(args: list[str]) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in ("-j", "--jobs"):
            skip = i + 1 < len(args) and args[i + 1].isdigit()
            continue
        if re.fullmatch(r"-j\d*|--jobs=\d+", a):
            continue
        out.append(a)
    return out


def kernel_of(args: list[str]) -> str | None:
    for a in args:
        m = KERNEL_ARG.match(a)
        if m:
            return m.group(1)
        m = re.search(r"/lib/modules/([^/]+)/build|/usr/src/linux-headers-([^/ ]+)", a)
        if m:
            return m.group(1) or m.group(2)
    return None


def packages(kernel: str | None) -> str:
    """The installed headers (of KERNEL's ABI where known) and toolchain, `name version` a line."""
    out = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev} ${Package} ${Version}\n"],
                         capture_output=True, text=True, check=True).stdout
    abi = re.sub(r"-[a-z][a-z0-9]*$", "", kernel) if kernel else None  # 6.1.0-50-amd64 -> 6.1.0-50
    keep = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) != 3 or not parts[0].startswith("i"):
            continue
        name = parts[1].split(":")[0]
        if (name.startswith("linux-headers-") and (abi is None or abi in name)) or TOOLCHAIN.match(name):
            keep.append(f"{name} {parts[2]}")
    return "\n".join(sorted(keep))


def tree_hash(top: str) -> str:
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for f in sorted(filenames):
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, top)
            if rel == "make.log":
                continue
            st = os.lstat(path)
            h.update(f"{rel}\0{st.st_mode:o}\0".encode())
            if os.path.islink(path):
                h.update(os.readlink(path).encode())
            elif os.path.isfile(path):
                with open(path, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
    return h.hexdigest()


def key_of(cwd: str, args: list[str]) -> tuple[str, dict]:
    kernel = kernel_of(args)
    inputs = {"args": normal_args(args), "env": {k: v for k, v in sorted(os.environ.items()) if ENV_KEYS.match(k)},
              "packages": packages(kernel), "machine": os.uname().machine, "kernel": kernel, "tree": tree_hash(cwd)}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24], inputs


def run_and_keep(cwd: str, args: list[str], entry: str, inputs: dict) -> int:
    """Run the real build, teeing its output, then keep its status, output and modules under ENTRY (atomically)."""
    env = dict(os.environ, **{ACTIVE: "1"})
    p = subprocess.Popen([REAL_MAKE, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out = bytearray()
    for chunk in iter(lambda: p.stdout.read1(65536), b""):
        sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        out += chunk
    rc = p.wait()
    tmp = tempfile.mkdtemp(dir=CACHE, prefix=".tmp-")
    with tarfile.open(os.path.join(tmp, "modules.tar"), "w") as tar:
        for dirpath, _, filenames in os.walk(cwd):
            for f in sorted(filenames):
                if f.endswith(".ko"):
                    tar.add(os.path.join(dirpath, f), arcname=os.path.relpath(os.path.join(dirpath, f), cwd))
    with open(os.path.join(tmp, "output"), "wb") as fh:
        fh.write(out)
    with open(os.path.join(tmp, "inputs.json"), "w") as fh:
        json.dump({**inputs, "rc": rc}, fh, indent=1)
    os.chmod(tmp, 0o755)
    os.rename(tmp, entry)
    return rc


def replay(cwd: str, entry: str) -> int:
    with open(os.path.join(entry, "output"), "rb") as fh:
        sys.stdout.buffer.write(fh.read())
    sys.stdout.buffer.flush()
    with tarfile.open(os.path.join(entry, "modules.tar")) as tar:
        for m in tar.getmembers():  # our own archive, but never write outside the build directory
            if not m.isfile() or m.name.startswith("/") or ".." in m.name.split("/"):
                continue
            tar.extract(m, cwd, set_attrs=False)
    with open(os.path.join(entry, "inputs.json")) as fh:
        return json.load(fh)["rc"]


def main() -> int:
    cwd, args = os.getcwd(), sys.argv[1:]
    m = wanted(cwd, args)
    if not m:
        passthrough()
    key, inputs = key_of(cwd, args)
    entry = os.path.join(CACHE, key)
    t0 = time.monotonic()
    fd = os.open(entry + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a host making this build now: wait for it, then reuse it
    waited = time.monotonic() - t0
    if os.path.isdir(entry):
        how, rc = "reused", replay(cwd, entry)
    else:
        how, rc = "built", run_and_keep(cwd, args, entry, inputs)
    os.close(fd)
    with open(os.path.join(CACHE, "uses.log"), "a") as fh:
        fh.write(json.dumps({"how": how, "key": key, "module": m.group(1), "version": m.group(2),
                             "kernel": inputs["kernel"], "rc": rc, "seconds": round(time.monotonic() - t0, 1),
                             "waited": round(waited, 1), "host": os.uname().nodename, "at": time.time()}) + "\n")
    return rc


if __name__ == "__main__":
    if not shutil.which(REAL_MAKE):
        sys.exit("make: /usr/bin/make is not installed")
    sys.exit(main())
