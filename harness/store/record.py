"""A backend's run record `<run>/<backend>.json` (with its curves files), as the worker writes it and every verb
reads it: `RunRecord` and its parts.

The per-step columns (`step`, `loss`, `time_s`), the evaluations and the contention chunks are one object,
`RunRecord.curves` (harness.store.curves.Curves), apart from the record's figures: everything that grows with the
steps is there, and nowhere else. Since schema version 4 they live in their own files beside the record
(`<backend>.steps.csv`, `.evals.csv`, `.chunks.jsonl`), which only grow, and the record's JSON holds only how much of
each it vouches for (`curves`: rows and bytes), so the record stays small however long the run; a record of version
3 (the previous release) held them in its JSON as `steps`, `evals` and `chunks`, and is still read, and written back
as it was read.

A status is `RunRecord.status` (a `Status`) with its reason beside it in `failure`. On disk a failed status keeps
the spelling it has always had, `"failed: <reason>"`, beside `"failure": "<reason>"`: readers of the files written
before (other tools, older reports, the schema's pattern) read it unchanged, and no schema version changes; the
store is the one place that spells and reads it.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.config.fields import Config
from harness.errors import UsageError
from harness.files import check_types, column, validate
from harness.store.contention import CONTENTION_JSON_SCHEMA, Contention, check_chunks
from harness.store.curves import EXTENTS_JSON_SCHEMA, Curves, Extents, extents_for, nan_for_null, write_curves
from harness.store.paths import RunPaths
from harness.store.spec import (
    BACKEND_PATTERN,
    CONFIG_SCHEMA,
    RUN_ID_PATTERN,
    DataInfo,
    RunSpec,
    load_spec_at,
    stored_config,
)
from harness.store.stored import Stored, read_document, typed
from harness.store.writes import atomic_write_json

SCHEMA = "nanogpt-parity/run-record"
# 2: vocabulary and text normalisation in `data`; null for non-finite numbers
# 3: contention evidence: `chunks` (per chunk of steps: wall and CPU time, run-queue wait, machine load, GPU state)
#    and `timings.contention`; steady-state figures from the undisturbed steps (`timings.disturbed_steps`);
#    `resumed_from_step`, the step each resume continued from (one entry per resume; absent in a record that was
#    never resumed).
# 4: the curves in their own files, appended to (harness.store.curves); `curves` says how much of each the record
#    vouches for (rows and bytes), in place of `steps`, `evals` and `chunks`; `experiment_sha256`, the digest of the
#    spec the record was written under (RunSpec.experiment). Version 3 is still read (and resumed); any other is
#    refused (harness.files.check_version: re-run it).
SCHEMA_VERSION = 4
OLDEST_READ = 3


class Status(str, enum.Enum):
    """A run record's state. A failure's reason is the record's `failure`; on disk the status reads
    "failed: <reason>" (`stored`)."""

    QUEUED = "queued"  # submitted to an executor, not started
    RUNNING = "running"
    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    FAILED = "failed"

    @classmethod
    def of(cls, stored: str) -> Status:
        """The Status of a stored status string ("failed: ..." is FAILED)."""
        return cls.FAILED if str(stored).startswith(cls.FAILED.value) else cls(stored)

    def stored(self, reason: str | None = None) -> str:
        """The stored string: the value, or "failed: <reason>"."""
        return f"failed: {reason}" if self is Status.FAILED and reason else self.value


def failure_of(stored: str) -> str | None:
    """The reason a stored status string "failed: <reason>" carries (None: none): the one place it is read back."""
    prefix = f"{Status.FAILED.value}: "
    return stored[len(prefix):] if stored.startswith(prefix) else None


# --- the record's parts ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Fingerprints(Stored):
    """sha256 of the initial weights, the training batches and the evaluation batches a backend got: equal across
    backends when the comparison is fair."""

    weights: str | None = None
    batches: str | None = None
    eval_batches: str | None = None


@dataclass(kw_only=True)
class Environment(Stored):
    """The machine and software a run used (harness.environment.capture; framework versions are the backend's
    `backend_info`)."""

    python: str | None = None
    platform: str | None = None
    hostname: str | None = None
    cpu_model: str | None = None
    cpu_count: int | None = None
    cpu_affinity: int | None = None
    memory_bytes: int | None = None
    numpy: str | None = None
    harness_version: str | None = None
    git_commit: str | None = None
    omp_num_threads: str | None = None
    openblas_num_threads: str | None = None


@dataclass(kw_only=True)
class Timings(Stored):
    """The run's times (seconds) and its steady-state figures (harness.timing.steady.summarize_times: from the
    undisturbed steps after the warm-up), with the contention evidence behind them (`contention`). A figure a
    worker did not get to (killed) is None; the reports recompute what they can from the curves."""

    OMIT_NONE = ("first_step_s", "warmup_steps", "steady_steps_all", "disturbed_steps", "figures_from",
                 "steady_steps", "step_median_s", "step_p10_s", "step_p90_s", "step_iqr_s", "step_mean_s",
                 "tokens_per_s", "contention", "train_s", "eval_s", "achieved_flops", "wall_s")

    setup_s: float | None = None
    first_step_s: float | None = None  # JIT warm-up, but not torch.compile: that is compile_s
    compile_s: float | None = None  # the backend's warm-up before step 0 (None: it has none)
    warmup_steps: int | None = None
    steady_steps_all: int | None = None
    disturbed_steps: int | None = None
    figures_from: str | None = None
    steady_steps: int | None = None
    step_median_s: float | None = None
    step_p10_s: float | None = None
    step_p90_s: float | None = None
    step_iqr_s: float | None = None
    step_mean_s: float | None = None
    tokens_per_s: float | None = None
    contention: Contention | None = None
    train_s: float | None = None
    eval_s: float | None = None
    achieved_flops: float | None = None
    wall_s: float | None = None


@dataclass(kw_only=True)
class Memory(Stored):
    """Peak memory: `kind` "device" (the accelerator's allocator) or "rss" (the process's resident set)."""

    OMIT_NONE = ("kind", "peak_bytes")

    kind: str | None = None
    peak_bytes: int | None = None


@dataclass(kw_only=True)
class TextProtocol(Stored):
    """How the continuations and samples of `TextQuality` were made (harness.run.text)."""

    n_prompts: int | None = None
    prompt_chars: int | None = None
    continuation_chars: int | None = None
    temperature: float | None = None
    seed: int | None = None
    offsets: str | None = None
    bootstrap: int | None = None
    sample_chars: int | None = None
    sample_temperatures: list[float | None] = field(default_factory=list)


@dataclass(kw_only=True)
class TextSample(Stored):
    temperature: float | None = None
    text: str = ""


@dataclass(kw_only=True)
class Continuation(Stored):
    """One prompt of the validation split, its true continuation and the model's."""

    prompt: str = ""
    reference: str = ""
    hypothesis: str = ""


