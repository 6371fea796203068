"""The page of a `harness bench parts` record: `<out>/bench/<id>.html` beside the record, self-contained (inline
SVG, no script), built with Jinja2 from harness/report/templates/parts.html.j2: the diagnosis of every pair, one
stacked bar per backend (where its step's time goes) and the table (ms with the interval of the median, share of
the step, FLOP/s, the ratio to the first backend with its interval, kernels per call on CUDA). `harness report ID`
rebuilds it from the record.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from markupsafe import Markup

import harness
from harness import pages
from harness.bench.parts_analysis import label, ratio_cell, summary
from harness.core.parts import KINDS, MEANING, OPTIMIZER, REST, STEP, kind, split_item
from harness.store import atomic_write_bytes
from harness.store.parts import PartsRecord, record_path
from harness.timing import contention


def notes(record: PartsRecord, s: dict) -> list[str]:
    """What the table needs said beside it: the rounds used, each backend's set-up and compile time (reported apart,
    in no figure), its clock and its overhead row's share, the load, launch-bound parts."""
    r = s["rounds"]
    used = "undisturbed" if r["usable"] else "all (too few undisturbed: no verdict)"
    lines = [f"rounds: {r['total']} made, {r['clean']} undisturbed, {r['disturbed']} disturbed (left out); figures "
             f"from {r['used']} {used} rounds; ms per call, median over the rounds [95 % interval]"]
    if record.stopped:  # no verdict could come any more
        lines.append(f"rounds {record.stopped}")
    for c in record.contenders:
        ready = c.ready
        if ready is None:
            lines.append(f"{c.name}: not set up")
            continue
        compiled = f", JIT compilation {ready.compile_s:.1f} s" if ready.compile_s else ""
        rest = s["rest_share"].get(c.name)
        lines.append(f"{c.name} on {c.device}: set up in {ready.setup_s or 0:.1f} s{compiled} "
                     f"(apart: in no figure); {ready.clock}; fusion and framework overhead "
                     f"{'-' if rest is None or not math.isfinite(rest) else f'{rest:+.1%}'} of the step")
    env = record.environment
    if env.loadavg_start is not None:
        lines.append(f"load average {env.loadavg_start:.2f} at the start, {env.loadavg_end or 0:.2f} at "
                     f"the end, on {env.cores} usable cores")
    bound = []
    for n, t in s["tables"].items():
        counted = [row for row, v in t.items() if v.get("launches")]
        rows = [row for row in counted if t[row]["launches"]["launch_bound"]]
        if len(rows) > 5:  # most of them: say which are not
            rest = [label(row) for row in counted if row not in rows]
            bound.append(f"{n}: {len(rows)} of {len(counted)} rows" + (f" (all but {', '.join(rest)})" if rest else ""))
        elif rows:
            bound.append(f"{n}: {', '.join(label(row) for row in rows)}")
    if bound:
        lines.append("* launch-bound on CUDA (its kernels keep the GPU busy under half its time): " + "; ".join(bound))
    if not record.all_parts:
        lines.append(f"only the parts {', '.join(record.options.parts or [])} were timed: the overhead row "
                     "holds the others too")
    return lines


def _segments(table: dict) -> list[tuple[str, float]]:
    """(kind, ms) per part kind (forward and backward together), the optimizer and the overhead, in forward order."""
    totals: dict[str, float] = {}
    for row, v in table.items():
        part, direction = split_item(row)
        if direction is None:
            continue
        totals[kind(part)] = totals.get(kind(part), 0.0) + v["median_s"] * 1e3
    out = [(k, totals[k]) for k in KINDS if k in totals]
    return [*out, (OPTIMIZER, table[OPTIMIZER]["median_s"] * 1e3), (REST, table[REST]["median_s"] * 1e3)]


