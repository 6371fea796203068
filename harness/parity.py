"""`harness parity`: do two backends compute the same thing? (docs/design.md, "Parity")

Parity mode trains both backends from the same canonical weights on the same batches (dropout 0, or the same
harness-drawn dropout masks), each in its own worker process (harness.launch), and compares them at four depths,
in float64:

1. step-0 logits on the first training batch: max absolute difference;
2. step-0 gradients of the mean loss, per parameter: relative error ||ga - gb|| / max(||ga||, ||gb||, tiny),
   the worst parameter named;
3. the optimizer step: after each of the first K training steps (forward, backward, clip, AdamW), each
   parameter's update and AdamW moments m and v, per parameter and step (relative error, as the gradients); a
   failure names the worst parameter and, where the pattern tells, the likely cause (`diagnose_optimizer`);
4. the per-step training loss over N steps: max absolute deviation and the step where it peaks, plus the
   final evaluation's validation loss.

With `--dropout P` the harness draws every dropout mask (harness.masks) and hands the same masks to both backends,
so the training steps, the optimizer check and an extra step-0 gradient check under the step-0 masks
(`dropout_grad/`) compare dropout placement and scaling exactly.

The comparison itself is the pure function `compare`, so tests (and other tools) can feed it the output of
in-process backends. Default tolerances depend on the precision pair and the size preset; they were measured
(docs/parity.md).
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import UsageError
from harness.options import THREADS_HELP, add_backend, add_quiet, pick_sizes

SCHEMA = "nanogpt-parity/parity-record"
SCHEMA_VERSION = 1
DEFAULT_STEPS = 50
DEFAULT_BACKENDS = "torch,numpy"
TINY = 1e-300  # floor of the relative error's denominator: two all-zero gradients agree exactly
GRAD_PREFIX = "grad/"
DROPOUT_GRAD_PREFIX = "dropout_grad/"  # step-0 gradients under the harness's step-0 dropout masks
OPT_PREFIX = "opt/"  # opt/<k>/param|adam_m|adam_v/<name>: the state after training step k (k = 0: params only)
OPT_QUANTITIES = ("update", "adam_m", "adam_v")  # update = param after step k - param after step k - 1
DEFAULT_OPT_STEPS = 3
EXPLAINED = 0.1  # a pattern "explains" a difference when it leaves less than this fraction of it unexplained


@dataclass(frozen=True)
class Tolerances:
    """Pass thresholds: logits max |diff|, worst per-parameter gradient relative error, loss max |diff|, and the
    worst per-parameter relative error of the optimizer step (updates and AdamW moments)."""

    logits: float
    grad: float
    loss: float
    opt: float

    def validate(self) -> None:
        """Raise UsageError unless every tolerance is a finite number >= 0."""
        for key, value in asdict(self).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < 0:
                raise UsageError(f"--tol-{key} must be a finite number >= 0, got {value!r}")


# 10x the worst deviation measured on CPU for each precision pair and size preset, rounded up to a power of ten
# (docs/parity.md has the measurements and the commands). Pairs are the two backends' dtypes, sorted, joined by "/".
# Two stated exceptions: float64/float64 medium loss 1e-7 (the rule gives 1e-8, but the float64 reference against
# itself from weights perturbed by 1e-15 already reaches 4.8e-9), and float32/float32 is never tighter than
# float32/float64. The loss tolerance depends on the size: medium and large pass through an unstable phase at
# lr 0.01 where any rounding difference grows by up to 1e5-1e6, so float32 pairs check the training loop sharply only
# on small; the float64/float64 pair checks it sharply on every size.
# The optimizer step (depth 3), same rule, measured over 3 steps with dropout 0 and 0.2: Adam divides by sqrt(v), so
# an entry whose gradient is at rounding level (e.g. the key bias, whose exact gradient is 0) moves by up to lr from
# noise alone; float32 against float64 reaches 6.1e-4 (small, dropout 0.2), float64 pairs 7.9e-13 (docs/parity.md).
DEFAULT_TOLERANCES: dict[str, dict[str, Tolerances]] = {
    "float64/float64": {
        "small": Tolerances(logits=1e-14, grad=1e-13, loss=1e-13, opt=1e-11),
        "medium": Tolerances(logits=1e-14, grad=1e-13, loss=1e-7, opt=1e-11),
        "large": Tolerances(logits=1e-14, grad=1e-13, loss=1e-12, opt=1e-11),
    },
    "float32/float64": {
        "small": Tolerances(logits=1e-6, grad=1e-5, loss=1e-5, opt=1e-2),
        "medium": Tolerances(logits=1e-5, grad=1e-5, loss=1.0, opt=1e-2),
        "large": Tolerances(logits=1e-5, grad=1e-4, loss=1e-2, opt=1e-3),
    },
    "float32/float32": {
        "small": Tolerances(logits=1e-6, grad=1e-5, loss=1e-5, opt=1e-2),
        "medium": Tolerances(logits=1e-5, grad=1e-4, loss=10.0, opt=1e-2),
        "large": Tolerances(logits=1e-5, grad=1e-4, loss=1e-2, opt=1e-3),
    },
}
TOL_KEYS = ("logits", "grad", "loss", "opt")
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


def relative_error(a: np.ndarray, b: np.ndarray, tiny: float = TINY) -> float:
    """||a - b|| / max(||a||, ||b||, tiny), Frobenius norms in float64; NaN if either holds a non-finite value."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"shapes differ: {a64.shape} vs {b64.shape}")
    if not (np.isfinite(a64).all() and np.isfinite(b64).all()):
        return math.nan
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(a64), np.linalg.norm(b64), tiny))