@dataclass(kw_only=True)
class TextQuality(Stored):
    """BLEU and chrF of prompted continuations against the true text (95 % bootstrap half-widths, sacrebleu's
    signatures), generation speed, and samples at several temperatures (harness.run.text.text_quality)."""

    protocol: TextProtocol | None = None
    bleu: float | None = None
    bleu_ci: float | None = None
    bleu_signature: str | None = None
    chrf: float | None = None
    chrf_ci: float | None = None
    chrf_signature: str | None = None
    generation_s: float | None = None
    generation_tokens: int | None = None
    generation_tokens_per_s: float | None = None
    sample_prompt: str | None = None
    samples: list[TextSample] = field(default_factory=list)
    continuations: list[Continuation] = field(default_factory=list)


@dataclass(kw_only=True)
class CheckpointRef(Stored):
    """The last checkpoint: the step it holds and its file name in the run directory."""

    step: int
    file: str


@dataclass(kw_only=True)
class TimeToTarget(Stored):
    """When the evaluated validation loss first reached `target_val_loss` (harness.core.costs.time_to_target): the
    evaluation's step and loss, the training time until then and with the evaluations; `reached` False: never."""

    target_val_loss: float
    reached: bool = False
    step: int | None = None
    val_loss: float | None = None
    train_s: float | None = None
    train_eval_s: float | None = None


# --- the record -----------------------------------------------------------------------------------------------------
_NUM = {"type": ["number", "null"]}  # null: a non-finite value (NaN or infinity)
_SECONDS = {"type": ["number", "null"], "minimum": 0}
_COUNT = {"type": ["integer", "null"], "minimum": 0}

# `timings` (the worker's times and harness.timing.steady.summarize_times' figures)
TIMINGS_JSON_SCHEMA: dict = {
    "type": "object",
    "properties": {**{k: _SECONDS for k in ("setup_s", "first_step_s", "compile_s", "step_median_s", "step_p10_s",
                                            "step_p90_s", "step_iqr_s", "step_mean_s", "train_s", "eval_s",
                                            "wall_s")},
                   "tokens_per_s": _SECONDS, "achieved_flops": _SECONDS,
                   **{k: _COUNT for k in ("warmup_steps", "steady_steps", "steady_steps_all", "disturbed_steps")},
                   "figures_from": {"type": "string"}, "contention": CONTENTION_JSON_SCHEMA},
}

