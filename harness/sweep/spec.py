"""A sweep spec (a TOML file, or the same from flags) and the cells it expands to.

Axes: `sizes` and/or `configs` (TOML files), `backends`, `seeds` (a count or a list), `devices`, `precision`,
`dtype`, and any config field (or nanoGPT's name for it, as on `harness run --set`) as a list under `[fields]`
(`--axis NAME=V1,V2` on the command line); `backend_devices` puts one backend's cells on another device.
Cells are the cross product; every cell is validated (its Config, its backend, device and options) before anything
is written. When `n_embd` is swept and `d_hidden` is not, `d_hidden` keeps the preset's ratio to `n_embd` (4 in
every preset); every other field keeps its value and must stay valid (e.g. `n_head` must divide every `n_embd`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from harness.backends import DEFAULT_BACKEND, taking
from harness.backends.declaration import listing
from harness.config import nanogpt
from harness.config.fields import SEED_MAX, Config, short
from harness.config.load import load_config
from harness.config.presets import PRESETS
from harness.errors import UsageError
from harness.files import type_words
from harness.store.sweep import SWEEP_NAME_RE
from harness.sweep.settings import check_slurm
from harness.timing.paired import ROUNDS

DEFAULT_SEED = 1337  # seeds = N means DEFAULT_SEED, DEFAULT_SEED + 1, ..., as `harness run --seed` defaults to 1337
MAX_CELLS_WITHOUT_YES = 300
MAX_CELLS = 10_000  # even with --yes: one manifest, one process following it; split a larger study into sweeps
TOP_KEYS = {"name", "sizes", "configs", "backends", "seeds", "devices", "backend_devices", "precision", "dtype",
            "steps", "epochs",
            "eval_interval", "checkpoint_every", "threads", "text", "fields", "slurm", "executor", "jobs",
            "paired_rounds"}
# Config fields a sweep may not list: the name is the cell's label, steps/epochs are the schedule (top level)
NOT_SWEEPABLE = {"name", "steps", "epochs"}
FIELDS = {f.name for f in dataclasses.fields(Config)} - NOT_SWEEPABLE
# nanoGPT's names, accepted as on `harness run --set` (harness.config.nanogpt.apply_overrides): an alias of a field, or
# decay_lr (true: the cosine schedule the config describes; false: a constant rate)
NANOGPT_NAMES = {**nanogpt.ALIASES, "decay_lr": "lr_schedule"}


@dataclass
class SweepSpec:
    """What to run: the axes of the cross product and the schedule shared by every cell."""

    name: str = "sweep"
    sizes: list[str] = field(default_factory=list)
    configs: list[str] = field(default_factory=list)  # TOML paths (absolute once parsed)
    backends: list[str] = field(default_factory=lambda: [DEFAULT_BACKEND])
    seeds: list[int] | range = field(default_factory=lambda: [DEFAULT_SEED])  # a count stays a range until expanded
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    backend_devices: dict[str, str] = field(default_factory=dict)  # `--device NAME=DEVICE`: that backend's cells
    precision: list[str | None] = field(default_factory=lambda: [None])
    dtype: list[str | None] = field(default_factory=lambda: [None])
    fields: dict[str, list[Any]] = field(default_factory=dict)
    steps: int | None = None
    epochs: int | None = None
    eval_interval: int | None = None
    checkpoint_every: int = 0
    threads: int | None = None
    text: bool = True
    paired_rounds: int = ROUNDS  # undisturbed rounds of paired timing per block; 0: none

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), seeds=list(self.seeds))


@dataclass
class Cell:
    """One backend run of the sweep: a validated config, a backend, a seed, a device and backend options."""

    index: int
    config: Config
    source: str  # the size preset or the config file the cell starts from
    backend: str
    seed: int
    device: str
    options: dict[str, Any]
    overrides: dict[str, Any]  # the swept fields' values (as listed, before scaling)

    @property
    def group(self) -> str:
        """Everything but the seed: the cells of one group differ only in their seed."""
        opts = "".join(f",{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.config.name}/{self.backend}/{self.device}{opts}"

    @property
    def key(self) -> str:
        return f"{self.group}/seed={self.seed}"


def _list(value: Any, what: str, kind: type | tuple[type, ...] = str) -> list:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise UsageError(f"sweep axis {what} is empty; list at least one value or leave it out")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for v in values:
        if not isinstance(v, kind) or (isinstance(v, bool) and bool not in kinds):
            raise UsageError(f"sweep axis {what}: {v!r} is not {type_words(kinds)}; fix the value")
    if len(set(map(repr, values))) != len(values):
        raise UsageError(f"sweep axis {what} lists a value twice ({values}); name each value once")
    return values


def parse_seeds(value: Any) -> list[int] | range:
    """`3` -> the 3 seeds from 1337 (a range: counted before anything is built); `[1, 2]` -> [1, 2].

    A TOML value must be a whole number or a list of them (`seeds = "3"` is refused); the flag's text goes through
    `parse_seed_flag` first."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise UsageError(f"seeds = {value}: the number of seeds must be positive")
        if value > SEED_MAX - DEFAULT_SEED + 1:
            raise UsageError(f"seeds = {value}: the seeds would run past {SEED_MAX} (they count up from "
                             f"{DEFAULT_SEED}); give a smaller count or a list of seeds")
        return range(DEFAULT_SEED, DEFAULT_SEED + value)
    if not isinstance(value, list):
        raise UsageError(f"seeds = {value!r}: give a count (seeds = 3) or a list of whole numbers (seeds = [1, 2, 3])")
    seeds = _list(value, "seeds", int)
    bad = [s for s in seeds if not 0 <= s <= SEED_MAX]
    if bad:
        raise UsageError(f"seed {bad[0]} is out of range; a seed is a whole number from 0 to {SEED_MAX}")
    return seeds


