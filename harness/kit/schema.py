"""The kit manifest's JSON schema, and reading a manifest.json against it.

`FIELDS` declares every top-level field of manifest.json, once: `harness kit export` writes exactly these (a test
holds it to that) and `harness kit check` reads nothing that this schema has not checked. A new manifest field is
one entry here (and `REQUIRED` if a kit without it is unusable) beside the line of `build_manifest` that writes it.
A manifest that parses but breaks the schema is refused in one line naming the field and the fix (exit 2).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from harness.config.fields import GELUS
from harness.config.presets import PRESETS
from harness.errors import UsageError
from harness.kit.export import FILES, MANIFEST, MAX_STEPS, SCHEMA, SCHEMA_VERSION

FIX = "export the kit again with `harness kit export`"
MAX_MANIFEST_BYTES = 64 << 20  # a large kit's manifest is well under 1 MB
# A kit file is a plain file name inside the kit directory: no directory part, no '..', nothing hidden.
FILE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*\.npz$"

_INT = {"type": "integer", "minimum": 0}
_TEXT = {"type": "string"}
_TOLERANCES = {"type": "object", "required": ["logits", "grad", "loss", "opt"],
               "additionalProperties": {"type": "number", "exclusiveMinimum": 0}}
# One array of a kit file: its dtype and shape (checked against the file's .npy headers before any data is read)
# and its layout for column-major frameworks (kit/layout.py: axes, order, flux_* entries, free-form).
ARRAY = {"type": "object", "required": ["dtype", "shape"],
         "properties": {"dtype": {"enum": ["float32", "float64", "int64", "int32", "bool"]},
                        "shape": {"type": "array", "items": _INT, "maxItems": 8}}}
FILE = {"type": "object", "required": ["sha256", "bytes", "arrays"], "additionalProperties": False,
        "properties": {"sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"}, "bytes": _INT,
                       "arrays": {"type": "object", "minProperties": 1, "additionalProperties": ARRAY}}}

FIELDS: dict[str, dict[str, Any]] = {
    "schema": {"const": SCHEMA},
    "schema_version": {"const": SCHEMA_VERSION},
    "created_at": _TEXT,
    "harness_version": _TEXT,
    "size": {"enum": [*PRESETS, None]},  # null: exported from a --config of one's own
    "config": {"type": "object", "required": ["name", "dropout", "learning_rate"],
               "properties": {"name": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"},
                              "dropout": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
                              "learning_rate": {"type": "number", "exclusiveMinimum": 0}}},
    "seed": _INT,
    "steps": {"type": "integer", "minimum": 1, "maximum": MAX_STEPS},
    "vocabulary": _TEXT,
    "vocab_size": {"type": "integer", "minimum": 1},
    "data": {"type": "object"},
    "expected_dtype": {"const": "float64"},
    "oracle": _TEXT,
    "parameters": {"type": "object", "minProperties": 1,
                   "additionalProperties": {"type": "array", "items": {"type": "integer", "minimum": 1},
                                            "minItems": 1, "maxItems": 2}},
    "model": _TEXT,
    "taps": {"type": "object", "required": ["rows", "names"],
             "properties": {"rows": {"type": "integer", "minimum": 1},
                            "names": {"type": "array", "items": {"type": "string", "pattern": r"^[a-z0-9_.]{1,64}$"}},
                            "prefix": {"const": "tap/"},
                            "masks": {"type": "array", "items": {"type": "string",
                                                                 "pattern": r"^h\.[0-9]{1,4}\.attn\.probs$"}}}},
    "model_options": {"type": "object", "additionalProperties": False,
                      "properties": {"tie_embeddings": {"type": "boolean"}, "gelu": {"enum": list(GELUS)},
                                     "bias": {"type": "boolean"}, "lm_head_bias": {"type": "boolean"},
                                     "attn_dropout": {"type": "boolean"},
                                     "mlp_hidden": {"type": "integer", "minimum": 1}}},
    "training": {"type": "object"},
    "definitions": {"type": "object"},
    "results": {"type": "object"},
    "tolerances": {"type": "object", "properties": {"float32": _TOLERANCES, "float64": _TOLERANCES}},
    "files": {"type": "object", "required": ["weights.npz", "expected.npz"],
              "propertyNames": {"pattern": FILE_NAME_PATTERN, "maxLength": 100},
              "additionalProperties": FILE},
}
REQUIRED = ["schema", "schema_version", "config", "seed", "steps", "parameters", "files"]
MANIFEST_SCHEMA: dict[str, Any] = {"type": "object", "required": REQUIRED, "properties": FIELDS,
                                   "additionalProperties": False}


def _message(error: Any) -> str:
    """One line for the most relevant schema error: the field, what is wrong with it."""
    where = [str(p) for p in error.absolute_path]
    field = "/".join(where)
    if error.validator == "required":
        missing = next((r for r in error.validator_value if r not in error.instance), None)
        if missing is not None:
            field = "/".join([*where, missing])
            extra = " (every kit has it)" if missing in FILES else ""
            return f"field {field!r} is missing{extra}"
    if "propertyNames" in error.absolute_schema_path:
        return (f"field {field!r} names {error.instance!r}, which is not a plain .npz file name inside the kit "
                "directory (a kit reads only its own files: no directory part, no '..')")
    if error.validator in ("enum", "const"):
        allowed = error.validator_value if error.validator == "enum" else [error.validator_value]
        return (f"field {field!r} is {json.dumps(error.instance)[:60]}, expected "
                f"{' or '.join(json.dumps(a) for a in allowed)}")
    if error.validator == "additionalProperties" and error.validator_value is False:
        return f"field {field or '(top level)'!r}: {error.message}"
    if error.validator == "type":
        kind = type(error.instance).__name__
        kind = {"str": "a string", "int": "a whole number", "float": "a number", "list": "a list",
                "dict": "an object", "bool": "true/false", "NoneType": "null"}.get(kind, kind)
        want = error.validator_value if isinstance(error.validator_value, str) else " or ".join(error.validator_value)
        return f"field {field!r} is {kind}, expected {'an' if want[0] in 'aeiou' else 'a'} {want}"
    message = error.message if len(error.message) < 160 else error.message[:157] + "..."
    return f"field {field or '(top level)'!r}: {message}"


def validate_manifest(doc: Any, path: Path) -> dict[str, Any]:
    """`doc` if it is a manifest of this harness's kit schema; UsageError naming the field and the fix otherwise."""
    import jsonschema

    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise UsageError(f"{path} is not a kit manifest (schema {SCHEMA!r}); {FIX}")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise UsageError(f"{path} has kit schema version {doc.get('schema_version')!r}, this harness reads "
                         f"version {SCHEMA_VERSION}; export the kit again with this harness")
    validator = jsonschema.Draft202012Validator(MANIFEST_SCHEMA)
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        raise UsageError(f"kit manifest {str(path)!r}: {_message(error)}; {FIX}")
    return doc


