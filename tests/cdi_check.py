"""Validate a CDI spec against the upstream CDI JSON schema (vendored unchanged in tests/fixtures/cdi-schema, its
SOURCE file names the repository and commit). schema.json refers to defs.json by a relative $ref."""
from __future__ import annotations

import json

from tests.conftest import FIXTURES

SCHEMA_DIR = FIXTURES / "cdi-schema"


def validator():
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT7

    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=DRAFT7))
    return jsonschema.Draft7Validator(schema, registry=registry)


def validate(spec: dict) -> None:
    """Raises jsonschema.ValidationError when the spec does not conform."""
    validator().validate(spec)


def apply_spec(config: dict, spec: dict, names: list[str]) -> None:
    """What an engine does with a CDI spec (the tests stand in for one): the spec's common edits plus those of the
    named devices (e.g. ["all"]), applied to an OCI config."""
    chosen = [d for d in spec["devices"] if d["name"] in names]
    missing = set(names) - {d["name"] for d in chosen}
    if missing:
        raise KeyError(f"{spec['kind']}={sorted(missing)[0]} is not in the spec")
    for ce in [spec.get("containerEdits", {})] + [d["containerEdits"] for d in chosen]:
        proc = config.setdefault("process", {})
        proc["env"] = proc.get("env", []) + ce.get("env", [])
        linux = config.setdefault("linux", {})
        for n in ce.get("deviceNodes", []):
            linux.setdefault("devices", []).append({k: n[k] for k in ("path", "type", "major", "minor")})
            linux.setdefault("resources", {}).setdefault("devices", []).append(
                {"allow": True, "type": "c", "major": n["major"], "minor": n["minor"], "access": "rwm"})
        for m in ce.get("mounts", []):
            config.setdefault("mounts", []).append({"destination": m["containerPath"], "source": m["hostPath"],
                                                    "type": "bind", "options": m.get("options", ["bind"])})