def parse_seed_flag(text: str) -> int | list[int]:
    """The text of `--seeds`: "3" -> 3 (a count), "1,2" -> [1, 2]."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        ints = [int(p) for p in parts]
    except ValueError:
        raise UsageError(f"--seeds {text!r}: give a count (3) or a list of whole numbers (1,2,3)") from None
    if not ints:
        raise UsageError(f"--seeds {text!r}: give a count (3) or a list of whole numbers (1,2,3)")
    return ints[0] if len(ints) == 1 and "," not in text else ints


def parse_set(items: list[str], option: str = "--axis") -> dict[str, list[Any]]:
    """`--axis learning_rate=0.003,0.01` (repeatable; `option` names the flag in messages) -> {"learning_rate":
    [0.003, 0.01]}: a sweep axis (`--set NAME=VALUE`: an axis of one value). Each value is read as `harness run
    --set` reads one (harness.config.nanogpt.parse_value: a Python literal such as False or 1e-3, else TOML's
    spelling, else the text)."""
    fields: dict[str, list[Any]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not name.strip() or not values.strip():
            raise UsageError(f"{option} {item!r}: write NAME=VALUE, or NAME=V1,V2 for an axis (e.g. --axis "
                             "learning_rate=0.003,0.01)")
        name = name.strip()
        if name in fields:
            raise UsageError(f"{option} {name} given twice; list all its values in one --axis {name}=V1,V2")
        fields[name] = [nanogpt.parse_value(v.strip(), f"{option} {name}") for v in values.split(",")]
    return fields


def _backend_devices(value: Any, spec: SweepSpec) -> dict[str, str]:
    """`backend_devices = {torch = "cuda"}` (`--device torch=cuda`): the device of one backend's cells, checked."""
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise UsageError(f"sweep backend_devices must be a table of backend = device, e.g. "
                         f"{{{DEFAULT_BACKEND} = \"cuda\"}}")
    for name, device in value.items():
        if name not in spec.backends:
            raise UsageError(f"sweep backend_devices names {short(name)}, which is not one of the sweep's backends "
                             f"({', '.join(spec.backends)}); drop it or add the backend")
        if device not in ("cpu", "cuda"):
            raise UsageError(f"sweep backend_devices: unknown device {short(device)} for {name}; use cpu or cuda")
    if value and len(spec.devices) > 1:
        raise UsageError("a device per backend (--device NAME=DEVICE, backend_devices) and a device axis (--axis "
                         "device=..., devices) exclude each other; pass one")
    return dict(value)


def _positive(value: Any, what: str, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"sweep {what} must be a positive whole number, got {value!r}")
    return value


