"""What an engine keeps under its data root (containers, images, volumes), read from the files it keeps there: for
`uninstall --purge-engine`, which must say what a package's purge would delete before it deletes anything (issue 39
item 1: Debian's docker.io purge wiped an operator's container, image and volume, exit 0).

Read-only and under `root` (a `--root` tree or the live host), so a stopped engine's store is counted as well as a
running one's; the adapters (provision/engines/) ask their live engine first where it runs, and fall back to these.
Every reader returns None where the data root is absent, and skips an entry it cannot parse rather than guessing:
an unreadable entry is still counted, by its directory's name."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from provision.facts.rootfs import read_bytes_bounded, under

# An engine's own index of its images or containers grows with them (a few hundred bytes each): far above MAX_READ's
# 4 MiB is still a real host's, so these reads get their own bound.
INDEX_LIMIT = 256 << 20
SHOWN = 5  # names shown per kind; the rest are counted ("and 12 more")


@dataclass(frozen=True)
class StoredData:
    """An engine's containers, images and volumes under `path`, by the names people use (a container's name, an
    image's tags or short id, a volume's name), and where the count came from (`source`: "the running dockerd", "the
    files under /var/lib/docker"). `note`: what could not be named (containerd's store without its daemon)."""
    path: str
    source: str
    containers: tuple[str, ...] = ()
    images: tuple[str, ...] = ()
    volumes: tuple[str, ...] = ()
    note: str = ""

    @property
    def empty(self) -> bool:
        return not (self.containers or self.images or self.volumes or self.note)

    def without(self, containers=(), images=()) -> StoredData:
        """The same, less the entries named (gpuprov's own)."""
        return replace(self, containers=tuple(c for c in self.containers if c not in containers),
                       images=tuple(i for i in self.images if i not in images))

    def counts(self, names: bool = True) -> str:
        """"2 containers (web, db), 1 image (op/app:1), 1 volume (opdata)"; "nothing" when empty."""
        parts = []
        for kind, items in (("container", self.containers), ("image", self.images), ("volume", self.volumes)):
            if not items:
                continue
            shown = ", ".join(items[:SHOWN]) + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")
            parts.append(f"{len(items)} {kind}{'s' if len(items) != 1 else ''}" + (f" ({shown})" if names else ""))
        parts += [self.note] if self.note else []
        return ", ".join(parts) or "nothing"

    def to_dict(self) -> dict:
        return {"path": self.path, "source": self.source, "containers": list(self.containers),
                "images": list(self.images), "volumes": list(self.volumes), "note": self.note}


def _json(path: Path) -> object:
    try:
        return json.loads(read_bytes_bounded(path, INDEX_LIMIT))
    except (OSError, ValueError):
        return None


def _dirs(path: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def short(image_id: str) -> str:
    """An untagged image as docker and podman show it: its id's first 12 hex digits."""
    return image_id.split(":")[-1][:12]


def repository(ref: str) -> str:
    """"localhost/gpuprov-validate:0.1.0-2" -> "gpuprov-validate": the last path part of the name, without its tag."""
    name = ref.rsplit("/", 1)[-1]
    return name.split("@")[0].split(":")[0]


def docker_store(root: Path, data_root: str, ours: str) -> StoredData | None:
    """dockerd's files under `data_root` (containers/ID/config.v2.json: name and image; image/DRIVER/repositories.json
    and imagedb: every image, tagged or not; volumes/NAME: named and anonymous volumes), less what is gpuprov's:
    images whose every tag is repository `ours` and the containers made from them."""
    top = under(root, data_root)
    if not top.is_dir():
        return None
    images: dict[str, list[str]] = {}
    own_ids: set[str] = set()
    for driver in _dirs(top / "image"):
        d = top / "image" / driver
        for hexid in _names(d / "imagedb/content/sha256"):
            images.setdefault(f"sha256:{hexid}", [])
        repos = _json(d / "repositories.json")
        for tags in ((repos or {}).get("Repositories") or {}).values() if isinstance(repos, dict) else ():
            for tag, image_id in (tags.items() if isinstance(tags, dict) else ()):
                images.setdefault(str(image_id), []).append(str(tag))
    for image_id, tags in images.items():
        if tags and all(repository(t) == ours for t in tags):
            own_ids.add(image_id)
    containers = []
    for cid in _dirs(top / "containers"):
        doc = _json(top / "containers" / cid / "config.v2.json")
        doc = doc if isinstance(doc, dict) else {}
        image = str(doc.get("Image") or "")
        asked = str((doc.get("Config") or {}).get("Image") or "") if isinstance(doc.get("Config"), dict) else ""
        if image in own_ids or (asked and repository(asked) == ours):
            continue
        containers.append(str(doc.get("Name") or "").lstrip("/") or cid[:12])
    named = sorted(", ".join(sorted(tags)) if tags else short(i) for i, tags in images.items() if i not in own_ids)
    return StoredData(data_root, f"the files under {data_root}", tuple(sorted(containers)), tuple(named),
                      tuple(_dirs(top / "volumes")))


def _names(path: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(path))
    except OSError:
        return []


def containers_storage(root: Path, graph_root: str, ours: str, volume_path: str | None = None) -> StoredData | None:
    """containers/storage's files under `graph_root` (Podman's, Buildah's, CRI-O's): DRIVER-containers/containers.json
    and DRIVER-images/images.json (each entry's id and names), and Podman's volumes (`volume_path`, by default
    GRAPHROOT/volumes), less gpuprov's images (every name of repository `ours`) and the containers made from them."""
    top = under(root, graph_root)
    if not top.is_dir():
        return None
    own_ids: set[str] = set()
    images = []
    for d in (n for n in _dirs(top) if n.endswith("-images")):
        for img in _json(top / d / "images.json") or []:
            if not isinstance(img, dict):
                continue
            names = [str(n) for n in img.get("names") or []]
            if names and all(repository(n) == ours for n in names):
                own_ids.add(str(img.get("id")))
                continue
            images.append(", ".join(sorted(names)) if names else short(str(img.get("id") or "")))
    containers = []
    for d in (n for n in _dirs(top) if n.endswith("-containers")):
        for c in _json(top / d / "containers.json") or []:
            if isinstance(c, dict) and str(c.get("image")) not in own_ids:
                containers.append((c.get("names") or [short(str(c.get("id") or ""))])[0])
    vols = _dirs(under(root, volume_path) if volume_path else top / "volumes")
    return StoredData(graph_root, f"the files under {graph_root}", tuple(sorted(map(str, containers))),
                      tuple(sorted(images)), tuple(vols))


def containerd_store(root: Path, data_root: str) -> StoredData | None:
    """containerd's files under `data_root`, where its daemon does not answer: its containers and image names are in
    its metadata database (bolt), which only the daemon reads, so what is counted is what lies on disk: content blobs
    (image layers and manifests) and snapshots (unpacked layers and containers' root filesystems)."""
    top = under(root, data_root)
    if not top.is_dir():
        return None
    blobs = len(_names(top / "io.containerd.content.v1.content/blobs/sha256"))
    snaps = sum(len(_dirs(top / d / "snapshots")) for d in _dirs(top) if d.startswith("io.containerd.snapshotter."))
    note = f"{blobs} content blobs and {snaps} snapshots (containerd is not running: only it names its images)" \
        if blobs or snaps else ""
    return StoredData(data_root, f"the files under {data_root}", note=note)
