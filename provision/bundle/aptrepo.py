"""A flat apt repository (Packages + Release) written in Python from the .debs' own control data (dpkg-deb),
and the apt options that make apt use that repository alone."""
from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

from provision import effects


def control(deb: Path) -> str:
    return effects.run(["dpkg-deb", "-f", str(deb)]).output.strip()


def write_flat_repo(repo: Path) -> list[dict]:
    """Packages(.gz) and Release for every .deb in `repo`; returns [{package, version, filename}]."""
    stanzas, index = [], []
    for deb in sorted(repo.glob("*.deb")):
        data = deb.read_bytes()
        ctl = control(deb)
        fields = dict(line.split(": ", 1) for line in ctl.splitlines() if ": " in line and not line.startswith(" "))
        stanzas.append(f"{ctl}\nFilename: ./{deb.name}\nSize: {len(data)}\n"
                       f"MD5sum: {hashlib.md5(data).hexdigest()}\nSHA256: {hashlib.sha256(data).hexdigest()}\n")
        index.append({"package": fields.get("Package"), "version": fields.get("Version"), "filename": deb.name})
    packages = "\n".join(stanzas)
    (repo / "Packages").write_text(packages)
    (repo / "Packages.gz").write_bytes(gzip.compress(packages.encode(), mtime=0))
    lines = ["Origin: gpuprov", "Label: gpuprov offline bundle", "Suite: gpuprov", "Codename: gpuprov",
             "Architectures: amd64 all", "SHA256:"]
    for name in ("Packages", "Packages.gz"):
        b = (repo / name).read_bytes()
        lines.append(f" {hashlib.sha256(b).hexdigest()} {len(b)} {name}")
    (repo / "Release").write_text("\n".join(lines) + "\n")
    return index


def repo_packages(repo: Path) -> dict[str, str]:
    """package -> version from the repository's Packages file."""
    out, pkg = {}, None
    for line in (repo / "Packages").read_text().splitlines():
        if line.startswith("Package: "):
            pkg = line.split(": ", 1)[1]
        elif line.startswith("Version: ") and pkg:
            out[pkg] = line.split(": ", 1)[1]
    return out
