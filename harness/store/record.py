"""A backend's run record `<run>/<backend>.json` (with its per-step CSVs), as the worker writes it and every verb
reads it: `RunRecord`, its parts, and `Curves`, what training measured step by step.

The per-step columns (`steps.step`, `steps.loss`, `steps.time_s`), the evaluations and the contention chunks are
one object, `RunRecord.curves`, apart from the record's figures: everything that grows with the steps is there,
and nowhere else. In JSON they are the record's `steps`, `evals` and `chunks`; the worker also writes the steps and
evaluations as `<backend>.steps.csv` and `<backend>.evals.csv` (`write_curves_csv`).

A status is `RunRecord.status` (a `Status`) with its reason beside it in `failure`. On disk a failed status keeps
the spelling it has always had, `"failed: <reason>"`, beside `"failure": "<reason>"`: readers of the files written
before (other tools, older reports, the schema's pattern) read it unchanged, and no schema version changes; the
store is the one place that spells and reads it.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.config.fields import Config
from harness.errors import UsageError
from harness.files import check_types, column
from harness.store.contention import CONTENTION_JSON_SCHEMA, Contention, check_chunks, truncate_chunks
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
from harness.store.writes import atomic_write_csv, atomic_write_json

SCHEMA = "nanogpt-parity/run-record"
# 2: vocabulary and text normalisation in `data`; null for non-finite numbers
# 3: contention evidence: `chunks` (per chunk of steps: wall and CPU time, run-queue wait, machine load, GPU state)
#    and `timings.contention`; steady-state figures from the undisturbed steps (`timings.disturbed_steps`);
#    `resumed_from_step`, the step each resume continued from (one entry per resume; absent in a record that was
#    never resumed). A record of another version is refused (harness.files.check_version: re-run it).
SCHEMA_VERSION = 3


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


# --- what training measured -----------------------------------------------------------------------------------------
@dataclass
class Eval:
    """One evaluation point: the mean losses over the fixed evaluation batches before training step `step` (after
    `step` updates), and its seconds."""

    step: int
    train_loss: float
    val_loss: float
    time_s: float | None = None

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Eval:
        nan = math.nan
        losses = (doc["train_loss"], doc["val_loss"], doc.get("time_s", nan))
        train, val, time_s = (nan if v is None else v for v in losses)
        return cls(doc["step"], train, val, time_s)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "train_loss": self.train_loss, "val_loss": self.val_loss, "time_s": self.time_s}


@dataclass
class Curves:
    """What training measured so far: per-step losses and times, the evaluation points, and the contention evidence
    of each chunk of steps (harness.timing.contention). `step` may be longer than `loss`: a step whose loss was not
    yet fetched from the device."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    time_s: list[float] = field(default_factory=list)
    evals: list[Eval] = field(default_factory=list)
    chunks: list[dict] = field(default_factory=list)

    @property
    def steps_done(self) -> int:
        """Steps whose loss is known."""
        return len(self.loss)

    @property
    def last_eval(self) -> Eval | None:
        return self.evals[-1] if self.evals else None

    def truncate(self, steps: int) -> None:
        """Keep what was measured before training step `steps` (for resuming from a checkpoint)."""
        keep = sum(1 for s in self.step if s < steps)
        del self.step[keep:], self.loss[keep:], self.time_s[keep:]
        self.evals[:] = [e for e in self.evals if e.step < steps]
        self.chunks[:] = truncate_chunks(self.chunks, steps)

    def followed_by(self, tail: Curves) -> Curves:
        """These curves, followed by what `tail` (an earlier attempt's) recorded beyond them."""
        n = len(self.loss)
        keep = [i for i, s in enumerate(tail.step[:len(tail.loss)]) if s >= n]
        last_eval = self.evals[-1].step if self.evals else -1
        covered = max((c["step"] + c["n"] for c in self.chunks), default=0)
        return Curves(step=self.step[:n] + [tail.step[i] for i in keep], loss=self.loss + [tail.loss[i] for i in keep],
                      time_s=self.time_s[:n] + [tail.time_s[i] for i in keep],
                      evals=self.evals + [e for e in tail.evals if e.step > last_eval],
                      chunks=self.chunks + [c for c in tail.chunks if c["step"] >= max(n, covered)])

    def to_json(self) -> dict[str, Any]:
        """The record's `steps`, `evals` and `chunks`."""
        return {"steps": {"step": self.step, "loss": self.loss, "time_s": self.time_s},
                "evals": [e.to_dict() for e in self.evals], "chunks": self.chunks}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Curves:
        """The curves of a record's JSON (checked by `check_columns`): null losses and times (non-finite when
        written) come back as nan."""
        steps = doc["steps"]
        return cls(step=list(steps["step"]), loss=_nan(steps["loss"]), time_s=_nan(steps["time_s"]),
                   evals=[Eval.from_dict(e) for e in doc["evals"]], chunks=list(doc.get("chunks") or []))


def _nan(values: list) -> list:
    return [math.nan if v is None else v for v in values]


