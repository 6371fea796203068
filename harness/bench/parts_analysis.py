"""What a parts record says (harness.store.parts.PartsRecord): per backend the time of every part, forward and backward,
the optimizer, the "fusion and framework overhead" row and the whole step, with 95 % intervals; the ratio of each
part to the first backend's; FLOP/s; launch-bound parts on CUDA; and one line per pair of backends naming the parts
that make up most of the difference in their steps.

Pure: it reads the record and computes. The rounds used are the undisturbed ones (harness.timing.contention's rule,
judged per burst as the paired timing judges them), or every round, marked, when too few are undisturbed.

- A part's time is the median over the rounds of its seconds per call, with a bootstrap 95 % interval of that
  median (harness.timing.stats.median_ci). The "fusion and framework overhead" row is the step's median minus the
  sum of the parts' medians (the table adds up to the step exactly); its interval is the bootstrap interval of the
  per-round differences. With a --parts filter it also holds the parts not timed.
- The ratio of a part to the first backend's is the geometric mean of the per-round ratios with a Student-t interval
  on their logarithms (harness.timing.stats.geometric_mean_ci), as every speed ratio of the harness.
- The diagnosis of a pair: the whole step's ratio with its interval; per row the mean per-round difference (slower
  minus faster) with a Student-t interval (stats.paired_difference); the rows whose interval lies above 0, largest
  first, until they make up `MOST` of the mean step difference (at most `NAMED` rows). A row whose interval
  includes 0 (no difference) is never named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.core.parts import REST, STEP, split_item, summed
from harness.store.parts import PartsRecord, PartsRound
from harness.timing import paired, stats
from harness.units import text_table

MOST = 0.8  # the diagnosis names rows until they make up this share of the difference
NAMED = 3  # ... and at most this many
LAUNCH_BOUND_BUSY = 0.5  # on CUDA a part whose kernels keep the GPU busy less than this share of its time
SHORT = {"forward": "fwd", "backward": "bwd"}


@dataclass
class Rounds:
    """The rounds the figures come from: undisturbed ones when there are enough (`usable`), else every round."""

    used: list[PartsRound]
    total: int
    clean: int
    usable: bool

    @property
    def disturbed(self) -> int:
        return self.total - self.clean


def rounds_used(record: PartsRecord) -> Rounds:
    """Rounds holding every contender's burst; undisturbed ones where enough are (harness.timing.paired.usable)."""
    names = record.names
    full = [r for r in record.rounds if all(n in r.bursts for n in names)]
    clean = [r for r in full if paired.round_clean(r)]
    ok = paired.usable(len(clean), record.plan.rounds)
    return Rounds(clean if ok else full, len(full), len(clean), ok)


def row_of(key: str, per_block: bool) -> str:
    """The table row an item belongs to: itself per block, its summed name ("h.*.attn.probs/forward") otherwise."""
    part, direction = split_item(key)
    if direction is None or per_block:
        return key
    return f"{summed(part)}/{direction}"


def label(row: str) -> str:
    """A row in words: "h.*.attn.probs backward", "optimizer"."""
    part, direction = split_item(row)
    return part if direction is None else f"{part} {direction}"


def row_keys(record: PartsRecord, per_block: bool = False) -> list[str]:
    """The table's rows in the order a step runs them: the parts' forwards, their backwards, the optimizer, the
    fusion and framework overhead, the step."""
    rows = list(dict.fromkeys(row_of(k, per_block) for k in record.items if k not in (STEP,)))
    return [*rows, REST, STEP]


def series(record: PartsRecord, name: str, used: list[PartsRound], per_block: bool = False
           ) -> dict[str, np.ndarray]:
    """Per row, the seconds per call of contender `name` in each used round (a summed row: the sum over blocks;
    REST: the step minus every timed item)."""
    rows = row_keys(record, per_block)
    out = {r: np.zeros(len(used)) for r in rows}
    for j, rnd in enumerate(used):
        times = rnd.bursts[name].times
        parts_sum = 0.0
        for key, value in times.items():
            v = float(value) if value is not None else math.nan
            if key == STEP:
                out[STEP][j] = v
                continue
            out[row_of(key, per_block)][j] += v
            parts_sum += v
        out[REST][j] = out[STEP][j] - parts_sum
    return out


def _flops(record: PartsRecord, row: str) -> float | None:
    """FLOPs per step of a row (summed over its blocks), None where the model of the cost has none."""
    part, direction = split_item(row)
    tokens = record.tokens_per_step
    if row == STEP:
        return float(record.flops_per_token * tokens) if record.flops_per_token else None
    if direction is None:
        return None
    total = sum(f.get(direction, 0) for p, f in record.flops.items() if p == part or summed(p) == part)
    return float(total * tokens) if total else None


