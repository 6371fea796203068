"""The stored form of contention evidence (harness.timing.contention measures and judges it): the chunks a record
holds, checked where a record is read, and `Contention`, the summary a run record keeps in `timings.contention`.

A chunk is the evidence of one span of steps, as `harness.timing.contention.chunk` writes it: `step`, `n` (the steps
it covers), `wall_s`, `cpu_s` and the optional readings of `CHUNK_OPTIONAL`. Chunks stay plain JSON objects (a run
keeps one every half second, and harness.timing.contention is the one module that reads their fields).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from harness.errors import UsageError
from harness.files import check_types, column, short_json
from harness.store.stored import Stored

# The types of a chunk's fields as harness.timing.contention.chunk writes them, against which a chunk read back from
# disk is checked (`check_chunks`): the four every chunk has, then the ones it may leave out. null: not measured, or
# not finite.
_NUMBER = (int, float, type(None))
CHUNK_REQUIRED: dict[str, tuple[type, ...]] = {"step": (int,), "n": (int,), "wall_s": _NUMBER, "cpu_s": _NUMBER}
CHUNK_OPTIONAL: dict[str, tuple[type, ...]] = {
    **{k: _NUMBER for k in ("exec_s", "wait_s", "busy_s", "steal_s", "total_s", "others_cpu_s", "psi_some_s", "at",
                            "threads", "ncpu")},
    "load": (list, type(None)), "gpu": (list, type(None)),
}
GPU_STATE: dict[str, tuple[type, ...]] = {"sm_mhz": _NUMBER, "reasons": (int, type(None)),
                                          "others": (int, type(None)), "own_listed": (bool, type(None))}


def check_chunks(chunks: Any, path: str | os.PathLike, where: str, fix: str) -> None:
    """UsageError (harness.files' one line, naming the field) unless `chunks` is a list of chunks of the types
    harness.timing.contention.chunk writes (`CHUNK_REQUIRED`, `CHUNK_OPTIONAL`, the GPU states of `GPU_STATE`), none
    starting before step 0 or holding no step: what its summary and its reasons read cannot fail on them. Linear in
    the chunks: C-level passes, a Python loop only over chunks that hold GPU states."""
    if not isinstance(chunks, list):
        raise UsageError(f"{str(path)!r} is invalid at field {where!r}: {short_json(chunks)} is not a list; {fix}")
    check_types(chunks, path, f"{where}/{{}}", fix, (dict,))
    for key, kinds in CHUNK_REQUIRED.items():
        column(chunks, key, path, where, fix, kinds)
    for key, kinds in CHUNK_OPTIONAL.items():
        column(chunks, key, path, where, fix, kinds, optional=True)
    if chunks and (min(c["step"] for c in chunks) < 0 or min(c["n"] for c in chunks) < 1):
        raise UsageError(f"{str(path)!r} is invalid at field {where!r}: a chunk starts before step 0 or holds no "
                         f"step; {fix}")
    loads = [(i, c["load"]) for i, c in enumerate(chunks) if c.get("load")]
    for i, load in loads:
        check_types(load, path, f"{where}/{i}/load/{{}}", fix, _NUMBER)
    for i, c in ((i, c) for i, c in enumerate(chunks) if c.get("gpu")):
        states = c["gpu"]
        check_types(states, path, f"{where}/{i}/gpu/{{}}", fix, (dict, type(None)))
        for j, state in enumerate(states):
            for key, kinds in GPU_STATE.items() if state else ():
                check_types([state.get(key)], path, f"{where}/{i}/gpu/{j}/{key}", fix, kinds)


def truncate_chunks(chunks: list[dict], steps: int) -> list[dict]:
    """The chunks that cover steps before `steps`; one that straddles it keeps its evidence for its first part."""
    out = []
    for c in chunks:
        if c["step"] < steps:
            out.append(c if c["step"] + c["n"] <= steps else dict(c, n=steps - c["step"]))
    return out


_NUM = {"type": ["number", "null"]}  # null: a non-finite value (NaN or infinity)
_COUNT = {"type": ["integer", "null"], "minimum": 0}

# `timings.contention` of a run record: the fields a report reads, typed
CONTENTION_JSON_SCHEMA: dict = {
    "type": ["object", "null"],
    "properties": {"evidence": {"type": "string"}, "chunks": _COUNT, "steady_steps": _COUNT,
                   "disturbed_steps": _COUNT, "contended_fraction": {"type": ["number", "null"], "minimum": 0,
                                                                     "maximum": 1},
                   "mostly_disturbed": {"type": "boolean"}, "disturbed_chunks": _COUNT,
                   "reasons": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
                   "cpu_per_wall": _NUM, "wait_fraction_median": _NUM, "wait_fraction_max": _NUM,
                   "steal_fraction_max": _NUM, "others_cpus_median": _NUM,
                   "load_range": {"type": ["array", "null"], "items": _NUM, "minItems": 2, "maxItems": 2},
                   "threads_max": _COUNT, "ncpu": _COUNT, "gpu_evidence": {"type": "string"}},
}


@dataclass(kw_only=True)
class Contention(Stored):
    """How disturbed a run's steady steps were (harness.timing.contention.summarize): the share of steady steps in a
    chunk judged disturbed by the rule `rule`, whether that is most of them, why (`reasons`: chunks per kind), and
    the evidence in short. `contended_fraction` is None where the CPU part of the rule cannot be judged."""

    OMIT_NONE = ("gpu_evidence",)

    rule: dict[str, Any] | None = None
    evidence: str = "none"
    chunks: int = 0
    steady_steps: int | None = None
    disturbed_steps: int | None = None
    contended_fraction: float | None = None
    mostly_disturbed: bool = False
    disturbed_chunks: int | None = None
    reasons: dict[str, int] = field(default_factory=dict)
    cpu_per_wall: float | None = None
    wait_fraction_median: float | None = None
    wait_fraction_max: float | None = None
    steal_fraction_max: float | None = None
    others_cpus_median: float | None = None
    load_range: list[float | None] | None = None
    threads_max: int | None = None
    ncpu: int | None = None
    gpu_evidence: str | None = None
