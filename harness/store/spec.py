"""`spec.json`: what a run was asked for (config, seed, data provenance, backends and their options), written once
by `harness run` / `harness parity` / a sweep before any worker starts, and read by every worker and every verb that
acts on the run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from harness.config.fields import NAME_RE, Config, config_from_dict
from harness.errors import UsageError
from harness.store.paths import RUN_ID_RE, RunPaths
from harness.store.stored import Stored, read_document, typed
from harness.store.writes import atomic_write_json

SPEC_SCHEMA = "nanogpt-parity/run-spec"
SPEC_SCHEMA_VERSION = 1
MAX_SPEC_BYTES = 16 * 2**20  # config, options, data provenance; the vocabulary: at most 0x110000 symbols x 12 bytes

# Names that reach file names and HTML pages are checked against the patterns they were made with: a record edited
# to hold markup or a path in a name is refused where it is read, not shown.
NAME_PATTERN = {"type": "string", "pattern": NAME_RE.pattern}
BACKEND_PATTERN = {"type": "string", "pattern": r"^[a-z][a-z0-9_]{0,31}$"}
RUN_ID_PATTERN = {"type": "string", "pattern": RUN_ID_RE.pattern}
CONFIG_SCHEMA = {"type": "object", "required": ["name", "n_embd", "block_size", "n_layer", "n_head", "d_hidden"],
                 "properties": {"name": NAME_PATTERN}}

SPEC_JSON_SCHEMA: dict = {
    "type": "object",
    "required": ["schema", "run_id", "config", "seed", "device", "data", "backends", "backend_options"],
    "properties": {
        "schema": {"const": SPEC_SCHEMA},
        "schema_version": {"type": "integer"},
        "run_id": RUN_ID_PATTERN,
        "label": NAME_PATTERN,
        "config": CONFIG_SCHEMA,
        "seed": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},
        "device": {"enum": ["cpu", "cuda"]},
        "data": {"type": "object", "required": ["path", "sha256"],
                 "properties": {"path": {"type": "string"}, "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                                "n_chars": {"type": "integer", "minimum": 0}, "vocab": {"type": "string"},
                                "bom_stripped": {"type": "boolean"},
                                "line_endings": {"enum": ["normalised", "kept"]}}},
        "backends": {"type": "array", "minItems": 1, "items": BACKEND_PATTERN},
        "backend_options": {"type": "object", "additionalProperties": {"type": "object"}},
        "checkpoint_every": {"type": ["integer", "null"], "minimum": 0},
        "text": {"type": "boolean"},
        "parity": {"type": ["boolean", "object"],  # object: parity options
                   "properties": {"opt_steps": {"type": ["integer", "null"], "minimum": 0},
                                  "reference": {"type": ["string", "null"]}}},
        "threads": {"type": ["integer", "null"], "minimum": 1},
        "paired_rounds": {"type": ["integer", "null"], "minimum": 0},
        "experiment": {"type": "object", "required": ["sha256", "fields"],
                       "properties": {"sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                                      "fields": {"type": "object",
                                                 "additionalProperties": {"type": "string",
                                                                          "pattern": "^[0-9a-f]{16}$"}}}},
    },
}

# What defines a run's experiment, each field of spec.json that can change what it computes or records: the config
# (every field), the seed, the device(s), the data (its sha256 and how it was read: line endings, byte-order mark,
# vocabulary; not `path`, where it came from: the run trains on its checked copy in --out), the backends and their
# options (dtype, precision, compile mode, ...), the threads, checkpoint_every, whether text is measured, and the
# parity options. Not: the ids, the label (the config's name, itself in the config), created_at, and paired_rounds
# (the paired timing after training, which `harness resume --paired-rounds` may change).
DEFINING = ("config", "seed", "device", "devices", "data", "backends", "backend_options", "checkpoint_every", "text",
            "parity", "threads")
_PER_KEY = ("config", "data", "devices", "backend_options")  # objects with a digest per key ("config.learning_rate")


@dataclass(kw_only=True)
class DataInfo(Stored):
    """The corpus a run trained on: where it came from, its sha256, and how it was read (harness.core.data.Corpus).
    The spec and the run record hold all of it, parity.json and sweep.json the path and sha256."""

    OMIT_NONE = ("n_chars", "vocab_size", "vocab", "n_train", "n_val", "bom_stripped", "line_endings",
                 "line_endings_changed")

    path: str
    sha256: str
    n_chars: int | None = None
    vocab_size: int | None = None
    vocab: str | None = None
    n_train: int | None = None
    n_val: int | None = None
    bom_stripped: bool | None = None
    line_endings: str | None = None
    line_endings_changed: int | None = None


@dataclass(kw_only=True)
class ParityOptions(Stored):
    """What `harness parity` (or the kit's export) adds to a run's workers: the optimizer steps whose states are
    recorded (None: every step) and the backend the others re-synchronise from (None: none)."""

    opt_steps: int | None = None
    reference: str | None = None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def field_digest(name: str, value: Any) -> str:
    """16 hex digits of sha256 over a defining field's name and canonical JSON value."""
    return hashlib.sha256(f"{name}={_canonical(value)}".encode()).hexdigest()[:16]


@dataclass(kw_only=True)
class Experiment(Stored):
    """What defines a run (`DEFINING`), as digests written with its spec: `sha256` over all of it, and one per field
    (`fields`: "seed", "config.learning_rate", "backend_options.torch", ...), so that a spec.json changed since is
    refused naming what changed (harness.run.resumable). Each record carries the `sha256` it was written under."""

    sha256: str
    fields: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, values: dict[str, Any], names: list[str] | None = None) -> Experiment:
        """The digests of `values` (the spec's `defining` fields), over `names` (default: all of them)."""
        names = sorted(values) if names is None else sorted(names)
        chosen = {n: values.get(n) for n in names}
        return cls(sha256=hashlib.sha256(_canonical(chosen).encode()).hexdigest(),
                   fields={n: field_digest(n, v) for n, v in chosen.items()})


