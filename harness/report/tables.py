"""The report's tables (pandas DataFrames rendered with `to_html`) and the number formats they share."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
from markupsafe import Markup, escape

from harness.pages import ERROR, OK
from harness.report.analysis import (
    PairComparison,
    RunView,
    costs,
    fairness_problems,
    final_val,
    loss_judgement,
    parity_checks,
    status_of,
    text_agreement,
)
from harness.report.results import target_of
from harness.store import RunRecord
from harness.store.contention import Contention
from harness.store.parity import ParityRecord
from harness.timing import contention
from harness.timing.steady import FIGURES_ALL
from harness.units import DASH, fmt_bytes


# --- formats -------------------------------------------------------------------------------------------------------
def _ok(x: Any) -> bool:
    return x is not None and not (isinstance(x, float) and not math.isfinite(x))


def fmt_seconds(s: float | None) -> str:
    """'812 µs', '12.3 ms', '4.56 s', '3 min 12 s', '1 h 02 min'."""
    if not _ok(s):
        return DASH
    if s == 0:
        return "0 s"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def fmt_int(n: float | None) -> str:
    return DASH if not _ok(n) else f"{round(n):,}"


def fmt_rate(x: float | None) -> str:
    """Thousands separators, 3 significant digits below 1000."""
    if not _ok(x):
        return DASH
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def fmt_speed(x: float | None, summary: Contention | None) -> str:
    """`fmt_rate` of a run's speed, marked when the run was mostly disturbed (contention.disturbed_tag): no such
    figure is shown without saying so."""
    tag = contention.disturbed_tag(summary)
    return fmt_rate(x) + (f" ({tag})" if tag and _ok(x) else "")


def fmt_flops(x: float | None) -> str:
    """'767.8 MFLOP/s', '12.3 GFLOP/s', '1.2 TFLOP/s'."""
    if not _ok(x):
        return DASH
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if x >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x:.3g} FLOP/s"


def fmt_loss(x: float | None, digits: int = 4) -> str:
    return DASH if not _ok(x) else f"{x:.{digits}f}"


def fmt_diff(x: float | None) -> str:
    """A loss difference with its sign: 4 decimals, or 3 significant digits where 4 decimals would show 0."""
    if not _ok(x):
        return DASH
    return f"{x:+.4f}" if x == 0 or abs(x) >= 5e-5 else f"{x:+.2e}"


def fmt_sci(x: float | None) -> str:
    return DASH if not _ok(x) else f"{x:.2e}"


def fmt_score(x: float | None, ci: float | None = None) -> str:
    if not _ok(x):
        return DASH
    return f"{x:.2f} ± {ci:.2f}" if _ok(ci) else f"{x:.2f}"


def html_table(df: pd.DataFrame, classes: str = "", index: bool = True, escape: bool = True) -> Markup:
    """A DataFrame as an HTML table with the report's classes."""
    html = df.to_html(classes=f"table {classes}".strip(), index=index, index_names=False, escape=escape, border=0,
                      na_rep=DASH)
    return Markup(html)


# --- tables --------------------------------------------------------------------------------------------------------
def summary_table(view: RunView, speed: bool = True) -> Markup:
    """One row per backend: status, steps, final losses, throughput, memory, BLEU and chrF; without `speed` (a
    parity check) no throughput, step time or contention."""
    rows = {}
    for rec in view.records:
        c = costs(rec)
        text = rec.text
        last = rec.curves.last_eval
        _, status = status_of(rec, view.age_s.get(rec.backend))
        rows[rec.backend] = {
            "status": status,
            "steps": fmt_int(rec.curves.steps_done),
            "final train loss": fmt_loss(last.train_loss) if last else DASH,
            "final val loss": fmt_loss(final_val(rec)),
            "at step": fmt_int(last.step) if last else DASH,
            "tokens/s": fmt_speed(c.tokens_per_s, c.contention),
            "step (median)": fmt_seconds(c.step_median_s),
            "steps disturbed": fmt_disturbed(c.contention),
            "peak memory": fmt_bytes(c.peak_bytes),
            "BLEU": fmt_score(text.bleu, text.bleu_ci) if text else DASH,
            "chrF": fmt_score(text.chrf, text.chrf_ci) if text else DASH,
        }
        if not speed:
            for key in ("tokens/s", "step (median)", "steps disturbed", "peak memory"):
                del rows[rec.backend][key]
        if not speed and text is None:
            del rows[rec.backend]["BLEU"], rows[rec.backend]["chrF"]
    for name in view.missing:
        rows[name] = {"status": "no record"}
    df = pd.DataFrame.from_dict(rows, orient="index").fillna(DASH)
    df.index.name = "backend"
    return html_table(df, "summary")


