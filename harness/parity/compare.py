"""`harness parity`: do two backends compute the same thing? (docs/design.md, "Parity")

Parity mode trains both backends from the same canonical weights on the same batches (dropout 0, or the same
harness-drawn dropout masks), each in its own worker process (harness.run.supervise), and compares them, in float64, at
five depths, each failure naming where it first breaks and, where the pattern tells, the likely cause
(harness/diagnose.py):

0. the activation taps (harness/taps.py): the named intermediate tensors of the step-0 forward pass on the first
   rows of the first batch, walked in forward order; the first divergent tap and its cause are named;
1. step-0 logits on the first training batch: max absolute difference;
2. step-0 gradients of the mean loss, per parameter: relative error ||ga - gb|| / max(||ga||, ||gb||, tiny);
3. the optimizer step, re-synchronised: after each training step k (every step by default, `--opt-steps K`: the
   first K), each parameter's update and AdamW moments m and v, where the non-reference backend took step k from
   the reference's state after step k - 1 (harness/probe.py); also the loss of each such step;
4. the per-step training loss over N steps: the first step over tolerance and the peak, plus the final
   evaluation's validation loss.

With `--dropout P` the harness draws every dropout mask (harness.core.masks) and hands the same masks to both backends,
so the training steps, the optimizer check and an extra step-0 gradient check under the step-0 masks
(`dropout_grad/`) compare dropout placement and scaling exactly.

The comparison itself is the pure function `compare`, so tests (and other tools) can feed it the output of
in-process backends. Default tolerances depend on the precision pair and the size preset; they were measured
(docs/parity.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from harness.core.taps import PREFIX as TAP_PREFIX
from harness.core.taps import block_of, in_forward_order
from harness.errors import UsageError
from harness.parity import diagnose
from harness.parity.diagnose import DROPOUT_CAUSE, TINY, common_factor, proportional, relative_error, worst, worst_key
from harness.run.probe import (
    ADAM_T,
    DROPOUT_GRAD_PREFIX,
    GRAD_PREFIX,
    OPT_PREFIX,
    STATE_QUANTITIES,
    SYNC_LOSS,
    SYNC_REFERENCE,
    SYNC_STEPS,
    opt_key,
    split_state,
    state_at,
)

SCHEMA = "nanogpt-parity/parity-record"


SCHEMA_VERSION = 1


DEFAULT_STEPS = 50


# what depth 3 grades per parameter: the update (param after step k - param after step k - 1) and the moments
OPT_QUANTITIES = ("update", *STATE_QUANTITIES[1:])


DEFAULT_OPT_STEPS: int | None = None  # None: every training step is re-synchronised and compared, within PROBE_BUDGET


# the optimizer states a parity worker keeps by default (harness.launch.probe_bytes): every step of small, medium and
# large at the default 50 steps; the first 27 of nanogpt-cpu's (800,000 parameters: 37 MiB a step)
PROBE_BUDGET = 2**30


EXPLAINED = 0.1  # a pattern "explains" a difference when it leaves less than this fraction of it unexplained


@dataclass(frozen=True)
class Tolerances:
    """Pass thresholds: logits max |diff|, worst per-parameter gradient relative error, loss max |diff|, the worst
    per-parameter relative error of the optimizer step (updates and AdamW moments), the activation taps' max |diff|
    relative to each tap's largest value (None: the logits tolerance) and the loss of a re-synchronised step, both
    sides from the same state (None: the loss tolerance)."""

    logits: float
    grad: float
    loss: float
    opt: float
    taps: float | None = None
    step_loss: float | None = None

    def validate(self) -> None:
        """Raise UsageError unless every tolerance is a finite number >= 0 (taps and step_loss may be None)."""
        for key, value in asdict(self).items():
            if value is None and key in ("taps", "step_loss"):
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < 0:
                raise UsageError(f"--tol-{key.replace('_', '-')} must be a finite number >= 0, got {value!r}")

    @property
    def tap(self) -> float:
        """The activation taps' tolerance in effect."""
        return self.logits if self.taps is None else self.taps

    @property
    def step(self) -> float:
        """The re-synchronised step loss's tolerance in effect."""
        return self.loss if self.step_loss is None else self.step_loss


# 10x the worst deviation measured on CPU for each precision pair and size preset, rounded up to a power of ten
# (docs/parity.md has the measurements and the commands). Pairs are the two backends' dtypes, sorted, joined by "/".
# Two stated exceptions: float64/float64 medium loss 1e-7 (the rule gives 1e-8, but the float64 reference against
# itself from weights perturbed by 1e-15 already reaches 4.8e-9), and float32/float32 is never tighter than
# float32/float64. The loss tolerance depends on the size: medium and large pass through an unstable phase at
# lr 0.01 where any rounding difference grows by up to 1e5-1e6, so float32 pairs check the training loop sharply only
# on small; the float64/float64 pair checks it sharply on every size.
# The optimizer step (depth 3), same rule, measured over 50 steps re-synchronised, dropout 0 and 0.2 (worst 5.7e-5 for
# float32 pairs, 4.3e-14 for float64/float64; large: 10 steps, one seed), with the entries whose gradient is at
# rounding level left out of the update's error (`update_error`). The taps (depth 0) and the step loss: the same rule
# rounded up to 1, 2 or 5 x a power of ten: the tanh-vs-exact GELU difference in small's taps is 20x float32 rounding,
# so a power of ten would hide it.
DEFAULT_TOLERANCES: dict[str, dict[str, Tolerances]] = {
    "float64/float64": {
        "small": Tolerances(logits=1e-14, grad=1e-13, loss=1e-13, opt=1e-12, taps=1e-14, step_loss=1e-13),
        "medium": Tolerances(logits=1e-14, grad=1e-13, loss=1e-7, opt=1e-12, taps=2e-14, step_loss=1e-13),
        "large": Tolerances(logits=1e-14, grad=1e-13, loss=1e-12, opt=1e-12, taps=2e-14, step_loss=1e-13),
    },
    "float32/float64": {
        "small": Tolerances(logits=1e-6, grad=1e-5, loss=1e-5, opt=1e-3, taps=5e-6, step_loss=1e-5),
        "medium": Tolerances(logits=1e-5, grad=1e-5, loss=1.0, opt=1e-3, taps=1e-5, step_loss=1e-5),
        "large": Tolerances(logits=1e-5, grad=1e-4, loss=1e-2, opt=1e-3, taps=1e-5, step_loss=1e-5),
    },
    "float32/float32": {
        "small": Tolerances(logits=1e-6, grad=1e-5, loss=1e-5, opt=1e-3, taps=5e-6, step_loss=1e-5),
        "medium": Tolerances(logits=1e-5, grad=1e-4, loss=10.0, opt=1e-3, taps=1e-5, step_loss=1e-5),
        "large": Tolerances(logits=1e-5, grad=1e-4, loss=1e-2, opt=1e-3, taps=1e-5, step_loss=1e-5),
    },
}


TOL_KEYS = tuple(f.name for f in fields(Tolerances))  # --tol-<key> options, parity.json's "tolerances"


LOOSEST = "float32/float32"  # used for a dtype pair that was never measured


# A backend's default dtype when it is not said otherwise (used only if its class cannot be inspected).
FALLBACK_DTYPES = {"torch": "float32", "numpy": "float64", "flux": "float32"}


def precision_pair(dtype_a: str, dtype_b: str) -> str:
    """The precision pair of two backends' dtypes, e.g. "float32/float64" (order does not matter)."""
    return "/".join(sorted((str(dtype_a), str(dtype_b))))


def default_tolerances(pair: str, size: str | None = None) -> Tolerances:
    """The measured default tolerances of a precision pair and size preset.

    For a config of one's own (`size` None or not a preset) the loosest over the presets of that pair; for a pair
    never measured, those of the loosest pair.
    """
    table = DEFAULT_TOLERANCES.get(pair, DEFAULT_TOLERANCES[LOOSEST])
    if size in table:
        return table[size]
    return Tolerances(**{k: max(getattr(t, k) for t in table.values()) for k in TOL_KEYS})


def reference_backend(backends: Sequence[str]) -> str:
    """The backend whose optimizer states the other re-synchronises from: the NumPy oracle where it takes part,
    else the first named."""
    return "numpy" if "numpy" in backends else backends[0]


