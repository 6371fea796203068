"""The sweep report `<out>/sweep-<id>.html` (self-contained, like the run reports) and its CSV beside it.

Read from the RunRecords only, through `harness.results.load_runs` (the manifest says which runs belong to the
sweep). Per group (config x backend x device x options): mean and 95 % t interval across seeds of the final
validation loss, median step time, tokens/s, peak memory, time to target, chrF and BLEU. Per config and pair of
backends: per-seed paired step-time ratios and loss differences with intervals, and a verdict sentence. A scaling
figure (step time and tokens/s against FLOPs per token, log-log, fitted exponent per backend, crossover) when the
sweep spans more than one model shape, and validation loss against wall-clock time (median seed, band over seeds).
"""

from __future__ import annotations

import math
import time
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import harness
from harness import records, stats
from harness.report import tables
from harness.sweep import manifest as mf

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
    """One row per group: n seeds completed, then 'mean [lo, hi]' of every metric (95 % t interval over seeds)."""
    rows = []
    done = df[df["status"] == "completed"]
    for key, g in done.groupby(GROUP, dropna=False, sort=False):
        row = {"group": _group_name(key), "seeds": len(g)}
        for col, head, fmt in METRICS:
            if col == "target_train_s":
                reached = int(g["target_reached"].fillna(False).astype(bool).sum())
                text = _interval_text(g.loc[g["target_reached"].fillna(False).astype(bool), col], fmt, True)
                if not g["target_val_loss"].notna().any():
                    row[head] = tables.DASH
                else:
                    row[head] = f"{text}; reached {reached}/{len(g)}" if reached else f"not reached (0/{len(g)})"
            else:
                row[head] = _interval_text(g[col], fmt, col in LOG_SCALE)
        rows.append(row)
    return pd.DataFrame(rows)


