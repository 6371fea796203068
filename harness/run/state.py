"""Where a run stands, from its directory alone (`harness status RUN_ID`): each backend's record (completed,
running, interrupted, failed, or not started, with the step reached), its paired timing and its parity verdict.

Reads only: a run being written is never locked or changed by asking. A record left "running" is running only while
a process holds the run's lock (the kernel's lock table, /proc/locks, says so without taking the lock); otherwise its
process is gone and the run was interrupted.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from harness import files
from harness.errors import UsageError
from harness.run import records


def lock_held(paths: records.RunPaths) -> bool | None:
    """Whether a process holds the run's lock now (None: this system cannot say)."""
    return files.lock_held(paths.lock)  # never locked (no .lock yet): False, nothing has written the run


def backend_row(backend: str, rec: dict | None, held: bool | None) -> dict[str, str]:
    """One backend's row of the status table: its state now (`held`: whether a process holds the run's lock), the
    step reached of the total, the last val loss."""
    if rec is None:  # the backends of a run train one after another: a later one waits without a record
        return {"backend": backend, "status": "not started", "steps": "", "val_loss": "", "device": ""}
    status = str(rec.get("status", ""))
    if status == records.Status.RUNNING.value and held is False:
        status = "interrupted (its process is gone)"
    done = len((rec.get("steps") or {}).get("loss") or [])
    last = rec["evals"][-1] if rec.get("evals") else None
    resumed = rec.get("resumed_from_step")
    return {"backend": backend, "status": status, "steps": f"{done}/{rec.get('total_steps', '?')}",
            "val_loss": f"{last['val_loss']:.4f}" if last else "", "device": str(rec.get("device", "")),
            **({"resumed from step": ", ".join(map(str, resumed))} if resumed else {})}


def paired_line(paths: records.RunPaths) -> str | None:
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


def parity_line(paths: records.RunPaths) -> str | None:
    """A parity run's verdict in one line (None for an ordinary run, or before its comparison is written)."""
    if not paths.parity.is_file():
        return None
    try:
        doc = files.read_json(paths.parity, "parity record", "run `harness parity` again", records.MAX_PARITY_BYTES)
        verdict = str(doc["verdict"])
    except (UsageError, KeyError, TypeError):
        return "parity: parity.json is unreadable"
    return f"parity: {verdict}" + (f" ({doc['failures'][0]})" if verdict != "pass" and doc.get("failures") else "")


def print_status(out: Path, run_id: str) -> list[dict[str, str]]:
    """Print the run's table of backends, its paired timing and parity lines; returns the rows."""
    import pandas as pd

    spec, recs = records.load_run(out, run_id)  # a missing or damaged run is a UsageError naming it
    paths = records.RunPaths(Path(out), run_id)
    held = lock_held(paths)
    by_name = {r["backend"]: r for r in recs}
    rows = [backend_row(b, by_name.get(b), held) for b in spec["backends"]]
    print(f"run {run_id} ({spec.get('label', '?')}, seed {spec.get('seed', '?')}), {len(rows)} backends, under "
          f"{out}" + (", being written now" if held else ""))
    print(pd.DataFrame(rows).fillna("").to_string(index=False))
    for line in (paired_line(paths), parity_line(paths)):
        if line:
            print(line)
    if not held and any(r["status"].startswith("interrupted") for r in rows):
        print(f"continue with `harness resume {run_id} --out {shlex.quote(str(out))}`")
    return rows
