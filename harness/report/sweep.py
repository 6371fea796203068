"""The sweep report `<out>/sweep-<id>.html` (self-contained, like the run reports) and its CSV beside it.

Read from the RunRecords, through `harness.report.results.load_runs` (the manifest says which runs belong to the sweep),
and the sweep's paired-timing records (harness.run.paired_timing). Per group (config x backend x device x options): mean
and 95 % t interval across seeds of the final validation loss, median step time, tokens/s, peak memory, time to target,
chrF and BLEU (speed figures without the cells whose training was mostly disturbed). Per (config, device, dtype option,
precision option) and pair of backends, one verdict naming the combination: the speed ratio from the paired timing,
combined across seeds, the loss difference first − second across seeds, each with its interval, what the data cannot
carry said in the sentence, and the contention behind it. A scaling figure (step time and tokens/s against FLOPs per
token, log-log, fitted exponent per backend, crossover) when the sweep spans more than one model shape, and validation
loss against wall-clock time (median seed, band over seeds).
"""

from __future__ import annotations

import math
import time
import warnings
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import harness
from harness.pages import NEUTRAL, WARN, worse
from harness.report import tables
from harness.report.analysis import CONVENTION, difference_judgement
from harness.store import RunPaths, RunRecord, atomic_write_bytes
from harness.store.curves import eval_array
from harness.store.paired import PairedRecord
from harness.store.sweep import PairedEntry
from harness.sweep import manifest as mf
from harness.timing import contention, stats

GROUP = ["label", "backend", "device", "dtype", "precision"]
METRICS = [  # column, heading, formatter
    ("final_val_loss", "final val loss", lambda x: tables.fmt_loss(x)),
    ("step_median_s", "median step", tables.fmt_seconds),
    ("tokens_per_s", "tokens/s", tables.fmt_rate),
    ("peak_bytes", "peak memory", tables.fmt_bytes),
    ("target_train_s", "time to target", tables.fmt_seconds),
    ("chrf", "chrF", lambda x: tables.fmt_score(x)),
    ("bleu", "BLEU", lambda x: tables.fmt_score(x)),
]