def fmt_disturbed(evidence: Contention | None) -> str:
    """'0 %', '12 %', '64 % (mostly: no speed verdict)', or a dash where nothing could be judged."""
    if evidence is None or evidence.contended_fraction is None:
        return DASH
    mark = " (mostly: no speed verdict)" if evidence.mostly_disturbed else ""
    return f"{evidence.contended_fraction:.0%}{mark}"


def fmt_faster(a: str, b: str, time_ratio: float | None, lo: float | None = None, hi: float | None = None) -> str:
    """A time ratio a / b as 'FASTER N× faster [lo, hi]', the faster one named (N ≥ 1)."""
    if not _ok(time_ratio) or not time_ratio:
        return DASH
    from harness.timing.paired import speed_words

    w = speed_words({"a": a, "b": b, "ratio": time_ratio, "lo": lo, "hi": hi})
    interval = f" [{w['lo']:.3g}, {w['hi']:.3g}]" if w["lo"] is not None and w["hi"] is not None else ""
    return f"{w['fast']} {w['x']:.3g}× faster{interval}"


def pair_table(comparisons: list[PairComparison], parity: bool = False) -> Markup:
    """One row per backend pair: validation losses and their difference (first − second), the loss verdict (the
    summary's, `loss_judgement`), the paired per-step difference, the largest deviation, the paired-timing speed and
    the separate training runs' step-time ratio. In a parity check neither speed nor the band's verdict (the parity
    check's rows are its verdict)."""
    rows = []
    for c in comparisons:
        rel = c.val_rel
        verdict = loss_judgement(c).short
        tail = DASH
        if c.tail_mean is not None:
            tail = f"{c.a} − {c.b} = {fmt_diff(c.tail_mean)} ± {c.tail_ci:.2g} ({c.tail_steps} steps)"
        p = c.paired
        rows.append({
            "pair": f"{c.a} vs {c.b}",
            "eval step": fmt_int(c.eval_step),
            "validation loss": DASH if c.val_diff is None else f"{c.a} {fmt_loss(c.val_a)}, {c.b} {fmt_loss(c.val_b)}",
            "Δ val (first − second)": DASH if c.val_diff is None else f"{c.a} − {c.b} = {fmt_diff(c.val_diff)}",
            "|Δ| / mean": DASH if rel is None else f"{rel:.2%}",
            "verdict": verdict,
            "per-step training loss, first − second, last steps (mean ± 95 % CI)": tail,
            "max |Δ| per step": fmt_sci(c.max_dev),
            "speed, paired timing (95 % interval)": DASH if p is None else (
                fmt_faster(c.a, c.b, p["ratio"], p["lo"], p["hi"]) + ("" if p["usable"] else " (too disturbed)")),
            "separate training runs (not paired: no verdict)": fmt_faster(c.a, c.b, c.training_time_ratio),
        })
        if parity:
            for key in ("|Δ| / mean", "verdict", "speed, paired timing (95 % interval)",
                        "separate training runs (not paired: no verdict)"):
                del rows[-1][key]
    return html_table(pd.DataFrame(rows), "pairs", index=False)


