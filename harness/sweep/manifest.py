"""The sweep manifest `<out>/sweeps/<sweep_id>/sweep.json`: spec, cells, run ids, executor job ids, status per cell.

The manifest is written only by the `harness sweep` process (atomically, like every record). The status it holds
is a cache: the truth about a cell is its RunRecord (and, on SLURM, whether its job is still queued or running),
and `refresh` reads that again.

Every load checks the document against `SWEEP_JSON_SCHEMA`, the executor settings again (they are written into
job scripts: harness.sweep.settings) and every cell's config, so a damaged or hand-edited sweep.json is one line
naming the field, never a traceback and never a job script built from it. The directory `--out` must still be
trusted: on SLURM, submitit's pickles under `<out>/sweeps/<id>/slurm/` are what each job unpickles and runs.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from harness.config.fields import SEED_MAX, config_from_dict
from harness.errors import UsageError
from harness.files import check_version, read_json
from harness.run import records
from harness.run.records import RunPaths, SweepPaths
from harness.sweep.settings import check_executor
from harness.units import utc_now

SCHEMA = "nanogpt-parity/sweep"
SCHEMA_VERSION = 1
# cell states: pending (never started), queued / running (an executor holds it), completed, interrupted, failed
DONE = "completed"
RERUNNABLE = ("pending", "interrupted", "failed")
STATES = ("pending", "queued", "running", "completed", "interrupted", "failed")
# sweep.json: about 1 KB a cell measured (its config, state and job), 10 MB at MAX_CELLS (10,000) cells; a cell's
# error text and the paired entries add little. 256 MiB is far above any sweep the harness writes, yet bounded.
MAX_MANIFEST_BYTES = 256 * 2**20
SWEEP_ID_RE = records.SWEEP_ID_RE
# the sweep's name, as harness.sweep.spec.build_spec accepts it at creation: it goes into sweep ids and into the SLURM
# job name (#SBATCH --job-name=harness-NAME), so a stored one is held to the same plain text (no newline, no markup)
SWEEP_NAME_RE = r"^[A-Za-z0-9_.-]{1,40}$"

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
        "run_id": {"type": ["string", "null"], "pattern": records.RUN_ID_RE.pattern},
        "job_ids": {"type": "array", "items": {"type": "string", "pattern": "^[0-9]{1,20}(_[0-9]{1,9})?$"}},
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
        "job_ids": {"type": "array", "items": {"type": "string", "pattern": "^[0-9]{1,20}(_[0-9]{1,9})?$"}},
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
        "executor": {"type": "object", "required": ["kind"]},  # every field: settings.check_executor
        "data": {"type": "object", "required": ["path", "sha256"],
                 "properties": {"path": {"type": "string"},
                                "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"}}},
        "cells": {"type": "array", "items": _CELL},
        "paired": {"type": "array", "items": _PAIRED},
        "owner": {"type": "object", "properties": {"pid": {"type": "integer"}, "host": {"type": "string"}}},
    },
}


def sweeps_dir(out: Path) -> Path:
    """`<out>/sweeps` (records.SweepPaths.root)."""
    return SweepPaths.root(out)


def new_sweep_id(out: Path, name: str) -> str:
    """A fresh sweep id (UTC time, the sweep's name, a random suffix); its directory is created here, exclusively."""
    root = sweeps_dir(out)
    root.mkdir(parents=True, exist_ok=True)
    while True:
        sweep_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{name}-{secrets.token_hex(2)}"
        try:
            (root / sweep_id).mkdir()
            return sweep_id
        except FileExistsError:
            continue


class Manifest:
    """The manifest document of one sweep and where it lives."""

    def __init__(self, out: Path, doc: dict):
        self.out, self.doc = Path(out), doc

    @property
    def sweep_id(self) -> str:
        return self.doc["sweep_id"]

    @property
    def paths(self) -> SweepPaths:
        """Every file of this sweep's directory."""
        return SweepPaths(self.out, self.sweep_id)

    @property
    def dir(self) -> Path:
        return self.paths.dir

    @property
    def path(self) -> Path:
        return self.paths.manifest

    @property
    def cells(self) -> list[dict]:
        return self.doc["cells"]

    def save(self) -> None:
        self.doc["updated_at"] = utc_now()
        records.atomic_write_json(self.path, self.doc)

    @classmethod
    def load(cls, out: Path, sweep_id: str) -> Manifest:
        """The manifest of `sweep_id` under `out`, checked (schema, executor settings, cell configs); a UsageError
        naming the problem and the field when there is none or it is damaged."""
        check_sweep_id(sweep_id, out)
        path = SweepPaths(Path(out), sweep_id).manifest
        fix = "that sweep cannot be used; restore its sweep.json or start a new sweep"
        if not os.path.lexists(path):
            raise UsageError(f"no sweep {sweep_id!r} under {str(sweeps_dir(out))!r}; pass an existing sweep id "
                             "and the --out it was written to")
        # a regular file of bounded size only: a named pipe put at sweep.json must not hang --status
        doc = read_json(path, "the sweep manifest", fix, MAX_MANIFEST_BYTES)
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise UsageError(f"{path} is not a nanogpt-parity sweep manifest")
        check_version(doc, path, SCHEMA_VERSION)
        check_document(doc, path, fix)
        if doc["sweep_id"] != sweep_id:
            raise UsageError(f"{str(path)!r} is invalid at field 'sweep_id': {doc['sweep_id']!r} is not its "
                             f"directory's name; {fix}")
        return cls(out, doc)


def check_sweep_id(sweep_id: str, out: Path) -> str:
    """A sweep id is a name from `<out>/sweeps` (never empty: an unset shell variable must not mean "new work")."""
    if not sweep_id:
        raise UsageError(f"the sweep id is empty (an unset shell variable?); pass one from `ls {sweeps_dir(out)}`")
    if not re.match(SWEEP_ID_RE, sweep_id) or ".." in sweep_id:
        raise UsageError(f"{sweep_id!r} is not a sweep id; pass one from `ls {sweeps_dir(out)}`")
    return sweep_id


def check_document(doc: dict, path: Path, fix: str) -> None:
    """The manifest's schema, its executor settings and every cell's config (UsageError naming the field)."""
    records._validate(doc, SWEEP_JSON_SCHEMA, path, fix)
    try:
        check_executor(doc["executor"], "executor.slurm")
    except UsageError as exc:
        raise UsageError(f"{str(path)!r} is invalid at field 'executor': {exc}; a sweep whose executor settings "
                         "fail these checks is not run (they go into job scripts): fix them or start a new sweep"
                         ) from None
    for i, cell in enumerate(doc["cells"]):
        if cell["index"] != i:  # members and resumes find a cell by its index: it must be its place in the list
            raise UsageError(f"{str(path)!r} is invalid at field 'cells/{i}/index': {cell['index']} is not its place "
                             f"in the list; {fix}")
        config_from_dict(cell["config"], f"{path} field 'cells/{i}'")
    for i, entry in enumerate(doc.get("paired") or []):
        why = f"its index {entry['index']} is not its place in the list" if entry["index"] != i else \
            _members_problem(entry["members"], doc["cells"])  # the index names its record: two must never share one
        if why is None and entry["path"] != paired_path(doc["sweep_id"], entry["index"]):
            why = "its path is not its record's place in this sweep"
        if why is not None:
            raise UsageError(f"{str(path)!r} is invalid at field 'paired/{i}': {why}; {fix}")
        # what the member cells determine is taken from them, never from the stored copy
        entry.update(paired_fields(doc["sweep_id"], entry["index"], [doc["cells"][m] for m in entry["members"]]))


def _members_problem(members: list[int], cells: list[dict]) -> str | None:
    """Why `members` are not the cells of one paired timing (None if they are): distinct cells of this sweep, every
    cell of one block (same config, seed, device and dtype option), two or more backends, told apart by name."""
    if len(set(members)) != len(members):
        return f"its members {members} name a cell twice"
    if any(m >= len(cells) for m in members):
        return f"its members {members} name a cell this sweep does not have"
    group = [cells[m] for m in members]
    block = block_of(group[0])
    if any(block_of(c) != block for c in group) or \
            sorted(members) != [c["index"] for c in cells if block_of(c) == block]:
        return f"its members {members} are not the cells of one block (same config, seed, device and dtype)"
    names = [contender_name(c, group) for c in group]
    if len({c["backend"] for c in group}) < 2 or len(set(names)) != len(names):
        return f"its members {members} are not two or more distinct backends"
    return None


def record_status(out: Path, cell: dict) -> tuple[str, dict | None]:
    """(state, record) of a cell from its RunRecord alone: pending, running, completed, interrupted or failed."""
    if not cell.get("run_id"):
        return "pending", None
    path = RunPaths(Path(out), cell["run_id"]).record(cell["backend"])
    if not path.exists():
        return "pending", None
    try:
        rec = records.load_record(path)
    except UsageError:
        return "failed", None
    status = rec.get("status", "")
    if status == DONE:
        return DONE, rec
    if status == "running":
        return "running", rec
    if records.is_failed(status):
        return "failed", rec
    return "interrupted", rec


def cell_summary(cell: dict, rec: dict | None) -> dict[str, Any]:
    """Progress of a cell for the status table: steps done of total, last validation loss."""
    if rec is None:
        return {"steps": "", "val_loss": ""}
    done = len(rec.get("steps", {}).get("loss", []))
    last = rec["evals"][-1] if rec.get("evals") else None
    return {"steps": f"{done}/{rec.get('total_steps', '?')}",
            "val_loss": f"{last['val_loss']:.4f}" if last else ""}


# --- paired timing entries -----------------------------------------------------------------------------------------
# A sweep's speed comparisons rest on paired timing (harness.timing.paired): per config, seed, device and dtype
# option, one entry whose contenders are that block's cells (two or more backends), timed side by side after the block's
# training. The entries live in the manifest's `paired` list (never among the cells: a cell is one training run),
# their records in `<out>/sweeps/<id>/paired/<n>.json`.
PAIRED_RERUNNABLE = (*RERUNNABLE, "incomplete")  # incomplete: its sessions ended without enough undisturbed rounds


def block_of(cell: dict) -> tuple:
    """The cells whose speed is compared side by side: same config, seed, device and dtype option."""
    return (cell.get("label"), cell["seed"], cell["device"], (cell.get("backend_options") or {}).get("dtype"))


def paired_fields(sweep_id: str, index: int, members: list[dict]) -> dict[str, Any]:
    """The fields of paired entry `index` that its member cells (one block) determine: key, label, seed, device,
    dtype and its record's path."""
    label, seed, device, dtype = block_of(members[0])
    return {"key": f"{label}/{device}{f'/dtype={dtype}' if dtype else ''}/seed={seed}/paired", "label": label,
            "seed": seed, "device": device, "dtype": dtype, "path": paired_path(sweep_id, index)}


def paired_record(out: Path, entry: dict) -> Path:
    """The record of paired entry `entry` of a loaded manifest (its `path` was checked to be
    `SweepPaths.paired(index)`, relative to --out, by `check_document`)."""
    return Path(out) / entry["path"]


def paired_path(sweep_id: str, index: int) -> str:
    """Where the record of paired entry `index` lives, relative to --out (the only place a manifest may name)."""
    return SweepPaths(Path(), sweep_id).paired(index).as_posix()


def paired_entries(sweep_id: str, cells: list[dict], rounds: int) -> list[dict]:
    """One paired-timing entry per block of cells with two or more backends (none when `rounds` is 0)."""
    if not rounds:
        return []
    blocks: dict[tuple, list[dict]] = {}
    for cell in cells:
        blocks.setdefault(block_of(cell), []).append(cell)
    out = []
    for members in blocks.values():
        if len({c["backend"] for c in members}) < 2:
            continue
        i = len(out)
        out.append({"index": i, "kind": "paired", **paired_fields(sweep_id, i, members),
                    "members": [c["index"] for c in members], "rounds": rounds, "status": "pending", "attempts": 0,
                    "job_ids": []})
    return out


def contender_name(cell: dict, members: list[dict]) -> str:
    """The backend's name, with its options where two members share the backend (torch fp32 and torch tf32)."""
    if sum(1 for c in members if c["backend"] == cell["backend"]) == 1:
        return cell["backend"]
    opts = ",".join(f"{k}={v}" for k, v in sorted((cell.get("backend_options") or {}).items()))
    return f"{cell['backend']}[{opts}]"


def ensure_paired_doc(out: Path, entry: dict, cells: list[dict], threads: int | None) -> Path:
    """Write the entry's paired-timing record (no session yet) unless it exists; returns its path. An existing record
    gets its contenders' run ids and directories from the manifest again (a cell whose run directory was removed and
    made anew on resume has a new run), keeping every session it holds."""
    from harness.run import paired_timing
    from harness.timing import paired

    path = paired_record(out, entry)
    members = [cells[i] for i in entry["members"]]
    contenders = [{"name": contender_name(c, members), "cell": c["index"], "run_id": c["run_id"],
                   "run_dir": str(records.run_dir(out, c["run_id"]).resolve()), "backend": c["backend"],
                   "options": c.get("backend_options") or {}, "device": c["device"]} for c in members]
    if not path.exists():
        records.atomic_write_json(path, paired_timing.new_doc(contenders, entry["label"], entry["seed"],
        entry["rounds"],
                                                       threads))
        return path
    with paired_timing.RecordLock(path):  # a coordinator adding a session rewrites the record too
        try:
            doc = paired.load(path)
        except UsageError:
            return path  # paired.run says what is wrong with it, and the entry fails
        now = {c["cell"]: c for c in contenders}
        stale = [c for c in doc["contenders"] if c.get("cell") in now and
                 (c.get("run_id"), c.get("run_dir")) != (now[c["cell"]]["run_id"], now[c["cell"]]["run_dir"])]
        for c in stale:
            c.update(run_id=now[c["cell"]]["run_id"], run_dir=now[c["cell"]]["run_dir"])
        if stale:
            records.atomic_write_json(path, doc)
    return path


def paired_status(out: Path, entry: dict) -> tuple[str, dict | None]:
    """(state, record) of a paired entry from its record: pending, running, completed, incomplete (its sessions
    ended without the undisturbed rounds it wants), interrupted or failed."""
    from harness.timing import paired

    path = paired_record(out, entry)
    if not path.exists():
        return "pending", None
    try:
        doc = paired.load(path)
    except UsageError:
        return "failed", None
    if paired.complete(doc):
        return DONE, doc
    last = (doc.get("sessions") or [{}])[-1]
    state = last.get("status", "pending") if doc.get("sessions") else "pending"
    return ("running" if state == "running" else state), doc


def ordered(cells: list[dict], entries: list[dict]) -> list[dict]:
    """Cells and paired entries in running order: each entry right after the last of its members."""
    keyed = [((c["index"], 0, 0), c) for c in cells] + [((max(e["members"]), 1, e["index"]), e) for e in entries]
    return [item for _, item in sorted(keyed, key=lambda kv: kv[0])]
