"""The report's figures: matplotlib (Agg) drawn to SVG text that is inlined into the HTML.

Every figure is self-contained SVG (text kept as text, no external references). Element ids are prefixed per
figure, so that several SVGs inlined into one page cannot clash. Long curves are reduced to at most `MAX_POINTS`
bins (mean line plus min-max band), and long evaluation lines to the smallest and largest point of each bin
(`decimated`), which keeps the file small and quick to draw without hiding spikes; every value stays in the CSVs.
"""

from __future__ import annotations

import functools
import io
import itertools
import re
from collections.abc import Callable
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from markupsafe import Markup, escape

from harness.report.analysis import PairComparison, RunView, costs, step_losses
from harness.store.curves import eval_columns

MAX_POINTS = 1500
_EXTRA = ["#e67700", "#495057", "#c2255c", "#0b7285", "#5c940d"]  # none of the shipped backends' own
RC = {"svg.fonttype": "none", "svg.hashsalt": "nanogpt-parity", "font.size": 10, "axes.titlesize": 11,
      "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
      "legend.frameon": False, "font.family": "DejaVu Sans"}
_ids = itertools.count(1)
# The largest magnitude drawn: a record may hold any finite number (a diverged run's loss of 1e308), but sums and
# differences of values near the float64 limit overflow to inf, and an axis reaching inf cannot be labelled. Values
# beyond this are left out of a figure as non-finite ones are (the tables still show them).
PLOT_MAX = 1e100


def color(backend: str) -> str:
    """The colour a backend declares (harness.backends.declaration); any other name (a port's, a backend no longer
    installed, one that declares none) gets a stable colour from a small palette."""
    from harness.backends import declarations

    declared = declarations([backend]).get(backend)
    return declared.color if declared and declared.color else _EXTRA[sum(map(ord, backend)) % len(_EXTRA)]


def plain(text: object) -> str:
    """`text` for a matplotlib label, drawn as written: a `$` would start mathtext (and a malformed formula raise).

    Only names read from records get this; the harness's own labels may use mathtext on purpose.
    """
    return str(text).replace("$", r"\$")


def plottable(values: Any) -> np.ndarray:
    """`values` as float64 with what no figure can draw (non-finite, or beyond `PLOT_MAX` in magnitude) as nan."""
    y = np.array(values, dtype=np.float64)
    y[~(np.abs(y) <= PLOT_MAX)] = np.nan
    return y


def drawn(figure: Callable[..., Markup | None]) -> Callable[..., Markup | None]:
    """A figure function that never breaks the report: values that pass the records' schema yet cannot be drawn
    (an axis matplotlib cannot scale) give a line saying that figure was not drawn, and why, in its place."""
    @functools.wraps(figure)
    def draw(*args: Any, **kwargs: Any) -> Markup | None:
        try:
            return figure(*args, **kwargs)
        except (OverflowError, ValueError, FloatingPointError) as exc:
            plt.close("all")
            return Markup('<p class="note">This figure was not drawn: the records hold values it cannot show '
                          "({}).</p>").format(f"{type(exc).__name__}: {exc}"[:200])
    return draw


def to_svg(fig: plt.Figure, title: str) -> Markup:
    """The figure as inline SVG markup (ids made unique, fixed size attributes replaced by a responsive width).

    matplotlib escapes the text it draws; `title` goes into an attribute here, so it is escaped here.
    """
    buf = io.StringIO()
    fig.savefig(buf, format="svg")  # tight_layout has placed everything: no second layout pass
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    prefix = f"f{next(_ids)}-"
    ids = set(re.findall(r'\bid="([^"]+)"', text))
    text = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}{m.group(1)}"', text)
    text = re.sub(r'(href|xlink:href)="#([^"]+)"',
                  lambda m: f'{m.group(1)}="#{prefix}{m.group(2)}"' if m.group(2) in ids else m.group(0), text)
    text = re.sub(r"url\(#([^)]+)\)",
                  lambda m: f"url(#{prefix}{m.group(1)})" if m.group(1) in ids else m.group(0), text)
    text = re.sub(r'<svg([^>]*?)\swidth="[^"]*"\sheight="[^"]*"',
                  lambda m: f'<svg{m.group(1)} class="figure" role="img" aria-label="{escape(title)}"', text, count=1)
    return Markup(text)


