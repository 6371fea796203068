"""Numbers the report shows, derived from RunRecords only: statuses, fairness, loss agreement, costs, text.

Nothing here draws or formats HTML; `harness.report` turns these into tables and figures. Every figure a record
lacks (an interrupted or killed worker writes no summary) is recomputed from the per-step data where it can be,
and left as None where it cannot, never guessed.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import UsageError
from harness.pages import ERROR, NEUTRAL, OK, WARN
from harness.report.results import costs
from harness.store import RunPaths, RunRecord, RunSpec, Status, compare_fingerprints, load_run
from harness.store.curves import Eval, eval_array
from harness.store.paired import PairedRecord
from harness.store.parity import ParityCheck, ParityRecord
from harness.timing import stats

# Loss agreement with dropout on (docs/design.md, "Parity"): the frameworks' dropout streams differ, so the final
# validation losses can only agree statistically. Two backends "agree" when their validation losses at the last
# common evaluation step differ by at most LOSS_BAND_REL of their mean.
LOSS_BAND_REL = 0.02
# The paired per-step comparison uses the last TAIL_FRACTION of the common steps (at least TAIL_MIN_STEPS).
TAIL_FRACTION = 0.2
TAIL_MIN_STEPS = 10
# A "running" record not rewritten for this long belongs to a worker that is no longer alive.
STALE_AFTER_S = 600.0

# Levels of a verdict or banner, best first, and what each means: harness.pages (the one palette of every page).
# The report's sign convention, stated once in every report so that no number can be read backwards: differences are
# first − second with both names written out; ratios are "how many times faster", the faster one named; intervals
# are 95 %.
CONVENTION = ("Convention: a difference is written first − second with both names (e.g. torch − numpy); a speed "
              "ratio is written \"X is N× faster than Y\", the faster one named, N ≥ 1; every interval is 95 %.")
CONVENTION_PARITY = ("Convention: a difference is written first − second with both names (e.g. torch − numpy); every "
                     "interval is 95 %.")  # a parity check's page: it has no speed ratio


@dataclass
class Banner:
    """One line shown at the top of a report: `level` is "warn" or "error"."""

    level: str
    text: str


@dataclass
class RunView:
    """Everything the report reads for one run id."""

    paths: RunPaths
    spec: RunSpec
    records: list[RunRecord]
    missing: list[str]  # backends in the spec without a record
    age_s: dict[str, float]  # seconds since each record was last written
    parity: ParityRecord | None = None
    parity_error: str | None = None
    paired: PairedRecord | None = None  # paired.json (harness.timing.paired): the backends timed side by side
    banners: list[Banner] = field(default_factory=list)

    @property
    def out(self) -> Path:
        return self.paths.out

    @property
    def run_id(self) -> str:
        return self.paths.run_id

    @property
    def backends(self) -> list[str]:
        return [r.backend for r in self.records]

    @property
    def label(self) -> str:
        return str(self.spec.label or self.spec.config.name or "?")

    def record(self, backend: str) -> RunRecord:
        return next(r for r in self.records if r.backend == backend)


def load_view(paths: RunPaths, now: float | None = None) -> RunView:
    """Load run `paths` (UsageError when missing or corrupt) with its parity.json and paired.json where there are."""
    spec, recs = load_run(paths)
    now = time.time() if now is None else now
    ages = {r.backend: max(0.0, now - paths.record(r.backend).stat().st_mtime) for r in recs}
    have = {r.backend for r in recs}
    view = RunView(paths=paths, spec=spec, records=recs, missing=[b for b in spec.backends if b not in have],
                   age_s=ages)
    if paths.parity.exists():
        try:
            view.parity = ParityRecord.load(paths.parity)
        except UsageError as exc:
            view.parity_error = str(exc)
    if os.path.lexists(paths.paired_timing):  # a damaged one is bad input (UsageError), as a damaged record is
        view.paired = PairedRecord.load(paths.paired_timing)
    view.banners = banners(view)
    return view


def is_parity(view: RunView) -> bool:
    """Whether the run is a parity check (`harness parity`, which writes parity.json): a correctness check, whose
    page shows no speed."""
    return view.spec.parity is not None or view.parity is not None or view.parity_error is not None


# --- status and fairness -------------------------------------------------------------------------------------------
def status_of(rec: RunRecord, age_s: float | None = None) -> tuple[str, str]:
    """(level, text) of one record's status: completed is ok; interrupted, failed and running are not."""
    steps, total = rec.curves.steps_done, rec.total_steps
    progress = f"{steps:,} of {total:,} steps" if isinstance(total, int) else f"{steps:,} steps"
    if rec.status is Status.COMPLETED:
        return OK, "completed"
    if rec.status is Status.INTERRUPTED:
        return WARN, f"interrupted after {progress}"
    if rec.status is Status.FAILED:
        return ERROR, f"{rec.status_text} (after {progress})"
    if rec.status is Status.RUNNING:
        if age_s is not None and age_s > STALE_AFTER_S:
            return ERROR, (f"running, but its record was last written {human_age(age_s)} ago: the worker is no "
                           f"longer alive ({progress} recorded)")
        when = f", last written {human_age(age_s)} ago" if age_s is not None else ""
        return WARN, f"still running ({progress}{when}): this report is a snapshot"
    return ERROR, f"unknown status {rec.status_text!r}"


