"""A flat apt repository (Packages + Release) from the .debs' own control data (dpkg-deb), its index files
written by python-debian's deb822 classes (Packages stanzas, the Release file with its Date and checksums) rather
than by hand: a hand-written Release once lacked `Date`, and apt warned `Invalid 'Date' entry in Release file` on
every install from a bundle."""
from __future__ import annotations

import email.utils
import gzip
import hashlib
from pathlib import Path

from debian.deb822 import Deb822, Packages, Release

from provision import effects


def control(deb: Path) -> str:
    return effects.run(["dpkg-deb", "-f", str(deb)]).output.strip()


def write_flat_repo(repo: Path) -> list[dict]:
    """Packages(.gz) and Release for every .deb in `repo`; returns [{package, version, filename}]."""
    stanzas, index = [], []
    for deb in sorted(repo.glob("*.deb")):
        data = deb.read_bytes()
        stanza = Packages(Deb822(control(deb)))
        stanza.update({"Filename": f"./{deb.name}", "Size": str(len(data)), "MD5sum": hashlib.md5(data).hexdigest(),
                       "SHA256": hashlib.sha256(data).hexdigest()})
        stanzas.append(stanza.dump())
        index.append({"package": stanza.get("Package"), "version": stanza.get("Version"), "filename": deb.name})
    packages = "\n".join(stanzas)
    (repo / "Packages").write_text(packages)
    (repo / "Packages.gz").write_bytes(gzip.compress(packages.encode(), mtime=0))
    release = Release({"Origin": "gpuprov", "Label": "gpuprov offline bundle", "Suite": "gpuprov",
                       "Codename": "gpuprov", "Date": email.utils.formatdate(usegmt=True),
                       "Architectures": "amd64 all"})
    release["SHA256"] = [{"sha256": hashlib.sha256(b).hexdigest(), "size": str(len(b)), "name": name}
                         for name, b in ((n, (repo / n).read_bytes()) for n in ("Packages", "Packages.gz"))]
    (repo / "Release").write_text(release.dump())
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