def loss_deviation(losses_a: Sequence[float], losses_b: Sequence[float]) -> tuple[float, int, list[float]]:
    """Over the common steps: max |la - lb|, the step where it peaks (first NaN wins) and every step's |diff|."""
    n = min(len(losses_a), len(losses_b))
    if n == 0:
        return math.nan, -1, []
    d = np.abs(np.asarray(losses_a[:n], dtype=np.float64) - np.asarray(losses_b[:n], dtype=np.float64))
    bad = ~np.isfinite(d)
    step = int(np.argmax(bad)) if bad.any() else int(np.argmax(d))
    return (math.nan if bad.any() else float(d[step])), step, [float(v) for v in d]


def _within(value: float, tol: float) -> bool:
    return bool(value <= tol)  # False for NaN


def _fmt(value: float) -> str:
    return "nan" if value != value else f"{value:.1e}"


@dataclass
class ParityResult:
    """What `compare` found: the deviations, the tolerances they were held to, and what broke."""

    backends: tuple[str, str]
    tolerances: Tolerances
    logits_max_abs: float = math.nan
    logits_where: tuple[int, ...] = ()  # (batch row, position, token) of the largest difference
    grad_rel_err: dict[str, float] = field(default_factory=dict)
    worst_grad: str | None = None
    worst_grad_rel_err: float = math.nan
    loss_max_abs_dev: float = math.nan
    loss_peak_step: int = -1
    loss_steps: int = 0
    loss_abs_dev: list[float] = field(default_factory=list)
    val_loss: dict[str, float] | None = None
    val_loss_abs_diff: float | None = None
    dropout_grad_rel_err: dict[str, float] = field(default_factory=dict)  # under the step-0 masks (dropout > 0)
    worst_dropout_grad: str | None = None
    worst_dropout_grad_rel_err: float = math.nan
    # depth 3: {step k: {"update" | "adam_m" | "adam_v": {name: rel err}}}
    opt_rel_err: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    worst_opt: tuple[int, str, str] | None = None  # (step, quantity, parameter)
    worst_opt_rel_err: float = math.nan
    opt_first_bad: tuple[int, str, str] | None = None  # the worst at the first step out of tolerance
    opt_cause: str | None = None
    # the learning rate each training step took (probe `lr_used`) against the harness's schedule (`lr`), per backend
    rate_rel_err: dict[str, float] = field(default_factory=dict)
    rate_tol: float = math.nan
    rate_first_bad: tuple[str, int] | None = None  # (backend, optimizer step)
    rate_cause: str | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every check is within its tolerance."""
        return not self.failures

    def rows(self) -> list[dict[str, Any]]:
        """The summary table: one row per check, each with its depth (logits, gradients, dropout_gradients,
        optimizer, loss)."""
        t = self.tolerances
        lw = self.logits_where
        where = f"batch row {lw[0]}, position {lw[1]}, token {lw[2]}" if len(lw) == 3 else ""
        rows = [
            {"depth": "logits", "check": "step-0 logits max |diff|", "value": self.logits_max_abs,
             "tolerance": t.logits, "where": where},
            {"depth": "gradients", "check": "step-0 gradient rel err (worst)", "value": self.worst_grad_rel_err,
             "tolerance": t.grad, "where": self.worst_grad or ""},
        ]
        if self.dropout_grad_rel_err:
            rows.append({"depth": "dropout_gradients", "check": "step-0 gradient rel err, dropout masks",
                         "value": self.worst_dropout_grad_rel_err,
                         "tolerance": t.grad, "where": self.worst_dropout_grad or ""})
        if self.opt_rel_err:
            wo = self.worst_opt
            rows.append({"depth": "optimizer", "check": f"optimizer steps 1..{max(self.opt_rel_err)} rel err",
                         "value": self.worst_opt_rel_err, "tolerance": t.opt,
                         "where": f"step {wo[0]} {wo[1]} {wo[2]}" if wo else ""})
        if self.rate_rel_err:
            who = max(self.rate_rel_err, key=lambda n: (not math.isfinite(self.rate_rel_err[n]), self.rate_rel_err[n]))
            bad = self.rate_first_bad
            rows.append({"depth": "optimizer", "check": "learning rate per step vs schedule",
                         "value": self.rate_rel_err[who], "tolerance": self.rate_tol,
                         "where": f"{bad[0]} from step {bad[1]}" if bad else who})
        rows.append({"depth": "loss", "check": "training loss max |diff|", "value": self.loss_max_abs_dev,
                     "tolerance": t.loss,
                     "where": f"step {self.loss_peak_step} of {self.loss_steps}" if self.loss_steps else ""})
        if self.val_loss_abs_diff is not None:
            rows.append({"depth": "loss", "check": "final val loss |diff|", "value": self.val_loss_abs_diff,
                         "tolerance": t.loss,
                         "where": ", ".join(f"{k} {v:.6f}" for k, v in (self.val_loss or {}).items())})
        for row in rows:
            row["result"] = "ok" if _within(row["value"], row["tolerance"]) else "FAIL"
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready results (NaN stays NaN; json writes it as NaN)."""
        return {
            "passed": self.passed, "failures": list(self.failures),
            "tolerances": asdict(self.tolerances),
            "logits": {"max_abs_diff": self.logits_max_abs, "where": list(self.logits_where)},
            "gradients": {"worst": self.worst_grad, "worst_rel_err": self.worst_grad_rel_err,
                          "rel_err": dict(self.grad_rel_err)},
            "loss": {"max_abs_dev": self.loss_max_abs_dev, "peak_step": self.loss_peak_step,
                     "steps": self.loss_steps, "abs_dev": list(self.loss_abs_dev)},
            "val_loss": {"values": self.val_loss, "abs_diff": self.val_loss_abs_diff},
            "dropout_gradients": {"worst": self.worst_dropout_grad, "worst_rel_err": self.worst_dropout_grad_rel_err,
                                  "rel_err": dict(self.dropout_grad_rel_err)} if self.dropout_grad_rel_err else None,
            "optimizer": {
                "steps": sorted(self.opt_rel_err),
                "worst": dict(zip(("step", "quantity", "parameter"), self.worst_opt)) if self.worst_opt else None,
                "worst_rel_err": self.worst_opt_rel_err,
                "first_bad": (dict(zip(("step", "quantity", "parameter"), self.opt_first_bad))
                              if self.opt_first_bad else None),
                "cause": self.opt_cause,
                "rel_err": {str(k): v for k, v in self.opt_rel_err.items()},
            } if self.opt_rel_err else None,
            "learning_rates": {
                "rel_err": dict(self.rate_rel_err), "tolerance": self.rate_tol,
                "first_bad": dict(zip(("backend", "step"), self.rate_first_bad)) if self.rate_first_bad else None,
                "cause": self.rate_cause,
            } if self.rate_rel_err else None,
        }