def comparisons(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Paired backend comparisons per config (and device/options), matched by seed."""
    out = []
    done = df[df["status"] == "completed"]
    for key, g in done.groupby(["label", "device"], sort=False):
        label, device = key
        backends = list(dict.fromkeys(g["backend"]))
        for a, b in combinations(backends, 2):
            ga = g[g["backend"] == a].groupby("seed").first()
            gb = g[g["backend"] == b].groupby("seed").first()
            seeds = sorted(set(ga.index) & set(gb.index))
            if not seeds:
                continue
            ta, tb = ga.loc[seeds, "step_median_s"].tolist(), gb.loc[seeds, "step_median_s"].tolist()
            la, lb = ga.loc[seeds, "final_val_loss"].tolist(), gb.loc[seeds, "final_val_loss"].tolist()
            speed = stats.paired_ratio(tb, ta) if all(_finite(ta)) and len(_finite(ta + tb)) == 2 * len(seeds) \
                else None  # > 1: a is faster (b's steps take longer)
            loss = stats.paired_difference(la, lb) if len(_finite(la + lb)) == 2 * len(seeds) else None
            contended = bool(g["contended"].any())
            out.append({"label": label, "device": device, "a": a, "b": b, "seeds": seeds, "speed": speed,
                        "loss": loss, "contended": contended, "sentence": _sentence(label, device, a, b, seeds,
                                                                                     speed, loss, contended)})
    return out


def _sentence(label: str, device: str, a: str, b: str, seeds: list, speed: stats.Interval | None,
              loss: stats.Interval | None, contended: bool) -> str:
    n = f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''}"
    parts = []
    if speed is not None:
        fast, slow, r = (a, b, speed) if speed.estimate >= 1 else (b, a, stats.Interval(
            1 / speed.estimate, None if speed.hi is None else 1 / speed.hi,
            None if speed.lo is None else 1 / speed.lo, speed.n))
        ci = f" [{r.lo:.3g}, {r.hi:.3g}]" if r.lo is not None else " (one seed: no interval)"
        certain = "" if r.lo is None or r.lo > 1 or r.hi < 1 else " (the interval includes 1: not a clear difference)"
        parts.append(f"{fast} is {r.estimate:.3g}x{ci} faster than {slow} on {label} ({device}), {n}{certain}")
    if loss is not None:
        if loss.lo is None:
            parts.append(f"final validation loss {a} − {b}: {loss.estimate:+.3g} (one seed: no interval)")
        else:
            zero = "consistent with no difference" if loss.lo <= 0 <= loss.hi else "a systematic difference"
            parts.append(f"final validation loss {a} − {b}: {loss.estimate:+.3g} [{loss.lo:+.3g}, {loss.hi:+.3g}], "
                         f"{zero}")
    text = "; ".join(parts) + "."
    if contended:
        text += " Timings were taken with cells running side by side (--jobs), so they are contended."
    return text


def pair_table(comps: list[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for c in comps:
        s, lo = c["speed"], c["loss"]
        rows.append({"config": c["label"], "device": c["device"], "pair": f"{c['a']} vs {c['b']}",
                     "seeds": len(c["seeds"]),
                     "step time ratio (b / a)": s.fmt(".3g", "x") if s else tables.DASH,
                     "val loss a − b": lo.fmt("+.3g") if lo else tables.DASH})
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


def _wall_curve(rec: dict) -> tuple[np.ndarray, np.ndarray]:
    """(elapsed training + evaluation seconds at each evaluation, val loss there) of one record."""
    steps = rec.get("steps") or {}
    step_idx = np.asarray(steps.get("step", []), dtype=np.int64)
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(steps.get("time_s", []), dtype=np.float64))])
    xs, ys, eval_s = [], [], 0.0
    for e in rec.get("evals") or []:
        k = int(np.searchsorted(step_idx, e["step"]))  # steps before this evaluation
        eval_s += e.get("time_s") or 0.0
        xs.append(cum[min(k, len(cum) - 1)] + eval_s)
        ys.append(e["val_loss"])
    return np.asarray(xs), np.asarray(ys)


def wallclock_figures(out: Path, df: pd.DataFrame) -> list[dict[str, Any]]:
    """Per config: validation loss against elapsed time per backend, the median seed's curve and a min–max band."""
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
                    rec = records.load_record(records.run_dir(out, r["run_id"]) / f"{backend}.json")
                    curves.append((r["final_val_loss"], *_wall_curve(rec)))
                curves.sort(key=lambda c: c[0])
                _, mx, my = curves[len(curves) // 2]  # the median seed (by final val loss)
                col = figures.color(str(backend))
                if len(curves) > 1:
                    grid = np.linspace(0, min(c[1][-1] for c in curves), 60)
                    band = np.array([np.interp(grid, c[1], c[2]) for c in curves])
                    ax.fill_between(grid, band.min(axis=0), band.max(axis=0), color=col, alpha=0.18, linewidth=0)
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


def write_sweep_report(out: Path, sweep_id: str) -> Path:
    """Write `<out>/sweep-<id>.html` and `<out>/sweep-<id>.csv` (the tidy table of its runs); returns the HTML path."""
    from harness.report import _env
    from harness.results import load_runs

    out = Path(out)
    m = mf.Manifest.load(out, sweep_id)
    df = load_runs(out, sweep_id=sweep_id).sort_values("cell", kind="stable")  # the spec's order of backends
    states: dict[str, int] = {}
    for cell in m.cells:
        states[cell["status"]] = states.get(cell["status"], 0) + 1
    comps = comparisons(df)
    sc = scaling(df)
    banners = []
    if df["contended"].any():
        banners.append({"level": "warn", "text": "Some cells ran side by side (--jobs): their timings are contended "
                                                  "and not comparable; the losses are unaffected."})
    if states.get("completed", 0) < len(m.cells):
        done = states.get("completed", 0)
        banners.append({"level": "warn", "text": f"Incomplete sweep: {done} of {len(m.cells)} cells completed; "
                                                  f"`harness sweep --resume {sweep_id}` runs the rest."})
    run_ids = [c["run_id"] for c in m.cells if c.get("run_id")]
    page = _env().get_template("sweep.html.j2").render(
        title=f"nanogpt-parity sweep {sweep_id}", sweep_id=sweep_id, version=harness.__version__,
        generated=time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()), run_ids=run_ids, banners=banners,
        spec=m.doc["spec"], executor=m.doc["executor"], states=states, n_cells=len(m.cells),
        groups=tables.html_table(group_table(df), "summary", index=False) if len(df) else None,
        comparisons=comps, pairs=tables.html_table(pair_table(comps), "pairs", index=False) if comps else None,
        scaling=None if sc is None else {"fig": scaling_figure(sc), "crossings": sc["crossings"],
                                         "table": tables.html_table(sc["table"], "scaling", index=False)},
        wallclock=wallclock_figures(out, df), csv_name=f"sweep-{sweep_id}.csv",
        cells=tables.html_table(pd.DataFrame([{"cell": c["index"], "key": c["key"], "status": c["status"],
                                               "run": c.get("run_id") or "", "jobs": " ".join(c.get("job_ids", []))}
                                              for c in m.cells]), "cells", index=False))
    csv_path = out / f"sweep-{sweep_id}.csv"
    records.atomic_write_bytes(csv_path, df.to_csv(index=False).encode("utf-8"))
    path = out / f"sweep-{sweep_id}.html"
    records.atomic_write_bytes(path, page.encode("utf-8"))
    return path
