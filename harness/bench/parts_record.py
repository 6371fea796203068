"""The record of `harness bench parts`: `<out>/bench/parts-<UTC time>-<random>.json` (`PartsRecord`), written
atomically while the rounds come in and read back only through the bounded reader with its JSON schema.

It holds what was asked (size, backends, options, the parts timed), the model's FLOPs per part, the timing plan and
the contention rule, each contender's set-up (`ready`: set-up, compile and warm-up seconds, the calls per item per
burst, the clock, kernel counts where counted, the backend's description) and every round: per contender the
seconds per call of every item and the burst's contention evidence. The analysis is harness.bench.parts_analysis.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.files import check_types, check_version, read_json, validate
from harness.run.records import atomic_write_json
from harness.timing import contention

SCHEMA = "nanogpt-parity/bench-parts"
SCHEMA_VERSION = 1
ID_RE = re.compile(r"^parts-\d{8}-\d{6}-[0-9a-f]{6}$")
BENCH = "bench"  # the folder under --out
# The most bytes a parts record can hold: MAX_ROUNDS_FACTOR x the most rounds one may ask, four contenders, a few
# hundred items of ~40 bytes and 1 KB of evidence a burst, with room to spare; anything bigger is no record of ours.
MAX_BYTES = 256 * 2**20
STATES = ["running", "completed", "incomplete", "interrupted", "failed"]
FIX = "delete it and time again"

_NUMBER = {"type": "number"}
_SECONDS = {"type": ["number", "null"], "minimum": 0}
JSON_SCHEMA: dict = {
    "type": "object",
    "required": ["schema", "id", "options", "config", "parts", "items", "plan", "contenders", "rounds", "status"],
    "properties": {
        "schema": {"const": SCHEMA}, "schema_version": {"type": "integer"},
        "id": {"type": "string", "pattern": ID_RE.pattern},
        "created_at": {"type": "string"}, "finished_at": {"type": ["string", "null"]},
        "status": {"enum": STATES}, "failure": {"type": ["string", "null"]},
        "options": {"type": "object", "required": ["size", "backends"],
                    "properties": {"size": {"type": "string"},
                                   "backends": {"type": "array", "minItems": 1, "items": {"type": "string"}},
                                   "per_block": {"type": "boolean"}}},
        "config": {"type": "object", "required": ["n_layer", "batch_size", "block_size"],
                   "properties": {"n_layer": {"type": "integer", "minimum": 1},
                                  "batch_size": {"type": "integer", "minimum": 1},
                                  "block_size": {"type": "integer", "minimum": 1}}},
        "vocab_size": {"type": "integer", "minimum": 1},
        "tokens_per_step": {"type": "integer", "minimum": 1},
        "parts": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "all_parts": {"type": "boolean"},
        "items": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "flops": {"type": "object", "additionalProperties": {
            "type": "object", "properties": {"forward": _NUMBER, "backward": _NUMBER}}},
        "flops_per_token": {"type": ["integer", "null"]},
        "plan": {"type": "object", "required": ["rounds", "max_rounds", "burst_s"],
                 "properties": {"rounds": {"type": "integer", "minimum": 1},
                                "max_rounds": {"type": "integer", "minimum": 1},
                                "burst_s": {"type": "number", "exclusiveMinimum": 0}, "gap_s": _SECONDS}},
        "rule": {"type": ["object", "null"]},
        "environment": {"type": "object"},
        "contenders": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "backend"],
            "properties": {"name": {"type": "string", "minLength": 1}, "backend": {"type": "string"},
                           "device": {"type": "string"}, "options": {"type": "object"},
                           "ready": {"type": ["object", "null"], "properties": {
                               "setup_s": _SECONDS, "compile_s": _SECONDS, "warmup_s": _SECONDS,
                               "calls": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1}},
                               "passes": {"type": "integer", "minimum": 1},
                               "step_samples": {"type": "integer", "minimum": 1},
                               "launches": {"type": "object"}, "clock": {"type": "string"},
                               "backend_info": {"type": "object"}}}}}},
        "rounds": {"type": "array", "items": {"type": "object", "required": ["bursts"],
                                              "properties": {"order": {"type": "array"},
                                                             "bursts": {"type": "object"}}}},
    },
}


def new_id() -> str:
    """A fresh record id: parts-<UTC time>-<6 hex digits>."""
    return f"parts-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def record_path(out: Path, record_id: str) -> Path:
    """Where record `record_id` lives under `out`: `<out>/bench/<id>.json` (its page: the same name, .html)."""
    return Path(out) / BENCH / f"{record_id}.json"


def check_id(out: Path, record_id: str) -> Path:
    """The record path of `record_id`, or UsageError (one line) when it is no parts id or there is no such record."""
    if not ID_RE.match(record_id):
        raise UsageError(f"{record_id!r} is not a parts record id (parts-YYYYmmdd-HHMMSS-xxxxxx); pass a name from "
                         f"`ls {Path(out) / BENCH}` without .json")
    path = record_path(out, record_id)
    if not os.path.lexists(path):
        raise UsageError(f"no parts record {record_id!r} under {str(out)!r}; pass an id from `ls {Path(out) / BENCH}` "
                         "and the --out it was written under")
    return path


@dataclass
class PartsRecord:
    """One `harness bench parts` measurement (see the module docstring); `dump` writes it, `load` reads it back."""

    id: str
    options: dict
    config: dict
    vocab_size: int
    tokens_per_step: int
    parts: list[str]
    all_parts: bool
    items: list[str]
    flops: dict
    flops_per_token: int | None
    plan: dict
    contenders: list[dict]
    rule: dict | None = None
    environment: dict = field(default_factory=dict)
    rounds: list[dict] = field(default_factory=list)
    status: str = "running"
    failure: str | None = None
    created_at: str = ""
    finished_at: str | None = None
    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    def dump(self, path: Path) -> None:
        """Write the record atomically (a reader never sees half of it)."""
        atomic_write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: Path) -> PartsRecord:
        """The record at `path`, read within MAX_BYTES and checked against JSON_SCHEMA and `check_rounds`;
        UsageError in one line naming the file (and the field) when it is unreadable or not one."""
        doc = read_json(path, "parts record", FIX, MAX_BYTES, f"no parts record is so big; {FIX}")
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise UsageError(f"{str(path)!r} is not a nanogpt-parity parts record")
        check_version(doc, path, SCHEMA_VERSION)
        validate(doc, JSON_SCHEMA, path, FIX)
        check_rounds(doc, path)
        names = {f.name for f in cls.__dataclass_fields__.values()}
        return cls(**{k: v for k, v in doc.items() if k in names})


def check_rounds(doc: dict, path: Path) -> None:
    """Every burst of every round: {"times": {item: seconds per call}, "chunk": contention evidence}, of a contender
    of the record, its times numbers (null: not finite) for items of the record."""
    names = {c["name"] for c in doc["contenders"]}
    known = set(doc["items"])
    for j, rnd in enumerate(doc["rounds"]):
        for name, b in rnd["bursts"].items():
            at = f"rounds/{j}/bursts/{name}"
            if name not in names:
                raise UsageError(f"{str(path)!r} is invalid at field {at!r}: not a contender of the record; {FIX}")
            check_types([b], path, at, FIX, (dict,))
            times = b.get("times")
            check_types([times], path, at + "/times", FIX, (dict,))
            unknown = set(times) - known
            if unknown:
                raise UsageError(f"{str(path)!r} is invalid at field {at + '/times'!r}: {sorted(unknown)[0]!r} is "
                                 f"not an item of the record; {FIX}")
            check_types(list(times.values()), path, at + "/times/{}", FIX, (int, float, type(None)))
            contention.check_chunks([b.get("chunk")], path, at + "/chunk", FIX)


def jsonable(obj: Any) -> Any:
    """Tuples to lists, NumPy scalars to Python numbers (a burst's reply, a backend's description)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    return obj
