"""Docker CE's packages stood in for (Docker's archive is not reachable here): `docker-ce`, `docker-ce-cli` and
`containerd.io` built with `dpkg-deb -b` around Debian's real dockerd/docker/containerd/ctr/runc binaries, with Docker
CE's names, epoch-5 versions, Conflicts/Replaces/Provides and units, laid out as Docker's packages lay them out
(/usr/bin/dockerd, runc inside containerd.io, containerd.io's config.toml with the CRI plugin disabled). apt then
resolves on a host holding them exactly as on a real Docker CE host: Debian's docker.io or containerd would remove
them.

Built on this machine from `apt-get download` of Debian's docker.io, containerd and runc, cached under
/tmp/gpuprov-dockerce-<key>: the key covers this file and the Debian versions used, so a change to either rebuilds.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.shared_builds import once

DOCKER_VERSION = "5:28.0.1-1~debian.12~bookworm"
CONTAINERD_VERSION = "1.7.25-1"
SOURCES = ("docker.io", "containerd", "runc")  # Debian's packages whose binaries go in

DOCKER_SERVICE = """\
[Unit]
Description=Docker Application Container Engine
After=network-online.target nss-lookup.target docker.socket firewalld.service containerd.service time-set.target
Wants=network-online.target containerd.service
Requires=docker.socket

[Service]
Type=notify
ExecStart=/usr/bin/dockerd -H fd:// --containerd=/run/containerd/containerd.sock
ExecReload=/bin/kill -s HUP $MAINPID
TimeoutStartSec=0
RestartSec=2
Restart=always
StartLimitBurst=3
StartLimitInterval=60s
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity
Delegate=yes
KillMode=process
OOMScoreAdjust=-500

[Install]
WantedBy=multi-user.target
"""
DOCKER_SOCKET = """\
[Unit]
Description=Docker Socket for the API

[Socket]
ListenStream=/run/docker.sock
SocketMode=0660
SocketUser=root
SocketGroup=docker

[Install]
WantedBy=sockets.target
"""
CONTAINERD_SERVICE = """\
[Unit]
Description=containerd container runtime
After=network.target local-fs.target dbus.service

[Service]
ExecStartPre=-/sbin/modprobe overlay
ExecStart=/usr/bin/containerd
Type=notify
Delegate=yes
KillMode=process
Restart=always
RestartSec=5
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity
OOMScoreAdjust=-999

[Install]
WantedBy=multi-user.target
"""
# containerd.io's own /etc/containerd/config.toml (a conffile): the CRI plugin off, as Docker ships it
CONTAINERD_CONFIG = """\
#   Copyright 2018-2022 Docker Inc.

#   Licensed under the Apache License, Version 2.0 (the "License");
#   you may not use this file except in compliance with the License.

disabled_plugins = ["cri"]

#root = "/var/lib/containerd"
#state = "/run/containerd"
"""
POSTINST = """\
#!/bin/sh
set -e
if [ "$1" = configure ]; then
{body}
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload
        systemctl enable {units} >/dev/null 2>&1 || true
        systemctl start {start} || true
    fi