# --- the comparison (pure) ---------------------------------------------------------------------------------------
def max_abs_diff(a: np.ndarray, b: np.ndarray) -> tuple[float, tuple[int, ...]]:
    """max |a - b| in float64 and the index where it occurs (NaN anywhere gives NaN at the first NaN)."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"shapes differ: {a64.shape} vs {b64.shape}")
    if a64.size == 0:
        return 0.0, ()
    d = np.abs(a64 - b64)
    bad = ~np.isfinite(d)
    flat = int(np.argmax(bad)) if bad.any() else int(np.argmax(d))
    index = tuple(int(i) for i in np.unravel_index(flat, d.shape))
    return (math.nan if bad.any() else float(d.flat[flat])), index


def tap_error(a: np.ndarray, b: np.ndarray) -> tuple[float, float, tuple[int, ...]]:
    """(max |a - b| / the larger of max |a| and max |b|, max |a - b|, its index): a tap's deviation relative to its
    own scale (activations range from ~0.01 to ~4), NaN anywhere gives NaN."""
    diff, where = max_abs_diff(a, b)
    scale = max(float(np.max(np.abs(a))) if np.size(a) else 0.0, float(np.max(np.abs(b))) if np.size(b) else 0.0)
    return (diff / scale if scale > 0 else diff) if math.isfinite(scale) else math.nan, diff, where


def loss_deviation(losses_a: Sequence[float], losses_b: Sequence[float]) -> tuple[float, int, list[float]]:
    """Over the common steps: max |la - lb|, the step where it peaks (first NaN wins) and every step's |diff|."""
    n = min(len(losses_a), len(losses_b))
    if n == 0:
        return math.nan, -1, []
    d = np.abs(np.asarray(losses_a[:n], dtype=np.float64) - np.asarray(losses_b[:n], dtype=np.float64))
    bad = ~np.isfinite(d)
    step = int(np.argmax(bad)) if bad.any() else int(np.argmax(d))
    return (math.nan if bad.any() else float(d[step])), step, [float(v) for v in d]


def first_over(values: Sequence[float], tol: float) -> int:
    """The index of the first value over `tol` (NaN counts as over), -1 if none."""
    return next((i for i, v in enumerate(values) if not _within(v, tol)), -1)


def _within(value: float, tol: float) -> bool:
    return bool(value <= tol)  # False for NaN


def _fmt(value: float) -> str:
    return "nan" if value != value else f"{value:.1e}"


def _index(where: Sequence[int]) -> str:
    return "[" + ",".join(str(i) for i in where) + "]"


@dataclass
class ParityResult:
    """What `compare` found: the deviations, the tolerances they were held to, what broke first and worst."""

    backends: tuple[str, str]
    tolerances: Tolerances
    logits_max_abs: float = math.nan
    logits_where: tuple[int, ...] = ()  # (batch row, position, token) of the largest difference
    logits_cause: str | None = None
    # depth 0: {tap: max |diff| / the tap's scale}, the raw max |diff| and where; the first over tolerance
    taps_rel_err: dict[str, float] = field(default_factory=dict)
    taps_max_abs: dict[str, float] = field(default_factory=dict)
    taps_where: dict[str, tuple[int, ...]] = field(default_factory=dict)
    first_tap: str | None = None
    worst_tap: str | None = None
    tap_cause: str | None = None
    taps_missing: dict[str, list[str]] = field(default_factory=dict)  # backend -> taps only the other gave
    grad_rel_err: dict[str, float] = field(default_factory=dict)
    worst_grad: str | None = None
    worst_grad_rel_err: float = math.nan
    first_grad: str | None = None  # the first over tolerance in backward order (nearest the loss first)
    loss_max_abs_dev: float = math.nan
    loss_peak_step: int = -1
    loss_first_bad: int = -1  # the first step over the loss tolerance
    loss_steps: int = 0
    loss_abs_dev: list[float] = field(default_factory=list)
    val_loss: dict[str, float] | None = None
    val_loss_abs_diff: float | None = None
    dropout_grad_rel_err: dict[str, float] = field(default_factory=dict)  # under the step-0 masks (dropout > 0)
    worst_dropout_grad: str | None = None
    worst_dropout_grad_rel_err: float = math.nan
    first_dropout_grad: str | None = None
    # depth 3: {step k: {"update" | "adam_m" | "adam_v": {name: rel err}}}
    opt_rel_err: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    opt_reference: str | None = None  # re-synchronised: the backend whose state every step started from
    worst_opt: tuple[int, str, str] | None = None  # (step, quantity, parameter)
    worst_opt_rel_err: float = math.nan
    opt_first_bad: tuple[int, str, str] | None = None  # the worst at the first step out of tolerance
    opt_first_bad_rel_err: float = math.nan
    opt_cause: str | None = None
    # the learning rate each training step took (probe `lr_used`) against the harness's schedule (`lr`), per backend
    rate_rel_err: dict[str, float] = field(default_factory=dict)
    rate_tol: float = math.nan
    rate_first_bad: tuple[str, int] | None = None  # (backend, optimizer step)
    rate_cause: str | None = None
    step_loss_abs_dev: list[float] = field(default_factory=list)  # re-synchronised steps 1..K: |loss diff|
    step_loss_first_bad: int = -1  # the first such step (1-based) over the step-loss tolerance
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the reader should know that is no failure

    @property
    def passed(self) -> bool:
        """True when every check is within its tolerance."""
        return not self.failures

    def rows(self) -> list[dict[str, Any]]:
        """The summary table: one row per check, each with its depth (taps, logits, gradients, dropout_gradients,
        optimizer, learning_rate, step_loss, loss) and where it first broke and where it is worst, in two columns.
        parity.json stores these rows (`checks`), and the HTML report shows them as they are."""
        t = self.tolerances
        lw = self.logits_where
        rows = []
        if self.taps_rel_err:
            wt = self.worst_tap
            rows.append({"depth": "taps", "check": "step-0 activation taps max |diff| (scaled)",
                         "value": self.taps_rel_err[wt] if wt else math.nan, "tolerance": t.tap,
                         "first_broken": self.first_tap or "",
                         "worst": f"{wt} {_index(self.taps_where.get(wt, ()))}" if wt else ""})
        rows.append({"depth": "logits", "check": "step-0 logits max |diff|", "value": self.logits_max_abs,
                     "tolerance": t.logits, "first_broken": "",
                     "worst": f"batch row {lw[0]}, position {lw[1]}, token {lw[2]}" if len(lw) == 3 else ""})
        rows.append({"depth": "gradients", "check": "step-0 gradient rel err", "value": self.worst_grad_rel_err,
                     "tolerance": t.grad, "first_broken": self.first_grad or "", "worst": self.worst_grad or ""})
        if self.dropout_grad_rel_err:
            rows.append({"depth": "dropout_gradients", "check": "step-0 gradient rel err, dropout masks",
                         "value": self.worst_dropout_grad_rel_err, "tolerance": t.grad,
                         "first_broken": self.first_dropout_grad or "", "worst": self.worst_dropout_grad or ""})
        if self.opt_rel_err:
            wo, fb = self.worst_opt, self.opt_first_bad
            steps = sorted(self.opt_rel_err)
            span = f"{steps[0]}..{steps[-1]}" if steps != list(range(steps[0], steps[-1] + 1)) or len(steps) > 1 \
                else f"{steps[0]}"
            sync = " (re-synchronised)" if self.opt_reference else ""
            rows.append({"depth": "optimizer", "check": f"optimizer steps {span}{sync} rel err",
                         "value": self.worst_opt_rel_err, "tolerance": t.opt,
                         "first_broken": f"step {fb[0]} {fb[1]} {fb[2]}" if fb else "",
                         "worst": f"step {wo[0]} {wo[1]} {wo[2]}" if wo else ""})
        if self.step_loss_abs_dev:
            dev = self.step_loss_abs_dev
            peak = worst(dict(enumerate(dev)))  # the value and where it is: the same step, a NaN first
            rows.append({"depth": "step_loss", "check": "loss of each step from the same state",
                         "value": dev[peak],
                         "tolerance": t.step,
                         "first_broken": f"step {self.step_loss_first_bad}" if self.step_loss_first_bad > 0 else "",
                         "worst": f"step {peak + 1} of {len(dev)}"})
        if self.rate_rel_err:
            who = worst(self.rate_rel_err)
            bad = self.rate_first_bad
            rows.append({"depth": "learning_rate", "check": "learning rate per step vs schedule",
                         "value": self.rate_rel_err[who], "tolerance": self.rate_tol,
                         "first_broken": f"{bad[0]} at step {bad[1]}" if bad else "", "worst": who})
        rows.append({"depth": "loss", "check": "training loss max |diff|", "value": self.loss_max_abs_dev,
                     "tolerance": t.loss,
                     "first_broken": f"step {self.loss_first_bad}" if self.loss_first_bad >= 0 else "",
                     "worst": f"step {self.loss_peak_step} of {self.loss_steps}" if self.loss_steps else ""})
        if self.val_loss_abs_diff is not None:
            rows.append({"depth": "loss", "check": "final val loss |diff|", "value": self.val_loss_abs_diff,
                         "tolerance": t.loss, "first_broken": "",
                         "worst": ", ".join(f"{k} {v:.6f}" for k, v in (self.val_loss or {}).items())})
        for row in rows:
            row["result"] = "ok" if _within(row["value"], row["tolerance"]) else "FAIL"
        if self.opt_first_bad and rows and any(r["depth"] == "optimizer" for r in rows):
            for row in rows:  # a pattern caught within tolerance (decay on the embeddings, aliasing) still fails
                if row["depth"] == "optimizer":
                    row["result"] = "FAIL"
        if self.first_tap:
            for row in rows:
                if row["depth"] == "taps":
                    row["result"] = "FAIL"
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready results (NaN stays NaN; json writes it as NaN)."""
        return {
            "passed": self.passed, "failures": list(self.failures), "notes": list(self.notes),
            "tolerances": asdict(self.tolerances),
            "taps": {"first_divergent": self.first_tap, "cause": self.tap_cause, "worst": self.worst_tap,
                     "rel_err": dict(self.taps_rel_err), "max_abs_diff": dict(self.taps_max_abs),
                     "where": {k: list(v) for k, v in self.taps_where.items()},
                     "missing": {k: list(v) for k, v in self.taps_missing.items()}} if self.taps_rel_err else None,
            "logits": {"max_abs_diff": self.logits_max_abs, "where": list(self.logits_where),
                       "cause": self.logits_cause},
            "gradients": {"worst": self.worst_grad, "worst_rel_err": self.worst_grad_rel_err,
                          "first_broken": self.first_grad, "rel_err": dict(self.grad_rel_err)},
            "loss": {"max_abs_dev": self.loss_max_abs_dev, "peak_step": self.loss_peak_step,
                     "first_bad_step": self.loss_first_bad if self.loss_first_bad >= 0 else None,
                     "steps": self.loss_steps, "abs_dev": list(self.loss_abs_dev)},
            "val_loss": {"values": self.val_loss, "abs_diff": self.val_loss_abs_diff},
            "dropout_gradients": {"worst": self.worst_dropout_grad, "worst_rel_err": self.worst_dropout_grad_rel_err,
                                  "first_broken": self.first_dropout_grad,
                                  "rel_err": dict(self.dropout_grad_rel_err)} if self.dropout_grad_rel_err else None,
            "optimizer": {
                "steps": sorted(self.opt_rel_err),
                "resynchronised_from": self.opt_reference,
                "worst": dict(zip(("step", "quantity", "parameter"), self.worst_opt)) if self.worst_opt else None,
                "worst_rel_err": self.worst_opt_rel_err,
                "first_bad": (dict(zip(("step", "quantity", "parameter"), self.opt_first_bad))
                              if self.opt_first_bad else None),
                "first_bad_rel_err": self.opt_first_bad_rel_err,
                "cause": self.opt_cause,
                "rel_err": {str(k): v for k, v in self.opt_rel_err.items()},
            } if self.opt_rel_err else None,
            "learning_rates": {
                "rel_err": dict(self.rate_rel_err), "tolerance": self.rate_tol,
                "first_bad": dict(zip(("backend", "step"), self.rate_first_bad)) if self.rate_first_bad else None,
                "cause": self.rate_cause,
            } if self.rate_rel_err else None,
            "step_loss": {"abs_dev": list(self.step_loss_abs_dev),
                          "first_bad_step": self.step_loss_first_bad if self.step_loss_first_bad > 0 else None,
                          } if self.step_loss_abs_dev else None,
        }


def _grads(probe: Mapping[str, np.ndarray], prefix: str = GRAD_PREFIX) -> dict[str, np.ndarray]:
    """The probe's arrays under `prefix` (gradients by default; TAP_PREFIX: the taps), by name without it."""
    return {k[len(prefix):]: v for k, v in probe.items() if k.startswith(prefix)}


