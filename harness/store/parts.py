"""The record of `harness bench parts`: `<out>/bench/parts-<UTC time>-<random>.json` (`PartsRecord`), written
atomically while the rounds come in and read back only through the bounded reader with its JSON schema.

It holds what was asked (`PartsOptions`: size, backends, devices, dtype, threads, the parts filter), the config, the
model's FLOPs per part, the timing plan (`PartsPlan`) and the contention rule, each contender (`PartsContender`) with
its set-up (`PartsReady`: set-up, compile and warm-up seconds, the calls per item per burst, the clock, kernel
counts where counted, the backend's description) and every round (`PartsRound`): per contender its burst
(`PartsBurst`: the seconds per call of every item and the burst's contention evidence). harness.bench.parts measures
it; harness.bench.parts_analysis reads it.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.config.fields import Config
from harness.errors import UsageError
from harness.files import check_types
from harness.store.contention import check_chunks
from harness.store.paths import BENCH, inside
from harness.store.record import Environment
from harness.store.spec import stored_config
from harness.store.stored import Stored, read_document, typed
from harness.store.writes import atomic_write_json

SCHEMA = "nanogpt-parity/bench-parts"
SCHEMA_VERSION = 1
ID_RE = re.compile(r"^parts-\d{8}-\d{6}-[0-9a-f]{6}$")
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
        "status": {"enum": STATES}, "failure": {"type": ["string", "null"]}, "stopped": {"type": ["string", "null"]},
        "options": {"type": "object", "required": ["size", "backends"],
                    "properties": {"size": {"type": "string"},
                                   "backends": {"type": "array", "minItems": 1, "items": {"type": "string"}},
                                   "devices": {"type": ["object", "null"],
                                               "additionalProperties": {"type": "string"}},
                                   "dtype": {"type": ["string", "null"]},
                                   "threads": {"type": ["integer", "null"]},
                                   "parts": {"type": ["array", "null"], "items": {"type": "string"}},
                                   "per_block": {"type": "boolean"}, "seed": {"type": ["integer", "null"]},
                                   "data": {"type": ["string", "null"]}}},
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
                                "burst_s": {"type": "number", "exclusiveMinimum": 0}, "gap_s": _SECONDS,
                                "order": {"type": "string"}}},
        "rule": {"type": ["object", "null"]},
        "environment": {"type": "object"},
        "contenders": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "backend"],
            "properties": {"name": {"type": "string", "minLength": 1}, "backend": {"type": "string"},
                           "device": {"type": "string"}, "options": {"type": "object"},
                           "ready": {"type": ["object", "null"], "properties": {
                               "setup_s": _SECONDS, "compile_s": _SECONDS, "warmup_s": _SECONDS,
                               "reference_s": _SECONDS, "calibrate_s": _SECONDS, "sample_s": _SECONDS,
                               "calls": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1}},
                               "passes": {"type": ["integer", "null"], "minimum": 1},
                               "step_samples": {"type": ["integer", "null"], "minimum": 1},
                               "launches": {"type": "object", "additionalProperties": {
                                   "type": "object", "additionalProperties": {"type": "number"}}},
                               "clock": {"type": "string"}, "sync_each_call": {"type": ["boolean", "null"]},
                               "backend_info": {"type": "object"}, "pid": {"type": ["integer", "null"]},
                               "gpu_evidence": {"type": "boolean"}}}}}},
        "rounds": {"type": "array", "items": {"type": "object", "required": ["bursts"],
                                              "properties": {"order": {"type": "array", "items": {"type": "string"}},
                                                             "bursts": {"type": "object"}}}},
    },
}


def new_id() -> str:
    """A fresh record id: parts-<UTC time>-<6 hex digits>."""
    return f"parts-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def record_path(out: Path, record_id: str) -> Path:
    """Where record `record_id` lives under `out`: `<out>/bench/<id>.json` (its page: the same name, .html)."""
    return inside(out, BENCH) / f"{record_id}.json"


def is_parts_id(ident: str) -> bool:
    """Whether `ident` is a parts record's id (`harness report` tells them from run and sweep ids by it)."""
    return bool(ID_RE.match(ident))


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


@dataclass(kw_only=True)
class PartsOptions(Stored):
    """What the command was asked: the size, the backends (the first is the one the others are compared with),
    their devices, dtype and threads, the parts filter (None: every part), the per-block view, seed and data."""

    size: str
    backends: list[str]
    devices: dict[str, str] | None = None
    dtype: str | None = None
    threads: int | None = None
    parts: list[str] | None = None
    per_block: bool = False
    seed: int | None = None
    data: str | None = None