def config_table(view: RunView, columns: int = 3) -> Markup:
    """Hyper-parameters, schedule, seed, device and data: a compact grid of `columns` (setting, value) pairs when
    every backend ran the same config, else one column per backend."""
    cfgs = {r.backend: r.config.to_dict() for r in view.records} or {"spec": view.spec.config.to_dict()}
    rec = view.records[0] if view.records else None
    data = (rec.data if rec is not None else None) or view.spec.data
    epochs = rec.epochs if rec is not None else None
    extra = {
        "steps (planned)": fmt_int(rec.total_steps if rec is not None else None),
        "epochs (planned)": f"{epochs:.3g}" if _ok(epochs) else DASH,
        "tokens per step": fmt_int(rec.tokens_per_step if rec is not None else None),
        "seed": _cell(view.spec.seed),
        "device": _cell(view.spec.device),
        "data sha256": _cell((data.sha256 or "")[:16] + "…"),
        "train / val chars": f"{fmt_int(data.n_train)} / {fmt_int(data.n_val)}",
        "vocabulary": fmt_int(data.vocab_size),
        "data file": _cell(data.path),
    }
    if len({repr(sorted(c.items())) for c in cfgs.values()}) == 1:
        items = [(k, _cell(v)) for k, v in next(iter(cfgs.values())).items()] + list(extra.items())
        n_rows = -(-len(items) // columns)
        grid = []
        for i in range(n_rows):
            row: list[str] = []
            for j in range(columns):
                k = j * n_rows + i
                row += list(items[k]) if k < len(items) else ["", ""]
            grid.append(row)
        df = pd.DataFrame(grid, columns=["setting", "value"] * columns)
        return html_table(df, "config grid", index=False)
    df = pd.DataFrame({k: {key: _cell(v) for key, v in c.items()} for k, c in cfgs.items()})
    for col in df.columns:
        for k, v in extra.items():
            df.loc[k, col] = v
    return html_table(df.fillna(DASH), "config")


def environment_table(view: RunView) -> Markup:
    """Framework, versions, device and machine of every backend (union of the keys they report)."""
    cols: dict[str, dict[str, str]] = {}
    for rec in view.records:
        env = rec.environment
        col = {f"backend: {k}": _cell(v) for k, v in rec.backend_info.items()}  # the backend's own describe()
        col.update({
            "backend options": _cell(rec.backend_options),
            "python": _cell(env.python), "numpy": _cell(env.numpy),
            "platform": _cell(env.platform), "host": _cell(env.hostname),
            "CPU": _cell(env.cpu_model),
            "cores (usable / all)": f"{_cell(env.cpu_affinity)} / {_cell(env.cpu_count)}",
            "memory": fmt_bytes(env.memory_bytes), "OMP_NUM_THREADS": _cell(env.omp_num_threads),
            "harness": f"{_cell(env.harness_version)} (git {_cell(env.git_commit)})",
            "started / finished": f"{_cell(rec.started_at)} / {_cell(rec.finished_at)}",
        })
        if rec.resumed_at:
            col["resumed at"] = _cell(rec.resumed_at)
        if rec.resumed_from_step:  # one entry per resume (records of schema version 3)
            col["resumed from step"] = ", then ".join(str(int(s)) for s in rec.resumed_from_step)
        cols[rec.backend] = col
    if not cols:
        return Markup("<p>No record, so no environment.</p>")
    df = pd.DataFrame(cols).fillna(DASH)
    df.index.name = "item"
    return html_table(df, "env")


def fingerprint_table(view: RunView) -> Markup:
    """Short fingerprints per backend, with whether each equals the first backend's."""
    if not view.records:
        return Markup("")
    ref = view.records[0]
    cols = {}
    for rec in view.records:
        col = {}
        for key, label in (("weights", "initial weights"), ("batches", "training batches"),
                           ("eval_batches", "evaluation batches")):
            fp = getattr(rec.fingerprints, key) if rec.fingerprints else None
            same = fp is not None and fp == (getattr(ref.fingerprints, key) if ref.fingerprints else None)
            col[label] = DASH if fp is None else f"{fp[:12]}… {'✓' if same else '✗ differs'}"
        col["config hash"] = _short(rec.config_hash, ref.config_hash)
        col["data sha256"] = _short(rec.data.sha256 if rec.data else None, ref.data.sha256 if ref.data else None)
        cols[rec.backend] = col
    df = pd.DataFrame(cols)
    df.index.name = "input"
    fair = "" if not fairness_problems(view.records) else "unfair"
    return html_table(df, f"fingerprints {fair}".strip())


def _short(fp: str | None, ref: str | None) -> str:
    return DASH if not fp else f"{fp[:12]}… {'✓' if fp == ref else '✗ differs'}"


def _cell(v: Any) -> str:
    if v is None:
        return DASH
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_cell(x)}" for k, x in v.items()) or "none"
    return str(v)