def _launches(record: PartsRecord, name: str, row: str, per_block: bool) -> dict | None:
    """Kernels per call of a row and their GPU time (summed over its blocks), where the runner counted them."""
    ready = record.contender(name).ready
    counted = ready.launches if ready is not None else {}
    keys = [k for k in counted if row_of(k, per_block) == row]
    if not keys or not all("kernels" in counted[k] for k in keys):
        return None
    return {"kernels": sum(int(counted[k]["kernels"]) for k in keys),
            "kernel_us": sum(float(counted[k].get("kernel_us") or 0.0) for k in keys)}


def contender_table(record: PartsRecord, name: str, used: list[PartsRound], per_block: bool = False
                    ) -> dict[str, dict]:
    """Per row of contender `name`: median seconds per call with its interval, share of the step, FLOP/s, and on
    CUDA kernels per call and whether the row is launch-bound."""
    s = series(record, name, used, per_block)
    out = {}
    for row, values in s.items():
        finite = [float(v) for v in values if math.isfinite(v)]
        med = float(np.median(finite)) if finite else math.nan
        ci = stats.median_ci(finite)
        out[row] = {"median_s": med, "lo_s": ci[0] if ci else None, "hi_s": ci[1] if ci else None}
    parts_total = sum(v["median_s"] for r, v in out.items() if r not in (REST, STEP))
    step = out[STEP]["median_s"]
    out[REST]["median_s"] = step - parts_total  # the table adds up to the step
    for row, v in out.items():
        v["share"] = v["median_s"] / step if step else None
        flops = _flops(record, row)
        v["flops_per_s"] = flops / v["median_s"] if flops and v["median_s"] > 0 else None
        launches = _launches(record, name, row, per_block)
        if launches:
            busy = launches["kernel_us"] / (v["median_s"] * 1e6) if v["median_s"] > 0 else None
            launches.update(busy=busy, launch_bound=bool(launches["kernels"] and busy is not None
                                                          and busy < LAUNCH_BOUND_BUSY))
            v["launches"] = launches
    return out


def ratio_table(record: PartsRecord, a: str, b: str, used: list[PartsRound], per_block: bool = False
                ) -> dict[str, dict | None]:
    """Per row, b's time over a's: the geometric mean of the per-round ratios with its t interval (REST: none,
    it can be negative)."""
    sa, sb = series(record, a, used, per_block), series(record, b, used, per_block)
    out = {}
    for row in sa:
        pairs = [(x, y) for x, y in zip(sa[row], sb[row]) if x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y)]
        if row == REST or not pairs:
            out[row] = None
            continue
        ci = stats.paired_ratio([y for _, y in pairs], [x for x, _ in pairs])
        out[row] = {"ratio": ci.estimate, "lo": ci.lo, "hi": ci.hi, "n": ci.n}
    return out


def ratio_cell(q: dict | None) -> str:
    """A row's ratio to the first contender as the table and the page show it: "1.23 [1.10, 1.37]" ("" for none)."""
    if not q:
        return ""
    return f"{q['ratio']:.2f} [{q['lo']:.2f}, {q['hi']:.2f}]" if q["lo"] is not None else f"{q['ratio']:.2f}"


def _ms(s: float) -> str:
    return f"{s * 1e3:+.3g} ms"


def _difference(d: dict) -> str:
    """"+0.81 ms [+0.70, +0.92]": a row's mean difference and its interval."""
    return f"{_ms(d['mean_s'])} [{d['lo_s'] * 1e3:+.3g}, {d['hi_s'] * 1e3:+.3g}]"


def _bound(tables: dict | None, name: str, row: str) -> str:
    """", launch-bound: 12 kernels, GPU busy 8 %" for a row of contender `name` its kernel counts call
    launch-bound (on CUDA), else ""."""
    launches = ((tables or {}).get(name, {}).get(row) or {}).get("launches") or {}
    if not launches.get("launch_bound"):
        return ""
    return f", launch-bound: {launches['kernels']} kernels, GPU busy {launches['busy']:.0%}"


