"""Where a run stands, from its directory alone (`harness status RUN_ID`): each backend's record (completed,
running, interrupted, failed, or not started, with the step reached), its paired timing and its parity verdict; and
the run's one row of the listing of `harness status` (`run_summary`).

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
    from harness.units import dict_table

    spec, recs = load_run(paths)  # a missing or damaged run is a UsageError naming it
    held = lock_held(paths)
    by_name = {r.backend: r for r in recs}
    rows = [backend_row(b, by_name.get(b), held) for b in spec.backends]
    print(f"run {paths.run_id} ({spec.label or '?'}, seed {spec.seed}), {len(rows)} backends, under "
          f"{paths.out}" + (", being written now" if held else ""))
    print(dict_table(rows, right=("steps", "val_loss")))
    for line in (paired_line(paths), parity_line(paths)):
        if line:
            print(line)
    if not held and any(r["status"].startswith("interrupted") for r in rows):
        print(f"continue with `harness resume {paths.run_id} --out {shlex.quote(str(paths.out))}`")
    return rows


def _state_word(status: str) -> str:
    """"failed: reason" -> "failed", "interrupted (its process is gone)" -> "interrupted": a state in one word."""
    return status.split(":")[0].split(" (")[0]


def run_summary(paths: RunPaths) -> dict[str, str]:
    """The run's row of the listing of `harness status`: id, kind (run or parity), size, backends, state (one word
    when every backend is in it, else how many are in each; a running one with its step) and verdict (parity's, or
    the paired timing's speed verdict). UsageError when the run is unreadable."""
    from harness.timing import paired

    spec, recs = load_run(paths)
    held = lock_held(paths)
    by_name = {r.backend: r for r in recs}
    rows = [backend_row(b, by_name.get(b), held) for b in spec.backends]
    words = [_state_word(r["status"]) for r in rows]
    tally = {w: words.count(w) for w in dict.fromkeys(words)}
    state = words[0] if len(tally) == 1 else ", ".join(f"{n} {w}" for w, n in tally.items())
    running = [r for r in rows if r["status"] == "running"]
    if running:
        state += f" (step {running[0]['steps']})"
    verdict = ""
    if paths.parity.is_file():
        line = parity_line(paths) or ""
        verdict = line.removeprefix("parity: ").split(" (")[0]
    elif paths.paired_timing.is_file() and len(spec.backends) > 1:
        try:
            doc = paired.load(paths.paired_timing)
            last = doc.last_session
            verdict = (paired.judge(paired.pair_summary(doc, *doc.names[:2]))["label"] if paired.rounds_of(doc) else
                       "paired timing failed" if last is not None and last.failure else "")
        except (UsageError, KeyError, TypeError, ValueError):
            verdict = "paired timing unreadable"
    return {"id": paths.run_id, "kind": "parity" if spec.parity is not None else "run", "size": spec.label or "?",
            "backends": ",".join(spec.backends), "state": state, "verdict": verdict}