def _initial_params(*probes: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The parameters before step 1 (`opt/0/param/`) of the first probe that holds them, float64."""
    for probe in probes:
        params = opt_state(probe, 0)["param"]
        if params:
            return params
    return {}


# --- the optimizer step (depth 3) ----------------------------------------------------------------------------------
def opt_steps(probe: Mapping[str, np.ndarray]) -> list[int]:
    """The training steps k >= 1 whose optimizer state the probe holds (`opt/<k>/...`), ascending."""
    steps = {int(k.split("/")[1]) for k in probe if k.startswith(OPT_PREFIX) and k.split("/")[1].isdigit()}
    return sorted(k for k in steps if k >= 1)


def opt_state(probe: Mapping[str, np.ndarray], step: int) -> dict[str, dict[str, np.ndarray]]:
    """{"param" | "adam_m" | "adam_v": {name: float64 array}} after training step `step` (0: before the first step,
    zero moments), read by harness.run.probe.state_at."""
    return split_state(state_at(probe, step))


def adam_t(probe: Mapping[str, np.ndarray], step: int) -> int | None:
    """AdamW's step counter after training step `step` as the probe recorded it (None: not recorded)."""
    value = probe.get(opt_key(step, ADAM_T))
    return None if value is None else int(np.asarray(value))


def opt_quantities(probe: Mapping[str, np.ndarray], step: int,
                   before: Mapping[str, np.ndarray] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """What depth 3 grades after training step `step`: {"update": p_k - p_(k-1), "adam_m": m_k, "adam_v": v_k},
    each {name: float64 array}. `before`: the parameters the step started from (re-synchronised: the reference's);
    default the probe's own after step - 1. Without those the update is the parameter p_k itself."""
    now = opt_state(probe, step)
    prev = opt_state(probe, step - 1)["param"] if before is None else before
    update = {n: (p - prev[n] if n in prev and np.shape(prev[n]) == p.shape else p) for n, p in now["param"].items()}
    return {"update": update, "adam_m": now["adam_m"], "adam_v": now["adam_v"]}


NOISE_FLOOR = 1e-4  # an entry whose sqrt(v) is below this fraction of its parameter's median is rounding noise


def update_error(ua: np.ndarray, ub: np.ndarray, va: np.ndarray | None, vb: np.ndarray | None) -> float:
    """The relative error of two updates, leaving out the entries whose gradient is at rounding level on both sides:
    sqrt(v) > 0 but below NOISE_FLOOR x the parameter's median sqrt(v) (e.g. the key bias, whose exact gradient is 0:
    Adam divides its rounding noise by sqrt(v) and moves it by up to the learning rate, differently in every
    backend). Entries with v exactly 0 (rows no token used: decay only) are kept."""
    if va is None or vb is None or np.shape(va) != np.shape(ua) or np.shape(vb) != np.shape(ua):
        return relative_error(ua, ub)
    s = np.sqrt(np.maximum(np.maximum(np.asarray(va, dtype=np.float64), np.asarray(vb, dtype=np.float64)), 0.0))
    live = s > 0
    if not live.any():
        return relative_error(ua, ub)
    keep = ~(live & (s < NOISE_FLOOR * float(np.median(s[live]))))
    return relative_error(np.asarray(ua)[keep], np.asarray(ub)[keep])


def synchronised(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray]) -> int | None:
    """Which probe (0 or 1) is the reference the other re-synchronised its steps from (the other holds
    `sync/steps`), None for two free-running probes."""
    if SYNC_STEPS in probe_a and SYNC_STEPS not in probe_b:
        return 1
    if SYNC_STEPS in probe_b and SYNC_STEPS not in probe_a:
        return 0
    return None


def start_state(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], step: int
                ) -> dict[str, dict[str, np.ndarray]]:
    """The state both sides started training step `step` from: the reference's after step - 1 when re-synchronised,
    else probe_b's (the same as probe_a's when every earlier step agreed); zero moments at step 1."""
    ref = synchronised(probe_a, probe_b)
    return opt_state(probe_a if ref == 0 else probe_b, step - 1)