def human_age(seconds: float | None) -> str:
    """'42 s', '7 min', '3.2 h', '2.0 days'."""
    if seconds is None:
        return "?"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def fairness_problems(recs: list[RunRecord]) -> list[str]:
    """Differences in data, config, weights or batches between backends (any one makes the comparison unfair)."""
    return compare_fingerprints(recs)


def banners(view: RunView) -> list[Banner]:
    """What a reader must know before trusting anything below: unfinished runs, unfair comparisons, parity."""
    out: list[Banner] = []
    run = f"run {view.run_id}"
    if not view.records:
        out.append(Banner(ERROR, f"{run}: no backend wrote a record (it failed before training started); "
                                 "there is nothing to compare"))
    for rec in view.records:
        level, text = status_of(rec, view.age_s.get(rec.backend))
        if level != OK:
            resume = (f" Resume with `harness resume {view.run_id} --out {view.out}`."
                      if rec.status in (Status.INTERRUPTED, Status.RUNNING) else "")
            out.append(Banner(level, f"{run}: {rec.backend} {text}.{resume}"))
    for name in view.missing:
        out.append(Banner(ERROR, f"{run}: {name} has no record (it never started, or failed before setup)"))
    for problem in fairness_problems(view.records):
        out.append(Banner(ERROR, f"{run}: {problem}: the comparison is not fair"))
    for rec in view.records if not is_parity(view) else []:  # a parity check times nothing: no speed banner
        cont = costs(rec).contention
        if cont is not None and cont.mostly_disturbed:
            out.append(Banner(WARN, f"{run}: {rec.backend} trained on a busy machine: "
                                    f"{cont.contended_fraction:.0%} of its steady steps were disturbed, so its "
                                    "speed figures are kept out of every speed verdict (its losses still count)"))
    if view.parity_error:
        out.append(Banner(ERROR, f"{run}: {view.parity_error}"))
    elif view.parity is not None and view.parity.compared_nothing:
        why = "; ".join(str(f) for f in view.parity.failures) or "no reason recorded"
        out.append(Banner(ERROR, f"{run}: the parity check compared nothing ({why})"))
    elif view.parity is not None and view.parity.passed is False:
        out.append(Banner(ERROR, f"{run}: parity check FAILED (see the summary)"))
    return out


# --- parity.json ------------------------------------------------------------------------------------------------------
def parity_checks(doc: ParityRecord) -> list[dict]:
    """One row per check of a parity.json, as it holds them (`checks`, harness.parity.result.ParityResult.rows):
    check, value, tolerance, "first broken" (where a check first fails: the first divergent tap, the first step),
    "worst" (where it is largest), result ("ok" / "FAIL"); the likely causes are in the FAIL lines, not repeated
    here. A parity.json that compared nothing (verdict "error") has none."""
    return [_check_row(c) for c in doc.checks or []]


