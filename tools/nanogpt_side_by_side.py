#!/usr/bin/env python3
"""The CPU side-by-side of docs/nanogpt.md: validation-loss curves and a table from harness records and nanoGPT logs.

Reads the torch record (`runs/*/torch.json`) of each `harness run --out DIR` and the `step N: train loss X, val
loss Y` lines of each log of nanoGPT's train.py, one per seed, for up to three programs (the harness with attention
dropout, without it, nanoGPT). Prints a Markdown table (best and final validation loss per seed, with the step of
the best; the mean and the seed standard deviation of each; how far each harness variant's mean is from nanoGPT's
and whether their seed ranges overlap) and writes an SVG of the curves:

    python tools/nanogpt_side_by_side.py --harness-on A1 A2 A3 --harness-off B1 B2 B3 \\
        --nanogpt n1.log n2.log n3.log --seeds 1337,1338,1339 --svg docs/figures/nanogpt-attn-dropout.svg
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the harness of this checkout, also where it is not installed
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss ([0-9.]+), val loss ([0-9.]+)$")
Curve = list[tuple[int, float]]  # (step, validation loss)


def harness_curve(out_dir: Path) -> Curve:
    """The validation losses of the one torch record under a `harness run --out` directory (read by the store)."""
    from harness.errors import UsageError
    from harness.store import RunPaths, RunRecord

    records = [p.record("torch") for p in RunPaths.under(out_dir) if p.record("torch").is_file()]
    if len(records) != 1:
        sys.exit(f"{out_dir}: expected one runs/*/torch.json, found {len(records)}")
    try:
        record = RunRecord.load(records[0])
    except UsageError as exc:
        sys.exit(str(exc))
    if record.status.value != "completed":
        sys.exit(f"{records[0]}: the run is {record.status.value!r}, not completed")
    return [(int(e.step), float(e.val_loss)) for e in record.curves.evals]


def nanogpt_curve(log: Path) -> Curve:
    """The validation losses nanoGPT's train.py printed at each evaluation."""
    curve = [(int(m[1]), float(m[3])) for m in map(NANOGPT_EVAL.match, log.read_text().splitlines()) if m]
    if not curve:
        sys.exit(f"{log}: no 'step N: train loss X, val loss Y' line (not a log of nanoGPT's train.py?)")
    return curve


def summary(curves: list[Curve]) -> dict[str, list[float]]:
    """Per seed: the best validation loss, its step, the final one."""
    best = [min(c, key=lambda e: e[1]) for c in curves]
    return {"best": [b[1] for b in best], "best_step": [b[0] for b in best], "final": [c[-1][1] for c in curves]}


def spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.mean(values):.4f} ± {sd:.4f}"


def table(programs: dict[str, list[Curve]], seeds: list[str]) -> str:
    """The Markdown table: one row per program and seed, then the mean ± seed sd, then each against nanoGPT."""
    rows = ["| program | seed | best val loss (step) | final val loss |", "|---|---|---|---|"]
    stats = {name: summary(curves) for name, curves in programs.items()}
    for name, s in stats.items():
        for i, seed in enumerate(seeds[:len(s["best"])]):
            rows.append(f"| {name} | {seed} | {s['best'][i]:.4f} ({s['best_step'][i]}) | {s['final'][i]:.4f} |")
        rows.append(f"| {name} | mean ± sd | {spread(s['best'])} | {spread(s['final'])} |")
    reference = next((n for n in stats if n.startswith("nanoGPT")), None)
    if reference is not None:
        rows += ["", "| against nanoGPT | best: difference of means (seed ranges overlap?) | final: the same |",
                 "|---|---|---|"]
        for name, s in stats.items():
            if name == reference:
                continue
            cells = []
            for key in ("best", "final"):
                a, b = s[key], stats[reference][key]
                overlap = max(min(a), min(b)) <= min(max(a), max(b))
                cells.append(f"{statistics.mean(a) - statistics.mean(b):+.4f} ({'yes' if overlap else 'no'})")
            rows.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(rows)


def figure(programs: dict[str, list[Curve]], path: Path, title: str) -> None:
    """Validation loss against step, one line per seed, one colour per program; right: the last half enlarged."""
    colors = ["#1f77b4", "#d62728", "#2ca02c"]
    matplotlib.rcParams["svg.hashsalt"] = "nanogpt-side-by-side"  # the same SVG from the same numbers
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for color, (name, curves) in zip(colors, programs.items()):
        for i, curve in enumerate(curves):
            steps, losses = zip(*curve)
            for ax in axes:
                ax.plot(steps, losses, color=color, lw=1.2, alpha=0.85, label=name if i == 0 else None)
    last = max(c[-1][0] for curves in programs.values() for c in curves)
    tail = [v for curves in programs.values() for c in curves for s, v in c if s >= last // 2]
    axes[1].set_xlim(last // 2, last)
    axes[1].set_ylim(min(tail) - 0.01, max(tail) + 0.01)
    for ax, sub in zip(axes, ("", " (second half)")):
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.set_title(title + sub, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Read the runs, print the table, write the figure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--harness-on", nargs="+", type=Path, default=[], metavar="OUT_DIR")
    parser.add_argument("--harness-off", nargs="+", type=Path, default=[], metavar="OUT_DIR")
    parser.add_argument("--nanogpt", nargs="+", type=Path, default=[], metavar="LOG")
    parser.add_argument("--seeds", default="", help="the seeds, comma-separated, in the order of the runs")
    parser.add_argument("--svg", type=Path, help="write the figure here")
    parser.add_argument("--title", default="validation loss, one line per seed")
    args = parser.parse_args(argv)
    programs = {name: curves for name, curves in (
        ("harness, attn_dropout on", [harness_curve(d) for d in args.harness_on]),
        ("harness, attn_dropout off", [harness_curve(d) for d in args.harness_off]),
        ("nanoGPT train.py", [nanogpt_curve(log) for log in args.nanogpt])) if curves}
    if not programs:
        parser.error("name some runs: --harness-on, --harness-off, --nanogpt")
    seeds = args.seeds.split(",") if args.seeds else [str(i + 1) for i in range(max(map(len, programs.values())))]
    print(table(programs, seeds))
    if args.svg:
        figure(programs, args.svg, args.title)
        print(f"figure: {args.svg}", file=sys.stderr)


if __name__ == "__main__":
    main()