def _concat(arrays: Mapping[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    return np.concatenate([np.ravel(arrays[n]) for n in names]) if names else np.zeros(0)


def _typical_factor(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """The median ratio f = a/b over the larger half of |b|, and the fraction of those elements whose ratio lies
    within 1 % of f (robust against the few elements a second effect, e.g. eps, moves)."""
    mag = np.abs(b)
    live = mag > 0
    if live.sum() < 2:
        return math.nan, 0.0
    big = live & (mag >= np.median(mag[live]))
    ratio = a[big] / b[big]
    f = float(np.median(ratio))
    return f, float(np.mean(np.abs(ratio - f) <= 0.01 * abs(f)))


def _hyper(hyper: Mapping[str, Any] | None, key: str) -> float | None:
    value = (hyper or {}).get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def step_rate(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], step: int,
              hyper: Mapping[str, Any] | None) -> float | None:
    """The learning rate of optimizer step `step` (1-based): the harness's schedule as the probes hold it (`lr`, what
    the runner handed `train_step`), else the config's constant `learning_rate` (probes from before the schedule)."""
    for probe in (probe_a, probe_b):
        lrs = probe.get("lr")
        if lrs is not None and np.ndim(lrs) == 1 and len(lrs) >= step >= 1:
            return float(lrs[step - 1])
    return _hyper(hyper, "learning_rate")


UPDATE_RULE = "the update rule differs (learning rate, bias correction, eps or weight decay)"  # no pattern fits


WRONG_STEP_INPUTS = ("the step's forward pass: its loss differs although both sides started the step from the same "
                     "state and every step-0 check agrees: the wrong batch or dropout masks for this step (an "
                     "off-by-one in the training loop), or dropout active only in the training step")


def diagnose_optimizer(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], step: int,
                       tol: float, gradients_agree: bool = True,
                       before: Mapping[str, Mapping[str, np.ndarray]] | None = None,
                       hyper: Mapping[str, Any] | None = None, step_loss_differs: bool = False,
                       names: tuple[str, str] = ("a", "b")) -> str:
    """The likely cause of a difference first seen after training step `step`, from its pattern.

    Both sides started the step from the same state `before` ({"param" | "adam_m" | "adam_v": {name: array}};
    default `start_state`) and, when `gradients_agree`, compute the same gradient, so the difference is the
    step's own. `hyper`: the config (learning_rate, weight_decay, beta1, beta2); the patterns that need it are
    skipped without it. In the order tested: the gradients already differ -> not the optimizer; the step's loss
    differs -> the wrong batch or masks; AdamW's step counters differ; the gradient each side fed AdamW
    (g = (m - beta1 m_before) / (1 - beta1)) off by one common factor f for every parameter and v's by f^2 ->
    gradient clipping; each parameter's by its own factor -> clipping per parameter; m off by alpha * p -> coupled
    (L2) weight decay; m off along (m_before - g) -> beta1; v off along (v_before - g^2), or by a common factor at
    step 1 -> beta2; then on the updates: exactly +-lr x wd x p on some parameters -> which parameters are decayed
    (the embeddings: minGPT's convention); only 1-D parameters differ -> weight decay on biases/LayerNorm; one
    common factor -> the step counter's t, bias correction or the learning rate; only the decayed matrices, by
    alpha * p -> the decoupled weight decay; concentrated where v is small -> eps.
    """
    if not gradients_agree:
        return ("the gradients already differ (see the gradient check): the optimizer step inherits it; fix the "
                "forward/backward pass first")
    if step_loss_differs:
        return WRONG_STEP_INPUTS
    a_name, b_name = names
    ta, tb = adam_t(probe_a, step), adam_t(probe_b, step)
    if ta is not None and tb is not None and ta != tb:
        return (f"AdamW's step counter: after step {step} {a_name}'s t is {ta}, {b_name}'s {tb} (the bias "
                "correction uses t: a counter that stops, restarts or is not restored)")
    synced = before is not None or synchronised(probe_a, probe_b) is not None
    start = before if before is not None else start_state(probe_a, probe_b, step)
    base = dict(start["param"])
    # re-synchronised, both updates are from the common state; two free runs: each from its own previous state
    qa, qb = (opt_quantities(p, step, base if synced else None) for p in (probe_a, probe_b))
    names_ = [n for n in qb["update"] if n in qa["update"] and np.shape(qa["update"][n]) == np.shape(qb["update"][n])]
    if not names_:
        return "no parameters in common"
    beta1, beta2 = _hyper(hyper, "beta1"), _hyper(hyper, "beta2")
    lr, wd = step_rate(probe_a, probe_b, step, hyper), _hyper(hyper, "weight_decay")
    m_before = {n: start.get("adam_m", {}).get(n, np.zeros_like(base.get(n, qb["adam_m"].get(n, 0.0))))
                for n in names_}
    v_before = {n: start.get("adam_v", {}).get(n, np.zeros_like(base.get(n, qb["adam_v"].get(n, 0.0))))
                for n in names_}
    fresh = all(not np.any(m_before[n]) for n in names_)  # step 1: m and v start at zero

    def over(q: str, subset: Sequence[str] = names_) -> list[str]:
        def err(n: str) -> float:
            if q == "update":
                return update_error(qa[q][n], qb[q][n], qa["adam_v"].get(n), qb["adam_v"].get(n))
            return relative_error(qa[q][n], qb[q][n])
        return [n for n in subset if n in qa[q] and n in qb[q] and not _within(err(n), tol)]

    one_d = [n for n in names_ if np.ndim(qb["update"][n]) < 2]
    matrices = [n for n in names_ if np.ndim(qb["update"][n]) >= 2]
    m_names = [n for n in names_ if n in qa["adam_m"] and n in qb["adam_m"]]
    v_names = [n for n in names_ if n in qa["adam_v"] and n in qb["adam_v"]]
    m_over, v_over = over("adam_m", m_names), over("adam_v", v_names)

    def fed(q: Mapping[str, np.ndarray], n: str) -> np.ndarray:
        """The gradient a side fed AdamW (from its m), or m itself when beta1 is unknown (exact at step 1)."""
        if beta1 is None:
            return q["adam_m"][n]
        return diagnose.effective_gradient(q["adam_m"][n], m_before[n], beta1)

    def fed_square(q: Mapping[str, np.ndarray], n: str) -> np.ndarray:
        if beta2 is None:
            return q["adam_v"][n]
        return (q["adam_v"][n] - beta2 * v_before[n]) / (1 - beta2)

    if m_over and (beta1 is not None or fresh):
        ga, gb = _concat({n: fed(qa, n) for n in m_names}, m_names), _concat({n: fed(qb, n) for n in m_names},
                                                                             m_names)
        f, rest = common_factor(ga, gb)
        if rest < EXPLAINED:
            va, vb = (_concat({n: fed_square(q, n) for n in v_names}, v_names) for q in (qa, qb))
            fv, _ = common_factor(va, vb)
            if v_names and math.isfinite(fv) and abs(fv - f * f) <= 0.05 * f * f:
                return (f"gradient clipping: every parameter's gradient entered AdamW scaled by one common factor "
                        f"({f:.3g} in m, {fv:.3g} = its square in v); check the max norm and the global-norm "
                        "computation (clipping per parameter clips nothing while each parameter's own norm is below "
                        "the max)")
            if not v_over:
                return (f"beta1: m is off by one common factor {f:.3g} for every parameter while v agrees (m = "
                        "beta1 m + (1 - beta1) g)")
            return f"the gradient fed to AdamW is scaled by one common factor {f:.3g} (m) for every parameter"
        own = [common_factor(np.ravel(fed(qa, n)), np.ravel(fed(qb, n))) for n in m_over]
        if all(rest_n < EXPLAINED for _, rest_n in own):
            lo, hi = min(f_n for f_n, _ in own), max(f_n for f_n, _ in own)
            return (f"gradient clipping per parameter: each parameter's gradient is scaled by its own factor "
                    f"({lo:.3g} to {hi:.3g}) instead of one global-norm factor")
    if m_over:
        with_p = [n for n in m_names if n in base]
        d = _concat(qa["adam_m"], with_p) - _concat(qb["adam_m"], with_p)
        alpha, rest = proportional(d, _concat(base, with_p))
        if rest < EXPLAINED:
            return (f"coupled (L2) weight decay: m differs by {alpha:.3g} x the parameter on all parameters (weight "
                    "decay added to the gradient instead of applied to the weights)")
        mat = [n for n in with_p if n in matrices]
        if mat and not [n for n in m_over if n not in mat]:
            d = _concat(qa["adam_m"], mat) - _concat(qb["adam_m"], mat)
            alpha, rest = proportional(d, _concat(base, mat))
            if rest < EXPLAINED:
                return (f"coupled (L2) weight decay: m differs by {alpha:.3g} x the parameter on the decayed "
                        "matrices (weight decay added to the gradient instead of applied to the weights, AdamW)")
        if beta1 is not None and not fresh:
            d = _concat(qa["adam_m"], m_names) - _concat(qb["adam_m"], m_names)
            direction = _concat(m_before, m_names) - _concat({n: fed(qb, n) for n in m_names}, m_names)
            alpha, rest = proportional(d, direction)
            if rest < EXPLAINED:
                return f"beta1: m differs by {alpha:.3g} x (m before the step - g), i.e. beta1 differs by {alpha:.3g}"
        return "the first moment m differs: beta1, or the gradient fed to AdamW"
    if v_over:
        va, vb = _concat(qa["adam_v"], v_names), _concat(qb["adam_v"], v_names)
        if fresh:
            fv, rest = common_factor(va, vb)
            if rest < EXPLAINED:
                return (f"beta2: m agrees but v differs by one common factor {fv:.3g} for every parameter "
                        f"(after step {step})")
        elif beta2 is not None:
            direction = _concat(v_before, v_names) - _concat({n: fed_square(qb, n) for n in v_names}, v_names)
            alpha, rest = proportional(va - vb, direction)
            if rest < EXPLAINED:
                return f"beta2: m agrees but v differs by {alpha:.3g} x (v before the step - g^2): beta2 differs"
        return "the second moment v differs (beta2, or the squared gradient) while m agrees"
    if lr is not None and wd:
        found = diagnose.decay_cause(diagnose.decay_ratios(qa["update"], qb["update"], base, lr * wd),
                                     {n: np.shape(qb["update"][n]) for n in names_}, names)
        if found:
            return found[1]
    u_over = over("update")
    if not u_over:
        return "no single pattern (the parameters differ, the updates and moments do not)"
    if not [n for n in u_over if n in matrices]:
        return ("weight decay applied to 1-D parameters (biases, LayerNorm weights): only 1-D parameters' updates "
                f"differ ({', '.join(u_over[:3])}{', ...' if len(u_over) > 3 else ''})")
    ua, ub = _concat(qa["update"], names_), _concat(qb["update"], names_)
    f, share = _typical_factor(ua, ub)
    if share >= 1 - EXPLAINED and abs(f - 1) > 0.01:
        if beta1 is not None and beta2 is not None:
            counter = diagnose.step_counter_cause(f, step, beta1, beta2, names)
            if counter:
                return counter
        factors = []
        for k in opt_steps(probe_b):
            if k not in opt_steps(probe_a):
                continue
            base_k = start_state(probe_a, probe_b, k)["param"] if synced else None
            a_k, b_k = opt_quantities(probe_a, k, base_k)["update"], opt_quantities(probe_b, k, base_k)["update"]
            common = [n for n in names_ if n in a_k and n in b_k]
            factors.append(_typical_factor(_concat(a_k, common), _concat(b_k, common))[0])
            if len(factors) == 5:
                break
        shown = ", ".join(f"{x:.3g}" for x in factors)
        if len(factors) > 1 and max(factors) - min(factors) > 0.02 * abs(factors[0]):
            return (f"bias correction: every parameter's update is off by one common factor that changes with t "
                    f"({shown} at steps 1..{len(factors)}); a missing correction gives (1-beta1^t)/sqrt(1-beta2^t)")
        return (f"the step size: every parameter's update is off by one common factor ({shown} at steps "
                f"1..{len(factors)}): learning rate or bias correction (missing: 3.16 at t=1 for betas 0.9, 0.999)")
    if not [n for n in u_over if n in one_d]:
        with_p = [n for n in matrices if n in base]
        d = _concat(qa["update"], with_p) - _concat(qb["update"], with_p)
        alpha, rest = proportional(d, _concat(base, with_p))
        if rest < EXPLAINED:
            return f"decoupled weight decay on the matrices: the update differs by {alpha:.3g} x the parameter"
    # eps: where sqrt(v) is small the update is most sensitive to eps
    s = np.sqrt(np.maximum(_concat(qb["adam_v"], v_names), 0.0)) if v_names else np.zeros(0)
    if v_names and s.size == ua.size:
        r = np.abs(ua - ub) / np.maximum(np.abs(ub), 1e-300)
        live = s > 0
        if live.sum() >= 20:
            low, high = np.quantile(s[live], [0.1, 0.5])
            small, large = np.median(r[live & (s <= low)]), np.median(r[live & (s >= high)])
            if small > 10 * large and small > tol:
                return (f"eps: the updates differ most where v is small (median relative difference {small:.2g} in "
                        f"the smallest tenth of sqrt(v), {large:.2g} in the upper half)")
    return UPDATE_RULE


def _compare_grads(ga: dict[str, np.ndarray], gb: dict[str, np.ndarray], tol: float, what: str,
                   backends: tuple[str, str], fail: Any, required: bool = False, cause: str | None = None
                   ) -> tuple[dict[str, float], str | None, float, str | None]:
    """Per-parameter relative errors of two gradient sets, the worst one, the first over tolerance in backward
    order (nearest the loss first: the backward pass computes them in that order) and FAIL lines through `fail`."""
    a, b = backends
    errs: dict[str, float] = {}
    for name in sorted(set(ga) ^ set(gb)):
        fail(f"FAIL: {what} {name} missing from the {a if name not in ga else b} probe")
    for name in [n for n in ga if n in gb]:  # a's order: the canonical one (the oracle's, in the kit)
        if np.shape(ga[name]) != np.shape(gb[name]):
            fail(f"FAIL: {what} {name} shapes differ: {a} {np.shape(ga[name])} vs {b} {np.shape(gb[name])}")
            errs[name] = math.nan
        else:
            errs[name] = relative_error(ga[name], gb[name])
    if required and not ga and not gb:
        fail("FAIL: no gradients in either probe")
    if not errs:
        return errs, None, math.nan, None
    bad = worst(errs)
    over = [n for n in reversed(list(errs)) if not _within(errs[n], tol)]
    unused = [(n, side) for n in over for side, g, other in ((a, ga, gb), (b, gb, ga))
              if np.shape(g[n]) == np.shape(other[n]) and not np.any(g[n]) and np.any(other[n])]
    if unused and cause is None:
        n, side = unused[0]
        cause = (f"likely cause: {n} gets no gradient in {side}: its forward pass does not use it (a missing bias or "
                 "an unused parameter)")
    if over:
        more = f" ({len(over) - 1} more parameter(s) over tol)" if len(over) > 1 else ""
        fail(f"FAIL: {what} {bad} rel err {_fmt(errs[bad])} > tol {tol:g}{more}"
             + (f"; {cause}" if cause else ""))
    return errs, bad, errs[bad], (over[0] if over else None)


def _compare_taps(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], tol: float,
                  backends: tuple[str, str], r: ParityResult) -> None:
    """Depth 0 into `r`: every tap both probes hold, in forward order; the first over tolerance is named with the
    likely cause read from its pattern (harness.parity.diagnose.forward_cause)."""
    a, b = backends
    ta, tb = _grads(probe_a, TAP_PREFIX), _grads(probe_b, TAP_PREFIX)
    for name, probe, label in ((a, probe_a, ta), (b, probe_b, tb)):
        if "logits" in label and "logits" in probe and np.ndim(probe["logits"]) == 3:
            rows = label["logits"].shape[0]
            if np.shape(probe["logits"][:rows]) == np.shape(label["logits"]):
                err, diff, _ = tap_error(label["logits"], probe["logits"][:rows])
                if not _within(err, tol):
                    r.failures.append(f"FAIL: {name}'s activation taps are not its forward pass: its tap logits "
                                      f"differ from its logits by {_fmt(diff)} (the path that records the taps "
                                      "and the model's forward differ)")
        for block in sorted({n[:-len("attn.y")] for n in label if n.endswith("attn.y")},
                            key=lambda head: block_of(head + "attn.y") or 0):
            err = diagnose.attention_self_error(label, block)  # torch taps probabilities SDPA does not return
            if err is not None and not _within(err, tol):
                r.failures.append(f"FAIL: {name}'s attention taps are not its attention: its {block}attn.y differs "
                                  f"from its own {block}attn.probs @ {block}attn.v by {_fmt(err)} of its scale (the "
                                  "probabilities are computed apart from the attention call: the SDPA call's scale "
                                  "or mask)")
    missing = {name: sorted(set(other) - set(own)) for name, own, other in ((a, ta, tb), (b, tb, ta)) if own}
    r.taps_missing = {k: v for k, v in missing.items() if v}
    for name, lacking in r.taps_missing.items():
        shown = ", ".join(lacking[:3]) + (", ..." if len(lacking) > 3 else "")
        r.notes.append(f"note: {name} gave no tap {shown} ({len(lacking)} of {len(ta) + len(tb) - len(lacking)}); "
                       "those are not compared")
    common = in_forward_order(set(ta) & set(tb))
    for name in common:
        if np.shape(ta[name]) != np.shape(tb[name]):
            r.failures.append(f"FAIL: tap {name} shapes differ: {a} {np.shape(ta[name])} vs {b} {np.shape(tb[name])}")
            r.taps_rel_err[name] = math.nan
            continue
        err, diff, where = tap_error(ta[name], tb[name])
        r.taps_rel_err[name], r.taps_max_abs[name], r.taps_where[name] = err, diff, where
    r.worst_tap = worst(r.taps_rel_err)
    over = [n for n in common if not _within(r.taps_rel_err.get(n, math.nan), tol)]
    if not over:
        return
    first = r.first_tap = over[0]
    if np.shape(ta[first]) != np.shape(tb[first]):
        r.tap_cause = "the tap's shape differs (layout)"
        return
    f64a = {k: np.asarray(v, dtype=np.float64) for k, v in ta.items()}
    f64b = {k: np.asarray(v, dtype=np.float64) for k, v in tb.items()}
    n_layer = 1 + max((block_of(n) for n in (*ta, *tb) if block_of(n) is not None), default=-1)
    x = probe_b.get("x", probe_a.get("x"))
    rows = f64b[first].shape[0]
    x = np.asarray(x)[:rows] if x is not None and np.ndim(x) == 2 else None
    try:
        r.tap_cause = diagnose.forward_cause(first, f64a, f64b, _initial_params(probe_b, probe_a), x, n_layer,
                                             backends)
    except (ValueError, IndexError, KeyError, FloatingPointError) as exc:  # a pattern test on odd input
        r.tap_cause = f"the forward pass at {first} (no pattern read: {type(exc).__name__})"
    more = f" ({len(over) - 1} later tap(s) over tol)" if len(over) > 1 else ""
    r.failures.append(f"FAIL: forward: first divergent activation {first} (max abs {_fmt(r.taps_max_abs[first])} at "
                      f"{_index(r.taps_where[first])}, {_fmt(r.taps_rel_err[first])} of its scale > tol "
                      f"{tol:g}){more}; likely cause: {r.tap_cause}")