def _check_row(c: ParityCheck) -> dict:
    """A check as the report's table shows it (every field but its depth, "first broken" spelt as a heading)."""
    row = {("first broken" if k == "first_broken" else k): v for k, v in c.to_dict().items() if k != "depth"}
    return {k: v for k, v in row.items() if v is not None or k in ("value", "tolerance")}


def parity_sentence(doc: ParityRecord) -> str:
    """One sentence: the verdict, the precision pair and steps, and each check's value against its tolerance."""
    passed = doc.passed
    verdict = {True: "PASS", False: "FAIL", None: "no verdict"}[passed]
    if doc.compared_nothing:
        verdict = "ERROR (nothing compared)"
    context = [f"{doc.precision_pair} pair" if doc.precision_pair else "",
               f"{doc.steps} steps" if doc.steps else "",
               f"dropout {doc.dropout:g}, shared masks" if doc.dropout else "dropout 0"]
    parts = []
    for c in doc.checks or []:
        if isinstance(c.value, float) and isinstance(c.tolerance, float):
            op = "≤" if c.result == "ok" else ">"
            parts.append(f"{c.check} {c.value:.1e} {op} {c.tolerance:g}")
    s = f"Parity ({', '.join(c for c in context if c)}): {verdict}"
    if parts:
        s += ": " + "; ".join(parts)
    failures = [f for f in doc.failures if isinstance(f, str)]
    if passed is False and failures:
        s += ". " + " ".join(failures)
    return s + "."


# --- per-backend figures ----------------------------------------------------------------------------------------------
def step_losses(rec: RunRecord) -> tuple[np.ndarray, np.ndarray]:
    """(steps, losses) as arrays, only the steps whose loss was recorded."""
    cv = rec.curves
    loss = np.asarray(cv.loss, dtype=np.float64)
    step = np.asarray(cv.step[:len(loss)], dtype=np.int64)
    if len(step) < len(loss):
        step = np.arange(len(loss), dtype=np.int64)
    return step, loss


def last_eval(rec: RunRecord) -> Eval | None:
    """The last evaluation point of a record, or None."""
    return rec.curves.last_eval


def evals_by_step(rec: RunRecord) -> tuple[np.ndarray, np.ndarray]:
    """A record's evaluation steps, sorted and each once, and the validation loss at each (the first where a step
    repeats): array passes, so that matching two records' evaluations is linear in their length, not quadratic,
    and a million of them take milliseconds."""
    rows = eval_array(rec.curves.evals)
    steps, first = np.unique(rows[:, 0], return_index=True)
    return steps, rows[first, 2]


# --- comparisons between backends ------------------------------------------------------------------------------------
@dataclass
class PairComparison:
    """Two backends of one run compared: loss agreement, per-step deviation, speed."""

    a: str
    b: str
    common_steps: np.ndarray
    abs_dev: np.ndarray  # |loss_a - loss_b| at each common step
    eval_step: int | None = None
    val_a: float | None = None
    val_b: float | None = None
    tail_steps: int = 0
    tail_mean: float | None = None  # mean of loss_a - loss_b over the tail window
    tail_ci: float | None = None  # 95 % half-width of that mean
    tail_scale: float | None = None  # the mean training loss of both over the tail window (the band's scale there)
    training_time_ratio: float | None = None  # time per token of a over b (< 1: a is faster), separate runs
    paired: dict | None = None  # harness.timing.paired.pair_summary of (a, b): time ratio a / b from the paired timing
    paired_failure: str | None = None  # why the paired timing has no round of (a, b), when it was tried
    paired_crashed: bool = False  # the paired timing's last session failed (not merely unfinished)

    @property
    def val_diff(self) -> float | None:
        """Validation loss a − b (first − second, the report's convention)."""
        return None if self.val_a is None or self.val_b is None else self.val_a - self.val_b

    @property
    def val_rel(self) -> float | None:
        if self.val_diff is None:
            return None
        mean = (self.val_a + self.val_b) / 2
        return abs(self.val_diff) / mean if mean else None

    @property
    def agree(self) -> bool | None:
        """The loss verdict as a yes or no: True agree, False differ, None no verdict (`loss_judgement`)."""
        return {OK: True, ERROR: False}.get(loss_judgement(self).level)

    @property
    def max_dev(self) -> float | None:
        finite = self.abs_dev[np.isfinite(self.abs_dev)]
        return float(finite.max()) if finite.size else None

    @property
    def tail_interval(self) -> tuple[float, float] | None:
        """The 95 % interval of the tail's mean per-step difference a − b, where there is a finite one."""
        if self.tail_mean is None or self.tail_ci is None or not math.isfinite(self.tail_mean + self.tail_ci):
            return None
        return self.tail_mean - self.tail_ci, self.tail_mean + self.tail_ci