def diagnose(record: PartsRecord, a: str, b: str, used: list[PartsRound], usable: bool = True,
             tables: dict | None = None) -> dict:
    """The one-line diagnosis of the pair (a, b) (see the module docstring): {"line", "slow", "fast", "ratio", "lo",
    "hi", "conclusive", "named": [{"row", "share", "mean_s", "lo_s", "hi_s"}]}. `tables` (contender_table of each):
    a named row that is launch-bound in the slower one says so."""
    sa, sb = series(record, a, used), series(record, b, used)
    step = stats.paired_ratio(list(sb[STEP]), list(sa[STEP])) if len(used) else None
    out: dict[str, Any] = {"a": a, "b": b, "named": [], "ratio": None, "lo": None, "hi": None, "conclusive": False}
    if step is None:
        out["line"] = f"{a} vs {b}: no round holds both"
        return out
    w = paired.speed_words({"ratio": step.estimate, "lo": step.lo, "hi": step.hi}, b, a)  # b's time over a's
    slow, fast, x, lo, hi, conclusive = w["slow"], w["fast"], w["x"], w["lo"], w["hi"], w["conclusive"]
    out.update(slow=slow, fast=fast, ratio=x, lo=lo, hi=hi, conclusive=conclusive)
    ss, sf = (sb, sa) if slow == b else (sa, sb)
    interval = f" [{lo:.3g}, {hi:.3g}]" if lo is not None and hi is not None else " (one round: no interval)"
    head = f"{slow} {x:.3g}× slower than {fast}{interval}"
    diffs = _row_differences(ss, sf)
    if conclusive:
        out["named"] = _named(diffs, float(np.mean(ss[STEP] - sf[STEP])))
        named = [f"{n['share']:.0%} {'of the difference is ' if i == 0 else ''}{label(n['row'])} "
                 f"({_difference(n)}{_bound(tables, slow, n['row'])})" for i, n in enumerate(out["named"])]
        line = f"{head}: " + (", ".join(named) if named else "no part's difference is clear on its own")
        if sum(n["share"] for n in out["named"]) > 1.1:  # more than the whole difference: others go the other way
            line += f"; parts where {slow} is faster offset the excess"
    else:
        line = f"{slow} and {fast}: no clear difference in the whole step ({x:.3g}×{interval})"
        both = sorted((d for d in diffs if d["lo_s"] is not None and (d["lo_s"] > 0 or d["hi_s"] < 0)),
                      key=lambda d: -abs(d["mean_s"]))[:2]
        if both:
            line += "; parts that differ: " + ", ".join(f"{label(d['row'])} ({slow} {_difference(d)})" for d in both)
    if not usable:
        line = f"no verdict, most rounds were disturbed (all rounds say: {line})"
    out["line"] = line
    return out


def _row_differences(slow: dict[str, np.ndarray], fast: dict[str, np.ndarray]) -> list[dict]:
    """Per row but the step: the mean per-round difference slow - fast with its t interval."""
    out = []
    for row in slow:
        if row == STEP:
            continue
        pairs = [(float(x), float(y)) for x, y in zip(slow[row], fast[row]) if math.isfinite(x) and math.isfinite(y)]
        if not pairs:
            continue
        ci = stats.paired_difference([x for x, _ in pairs], [y for _, y in pairs])
        out.append({"row": row, "mean_s": ci.estimate, "lo_s": ci.lo, "hi_s": ci.hi})
    return out


def _named(diffs: list[dict], total: float) -> list[dict]:
    """The rows that make up most of a positive step difference `total`: interval above 0, largest first."""
    if total <= 0:
        return []
    named, share = [], 0.0
    for d in sorted((d for d in diffs if d["lo_s"] is not None and d["lo_s"] > 0), key=lambda d: -d["mean_s"]):
        named.append({**d, "share": d["mean_s"] / total})
        share += d["mean_s"] / total
        if share >= MOST or len(named) >= NAMED:
            break
    return named


def summary(record: PartsRecord, per_block: bool = False) -> dict:
    """Everything the table, the page and the record's readers show: the rounds used, per contender its rows, per
    other contender its ratios to the first, the diagnosis of every pair, and per contender the rest's share of
    the step."""
    r = rounds_used(record)
    names = record.names
    tables = {n: contender_table(record, n, r.used, per_block) for n in names}
    ratios = {n: ratio_table(record, names[0], n, r.used, per_block) for n in names[1:]}
    pairs = [diagnose(record, a, b, r.used, r.usable, tables if not per_block else None)
             for i, a in enumerate(names) for b in names[i + 1:]]
    return {"rounds": {"total": r.total, "clean": r.clean, "disturbed": r.disturbed, "usable": r.usable,
                       "used": len(r.used)},
            "rows": row_keys(record, per_block), "tables": tables, "ratios": ratios, "pairs": pairs,
            "rest_share": {n: tables[n][REST]["share"] for n in names}}


def _cell_ms(v: dict) -> str:
    s = v["median_s"]
    return "-" if not math.isfinite(s) else f"{s * 1e3:.3f}"


def format_table(record: PartsRecord, s: dict) -> str:
    """The console table: a row per part and direction (then the optimizer, the overhead, the step), per backend
    ms per call and share of the step, and per backend after the first its ratio to the first with its interval."""
    names = record.names
    head = ["part", *[h for i, n in enumerate(names) for h in
                      ([f"{n} ms", "share"] + ([f"×{names[0]} [95% CI]"] if i else []))]]
    lines = [head]
    for row in s["rows"]:
        cells = [label(row) if split_item(row)[1] is None else f"{split_item(row)[0]} {SHORT[split_item(row)[1]]}"]
        for i, n in enumerate(names):
            v = s["tables"][n][row]
            mark = "*" if (v.get("launches") or {}).get("launch_bound") else ""
            cells += [_cell_ms(v) + mark, "" if v["share"] is None else f"{v['share']:.1%}"]
            if i:
                cells.append(ratio_cell(s["ratios"][n].get(row)))
        lines.append(cells)
    return text_table(head, lines[1:], right=range(1, len(head)))