def load_toml(path: Path) -> tuple[dict, Path]:
    """The TOML document of a sweep file (checked for unknown keys) and the directory its paths are relative to."""
    from harness.config.presets import MAX_TOML_BYTES
    from harness.files import read_regular

    blob = read_regular(path, "sweep file", "pass the path of a TOML file", MAX_TOML_BYTES)
    try:
        doc = tomllib.loads(blob.decode("utf-8"))
    # TOMLDecodeError is a ValueError, as is an integer past Python's digit limit; deep nesting runs out of recursion
    except (UnicodeDecodeError, ValueError, MemoryError, RecursionError) as exc:
        reason = short(str(exc), 120)[1:-1] if str(exc) else type(exc).__name__
        raise UsageError(f"{path}: not valid TOML ({reason}); fix the syntax") from None
    unknown = set(doc) - TOP_KEYS
    if unknown:
        raise UsageError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(TOP_KEYS))}")
    try:
        check_slurm(doc.get("slurm", {}))
    except UsageError as exc:
        raise UsageError(f"{path}: {exc}") from None
    if not isinstance(doc.get("fields", {}), dict):
        raise UsageError(f"{path}: [fields] must be a table of FIELD = [values]")
    return doc, path.parent


def build_spec(doc: dict, base: Path) -> SweepSpec:
    """A SweepSpec from a mapping (the TOML document, with the flags already merged in)."""
    spec = SweepSpec()
    if "name" in doc:
        if not isinstance(doc["name"], str) or not re.fullmatch(SWEEP_NAME_RE, doc["name"]):
            raise UsageError(f"sweep name {short(doc['name'])}: use 1-40 letters, digits, '.', '_' or '-'")
        spec.name = doc["name"]
    if "sizes" in doc:
        spec.sizes = _list(doc["sizes"], "sizes")
        for s in spec.sizes:
            if s not in PRESETS:
                raise UsageError(f"unknown size {s!r} in the sweep; choose from {', '.join(PRESETS)}")
    if "configs" in doc:
        spec.configs = [str((base / p).resolve()) if not Path(p).is_absolute() else p
                        for p in _list(doc["configs"], "configs")]
    if not spec.sizes and not spec.configs:
        spec.sizes = ["small"]
    if "backends" in doc:
        spec.backends = _list(doc["backends"], "backends")
    if "seeds" in doc:
        spec.seeds = parse_seeds(doc["seeds"])
    if "devices" in doc:
        spec.devices = _list(doc["devices"], "devices")
    if "backend_devices" in doc:
        spec.backend_devices = _backend_devices(doc["backend_devices"], spec)
    for key in ("precision", "dtype"):
        if key in doc:
            setattr(spec, key, _list(doc[key], key))
    if spec.precision != [None] and not taking("precision", spec.backends):
        # as `harness run --precision` with such backends: an option that would apply to no cell is an error
        raise UsageError(f"precision applies to {listing(taking('precision'))} only, and this sweep has "
                         f"{', '.join(spec.backends)}; drop precision or add one of those backends")
    fields = doc.get("fields", {})
    targets: dict[str, str] = {}  # the field each name sets: a field and its nanoGPT alias may not both be swept
    for name, values in fields.items():
        target = NANOGPT_NAMES.get(name, name)
        if target not in FIELDS:
            hint = " (set it at the top level of the sweep)" if target in NOT_SWEEPABLE else ""
            alias = f" (nanoGPT's name for {target})" if name != target else ""
            raise UsageError(f"unknown config field {short(name)}{alias} in the sweep{hint}; sweepable fields: "
                             f"{', '.join(sorted(FIELDS))} (and nanoGPT's {', '.join(sorted(NANOGPT_NAMES))})")
        if target in targets:
            raise UsageError(f"the sweep lists both {targets[target]} and {name}, which set the same field; keep one")
        targets[target] = name
        spec.fields[name] = _list(values, f"fields.{name}", (int, float, str, bool))  # bool: the model options
    if doc.get("steps") is not None and doc.get("epochs") is not None:
        raise UsageError("the sweep sets both steps and epochs; keep one")
    spec.steps = _positive(doc.get("steps"), "steps")
    spec.epochs = _positive(doc.get("epochs"), "epochs")
    spec.eval_interval = _positive(doc.get("eval_interval"), "eval_interval")
    spec.checkpoint_every = _positive(doc.get("checkpoint_every"), "checkpoint_every") or 0
    spec.threads = _positive(doc.get("threads"), "threads")
    if doc.get("paired_rounds") is not None:
        value = doc["paired_rounds"]
        from harness.timing.paired import MAX_ROUNDS

        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_ROUNDS:
            raise UsageError(f"sweep paired_rounds must be a whole number from 0 to {MAX_ROUNDS}, got {value!r}")
        spec.paired_rounds = value
    if "text" in doc:
        if not isinstance(doc["text"], bool):
            raise UsageError(f"sweep text must be true or false, got {doc['text']!r}")
        spec.text = doc["text"]
    return spec


