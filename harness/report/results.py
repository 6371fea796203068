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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.errors import UsageError
from harness.store import RunPaths, RunRecord, SweepPaths, Timings
from harness.store.contention import Contention
from harness.store.curves import eval_array
from harness.store.sweep import SweepManifest

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


@dataclass
class Costs:
    """Every cost figure of one record (`costs`): its timings, completed where a worker that did not finish left
    them out, and the figures derived from them. `recomputed` names what was derived here rather than read."""

    setup_s: float | None
    first_step_s: float | None
    compile_s: float | None
    step_median_s: float | None
    step_p10_s: float | None
    step_p90_s: float | None
    step_iqr_s: float | None
    steady_steps: int | None
    warmup_steps: int | None
    tokens_per_s: float | None
    eval_s: float | None
    train_s: float | None
    wall_s: float | None
    generation_tokens_per_s: float | None
    peak_bytes: int | None
    memory_kind: str | None
    n_params: int | None
    n_params_non_embedding: int | None
    flops_per_token: int | None
    achieved_flops: float | None
    recomputed: list[str]
    tokens_per_step: int | None
    contention: Contention | None
    disturbed_steps: int | None
    figures_from: str | None

    @property
    def contended_fraction(self) -> float | None:
        return self.contention.contended_fraction if self.contention is not None else None

    @property
    def mostly_disturbed(self) -> bool:
        return bool(self.contention is not None and self.contention.mostly_disturbed)


def costs(rec: RunRecord) -> Costs:
    """Every cost figure of one record, recomputing what an unfinished record lacks (None where unknowable)."""
    from harness.timing import contention
    from harness.timing.steady import steady_start, summarize_times

    t = Timings.from_dict(rec.timings.to_dict())  # a copy: what is recomputed here is not written back
    recomputed: list[str] = []
    # the curves are read only where a figure is missing (a record's files are read when first touched)
    need = (t.step_median_s is None or t.contention is None or t.train_s is None
            or (t.first_step_s is None and not rec.resumed_at))
    times = np.asarray(rec.curves.time_s, dtype=np.float64) if need else np.empty(0)
    chunks = rec.curves.chunks if need else []
    tokens_per_step = rec.tokens_per_step
    if tokens_per_step is None:
        tokens_per_step = rec.config.batch_size * rec.config.block_size or None
    if t.step_median_s is None and len(times) and tokens_per_step:
        summary = summarize_times(times, tokens_per_step, disturbed=contention.disturbed_steps(chunks, len(times)))
        for key, value in summary.items():
            setattr(t, key, value)
        recomputed += ["step times", "tokens/s"]
    if t.contention is None and chunks and len(times):
        t.contention = contention.summarize(chunks, len(times), steady_start(len(times)))
        recomputed.append("contention")
    if t.first_step_s is None and len(times) and not rec.resumed_at:
        t.first_step_s = float(times[0])
        recomputed.append("first step")
    if t.train_s is None and len(times):
        t.train_s = float(times.sum())
        recomputed.append("train time")
    if t.eval_s is None and len(rec.curves.evals):
        t.eval_s = float(np.nansum(eval_array(rec.curves.evals)[:, 3]))
        recomputed.append("eval time")
    flops_per_token = rec.flops_per_token
    if flops_per_token is None:
        flops_per_token = _flops_per_token(rec)
    achieved = t.achieved_flops
    if achieved is None and t.tokens_per_s and flops_per_token:
        achieved = t.tokens_per_s * flops_per_token
        recomputed.append("FLOP/s")
    return Costs(
        setup_s=t.setup_s, first_step_s=t.first_step_s, compile_s=t.compile_s, step_median_s=t.step_median_s,
        step_p10_s=t.step_p10_s, step_p90_s=t.step_p90_s, step_iqr_s=t.step_iqr_s, steady_steps=t.steady_steps,
        warmup_steps=t.warmup_steps, tokens_per_s=t.tokens_per_s, eval_s=t.eval_s, train_s=t.train_s,
        wall_s=t.wall_s, generation_tokens_per_s=rec.text.generation_tokens_per_s if rec.text else None,
        peak_bytes=rec.memory.peak_bytes, memory_kind=rec.memory.kind, n_params=rec.n_params,
        n_params_non_embedding=rec.n_params_non_embedding, flops_per_token=flops_per_token, achieved_flops=achieved,
        recomputed=recomputed, tokens_per_step=tokens_per_step, contention=t.contention,
        disturbed_steps=t.disturbed_steps, figures_from=t.figures_from)


def step_median_interval(rec: RunRecord) -> list[float]:
    """A 95 % bootstrap interval of the median steady step time, over the steps its figures come from
    (harness.timing.steady.steady_times: the undisturbed ones); [] without steps."""
    from harness.timing import contention, stats
    from harness.timing.steady import steady_times

    times = rec.curves.time_s
    steady, _ = steady_times(times, disturbed=contention.disturbed_steps(rec.curves.chunks, len(times)))
    return stats.median_ci(steady.tolist())


