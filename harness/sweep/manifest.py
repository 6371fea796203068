"""The sweep manifest `<out>/sweeps/<sweep_id>/sweep.json`: spec, cells, run ids, executor job ids, status per cell.

The manifest is written only by the `harness sweep` process (atomically, like every record). The status it holds
is a cache: the truth about a cell is its RunRecord (and, on SLURM, whether its job is still queued or running),
and `refresh` reads that again.

The manifest's type and schema are harness.store.sweep's (`SweepManifest`, `SweepCell`, `PairedEntry`). Every load
checks the document against its schema, the executor settings again (they are written into
job scripts: harness.sweep.settings) and every cell's config, so a damaged or hand-edited sweep.json is one line
naming the field, never a traceback and never a job script built from it. The directory `--out` must still be
trusted: on SLURM, submitit's pickles under `<out>/sweeps/<id>/slurm/` are what each job unpickles and runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.config.fields import config_from_dict
from harness.errors import UsageError
from harness.store import RunPaths, RunRecord, Status, SweepPaths, check_sweep_id
from harness.store.paired import Contender, PairedRecord
from harness.store.sweep import DONE, RERUNNABLE, PairedEntry, SweepCell, SweepManifest
from harness.sweep.settings import check_executor
from harness.units import utc_now

PAIRED_RERUNNABLE = (*RERUNNABLE, "incomplete")  # incomplete: its sessions ended without enough undisturbed rounds


class Manifest:
    """The manifest of one sweep (`doc`) and where it lives (`paths`)."""

    def __init__(self, paths: SweepPaths, doc: SweepManifest):
        self.paths, self.doc = paths, doc

    @property
    def out(self) -> Path:
        return self.paths.out

    @property
    def sweep_id(self) -> str:
        return self.paths.sweep_id

    @property
    def dir(self) -> Path:
        return self.paths.dir

    @property
    def path(self) -> Path:
        return self.paths.manifest

    @property
    def cells(self) -> list[SweepCell]:
        return self.doc.cells

    @property
    def paired(self) -> list[PairedEntry]:
        return self.doc.paired

    def run(self, cell: SweepCell) -> RunPaths:
        """The run directory of `cell` (it has a run id)."""
        assert cell.run_id is not None
        return RunPaths(self.out, cell.run_id)

    def save(self) -> None:
        self.doc.updated_at = utc_now()
        self.doc.dump(self.paths)

    @classmethod
    def load(cls, out: Path, sweep_id: str) -> Manifest:
        """The manifest of `sweep_id` under `out`, checked (schema, executor settings, cell configs); a UsageError
        naming the problem and the field when there is none or it is damaged."""
        check_sweep_id(sweep_id, out)
        paths = SweepPaths(Path(out), sweep_id)
        fix = "that sweep cannot be used; restore its sweep.json or start a new sweep"
        if not os.path.lexists(paths.manifest):
            raise UsageError(f"no sweep {sweep_id!r} under {str(SweepPaths.root(out))!r}; pass an existing sweep id "
                             "and the --out it was written to")
        doc = SweepManifest.read(paths)
        check_document(doc, paths.manifest, fix)
        if doc.sweep_id != sweep_id:
            raise UsageError(f"{str(paths.manifest)!r} is invalid at field 'sweep_id': {doc.sweep_id!r} is not its "
                             f"directory's name; {fix}")
        return cls(paths, doc)


def check_document(doc: SweepManifest, path: Path, fix: str) -> None:
    """The manifest's executor settings and every cell's config, and its paired entries' members and paths
    (UsageError naming the field; its schema was checked where it was read)."""
    try:
        check_executor(doc.executor.to_dict(), "executor.slurm")
    except UsageError as exc:
        raise UsageError(f"{str(path)!r} is invalid at field 'executor': {exc}; a sweep whose executor settings "
                         "fail these checks is not run (they go into job scripts): fix them or start a new sweep"
                         ) from None
    for i, cell in enumerate(doc.cells):
        if cell.index != i:  # members and resumes find a cell by its index: it must be its place in the list
            raise UsageError(f"{str(path)!r} is invalid at field 'cells/{i}/index': {cell.index} is not its place "
                             f"in the list; {fix}")
        config_from_dict(cell.config, f"{path} field 'cells/{i}'")
    for i, entry in enumerate(doc.paired):
        why = f"its index {entry.index} is not its place in the list" if entry.index != i else \
            _members_problem(entry.members, doc.cells)  # the index names its record: two must never share one
        if why is None and entry.path != paired_path(doc.sweep_id, entry.index):
            why = "its path is not its record's place in this sweep"
        if why is not None:
            raise UsageError(f"{str(path)!r} is invalid at field 'paired/{i}': {why}; {fix}")
        # what the member cells determine is taken from them, never from the stored copy
        set_paired_fields(entry, doc.sweep_id, [doc.cells[m] for m in entry.members])


def _members_problem(members: list[int], cells: list[SweepCell]) -> str | None:
    """Why `members` are not the cells of one paired timing (None if they are): distinct cells of this sweep, every
    cell of one block (same config, seed, device and dtype option), two or more backends, told apart by name."""
    if len(set(members)) != len(members):
        return f"its members {members} name a cell twice"
    if any(m >= len(cells) for m in members):
        return f"its members {members} name a cell this sweep does not have"
    group = [cells[m] for m in members]
    block = block_of(group[0])
    if any(block_of(c) != block for c in group) or \
            sorted(members) != [c.index for c in cells if block_of(c) == block]:
        return f"its members {members} are not the cells of one block (same config, seed, device and dtype)"
    names = [contender_name(c, group) for c in group]
    if len({c.backend for c in group}) < 2 or len(set(names)) != len(names):
        return f"its members {members} are not two or more distinct backends"
    return None


def record_status(out: Path, cell: SweepCell) -> tuple[str, RunRecord | None]:
    """(state, record) of a cell from its RunRecord alone: pending, running, completed, interrupted or failed."""
    if not cell.run_id:
        return "pending", None
    path = RunPaths(Path(out), cell.run_id).record(cell.backend)
    if not path.exists():
        return "pending", None
    try:
        rec = RunRecord.load(path)
    except UsageError:
        return "failed", None
    if rec.status in (Status.COMPLETED, Status.RUNNING, Status.FAILED):
        return rec.status.value, rec
    return "interrupted", rec


def cell_summary(rec: RunRecord | None) -> dict[str, Any]:
    """Progress of a cell for the status table: steps done of total, last validation loss."""
    if rec is None:
        return {"steps": "", "val_loss": ""}
    last = rec.curves.last_eval
    total = "?" if rec.total_steps is None else rec.total_steps
    return {"steps": f"{rec.curves.steps_done}/{total}", "val_loss": f"{last.val_loss:.4f}" if last else ""}


# --- paired timing entries -----------------------------------------------------------------------------------------
# A sweep's speed comparisons rest on paired timing (harness.timing.paired): per config, seed, device and dtype
# option, one entry whose contenders are that block's cells (two or more backends), timed side by side after the block's
# training. The entries live in the manifest's `paired` list (never among the cells: a cell is one training run),
# their records in `<out>/sweeps/<id>/paired/<n>.json`.
def block_of(cell: SweepCell) -> tuple:
    """The cells whose speed is compared side by side: same config, seed, device and dtype option."""
    return (cell.label, cell.seed, cell.device, cell.backend_options.get("dtype"))


def set_paired_fields(entry: PairedEntry, sweep_id: str, members: list[SweepCell]) -> None:
    """The fields of paired entry `entry` that its member cells (one block) determine: key, label, seed, device,
    dtype and its record's path."""
    label, seed, device, dtype = block_of(members[0])
    entry.key = f"{label}/{device}{f'/dtype={dtype}' if dtype else ''}/seed={seed}/paired"
    entry.label, entry.seed, entry.device, entry.dtype = label, seed, device, dtype
    entry.path = paired_path(sweep_id, entry.index)


