"""The CDI spec's JSON schema (container-device-interface `schema/schema.json` + `defs.json`, draft-07), written
out here as one document, stricter where the spec says unknown fields fail loading (additionalProperties)."""

_str = {"type": "string"}
_strs = {"type": "array", "items": _str}
_int64 = {"type": "integer"}
_uint32 = {"type": "integer", "minimum": 0, "maximum": 4294967295}

DEVICE_NODE = {"type": "object", "required": ["path"], "additionalProperties": False, "properties": {
    "path": _str, "hostPath": _str, "permissions": _str, "type": _str, "major": _int64, "minor": _int64,
    "uid": _uint32, "gid": _uint32, "fileMode": {"type": "integer"}}}
MOUNT = {"type": "object", "required": ["hostPath", "containerPath"], "additionalProperties": False,
         "properties": {"hostPath": _str, "containerPath": _str, "options": _strs, "type": _str}}
HOOK = {"type": "object", "required": ["hookName", "path"], "additionalProperties": False, "properties": {
    "hookName": _str, "path": _str, "args": _strs, "env": _strs, "timeout": _uint32}}
EDITS = {"type": "object", "additionalProperties": False, "properties": {
    "env": _strs, "deviceNodes": {"type": "array", "items": DEVICE_NODE},
    "mounts": {"type": "array", "items": MOUNT}, "hooks": {"type": "array", "items": HOOK},
    "intelRdt": {"type": "object"}, "additionalGids": {"type": "array", "items": _uint32}}}
ANNOTATIONS = {"type": "object", "patternProperties": {".{1,}": _str}}
SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "required": ["cdiVersion", "kind", "devices"],
    "additionalProperties": False,
    "properties": {
        "cdiVersion": {"type": "string", "pattern": r"^\d+\.\d+\.\d+$"},
        "kind": {"type": "string", "pattern": r"^[A-Za-z0-9.-]+/[A-Za-z0-9_.-]+$"},
        "annotations": ANNOTATIONS,
        "devices": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "containerEdits"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$"},
                           "annotations": ANNOTATIONS, "containerEdits": EDITS}}},
        "containerEdits": EDITS,
    },
}