def binned(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean, min, max) of `y` over at most `max_points` consecutive bins (the data itself when short)."""
    if len(y) <= max_points:
        return x, y, y, y
    edges = np.linspace(0, len(y), max_points + 1).astype(int)
    xs, mean, lo, hi = [], [], [], []
    for a, b in itertools.pairwise(edges):
        if b > a:
            seg = y[a:b]
            xs.append(x[a:b].mean())
            mean.append(seg.mean())
            lo.append(seg.min())
            hi.append(seg.max())
    return np.asarray(xs), np.asarray(mean), np.asarray(lo), np.asarray(hi)


def decimated(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a line reduced to about `max_points` points that keep its envelope: of each of `max_points // 2`
    consecutive bins, the points of its smallest and its largest value, in order, so a spike of one evaluation is
    still drawn (the data itself when short; non-finite values are left to the caller)."""
    n = len(y)
    if n <= max_points:
        return x, y
    edges = np.linspace(0, n, max_points // 2 + 1).astype(int)
    starts = edges[:-1][np.diff(edges) > 0]
    filled = np.where(np.isnan(y), np.inf, y)
    lo = np.array([a + int(np.argmin(filled[a:b])) for a, b in zip(starts, [*starts[1:], n])])
    filled = np.where(np.isnan(y), -np.inf, y)
    hi = np.array([a + int(np.argmax(filled[a:b])) for a, b in zip(starts, [*starts[1:], n])])
    keep = np.unique(np.concatenate([lo, hi, [0, n - 1]]))
    return x[keep], y[keep]


def rolling_mean(y: np.ndarray, window: int) -> np.ndarray:
    """Centred rolling mean over `window` points (odd), narrowing symmetrically at the ends: no lag, no end bias."""
    y = np.asarray(y, dtype=np.float64)
    if window <= 1 or len(y) == 0:
        return y
    idx = np.arange(len(y))
    half = np.minimum.reduce([np.full(len(y), window // 2), idx, len(y) - 1 - idx])  # symmetric at both ends
    c = np.cumsum(np.insert(y, 0, 0.0))
    lo, hi = idx - half, idx + half + 1
    return (c[hi] - c[lo]) / (hi - lo)


def smoothing_window(n: int) -> int:
    """Rolling-mean window for a curve of n steps: n/25, at least 5 (fewer for very short curves), at most 200."""
    return int(min(200, max(1, min(5, n // 4), n // 25)))


@drawn
def loss_figure(view: RunView) -> Markup | None:
    """Training loss per step (left) and evaluation train/validation loss (right), every backend overlaid."""
    if not any(len(step_losses(r)[1]) or len(r.curves.evals) for r in view.records):
        return None
    with plt.rc_context(RC):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
        for rec in view.records:
            name, c = plain(rec.backend), color(rec.backend)
            steps, loss = step_losses(rec)
            loss = plottable(loss)
            finite = np.isfinite(loss)
            if finite.any():
                steps, loss = steps[finite], loss[finite]
                x, _, lo, hi = binned(steps, loss)
                if len(x) < len(loss):
                    ax1.fill_between(x, lo, hi, color=c, alpha=0.18, linewidth=0)
                else:
                    ax1.plot(steps, loss, color=c, lw=0.6, alpha=0.35)
                w = smoothing_window(len(loss))
                xr, mr, _, _ = binned(steps, rolling_mean(loss, w))
                ax1.plot(xr, mr, color=c, lw=1.6, label=f"{name} (rolling mean over {w} steps)" if w > 1 else name)
            evals = rec.curves.evals
            if len(evals):
                es, train, val = eval_columns(evals)
                ms = 3 if len(evals) <= 60 else 0  # markers only where they can be told apart
                ax2.plot(*decimated(es, plottable(train)), "--", marker="o", ms=ms, color=c, lw=1.2,
                         label=f"{name} train")
                ax2.plot(*decimated(es, plottable(val)), "-", marker="s", ms=ms, color=c, lw=1.6,
                         label=f"{name} validation")
        ax1.set(title="Training loss per step", xlabel="step", ylabel="cross-entropy (nats)")
        ax2.set(title="Evaluation on the fixed batches", xlabel="step")
        for ax in (ax1, ax2):
            if ax.has_data():
                ax.legend(fontsize=8)
        if not any(len(rec.curves.evals) for rec in view.records):
            ax2.text(0.5, 0.5, "no evaluation points recorded", ha="center", va="center", transform=ax2.transAxes)
        fig.tight_layout()
        return to_svg(fig, "loss curves")


@drawn
def deviation_figure(comparisons: list[PairComparison]) -> Markup | None:
    """|loss_a - loss_b| per common step with its rolling mean, log scale, one colour per pair."""
    shown = [c for c in comparisons if c.abs_dev.size]
    if not shown:
        return None
    with plt.rc_context(RC):
        fig, ax = plt.subplots(figsize=(11, 3.6))
        devs = [plottable(c.abs_dev) for c in shown]
        positive = np.concatenate([d[(d > 0) & np.isfinite(d)] for d in devs])
        floor = float(positive.min()) / 10 if positive.size else 1e-12
        any_zero = False
        for i, (cmp, dev) in enumerate(zip(shown, devs)):
            col = plt.get_cmap("tab10")(i % 10)
            finite = np.isfinite(dev)
            steps, dev = cmp.common_steps[finite], dev[finite]
            if not dev.size:
                continue
            any_zero |= bool((dev == 0).any())
            x, m, lo, hi = binned(steps, np.where(dev > 0, dev, floor))
            ax.fill_between(x, lo, hi, color=col, alpha=0.15, linewidth=0)
            ax.plot(x, m, color=col, lw=0.6, alpha=0.5)
            w = smoothing_window(len(dev))
            roll = rolling_mean(dev, w)
            xr, mr, _, _ = binned(steps, np.where(roll > 0, roll, floor))
            ax.plot(xr, mr, color=col, lw=1.8, label=plain(f"{cmp.a} vs {cmp.b}") + f": rolling mean over {w} steps")
        ax.set_yscale("log")
        note = f" (exact zeros drawn at {floor:.0e})" if any_zero else ""
        ax.set(title="Absolute per-step training-loss difference" + note, xlabel="step", ylabel="|Δ loss| (nats)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        return to_svg(fig, "per-step loss deviation")


@drawn
def cost_figure(view: RunView) -> Markup | None:
    """Steady step time (median, p10-p90), tokens/s and peak memory, one bar per backend."""
    if not view.records:
        return None
    names = [r.backend for r in view.records]
    cs = [costs(r) for r in view.records]
    cols = [color(n) for n in names]
    with plt.rc_context(RC):
        fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
        x = np.arange(len(names))

        def bars(ax: plt.Axes, values: list[float | None], title: str, unit: str,
                 err: list[tuple[float, float]] | None = None) -> None:
            values = [None if v is None or not abs(v) <= PLOT_MAX else v for v in values]
            vals = [v if v is not None else 0.0 for v in values]
            yerr = None
            if err is not None:
                yerr = np.array([[max(0.0, v - lo), max(0.0, hi - v)] for v, (lo, hi) in zip(vals, err)]).T
            ax.bar(x, vals, color=cols, yerr=yerr, capsize=4, width=0.6)
            for xi, v in zip(x, values):
                label = "n/a" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.3g}"
                ax.annotate(label, (xi, v or 0.0), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                            textcoords="offset points")
            ax.set_xticks(x, [plain(n) for n in names])
            ax.set_xlim(-0.5 - 0.3 * max(0, 3 - len(names)), len(names) - 0.5 + 0.3 * max(0, 3 - len(names)))
            ax.margins(y=0.12)
            ax.set(title=title, ylabel=unit)
            ax.grid(axis="x", visible=False)

        med = [c.step_median_s * 1e3 if c.step_median_s else None for c in cs]
        err = [((c.step_p10_s or 0) * 1e3, (c.step_p90_s or 0) * 1e3) if c.step_median_s else (0.0, 0.0)
               for c in cs]
        bars(axes[0], med, "Steady step time (median, p10–p90)", "ms / step", err)
        bars(axes[1], [c.tokens_per_s for c in cs], "Training throughput", "tokens / s")
        kinds = {c.memory_kind for c in cs if c.memory_kind}
        kind = {"device": "device memory", "rss": "process RSS"}
        mem_label = " / ".join(kind.get(k, k) for k in sorted(kinds)) or "memory"
        bars(axes[2], [c.peak_bytes / 2**20 if c.peak_bytes else None for c in cs],
             f"Peak memory ({mem_label})", "MiB")
        fig.tight_layout()
        return to_svg(fig, "throughput and memory")


@drawn
def scaling_figure(views: list[RunView]) -> Markup | None:
    """Median step time and tokens/s against parameter count, one line per backend, across the report's runs."""
    series: dict[str, list[tuple[int, float, float, float, float, str]]] = {}
    for view in views:
        for rec in view.records:
            c = costs(rec)
            if c.n_params and c.step_median_s and c.tokens_per_s:
                series.setdefault(rec.backend, []).append(
                    (c.n_params, c.step_median_s, c.step_p10_s or c.step_median_s,
                     c.step_p90_s or c.step_median_s, c.tokens_per_s, view.label))
    if not series:
        return None
    with plt.rc_context(RC):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
        for name, pts in series.items():
            pts.sort()
            n = np.array([p[0] for p in pts], dtype=float)
            med = np.array([p[1] for p in pts]) * 1e3
            lo = med - np.array([p[2] for p in pts]) * 1e3
            hi = np.array([p[3] for p in pts]) * 1e3 - med
            ax1.errorbar(n, med, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], marker="o", color=color(name),
                         capsize=3, label=plain(name))
            ax2.plot(n, [p[4] for p in pts], marker="o", color=color(name), label=plain(name))
            for p in pts:
                ax2.annotate(plain(p[5]), (p[0], p[4]), fontsize=8, xytext=(4, 4), textcoords="offset points")
        ax1.set(xscale="log", yscale="log", title="Steady step time (median, p10–p90)", xlabel="parameters",
                ylabel="ms / step")
        ax2.set(xscale="log", yscale="log", title="Training throughput", xlabel="parameters", ylabel="tokens / s")
        for ax in (ax1, ax2):
            ax.legend(fontsize=8)
        fig.tight_layout()
        return to_svg(fig, "scaling with model size")
