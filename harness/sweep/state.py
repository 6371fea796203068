"""Where a sweep stands: each cell's and paired timing's state now (its record, and squeue for SLURM jobs still
alive), the status table of `harness status SWEEP_ID`, and which local process owns the sweep.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

from harness.store.sweep import DONE, Owner, PairedEntry, SweepCell
from harness.sweep import manifest as mf


def alive_jobs(m: mf.Manifest) -> dict[str, str] | None:
    """The SLURM jobs of the sweep's cells and paired entries that squeue lists as alive, with their state (one squeue
    call for both; {} for a local sweep or one without jobs); None when squeue cannot answer."""
    jobs = [i.job for i in [*m.cells, *m.paired] if i.job]
    if m.doc.executor.kind != "slurm" or not jobs:
        return {}
    from harness.sweep.slurm import is_alive, job_states

    states = job_states(jobs)
    return None if states is None else {j: s for j, s in states.items() if is_alive(s)}


def state_now(m: mf.Manifest, item: SweepCell | PairedEntry, state: str,
              alive: dict[str, str] | None) -> tuple[str, str]:
    """(state, job id) of a cell or paired entry now: its job's, while squeue lists it alive, else its record's
    `state`, where a record left "running" is running only if this sweep's local process is running it. When squeue
    could not answer (`alive` None), a job stored as queued or running keeps that state unless its record says it
    completed: an unanswered squeue must never make a job that still runs look gone (and be submitted again)."""
    job = item.job
    if alive is None and job and item.status in ("queued", "running") and state != DONE:
        return item.status, job
    if alive is not None and job in alive:
        return ("running" if alive[job].startswith("RUNNING") else "queued"), job
    if state == "running":
        local = item.status == "running" and m.doc.executor.kind == "local" and local_alive(m)
        state = "running" if local else "interrupted"
    return state, job


class Refreshed(NamedTuple):
    """The rows of `refresh`: one per cell, one per paired-timing entry; whether squeue answered (always, locally)."""

    cells: list[dict]
    paired: list[dict]
    squeue_answered: bool


def refresh(m: mf.Manifest) -> Refreshed:
    """Each cell's and paired-timing entry's state now (from squeue, asked once, for SLURM jobs still alive, else from
    its record), set in `m` in memory."""
    alive = alive_jobs(m)
    return Refreshed([_refresh_cell(m, c, alive) for c in m.cells],
                     [_refresh_entry(m, e, alive) for e in m.paired], alive is not None)


def _refresh_entry(m: mf.Manifest, entry: PairedEntry, alive: dict[str, str] | None) -> dict:
    """A paired entry's state now, set in it; its row of the status table."""
    from harness.timing import paired

    state, doc = mf.paired_status(m.out, entry)
    entry.status, job = state_now(m, entry, state, alive)
    return {"paired": entry.index, "key": entry.key, "status": entry.status, "job": job,
            "rounds": paired.status_text(doc) if doc else ""}


def _refresh_cell(m: mf.Manifest, cell: SweepCell, alive: dict[str, str] | None) -> dict:
    """A cell's state now, set in it; its row of the status table."""
    state, rec = mf.record_status(m.out, cell)
    cell.status, job = state_now(m, cell, state, alive)
    return {"cell": cell.index, "key": cell.key, "status": cell.status, "run": cell.run_id or "", "job": job,
            **mf.cell_summary(rec)}


def counts(rows: list[dict]) -> dict[str, int]:
    """How many rows are in each state."""
    tally: dict[str, int] = {}
    for row in rows:
        tally[row["status"]] = tally.get(row["status"], 0) + 1
    return tally


SQUEUE_SILENT = "squeue did not answer: the states of queued or running jobs are as last recorded"


def local_alive(m: mf.Manifest) -> bool:
    """Whether the `harness sweep` process that owns the manifest still runs (its pid, on this host)."""
    import os
    import socket

    owner = m.doc.owner
    if owner is None or owner.host != socket.gethostname() or not owner.pid:
        return False
    try:
        os.kill(int(owner.pid), 0)
    except (OSError, ValueError):
        return False
    return True


def own(m: mf.Manifest) -> None:
    """Mark this process as the one running the sweep (`local_alive` asks whether it still runs)."""
    import os
    import socket

    m.doc.owner = Owner(pid=os.getpid(), host=socket.gethostname())


def print_status(m: mf.Manifest) -> dict[str, int]:
    """Print the table of cells and of paired timings; returns how many cells are in each state."""
    from harness.units import dict_table

    rows, prows, answered = refresh(m)
    print(f"sweep {m.sweep_id} ({m.doc.executor.kind}), {len(rows)} cells, under {m.out}")
    print(dict_table(rows, right=("cell", "steps", "val_loss")))
    counted = counts(rows)
    print("  " + ", ".join(f"{v} {k}" for k, v in sorted(counted.items())))
    if prows:
        print(f"paired timing ({len(prows)}):")
        print(dict_table(prows, right=("paired",)))
    if not answered:
        print(f"{SQUEUE_SILENT}; ask again later", file=sys.stderr)
    return counted


def sweep_summary(out: Path, sweep_id: str) -> tuple[dict[str, str], set[str]]:
    """The sweep's row of the listing of `harness status` (id, kind, sizes, backends, state: how many cells are in
    each state as the manifest last recorded them, a sweep whose process is gone not running) and the run ids of
    its cells (listed under the sweep, not on their own). Reads sweep.json only (bounded, schema-checked), never the
    cells' records. UsageError when it is unreadable."""
    from harness.store import SweepPaths
    from harness.store.sweep import SweepManifest

    doc = SweepManifest.read(SweepPaths(Path(out), sweep_id))
    m = mf.Manifest(SweepPaths(Path(out), sweep_id), doc)
    alive = doc.executor.kind != "local" or local_alive(m)
    states = [c.status if c.status != "running" or alive else "interrupted" for c in doc.cells]
    tally = {s: states.count(s) for s in dict.fromkeys(states)}
    sizes = dict.fromkeys(str(c.label or c.config.get("name") or "?") for c in doc.cells)
    return ({"id": sweep_id, "kind": "sweep", "size": ",".join(sizes) or "?",
             "backends": ",".join(dict.fromkeys(c.backend for c in doc.cells)),
             "state": f"{len(states)} cell{'s' if len(states) != 1 else ''}: "
                      + ", ".join(f"{n} {s}" for s, n in tally.items()), "verdict": ""},
            {c.run_id for c in doc.cells if c.run_id})