@dataclass(kw_only=True)
class RunSpec(Stored):
    """One run's spec.json. `parity` is None for an ordinary run (stored as `false`). `experiment`: the digests of
    what defines it, written with it (None in a spec of the previous release)."""

    OMIT_NONE = ("label", "experiment")

    schema: str = SPEC_SCHEMA
    schema_version: int = SPEC_SCHEMA_VERSION
    run_id: str
    label: str | None = None
    created_at: str | None = None
    config: Config
    seed: int
    device: str
    devices: dict[str, str] = field(default_factory=dict)
    data: DataInfo
    backends: list[str]
    backend_options: dict[str, dict[str, Any]]
    checkpoint_every: int | None = None
    text: bool = True
    parity: ParityOptions | None = None
    threads: int | None = None
    paired_rounds: int | None = None
    experiment: Experiment | None = None

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RunSpec:
        config = doc.get("config")
        doc = dict(doc, config=config if isinstance(config, Config) else stored_config(config, "spec.json"))
        if doc.get("devices") is None and "devices" in doc:
            doc["devices"] = {}
        parity = doc.get("parity")
        if "parity" in doc:  # false: an ordinary run; true: parity with every option at its default
            doc["parity"] = {} if parity is True else parity if isinstance(parity, dict) else None
        return super().from_dict(doc)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["config"] = self.config.to_dict()
        out["parity"] = False if self.parity is None else self.parity.to_dict()
        return out

    # --- what defines the experiment ----------------------------------------------------------------------------
    def defining(self) -> dict[str, Any]:
        """The fields that define the run (`DEFINING`) as they are now, by name: an object of `_PER_KEY` one entry
        per key ("config.seed" ... "backend_options.torch"), the data without its `path`."""
        doc = self.to_dict()
        out: dict[str, Any] = {}
        for key in DEFINING:
            value = doc.get(key)
            if key in _PER_KEY and isinstance(value, dict):
                out.update({f"{key}.{k}": v for k, v in value.items() if (key, k) != ("data", "path")})
            else:
                out[key] = value
        return out

    def changed(self) -> list[str] | None:
        """The defining fields that differ from the digests written with the spec (empty: none; ["experiment"]: the
        digests themselves were edited); None for a spec without them (the previous release's)."""
        if self.experiment is None:
            return None
        stored = self.experiment.fields
        now = Experiment.of(self.defining(), list(stored))
        changed = [name for name in sorted(stored) if now.fields[name] != stored[name]]
        if not changed and now.sha256 != self.experiment.sha256:
            changed = ["experiment"]
        return changed

    def device_of(self, backend: str) -> str:
        """The device backend `backend` runs on (parity: one per backend)."""
        return self.devices.get(backend) or self.device

    def options_of(self, backend: str) -> dict[str, Any]:
        """The constructor options of backend `backend`."""
        return self.backend_options.get(backend) or {}

    # --- how big the run's records can be ---------------------------------------------------------------------
    def steps_bound(self) -> int | None:
        """The most training steps the run can have: its config's `steps`, else `epochs` times the batches of its
        corpus (no more than n_chars // (block_size x batch_size) per epoch); None when the spec cannot say."""
        c = self.config
        if c.steps:
            return c.steps
        if self.data.n_chars is None:
            return None
        return c.epochs * (self.data.n_chars // (c.block_size * c.batch_size) + 1)

    @classmethod
    def load(cls, paths: RunPaths, runnable: bool = True) -> RunSpec:
        """The run's spec.json, read within MAX_SPEC_BYTES and checked (schema, version, its run id against its
        directory, and with `runnable` its config as a run needs it: unknown or invalid keys refused); any problem
        is a UsageError naming the file and the field. A reader that runs nothing (a report) passes `runnable`
        False: a config the harness cannot run is still shown."""
        path = paths.spec
        fix = "that run cannot be used; delete it or start a new run"
        doc = read_document(path, SPEC_SCHEMA, "run spec", fix, MAX_SPEC_BYTES, SPEC_SCHEMA_VERSION,
                            SPEC_JSON_SCHEMA, f"no run writes so much; {fix}", "schema")
        if doc["run_id"] != paths.run_id:
            raise UsageError(f"{str(path)!r} is invalid at field 'run_id': {doc['run_id']!r} is not its "
                             f"directory's name; {fix}")
        doc["config"] = stored_config(doc["config"], str(path), strict=runnable)
        return typed(cls, doc, path, fix)

    def dump(self, paths: RunPaths) -> None:
        """Write spec.json (atomically), with the digests of what defines the run (`experiment`, made here once)."""
        if self.experiment is None:
            self.experiment = Experiment.of(self.defining())
        atomic_write_json(paths.spec, self.to_dict())


def stored_config(doc: dict[str, Any], source: str, strict: bool = False) -> Config:
    """The Config of a stored config `doc`: `strict`, checked as a run needs it (harness.config.fields.
    config_from_dict: unknown, missing or invalid keys are a UsageError naming `source`); else as far as it can be
    read, for a reader that runs nothing (a report of a damaged run): keys this harness does not know left out,
    missing ones None, values unchecked."""
    if strict:
        return config_from_dict(doc, source)
    fields = dataclasses.fields(Config)
    return Config(**{f.name: doc.get(f.name) for f in fields if f.name in doc or f.default is dataclasses.MISSING})


def load_spec_at(paths: RunPaths, runnable: bool = True) -> RunSpec:
    """The spec of run `paths`, with "no such run" said as such (UsageError naming --out) when the directory or its
    spec.json is missing."""
    if not paths.dir.is_dir():
        raise UsageError(f"no run {paths.run_id!r} under {str(RunPaths.root(paths.out))!r}; pass an existing run id "
                         "(and the same --out as the run)")
    if not paths.spec.exists() and not paths.spec.is_symlink():
        raise UsageError(f"run {paths.run_id!r} has no spec.json; it is not a complete run directory")
    return RunSpec.load(paths, runnable)

