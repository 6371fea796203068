"""OUT/summary.json (everything) and OUT/summary.md (a table), written atomically after every check.

A killed run leaves the summary of what finished; a second call with the same --out reads it back, keeps the rows of
the checks that have a result (PASS or FAIL), and runs the others. Every check of the plan has a row, whatever became
of it: PASS, FAIL, "skipped" (a part the preflight did not find; --skip-long) or "not run" (the budget, --only, a
derived check waiting for its sources, a stop). Each call is listed with its budget, time and machine.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

SCHEMA = "nanogpt-parity/gpu-check"
VERSION = 1
DONE = ("PASS", "FAIL")  # a result: kept by a later call unless --only names the check


class SummaryError(Exception):
    """An existing summary that cannot be continued (unreadable, not a GPU check's, the other kind of run)."""


def load(out: Path, dry_run: bool) -> dict[str, Any] | None:
    """The summary under `out` to continue, or None when there is none."""
    path = out / "summary.json"
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SummaryError(f"{path} is unreadable ({type(exc).__name__}); give another --out, or move it away to "
                           "start over") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("checks"), list):
        raise SummaryError(f"{path} is not a GPU check's summary; give another --out")
    if bool(doc.get("dry_run")) != dry_run:
        kind = "a dry run's" if doc.get("dry_run") else "a GPU run's"
        raise SummaryError(f"{path} holds {kind} results; give another --out (a dry run and a GPU run never share "
                           "one)")
    return doc


def rows_by_name(doc: dict[str, Any] | None) -> dict[str, dict]:
    return {r["name"]: r for r in (doc or {}).get("checks", []) if isinstance(r, dict) and "name" in r}


def measured_times(doc: dict[str, Any] | None) -> dict[str, float]:
    """The seconds each check took, from a summary: finished checks' times, and for a check stopped by the budget
    or its time limit its time so far (a lower bound, used when it exceeds the table's estimate)."""
    times = {}
    for name, r in rows_by_name(doc).items():
        wall = r.get("wall_s")
        if isinstance(wall, (int, float)) and wall > 0 and (r.get("result") in DONE or r.get("stopped")):
            times[name] = float(wall) if r.get("result") in DONE else max(float(wall), float(r.get("estimate_s") or 0))
    return times


def write(out: Path, doc: dict[str, Any]) -> None:
    """summary.json and summary.md, each replaced atomically (a reader, or a kill, never sees half of one)."""
    counts = {k: sum(r["result"] == k for r in doc["checks"]) for k in ("PASS", "FAIL", "skipped", "not run")}
    doc.update(passed=counts["PASS"], failed=counts["FAIL"], skipped=counts["skipped"], not_run=counts["not run"],
               complete=counts["not run"] == 0 and counts["skipped"] == 0)
    _atomic(out / "summary.json", json.dumps(doc, indent=1, default=str) + "\n")
    _atomic(out / "summary.md", markdown(doc))


def _atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def markdown(doc: dict[str, Any]) -> str:
    """A table of every check in plan order, the calls made, and what is left to run."""
    kind = "dry run on the CPU" if doc["dry_run"] else "GPU"
    lines = [f"# GPU check ({kind})", "",
             f"{doc['passed']} passed, {doc['failed']} failed, {doc['skipped']} skipped, {doc['not_run']} not run"
             + ("" if doc["complete"] else " (run the same command again to continue)"), ""]
    for c in doc.get("calls", []):
        budget = f"budget {c['budget_s']:g} s" if c.get("budget_s") else "no budget"
        lines.append(f"- call {c['call']}: {c['started_at']}, {budget}, {c.get('wall_s', 0):.0f} s"
                     f"{', stopped: ' + c['stopped'] if c.get('stopped') else ''}; {c.get('environment', '')}")
    lines += ["", "| tier | check | result | s | estimate s | call | summary |", "|---:|---|---|---:|---:|---:|---|"]
    for r in doc["checks"]:
        text = str(r.get("summary", "")).replace("|", "\\|").replace("\n", " ")
        wall = f"{r['wall_s']:.1f}" if isinstance(r.get("wall_s"), (int, float)) else ""
        lines.append(f"| {r.get('tier', '')} | {r['name']} | {r['result']} | {wall} | {r.get('estimate_s', ''):g} | "
                     f"{r.get('call') or ''} | {text} |")
    failed = [r for r in doc["checks"] if r["result"] == "FAIL" and r.get("tail")]
    if failed:
        lines += ["", "## The last lines of each failed check", ""]
        for r in failed:
            lines += [f"### {r['name']}", "", "```", *r["tail"], "```", ""]
    return "\n".join(lines) + "\n"