# A record of version 4: its curves in their files, `curves` how much of each it vouches for.
RECORD_JSON_SCHEMA: dict = {
    "type": "object",
    "required": ["schema", "run_id", "backend", "status", "config", "curves"],
    "properties": {
        "schema": {"const": SCHEMA},
        "schema_version": {"type": "integer"},
        "run_id": RUN_ID_PATTERN,
        "backend": BACKEND_PATTERN,
        "status": {"type": "string", "pattern": "^(queued|running|completed|interrupted|failed(: .*)?)$"},
        "config": CONFIG_SCHEMA,
        "seed": {"type": "integer"},
        "total_steps": {"type": "integer", "minimum": 0},
        "tokens_per_step": {"type": ["integer", "null"], "minimum": 0},
        "n_params": _COUNT, "n_params_non_embedding": _COUNT, "flops_per_token": _COUNT,
        "curves": EXTENTS_JSON_SCHEMA,
        "timings": TIMINGS_JSON_SCHEMA,
        "memory": {"type": "object", "properties": {"peak_bytes": _COUNT, "kind": {"type": ["string", "null"]}}},
        "fingerprints": {"type": "object"}, "data": {"type": "object"},
        "checkpoint": {"type": ["object", "null"], "properties": {"step": {"type": "integer", "minimum": 0}}},
        "text": {"type": ["object", "null"], "properties": {"chrf": _NUM, "bleu": _NUM}},
        "resumed_from_step": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "experiment_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
    },
}

# A record of version 3, its curves in its JSON. The per-step and per-evaluation lists are checked by
# `check_columns`, not item by item here: jsonschema takes about 60 µs per item, a minute for a record of a million
# steps; `ITEMS` gives their types.
_V3_PROPERTIES = {k: v for k, v in RECORD_JSON_SCHEMA["properties"].items() if k != "curves"}
RECORD_V3_JSON_SCHEMA: dict = {
    "type": "object",
    "required": ["schema", "run_id", "backend", "status", "config", "steps", "evals"],
    "properties": {
        **_V3_PROPERTIES,
        "steps": {"type": "object", "required": ["step", "loss", "time_s"],
                  "properties": {"step": {"type": "array"}, "loss": {"type": "array"}, "time_s": {"type": "array"}}},
        "evals": {"type": "array"},
        "chunks": {"type": "array"},
    },
}

# The types of the list items `check_columns` checks: the per-step lists (one number per step) and each evaluation's
# fields; the chunks' are harness.store.contention's (`check_chunks`).
_INT, _FLOAT = (int,), (int, float, type(None))
ITEMS: dict[str, dict[str, tuple[type, ...]]] = {
    "steps": {"step": _INT, "loss": _FLOAT, "time_s": _FLOAT},
    "evals": {"step": _INT, "train_loss": _FLOAT, "val_loss": _FLOAT, "time_s": _FLOAT},
}


def check_columns(record: dict, path: Path, fix: str) -> None:
    """The items of a version-3 record's per-step, evaluation and chunk lists (`ITEMS`, the chunks' types): linear
    in the record's size, a few C-level passes over each list."""
    steps = record["steps"]
    for key, kinds in ITEMS["steps"].items():
        check_types(steps[key], path, f"steps/{key}/{{}}", fix, kinds)
    evals = record["evals"]
    check_types(evals, path, "evals/{}", fix, (dict,))
    for key, kinds in ITEMS["evals"].items():
        column(evals, key, path, "evals", fix, kinds, optional=key == "time_s")
    check_chunks(record.get("chunks") or [], path, "chunks", fix)
    if (np.asarray(nan_for_null(steps["time_s"]), dtype=np.float64) < 0).any():
        raise UsageError(f"{str(path)!r} is invalid at field 'steps/time_s': a step time is negative; {fix}")
    if not len(steps["step"]) >= len(steps["loss"]) <= len(steps["time_s"]):
        raise UsageError(f"{str(path)!r} is invalid at field 'steps': fewer steps or times than losses; {fix}")


# --- how big a record can be ---------------------------------------------------------------------------------------
# Every JSON file of a run is read within a cap (harness.files.read_json), so a device, a FIFO or a file of gigabytes
# put where a record belongs is refused before it is read. The caps are bytes of JSON as harness.store.writes
# writes it (indent 1), bounded from above item by item, for the steps and evaluations the run's spec lets it have:
RECORD_BASE_BYTES = 16 * 2**20  # a record without its lists: the vocabulary again, the text samples, a traceback
STEP_BYTES = 96  # steps.step, .loss, .time_s: three numbers of at most 24 characters, one line each
EVAL_BYTES = 320  # one evaluation: four numbers and their names
CHUNK_BYTES = 4096  # one chunk of contention evidence, GPU states included (about 700 bytes measured); one a step
RECORD_CEILING = 2**30  # the cap of a record whose spec cannot say how many steps its run has