def _logits_cause(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], r: ParityResult,
                  backends: tuple[str, str]) -> str | None:
    """Why the logits differ, when the taps did not already say: the output layer (a tied lm_head) read from the
    reference's ln_f tap, or that the taps' rows agree."""
    if r.first_tap:
        return f"follows from the forward difference at {r.first_tap} (above)"
    ta, tb = _grads(probe_a, TAP_PREFIX), _grads(probe_b, TAP_PREFIX)
    ln_f = tb.get("ln_f", ta.get("ln_f"))
    if "logits" in ta and "logits" in tb:
        return (f"the activation taps (the first {tb['logits'].shape[0]} batch rows) agree: the difference lies in "
                "later batch rows")
    if ln_f is not None:
        rows = ln_f.shape[0]
        la, lb = (np.asarray(p["logits"][:rows], dtype=np.float64) for p in (probe_a, probe_b))
        cause = diagnose.output_cause(la, lb, np.asarray(ln_f, dtype=np.float64), _initial_params(probe_b, probe_a),
                                      backends)
        if "ties lm_head" in cause:
            return cause
    return None


def _step_loss_check(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray],
                     losses_a: Sequence[float], losses_b: Sequence[float], tol: float, r: ParityResult) -> None:
    """Re-synchronised: the loss of each step k (from the reference's state after k - 1) against the reference's
    loss of that step."""
    ref = synchronised(probe_a, probe_b)
    if ref is None:
        return
    other = probe_b if ref == 0 else probe_a
    ref_losses = losses_a if ref == 0 else losses_b
    sync = [float(v) for v in np.ravel(other.get(SYNC_LOSS, []))]
    n = min(len(sync), len(ref_losses))
    r.step_loss_abs_dev = [abs(sync[i] - float(ref_losses[i])) for i in range(n)]
    first = first_over(r.step_loss_abs_dev, tol)
    r.step_loss_first_bad = first + 1 if first >= 0 else -1