def load_manifest(kit: Path) -> dict[str, Any]:
    """The validated manifest.json of kit directory `kit` (UsageError naming what is wrong, read within a bound)."""
    from harness.files import kind_of, read_json

    try:
        mode = os.stat(kit).st_mode
    except OSError:
        raise UsageError(f"kit {str(kit)!r} does not exist; pass the directory `harness kit export` wrote") from None
    if not os.path.isdir(kit):
        raise UsageError(f"kit {str(kit)!r} is {kind_of(mode)}, not a directory; pass the directory `harness kit "
                         "export` wrote")
    path = kit / MANIFEST
    if not os.path.lexists(path):
        raise UsageError(f"kit {str(kit)!r} has no {MANIFEST} (not a kit, or an interrupted export); {FIX}")
    return validate_manifest(read_json(path, "kit manifest", FIX, MAX_MANIFEST_BYTES), path)


def kit_file(kit: Path, name: str) -> Path:
    """`kit/name`, checked to stay inside the kit directory (a symlink pointing out of it is refused)."""
    path = kit / name
    if Path(name).name != name or name in (".", ".."):  # the schema's pattern already refuses these
        raise UsageError(f"kit file {name!r} is not a plain file name inside the kit; {FIX}")
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(kit):
        raise UsageError(f"kit file {name} in {str(kit)!r} is a symlink to {os.path.realpath(path)!r}, outside the "
                         f"kit directory; a kit reads only its own files, {FIX}")
    return path
