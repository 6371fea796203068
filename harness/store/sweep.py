"""The sweep manifest `<out>/sweeps/<sweep_id>/sweep.json`: the sweep's spec and executor, its cells (one training run
each: `SweepCell`) and its paired-timing entries (`PairedEntry`), each with its state. harness.sweep.manifest adds
what a loaded manifest is checked for beyond its schema (the executor settings, each cell's config, the entries'
members and paths).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from harness.config.fields import SEED_MAX
from harness.store.paths import RUN_ID_RE, SWEEP_ID_RE, SweepPaths, inside
from harness.store.spec import DataInfo
from harness.store.stored import Stored, read_document, typed
from harness.store.writes import atomic_write_json

SCHEMA = "nanogpt-parity/sweep"
SCHEMA_VERSION = 1
# cell states: pending (never started), queued / running (an executor holds it), completed, interrupted, failed
DONE = "completed"
RERUNNABLE = ("pending", "interrupted", "failed")
STATES = ("pending", "queued", "running", "completed", "interrupted", "failed")
# sweep.json: about 1 KB a cell measured (its config, state and job), 10 MB at MAX_CELLS (10,000) cells; a cell's
# error text and the paired entries add little. 256 MiB is far above any sweep the harness writes, yet bounded.
MAX_MANIFEST_BYTES = 256 * 2**20
# the sweep's name, as harness.sweep.spec.build_spec accepts it at creation: it goes into sweep ids and into the SLURM
# job name (#SBATCH --job-name=harness-NAME), so a stored one is held to the same plain text (no newline, no markup)
SWEEP_NAME_RE = r"^[A-Za-z0-9_.-]{1,40}$"
_JOB_IDS = {"type": "array", "items": {"type": "string", "pattern": "^[0-9]{1,20}(_[0-9]{1,9})?$"}}

_CELL = {
    "type": "object",
    "required": ["index", "key", "config", "backend", "seed", "device", "backend_options", "status"],
    "properties": {
        "index": {"type": "integer", "minimum": 0}, "key": {"type": "string"}, "group": {"type": "string"},
        "label": {"type": "string"}, "source": {"type": "string"}, "overrides": {"type": "object"},
        "config": {"type": "object"},
        "backend": {"type": "string", "pattern": "^[a-z][a-z0-9_]{0,31}$"},
        "seed": {"type": "integer", "minimum": 0, "maximum": SEED_MAX},
        "device": {"enum": ["cpu", "cuda"]},
        "backend_options": {"type": "object"},
        "threads": {"type": ["integer", "null"], "minimum": 1},
        "run_id": {"type": ["string", "null"], "pattern": RUN_ID_RE.pattern},
        "job_ids": _JOB_IDS,
        "status": {"enum": list(STATES)},
        "attempts": {"type": "integer", "minimum": 0},
        "contended": {"type": "boolean"},
    },
}
# A paired-timing entry (the speed comparison of one block of cells): its record's path is derived from the sweep id
# and the entry's index, and the schema holds it to exactly that (a stored sweep.json must not point the harness at a
# file outside its sweep).
_PAIRED = {
    "type": "object",
    "required": ["index", "kind", "key", "label", "seed", "device", "members", "rounds", "path", "status"],
    "properties": {
        "index": {"type": "integer", "minimum": 0}, "kind": {"const": "paired"}, "key": {"type": "string"},
        "label": {"type": "string"}, "seed": {"type": "integer", "minimum": 0, "maximum": SEED_MAX},
        "device": {"enum": ["cpu", "cuda"]}, "dtype": {"enum": ["float32", "float64", None]},
        "members": {"type": "array", "minItems": 2, "items": {"type": "integer", "minimum": 0}},
        "rounds": {"type": "integer", "minimum": 1},
        "path": {"type": "string", "pattern": r"^sweeps/[A-Za-z0-9][A-Za-z0-9._-]{0,199}/paired/[0-9]{1,9}\.json$"},
        "status": {"enum": [*STATES, "incomplete"]}, "attempts": {"type": "integer", "minimum": 0},
        "job_ids": _JOB_IDS,
    },
}
SWEEP_JSON_SCHEMA: dict = {
    "type": "object",
    "required": ["schema", "schema_version", "sweep_id", "spec", "executor", "data", "cells"],
    "properties": {
        "schema": {"const": SCHEMA},
        "schema_version": {"type": "integer"},
        "sweep_id": {"type": "string", "pattern": SWEEP_ID_RE},
        "spec": {"type": "object", "required": ["checkpoint_every", "text"],
                 "properties": {"name": {"type": "string", "pattern": SWEEP_NAME_RE},
                                "checkpoint_every": {"type": ["integer", "null"], "minimum": 0},
                                "text": {"type": "boolean"}, "seeds": {"type": "array"}}},
        "executor": {"type": "object", "required": ["kind"]},  # every field: harness.sweep.settings.check_executor
        "data": {"type": "object", "required": ["path", "sha256"],
                 "properties": {"path": {"type": "string"},
                                "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"}}},
        "cells": {"type": "array", "items": _CELL},
        "paired": {"type": "array", "items": _PAIRED},
        "owner": {"type": "object", "properties": {"pid": {"type": "integer"}, "host": {"type": "string"}}},
    },
}


@dataclass(kw_only=True)
class SweepCell(Stored):
    """One cell: one training run of the sweep (a config, a backend, a seed, a device, options), its run id once its
    run directory exists, its SLURM jobs, and its state (a cache: the truth is its run record)."""

    kind: ClassVar[str] = "cell"
    OMIT_NONE = ("group", "label", "source")

    index: int
    key: str
    group: str | None = None
    label: str | None = None
    source: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any]  # checked as a Config where the manifest is loaded (harness.sweep.manifest)
    backend: str
    seed: int
    device: str
    backend_options: dict[str, Any] = field(default_factory=dict)
    threads: int | None = None
    run_id: str | None = None
    job_ids: list[str] = field(default_factory=list)
    status: str = "pending"
    attempts: int = 0
    contended: bool = False

    @property
    def job(self) -> str:
        """The cell's last SLURM job id ("" for none)."""
        return self.job_ids[-1] if self.job_ids else ""