def _compare_optimizer(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray],
                       tolerances: Tolerances, backends: tuple[str, str], r: ParityResult, grads_ok: bool,
                       hyper: Mapping[str, Any] | None, losses_a: Sequence[float], losses_b: Sequence[float],
                       config: Any = None) -> None:
    """Depth 3 into `r`: per step and parameter, the relative error of the update and of m and v, each side's step
    from the same state (re-synchronised, or the first steps of two free runs); aliased states; the decay
    pattern (exactly +-lr x wd x p), which fails even within tolerance; the cause at the first step that breaks
    (with the run's `config`, a learning-rate schedule mistake is named before the optimizer's own patterns)."""
    a, b = backends
    tol = tolerances.opt
    sa, sb = opt_steps(probe_a), opt_steps(probe_b)
    if not sa and not sb:
        return  # probes from before the optimizer check (or a kit that does not ask for it)
    if sa != sb:
        r.failures.append(f"FAIL: optimizer steps recorded differ: {a} {sa} vs {b} {sb}")
    ref = synchronised(probe_a, probe_b)
    if ref is not None:
        r.opt_reference = backends[ref]
        named = str(np.asarray((probe_b if ref == 0 else probe_a).get(SYNC_REFERENCE, "")))
        if named and named != r.opt_reference:  # the probe says whose states it took its steps from
            r.failures.append(f"FAIL: {backends[1 - ref]} re-synchronised its optimizer steps from {named}'s states, "
                              f"not from {r.opt_reference}'s: its probe belongs to another comparison")
        _step_loss_check(probe_a, probe_b, losses_a, losses_b, tolerances.step, r)
    aliased = {name: diagnose.aliased_quantities(probe, [k for k in sa if k in sb])
               for name, probe in ((a, probe_a), (b, probe_b))}
    alias_cause = next((f"aliased optimizer states: every opt/<k> {', '.join(q)} array {name} recorded is the same "
                        "array (the final state), as when references to the live arrays are saved instead of copies"
                        for name, q in aliased.items() if q), None)
    wd = _hyper(hyper, "weight_decay")
    for k in [k for k in sa if k in sb]:
        start = start_state(probe_a, probe_b, k)
        base = start["param"] if ref is not None else None  # free runs: each update from its own previous state
        qa, qb = opt_quantities(probe_a, k, base), opt_quantities(probe_b, k, base)
        step_err: dict[str, dict[str, float]] = {}
        for q in OPT_QUANTITIES:
            errs = step_err[q] = {}
            for name in sorted(set(qa[q]) ^ set(qb[q])):
                r.failures.append(f"FAIL: optimizer step {k} {q} of {name} missing from the "
                                  f"{a if name not in qa[q] else b} probe")
            for name in [n for n in qa[q] if n in qb[q]]:
                shape_ok = np.shape(qa[q][name]) == np.shape(qb[q][name])
                if not shape_ok:
                    errs[name] = math.nan
                elif q == "update":
                    errs[name] = update_error(qa[q][name], qb[q][name], qa["adam_v"].get(name), qb["adam_v"].get(name))
                else:
                    errs[name] = relative_error(qa[q][name], qb[q][name])
        r.opt_rel_err[k] = step_err
        if r.opt_first_bad is not None:
            continue
        bad = [(q, n, e) for q, errs in step_err.items() for n, e in errs.items() if not _within(e, tol)]
        lr = step_rate(probe_a, probe_b, k, hyper)
        decay = (diagnose.decay_cause(diagnose.decay_ratios(qa["update"], qb["update"], start["param"], lr * wd),
                                      {n: np.shape(v) for n, v in qb["update"].items()}, backends)
                 if lr and wd and not bad and grads_ok else None)
        step_loss_bad = (0 < r.step_loss_first_bad <= k) if ref is not None else (
            k == 1 and len(losses_a) > 0 and len(losses_b) > 0
            and not _within(abs(float(losses_a[0]) - float(losses_b[0])), tolerances.step))
        if not bad and decay is None and not (alias_cause and k == sa[-1]):
            continue
        schedule_cause = None
        if bad:
            q, n, e = max(bad, key=lambda t: worst_key(t[2]))
            synced = [s for s in sa if s <= k and s in sb and (ref is not None or s == 1 or s - 1 in sa)]
            schedule_cause = (config is not None and grads_ok and diagnose_schedule(
                rate_ratios(probe_a, probe_b) or update_ratios(probe_a, probe_b, synced), config, backends)) or None
            params = {p for _, p, _ in bad}
        elif decay is not None:
            q, n = "update", decay[0][0]
            e, params = step_err["update"].get(n, math.nan), set(decay[0])
        else:
            q, n = "param", next(iter(qb["adam_m"]), "")
            e, params = math.nan, set()
        r.opt_first_bad, r.opt_first_bad_rel_err = (k, q, n), e
        if alias_cause:
            r.opt_cause = alias_cause
        elif decay is not None:
            r.opt_cause = decay[1]
        elif bad and schedule_cause:
            r.opt_cause = schedule_cause
        else:
            r.opt_cause = diagnose_optimizer(probe_a, probe_b, k, tol, gradients_agree=grads_ok,
                                             before=start if ref is not None else None, hyper=hyper,
                                             step_loss_differs=step_loss_bad, names=backends)
            if r.opt_cause == UPDATE_RULE and r.rate_first_bad is not None and r.rate_first_bad[1] <= k:
                r.opt_cause = f"the learning rate: {r.rate_cause}"  # no other pattern fits, and the rate is off
        what = {"update": "update", "adam_m": "AdamW m", "adam_v": "AdamW v", "param": "state"}[q]
        more = f" ({len(params) - 1} more parameter(s) over tol)" if len(params) > 1 and bad else ""
        how = (f"rel err {_fmt(e)} > tol {tol:g}{more}" if bad else
               f"rel err {_fmt(e)}, within tol {tol:g} but exactly the pattern below" if decay is not None else
               "identical arrays at every step")
        r.failures.append(f"FAIL: optimizer step {k}: {n} {what} {how}; likely cause: {r.opt_cause}")
    every = {(k, q, n): e for k, step in r.opt_rel_err.items() for q, errs in step.items() for n, e in errs.items()}
    r.worst_opt = worst(every)
    r.worst_opt_rel_err = every[r.worst_opt] if every else math.nan
    k = r.step_loss_first_bad
    stated = r.opt_first_bad is not None and r.opt_first_bad[0] == k and r.opt_cause == WRONG_STEP_INPUTS
    if k > 0 and grads_ok and not stated:  # with the forward pass already different, it follows from that
        r.failures.append(f"FAIL: step {k}'s loss from the same state differs by {_fmt(r.step_loss_abs_dev[k - 1])} > "
                          f"tol {tolerances.step:g}; likely cause: {WRONG_STEP_INPUTS}")