def _finite(values: Any) -> list[float]:
    return [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


# Positive, right-skewed figures: geometric mean and an interval on the log scale (never below zero).
LOG_SCALE = {"step_median_s", "tokens_per_s", "peak_bytes", "target_train_s"}


def _interval_text(values: list[float], fmt: Any, log_scale: bool = False) -> str:
    vals = _finite(values)
    if log_scale:
        vals = [v for v in vals if v > 0]
    if not vals:
        return tables.DASH
    ci = stats.geometric_mean_ci(vals) if log_scale else stats.mean_ci(vals)
    if ci.lo is None:
        return f"{fmt(ci.estimate)} (n=1)"
    return f"{fmt(ci.estimate)} [{fmt(ci.lo)}, {fmt(ci.hi)}]"


def _group_name(key: tuple) -> str:
    label, backend, device, dtype, precision = key
    extra = "".join(f", {x}" for x in (dtype, precision) if isinstance(x, str) and x)
    return f"{label} / {backend} ({device}{extra})"


def group_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per group: n seeds completed, then 'mean [lo, hi]' of every metric (95 % t interval over seeds).

    Speed figures (median step, tokens/s, time to target) leave out cells whose training was mostly disturbed
    (harness.timing.contention); the last column says how many cells were disturbed and how many of them were left
    out."""
    rows = []
    done = df[df["status"] == "completed"]
    for key, g in done.groupby(GROUP, dropna=False, sort=False):
        row = {"group": _group_name(key), "seeds": len(g)}
        mostly = g["mostly_disturbed"].fillna(False).astype(bool) if "mostly_disturbed" in g else pd.Series(
            False, index=g.index)
        quiet = g[~mostly]
        for col, head, fmt in METRICS:
            src = quiet if col in SPEED else g
            if col == "target_train_s":
                hit = src["target_reached"].fillna(False).astype(bool)
                text = _interval_text(src.loc[hit, col], fmt, True)
                if not g["target_val_loss"].notna().any():
                    row[head] = tables.DASH
                else:
                    row[head] = f"{text}; reached {int(hit.sum())}/{len(src)}" if hit.any() \
                        else f"not reached (0/{len(src)})"
            else:
                row[head] = _interval_text(src[col], fmt, col in LOG_SCALE)
        frac = g["contended_fraction"] if "contended_fraction" in g else pd.Series(dtype=float)
        disturbed = int((frac.fillna(0) > 0).sum())
        row["cells disturbed (left out of speed)"] = (tables.DASH if frac.isna().all()
                                                      else f"{disturbed} of {len(g)} ({int(mostly.sum())})")
        rows.append(row)
    return pd.DataFrame(rows)


SPEED = {"step_median_s", "tokens_per_s", "target_train_s"}  # figures a mostly disturbed cell does not enter


def _option(value: Any) -> Any:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def comparison_name(label: str, device: str, dtype: Any, precision: Any, g: pd.DataFrame) -> str:
    """'small on cpu, dtype float32, precision tf32'; without a dtype option the dtypes each backend used."""
    name = f"{label} on {device}"
    if dtype:
        name += f", dtype {dtype}"
    elif "dtype" in g and g["dtype"].notna().any():
        used = g.groupby("backend", sort=False)["dtype"].first()
        name += ", dtypes " + ", ".join(f"{b} {d}" for b, d in used.items() if isinstance(d, str))
    if precision:
        name += f", precision {precision}"
    return name


def _paired_index(paired_docs: list[PairedRecord]) -> dict[tuple[str, str], tuple[PairedRecord, str]]:
    """(run id, backend) -> (paired-timing record, the contender's name in it)."""
    index = {}
    for doc in paired_docs:
        for c in doc.contenders:
            if c.run_id:
                index[(c.run_id, c.backend)] = (doc, c.name)
    return index


def comparisons(df: pd.DataFrame, paired_docs: list[PairedRecord] | None = None) -> list[dict[str, Any]]:
    """Paired backend comparisons, one per (label, device, dtype option, precision option) and pair of backends,
    matched by seed. A backend without a precision axis (numpy) enters every precision's comparison.

    Speed comes from the paired timing (`paired_docs`, harness.run.paired_timing: one record per block and seed, its
    usable sessions combined across seeds); without one there is no speed verdict, and the ratio of the separate
    training runs' median step times (mostly disturbed cells left out) is shown as information only."""
    from harness.timing import paired

    index = _paired_index(paired_docs or [])
    out = []
    done = df[df["status"] == "completed"].copy()
    for col in ("dtype_option", "precision_option", "mostly_disturbed", "contended_fraction", "run_id"):
        if col not in done:
            done[col] = None
    done["dtype_option"] = done["dtype_option"].map(_option)
    done["precision_option"] = done["precision_option"].map(_option)
    for (label, device, dtype), block in done.groupby(["label", "device", "dtype_option"], sort=False,
                                                      dropna=False):
        dtype = _option(dtype)
        precisions = list(dict.fromkeys(p for p in block["precision_option"] if p is not None)) or [None]
        for precision in precisions:
            g = block[block["precision_option"].isna() | (block["precision_option"] == precision)] \
                if precision is not None else block
            backends = list(dict.fromkeys(g["backend"]))
            for a, b in combinations(backends, 2):
                ga = g[g["backend"] == a].groupby("seed").first()
                gb = g[g["backend"] == b].groupby("seed").first()
                seeds = sorted(set(ga.index) & set(gb.index))
                if not seeds:
                    continue
                la, lb = ga.loc[seeds, "final_val_loss"].tolist(), gb.loc[seeds, "final_val_loss"].tolist()
                loss = stats.paired_difference(la, lb) if len(_finite(la + lb)) == 2 * len(seeds) else None
                quiet = [s for s in seeds if not _truthy(ga.loc[s, "mostly_disturbed"])
                         and not _truthy(gb.loc[s, "mostly_disturbed"])]
                ta, tb = ga.loc[quiet, "step_median_s"].tolist(), gb.loc[quiet, "step_median_s"].tolist()
                training = stats.paired_ratio(ta, tb) if quiet and len(_finite(ta + tb)) == 2 * len(quiet) \
                    else None  # time ratio a / b of the separate training runs: information, no verdict
                per_seed = []
                for s in seeds:
                    ka, kb = (ga.loc[s, "run_id"], a), (gb.loc[s, "run_id"], b)
                    if ka in index and kb in index and index[ka][0] is index[kb][0]:
                        doc = index[ka][0]
                        summary = paired.pair_summary(doc, index[ka][1], index[kb][1])
                        if summary["rounds"]:
                            per_seed.append(dict(summary, seed=s))
                speed = paired.combine(per_seed) if per_seed else None
                if speed is not None:
                    speed.update(a=a, b=b)
                disturbed = [(x, s, float(gx.loc[s, "contended_fraction"]), _truthy(gx.loc[s, "mostly_disturbed"]))
                             for x, gx in ((a, ga), (b, gb)) for s in seeds
                             if _option(gx.loc[s, "contended_fraction"]) and gx.loc[s, "contended_fraction"] > 0]
                name = comparison_name(label, device, dtype, precision, g)
                c = {"label": label, "device": device, "dtype": dtype, "precision": precision, "name": name,
                     "a": a, "b": b, "seeds": seeds, "speed": speed, "training": training,
                     "loss": loss, "loss_scale": float(np.mean(la + lb)) if loss is not None else None,
                     "disturbed": disturbed, "contended": bool(g["contended"].any())}
                c.update(verdict(c))
                out.append(c)
    return out


def _truthy(x: Any) -> bool:
    return bool(_option(x)) if not isinstance(x, (bool, np.bool_)) else bool(x)


def verdict(c: dict[str, Any]) -> dict[str, Any]:
    """The sentence, level and pills of one comparison: speed from the paired timing (green only when its interval
    excludes 1 with 3 or more seeds and a CV of the paired ratios of at most 10 %), and the loss difference a − b
    across seeds judged against the band of a run's report (`difference_judgement`). The box takes the worse of
    the two levels; each pill keeps its own."""
    from harness.timing import paired

    a, b, s = c["a"], c["b"], c["speed"]
    parts, notes = [], []
    if s is None or s.get("ratio") is None:
        speed_level, speed_label = NEUTRAL, "speed: not compared"
        parts.append(f"speed not compared: no paired timing of {a} and {b} (--paired-rounds 0, or a sweep from "
                     "before it existed); the separate training runs' step times are in the table, not a verdict")
    else:
        j = paired.judge(s)
        speed_level, speed_label, notes = j["level"], j["label"], j["notes"]
        parts.append(f"{j['claim']} (paired timing, interval {j['over']})")
    loss, loss_label, loss_level = c["loss"], None, NEUTRAL
    if loss is not None:
        parts.append(_loss_words(c))
        judged = _loss_judged(c)
        loss_label, loss_level = judged.label, judged.level
    text = f"{c['name']}: " + "; ".join(parts) + "."
    if notes:
        text += " Said plainly: " + "; ".join(notes) + "."
    text += " " + contention_line(c)
    if c["contended"]:
        text += " Timings were taken with cells running side by side (--jobs), so they are contended."
    level = worse(speed_level, loss_level) if loss_label else speed_level
    return {"sentence": text, "level": level, "speed_level": speed_level,
            "speed_label": speed_label, "loss_label": loss_label, "loss_level": loss_level}


def _loss_judged(c: dict[str, Any]) -> Any:
    """The loss verdict of a comparison: its interval across seeds (one seed: the point) against the band."""
    loss = c["loss"]
    lo, hi = (loss.estimate, loss.estimate) if loss.lo is None else (loss.lo, loss.hi)
    what = "the difference" if loss.lo is None else "its interval"
    return difference_judgement(lo, hi, c["loss_scale"], what)


def _loss_words(c: dict[str, Any]) -> str:
    """'final validation loss a − b: +0.0012 [-0.0003, +0.0027] (at most 0.11% of the mean loss; consistent with
    no difference), its interval within the 2% band: the losses agree'."""
    a, b, loss = c["a"], c["b"], c["loss"]
    if loss.lo is None:
        shown, how = f"{loss.estimate:+.3g} (one seed: no interval", abs(loss.estimate)
    else:
        sign = ("consistent with no difference" if loss.lo <= 0 <= loss.hi
                else f"{a} {'higher' if loss.estimate > 0 else 'lower'} across seeds")
        shown, how = f"{loss.estimate:+.3g} [{loss.lo:+.3g}, {loss.hi:+.3g}] ({sign}", max(abs(loss.lo), abs(loss.hi))
    scale = c["loss_scale"]
    share = f"; at most {how / scale:.2%} of the mean loss" if scale else ""
    return f"final validation loss {a} − {b}: {shown}{share}), {_loss_judged(c).why}"


def contention_line(c: dict[str, Any]) -> str:
    """One line: which cells of the comparison were disturbed while training, and the paired rounds left out."""
    if c["disturbed"]:
        cells = ", ".join(f"{x} seed {s} ({f:.0%} of steady steps{'; mostly: left out' if m else ''})"
                          for x, s, f, m in c["disturbed"])
        line = f"Contention: disturbed while training: {cells}"
    else:
        line = "Contention: no cell of this comparison was disturbed while training"
    s = c["speed"]
    if s is not None and s.get("rounds"):
        line += f"; paired timing: {s['disturbed_rounds']} of {s['rounds']} rounds disturbed (left out)"
    return line + "."


def pair_table(comps: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per comparison, in the sentences' direction: the faster backend named, differences first − second."""
    rows = []
    for c in comps:
        s, lo, t = c["speed"], c["loss"], c["training"]
        rows.append({
            "comparison": c["name"], "pair": f"{c['a']} vs {c['b']}", "seeds": len(c["seeds"]),
            "speed, paired timing (95 % interval)": tables.DASH if not s or s.get("ratio") is None else (
                tables.fmt_faster(c["a"], c["b"], s["ratio"], s.get("lo"), s.get("hi"))
                + ("" if s.get("usable") else " (too disturbed)")),
            "CV of the paired ratios": tables.DASH if not s or s.get("cv") is None else f"{s['cv']:.1%}",
            "paired rounds (disturbed / all)": tables.DASH if not s or not s.get("rounds")
            else f"{s['disturbed_rounds']} / {s['rounds']}",
            "separate training runs (not paired: no verdict)": tables.DASH if t is None
            else tables.fmt_faster(c["a"], c["b"], t.estimate, t.lo, t.hi),
            "val loss, first − second": tables.DASH if lo is None else f"{c['a']} − {c['b']} = {lo.fmt('+.3g')}",
            "cells disturbed": len(c["disturbed"]),
        })
    return pd.DataFrame(rows)


def scaling(df: pd.DataFrame) -> dict[str, Any] | None:
    """Per backend: log-log fit of median step time and tokens/s against FLOPs per token, and any crossover."""
    done = df[(df["status"] == "completed") & df["step_median_s"].notna() & df["flops_per_token"].notna()]
    if done["flops_per_token"].nunique() < 2:
        return None
    fits = {}
    for (backend, device), g in done.groupby(["backend", "device"], sort=False):
        fit_t = stats.loglog_fit(g["flops_per_token"], g["step_median_s"])
        fit_r = stats.loglog_fit(g["flops_per_token"], g["tokens_per_s"])
        if fit_t:
            fits[f"{backend} ({device})"] = {"step": fit_t, "rate": fit_r, "backend": backend,
                                             "x": g["flops_per_token"].to_numpy(float),
                                             "t": g["step_median_s"].to_numpy(float),
                                             "r": g["tokens_per_s"].to_numpy(float)}
    lo, hi = float(done["flops_per_token"].min()), float(done["flops_per_token"].max())
    crossings = []
    for (na, fa), (nb, fb) in combinations(fits.items(), 2):
        (ka, ca), (kb, cb) = fa["step"], fb["step"]
        if abs(ka - kb) < 1e-9:
            continue
        x = (cb / ca) ** (1.0 / (ka - kb))  # ca x^ka = cb x^kb
        where = "inside" if lo <= x <= hi else "outside"
        below = x / 2  # which backend the fits make faster on each side of the crossing
        fast_below, fast_above = (na, nb) if ca * below ** ka < cb * below ** kb else (nb, na)
        crossings.append(f"The fitted step-time lines of {na} and {nb} cross at {x:.3g} FLOPs per token, {where} the "
                         f"measured range [{lo:.3g}, {hi:.3g}]: below it {fast_below} is faster, above it "
                         f"{fast_above}.")
    rows = [{"backend": name, "points": len(f["x"]), "step time ∝ FLOPs^k: k": f"{f['step'][0]:.2f}",
             "tokens/s ∝ FLOPs^k: k": f"{f['rate'][0]:.2f}" if f["rate"] else tables.DASH} for name, f in fits.items()]
    if not crossings and len(fits) > 1:
        crossings.append("The fitted step-time lines do not cross (parallel slopes).")
    return {"fits": fits, "table": pd.DataFrame(rows), "crossings": crossings}


def scaling_figure(sc: dict[str, Any]) -> Any:
    from harness.report import figures

    plt = figures.plt
    with plt.rc_context(figures.RC):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for name, f in sc["fits"].items():
            col = figures.color(f["backend"])
            xs = np.geomspace(f["x"].min(), f["x"].max(), 50)
            for ax, ys, fit in ((axes[0], f["t"], f["step"]), (axes[1], f["r"], f["rate"])):
                ax.scatter(f["x"], ys, s=14, color=col, alpha=0.7)
                if fit:
                    ax.plot(xs, fit[1] * xs ** fit[0], color=col, label=f"{figures.plain(name)}: k = {fit[0]:.2f}")
        for ax, ylabel in ((axes[0], "median step time (s)"), (axes[1], "tokens/s")):
            ax.set_xscale("log"), ax.set_yscale("log")
            ax.set_xlabel("training FLOPs per token"), ax.set_ylabel(ylabel)
            ax.legend(fontsize=8)
        fig.tight_layout()
        return figures.to_svg(fig, "step time and tokens/s against FLOPs per token")


def _wall_curve(rec: RunRecord) -> tuple[np.ndarray, np.ndarray]:
    """(elapsed training + evaluation seconds at each evaluation, val loss there) of one record."""
    cv = rec.curves
    step_idx = np.asarray(cv.step, dtype=np.int64)
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(cv.time_s, dtype=np.float64))])
    rows = eval_array(cv.evals)  # (step, train loss, val loss, seconds; an unknown time nan, counted as none)
    k = np.searchsorted(step_idx, rows[:, 0].astype(np.int64))  # steps before each evaluation
    eval_s = np.cumsum(np.nan_to_num(rows[:, 3], nan=0.0))
    return cum[np.minimum(k, len(cum) - 1)] + eval_s, rows[:, 2]