@dataclass(kw_only=True)
class PairedEntry(Stored):
    """One block of cells (same config, seed, device and dtype option; two or more backends) timed side by side
    after its cells trained: its member cells, the undisturbed rounds wanted, its record's path relative to --out
    (`SweepPaths.paired(index)`), its SLURM jobs and its state."""

    index: int
    kind: str = "paired"
    key: str
    label: str
    seed: int
    device: str
    dtype: str | None = None
    path: str
    members: list[int]
    rounds: int
    status: str = "pending"
    attempts: int = 0
    job_ids: list[str] = field(default_factory=list)

    @property
    def job(self) -> str:
        """The entry's last SLURM job id ("" for none)."""
        return self.job_ids[-1] if self.job_ids else ""

    def record(self, out: Path) -> Path:
        """Its paired-timing record (`path` was checked to be `SweepPaths.paired(index)`, relative to --out; no link
        on the way: harness.store.paths.inside)."""
        return inside(out, *Path(self.path).parts)


@dataclass(kw_only=True)
class SweepSettings(Stored):
    """The sweep's spec as stored (harness.sweep.spec.SweepSpec's JSON): what its later runs take from it, typed;
    the axes it was expanded from are kept as they were written."""

    name: str = "sweep"
    checkpoint_every: int | None = None
    threads: int | None = None
    text: bool = True


@dataclass(kw_only=True)
class SlurmSettings(Stored):
    """The SLURM executor's settings (harness.sweep.settings.check_slurm checks them: they go into job scripts)."""

    OMIT_NONE = ("partition", "gpus_per_job", "cpus_per_job", "mem_gb", "time_min", "array_parallelism", "sbatch")

    partition: str | None = None
    gpus_per_job: int | None = None
    cpus_per_job: int | None = None
    mem_gb: float | None = None
    time_min: int | None = None
    array_parallelism: int | None = None
    sbatch: list[str] | None = None


@dataclass(kw_only=True)
class ExecutorSettings(Stored):
    """Where the sweep's cells run: "local" (`jobs` at once) or "slurm" (`slurm` settings)."""

    kind: str = "local"
    jobs: int = 1
    slurm: SlurmSettings = field(default_factory=SlurmSettings)

    @property
    def contended(self) -> bool:
        """Whether cells run side by side on this machine (their timings contend)."""
        return self.kind == "local" and self.jobs > 1


@dataclass(kw_only=True)
class Owner(Stored):
    """The `harness sweep` process that runs the sweep now (or ran it last)."""

    OMIT_NONE = ("pid", "host")

    pid: int | None = None
    host: str | None = None


@dataclass(kw_only=True)
class SweepManifest(Stored):
    """A sweep's manifest: its spec (as stored: `SweepSettings`), its executor, its corpus, its cells and paired
    entries, and the process that runs it."""

    OMIT_NONE = ("owner", "updated_at")

    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    sweep_id: str
    created_at: str | None = None
    spec: SweepSettings
    executor: ExecutorSettings
    data: DataInfo
    cells: list[SweepCell] = field(default_factory=list)
    paired: list[PairedEntry] = field(default_factory=list)
    owner: Owner | None = None
    updated_at: str | None = None

    @classmethod
    def read(cls, paths: SweepPaths) -> SweepManifest:
        """The manifest at `paths`, read within MAX_MANIFEST_BYTES and checked against its schema and version (a
        regular file only: a named pipe put at sweep.json must not hang --status); UsageError naming the field."""
        fix = "that sweep cannot be used; restore its sweep.json or start a new sweep"
        doc = read_document(paths.manifest, SCHEMA, "the sweep manifest", fix, MAX_MANIFEST_BYTES, SCHEMA_VERSION,
                            SWEEP_JSON_SCHEMA, foreign=".", label="sweep manifest")
        return typed(cls, dict(doc, paired=doc.get("paired") or []), paths.manifest, fix)

    def dump(self, paths: SweepPaths) -> None:
        """Write sweep.json (atomically)."""
        atomic_write_json(paths.manifest, self.to_dict())
