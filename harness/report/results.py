"""Every RunRecord under an output directory as one tidy table: `load_runs(out) -> pandas.DataFrame`.

One row per (run, backend) record; columns are plain numbers and strings (no nested objects), so the table can be
grouped, filtered and saved as CSV. Rows of sweep cells carry the sweep id, the cell index and whether the cell's
timings were contended (`--jobs N`); every row carries its contention evidence in short (`contended_fraction`, the
share of steady steps judged disturbed, and `mostly_disturbed`). `dtype`/`precision` are what the backend computed
in, `dtype_option`/`precision_option` what was asked for (None: the backend's default). The sweep report is built
from this table and saves it beside itself.

    >>> from harness.report.results import load_runs
    >>> df = load_runs("reports")
    >>> df.groupby(["label", "backend"])["final_val_loss"].describe()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from harness import files
from harness.errors import UsageError
from harness.run import records

CONFIG_COLUMNS = ("n_embd", "n_layer", "n_head", "block_size", "batch_size", "d_hidden", "learning_rate", "dropout",
                  "weight_decay", "scheme", "target_val_loss")
OPTION_COLUMNS = ("tie_embeddings", "gelu", "bias", "lm_head_bias", "attn_dropout", "decay", "lr_schedule",
                  "warmup_steps", "decay_steps", "min_lr")
COLUMNS = ("run_id", "backend", "label", "sweep_id", "cell", "contended", "seed", "device", "dtype", "precision",
           "dtype_option", "precision_option", "status", "steps_done", "total_steps", "final_eval_step",
           "final_val_loss", "final_train_loss", "step_median_s", "step_p10_s", "step_p90_s", "tokens_per_s",
           "contended_fraction", "mostly_disturbed", "disturbed_steps", "peak_bytes", "train_s", "wall_s",
           "setup_s", "first_step_s", "n_params", "flops_per_token", "achieved_flops", "target_reached",
           "target_step", "target_train_s", "chrf", "bleu", "config_hash", *CONFIG_COLUMNS, *OPTION_COLUMNS,
           "started_at")


def costs(rec: dict) -> dict[str, Any]:
    """Every cost figure of one record, recomputing what an unfinished record lacks (None where unknowable).

    Keys: setup_s, first_step_s, step_median_s, step_p10_s, step_p90_s, step_iqr_s, steady_steps, tokens_per_s,
    eval_s, train_s, wall_s, generation_tokens_per_s, peak_bytes, memory_kind, n_params, n_params_non_embedding,
    flops_per_token, achieved_flops, contention (harness.timing.contention.summarize), disturbed_steps,
    contended_fraction, mostly_disturbed, recomputed (names of figures derived here rather than read).
    """
    from harness.timing import contention
    from harness.timing.steady import steady_start, summarize_times

    t = dict(rec.get("timings") or {})
    recomputed: list[str] = []
    times = list((rec.get("steps") or {}).get("time_s", []))
    chunks = rec.get("chunks") or []
    tokens_per_step = rec.get("tokens_per_step")
    if tokens_per_step is None:
        cfg = rec.get("config", {})
        tokens_per_step = cfg.get("batch_size", 0) * cfg.get("block_size", 0) or None
    if t.get("step_median_s") is None and times and tokens_per_step:
        t.update(summarize_times(times, tokens_per_step, disturbed=contention.disturbed_steps(chunks, len(times))))
        recomputed += ["step times", "tokens/s"]
    if t.get("contention") is None and chunks and times:
        t["contention"] = contention.summarize(chunks, len(times), steady_start(len(times)))
        recomputed.append("contention")
    if t.get("first_step_s") is None and times and not rec.get("resumed_at"):
        t["first_step_s"] = times[0]
        recomputed.append("first step")
    if t.get("train_s") is None and times:
        t["train_s"] = float(sum(times))
        recomputed.append("train time")
    if t.get("eval_s") is None and rec.get("evals"):
        t["eval_s"] = float(sum(e.get("time_s") or 0.0 for e in rec["evals"]))
        recomputed.append("eval time")
    flops_per_token = rec.get("flops_per_token")
    if flops_per_token is None:
        flops_per_token = _flops_per_token(rec)
    achieved = t.get("achieved_flops")
    if achieved is None and t.get("tokens_per_s") and flops_per_token:
        achieved = t["tokens_per_s"] * flops_per_token
        recomputed.append("FLOP/s")
    memory = rec.get("memory") or {}
    text = rec.get("text") or {}
    return {
        "setup_s": t.get("setup_s"), "first_step_s": t.get("first_step_s"), "compile_s": t.get("compile_s"),
        "step_median_s": t.get("step_median_s"), "step_p10_s": t.get("step_p10_s"),
        "step_p90_s": t.get("step_p90_s"), "step_iqr_s": t.get("step_iqr_s"),
        "steady_steps": t.get("steady_steps"), "warmup_steps": t.get("warmup_steps"),
        "tokens_per_s": t.get("tokens_per_s"), "eval_s": t.get("eval_s"), "train_s": t.get("train_s"),
        "wall_s": t.get("wall_s"), "generation_tokens_per_s": text.get("generation_tokens_per_s"),
        "peak_bytes": memory.get("peak_bytes"), "memory_kind": memory.get("kind"),
        "n_params": rec.get("n_params"), "n_params_non_embedding": rec.get("n_params_non_embedding"),
        "flops_per_token": flops_per_token, "achieved_flops": achieved, "recomputed": recomputed,
        "tokens_per_step": tokens_per_step, "contention": t.get("contention"),
        "disturbed_steps": t.get("disturbed_steps"), "figures_from": t.get("figures_from"),
        "contended_fraction": (t.get("contention") or {}).get("contended_fraction"),
        "mostly_disturbed": bool((t.get("contention") or {}).get("mostly_disturbed")),
    }


def step_median_interval(rec: dict) -> list[float]:
    """A 95 % bootstrap interval of the median steady step time, over the steps its figures come from
    (harness.timing.steady.steady_times: the undisturbed ones); [] without steps."""
    from harness.timing import contention, stats
    from harness.timing.steady import steady_times

    times = (rec.get("steps") or {}).get("time_s") or []
    steady, _ = steady_times(times, disturbed=contention.disturbed_steps(rec.get("chunks") or [], len(times)))
    return stats.median_ci(steady.tolist())


def _flops_per_token(rec: dict) -> int | None:
    """6 x non-embedding params + 12 x layers x d x n_ctx, from the record's config (harness.core.costs)."""
    try:
        from harness.config.fields import Config
        from harness.core.costs import flops_per_token

        return flops_per_token(Config(**rec["config"]), int(rec["data"]["vocab_size"]))
    except (KeyError, TypeError, ValueError):
        return None


