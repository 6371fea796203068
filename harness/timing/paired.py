"""The analysis of a paired-timing record (harness.store.paired.PairedRecord, `<run>/paired.json`): rounds,
undisturbed rounds, ratios with intervals, and the one speed-verdict rule (`judge`).

Pure: the reports and sweeps read it; the coordinator that writes it is harness.run.paired_timing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from harness.pages import NEUTRAL, OK, WARN
from harness.store.paired import Burst, PairedRecord, Round
from harness.timing import contention, stats

ROUNDS = 10  # undisturbed rounds wanted (the default of --paired-rounds)


MAX_ROUNDS_FACTOR = 4  # give up after this many times `rounds` rounds


MAX_ROUNDS = 1000  # the most undisturbed rounds one may ask for


MIN_USABLE_ROUNDS = 3  # fewer undisturbed rounds than this (and than half the wanted ones): not usable


CV_MAX = 0.10  # a coefficient of variation of the paired ratios above this is said in the verdict


# --- analysis (pure: the report reads it) ---------------------------------------------------------------------------
def load(path: Path) -> PairedRecord:
    """The paired-timing record at `path` (harness.store.paired.PairedRecord.load: UsageError when it is
    unreadable)."""
    return PairedRecord.load(path)


def rounds_of(doc: PairedRecord) -> list[Round]:
    """Every round of every session, in order."""
    return [r for s in doc.sessions for r in s.rounds]


def burst_median(burst: Burst) -> float | None:
    """The median of a burst's step times (the positive, finite ones); None without one."""
    times = [t for t in burst.times if isinstance(t, (int, float)) and math.isfinite(t) and t > 0]
    return float(np.median(times)) if times else None


def burst_disturbed(burst: Burst) -> bool:
    return bool(contention.judge(burst.chunk or {}))


def pair_rounds(doc: PairedRecord, a: str, b: str) -> list[dict]:
    """Per round holding both: {"ratio": time a / time b, "disturbed": either burst disturbed, "session": i}."""
    out = []
    for i, s in enumerate(doc.sessions):
        for r in s.rounds:
            ba, bb = r.bursts.get(a), r.bursts.get(b)
            if not ba or not bb:
                continue
            ma, mb = burst_median(ba), burst_median(bb)
            if ma is None or mb is None:
                continue
            out.append({"ratio": ma / mb, "disturbed": burst_disturbed(ba) or burst_disturbed(bb), "session": i,
                        "a_s": ma, "b_s": mb})
    return out


def round_clean(rnd: Round) -> bool:
    """Whether no burst of round `rnd` was disturbed (every contender)."""
    return not any(burst_disturbed(b) for b in rnd.bursts.values())


def clean_rounds(doc: PairedRecord) -> int:
    """Rounds in which no burst was disturbed (every contender)."""
    return sum(1 for r in rounds_of(doc) if round_clean(r))