def compare(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray],
            losses_a: Sequence[float], losses_b: Sequence[float], tolerances: Tolerances,
            val_losses: tuple[float, float] | None = None, backends: tuple[str, str] = ("a", "b"),
            hyper: Mapping[str, Any] | None = None, config: Any = None) -> ParityResult:
    """Compare two backends' probes and training-loss curves, in float64.

    A probe maps "logits" (B, T, V), "x", "y" (the batch) and "grad/<canonical name>" to arrays, as the worker's
    `<backend>.probe.npz` (harness/probe.py); optionally "tap/<name>" (depth 0, harness/taps.py: any subset; the
    taps both hold are compared), "dropout_grad/<name>" (gradients under the step-0 dropout masks) and
    "opt/<k>/param|adam_m|adam_v/<name>", "opt/<k>/adam_t" (the state after training step k; k = 0: the parameters
    before it), graded by depth 3 with `tolerances.opt` and `diagnose_optimizer` (re-synchronised when one probe
    holds "sync/steps": then "sync/loss" is checked against the other's losses with `tolerances.step`).
    `losses_*` are the per-step training losses, `val_losses` the two final validation losses (checked against the
    loss tolerance), `hyper` the config (learning_rate, weight_decay, beta1, beta2) some diagnoses need; `config`
    (the run's harness Config, optional; its fields serve as `hyper` when that is not given) lets the FAIL lines
    name option and schedule causes (diagnose_gelu, diagnose_tying, diagnose_schedule). Every
    deviation beyond its tolerance, a NaN, a missing or misshapen array or a different batch is a failure, named in
    `result.failures`, the first divergent place first.
    """
    a, b = backends
    if hyper is None and config is not None:
        hyper = config.to_dict()
    r = ParityResult(backends=(a, b), tolerances=tolerances)
    fail = r.failures.append
    for key in ("x", "y"):
        if key in probe_a and key in probe_b and not np.array_equal(probe_a[key], probe_b[key]):
            fail(f"FAIL: the probes used different batches ({key} differs): the comparison is meaningless")
    # (0) the activation taps
    _compare_taps(probe_a, probe_b, tolerances.tap, (a, b), r)
    downstream = f"; follows from the forward difference at {r.first_tap}" if r.first_tap else ""
    # (a) logits
    if "logits" not in probe_a or "logits" not in probe_b:
        fail(f"FAIL: logits missing from the {a if 'logits' not in probe_a else b} probe")
    elif np.shape(probe_a["logits"]) != np.shape(probe_b["logits"]):
        fail(f"FAIL: logits shapes differ: {a} {np.shape(probe_a['logits'])} vs {b} {np.shape(probe_b['logits'])}")
    else:
        r.logits_max_abs, r.logits_where = max_abs_diff(probe_a["logits"], probe_b["logits"])
        if not _within(r.logits_max_abs, tolerances.logits):
            r.logits_cause = _logits_cause(probe_a, probe_b, r, (a, b)) or (
                config is not None and diagnose_gelu(probe_a, probe_b, config, (a, b))) or None
            cause = ("" if not r.logits_cause or r.first_tap else f"; likely cause: {r.logits_cause}")
            fail(f"FAIL: logits max abs diff {_fmt(r.logits_max_abs)} > tol {tolerances.logits:g}{cause}{downstream}")
    # (b) gradients (and, with dropout, the gradients under the harness's step-0 masks)
    tying = diagnose_tying(_grads(probe_a), _grads(probe_b), probe_b.get("x"), tolerances.grad)
    r.grad_rel_err, r.worst_grad, r.worst_grad_rel_err, r.first_grad = _compare_grads(
        _grads(probe_a), _grads(probe_b), tolerances.grad, "gradient", (a, b), fail, required=True,
        cause=f"likely cause: {tying}" if tying else downstream[2:] or None)
    grads_ok = all(_within(e, tolerances.grad) for e in r.grad_rel_err.values())
    if any(k.startswith(DROPOUT_GRAD_PREFIX) for k in (*probe_a, *probe_b)):
        r.dropout_grad_rel_err, r.worst_dropout_grad, r.worst_dropout_grad_rel_err, r.first_dropout_grad = \
            _compare_grads(_grads(probe_a, DROPOUT_GRAD_PREFIX), _grads(probe_b, DROPOUT_GRAD_PREFIX),
                           tolerances.grad, "gradient with dropout masks", (a, b), fail,
                           cause=(f"likely cause: {DROPOUT_CAUSE}" if grads_ok and r.grad_rel_err
                                  else downstream[2:] or None))
        grads_ok = grads_ok and all(_within(e, tolerances.grad) for e in r.dropout_grad_rel_err.values())
    # (c) the optimizer step
    # the rate each step took first (its cause explains an optimizer difference at the same step): a tenth of the
    # optimizer tolerance, 1e-4 float32, 1e-13 float64, each 10x the worst measured (1.5e-6, 3.6e-15)
    rate_line = _compare_rates(probe_a, probe_b, tolerances.opt / 10, (a, b), r, config)
    _compare_optimizer(probe_a, probe_b, tolerances, (a, b), r, grads_ok and not r.first_tap, hyper,
                       losses_a, losses_b, config)
    if rate_line:
        r.failures.append(rate_line)
    # (d) the training-loss curve
    r.loss_steps = min(len(losses_a), len(losses_b))
    if len(losses_a) != len(losses_b):
        fail(f"FAIL: training ran {len(losses_a)} steps in {a} but {len(losses_b)} in {b}")
    r.loss_max_abs_dev, r.loss_peak_step, r.loss_abs_dev = loss_deviation(losses_a, losses_b)
    r.loss_first_bad = first_over(r.loss_abs_dev, tolerances.loss)
    if r.loss_steps == 0:
        fail("FAIL: no training losses to compare")
    elif not _within(r.loss_max_abs_dev, tolerances.loss):
        k = r.loss_first_bad
        fail(f"FAIL: training loss: first over tol {tolerances.loss:g} at step {k} (abs dev "
             f"{_fmt(r.loss_abs_dev[k])}), peak {_fmt(r.loss_max_abs_dev)} at step {r.loss_peak_step}")
    if val_losses is not None:
        va, vb = (float(v) for v in val_losses)
        r.val_loss = {a: va, b: vb}
        r.val_loss_abs_diff = abs(va - vb) if math.isfinite(va) and math.isfinite(vb) else math.nan
        if not _within(r.val_loss_abs_diff, tolerances.loss):
            fail(f"FAIL: final val loss abs diff {_fmt(r.val_loss_abs_diff)} > tol {tolerances.loss:g}")
    return r


def format_table(result: ParityResult) -> str:
    """The summary table as text (pandas)."""
    import pandas as pd

    df = pd.DataFrame(result.rows()).drop(columns="depth").set_index("check")
    df["value"] = df["value"].map(_fmt)
    df["tolerance"] = df["tolerance"].map(lambda v: f"{v:g}")
    df = df.rename(columns={"first_broken": "first broken"})
    return df[["value", "tolerance", "result", "first broken", "worst"]].to_string()


def format_gradients(result: ParityResult) -> str:
    """Per-parameter gradient relative errors as text, worst first."""
    import pandas as pd

    items = sorted(result.grad_rel_err.items(), key=lambda kv: worst_key(kv[1]), reverse=True)
    df = pd.DataFrame({"rel err": [_fmt(v) for _, v in items]}, index=[k for k, _ in items])
    df.index.name = "parameter"
    return df.to_string()


def format_optimizer(result: ParityResult) -> str:
    """Per-parameter optimizer-step relative errors (update, m, v; worst over the steps) as text, worst first."""
    import pandas as pd

    names = sorted({n for step in result.opt_rel_err.values() for errs in step.values() for n in errs})
    table = {q: [max((step[q].get(n, 0.0) for step in result.opt_rel_err.values()), key=worst_key) for n in names]
             for q in OPT_QUANTITIES}
    df = pd.DataFrame(table, index=names)
    df = df.loc[df.max(axis=1).sort_values(ascending=False).index].map(_fmt)
    df.index.name = "parameter"
    return df.to_string()


# --- diagnoses of the model options and the learning-rate schedule (docs/nanogpt.md) --------------------------------
# Each takes the quantities of one depth and the config, and returns a cause (a phrase) or None when its pattern is
# absent; compare() appends the cause to the FAIL line of that depth.
EXPLAINS = 0.25  # a schedule hypothesis fits when it leaves at most this fraction of the rate difference unexplained


def update_ratios(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray],
                  steps: Sequence[int]) -> dict[int, tuple[float, float]]:
    """Per optimizer step k (1-based): (s, t) with update_b ~ s update_a and update_a ~ t update_b, least squares over
    every parameter. From the same state before step k an AdamW update is proportional to the learning rate (the
    decay term too), so s is rate_b / rate_a; NaN where a backend did not move. Re-synchronised probes: both updates
    from the reference's state before step k (the state the step started from)."""
    out: dict[int, tuple[float, float]] = {}
    synced = synchronised(probe_a, probe_b) is not None
    for k in steps:
        base = start_state(probe_a, probe_b, k)["param"] if synced else None
        ua, ub = opt_quantities(probe_a, k, base)["update"], opt_quantities(probe_b, k, base)["update"]
        names = [n for n in ub if n in ua and np.shape(ua[n]) == np.shape(ub[n])]
        a, b = _concat(ua, names), _concat(ub, names)
        out[k] = (common_factor(b, a)[0], common_factor(a, b)[0])
    return out


def rate_ratios(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray]
                ) -> dict[int, tuple[float, float]] | None:
    """Per training step k (1-based): (rate_b / rate_a, rate_a / rate_b) of the learning rates the two backends'
    steps took (the probes' `lr_used`, each measured from that backend's own consecutive states by
    harness.core.schedule.effective_rate, so what the other backend did before does not enter); None without them."""
    if "lr_used" not in probe_a or "lr_used" not in probe_b:
        return None
    ra, rb = (np.asarray(p["lr_used"], dtype=np.float64).ravel() for p in (probe_a, probe_b))
    n = min(len(ra), len(rb))
    return {k + 1: (rb[k] / ra[k] if ra[k] else math.nan, ra[k] / rb[k] if rb[k] else math.nan) for k in range(n)}