def paired_path(sweep_id: str, index: int) -> str:
    """Where the record of paired entry `index` lives, relative to --out (the only place a manifest may name)."""
    return SweepPaths(Path(), sweep_id).paired(index).as_posix()


def paired_entries(sweep_id: str, cells: list[SweepCell], rounds: int) -> list[PairedEntry]:
    """One paired-timing entry per block of cells with two or more backends (none when `rounds` is 0)."""
    if not rounds:
        return []
    blocks: dict[tuple, list[SweepCell]] = {}
    for cell in cells:
        blocks.setdefault(block_of(cell), []).append(cell)
    out: list[PairedEntry] = []
    for members in blocks.values():
        if len({c.backend for c in members}) < 2:
            continue
        entry = PairedEntry(index=len(out), key="", label="", seed=0, device="", path="",
                            members=[c.index for c in members], rounds=rounds)
        set_paired_fields(entry, sweep_id, members)
        out.append(entry)
    return out


def contender_name(cell: SweepCell, members: list[SweepCell]) -> str:
    """The backend's name, with its options where two members share the backend (torch fp32 and torch tf32)."""
    if sum(1 for c in members if c.backend == cell.backend) == 1:
        return cell.backend
    opts = ",".join(f"{k}={v}" for k, v in sorted(cell.backend_options.items()))
    return f"{cell.backend}[{opts}]"