@dataclass(kw_only=True)
class PartsPlan(Stored):
    """How the rounds are timed: the undisturbed rounds wanted and the most made, a burst's length, the pause
    before each burst and the order of the contenders."""

    rounds: int
    max_rounds: int
    burst_s: float
    gap_s: float | None = None
    order: str = ""


@dataclass(kw_only=True)
class PartsReady(Stored):
    """A timed process's `ready` message (harness.bench.parts_process): its set-up, compile, warm-up and calibration
    seconds, the calls of every item in a row (`calls`) and the passes a burst, the step's timings a pass, the
    clock, what each item launches (`launches`, where counted: kernels on CUDA, operators on the CPU), the
    backend's description."""

    ready: bool = True
    setup_s: float | None = None
    compile_s: float | None = None
    reference_s: float | None = None
    warmup_s: float | None = None
    calibrate_s: float | None = None
    calls: dict[str, int] = field(default_factory=dict)
    passes: int | None = None
    step_samples: int | None = None
    sample_s: float | None = None
    launches: dict[str, dict[str, float]] = field(default_factory=dict)
    clock: str = ""
    sync_each_call: bool | None = None
    backend_info: dict[str, Any] = field(default_factory=dict)
    pid: int | None = None
    gpu_evidence: bool = False


@dataclass(kw_only=True)
class PartsContender(Stored):
    """One timed process: its name in the record, its backend, device and options, and its `ready` (None until it
    was set up)."""

    name: str
    backend: str
    device: str = "cpu"
    options: dict[str, Any] = field(default_factory=dict)
    ready: PartsReady | None = None


@dataclass(kw_only=True)
class PartsBurst(Stored):
    """One contender's burst of a round: seconds per call of every item (None: not finite) and its contention
    chunk."""

    times: dict[str, float | None] = field(default_factory=dict)
    chunk: dict[str, Any] | None = None


@dataclass(kw_only=True)
class PartsRound(Stored):
    """One round: the contenders in the order they ran, and each one's burst."""

    order: list[str] = field(default_factory=list)
    bursts: dict[str, PartsBurst] = field(default_factory=dict)


@dataclass(kw_only=True)
class PartsEnvironment(Environment):
    """The machine (harness.environment.capture), its load average at the start and the end, its usable cores."""

    loadavg_start: float | None = None
    loadavg_end: float | None = None
    cores: int | None = None


@dataclass(kw_only=True)
class PartsRecord(Stored):
    """One `harness bench parts` measurement (see the module docstring); `dump` writes it, `load` reads it back."""

    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    id: str
    created_at: str = ""
    finished_at: str | None = None
    status: str = "running"
    failure: str | None = None
    stopped: str | None = None  # rounds stopped before their cap: no verdict could come any more (why)
    options: PartsOptions
    config: Config
    vocab_size: int
    tokens_per_step: int
    parts: list[str]
    all_parts: bool
    items: list[str]
    flops: dict[str, dict[str, int]]
    flops_per_token: int | None
    plan: PartsPlan
    rule: dict[str, Any] | None = None  # harness.timing.contention.RULE, as it was when the record was made
    environment: PartsEnvironment = field(default_factory=PartsEnvironment)
    contenders: list[PartsContender]
    rounds: list[PartsRound] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """The contenders' names, the first the one the others are compared with."""
        return [c.name for c in self.contenders]

    def contender(self, name: str) -> PartsContender:
        """The contender named `name`."""
        return next(c for c in self.contenders if c.name == name)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> PartsRecord:
        config = doc.get("config")
        return super().from_dict(dict(doc, config=config if isinstance(config, Config) else
                                      stored_config(config, "parts record")))

    def to_dict(self) -> dict[str, Any]:
        return dict(super().to_dict(), config=self.config.to_dict())

    def dump(self, path: Path) -> None:
        """Write the record atomically (a reader never sees half of it)."""
        atomic_write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: Path) -> PartsRecord:
        """The record at `path`, read within MAX_BYTES and checked against JSON_SCHEMA and `check_rounds`;
        UsageError in one line naming the file (and the field) when it is unreadable or not one."""
        doc = read_document(Path(path), SCHEMA, "parts record", FIX, MAX_BYTES, SCHEMA_VERSION, JSON_SCHEMA,
                            f"no parts record is so big; {FIX}", ".")
        check_rounds(doc, path)
        return typed(cls, doc, path, FIX)


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
            check_chunks([b.get("chunk")], path, at + "/chunk", FIX)