def row(rec: dict, sweep: dict | None = None) -> dict[str, Any]:
    """The tidy row of one RunRecord (`sweep`: {"sweep_id", "cell", "contended"} when it is a sweep cell)."""
    c = costs(rec)
    t = rec.get("timings") or {}
    cfg = rec.get("config") or {}
    last = rec["evals"][-1] if rec.get("evals") else {}
    ttt = rec.get("time_to_target")
    if ttt is None and cfg.get("target_val_loss") is not None:  # a worker that did not finish (killed, running)
        from harness.core.costs import time_to_target

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
        "dtype_option": opts.get("dtype"), "precision_option": opts.get("precision"),
        "status": rec.get("status"), "steps_done": len((rec.get("steps") or {}).get("loss", [])),
        "total_steps": rec.get("total_steps"), "final_eval_step": last.get("step"),
        "final_val_loss": last.get("val_loss"), "final_train_loss": last.get("train_loss"),
        "step_median_s": c["step_median_s"], "step_p10_s": c["step_p10_s"], "step_p90_s": c["step_p90_s"],
        "tokens_per_s": c["tokens_per_s"], "contended_fraction": c["contended_fraction"],
        "mostly_disturbed": c["mostly_disturbed"], "disturbed_steps": c["disturbed_steps"],
        "peak_bytes": c["peak_bytes"], "train_s": t.get("train_s"),
        "wall_s": t.get("wall_s"), "setup_s": t.get("setup_s"), "first_step_s": t.get("first_step_s"),
        "n_params": c["n_params"], "flops_per_token": c["flops_per_token"], "achieved_flops": c["achieved_flops"],
        "target_reached": None if ttt is None else bool(ttt["reached"]),
        "target_step": None if ttt is None else ttt["step"], "target_train_s": None if ttt is None else ttt["train_s"],
        "chrf": text.get("chrf"), "bleu": text.get("bleu"), "config_hash": rec.get("config_hash"),
        "started_at": rec.get("started_at"),
    }
    out.update({k: cfg.get(k) for k in (*CONFIG_COLUMNS, *OPTION_COLUMNS)})
    return out


def _sweep_cells(out: Path) -> dict[tuple[str, str], dict]:
    """(run id, backend) -> sweep membership, from every sweep manifest under `out` (unreadable ones skipped)."""
    from harness.sweep.manifest import MAX_MANIFEST_BYTES

    found: dict[tuple[str, str], dict] = {}
    for path in [s.manifest for s in records.SweepPaths.under(out) if s.manifest.is_file()]:
        try:
            doc = files.read_json(path, "the sweep manifest", "", MAX_MANIFEST_BYTES)
            for cell in doc["cells"]:
                if cell.get("run_id"):
                    found[(cell["run_id"], cell["backend"])] = {"sweep_id": doc["sweep_id"], "cell": cell["index"],
                                                                "contended": cell.get("contended", False)}
        except (UsageError, KeyError, TypeError, AttributeError):
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
        if not wanted and not records.SweepPaths(out, sweep_id).manifest.exists():
            raise UsageError(f"no sweep {sweep_id!r} under {str(records.SweepPaths.root(out))!r}")
        run_ids = sorted({r for r, _ in wanted})
    runs_dir = records.RunPaths.root(out)
    ids = run_ids if run_ids is not None else (sorted(p.name for p in runs_dir.iterdir() if p.is_dir())
                                               if runs_dir.is_dir() else [])
    rows = []
    for run_id in ids:
        for path in records.RunPaths(out, run_id).record_files():
            try:
                rec = records.load_record(path)
            except UsageError:
                continue
            if sweep_id is not None and (run_id, rec["backend"]) not in members:
                continue
            rows.append(row(rec, members.get((run_id, rec["backend"]))))
    return pd.DataFrame(rows, columns=list(COLUMNS))