def bars(record: PartsRecord, s: dict) -> Markup | None:
    """One stacked horizontal bar per backend: its parts (forward and backward), the optimizer and a positive
    overhead, a tick at its measured step."""
    from harness.report.figures import RC, drawn, plt, to_svg

    @drawn
    def figure() -> Markup | None:
        names = record.names
        segs = {n: _segments(s["tables"][n]) for n in names}
        kinds = [k for k, _ in segs[names[0]]]
        cmap = plt.get_cmap("tab20")
        with plt.rc_context(RC):
            fig, ax = plt.subplots(figsize=(11, max(2.6, 1.0 + 0.6 * len(names))))
            shown: set[str] = set()  # each kind labelled once, wherever it first appears
            for y, n in enumerate(names):
                left = 0.0
                for i, (k, ms) in enumerate(segs[n]):
                    if (k == REST and ms <= 0) or not math.isfinite(ms):
                        continue
                    ax.barh(y, ms, left=left, color="#ced4da" if k == REST else cmap(i % 20),
                            hatch="//" if k == REST else None, edgecolor="white", linewidth=0.5,
                            label=None if k in shown else k if k != REST else "fusion and framework overhead "
                            "(positive)")
                    shown.add(k)
                    left += ms
                step = s["tables"][n][STEP]["median_s"] * 1e3
                ax.plot([step, step], [y - 0.42, y + 0.42], color="black", linewidth=2)
                ax.annotate(f"step {step:.3g} ms", (max(step, left), y), xytext=(4, 0), textcoords="offset points",
                            va="center", fontsize=8)
            ax.set_yticks(range(len(names)), names)
            ax.invert_yaxis()
            ax.set(xlabel="ms per training step", title="Where the time of a step goes (black tick: the measured "
                   "step; parts beyond it: fused away)")
            ax.legend(fontsize=7, ncol=2 if len(kinds) > 9 else 1, loc="center left", bbox_to_anchor=(1.01, 0.5))
            ax.grid(axis="y", visible=False)
            fig.tight_layout()
            return to_svg(fig, "where the time of a step goes")
    return figure()


def _cell(v: dict) -> dict[str, Any]:
    ms = v["median_s"] * 1e3
    lo, hi = v.get("lo_s"), v.get("hi_s")
    launches = v.get("launches") or {}
    return {"ms": f"{ms:.3f}" if math.isfinite(ms) else "-",
            "ci": f"[{lo * 1e3:.3f}, {hi * 1e3:.3f}]" if lo is not None and hi is not None else "",
            "share": "" if v["share"] is None else f"{v['share']:.1%}",
            "gflops": f"{v['flops_per_s'] / 1e9:.3g}" if v.get("flops_per_s") else "",
            "kernels": launches.get("kernels", launches.get("ops", "")) if launches else "",
            "bound": bool(launches.get("launch_bound"))}


def page_model(record: PartsRecord, per_block: bool, s: dict | None = None) -> dict[str, Any]:
    """What the template shows; `s`: the record's summary where the caller has it (computed here otherwise)."""
    s = s if s is not None else summary(record, per_block)
    names = record.names
    rows = []
    for row in s["rows"]:
        part, direction = split_item(row)
        cells = []
        for i, n in enumerate(names):
            c = _cell(s["tables"][n][row])
            c["ratio"] = ratio_cell(s["ratios"][n].get(row)) if i else ""
            cells.append(c)
        rows.append({"label": label(row), "meaning": MEANING.get(kind(part), ""), "cells": cells,
                     "total": direction is None})
    kernels = any(c["kernels"] != "" for r in rows for c in r["cells"])
    pairs = [{**p, "level": level(p, s["rounds"]["usable"])} for p in s["pairs"]]
    return {"names": names, "rows": rows, "pairs": pairs, "notes": notes(record, s), "figure": bars(record, s),
            "kernels": kernels, "usable": s["rounds"]["usable"], "rule": contention.RULE_SENTENCE}


def level(pair: dict, usable: bool) -> str:
    """A diagnosis's level in the one palette by meaning (harness.pages): a difference with a verdict OK, none
    NEUTRAL, a figure from disturbed rounds WARN (a caveat)."""
    if not usable:
        return pages.WARN
    return pages.OK if pair["conclusive"] else pages.NEUTRAL


def write_page(record: PartsRecord, out: Path, per_block: bool = False, s: dict | None = None) -> Path:
    """Write the record's page beside it and return its path; `s`: its summary where the caller has it."""
    from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

    env = Environment(loader=PackageLoader("harness.report", "templates"), autoescape=select_autoescape(
        enabled_extensions=("html", "j2"), default_for_string=True, default=True), undefined=StrictUndefined,
        trim_blocks=True, lstrip_blocks=True)
    env.filters["inline"] = pages.inline
    env.globals["palette_css"] = pages.css()  # the reports' stylesheet (style.css) opens with the palette
    model = page_model(record, per_block, s) if record.rounds else None
    c = record.config
    title = f"nanogpt-parity: where the time goes — {record.options.size}, {', '.join(record.names)}"
    page = env.get_template("parts.html.j2").render(
        title=title, record=record, model=model, version=harness.__version__, shape=(
            f"{c.n_layer} block(s), n_embd {c.n_embd}, batch {c.batch_size} × {c.block_size} tokens, dropout "
            f"{c.dropout}"),
        generated=time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()))
    path = record_path(out, record.id).with_suffix(".html")
    atomic_write_bytes(path, page.encode("utf-8"))
    return path