def _grads(probe: Mapping[str, np.ndarray], prefix: str = GRAD_PREFIX) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: v for k, v in probe.items() if k.startswith(prefix)}


# --- the optimizer step (depth 3) ----------------------------------------------------------------------------------
def opt_steps(probe: Mapping[str, np.ndarray]) -> list[int]:
    """The training steps k >= 1 whose optimizer state the probe holds (`opt/<k>/...`), ascending."""
    steps = {int(k.split("/")[1]) for k in probe if k.startswith(OPT_PREFIX) and k.split("/")[1].isdigit()}
    return sorted(k for k in steps if k >= 1)


def opt_state(probe: Mapping[str, np.ndarray], step: int) -> dict[str, dict[str, np.ndarray]]:
    """{"param" | "adam_m" | "adam_v": {name: array}} after training step `step` (0: before the first step)."""
    out: dict[str, dict[str, np.ndarray]] = {"param": {}, "adam_m": {}, "adam_v": {}}
    head = f"{OPT_PREFIX}{step}/"
    for key, value in probe.items():
        if key.startswith(head):
            kind, _, name = key[len(head):].partition("/")
            if kind in out:
                out[kind][name] = np.asarray(value, dtype=np.float64)
    return out


def opt_quantities(probe: Mapping[str, np.ndarray], step: int) -> dict[str, dict[str, np.ndarray]]:
    """What depth 3 grades after training step `step`: {"update": p_k - p_(k-1), "adam_m": m_k, "adam_v": v_k},
    each {name: float64 array}. Without the parameters of step k - 1 the update is the parameter p_k itself."""
    now, before = opt_state(probe, step), opt_state(probe, step - 1)
    update = {n: (p - before["param"][n] if n in before["param"] and before["param"][n].shape == p.shape else p)
              for n, p in now["param"].items()}
    return {"update": update, "adam_m": now["adam_m"], "adam_v": now["adam_v"]}


