"""Where a run stands, from its directory alone (`harness status RUN_ID`): each backend's record (completed,
running, interrupted, failed, or not started, with the step reached), its paired timing and its parity verdict.

Reads only: a run being written is never locked or changed by asking. A record left "running" is running only while
a process holds the run's lock (the kernel's lock table, /proc/locks, says so without taking the lock); otherwise its
process is gone and the run was interrupted.
"""

from __future__ import annotations

import shlex

from harness import files
from harness.errors import UsageError
from harness.store import RunPaths, RunRecord, Status, load_run
from harness.store.parity import ParityRecord


def lock_held(paths: RunPaths) -> bool | None:
    """Whether a process holds the run's lock now (None: this system cannot say)."""
    return files.lock_held(paths.lock)  # never locked (no .lock yet): False, nothing has written the run


def backend_row(backend: str, rec: RunRecord | None, held: bool | None) -> dict[str, str]:
    """One backend's row of the status table: its state now (`held`: whether a process holds the run's lock), the
    step reached of the total, the last val loss."""
    if rec is None:  # the backends of a run train one after another: a later one waits without a record
        return {"backend": backend, "status": "not started", "steps": "", "val_loss": "", "device": ""}
    status = rec.status_text
    if rec.status is Status.RUNNING and held is False:
        status = "interrupted (its process is gone)"
    last = rec.curves.last_eval
    total = "?" if rec.total_steps is None else rec.total_steps
    resumed = rec.resumed_from_step
    return {"backend": backend, "status": status, "steps": f"{rec.curves.steps_done}/{total}",
            "val_loss": f"{last.val_loss:.4f}" if last else "", "device": str(rec.device or ""),
            **({"resumed from step": ", ".join(map(str, resumed))} if resumed else {})}


def paired_line(paths: RunPaths) -> str | None:
    """The paired timing's state in one line (None when the run has none)."""
    from harness.timing import paired

    if not paths.paired_timing.exists():
        return None
    try:
        doc = paired.load(paths.paired_timing)
    except UsageError as exc:
        return f"paired timing: unreadable ({exc})"
    state = "complete" if paired.complete(doc) else "incomplete"
    return f"paired timing {state} ({paired.status_text(doc)}); {paired.headline(doc)}"


def parity_line(paths: RunPaths) -> str | None:
    """A parity run's verdict in one line (None for an ordinary run, or before its comparison is written)."""
    if not paths.parity.is_file():
        return None
    try:
        doc = ParityRecord.load(paths.parity)
    except UsageError:
        return "parity: parity.json is unreadable"
    if doc.verdict is None:
        return "parity: parity.json is unreadable"
    return f"parity: {doc.verdict}" + (f" ({doc.failures[0]})" if doc.verdict != "pass" and doc.failures else "")


def print_status(paths: RunPaths) -> list[dict[str, str]]:
    """Print the run's table of backends, its paired timing and parity lines; returns the rows."""
    import pandas as pd

    spec, recs = load_run(paths)  # a missing or damaged run is a UsageError naming it
    held = lock_held(paths)
    by_name = {r.backend: r for r in recs}
    rows = [backend_row(b, by_name.get(b), held) for b in spec.backends]
    print(f"run {paths.run_id} ({spec.label or '?'}, seed {spec.seed}), {len(rows)} backends, under "
          f"{paths.out}" + (", being written now" if held else ""))
    print(pd.DataFrame(rows).fillna("").to_string(index=False))
    for line in (paired_line(paths), parity_line(paths)):
        if line:
            print(line)
    if not held and any(r["status"].startswith("interrupted") for r in rows):
        print(f"continue with `harness resume {paths.run_id} --out {shlex.quote(str(paths.out))}`")
    return rows
