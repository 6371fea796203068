"""The paired-timing record (`<run>/paired.json`, a sweep's `paired/<n>.json`): the contenders timed side by side,
the plan, and every session with every round of alternating bursts (harness.run.paired_timing writes it,
harness.timing.paired analyses it).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.files import check_types, column, lock_held, pid_alive
from harness.store.contention import check_chunks
from harness.store.lock import record_lock_path
from harness.store.stored import Stored, read_document, typed
from harness.store.writes import atomic_write_json

SCHEMA = "nanogpt-parity/paired-timing"
SCHEMA_VERSION = 1

# The most bytes a paired.json can hold: the longest session (harness.timing.paired.MAX_ROUNDS undisturbed rounds
# asked, MAX_ROUNDS_FACTOR times as many made) of two contenders at MAX_BURST steps a burst, at about 36 bytes a step
# time as harness.store.writes.json_bytes writes it, is 4,000 x 2 x 500 x 36 bytes = 144 MB plus 4 KB of evidence a
# burst; twice that leaves room for a resumed session. Anything bigger is no paired timing the harness wrote.
MAX_BYTES = 320 * 2**20

SESSION_STATES = ["running", "completed", "incomplete", "interrupted", "failed"]
_NUMBER = (int, float, type(None))  # null: a non-finite time
_COUNT = {"type": "integer", "minimum": 1}
_SECONDS = {"type": "number", "minimum": 0}
_STEPS = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}}
# The record without its rounds (`check_rounds` checks those: one jsonschema pass per item would take seconds on
# a long session). Every field a reader or the coordinator takes from it is typed; contenders may carry more
# fields (a sweep's: the cell and its run id).
JSON_SCHEMA: dict = {
    "type": "object",
    "required": ["schema", "contenders", "plan", "sessions"],
    "properties": {
        "schema": {"const": SCHEMA}, "schema_version": {"type": "integer"},
        "label": {"type": ["string", "null"]}, "seed": {"type": ["integer", "null"]},
        "contenders": {"type": "array", "minItems": 2, "items": {
            "type": "object", "required": ["name", "backend"],
            "properties": {"name": {"type": "string", "minLength": 1}, "backend": {"type": "string"},
                           "run_dir": {"type": "string"}, "run_id": {"type": ["string", "null"]},
                           "cell": {"type": ["integer", "null"]}, "options": {"type": ["object", "null"]},
                           "device": {"type": ["string", "null"]}}}},
        "threads": {"type": ["integer", "null"], "minimum": 1},
        "plan": {"type": "object",
                 "required": ["rounds", "max_rounds", "burst_s", "min_burst", "max_burst", "gap_s", "warmup_s"],
                 "properties": {"rounds": _COUNT, "max_rounds": _COUNT, "burst_s": {"type": "number",
                                                                                     "exclusiveMinimum": 0},
                                "min_burst": _COUNT, "max_burst": _COUNT, "gap_s": _SECONDS,
                                "warmup_steps": {"type": "integer", "minimum": 0}, "warmup_s": _SECONDS,
                                "order": {"type": "string"}}},
        "rule": {"type": ["object", "null"]},
        "status": {"enum": ["pending", *SESSION_STATES]},
        "created_at": {"type": "string"},
        "sessions": {"type": "array", "items": {
            "type": "object",
            "properties": {"status": {"enum": SESSION_STATES}, "started_at": {"type": "string"},
                           "finished_at": {"type": "string"}, "host": {"type": "string"},
                           "failure": {"type": "string"}, "stopped": {"type": "string"}, "ready": {"type": "object"},
                           "burst_steps": _STEPS, "burst_steps_after_first_round": _STEPS,
                           "rounds": {"type": "array"}}}},
    },
}


@dataclass(kw_only=True)
class Contender(Stored):
    """One backend timed: its name in the record (the backend's, or with its options where two share a backend),
    its run directory, options and device; in a sweep also the cell and its run id."""

    OMIT_NONE = ("cell", "run_id")

    name: str
    cell: int | None = None
    run_id: str | None = None
    run_dir: str = ""
    backend: str
    options: dict[str, Any] = field(default_factory=dict)
    device: str | None = None


@dataclass(kw_only=True)
class PairedPlan(Stored):
    """How a session times: the undisturbed rounds wanted and the most it makes, the bursts' target length and
    bounds in steps, the pause between bursts, the warm-up and the order of the contenders."""

    rounds: int
    max_rounds: int
    burst_s: float
    min_burst: int
    max_burst: int
    gap_s: float
    warmup_steps: int = 0
    warmup_s: float
    order: str = ""


@dataclass(kw_only=True)
class Ready(Stored):
    """A timed process's `ready` message (harness.run.timed): set up and warmed up, its step time and next step."""

    ready: bool = True
    setup_s: float | None = None
    compile_s: float | None = None
    warmup_steps: int | None = None
    warmup_s: float | None = None
    step_s: float = 0.0
    next_step: int = 0
    backend_info: dict[str, Any] = field(default_factory=dict)
    pid: int | None = None
    gpu_evidence: bool = False


@dataclass(kw_only=True)
class Burst(Stored):
    """One contender's burst of a round: its first step, its step times and its contention chunk."""

    start: int | None = None
    times: list[float | None] = field(default_factory=list)
    chunk: dict[str, Any] | None = None


@dataclass(kw_only=True)
class Round(Stored):
    """One round: the contenders in the order they ran, and each one's burst."""

    OMIT_NONE = ("order",)

    order: list[str] | None = None
    bursts: dict[str, Burst] = field(default_factory=dict)


@dataclass(kw_only=True)
class Session(Stored):
    """One coordinator's session: where and when it ran, its state (a failure's reason in `failure`; an incomplete
    session that stopped before its cap because no verdict could come any more: why, in `stopped`), the timed
    processes' ready messages, the burst sizes and its rounds. `gone`: a running session whose coordinator is gone
    (`abandoned`; never written)."""

    OMIT_NONE = ("started_at", "host", "burst_steps", "burst_steps_after_first_round", "finished_at", "failure", "gone",
                 "stopped")

    started_at: str | None = None
    host: str | None = None
    status: str = "running"
    ready: dict[str, Ready] = field(default_factory=dict)
    rounds: list[Round] = field(default_factory=list)
    burst_steps: dict[str, int] | None = None
    burst_steps_after_first_round: dict[str, int] | None = None
    finished_at: str | None = None
    failure: str | None = None
    gone: bool | None = None
    stopped: str | None = None


@dataclass(kw_only=True)
class PairedRecord(Stored):
    """A paired-timing record: its contenders, plan and sessions; `status` the last session's state ("pending"
    before the first)."""

    OMIT_NONE = ("created_at",)

    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    label: str | None = None
    seed: int | None = None
    contenders: list[Contender]
    threads: int | None = None
    plan: PairedPlan
    rule: dict[str, Any] | None = None  # harness.timing.contention.RULE, as it was when the record was made
    sessions: list[Session] = field(default_factory=list)
    status: str = "pending"
    created_at: str | None = None

    @property
    def names(self) -> list[str]:
        """The contenders' names."""
        return [c.name for c in self.contenders]

    @property
    def last_session(self) -> Session | None:
        return self.sessions[-1] if self.sessions else None

    @classmethod
    def load(cls, path: Path) -> PairedRecord:
        """A paired-timing record, read within `MAX_BYTES`, checked against `JSON_SCHEMA` and `check_rounds`; a
        session left "running" by a coordinator that is gone (killed, its disk full) reads as "interrupted"
        (`abandoned`). UsageError in one line naming the file (and the field) when it is unreadable or not one."""
        fix = "delete it to time again"
        if not os.path.lexists(path):
            raise UsageError(f"paired-timing record {str(path)!r} does not exist")
        doc = read_document(Path(path), SCHEMA, "paired-timing record", fix, MAX_BYTES, SCHEMA_VERSION, JSON_SCHEMA,
                            f"no paired timing writes so much; {fix}", ".")
        check_rounds(doc, path, fix)
        return abandoned(typed(cls, doc, path, fix), path)

    def dump(self, path: Path) -> None:
        """Write the record (atomically)."""
        atomic_write_json(path, self.to_dict())


def check_rounds(doc: dict, path: Path, fix: str) -> None:
    """Every round of every session: an object whose `bursts` map a name to {"start": step, "times": [seconds],
    "chunk": contention evidence}, typed as the coordinator writes them (UsageError naming the field). Linear in
    the record: C-level passes over each burst's times."""
    for i, session in enumerate(doc["sessions"]):
        where = f"sessions/{i}/rounds"
        rounds = session.get("rounds") or []
        check_types(rounds, path, where + "/{}", fix, (dict,))
        column(rounds, "order", path, where, fix, (list,), optional=True)
        for j, bursts in enumerate(column(rounds, "bursts", path, where, fix, (dict,))):
            for name, burst in bursts.items():
                at = f"{where}/{j}/bursts/{name}"
                check_types([burst], path, at, fix, (dict,))
                check_types([burst.get("start")], path, at + "/start", fix, (int, type(None)))
                times = burst.get("times")
                check_types([times], path, at + "/times", fix, (list,))
                check_types(times, path, at + "/times/{}", fix, _NUMBER)
                check_chunks([burst.get("chunk")], path, at + "/chunk", fix)


def abandoned(doc: PairedRecord, path: Path) -> PairedRecord:
    """`doc` with a session marked "running" whose coordinator is gone marked "interrupted" (`gone` True), and the
    record's status with it; in memory only (a reader writes nothing). Gone: the session ran on this host and no
    process holds the record's lock (harness.files.lock_held; the kernel drops the lock when its holder dies,
    however it dies). A session of another host is left as it is: this host cannot see its locks."""
    running = [s for s in doc.sessions if s.status == "running"]
    lock = record_lock_path(path)
    held = lock_held(lock) if running else True
    if held or (held is None and pid_alive(lock)):
        return doc
    here = socket.gethostname()
    for session in running:
        if session.host in (None, here):
            session.status, session.gone = "interrupted", True
    if doc.status == "running" and not any(s.status == "running" for s in doc.sessions):
        doc.status = "interrupted"
    return doc
