"""Every RunRecord under an output directory as one tidy table: `load_runs(out) -> pandas.DataFrame`.

One row per (run, backend) record; columns are plain numbers and strings (no nested objects), so the table can be
grouped, filtered and saved as CSV. Rows of sweep cells carry the sweep id, the cell index and whether the cell's
timings were contended (`--jobs N`). The sweep report is built from this table and saves it beside itself.

    >>> from harness.results import load_runs
    >>> df = load_runs("reports")
    >>> df.groupby(["label", "backend"])["final_val_loss"].describe()
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from harness import records
from harness.errors import UsageError

CONFIG_COLUMNS = ("n_embd", "n_layer", "n_head", "block_size", "batch_size", "d_hidden", "learning_rate", "dropout",
                  "weight_decay", "scheme", "target_val_loss")
COLUMNS = ("run_id", "backend", "label", "sweep_id", "cell", "contended", "seed", "device", "dtype", "precision",
           "status", "steps_done", "total_steps", "final_eval_step", "final_val_loss", "final_train_loss",
           "step_median_s", "step_p10_s", "step_p90_s", "tokens_per_s", "peak_bytes", "train_s", "wall_s",
           "setup_s", "first_step_s", "n_params", "flops_per_token", "achieved_flops", "target_reached",
           "target_step", "target_train_s", "chrf", "bleu", "config_hash", *CONFIG_COLUMNS, "started_at")


def row(rec: dict, sweep: dict | None = None) -> dict[str, Any]:
    """The tidy row of one RunRecord (`sweep`: {"sweep_id", "cell", "contended"} when it is a sweep cell)."""
    from harness.report.analysis import costs

    c = costs(rec)
    t = rec.get("timings") or {}
    cfg = rec.get("config") or {}
    last = rec["evals"][-1] if rec.get("evals") else {}
    ttt = rec.get("time_to_target")
    if ttt is None and cfg.get("target_val_loss") is not None:  # records written before the worker computed it
        from harness.costs import time_to_target

        steps = rec.get("steps") or {}
        ttt = time_to_target(cfg["target_val_loss"], rec.get("evals") or [], steps.get("step", []),
                             steps.get("time_s", []))
    text = rec.get("text") or {}
    opts = rec.get("backend_options") or {}
    info = rec.get("backend_info") or {}
    out = {
        "run_id": rec["run_id"], "backend": rec["backend"], "label": cfg.get("name"),
        "sweep_id": (sweep or {}).get("sweep_id"), "cell": (sweep or {}).get("cell"),
        "contended": bool((sweep or {}).get("contended", False)),
        "seed": rec.get("seed"), "device": rec.get("device"),
        "dtype": opts.get("dtype") or info.get("dtype"), "precision": opts.get("precision") or info.get("precision"),
        "status": rec.get("status"), "steps_done": len((rec.get("steps") or {}).get("loss", [])),
        "total_steps": rec.get("total_steps"), "final_eval_step": last.get("step"),
        "final_val_loss": last.get("val_loss"), "final_train_loss": last.get("train_loss"),
        "step_median_s": c["step_median_s"], "step_p10_s": c["step_p10_s"], "step_p90_s": c["step_p90_s"],
        "tokens_per_s": c["tokens_per_s"], "peak_bytes": c["peak_bytes"], "train_s": t.get("train_s"),
        "wall_s": t.get("wall_s"), "setup_s": t.get("setup_s"), "first_step_s": t.get("first_step_s"),
        "n_params": c["n_params"], "flops_per_token": c["flops_per_token"], "achieved_flops": c["achieved_flops"],
        "target_reached": None if ttt is None else bool(ttt["reached"]),
        "target_step": None if ttt is None else ttt["step"], "target_train_s": None if ttt is None else ttt["train_s"],
        "chrf": text.get("chrf"), "bleu": text.get("bleu"), "config_hash": rec.get("config_hash"),
        "started_at": rec.get("started_at"),
    }
    out.update({k: cfg.get(k) for k in CONFIG_COLUMNS})
    return out


def _sweep_cells(out: Path) -> dict[tuple[str, str], dict]:
    """(run id, backend) -> sweep membership, from every sweep manifest under `out` (unreadable ones skipped)."""
    found: dict[tuple[str, str], dict] = {}
    for path in sorted((out / "sweeps").glob("*/sweep.json")) if (out / "sweeps").is_dir() else []:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            for cell in doc["cells"]:
                if cell.get("run_id"):
                    found[(cell["run_id"], cell["backend"])] = {"sweep_id": doc["sweep_id"], "cell": cell["index"],
                                                                "contended": cell.get("contended", False)}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def load_runs(out: str | Path, sweep_id: str | None = None, run_ids: list[str] | None = None) -> pd.DataFrame:
    """One row per RunRecord under `<out>/runs/` (only a sweep's cells with `sweep_id`, or only `run_ids`).

    Unreadable records are skipped (the run report names them); the columns are `COLUMNS` in that order.
    """
    out = Path(out)
    members = _sweep_cells(out)
    if sweep_id is not None:
        wanted = {k for k, v in members.items() if v["sweep_id"] == sweep_id}
        if not wanted and not (out / "sweeps" / sweep_id / "sweep.json").exists():
            raise UsageError(f"no sweep {sweep_id!r} under {str(out / 'sweeps')!r}")
        run_ids = sorted({r for r, _ in wanted})
    runs_dir = out / "runs"
    ids = run_ids if run_ids is not None else (sorted(p.name for p in runs_dir.iterdir() if p.is_dir())
                                               if runs_dir.is_dir() else [])
    rows = []
    for run_id in ids:
        directory = records.run_dir(out, run_id)
        for path in sorted(directory.glob("*.json")):
            if path.name == "spec.json" or path.name.startswith("."):
                continue
            try:
                rec = records.load_record(path)
            except UsageError:
                continue
            if sweep_id is not None and (run_id, rec["backend"]) not in members:
                continue
            rows.append(row(rec, members.get((run_id, rec["backend"]))))
    return pd.DataFrame(rows, columns=list(COLUMNS))
