#!/usr/bin/env python3
"""Debian's `nvidia-detect` package, per suite: fetch it, vendor its id lists, run its script.

    scripts/debian_nvidia_detect.py fetch DEST [--suite S ...]   # nvidia-detect .debs unpacked under DEST/<suite>/
    scripts/debian_nvidia_detect.py regen [--from DEST]          # rewrite provision/data/debian_nvidia_ids.json

`fetch` uses apt itself with a private configuration and state (under DEST/.apt): the suites' contrib/non-free
entries are added there, never to the host's own sources, so the host's apt is left as it was. The mirror is the
one the host's own Debian entries use. `regen` names the package version each suite's lists came from.

The integration test tests/integration/test_driver_debian_detect.py runs the real `nvidia-detect` script from
these packages over every id in their lists and holds gpuprov's decisions against it.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "provision" / "data" / "debian_nvidia_ids.json"
SUITES = ("bullseye", "bookworm", "trixie")
IDS_DIR = "usr/share/nvidia"


def host_mirror() -> str:
    """The Debian archive URI the host's own apt entries use (deb822 or one-line format)."""
    srcs = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for p in srcs:
        try:
            text = p.read_text()
        except OSError:
            continue
        for m in re.finditer(r"^URIs:\s*(\S+)|^deb\s+(?:\[[^]]*\]\s+)?(\S+)", text, re.M):
            uri = m.group(1) or m.group(2)
            if uri.rstrip("/").endswith("/debian"):
                return uri
    raise SystemExit("no Debian archive entry in the host's apt sources: pass --mirror URI")


def apt_config(dest: Path, mirror: str, suites: tuple[str, ...]) -> dict:
    """A private apt (config, lists, cache) under DEST/.apt; returns the environment that selects it."""
    base = (dest / ".apt").resolve()
    for d in ("etc/sources.list.d", "etc/preferences.d", "etc/apt.conf.d", "state/lists/partial",
              "cache/archives/partial"):
        (base / d).mkdir(parents=True, exist_ok=True)
    (base / "etc/sources.list.d/debian.sources").write_text(
        "Types: deb\n"
        f"URIs: {mirror}\n"
        f"Suites: {' '.join(suites)}\n"
        "Components: main contrib non-free\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
    (base / "apt.conf").write_text(
        f'Dir::Etc "{base}/etc";\nDir::Etc::sourcelist "/dev/null";\n'
        f'Dir::Etc::sourceparts "{base}/etc/sources.list.d";\nDir::State "{base}/state";\n'
        f'Dir::State::status "/var/lib/dpkg/status";\nDir::Cache "{base}/cache";\n'
        'APT::Architecture "amd64";\nAPT::Sandbox::User "root";\n')
    return {"APT_CONFIG": str(base / "apt.conf"), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def fetch(dest: Path, suites: tuple[str, ...] = SUITES, versions: dict[str, str] | None = None,
          mirror: str | None = None) -> dict[str, str]:
    """Download and unpack nvidia-detect for each suite into DEST/<suite>; returns suite -> package version."""
    dest.mkdir(parents=True, exist_ok=True)
    env = apt_config(dest, mirror or host_mirror(), suites)
    subprocess.run(["apt-get", "update", "-q"], env=env, check=True, capture_output=True, timeout=600)
    out = {}
    for suite in suites:
        want = (versions or {}).get(suite)
        spec = f"nvidia-detect={want}" if want else f"nvidia-detect/{suite}"
        dl = dest / ".deb" / suite
        dl.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["apt-get", "download", "-q", spec], env=env, cwd=dl, capture_output=True, text=True,
                           timeout=600)
        if r.returncode != 0:
            raise SystemExit(f"apt-get download {spec} failed: {r.stderr.strip().splitlines()[-1:]}"
                             " (the archive moved on: run `scripts/debian_nvidia_detect.py regen`)")
        deb = sorted(dl.glob("nvidia-detect_*.deb"))[-1]
        subprocess.run(["dpkg-deb", "-x", str(deb), str(dest / suite)], check=True)
        out[suite] = deb.name.split("_")[1].replace("%3a", ":")
    return out


def read_lists(root: Path) -> dict[str, str]:
    """list name (file name without .ids) -> sorted device ids (10de implied), space separated."""
    lists = {}
    for f in sorted((root / IDS_DIR).glob("*.ids")):
        ids = sorted({ln.strip().lower() for ln in f.read_text().split() if ln.strip()})
        bad = [i for i in ids if not re.fullmatch(r"10de[0-9a-f]{4}", i)]
        if bad:
            raise SystemExit(f"{f}: unexpected ids {bad[:3]} (only NVIDIA's vendor 10de is vendored)")
        lists[f.name.removesuffix(".ids")] = " ".join(i[4:] for i in ids)
    return lists


def regen(src: Path, versions: dict[str, str]) -> dict:
    doc = {"generated_by": "scripts/debian_nvidia_detect.py regen",
           "about": "Debian's nvidia-detect id lists (/usr/share/nvidia/*.ids) per suite; device ids of vendor "
                    "10de, space separated",
           "suites": {}}
    for suite in SUITES:
        doc["suites"][suite] = {"nvidia_detect": versions[suite], "lists": read_lists(src / suite)}
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("dest", type=Path)
    f.add_argument("--suite", action="append", choices=SUITES)
    f.add_argument("--vendored", action="store_true", help="the exact versions the vendored lists name")
    f.add_argument("--mirror")
    r = sub.add_parser("regen")
    r.add_argument("--dest", type=Path, default=Path("/tmp/gpuprov-nvidia-detect"))
    r.add_argument("--mirror")
    args = ap.parse_args(argv)
    if args.cmd == "fetch":
        versions = None
        if args.vendored:
            versions = {s: v["nvidia_detect"] for s, v in json.loads(DATA.read_text())["suites"].items()}
        got = fetch(args.dest, tuple(args.suite or SUITES), versions, args.mirror)
        print(json.dumps(got))
        return 0
    versions = fetch(args.dest, SUITES, None, args.mirror)
    doc = regen(args.dest, versions)
    DATA.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {DATA}: " + ", ".join(f"{s} nvidia-detect {v}" for s, v in versions.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