def _concat(arrays: Mapping[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    return np.concatenate([np.ravel(arrays[n]) for n in names]) if names else np.zeros(0)


def _common_factor(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """The least-squares factor f with a ~ f b, and the fraction ||a - f b|| / ||a - b|| of the difference it
    leaves unexplained (0: a is exactly a scaled b; nan when a == b)."""
    bb = float(b @ b)
    f = float(a @ b) / bb if bb > 0 else math.nan
    diff = float(np.linalg.norm(a - b))
    if not (diff > 0 and math.isfinite(f)):
        return f, math.nan
    return f, float(np.linalg.norm(a - f * b)) / diff


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


def _proportional_to(d: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """alpha with d ~ alpha p (least squares) and the fraction of d it leaves unexplained."""
    pp = float(p @ p)
    nd = float(np.linalg.norm(d))
    if pp == 0 or nd == 0:
        return math.nan, math.nan
    alpha = float(d @ p) / pp
    return alpha, float(np.linalg.norm(d - alpha * p)) / nd


def diagnose_optimizer(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], step: int,
                       tol: float, gradients_agree: bool = True) -> str:
    """The likely cause of a difference first seen after training step `step`, from its pattern.

    Both backends start the step from the same state (everything agreed before it) and, when `gradients_agree`,
    with the same gradient, so the difference is the optimizer's. In the order tested:
    the gradients already differ -> not the optimizer; m off by one common factor f for every parameter and v by
    f^2 -> gradient clipping; each parameter's m off by its own factor -> clipping per parameter; m off by
    alpha * p -> coupled (L2) weight decay; m agrees, v off by one common
    factor -> beta2; then on the updates: only 1-D parameters differ -> weight decay on biases/LayerNorm; one
    common factor -> bias correction (factor changing with t) or the learning rate (constant); only the decayed
    matrices, by alpha * p -> the decoupled weight decay; concentrated where v is small -> eps.
    """
    if not gradients_agree:
        return ("the gradients already differ (see the gradient check): the optimizer step inherits it; fix the "
                "forward/backward pass first")
    qa, qb = opt_quantities(probe_a, step), opt_quantities(probe_b, step)
    base = opt_state(probe_b, step - 1)["param"]
    names = [n for n in qb["update"] if n in qa["update"] and np.shape(qa["update"][n]) == np.shape(qb["update"][n])]
    if not names:
        return "no parameters in common"

    def over(q: str, subset: Sequence[str] = names) -> list[str]:
        return [n for n in subset if n in qa[q] and n in qb[q] and not _within(relative_error(qa[q][n], qb[q][n]),
                                                                                tol)]

    one_d = [n for n in names if np.ndim(qb["update"][n]) < 2]
    matrices = [n for n in names if np.ndim(qb["update"][n]) >= 2]
    m_names = [n for n in names if n in qa["adam_m"] and n in qb["adam_m"]]
    v_names = [n for n in names if n in qa["adam_v"] and n in qb["adam_v"]]
    m_over, v_over = over("adam_m", m_names), over("adam_v", v_names)
    if m_over:
        ma, mb = _concat(qa["adam_m"], m_names), _concat(qb["adam_m"], m_names)
        f, rest = _common_factor(ma, mb)
        if step == 1 and rest < EXPLAINED:
            va, vb = _concat(qa["adam_v"], v_names), _concat(qb["adam_v"], v_names)
            fv, _ = _common_factor(va, vb)
            if v_names and math.isfinite(fv) and abs(fv - f * f) <= 0.05 * f * f:
                return (f"gradient clipping: every parameter's gradient entered AdamW scaled by one common factor "
                        f"({f:.3g} in m, {fv:.3g} = its square in v); check the max norm and the global-norm "
                        "computation")
            return f"the gradient fed to AdamW is scaled by one common factor {f:.3g} (m) for every parameter"
        if step == 1:
            own = [_common_factor(np.ravel(qa["adam_m"][n]), np.ravel(qb["adam_m"][n])) for n in m_over]
            if all(rest_n < EXPLAINED for _, rest_n in own):
                lo, hi = min(f_n for f_n, _ in own), max(f_n for f_n, _ in own)
                return (f"gradient clipping per parameter: each parameter's m is scaled by its own factor ({lo:.3g} "
                        f"to {hi:.3g}) instead of one global-norm factor")
        with_p = [n for n in m_names if n in base]
        d = _concat(qa["adam_m"], with_p) - _concat(qb["adam_m"], with_p)
        alpha, rest = _proportional_to(d, _concat(base, with_p))
        if rest < EXPLAINED:
            return (f"coupled (L2) weight decay: m differs by {alpha:.3g} x the parameter on all parameters (weight "
                    "decay added to the gradient instead of applied to the weights)")
        mat = [n for n in with_p if n in matrices]
        if mat and not [n for n in m_over if n not in mat]:
            d = _concat(qa["adam_m"], mat) - _concat(qb["adam_m"], mat)
            alpha, rest = _proportional_to(d, _concat(base, mat))
            if rest < EXPLAINED:
                return (f"coupled (L2) weight decay: m differs by {alpha:.3g} x the parameter on the decayed "
                        "matrices (weight decay added to the gradient instead of applied to the weights, AdamW)")
        return "the first moment m differs: beta1, or the gradient fed to AdamW"
    if v_over:
        va, vb = _concat(qa["adam_v"], v_names), _concat(qb["adam_v"], v_names)
        fv, rest = _common_factor(va, vb)
        if rest < EXPLAINED:
            return (f"beta2: m agrees but v differs by one common factor {fv:.3g} for every parameter "
                    f"(after step {step})")
        return "the second moment v differs (beta2, or the squared gradient) while m agrees"
    u_over = over("update")
    if not u_over:
        return "no single pattern (the parameters differ, the updates and moments do not)"
    if not [n for n in u_over if n in matrices]:
        return ("weight decay applied to 1-D parameters (biases, LayerNorm weights): only 1-D parameters' updates "
                f"differ ({', '.join(u_over[:3])}{', ...' if len(u_over) > 3 else ''})")
    ua, ub = _concat(qa["update"], names), _concat(qb["update"], names)
    f, share = _typical_factor(ua, ub)
    if share >= 1 - EXPLAINED and abs(f - 1) > 0.01:
        factors = []
        for k in opt_steps(probe_b):
            a_k, b_k = opt_quantities(probe_a, k)["update"], opt_quantities(probe_b, k)["update"]
            common = [n for n in names if n in a_k and n in b_k]
            factors.append(_typical_factor(_concat(a_k, common), _concat(b_k, common))[0])
        shown = ", ".join(f"{x:.3g}" for x in factors)
        if len(factors) > 1 and max(factors) - min(factors) > 0.02 * abs(factors[0]):
            return (f"bias correction: every parameter's update is off by one common factor that changes with t "
                    f"({shown} at steps 1..{len(factors)}); a missing correction gives (1-beta1^t)/sqrt(1-beta2^t)")
        return (f"the step size: every parameter's update is off by one common factor ({shown} at steps "
                f"1..{len(factors)}): learning rate or bias correction (missing: 3.16 at t=1 for betas 0.9, 0.999)")
    if not [n for n in u_over if n in one_d]:
        with_p = [n for n in matrices if n in base]
        d = _concat(qa["update"], with_p) - _concat(qb["update"], with_p)
        alpha, rest = _proportional_to(d, _concat(base, with_p))
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
    return "the update rule differs (learning rate, bias correction, eps or weight decay)"


def _compare_grads(ga: dict[str, np.ndarray], gb: dict[str, np.ndarray], tol: float, what: str,
                   backends: tuple[str, str], fail: Any, required: bool = False, cause: str | None = None
                   ) -> tuple[dict[str, float], str | None, float]:
    """Per-parameter relative errors of two gradient sets, the worst one, and FAIL lines through `fail`."""
    a, b = backends
    errs: dict[str, float] = {}
    for name in sorted(set(ga) ^ set(gb)):
        fail(f"FAIL: {what} {name} missing from the {a if name not in ga else b} probe")
    for name in [n for n in ga if n in gb]:
        if np.shape(ga[name]) != np.shape(gb[name]):
            fail(f"FAIL: {what} {name} shapes differ: {a} {np.shape(ga[name])} vs {b} {np.shape(gb[name])}")
            errs[name] = math.nan
        else:
            errs[name] = relative_error(ga[name], gb[name])
    if required and not ga and not gb:
        fail("FAIL: no gradients in either probe")
    if not errs:
        return errs, None, math.nan
    worst = max(errs, key=lambda n: (not math.isfinite(errs[n]), errs[n]))
    over = [n for n, e in errs.items() if not _within(e, tol)]
    if over:
        more = f" ({len(over) - 1} more parameter(s) over tol)" if len(over) > 1 else ""
        fail(f"FAIL: {what} {worst} rel err {_fmt(errs[worst])} > tol {tol:g}{more}"
             + (f"; {cause}" if cause else ""))
    return errs, worst, errs[worst]


def _compare_optimizer(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], tol: float,
                       backends: tuple[str, str], r: ParityResult, grads_ok: bool, config: Any = None) -> None:
    """Depth 3 into `r`: per step and parameter, the relative error of the update and of m and v."""
    a, b = backends
    sa, sb = opt_steps(probe_a), opt_steps(probe_b)
    if not sa and not sb:
        return  # probes from before the optimizer check (or a kit that does not ask for it)
    if sa != sb:
        r.failures.append(f"FAIL: optimizer steps recorded differ: {a} {sa} vs {b} {sb}")
    worst_key = (False, -1.0)
    for k in [k for k in sa if k in sb]:
        qa, qb = opt_quantities(probe_a, k), opt_quantities(probe_b, k)
        step_err: dict[str, dict[str, float]] = {}
        for q in OPT_QUANTITIES:
            errs = step_err[q] = {}
            for name in sorted(set(qa[q]) ^ set(qb[q])):
                r.failures.append(f"FAIL: optimizer step {k} {q} of {name} missing from the "
                                  f"{a if name not in qa[q] else b} probe")
            for name in [n for n in qa[q] if n in qb[q]]:
                shape_ok = np.shape(qa[q][name]) == np.shape(qb[q][name])
                errs[name] = relative_error(qa[q][name], qb[q][name]) if shape_ok else math.nan
                key = (not math.isfinite(errs[name]), errs[name] if math.isfinite(errs[name]) else 0.0)
                if key > worst_key:
                    worst_key, r.worst_opt, r.worst_opt_rel_err = key, (k, q, name), errs[name]
        r.opt_rel_err[k] = step_err
        bad = [(q, n, e) for q, errs in step_err.items() for n, e in errs.items() if not _within(e, tol)]
        if bad and r.opt_first_bad is None:
            q, n, e = max(bad, key=lambda t: (not math.isfinite(t[2]), t[2] if math.isfinite(t[2]) else 0.0))
            r.opt_first_bad = (k, q, n)
            synced = [s for s in sa if s <= k and s in sb and (s == 1 or s - 1 in sa)]  # from a common state
            r.opt_cause = ((config is not None and grads_ok and diagnose_schedule(
                rate_ratios(probe_a, probe_b) or update_ratios(probe_a, probe_b, synced), config, backends))
                or diagnose_optimizer(probe_a, probe_b, k, tol, gradients_agree=grads_ok))
            what = {"update": "update", "adam_m": "AdamW m", "adam_v": "AdamW v"}[q]
            params = {p for _, p, _ in bad}
            more = f" ({len(params) - 1} more parameter(s) over tol)" if len(params) > 1 else ""
            r.failures.append(f"FAIL: optimizer step {k}: {n} {what} rel err {_fmt(e)} > tol {tol:g}{more}; "
                              f"likely cause: {r.opt_cause}")


def compare(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray],
            losses_a: Sequence[float], losses_b: Sequence[float], tolerances: Tolerances,
            val_losses: tuple[float, float] | None = None, backends: tuple[str, str] = ("a", "b"),
            config: Any = None) -> ParityResult:
    """Compare two backends' step-0 probes and training-loss curves, in float64.

    A probe maps "logits" (B, T, V), "x", "y" (the batch) and "grad/<canonical name>" to arrays, as the worker's
    `<backend>.probe.npz`; optionally "dropout_grad/<name>" (gradients under the step-0 dropout masks) and
    "opt/<k>/param|adam_m|adam_v/<name>" (the state after training step k; k = 0: the parameters before it),
    graded by depth 3 with `tolerances.opt` and `diagnose_optimizer`. `losses_*` are the per-step training
    losses, `val_losses` the two final validation losses (checked against the loss tolerance); `config` (the run's
    harness Config, optional) lets the FAIL lines name option and schedule causes (diagnose_gelu, diagnose_tying,
    diagnose_schedule). Every deviation
    beyond its tolerance, a NaN, a missing or misshapen array or a different batch is a failure, named in
    `result.failures`.
    """
    a, b = backends
    r = ParityResult(backends=(a, b), tolerances=tolerances)
    fail = r.failures.append
    for key in ("x", "y"):
        if key in probe_a and key in probe_b and not np.array_equal(probe_a[key], probe_b[key]):
            fail(f"FAIL: the probes used different batches ({key} differs): the comparison is meaningless")
    # (a) logits
    if "logits" not in probe_a or "logits" not in probe_b:
        fail(f"FAIL: logits missing from the {a if 'logits' not in probe_a else b} probe")
    elif np.shape(probe_a["logits"]) != np.shape(probe_b["logits"]):
        fail(f"FAIL: logits shapes differ: {a} {np.shape(probe_a['logits'])} vs {b} {np.shape(probe_b['logits'])}")
    else:
        r.logits_max_abs, r.logits_where = max_abs_diff(probe_a["logits"], probe_b["logits"])
        if not _within(r.logits_max_abs, tolerances.logits):
            fail(f"FAIL: logits max abs diff {_fmt(r.logits_max_abs)} > tol {tolerances.logits:g}"
                 + _cause(config and diagnose_gelu(probe_a, probe_b, config, (a, b))))
    # (b) gradients (and, with dropout, the gradients under the harness's step-0 masks)
    tying = diagnose_tying(_grads(probe_a), _grads(probe_b), probe_b.get("x"), tolerances.grad)
    r.grad_rel_err, r.worst_grad, r.worst_grad_rel_err = _compare_grads(
        _grads(probe_a), _grads(probe_b), tolerances.grad, "gradient", (a, b), fail, required=True,
        cause=f"likely cause: {tying}" if tying else None)
    grads_ok = all(_within(e, tolerances.grad) for e in r.grad_rel_err.values())
    if any(k.startswith(DROPOUT_GRAD_PREFIX) for k in (*probe_a, *probe_b)):
        r.dropout_grad_rel_err, r.worst_dropout_grad, r.worst_dropout_grad_rel_err = _compare_grads(
            _grads(probe_a, DROPOUT_GRAD_PREFIX), _grads(probe_b, DROPOUT_GRAD_PREFIX), tolerances.grad,
            "gradient with dropout masks", (a, b), fail,
            cause=("likely cause: dropout (placement or scaling; the gradients agree with dropout off)"
                   if grads_ok and r.grad_rel_err else None))
        grads_ok = grads_ok and all(_within(e, tolerances.grad) for e in r.dropout_grad_rel_err.values())
    # (c) the optimizer step
    _compare_optimizer(probe_a, probe_b, tolerances.opt, (a, b), r, grads_ok, config)
    _compare_rates(probe_a, probe_b, tolerances.opt / 100, (a, b), r, config)
    # (d) the training-loss curve
    r.loss_steps = min(len(losses_a), len(losses_b))
    if len(losses_a) != len(losses_b):
        fail(f"FAIL: training ran {len(losses_a)} steps in {a} but {len(losses_b)} in {b}")
    r.loss_max_abs_dev, r.loss_peak_step, r.loss_abs_dev = loss_deviation(losses_a, losses_b)
    if r.loss_steps == 0:
        fail("FAIL: no training losses to compare")
    elif not _within(r.loss_max_abs_dev, tolerances.loss):
        fail(f"FAIL: training loss max abs dev {_fmt(r.loss_max_abs_dev)} at step {r.loss_peak_step} "
             f"> tol {tolerances.loss:g}")
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
    return df[["value", "tolerance", "result", "where"]].to_string()


def format_gradients(result: ParityResult) -> str:
    """Per-parameter gradient relative errors as text, worst first."""
    import pandas as pd

    items = sorted(result.grad_rel_err.items(), key=lambda kv: (math.isfinite(kv[1]), -kv[1] if kv[1] == kv[1]
                                                                   else 0.0))
    df = pd.DataFrame({"rel err": [_fmt(v) for _, v in items]}, index=[k for k, _ in items])
    df.index.name = "parameter"
    return df.to_string()


def format_optimizer(result: ParityResult) -> str:
    """Per-parameter optimizer-step relative errors (update, m, v; worst over the steps) as text, worst first."""
    import pandas as pd

    names = sorted({n for step in result.opt_rel_err.values() for errs in step.values() for n in errs})
    table = {q: [max((step[q].get(n, 0.0) for step in result.opt_rel_err.values()),
                     key=lambda e: (not math.isfinite(e), e if math.isfinite(e) else 0.0)) for n in names]
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
    decay term too), so s is rate_b / rate_a; NaN where a backend did not move."""
    out: dict[int, tuple[float, float]] = {}
    for k in steps:
        ua, ub = opt_quantities(probe_a, k)["update"], opt_quantities(probe_b, k)["update"]
        names = [n for n in ub if n in ua and np.shape(ua[n]) == np.shape(ub[n])]
        a, b = _concat(ua, names), _concat(ub, names)
        aa, bb, ab = float(a @ a), float(b @ b), float(a @ b)
        out[k] = (ab / aa if aa > 0 else math.nan, ab / bb if bb > 0 else math.nan)
    return out


def rate_ratios(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray]
                ) -> dict[int, tuple[float, float]] | None:
    """Per training step k (1-based): (rate_b / rate_a, rate_a / rate_b) of the learning rates the two backends'
    steps took (the probes' `lr_used`, each measured from that backend's own consecutive states by
    harness.schedule.effective_rate, so what the other backend did before does not enter); None without them."""
    if "lr_used" not in probe_a or "lr_used" not in probe_b:
        return None
    ra, rb = (np.asarray(p["lr_used"], dtype=np.float64).ravel() for p in (probe_a, probe_b))
    n = min(len(ra), len(rb))
    return {k + 1: (rb[k] / ra[k] if ra[k] else math.nan, ra[k] / rb[k] if rb[k] else math.nan) for k in range(n)}


def diagnose_schedule(ratios: Mapping[int, tuple[float, float]], config: Any,
                      backends: tuple[str, str] = ("a", "b")) -> str | None:
    """The learning-rate schedule a backend used, when it is a known mistake: `ratios` from `update_ratios` (steps
    where both backends started from the same state), `config` the run's (harness.schedule gives the rates).

    Hypotheses: the warm-up off by one step (the rate of the step after, or before, with 0 at the first step; or
    nanoGPT's old lr * it / warmup), the cosine decaying to 0 instead of min_lr, no warm-up, the schedule ignored (a
    constant learning_rate). A backend's implied rates are the schedule's times its ratio (b: s, a: t); a hypothesis
    fits when, at the step where it differs most from the schedule, it explains all but EXPLAINS of the difference,
    and at every step the implied rate is no further from it than that.
    """
    from harness.schedule import learning_rate

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
                   backends: tuple[str, str], r: ParityResult, config: Any) -> None:
    """Into `r`: per backend, the worst relative error of the rate its steps took (`lr_used`) against the
    harness's schedule (`lr`), the first step over `tol` and, from the pattern, the likely cause. Each backend
    is measured on its own states, so drift between the two cannot enter; a FAIL line when over `tol`."""
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
        r.failures.append(line)


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
    from python_impl import numpy_gpt

    params = opt_state(probe_b, 0)["param"] or opt_state(probe_a, 0)["param"]
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


def _cause(cause: str | None) -> str:
    """`; likely cause: ...` for a FAIL line, or nothing."""
    return f"; likely cause: {cause}" if cause else ""


# --- the command -------------------------------------------------------------------------------------------------
# Exit statuses of `harness parity`: a script can tell a numerical disagreement from a backend that never got to
# be compared. Printed by `harness parity --help`.
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_CRASH, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_STATUSES = f"""exit status:
  {EXIT_PASS}    pass: every check within its tolerance
  {EXIT_FAIL}    FAIL: both backends ran and differ beyond a tolerance (the table and the FAIL lines say where)
  {EXIT_USAGE}    bad input: one line on stderr, nothing run (or a backend refused its input)
  {EXIT_CRASH}    a backend crashed or left no result: nothing was compared (parity.json: verdict "error")
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C or SIGTERM)"""
def _float(text: str) -> float:
    # parsed loosely here, validated in `command` (a UsageError: one line, exit 2, nothing written)
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `harness parity` (the common --size/--config/--data/--device/--seed/--out/--dtype are added
    by the CLI), and the exit statuses in its --help."""
    p.epilog = EXIT_STATUSES
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_backend(p, f"the two backends to compare (torch, numpy, flux), in the order the report names them: "
                f"--backend torch --backend numpy or --backend torch,numpy ({DEFAULT_BACKENDS})")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                   help=f"training steps, all of whose losses are compared ({DEFAULT_STEPS})")
    p.add_argument("--tol-logits", type=_float, metavar="X",
                   help="max abs difference of the step-0 logits (default: measured per precision pair and size, "
                        "see docs/parity.md)")
    p.add_argument("--tol-grad", type=_float, metavar="X",
                   help="max relative error of any parameter's step-0 gradient (default: measured)")
    p.add_argument("--tol-loss", type=_float, metavar="X",
                   help="max abs difference of the per-step training loss and the final val loss "
                        "(default: measured)")
    p.add_argument("--tol-opt", type=_float, metavar="X",
                   help="max relative error of any parameter's update or AdamW moment after each of the first "
                        "--opt-steps steps (default: measured)")
    p.add_argument("--opt-steps", type=int, default=DEFAULT_OPT_STEPS, metavar="K",
                   help=f"training steps after which the optimizer state is compared ({DEFAULT_OPT_STEPS})")
    p.add_argument("--dropout", type=_float, default=0.0, metavar="P",
                   help="dropout probability; with P > 0 the harness draws every mask and hands the same masks to "
                        "both backends (0)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help=f"{THREADS_HELP}; default 1, unlike run and sweep: one thread fixes every reduction's "
                        "order, so a rerun gives bit-identical numbers (parity times nothing)")
    p.add_argument("--per-parameter", action="store_true",
                   help="also print every parameter's gradient and optimizer-step error")
    add_quiet(p)