def record_cap(spec: RunSpec | None) -> int:
    """The most bytes a backend's record of the run of `spec` can hold: `RECORD_BASE_BYTES` plus, for a record of
    version 3 (its curves in its JSON), per step its numbers and a chunk (a chunk holds one step or more), per
    evaluation (every `eval_interval` steps, and at the first and the last) its numbers; never more than
    `RECORD_CEILING` (and what a read allocates follows the file's size, never this cap:
    harness.files.read_bounded). A record of version 4 holds no per-step list and stays within RECORD_BASE_BYTES."""
    steps = spec.steps_bound() if spec is not None else None
    if steps is None:
        return RECORD_CEILING
    evals = steps // max(1, spec.config.eval_interval or 1) + 2
    return min(RECORD_CEILING, RECORD_BASE_BYTES + steps * (STEP_BYTES + CHUNK_BYTES) + evals * EVAL_BYTES)


@dataclass(kw_only=True)
class RunRecord(Stored):
    """One backend's record of one run: what it ran (config, seed, device, data, options), the fingerprints of what
    it was fed, where it stands (`status`, the reason of a failure in `failure`), its curves and its figures."""

    # a field the schema types as non-null is left out while None (a record written by hand may lack it)
    OMIT_NONE = ("seed", "total_steps", "data", "fingerprints", "resumed_at", "resumed_from_step", "failure", "signal",
                 "experiment_sha256")

    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    run_id: str
    backend: str
    backend_options: dict[str, Any] = field(default_factory=dict)
    status: Status = Status.RUNNING
    started_at: str | None = None
    finished_at: str | None = None
    error: str | None = None  # a failure's traceback, or what stopped the worker
    config: Config
    config_hash: str | None = None
    seed: int | None = None
    device: str | None = None
    data: DataInfo | None = None
    fingerprints: Fingerprints | None = None
    environment: Environment = field(default_factory=Environment)
    total_steps: int | None = None
    batches_per_epoch: int | None = None
    epochs: float | None = None
    tokens_per_step: int | None = None
    n_params: int | None = None
    n_params_non_embedding: int | None = None
    flops_per_token: int | None = None
    backend_info: dict[str, Any] = field(default_factory=dict)  # the backend's own describe(): a free-form map
    timings: Timings = field(default_factory=Timings)
    memory: Memory = field(default_factory=Memory)
    text: TextQuality | None = None
    checkpoint: CheckpointRef | None = None
    curves: Curves = field(default_factory=Curves)
    resumed_at: str | None = None
    resumed_from_step: list[int] | None = None  # the step each resume continued from
    time_to_target: TimeToTarget | None = None
    failure: str | None = None
    signal: str | None = None  # the signal the worker died by (harness.run.supervise.mark_ended)
    experiment_sha256: str | None = None  # the spec's digest it was written under (RunSpec.experiment)

    @property
    def finished(self) -> bool:
        return self.status is Status.COMPLETED

    @property
    def status_text(self) -> str:
        """The status as stored and shown: "completed", "failed: <reason>", ..."""
        return self.status.stored(self.failure)

    def fail(self, reason: str) -> None:
        """Mark the record failed for `reason`."""
        self.status, self.failure = Status.FAILED, reason

    @property
    def curves_in_json(self) -> bool:
        """Whether the record's curves are in its JSON (a record of version 3) rather than in their files."""
        return self.schema_version < 4

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RunRecord:
        stored = str(doc.get("status", Status.RUNNING.value))
        config = doc["config"]
        keys = tuple(doc)
        version = doc.get("schema_version", SCHEMA_VERSION)
        if isinstance(version, int) and version < 4:  # version 3: the curves in the JSON
            curves = Curves.from_json(doc)
        elif isinstance(doc.get("curves"), dict):  # version 4: how much of its files the record vouches for
            curves = Curves(extents=Extents.from_dict(doc["curves"]))
        else:
            curves = Curves()
        doc = {k: v for k, v in doc.items() if k not in ("steps", "evals", "chunks", "curves")}
        doc.update(status=Status.of(stored), curves=curves,
                   config=config if isinstance(config, Config) else stored_config(config, "run record"))
        if doc.get("failure") is None and failure_of(stored) is not None:
            doc["failure"] = failure_of(stored)
        record = super().from_dict(doc)
        record._json_keys = keys  # written back as read: `steps`, `evals`, `chunks` where they were
        return record

    def to_dict(self) -> dict[str, Any]:
        read = getattr(self, "_json_keys", None)
        if self.curves_in_json:
            curves = self.curves.to_json()
            if read and "chunks" not in read and not self.curves.chunks:
                del curves["chunks"]  # a record without contention evidence stays without
        else:
            curves = {"curves": extents_for(self.curves).to_dict()}
        out: dict[str, Any] = {}
        for key, value in super().to_dict().items():
            if key == "curves":
                out.update(curves)
            else:
                out[key] = value
        out.update(status=self.status_text, config=self.config.to_dict())
        return {**{k: out[k] for k in read if k in out}, **out} if read else out

    @classmethod
    def load(cls, path: Path, backend: str | None = None, spec: RunSpec | None = None) -> RunRecord:
        """Read and validate one run record; a missing, corrupt or invalid file is a UsageError naming it and the
        field. It is read within the cap of its run (`record_cap` of `spec`; without one, of the spec beside it).
        Its curves (version 4) are read from their files when first touched (harness.store.curves: a file missing
        or shorter than the record vouches for is refused now); a record of version 3 holds them, non-finite
        numbers (stored as null) coming back as nan."""
        fix = "rerun or delete that run"
        path = Path(path)
        paths = RunPaths.of_dir(path.parent)
        if spec is None:
            try:
                spec = RunSpec.load(paths, runnable=False)
            except UsageError:
                spec = None  # the record alone: the ceiling
        doc = read_document(path, SCHEMA, "run record", fix, record_cap(spec), SCHEMA_VERSION, None,
                            f"no run writes so much; {fix}", "pass a run id from <out>/runs", oldest=OLDEST_READ)
        in_json = isinstance(doc.get("schema_version"), int) and doc["schema_version"] < 4
        validate(doc, RECORD_V3_JSON_SCHEMA if in_json else RECORD_JSON_SCHEMA, path, fix)
        if in_json:
            check_columns(doc, path, fix)
        else:
            held = next((k for k in ("steps", "evals", "chunks") if k in doc), None)
            if held:
                raise UsageError(f"{str(path)!r} is invalid at field {held!r}: a record of schema version "
                                 f"{doc['schema_version']} holds its curves in their own files, not in its JSON; {fix}")
        if backend is not None and doc["backend"] != backend:
            raise UsageError(f"{str(path)!r} is invalid at field 'backend': {doc['backend']!r} in the file of "
                             f"backend {backend!r}; {fix}")
        doc["config"] = stored_config(doc["config"], str(path))
        record = typed(cls, doc, path, fix)
        if not in_json:
            record.curves = Curves.on_disk(paths, record.backend, record.curves.extents)
        return record

    def dump(self, paths: RunPaths) -> None:
        """Write `<backend>.json` (atomically), after its curves files where they are not yet there (written whole;
        the training loop appends to them instead: harness.run.persist)."""
        if not self.curves_in_json and not self.curves.stored_at(paths, self.backend):
            self.curves = write_curves(paths, self.backend, self.curves)
        atomic_write_json(paths.record(self.backend), self.to_dict())