def write_curves_csv(paths: RunPaths, backend: str, curves: Curves) -> None:
    """`<backend>.steps.csv` and `<backend>.evals.csv`: the curves as CSV (numbers written with `repr`: exact)."""
    atomic_write_csv(paths.steps_csv(backend), ["step", "loss", "time_s"],
                     [[s, repr(v), repr(t)] for s, v, t in zip(curves.step, curves.loss, curves.time_s)])
    atomic_write_csv(paths.evals_csv(backend), ["step", "train_loss", "val_loss", "time_s"],
                     [[e.step, repr(e.train_loss), repr(e.val_loss), repr(e.time_s)] for e in curves.evals])


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

# The per-step and per-evaluation lists are checked by `check_columns`, not item by item here: jsonschema takes
# about 60 µs per item, a minute for a record of a million steps; `ITEMS` gives their types.
RECORD_JSON_SCHEMA: dict = {
    "type": "object",
    "required": ["schema", "run_id", "backend", "status", "config", "steps", "evals"],
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
        "steps": {"type": "object", "required": ["step", "loss", "time_s"],
                  "properties": {"step": {"type": "array"}, "loss": {"type": "array"}, "time_s": {"type": "array"}}},
        "evals": {"type": "array"},
        "timings": TIMINGS_JSON_SCHEMA,
        "memory": {"type": "object", "properties": {"peak_bytes": _COUNT, "kind": {"type": ["string", "null"]}}},
        "fingerprints": {"type": "object"}, "data": {"type": "object"},
        "checkpoint": {"type": ["object", "null"]},
        "text": {"type": ["object", "null"], "properties": {"chrf": _NUM, "bleu": _NUM}},
        "chunks": {"type": "array"},
        "resumed_from_step": {"type": "array", "items": {"type": "integer", "minimum": 0}},
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
    """The items of a record's per-step, evaluation and chunk lists (`ITEMS`, the chunks' types): linear in the
    record's size, a few C-level passes over each list."""
    steps = record["steps"]
    for key, kinds in ITEMS["steps"].items():
        check_types(steps[key], path, f"steps/{key}/{{}}", fix, kinds)
    evals = record["evals"]
    check_types(evals, path, "evals/{}", fix, (dict,))
    for key, kinds in ITEMS["evals"].items():
        column(evals, key, path, "evals", fix, kinds, optional=key == "time_s")
    check_chunks(record.get("chunks") or [], path, "chunks", fix)
    if (np.asarray(_nan(steps["time_s"]), dtype=np.float64) < 0).any():
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
    """The most bytes a backend's record of the run of `spec` can hold: `RECORD_BASE_BYTES` plus, per step, its
    numbers and a chunk (a chunk holds one step or more), per evaluation (every `eval_interval` steps, and at the
    first and the last) its numbers; `RECORD_CEILING` when the spec cannot say how many steps there are."""
    steps = spec.steps_bound() if spec is not None else None
    if steps is None:
        return RECORD_CEILING
    evals = steps // spec.config.eval_interval + 2
    return RECORD_BASE_BYTES + steps * (STEP_BYTES + CHUNK_BYTES) + evals * EVAL_BYTES


@dataclass(kw_only=True)
class RunRecord(Stored):
    """One backend's record of one run: what it ran (config, seed, device, data, options), the fingerprints of what
    it was fed, where it stands (`status`, the reason of a failure in `failure`), its curves and its figures."""

    # a field the schema types as non-null is left out while None (a record written by hand may lack it)
    OMIT_NONE = ("seed", "total_steps", "data", "fingerprints", "resumed_at", "resumed_from_step", "failure", "signal")

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

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RunRecord:
        stored = str(doc.get("status", Status.RUNNING.value))
        config = doc["config"]
        keys = tuple(doc)
        curves = Curves.from_json(doc) if "steps" in doc else Curves()
        doc = {k: v for k, v in doc.items() if k not in ("steps", "evals", "chunks")}
        doc.update(status=Status.of(stored), curves=curves,
                   config=config if isinstance(config, Config) else stored_config(config, "run record"))
        if doc.get("failure") is None and failure_of(stored) is not None:
            doc["failure"] = failure_of(stored)
        record = super().from_dict(doc)
        record._json_keys = keys  # written back as read: `steps`, `evals`, `chunks` where they were
        return record

    def to_dict(self) -> dict[str, Any]:
        read = getattr(self, "_json_keys", None)
        curves = self.curves.to_json()
        if read and "chunks" not in read and not self.curves.chunks:
            del curves["chunks"]  # a record without contention evidence stays without
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
        Non-finite numbers (stored as null) come back as nan in the loss curves."""
        fix = "rerun or delete that run"
        path = Path(path)
        if spec is None:
            try:
                spec = RunSpec.load(RunPaths.of_dir(path.parent), runnable=False)
            except UsageError:
                spec = None  # the record alone: the ceiling
        doc = read_document(path, SCHEMA, "run record", fix, record_cap(spec), SCHEMA_VERSION, RECORD_JSON_SCHEMA,
                            f"no run writes so much; {fix}", "pass a run id from <out>/runs")
        check_columns(doc, path, fix)
        if backend is not None and doc["backend"] != backend:
            raise UsageError(f"{str(path)!r} is invalid at field 'backend': {doc['backend']!r} in the file of "
                             f"backend {backend!r}; {fix}")
        doc["config"] = stored_config(doc["config"], str(path))
        return typed(cls, doc, path, fix)

    def dump(self, paths: RunPaths) -> None:
        """Write `<backend>.json` (atomically)."""
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