def _flops_per_token(rec: RunRecord) -> int | None:
    """6 x non-embedding params + 12 x layers x d x n_ctx, from the record's config (harness.core.costs)."""
    from harness.core.costs import flops_per_token

    if rec.data is None or rec.data.vocab_size is None:
        return None
    return flops_per_token(rec.config, int(rec.data.vocab_size))


def target_of(rec: RunRecord) -> Any:
    """The record's time to target (harness.store.record.TimeToTarget), recomputed from its curves where a worker
    that did not finish (killed, running) wrote none yet; None when its config sets no target."""
    ttt, target = rec.time_to_target, rec.config.target_val_loss
    if ttt is None and target is not None:
        from harness.core.costs import time_to_target

        cv = rec.curves
        ttt = time_to_target(target, cv.evals, cv.step, cv.time_s)
    return ttt


def row(rec: RunRecord, sweep: dict | None = None) -> dict[str, Any]:
    """The tidy row of one RunRecord (`sweep`: {"sweep_id", "cell", "contended"} when it is a sweep cell)."""
    c = costs(rec)
    t, cfg = rec.timings, rec.config
    last = rec.curves.last_eval
    ttt = target_of(rec)
    text = rec.text
    opts, info = rec.backend_options, rec.backend_info
    out = {
        "run_id": rec.run_id, "backend": rec.backend, "label": cfg.name,
        "sweep_id": (sweep or {}).get("sweep_id"), "cell": (sweep or {}).get("cell"),
        "contended": bool((sweep or {}).get("contended", False)),
        "seed": rec.seed, "device": rec.device,
        "dtype": opts.get("dtype") or info.get("dtype"), "precision": opts.get("precision") or info.get("precision"),
        "dtype_option": opts.get("dtype"), "precision_option": opts.get("precision"),
        "status": rec.status_text, "steps_done": rec.curves.steps_done,
        "total_steps": rec.total_steps, "final_eval_step": last.step if last else None,
        "final_val_loss": last.val_loss if last else None, "final_train_loss": last.train_loss if last else None,
        "step_median_s": c.step_median_s, "step_p10_s": c.step_p10_s, "step_p90_s": c.step_p90_s,
        "tokens_per_s": c.tokens_per_s, "contended_fraction": c.contended_fraction,
        "mostly_disturbed": c.mostly_disturbed, "disturbed_steps": c.disturbed_steps,
        "peak_bytes": c.peak_bytes, "train_s": t.train_s,
        "wall_s": t.wall_s, "setup_s": t.setup_s, "first_step_s": t.first_step_s,
        "n_params": c.n_params, "flops_per_token": c.flops_per_token, "achieved_flops": c.achieved_flops,
        "target_reached": None if ttt is None else bool(ttt.reached),
        "target_step": None if ttt is None else ttt.step, "target_train_s": None if ttt is None else ttt.train_s,
        "chrf": text.chrf if text else None, "bleu": text.bleu if text else None, "config_hash": rec.config_hash,
        "started_at": rec.started_at,
    }
    out.update({k: getattr(cfg, k) for k in (*CONFIG_COLUMNS, *OPTION_COLUMNS)})
    return out


def _sweep_cells(out: Path) -> dict[tuple[str, str], dict]:
    """(run id, backend) -> sweep membership, from every sweep manifest under `out` (unreadable ones skipped)."""
    found: dict[tuple[str, str], dict] = {}
    for paths in [s for s in SweepPaths.under(out) if s.manifest.is_file()]:
        try:
            m = SweepManifest.read(paths)
        except UsageError:
            continue
        for cell in m.cells:
            if cell.run_id:
                found[(cell.run_id, cell.backend)] = {"sweep_id": m.sweep_id, "cell": cell.index,
                                                      "contended": cell.contended}
    return found


def load_runs(out: str | Path, sweep_id: str | None = None, run_ids: list[str] | None = None) -> pd.DataFrame:
    """One row per RunRecord under `<out>/runs/` (only a sweep's cells with `sweep_id`, or only `run_ids`).

    Unreadable records are skipped (the run report names them); the columns are `COLUMNS` in that order.
    """
    out = Path(out)
    members = _sweep_cells(out)
    if sweep_id is not None:
        wanted = {k for k, v in members.items() if v["sweep_id"] == sweep_id}
        if not wanted and not SweepPaths(out, sweep_id).manifest.exists():
            raise UsageError(f"no sweep {sweep_id!r} under {str(SweepPaths.root(out))!r}")
        run_ids = sorted({r for r, _ in wanted})
    runs = [RunPaths(out, r) for r in run_ids] if run_ids is not None else RunPaths.under(out)
    rows = []
    for paths in runs:
        for path in paths.record_files():
            try:
                rec = RunRecord.load(path)
                if sweep_id is not None and (paths.run_id, rec.backend) not in members:
                    continue
                rows.append(row(rec, members.get((paths.run_id, rec.backend))))
            except UsageError:  # the record, or a curves file read for its row
                continue
    return pd.DataFrame(rows, columns=list(COLUMNS))