def needed_for_a_verdict(wanted: int) -> int:
    """The undisturbed rounds a speed verdict needs when `wanted` are asked for: half of them, at least
    MIN_USABLE_ROUNDS (all of them when fewer are wanted), at least one."""
    return max(1, min(MIN_USABLE_ROUNDS, wanted), (wanted + 1) // 2)


def usable(n_clean: int, wanted: int) -> bool:
    return n_clean >= needed_for_a_verdict(wanted)


def out_of_reach(n_clean: int, rounds_left: int, wanted: int) -> bool:
    """Whether a paired timing can no longer give a verdict: even were every one of the `rounds_left` rounds it may
    still make undisturbed, its `n_clean` undisturbed rounds would stay fewer than a verdict needs. Then the rounds
    left cannot change the outcome ("no verdict"), and the coordinator stops (harness.run.paired_timing)."""
    return n_clean + rounds_left < needed_for_a_verdict(wanted)


def pair_summary(doc: PairedRecord, a: str, b: str) -> dict:
    """The time ratio a / b of one session or several: estimate, 95 % interval, CV, rounds used and dropped.

    Within one session the interval is over its undisturbed rounds; with several sessions each session's
    geometric mean is one value and the interval is across sessions. `usable` False: too few undisturbed rounds,
    the figures come from every round and must stay out of a verdict.
    """
    rows = pair_rounds(doc, a, b)
    wanted = doc.plan.rounds
    clean = [r for r in rows if not r["disturbed"]]
    ok = usable(len(clean), wanted)
    use = clean if ok else rows
    out: dict[str, Any] = {"a": a, "b": b, "rounds": len(rows), "clean_rounds": len(clean),
                           "disturbed_rounds": len(rows) - len(clean), "usable": ok, "ratio": None, "lo": None,
                           "hi": None, "cv": None, "n": 0, "level": "rounds", "sessions": 0}
    if not use:
        return out
    sessions = sorted({r["session"] for r in use})
    out["sessions"] = len(sessions)
    if len(sessions) > 1:
        values = [math.exp(np.mean([math.log(r["ratio"]) for r in use if r["session"] == s])) for s in sessions]
        out["level"] = "sessions"
    else:
        values = [r["ratio"] for r in use]
    ci = stats.geometric_mean_ci(values)
    out.update(ratio=ci.estimate, n=ci.n, per_value=values, lo=ci.lo, hi=ci.hi)
    if len(values) > 1:
        out["cv"] = float(np.std(values, ddof=1) / np.mean(values))
    out["a_step_s"] = float(np.median([r["a_s"] for r in use]))
    out["b_step_s"] = float(np.median([r["b_s"] for r in use]))
    return out


def combine(summaries: list[dict]) -> dict:
    """Several sessions' pair summaries (one per sweep seed) as one: geometric mean of the usable sessions' ratios,
    t interval across them (n = sessions), CV across them; with one usable session, that session's own. With none
    usable, the same over every session that has a ratio, marked `usable` False (no verdict may rest on it)."""
    good = [s for s in summaries if s.get("usable") and s.get("ratio")]
    if len(good) == 1:
        return dict(good[0], seeds=1, seeds_dropped=len(summaries) - 1)
    use = good or [s for s in summaries if s.get("ratio")]
    base = {"a": summaries[0]["a"] if summaries else None, "b": summaries[0]["b"] if summaries else None,
            "seeds": len(use), "seeds_dropped": len(summaries) - len(good), "level": "seeds", "usable": bool(good),
            "ratio": None, "lo": None, "hi": None, "cv": None, "n": len(use),
            "rounds": sum(s.get("rounds", 0) for s in summaries),
            "clean_rounds": sum(s.get("clean_rounds", 0) for s in summaries),
            "disturbed_rounds": sum(s.get("disturbed_rounds", 0) for s in summaries)}
    if not use:
        return base
    values = [s["ratio"] for s in use]
    ci = stats.geometric_mean_ci(values)
    base.update(ratio=ci.estimate, per_value=values, lo=ci.lo, hi=ci.hi,
                cv=float(np.std(values, ddof=1) / np.mean(values)) if len(values) > 1 else None)
    return base


def speed_words(s: dict, a: str | None = None, b: str | None = None) -> dict:
    """The comparison in the report's convention: "FAST is R× faster than SLOW [lo, hi]" (R >= 1, the faster one
    named); `conclusive` when the interval excludes 1 (no difference)."""
    a, b = a or s["a"], b or s["b"]
    r, lo, hi = s["ratio"], s.get("lo"), s.get("hi")
    if r >= 1:  # a's steps take longer: b is faster by r
        fast, slow, x, xlo, xhi = b, a, r, lo, hi
    else:
        fast, slow, x = a, b, 1 / r
        xlo, xhi = (None if hi is None else 1 / hi), (None if lo is None else 1 / lo)
    interval = f" [{xlo:.3g}, {xhi:.3g}]" if xlo is not None and xhi is not None else " (no interval)"
    conclusive = xlo is not None and xlo > 1
    return {"fast": fast, "slow": slow, "x": x, "lo": xlo, "hi": xhi, "conclusive": conclusive,
            "text": f"{fast} is {x:.3g}× faster than {slow}{interval}"}


def judge(s: dict) -> dict:
    """The speed verdict a summary (`pair_summary`, or `combine` over a sweep's seeds) can carry: one rule for
    every report, in the levels of harness.pages. `level` is OK only for a usable timing whose interval excludes 1,
    from 3 or more seeds, whose ratios vary by at most CV_MAX (one pair of processes cannot show how much a
    process's own speed varies: docs/benchmarks.md); NEUTRAL for an inconclusive, thin or noisy one; WARN for a
    timing mostly disturbed. Also: `label` (a pill), `claim` (the sentence's core), `over` (what the interval is
    over) and `notes` (what the verdict must say plainly)."""
    w = speed_words(s)
    seeds, cv = s.get("seeds", 1), s.get("cv")
    noisy = cv is not None and cv > CV_MAX
    if s["level"] == "seeds":
        over = f"across {seeds} seeds"
    elif s["level"] == "sessions":
        over = f"across {s['n']} sessions of one seed"
    else:
        over = f"over {s['n']} undisturbed of {s['rounds']} rounds of one seed" if s["usable"] else \
            f"over all {s['rounds']} rounds of one seed"
    if s.get("seeds_dropped"):
        over += f"; {s['seeds_dropped']} seed(s) left out (paired timing mostly disturbed)"
    notes = []
    if seeds < 3:
        notes.append(f"{seeds} seed{'s' if seeds != 1 else ''}, fewer than 3: the interval cannot show how much a "
                     "process's own speed varies")
    if noisy:
        notes.append(f"the paired ratios vary by {cv:.0%} (coefficient of variation over {CV_MAX:.0%}): noisy")
    elif cv is not None:
        over += f", coefficient of variation {cv:.1%}"
    if not s["usable"]:
        return {"level": WARN, "label": "speed: machine too busy", "over": over, "notes": [], "claim": (
            f"no verdict: {s['disturbed_rounds']} of {s['rounds']} paired rounds were disturbed by other work on the "
            f"machine, too many to rely on (all of them together say {w['text']})")}
    if not w["conclusive"]:
        return {"level": NEUTRAL, "label": "speed: no clear difference", "over": over, "notes": notes,
                "claim": f"{w['text']}: the interval includes 1, so no clear difference"}
    label = f"speed: {w['fast']} {w['x']:.3g}× faster" + (" (noisy)" if noisy else "") + (
        f" ({seeds} seed{'s' if seeds != 1 else ''})" if seeds < 3 else "")
    return {"level": NEUTRAL if noisy or seeds < 3 else OK, "label": label, "over": over, "notes": notes,
            "claim": w["text"]}


def headline(doc: PairedRecord) -> str:
    """One line per pair for the terminal: the ratio, its interval, the rounds behind it."""
    names = doc.names
    parts = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            s = pair_summary(doc, a, b)
            if s["ratio"] is None:
                parts.append(f"{a} vs {b}: no paired rounds")
                continue
            note = "" if s["usable"] else "; mostly disturbed: no verdict"
            parts.append(f"{speed_words(s)['text']} ({s['clean_rounds']} undisturbed of {s['rounds']} rounds"
                         f"{note})")
    last = doc.last_session
    if last is not None and last.failure:
        parts.append(f"last session failed: {last.failure}")
    return "paired timing: " + ("; ".join(parts) or "none")


def status_text(doc: PairedRecord) -> str:
    """One line: how much paired timing the record holds."""
    n, clean = len(rounds_of(doc)), clean_rounds(doc)
    last = doc.last_session
    if last is not None and last.failure:
        return f"paired timing failed: {last.failure}"
    gone = "; the last session was interrupted (its process is gone)" if last is not None and last.gone else ""
    return f"{len(doc.sessions)} session(s), {n} rounds, {clean} undisturbed{gone}"


def complete(doc: PairedRecord) -> bool:
    """Whether the record already holds the undisturbed rounds it wants (then no new session is started)."""
    return clean_rounds(doc) >= doc.plan.rounds
