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