def cost_table(view: RunView) -> Markup:
    """Every cost figure per backend (rows: figures, columns: backends)."""
    rows: dict[str, dict[str, str]] = {}
    for rec in view.records:
        c = costs(rec)
        kind = {"device": "device", "rss": "RSS"}.get(c.memory_kind, c.memory_kind or "")
        steady = f" over {c.steady_steps:,} steps" if c.steady_steps else ""
        if c.figures_from == FIGURES_ALL:
            steady = f" over all {c.steady_steps:,} steady steps (none undisturbed)"
        elif c.disturbed_steps is not None:
            steady = f" over {c.steady_steps:,} undisturbed steps ({c.disturbed_steps:,} disturbed left out)"
        rows[rec.backend] = {
            "setup (model build, weights to device)": fmt_seconds(c.setup_s),
            "compile before step 0 (--compile)": fmt_seconds(c.compile_s),
            "time to first step (JIT warm-up; not --compile)": fmt_seconds(c.first_step_s),
            f"steady step time, median{steady}": fmt_seconds(c.step_median_s),
            "steady step time, p10 – p90": f"{fmt_seconds(c.step_p10_s)} – {fmt_seconds(c.step_p90_s)}",
            "steady step time, IQR": fmt_seconds(c.step_iqr_s),
            "training tokens/s (median step)": fmt_speed(c.tokens_per_s, c.contention),
            "training time (sum of steps)": fmt_seconds(c.train_s),
            "time to target val loss (training time; step)": fmt_target(rec),
            "evaluation time": fmt_seconds(c.eval_s),
            "generation tokens/s (batched)": fmt_rate(c.generation_tokens_per_s),
            "total wall clock (worker)": fmt_seconds(c.wall_s),
            f"peak memory ({kind})" if kind else "peak memory": fmt_bytes(c.peak_bytes),
            "parameters (all)": fmt_int(c.n_params),
            "parameters (non-embedding)": fmt_int(c.n_params_non_embedding),
            "training FLOPs per token": fmt_int(c.flops_per_token),
            "achieved FLOP/s (FLOPs/token × tokens/s)": fmt_flops(c.achieved_flops),
            "contention while training": contention.sentence(c.contention),
            **_contention_rows(c.contention or Contention()),
            "recomputed from per-step data": ", ".join(c.recomputed) or "nothing",
        }
    df = pd.DataFrame(rows).fillna(DASH)
    df.index.name = "cost"
    return html_table(df, "costs")


def _contention_rows(cont: Contention) -> dict[str, str]:
    """The cost table's rows of a run's contention evidence in short."""
    return {
        "CPU time / wall time (median chunk)": DASH if cont.cpu_per_wall is None
        else f"{cont.cpu_per_wall:.2f} ({_cell(cont.threads_max)} threads)",
        "waited for a CPU (median / worst chunk)": DASH if cont.wait_fraction_median is None
        else f"{_share(cont.wait_fraction_median)} / {_share(cont.wait_fraction_max)}",
        "other processes' CPU use (median, in CPUs)": DASH if cont.others_cpus_median is None
        else f"{cont.others_cpus_median:.2f} of {_cell(cont.ncpu)}",
        "load average (1 min, range)": DASH if not cont.load_range
        else " – ".join(DASH if x is None else f"{x:g}" for x in cont.load_range),
    }


def _share(x: float | None) -> str:
    return f"{x:.1%}" if _ok(x) else DASH


def fmt_target(rec: RunRecord) -> str:
    """'12.3 s (step 200; target 2.55)', 'not reached (target 2.55)', or a dash when the config sets no target."""
    ttt = target_of(rec)
    if not ttt:
        return DASH
    if not ttt.reached:
        return f"not reached (target {ttt.target_val_loss:g})"
    return f"{fmt_seconds(ttt.train_s)} (step {ttt.step:,}; target {ttt.target_val_loss:g})"


def text_table(view: RunView) -> Markup | None:
    """BLEU, chrF (± 95 % CI), generation speed and agreement with the first backend's continuations."""
    with_text = [r for r in view.records if r.text is not None]
    if not with_text:
        return None
    first = with_text[0]
    rows = {}
    for rec in with_text:
        t = rec.text
        agree = text_agreement(first, rec) if rec is not first else None
        rows[rec.backend] = {
            "BLEU (± 95 % CI)": fmt_score(t.bleu, t.bleu_ci),
            "chrF (± 95 % CI)": fmt_score(t.chrf, t.chrf_ci),
            "generation tokens/s": fmt_rate(t.generation_tokens_per_s),
            "generation time": fmt_seconds(t.generation_s),
            f"continuations identical to {first.backend}'s": (
                DASH if agree is None else f"{agree['identical']} of {agree['total']} "
                f"(mean common prefix {agree['mean_prefix']:.0f} of {agree['length']} chars)"),
        }
    df = pd.DataFrame.from_dict(rows, orient="index")
    df.index.name = "backend"
    return html_table(df, "text")


def parity_table(doc: ParityRecord) -> Markup | None:
    """The checks of a parity.json, one row each, with the tolerances' source and the precision pair."""
    rows = parity_checks(doc)
    if not rows:
        return None
    df = pd.DataFrame(rows).fillna(DASH)
    if "value" in df:
        df["value"] = df["value"].map(lambda v: f"{v:.2e}" if isinstance(v, float) else _cell(v))
    df = df.map(lambda v: str(escape(_cell(v))))
    if "result" in df:  # drawn as every page draws a check's result (harness.pages)
        df["result"] = df["result"].map(lambda r: f'<span class="pill {OK if r == "ok" else ERROR}">{r}</span>')
    return html_table(df, "parity", index=False, escape=False)