def inside_band(lo: float, hi: float, scale: float) -> bool | None:
    """Where the interval [lo, hi] of a loss difference lies against the band ±LOSS_BAND_REL × `scale`: True wholly
    inside (the losses agree, a difference of either sign included), False wholly outside (they differ), None
    across an edge (the data cannot tell). A point is the interval [d, d]."""
    band = LOSS_BAND_REL * abs(scale)
    if -band <= lo and hi <= band:
        return True
    if lo > band or hi < -band:
        return False
    return None


@dataclass(frozen=True)
class LossJudgement:
    """The one loss verdict of a pair: the headline's level and label and the sentence's conclusion come from it."""

    level: str
    label: str  # "losses agree", "losses differ", "losses: no verdict", "losses not comparable"
    why: str  # the conclusion, in words

    @property
    def short(self) -> str:
        """The label without "losses": "agree", "differ", "no verdict", "not comparable" (a table's cell)."""
        return self.label.removeprefix("losses").lstrip(": ")


def difference_judgement(lo: float, hi: float, scale: float, what: str) -> LossJudgement:
    """A loss difference, an interval [lo, hi] or a point [d, d], judged against the band ±LOSS_BAND_REL × `scale`
    (`inside_band`); `what` names the difference in the conclusion."""
    band = f"{LOSS_BAND_REL:.0%}"
    inside = inside_band(lo, hi, scale)
    if inside is True:
        return LossJudgement(OK, "losses agree", f"{what} within the {band} band: the losses agree")
    if inside is False:
        return LossJudgement(ERROR, "losses differ", f"{what} outside the {band} band: the losses differ")
    return LossJudgement(NEUTRAL, "losses: no verdict", f"{what} reaches beyond the {band} band: too noisy to say "
                                                        "whether the losses agree")


def loss_judgement(c: PairComparison) -> LossJudgement:
    """Both pieces of evidence against the one band (LOSS_BAND_REL): the validation losses at the last common
    evaluation step, and the 95 % interval of the paired per-step training-loss difference over the tail.

    They agree when both lie within the band (a small difference of either sign, even one the interval shows is
    not zero, is inside it); they differ when either lies wholly outside; an interval across the band's edge
    gives no verdict (too noisy to say)."""
    band = f"{LOSS_BAND_REL:.0%}"
    if c.val_rel is None or not math.isfinite(c.val_rel):
        return LossJudgement(NEUTRAL, "losses not comparable", "no evaluation step in common: no verdict")
    tail = c.tail_interval
    tail_in = None if tail is None or c.tail_scale is None else inside_band(*tail, c.tail_scale)
    if c.val_rel > LOSS_BAND_REL:
        return LossJudgement(ERROR, "losses differ", f"the validation losses differ by more than the {band} band: "
                                                     "the losses differ")
    if tail is not None and tail_in is False:
        return LossJudgement(ERROR, "losses differ", f"the per-step training losses differ by more than the {band} "
                                                     "band: the losses differ")
    if tail is not None and tail_in is None:
        return LossJudgement(NEUTRAL, "losses: no verdict", f"the per-step interval reaches beyond the {band} "
                                                            "band: too noisy to say whether the losses agree")
    both = "both within" if tail is not None else "within"
    return LossJudgement(OK, "losses agree", f"{both} the {band} band: the losses agree")