def seed_band(curves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times, lowest, highest) validation loss over the seeds' curves (elapsed seconds, loss), each curve read only
    within its own time range (a seed that ended early, or started late, is no measurement outside it), at every
    time any curve was evaluated: so the band encloses each seed's line, every vertex and the straight pieces
    between them. Seeds on a busy machine can take very different times for the same steps."""
    times = np.unique(np.concatenate([x for x, _ in curves]))
    table = np.full((len(curves), len(times)), np.nan)
    for i, (x, y) in enumerate(curves):
        inside = (times >= x[0]) & (times <= x[-1])
        table[i, inside] = np.interp(times[inside], x, y)
    with warnings.catch_warnings():  # a time at which every curve's loss is not finite stays a gap
        warnings.simplefilter("ignore", RuntimeWarning)
        return times, np.nanmin(table, axis=0), np.nanmax(table, axis=0)


def wallclock_figures(out: Path, df: pd.DataFrame) -> list[dict[str, Any]]:
    """Per config: validation loss against elapsed time per backend, the median seed's curve and the band over
    every seed (`seed_band`), on the one time axis of `_wall_curve`."""
    from harness.report import figures

    plt = figures.plt
    done = df[(df["status"] == "completed") & df["final_val_loss"].notna()]
    result = []
    for (label, device), g in done.groupby(["label", "device"], sort=False):
        with plt.rc_context(figures.RC):
            fig, ax = plt.subplots(figsize=(10, 3.6))
            for backend, gb in g.groupby("backend", sort=False):
                curves = []
                for _, r in gb.iterrows():
                    rec = RunRecord.load(RunPaths(out, r["run_id"]).record(backend))
                    curves.append((r["final_val_loss"], *_wall_curve(rec)))
                curves.sort(key=lambda c: c[0])
                _, mx, my = curves[len(curves) // 2]  # the median seed (by final val loss)
                col = figures.color(str(backend))
                if len(curves) > 1:
                    times, lo, hi = seed_band([(c[1], c[2]) for c in curves if len(c[1])])
                    ax.fill_between(times, lo, hi, color=col, alpha=0.18, linewidth=0)
                ax.plot(mx, my, color=col, marker="o", markersize=3,
                        label=f"{figures.plain(backend)} ({len(curves)} seeds)")
            target = g["target_val_loss"].dropna()
            if len(target):
                ax.axhline(float(target.iloc[0]), color="#495057", linestyle=":", linewidth=1,
                           label=f"target {float(target.iloc[0]):g}")
            ax.set_xlabel("elapsed training + evaluation time (s)"), ax.set_ylabel("validation loss")
            ax.set_title(figures.plain(f"{label} ({device})")), ax.legend(fontsize=8)
            fig.tight_layout()
            result.append({"label": f"{label} ({device})",
                           "fig": figures.to_svg(fig, f"validation loss against time, {label}")})
    return result


def paired_records(out: Path, m: mf.Manifest) -> list[tuple[PairedEntry, PairedRecord | str]]:
    """Each paired entry of the sweep with its record, or why it has none ("not run yet", the one-line error)."""
    from harness.errors import UsageError

    found: list[tuple[PairedEntry, PairedRecord | str]] = []
    for entry in m.paired:
        path = entry.record(out)
        try:
            found.append((entry, PairedRecord.load(path) if path.exists() else "not run yet"))
        except UsageError as exc:
            found.append((entry, str(exc)))
    return found


def paired_docs(out: Path, m: mf.Manifest) -> list[PairedRecord]:
    """The sweep's paired-timing records (an unreadable or missing one is left out: its comparison says so)."""
    return [doc for _, doc in paired_records(out, m) if isinstance(doc, PairedRecord)]


