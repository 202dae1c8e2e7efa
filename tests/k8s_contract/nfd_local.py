"""How Node Feature Discovery's local source reads a features.d file, transliterated from its Go source
(kubernetes-sigs/node-feature-discovery, source/local/local.go at a650db05eccd1755417188498717f1e3f696cfb0):
hidden files are skipped, files over 64 KiB are skipped, lines are trimmed, '#' lines are comments or
'# +directive' lines (expiry-time, no-label, no-feature), `key=value` splits at the first '=', a bare key means
"true"."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

MAX_FEATURE_FILE_SIZE = 65536


def parse_feature_file(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    expiry = None
    skip_label = False
    for raw in text.split("\n"):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            if line.startswith("# +"):
                key, _, value = line[3:].partition("=")
                if key == "expiry-time":
                    expiry = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
                elif key == "no-label":
                    skip_label = True
                elif key != "no-feature":
                    raise ValueError(f"unknown feature file directive {key!r}")
            continue
        if expiry is not None and expiry < datetime.now(timezone.utc):
            continue
        key, sep, value = line.partition("=")
        if skip_label:
            labels.pop(key, None)
        else:
            labels[key] = value if sep else "true"
        skip_label = False
    return labels


def read_features_dir(d: Path) -> dict[str, str]:
    labels: dict[str, str] = {}
    for f in sorted(d.iterdir()):
        if f.name.startswith(".") or not f.is_file() or f.stat().st_size > MAX_FEATURE_FILE_SIZE:
            continue
        labels.update(parse_feature_file(f.read_text()))
    return labels