def compare_pair(ra: RunRecord, rb: RunRecord) -> PairComparison:
    """Compare backend records `ra` and `rb` on the steps and evaluation points both have."""
    sa, la = step_losses(ra)
    sb, lb = step_losses(rb)
    common, ia, ib = np.intersect1d(sa, sb, return_indices=True)
    da, db = la[ia], lb[ib]
    cmp = PairComparison(a=ra.backend, b=rb.backend, common_steps=common, abs_dev=np.abs(da - db))
    (ea, va), (eb, vb) = evals_by_step(ra), evals_by_step(rb)
    shared, ja, jb = np.intersect1d(ea, eb, assume_unique=True, return_indices=True)
    if shared.size:
        cmp.eval_step = int(shared[-1])
        cmp.val_a, cmp.val_b = float(va[ja[-1]]), float(vb[jb[-1]])
    n = len(common)
    if n >= 2:
        k = min(n, max(TAIL_MIN_STEPS, round(n * TAIL_FRACTION)))
        d = (da - db)[-k:]
        d = d[np.isfinite(d)]
        if d.size >= 2:
            cmp.tail_steps = int(d.size)
            cmp.tail_mean = float(d.mean())
            ci = stats.mean_ci(d.tolist())  # Student t: with few steps, 1.96 would be too narrow
            cmp.tail_ci = float(ci.hi - ci.estimate)
            level = (da + db)[-k:] / 2
            level = level[np.isfinite(level)]
            cmp.tail_scale = float(level.mean()) if level.size else None
    ta, tb = costs(ra).tokens_per_s, costs(rb).tokens_per_s
    if ta and tb:
        cmp.training_time_ratio = tb / ta  # time per token is 1 / throughput
    return cmp


def pairs(view: RunView) -> list[PairComparison]:
    """Every pair of backends of a run, in the spec's order, with the paired timing's ratio where there is one."""
    out = [compare_pair(a, b) for a, b in combinations(view.records, 2)]
    if view.paired is not None:
        from harness.timing import paired

        names = set(view.paired.names)
        for c in out:
            if {c.a, c.b} <= names:
                s = paired.pair_summary(view.paired, c.a, c.b)
                c.paired = s if s["ratio"] is not None else None
                if c.paired is None:
                    last = view.paired.last_session
                    c.paired_crashed = bool(last is not None and last.failure)
                    c.paired_failure = (last.failure if last is not None else None) or \
                        f"its last session: {last.status if last is not None else 'not started'}"
    return out


def text_agreement(ra: RunRecord, rb: RunRecord) -> dict[str, Any] | None:
    """How alike two backends' continuations are: share identical, mean common prefix (characters)."""
    ca = ra.text.continuations if ra.text else []
    cb = rb.text.continuations if rb.text else []
    if not ca or len(ca) != len(cb):
        return None
    prefixes = []
    for x, y in zip(ca, cb):
        h1, h2 = x.hypothesis, y.hypothesis
        k = 0
        while k < min(len(h1), len(h2)) and h1[k] == h2[k]:
            k += 1
        prefixes.append(k)
    same = sum(1 for x, y in zip(ca, cb) if x.hypothesis == y.hypothesis)
    return {"identical": same, "total": len(ca), "mean_prefix": float(np.mean(prefixes)),
            "length": max((len(x.hypothesis) for x in ca), default=0)}


def final_val(rec: RunRecord) -> float | None:
    last = last_eval(rec)
    return None if last is None else float(last.val_loss)


def headline(view: RunView) -> dict[str, Any]:
    """The few numbers the index lists for one run, per backend where they differ by backend."""
    return {
        "size": view.label, "device": view.spec.device,
        "n_params": next((r.n_params for r in view.records if r.n_params), None),
        "status": {r.backend: r.status_text for r in view.records},
        "val_loss": {r.backend: final_val(r) for r in view.records},
        "tokens_per_s": {r.backend: costs(r).tokens_per_s for r in view.records},
        "contention": {r.backend: costs(r).contention for r in view.records},
        "bleu": {r.backend: r.text.bleu if r.text else None for r in view.records},
        "chrf": {r.backend: r.text.chrf if r.text else None for r in view.records},
    }