def diagnose_schedule(ratios: Mapping[int, tuple[float, float]], config: Any,
                      backends: tuple[str, str] = ("a", "b")) -> str | None:
    """The learning-rate schedule a backend used, when it is a known mistake: `ratios` from `update_ratios` (steps
    where both backends started from the same state), `config` the run's (harness.core.schedule gives the rates).

    Hypotheses: the warm-up off by one step (the rate of the step after, or before, with 0 at the first step; or
    nanoGPT's old lr * it / warmup), the cosine decaying to 0 instead of min_lr, no warm-up, the schedule ignored (a
    constant learning_rate). A backend's implied rates are the schedule's times its ratio (b: s, a: t); a hypothesis
    fits when, at the step where it differs most from the schedule, it explains all but EXPLAINS of the difference,
    and at every step the implied rate is no further from it than that.
    """
    from harness.core.schedule import learning_rate

    steps = sorted(ratios)
    if not steps:
        return None
    lrs = {k: learning_rate(config, k - 1) for k in steps}  # optimizer step k (1-based) used get_lr(k - 1)
    lr, w = config.learning_rate, config.warmup_steps
    hypotheses: list[tuple[str, Any]] = [
        ("the warm-up is off by one step: it used the rate of the next step (nanoGPT's get_lr(it) is "
         "lr * (it + 1) / (warmup + 1))", lambda it: learning_rate(config, it + 1)),
        ("the warm-up is off by one step: it used the rate of the step before (0 at the first step; nanoGPT's "
         "get_lr(it) is lr * (it + 1) / (warmup + 1))", lambda it: learning_rate(config, it - 1) if it else 0.0),
    ]
    if w:
        hypotheses += [
            ("the warm-up is off by one step: lr * it / warmup (nanoGPT before its fix: 0 at the first step) "
             "instead of lr * (it + 1) / (warmup + 1)",
             lambda it: lr * it / w if it < w else learning_rate(config, it)),
            ("the warm-up is off by one step: lr * (it + 1) / warmup instead of lr * (it + 1) / (warmup + 1)",
             lambda it: lr * (it + 1) / w if it < w else learning_rate(config, it)),
            ("the warm-up is missing (warmup_steps = 0 used)",
             lambda it: learning_rate(config.replace(warmup_steps=0), it)),
        ]
    if config.lr_schedule == "cosine":
        hypotheses.append((f"the cosine decays to 0 instead of min_lr = {config.min_lr:g}",
                           lambda it: learning_rate(config.replace(min_lr=0.0), it)))
    if w or config.lr_schedule != "constant":
        hypotheses.append((f"the schedule is ignored: a constant learning_rate {lr:g}", lambda it: lr))

    def rel(u: float, v: float) -> float:
        return abs(u - v) / max(abs(u), abs(v), 1e-12 * lr)

    best: tuple[float, str, str] | None = None
    for who, index, other in ((backends[1], 0, backends[0]), (backends[0], 1, backends[1])):
        implied = {k: lrs[k] * ratios[k][index] for k in steps}
        if not all(math.isfinite(v) for v in implied.values()):
            continue
        for text, rate in hypotheses:
            h = {k: rate(k - 1) for k in steps}
            distinct = max(rel(h[k], lrs[k]) for k in steps)
            unexplained = max(rel(implied[k], h[k]) for k in steps)
            if distinct > 1e-6 and unexplained <= EXPLAINS * distinct \
                    and (best is None or unexplained / distinct < best[0]):
                first = next(k for k in steps if rel(h[k], lrs[k]) > 1e-6)
                most = max(steps, key=lambda k: rel(h[k], lrs[k]))
                shown = [first] if first == most else [first, most]
                best = (unexplained / distinct, text,
                        f"from optimizer step {first} on {who} stepped with other rates than the schedule ("
                        + "; ".join(f"step {k}: {implied[k]:.4g}, not {lrs[k]:.4g}" for k in shown)
                        + f"), {other} with the schedule's")
    return None if best is None else f"learning-rate schedule: {best[1]}; {best[2]}"


def _compare_rates(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], tol: float,
                   backends: tuple[str, str], r: ParityResult, config: Any) -> str | None:
    """Into `r`: per backend, the worst relative error of the rate its steps took (`lr_used`) against the
    harness's schedule (`lr`), the first step over `tol` and, from the pattern, the likely cause. Each backend
    is measured on its own states, so drift between the two cannot enter; returns the FAIL line when over `tol`
    (the caller places it after the optimizer depth's, whose cause may cite it)."""
    if not all("lr_used" in p and "lr" in p for p in (probe_a, probe_b)):
        return  # probes from before the rates were recorded
    r.rate_tol = tol
    for name, probe in zip(backends, (probe_a, probe_b)):
        used = np.asarray(probe["lr_used"], dtype=np.float64).ravel()
        lr = np.asarray(probe["lr"], dtype=np.float64).ravel()[:len(used)]
        err = np.abs(used - lr) / np.maximum(np.abs(lr), TINY)
        r.rate_rel_err[name] = float(np.nan_to_num(err, nan=np.inf).max()) if err.size else 0.0
        over = np.flatnonzero(~(err <= tol))
        if over.size and (r.rate_first_bad is None or over[0] + 1 < r.rate_first_bad[1]):
            k = int(over[0])
            r.rate_first_bad = (name, k + 1)
            r.rate_cause = (config is not None and diagnose_schedule(rate_ratios(probe_a, probe_b), config, backends)) \
                or (f"{name}'s steps took other rates than the ones the harness handed it (or its AdamW update "
                    "differs: see the optimizer depth)")
            line = (f"FAIL: learning rate of optimizer step {k + 1}: {name} stepped with {used[k]:.6g}, the schedule "
                    f"gives {lr[k]:.6g} (rel err {_fmt(float(err[k]))} > tol {tol:g}); likely cause: {r.rate_cause}")
    if r.rate_first_bad is not None:
        return line
    return None


def diagnose_tying(grads_a: Mapping[str, np.ndarray], grads_b: Mapping[str, np.ndarray], x: np.ndarray | None,
                   tol: float) -> str | None:
    """Tied embeddings (the probes hold wte.weight and no lm_head.weight): when wte.weight is the only gradient out of
    tolerance, the shared matrix's gradient is not the sum of its two uses. A difference confined to the rows of the
    tokens in the batch `x` is the embedding lookup's part; one on other rows too, the output layer's."""
    if "wte.weight" not in grads_b or "lm_head.weight" in grads_a or "lm_head.weight" in grads_b:
        return None
    over = [n for n in grads_a if n in grads_b and np.shape(grads_a[n]) == np.shape(grads_b[n])
            and not _within(relative_error(grads_a[n], grads_b[n]), tol)]
    if over != ["wte.weight"]:
        return None
    d = np.asarray(grads_a["wte.weight"], dtype=np.float64) - np.asarray(grads_b["wte.weight"], dtype=np.float64)
    part = ""
    if x is not None:
        used = np.zeros(d.shape[0], dtype=bool)
        used[np.unique(np.asarray(x))] = True
        if (~used).any():
            outside = float(np.linalg.norm(d[~used])) / max(float(np.linalg.norm(d)), TINY)
            part = (" (the difference lies only on the rows of the batch's tokens: the embedding lookup's part is "
                    "missing on one side)" if outside < 1e-6 else
                    " (the difference reaches rows of tokens absent from the batch: the output layer's part is "
                    "missing on one side)")
    return ("tied embeddings: only the shared wte.weight gradient differs; it must be the sum of both uses, the "
            "token embedding and the output layer (logits = h @ wte.T)" + part)


def diagnose_gelu(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], config: Any,
                  backends: tuple[str, str] = ("a", "b")) -> str | None:
    """When the step-0 logits differ: the float64 oracle's logits of the probe's batch `x` from its initial
    parameters (`opt/0/param/`) in both GELU forms; a backend whose logits lie 10x closer to the other form than to
    the config's computes that form."""
    from harness.models import numpy_gpt

    params = _initial_params(probe_b, probe_a)
    if "x" not in probe_b or not params or "logits" not in probe_a or "logits" not in probe_b:
        return None
    other = "tanh" if config.gelu == "exact" else "exact"
    x = np.asarray(probe_b["x"])
    try:
        want = numpy_gpt.gpt_forward(params, x, config)[0]
        alt = numpy_gpt.gpt_forward(params, x, config.replace(gelu=other))[0]
    except (KeyError, ValueError):  # parameters that do not fit the config: not this pattern
        return None
    for name, probe in zip(backends, (probe_a, probe_b)):
        logits = np.asarray(probe["logits"], dtype=np.float64)
        if logits.shape != want.shape:
            continue
        d_want, d_alt = float(np.abs(logits - want).max()), float(np.abs(logits - alt).max())
        if d_alt < 0.1 * d_want:
            return (f"GELU form: {name} computes the {other} GELU where the config asks for {config.gelu} (its logits "
                    f"are {d_alt:.1e} from the oracle's with the {other} form, {d_want:.1e} from the {config.gelu})")
    return None


# --- the command -------------------------------------------------------------------------------------------------
# Exit statuses of `harness parity`: a script can tell a numerical disagreement from a backend that never got to
# be compared. Printed by `harness parity --help`.
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_CRASH, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