def sweep_verdict(out: Path, sweep_id: str) -> dict[str, Any]:
    """For the index: the sweep's comparisons in short (level and label each), read from the records now."""
    from harness.report.results import load_runs

    m = mf.Manifest.load(out, sweep_id)
    df = load_runs(out, sweep_id=sweep_id).sort_values("cell", kind="stable")
    comps = comparisons(df, paired_docs(out, m))
    done = sum(1 for c in m.cells if c.status == "completed")
    items = [{"name": f"{c['name']}, {c['a']} vs {c['b']}", "level": c["speed_level"], "label": c["speed_label"],
              "loss_label": c["loss_label"], "loss_level": c["loss_level"]} for c in comps]
    return {"cells": len(m.cells), "completed": done, "comparisons": items}


def write_sweep_report(out: Path, sweep_id: str) -> Path:
    """Write `<out>/sweep-<id>.html` and `<out>/sweep-<id>.csv` (the tidy table of its runs); returns the HTML path."""
    from harness.report import _env
    from harness.report.results import load_runs
    from harness.timing import paired

    out = Path(out)
    m = mf.Manifest.load(out, sweep_id)
    df = load_runs(out, sweep_id=sweep_id).sort_values("cell", kind="stable")  # the spec's order of backends
    states: dict[str, int] = {}
    for cell in m.cells:
        states[cell.status] = states.get(cell.status, 0) + 1
    found = paired_records(out, m)
    comps = comparisons(df, [doc for _, doc in found if isinstance(doc, PairedRecord)])
    sc = scaling(df)
    banners = []
    if df["contended"].any():
        banners.append({"level": WARN, "text": "Some cells ran side by side (--jobs): their timings are contended "
                                                  "and not comparable; the losses are unaffected."})
    hit = df[df["contended_fraction"].fillna(0) > 0] if "contended_fraction" in df else df.iloc[:0]
    if len(hit):
        left = ", mostly disturbed: left out of speed figures"
        names = ", ".join(f"{r['label']}/{r['backend']} seed {r['seed']} (contended_fraction "
                          f"{r['contended_fraction']:.2f}{left if _truthy(r['mostly_disturbed']) else ''})"
                          for _, r in hit.iterrows())
        banners.append({"level": WARN, "text": f"Disturbed by other work on the machine while training: {names}. "
                                                  "Their speed figures come from the undisturbed steps; the speed "
                                                  "verdicts rest on the paired timing."})
    if states.get("completed", 0) < len(m.cells):
        done = states.get("completed", 0)
        banners.append({"level": WARN, "text": f"Incomplete sweep: {done} of {len(m.cells)} cells completed; "
                                                  f"`harness resume {sweep_id}` runs the rest."})
    run_ids = [c.run_id for c in m.cells if c.run_id]
    page = _env().get_template("sweep.html.j2").render(
        title=f"nanogpt-parity sweep {sweep_id}", sweep_id=sweep_id, version=harness.__version__,
        generated=time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()), run_ids=run_ids, banners=banners,
        spec=m.doc.spec.to_dict(), executor=m.doc.executor, states=states, n_cells=len(m.cells),
        groups=tables.html_table(group_table(df), "summary", index=False) if len(df) else None,
        comparisons=comps, pairs=tables.html_table(pair_table(comps), "pairs", index=False) if comps else None,
        convention=CONVENTION, rule=contention.RULE_SENTENCE,
        paired=[{"key": e.key, "status": e.status,
                 "line": paired.headline(doc) if isinstance(doc, PairedRecord) else doc} for e, doc in found],
        scaling=None if sc is None else {"fig": scaling_figure(sc), "crossings": sc["crossings"],
                                         "table": tables.html_table(sc["table"], "scaling", index=False)},
        wallclock=wallclock_figures(out, df), csv_name=f"sweep-{sweep_id}.csv",
        cells=tables.html_table(pd.DataFrame([{"cell": c.index, "key": c.key, "status": c.status,
                                               "run": c.run_id or "", "jobs": " ".join(c.job_ids)}
                                              for c in m.cells]), "cells", index=False))
    csv_path = out / f"sweep-{sweep_id}.csv"
    atomic_write_bytes(csv_path, df.to_csv(index=False).encode("utf-8"))
    path = out / f"sweep-{sweep_id}.html"
    atomic_write_bytes(path, page.encode("utf-8"))
    return path