def parse_backends(values: str | list[str] | None) -> list[str]:
    """The two backend names of --backend (repeated or comma-separated; default torch,numpy); UsageError for
    anything else."""
    from harness.options import pick_backends

    names = pick_backends(values if values else DEFAULT_BACKENDS, repeats=True)
    text = ",".join(names)
    if len(names) != 2:
        raise UsageError(f"--backend {text}: parity compares exactly two backends, got {len(names)}; "
                         "pass two, e.g. --backend torch --backend numpy")
    if names[0] == names[1]:
        raise UsageError(f"--backend {text}: the same backend twice; compare two different backends "
                         "(use --dtype to vary precision)")
    return names


def backend_dtype(name: str, requested: str | None) -> tuple[str, dict]:
    """The dtype backend `name` will compute in and the options that ask for it.

    --dtype applies to every backend whose constructor takes a dtype; the others keep their own default.
    """
    from harness.backends import backend_class

    default = FALLBACK_DTYPES.get(name, "float32")
    try:
        params = inspect.signature(backend_class(name).__init__).parameters
    except Exception:  # an unavailable backend: preflight reports it
        return (requested or default), ({"dtype": requested} if requested else {})
    if "dtype" not in params:
        return default, {}
    own = params["dtype"].default
    own = own if isinstance(own, str) else default
    return (requested, {"dtype": requested}) if requested else (own, {})