def load_run(paths: RunPaths, runnable: bool = False) -> tuple[RunSpec, list[RunRecord]]:
    """The spec and the backend records of run `paths` (UsageError naming what is wrong); `runnable`: its config
    checked as a run needs it (RunSpec.load)."""
    spec = load_spec_at(paths, runnable)
    recs = [RunRecord.load(paths.record(b), b, spec) for b in spec.backends if os.path.lexists(paths.record(b))]
    return spec, recs


def compare_fingerprints(recs: list[RunRecord]) -> list[str]:
    """Problems that would make a comparison unfair: different data, weights, batches or config. A record without
    its fingerprints (written by hand, or before they existed) cannot confirm equal inputs: that is said too."""
    problems: list[str] = []
    if len(recs) < 2:
        return problems
    ref = recs[0]
    if any(r.fingerprints is None or r.data is None or r.config_hash is None for r in recs):
        return ["a record lacks its data/config/weight/batch fingerprints, so equal inputs cannot be confirmed"]
    for rec in recs[1:]:
        if rec.data.sha256 != ref.data.sha256:
            problems.append(f"{rec.backend} read different data than {ref.backend}")
        if rec.config_hash != ref.config_hash:
            problems.append(f"{rec.backend} ran a different config than {ref.backend}")
        for key in ("weights", "batches", "eval_batches"):
            if getattr(rec.fingerprints, key) != getattr(ref.fingerprints, key):
                problems.append(f"{rec.backend} got different {key} than {ref.backend}")
    return problems