def ensure_paired_doc(out: Path, entry: PairedEntry, cells: list[SweepCell], threads: int | None) -> Path:
    """Write the entry's paired-timing record (no session yet) unless it exists; returns its path. An existing record
    gets its contenders' run ids and directories from the manifest again (a cell whose run directory was removed and
    made anew on resume has a new run), keeping every session it holds."""
    from harness.run import paired_timing
    from harness.store import RecordLock

    path = entry.record(out)
    members = [cells[i] for i in entry.members]
    contenders = [Contender(name=contender_name(c, members), cell=c.index, run_id=c.run_id,
                            run_dir=str(RunPaths(Path(out), c.run_id or "").dir.resolve()), backend=c.backend,
                            options=c.backend_options, device=c.device) for c in members]
    if not path.exists():
        paired_timing.new_doc(contenders, entry.label, entry.seed, entry.rounds, threads).dump(path)
        return path
    with RecordLock(path):  # a coordinator adding a session rewrites the record too
        try:
            doc = PairedRecord.load(path)
        except UsageError:
            return path  # paired.run says what is wrong with it, and the entry fails
        now = {c.cell: c for c in contenders}
        stale = [c for c in doc.contenders if c.cell in now and (c.run_id, c.run_dir) != (now[c.cell].run_id,
                                                                                          now[c.cell].run_dir)]
        for c in stale:
            c.run_id, c.run_dir = now[c.cell].run_id, now[c.cell].run_dir
        if stale:
            doc.dump(path)
    return path


def paired_status(out: Path, entry: PairedEntry) -> tuple[str, PairedRecord | None]:
    """(state, record) of a paired entry from its record: pending, running, completed, incomplete (its sessions
    ended without the undisturbed rounds it wants), interrupted or failed."""
    from harness.timing import paired

    path = entry.record(out)
    if not path.exists():
        return "pending", None
    try:
        doc = paired.load(path)
    except UsageError:
        return "failed", None
    if paired.complete(doc):
        return DONE, doc
    last = doc.last_session
    state = last.status if last is not None else "pending"
    return ("running" if state == "running" else state), doc


def ordered(cells: list[SweepCell], entries: list[PairedEntry]) -> list[SweepCell | PairedEntry]:
    """Cells and paired entries in running order: each entry right after the last of its members."""
    keyed = [((c.index, 0, 0), c) for c in cells] + [((max(e.members), 1, e.index), e) for e in entries]
    return [item for _, item in sorted(keyed, key=lambda kv: kv[0])]