def count_cells(spec: SweepSpec) -> int:
    """How many cells `expand(spec)` makes, by arithmetic alone (nothing is built: seeds = 2**40 is counted at once)."""
    takers = taking("precision", spec.backends)
    per_seed = len(spec.devices) * len(spec.dtype) * sum(
        len(spec.precision) if backend in takers else 1 for backend in spec.backends)
    return (len(spec.sizes) + len(spec.configs)) * math.prod(len(v) for v in spec.fields.values()) \
        * len(spec.seeds) * per_seed


def check_count(spec: SweepSpec, yes: bool) -> int:
    """The number of cells, refused (UsageError) above MAX_CELLS_WITHOUT_YES without `yes` and above MAX_CELLS."""
    n = count_cells(spec)
    if n > MAX_CELLS:
        raise UsageError(f"this sweep has {n:,} cells; a sweep holds at most {MAX_CELLS:,}: shrink an axis or split "
                         "the study into several sweeps")
    if n > MAX_CELLS_WITHOUT_YES and not yes:
        raise UsageError(f"this sweep has {n:,} cells (more than {MAX_CELLS_WITHOUT_YES}); pass --yes to run them all, "
                         "or shrink an axis")
    return n


def _base_configs(spec: SweepSpec) -> list[tuple[str, Config]]:
    bases = [(size, load_config(size)) for size in spec.sizes]
    bases += [(path, load_config(path=path)) for path in spec.configs]
    names = [c.name for _, c in bases]
    if len(set(names)) != len(names):
        raise UsageError(f"two sweep configs share the name {sorted(n for n in names if names.count(n) > 1)[0]!r}; "
                         "give each config file its own `name`")
    return bases


def _label(name: str, overrides: dict[str, Any]) -> str:
    parts = [name] + [f"{k}{v}" for k, v in overrides.items()]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(parts))


def expand(spec: SweepSpec) -> list[Cell]:
    """The cells of `spec` (the cross product of every axis), each Config validated; raises UsageError."""
    cells: list[Cell] = []
    names = list(spec.fields)
    takers = taking("precision", spec.backends)  # the backends that take a matmul precision option
    for source, base in _base_configs(spec):
        schedule: dict[str, Any] = {}
        if spec.steps is not None:
            schedule["steps"] = spec.steps
        if spec.epochs is not None:
            schedule.update(epochs=spec.epochs, steps=None)
        if spec.eval_interval is not None:
            schedule["eval_interval"] = spec.eval_interval
        for values in itertools.product(*(spec.fields[n] for n in names)):
            overrides = dict(zip(names, values))
            label = _label(base.name, overrides)
            # as `harness run --set`: nanoGPT's names, and d_hidden keeping its ratio when n_embd is swept
            config = nanogpt.apply_overrides(base, dict(schedule, **overrides, name=label))
            # seeds outermost, backends innermost: the cells that a paired comparison sets side by side run
            # next to each other, so slow drift of the machine hits both alike
            for seed in spec.seeds:
                for device in spec.devices:
                    for dtype in spec.dtype:
                        for backend in spec.backends:
                            precisions = spec.precision if backend in takers else [None]
                            where = spec.backend_devices.get(backend, device)
                            for precision in precisions:
                                options = {k: v for k, v in (("dtype", dtype), ("precision", precision)) if v}
                                cells.append(Cell(len(cells), config, source, backend, seed, where, options,
                                                  overrides))
    return cells