fi
"""
PACKAGES = {
    "containerd.io": dict(
        version=CONTAINERD_VERSION, depends="libc6 (>= 2.34), libseccomp2 (>= 2.5.0)",
        extra="Provides: containerd, runc\nConflicts: containerd, runc\nReplaces: containerd, runc\n",
        files={"usr/bin/containerd": "usr/bin/containerd", "usr/bin/containerd-shim-runc-v2":
               "usr/bin/containerd-shim-runc-v2", "usr/bin/ctr": "usr/bin/ctr", "usr/bin/runc": "usr/sbin/runc"},
        texts={"lib/systemd/system/containerd.service": CONTAINERD_SERVICE,
               "etc/containerd/config.toml": CONTAINERD_CONFIG},
        conffiles=("/etc/containerd/config.toml",), postinst=("    :", "containerd.service", "containerd.service")),
    "docker-ce-cli": dict(
        version=DOCKER_VERSION, depends="libc6 (>= 2.34)",
        extra="Conflicts: docker (<< 1.5~), docker-engine, docker.io\nReplaces: docker-ce (<< 5:0), docker-engine, "
              "docker.io\n",
        files={"usr/bin/docker": "usr/bin/docker"}, texts={}, conffiles=(), postinst=None),
    "docker-ce": dict(
        version=DOCKER_VERSION,
        depends="containerd.io (>= 1.7.24), docker-ce-cli, iptables, libc6 (>= 2.34), libdevmapper1.02.1, "
                "libsystemd0, adduser",
        extra="Conflicts: docker (<< 1.5~), docker-engine, docker-engine-cs, docker.io, lxc-docker, "
              "lxc-docker-virtual-package\nReplaces: docker-engine\n",
        files={"usr/bin/dockerd": "usr/sbin/dockerd", "usr/bin/docker-proxy": "usr/sbin/docker-proxy"},
        texts={"lib/systemd/system/docker.service": DOCKER_SERVICE, "lib/systemd/system/docker.socket": DOCKER_SOCKET},
        conffiles=(), postinst=("    getent group docker >/dev/null || addgroup --system docker",
                                "docker.socket docker.service", "docker.service")),
}


def _sh(*argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=True, **kw)


def source_versions() -> str:
    return _sh("dpkg-query", "-W", "-f", "${Package} ${Version}\n", *SOURCES).stdout if shutil.which("dpkg-query") \
        else ""


def _candidates() -> str:
    out = _sh("apt-cache", "show", "--no-all-versions", *SOURCES).stdout
    return "\n".join(ln for ln in out.splitlines() if ln.startswith(("Package:", "Version:")))


def build(cache_root: Path = Path(tempfile.gettempdir())) -> Path:
    """The directory holding the three .debs (built once per key)."""
    key = hashlib.sha256((Path(__file__).read_text() + _candidates()).encode()).hexdigest()[:16]
    out = cache_root / f"gpuprov-dockerce-{key}"
    if (out / ".done").exists():
        return out
    with once(str(out)):
        if not (out / ".done").exists():
            _build(out, key)
    return out


def _build(out: Path, key: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        (tmp / "dl").mkdir()
        _sh("apt-get", "download", *SOURCES, cwd=tmp / "dl", timeout=600)
        src = tmp / "src"
        for deb in (tmp / "dl").glob("*.deb"):
            _sh("dpkg-deb", "-x", str(deb), str(src))
        debs = tmp / "debs"
        debs.mkdir()
        for name, p in PACKAGES.items():
            _package(src, tmp / name, debs, name, p)
        shutil.copytree(debs, out)
    (out / ".done").write_text(key)


def _package(src: Path, tree: Path, debs: Path, name: str, p: dict) -> None:
    for dst, s in p["files"].items():
        (tree / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / s, tree / dst)
    for dst, text in p["texts"].items():
        (tree / dst).parent.mkdir(parents=True, exist_ok=True)
        (tree / dst).write_text(text)
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: {p['version']}\nArchitecture: amd64\nMaintainer: gpuprov tests "
        f"(stand-in for Docker's package) <tests@gpuprov.invalid>\nDepends: {p['depends']}\n{p['extra']}"
        f"Section: admin\nPriority: optional\nDescription: stand-in for Docker's {name} package\n"
        " Debian's binaries under Docker CE's package name, version and relations.\n")
    if p["conffiles"]:
        (tree / "DEBIAN/conffiles").write_text("\n".join(p["conffiles"]) + "\n")
    if p["postinst"]:
        body, units, start = p["postinst"]
        (tree / "DEBIAN/postinst").write_text(POSTINST.format(body=body, units=units, start=start))
        (tree / "DEBIAN/postinst").chmod(0o755)
    _sh("dpkg-deb", "--root-owner-group", "-Znone", "-b", str(tree), str(debs / f"{name}.deb"), timeout=600)