def resolve_tolerances(args: argparse.Namespace, pair: str) -> tuple[Tolerances, dict[str, str]]:
    """Command-line tolerances over the measured defaults of `pair` and the size preset (none for --config, nor
    for a preset changed by --set: the preset's were measured on its own model and schedule); also says where each
    came from."""
    size = None if getattr(args, "config", None) or getattr(args, "set", None) else getattr(args, "size", None)
    base = default_tolerances(pair, size)
    why = ", --set changes the preset" if getattr(args, "set", None) else ""
    where = (f"default ({pair} pair, {size} preset)" if size else
             f"default ({pair} pair, loosest over the presets{why})")
    chosen, source = {}, {}
    for key in TOL_KEYS:
        given = getattr(args, f"tol_{key}", None)
        chosen[key] = getattr(base, key) if given is None else given
        source[key] = where if given is None else "command line"
    tol = Tolerances(**chosen)
    tol.validate()
    return tol, source


def _load_probe(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _final_val(rec: dict) -> float | None:
    evals = rec.get("evals") or []
    return float(evals[-1]["val_loss"]) if evals else None


def command(args: argparse.Namespace) -> int:
    """`harness parity`: run two backends in parity mode, compare, write parity.json; the exit status is one of
    `EXIT_STATUSES` (0 pass, 1 numerical FAIL, 2 bad input, 3 a backend crashed, 130 interrupted)."""
    from harness import launch, records
    from harness.config import load_config
    from harness.data import load_corpus
    from harness.devices import parity_options, parse_devices

    # --- validate everything before anything is written ---
    backends = parse_backends(args.backend)
    args.size = pick_sizes(args.size, one=True)[0]
    if not isinstance(args.steps, int) or args.steps <= 0:
        raise UsageError(f"--steps must be a positive whole number, got {args.steps!r}")
    opt_k = getattr(args, "opt_steps", DEFAULT_OPT_STEPS)
    if not isinstance(opt_k, int) or opt_k < 0:
        raise UsageError(f"--opt-steps must be a whole number >= 0, got {opt_k!r}")
    dropout = getattr(args, "dropout", 0.0) or 0.0
    if not (math.isfinite(dropout) and 0.0 <= dropout < 1.0):
        raise UsageError(f"--dropout must be a number in [0, 1), got {dropout!r}")
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be a positive whole number, got {threads!r}")
    dtypes, options = {}, {}
    for name in backends:
        dtypes[name], options[name] = backend_dtype(name, args.dtype)
        options[name].update(parity_options(name))  # torch: single-tensor AdamW, math attention on CUDA
    device, devices = parse_devices(args.device, backends)  # --device DEVICE or NAME=DEVICE (repeatable)
    pair = precision_pair(*(dtypes[n] for n in backends))
    tolerances, tol_source = resolve_tolerances(args, pair)
    from harness.nanogpt import parse_sets

    config = load_config(args.size, args.config, parse_sets(getattr(args, "set", None))).replace(
        dropout=dropout, steps=args.steps)
    corpus = load_corpus(args.data)
    progress = not getattr(args, "quiet", False)
    plan = launch.Plan(config=config, corpus=corpus, backends=backends, device=device, seed=args.seed,
                       out=args.out, backend_options=options, text=False, parity={"opt_steps": opt_k},
                       progress=progress, threads=threads, devices=devices)
    try:
        launch.preflight(plan)
    except ImportError as exc:  # a registered backend whose module or framework is not installed
        raise UsageError(f"a backend cannot be loaded ({exc}); see `harness doctor`") from None

    # --- run ---
    run_id = launch.write_spec(plan)
    directory = records.run_dir(plan.out, run_id)
    drop = f"dropout {dropout:g} (shared masks)" if dropout else "dropout 0"
    print(f"parity {run_id}: {config.name}, {args.steps} steps, {drop}, {backends[0]} ({dtypes[backends[0]]}) "
          f"vs {backends[1]} ({dtypes[backends[1]]}) on {' / '.join(devices[n] for n in backends)}", file=sys.stderr)
    codes = launch.execute(directory, backends, progress=progress, threads=threads)
    record: dict[str, Any] = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "run_id": run_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config.to_dict(), "config_name": config.name, "steps": args.steps, "seed": args.seed,
        "dropout": dropout, "opt_steps": opt_k, "threads": threads,
        "device": device, "devices": devices, "backends": backends, "dtypes": dtypes, "precision_pair": pair,
        "tolerances": asdict(tolerances), "tolerance_source": tol_source,
        "data": {"path": corpus.path, "sha256": corpus.sha256}, "worker_exit_codes": codes,
        "files": {n: {"record": f"{n}.json", "probe": f"{n}.probe.npz"} for n in backends},
    }
    path = directory / "parity.json"
    broken = {n: c for n, c in codes.items() if c != 0}
    if broken or len(codes) != len(backends):
        reason = ", ".join(f"{n} exited {c}" for n, c in broken.items()) or "a backend did not run"
        record.update(verdict="error", failures=[f"ERROR: {reason}; nothing compared"], results=None)
        records.atomic_write_json(path, record)
        print(f"ERROR: {reason}; nothing compared (see the messages above)", file=sys.stderr)
        print(f"parity record: {path}")
        return (EXIT_INTERRUPTED if EXIT_INTERRUPTED in codes.values() else EXIT_USAGE if EXIT_USAGE in codes.values()
                else EXIT_CRASH)

    # --- compare ---
    _, recs = records.load_run(plan.out, run_id)
    by_name = {rec["backend"]: rec for rec in recs}
    ra, rb = by_name[backends[0]], by_name[backends[1]]
    for name, rec in ((backends[0], ra), (backends[1], rb)):
        actual = (rec.get("backend_info") or {}).get("dtype")
        if isinstance(actual, str) and actual != dtypes[name]:
            dtypes[name] = actual  # what the backend says it computed in wins
    if precision_pair(*(dtypes[n] for n in backends)) != pair:
        pair = precision_pair(*(dtypes[n] for n in backends))
        tolerances, tol_source = resolve_tolerances(args, pair)
        record.update(precision_pair=pair, tolerances=asdict(tolerances), tolerance_source=tol_source)
    missing = [n for n in backends if not (directory / f"{n}.probe.npz").is_file()]
    if missing:
        reason = f"no step-0 probe from {', '.join(missing)}"
        record.update(verdict="error", failures=[f"ERROR: {reason}; nothing compared"], results=None)
        records.atomic_write_json(path, record)
        print(f"ERROR: {reason}; nothing compared", file=sys.stderr)
        print(f"parity record: {path}")
        return EXIT_CRASH
    va, vb = _final_val(ra), _final_val(rb)
    result = compare(_load_probe(directory / f"{backends[0]}.probe.npz"),
                     _load_probe(directory / f"{backends[1]}.probe.npz"),
                     ra["steps"]["loss"], rb["steps"]["loss"], tolerances,
                     val_losses=(va, vb) if va is not None and vb is not None else None,
                     backends=(backends[0], backends[1]), config=config)
    for problem in launch.compare_fingerprints([ra, rb]):
        result.failures.append(f"FAIL: {problem}")
    record.update(verdict="pass" if result.passed else "fail", failures=list(result.failures),
                  results=result.to_dict(), dtypes=dtypes,
                  backend_info={n: by_name[n].get("backend_info", {}) for n in backends})
    records.atomic_write_json(path, record)

    print(format_table(result))
    if getattr(args, "per_parameter", False):
        print()
        print(format_gradients(result))
        if result.opt_rel_err:
            print()
            print(format_optimizer(result))
    for line in result.failures:
        print(line)
    if result.passed:
        print(f"PASS: {backends[0]} ({dtypes[backends[0]]}) and {backends[1]} ({dtypes[backends[1]]}) agree "
              f"within tolerance over {result.loss_steps} steps")
    print(f"parity record: {path}")
    return EXIT_PASS if result.passed else EXIT_FAIL
