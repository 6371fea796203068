"""The likely cause of a difference in the optimizer step (depth 3), read from its pattern.

Both sides took training step k from the same state (re-synchronised: the reference's after step k - 1), so a
difference is the step's own. `diagnose_optimizer` tests one hypothesis after the other, each in its own function
(docs/parity.md, "Diagnoses"): the step counter, a scaled gradient (clipping, beta1), the first moment (coupled weight
decay, beta1), the second moment (beta2), which parameters are decayed, then the updates alone (weight decay on 1-D
parameters, one common factor: the step counter, bias correction or the learning rate; the decoupled decay; eps).
The pattern readers before it (`decay_cause`, `step_counter_cause`, `aliased_quantities`) serve the comparison too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.parity.numeric import common_factor, proportional, relative_error, update_error, within
from harness.parity.states import (
    adam_t,
    concat,
    hyper_value,
    opt_quantities,
    opt_steps,
    start_state,
    step_rate,
    synchronised,
)
from harness.run.probe import STATE_QUANTITIES, state_at

EXPLAINED = 0.1  # a pattern "explains" a difference when it leaves less than this fraction of it unexplained


UPDATE_RULE = "the update rule differs (learning rate, bias correction, eps or weight decay)"  # no pattern fits


WRONG_STEP_INPUTS = ("the step's forward pass: its loss differs although both sides started the step from the same "
                     "state and every step-0 check agrees: the wrong batch or dropout masks for this step (an "
                     "off-by-one in the training loop), or dropout active only in the training step")


def effective_gradient(m: np.ndarray, m_before: np.ndarray, beta1: float) -> np.ndarray:
    """The gradient AdamW received in a step that took m_before to m: (m - beta1 m_before) / (1 - beta1)."""
    return (m - beta1 * m_before) / (1 - beta1)


def decay_ratios(update_a: Mapping[str, np.ndarray], update_b: Mapping[str, np.ndarray],
                 before: Mapping[str, np.ndarray], lr_wd: float) -> dict[str, tuple[float, float]]:
    """Per parameter: the ratio r with update_a - update_b ~ r * lr * wd * p (p the parameter both started the step
    from) and the fraction of the difference it leaves unexplained; r = +-1 exactly: one side decays the parameter
    and the other does not. Parameters that are all zero or whose updates are equal are left out."""
    out = {}
    for name, ua in update_a.items():
        p = before.get(name)
        if name not in update_b or p is None or np.shape(p) != np.shape(ua):
            continue
        r, rest = proportional(np.ravel(ua - update_b[name]), np.ravel(p) * lr_wd)
        if math.isfinite(r):
            out[name] = (r, rest)
    return out


def decay_cause(ratios: Mapping[str, tuple[float, float]], shapes: Mapping[str, tuple[int, ...]],
                names: tuple[str, str]) -> tuple[list[str], str] | None:
    """The parameters whose update differs by exactly +-1 x lr x wd x p, and the sentence naming the convention;
    None when none does. Exact to 3 %: rounding noise is not proportional to p, so it never gives +-1."""
    hit = [n for n, (r, rest) in ratios.items() if abs(abs(r) - 1) < 0.03 and rest < 0.1]
    if not hit:
        return None
    a, b = names
    shown = ", ".join(f"{n} {ratios[n][0]:+.3f}" for n in hit[:4]) + (", ..." if len(hit) > 4 else "")
    undecayed = a if ratios[hit[0]][0] > 0 else b
    if set(hit) <= {"wte.weight", "wpe.weight"}:
        return hit, (f"weight decay on the embeddings: the update of {' and '.join(hit)} differs by exactly "
                     f"lr x wd x p ({shown}; 0 elsewhere): {undecayed} does not decay the embeddings (minGPT's "
                     "convention), nanoGPT decays every parameter with >= 2 dimensions")
    if all(len(shapes.get(n, ())) < 2 for n in hit):
        return hit, (f"weight decay applied to 1-D parameters (biases, LayerNorm weights): their updates differ by "
                     f"exactly lr x wd x p ({shown})")
    return hit, (f"which parameters are decayed: the updates of {len(hit)} parameter(s) differ by exactly "
                 f"lr x wd x p ({shown}); {undecayed} does not decay them")


def bias_correction_factor(t: int, beta1: float, beta2: float) -> float:
    """The factor AdamW's bias corrections give the update at step t: sqrt(1 - beta2^t) / (1 - beta1^t)."""
    return math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)


def step_counter_cause(factor: float, step: int, beta1: float, beta2: float,
                       names: tuple[str, str] = ("a", "b")) -> str | None:
    """Every update of side a off by one common `factor` against side b's at training step `step`: the factor the
    bias correction gives when one side uses another t (a step counter that stopped or restarted), or None."""
    want = bias_correction_factor(step, beta1, beta2)
    for t in range(1, step + 50):
        if t == step:
            continue
        ratio = bias_correction_factor(t, beta1, beta2) / want
        for side, f in ((names[0], ratio), (names[1], 1 / ratio)):
            if abs(f - factor) < 0.005 * abs(factor):
                return (f"AdamW's step counter: the update is off by {factor:.4g}, exactly what the bias correction "
                        f"gives when {side} uses t = {t} at step {step} (a counter that stops, restarts or is not "
                        "restored)")
    return None


def aliased_quantities(probe: Mapping[str, np.ndarray], steps: Sequence[int]) -> list[str]:
    """The optimizer quantities (param, adam_m, adam_v) whose arrays after every step in `steps` (>= 2 of them) are
    identical, for every parameter: the same arrays saved by reference, not copied."""
    if len(steps) < 2:
        return []
    first, *later = (state_at(probe, k) for k in steps)
    out = []
    for quantity in STATE_QUANTITIES:
        head = f"{quantity}/"
        names = [k for k in first if k.startswith(head)]
        if names and all(np.array_equal(first[n], state.get(n)) for n in names for state in later):
            out.append(quantity)
    return out




def typical_factor(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
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


# --- diagnose_optimizer and its hypotheses ---------------------------------------------------------------------------
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
    counter = _counter_cause(probe_a, probe_b, step, names)
    if counter:
        return counter
    s = _read_step(probe_a, probe_b, step, tol, before, hyper, names)
    if s is None:
        return "no parameters in common"
    if s.m_over:
        return _gradient_scale_cause(s) or _first_moment_cause(s)
    if s.v_over:
        return _second_moment_cause(s)
    return _decayed_parameters_cause(s) or _update_cause(s, probe_a, probe_b)


@dataclass
class _Step:
    """One training step as both sides took it, read for the hypotheses: the updates and moments after it (`qa`,
    `qb`), the state it started from, the config's numbers the patterns need (None: unknown), and which parameters
    are over tolerance."""

    step: int
    tol: float
    names: tuple[str, str]  # the two sides, as the sentences name them
    synced: bool  # both updates from the common state (re-synchronised), else each from its own previous state
    base: dict[str, np.ndarray]  # the parameters the step started from
    qa: dict[str, dict[str, np.ndarray]]
    qb: dict[str, dict[str, np.ndarray]]
    params: list[str]  # the parameters both sides hold, of the same shape
    m_before: dict[str, np.ndarray]
    v_before: dict[str, np.ndarray]
    beta1: float | None
    beta2: float | None
    lr: float | None
    wd: float | None
    fresh: bool = field(init=False)  # step 1: m and v start at zero
    one_d: list[str] = field(init=False)
    matrices: list[str] = field(init=False)
    m_names: list[str] = field(init=False)
    v_names: list[str] = field(init=False)
    m_over: list[str] = field(init=False)
    v_over: list[str] = field(init=False)

    def __post_init__(self) -> None:
        qa, qb, params = self.qa, self.qb, self.params
        self.fresh = all(not np.any(self.m_before[n]) for n in params)
        self.one_d = [n for n in params if np.ndim(qb["update"][n]) < 2]
        self.matrices = [n for n in params if np.ndim(qb["update"][n]) >= 2]
        self.m_names = [n for n in params if n in qa["adam_m"] and n in qb["adam_m"]]
        self.v_names = [n for n in params if n in qa["adam_v"] and n in qb["adam_v"]]
        self.m_over, self.v_over = self.over("adam_m", self.m_names), self.over("adam_v", self.v_names)

    def over(self, q: str, subset: Sequence[str] | None = None) -> list[str]:
        """The parameters of `subset` (default: every one in common) whose quantity `q` is out of tolerance."""
        qa, qb = self.qa, self.qb

        def err(n: str) -> float:
            if q == "update":
                return update_error(qa[q][n], qb[q][n], qa["adam_v"].get(n), qb["adam_v"].get(n))
            return relative_error(qa[q][n], qb[q][n])
        return [n for n in (self.params if subset is None else subset)
                if n in qa[q] and n in qb[q] and not within(err(n), self.tol)]

    def fed(self, q: Mapping[str, np.ndarray], n: str) -> np.ndarray:
        """The gradient a side fed AdamW (from its m), or m itself when beta1 is unknown (exact at step 1)."""
        if self.beta1 is None:
            return q["adam_m"][n]
        return effective_gradient(q["adam_m"][n], self.m_before[n], self.beta1)

    def fed_square(self, q: Mapping[str, np.ndarray], n: str) -> np.ndarray:
        """The squared gradient a side fed AdamW (from its v), or v itself when beta2 is unknown."""
        if self.beta2 is None:
            return q["adam_v"][n]
        return (q["adam_v"][n] - self.beta2 * self.v_before[n]) / (1 - self.beta2)

    def joined(self, q: Mapping[str, np.ndarray], what: Callable[[Mapping[str, np.ndarray], str], np.ndarray],
               names: Sequence[str]) -> np.ndarray:
        """`what(q, n)` of every parameter of `names`, joined (`fed` or `fed_square`)."""
        return concat({n: what(q, n) for n in names}, names)


def _read_step(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], step: int, tol: float,
               before: Mapping[str, Mapping[str, np.ndarray]] | None, hyper: Mapping[str, Any] | None,
               names: tuple[str, str]) -> _Step | None:
    """Training step `step` of both probes from the state it started from (`before`, default `start_state`); None
    when the two sides have no parameter in common."""
    synced = before is not None or synchronised(probe_a, probe_b) is not None
    start = before if before is not None else start_state(probe_a, probe_b, step)
    base = dict(start["param"])
    # re-synchronised, both updates are from the common state; two free runs: each from its own previous state
    qa, qb = (opt_quantities(p, step, base if synced else None) for p in (probe_a, probe_b))
    params = [n for n in qb["update"] if n in qa["update"] and np.shape(qa["update"][n]) == np.shape(qb["update"][n])]
    if not params:
        return None
    m_before = {n: start.get("adam_m", {}).get(n, np.zeros_like(base.get(n, qb["adam_m"].get(n, 0.0))))
                for n in params}
    v_before = {n: start.get("adam_v", {}).get(n, np.zeros_like(base.get(n, qb["adam_v"].get(n, 0.0))))
                for n in params}
    return _Step(step=step, tol=tol, names=names, synced=synced, base=base, qa=qa, qb=qb, params=params,
                 m_before=m_before, v_before=v_before, beta1=hyper_value(hyper, "beta1"),
                 beta2=hyper_value(hyper, "beta2"), lr=step_rate(probe_a, probe_b, step, hyper),
                 wd=hyper_value(hyper, "weight_decay"))


def _counter_cause(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], step: int,
                   names: tuple[str, str]) -> str | None:
    """AdamW's step counters, as the probes recorded them, differ after the step."""
    a_name, b_name = names
    ta, tb = adam_t(probe_a, step), adam_t(probe_b, step)
    if ta is not None and tb is not None and ta != tb:
        return (f"AdamW's step counter: after step {step} {a_name}'s t is {ta}, {b_name}'s {tb} (the bias "
                "correction uses t: a counter that stops, restarts or is not restored)")
    return None


def _gradient_scale_cause(s: _Step) -> str | None:
    """m is off because the gradient fed to AdamW is scaled: by one common factor for every parameter (with v off
    by its square: global-norm clipping; v agreeing: beta1), or by each parameter's own (clipping per parameter).
    Needs beta1, except at step 1 where m is the fed gradient itself."""
    if not (s.beta1 is not None or s.fresh):
        return None
    f, rest = common_factor(s.joined(s.qa, s.fed, s.m_names), s.joined(s.qb, s.fed, s.m_names))
    if rest < EXPLAINED:
        va, vb = (s.joined(q, s.fed_square, s.v_names) for q in (s.qa, s.qb))
        fv, _ = common_factor(va, vb)
        if s.v_names and math.isfinite(fv) and abs(fv - f * f) <= 0.05 * f * f:
            return (f"gradient clipping: every parameter's gradient entered AdamW scaled by one common factor "
                    f"({f:.3g} in m, {fv:.3g} = its square in v); check the max norm and the global-norm "
                    "computation (clipping per parameter clips nothing while each parameter's own norm is below "
                    "the max)")
        if not s.v_over:
            return (f"beta1: m is off by one common factor {f:.3g} for every parameter while v agrees (m = "
                    "beta1 m + (1 - beta1) g)")
        return f"the gradient fed to AdamW is scaled by one common factor {f:.3g} (m) for every parameter"
    own = [common_factor(np.ravel(s.fed(s.qa, n)), np.ravel(s.fed(s.qb, n))) for n in s.m_over]
    if all(rest_n < EXPLAINED for _, rest_n in own):
        lo, hi = min(f_n for f_n, _ in own), max(f_n for f_n, _ in own)
        return (f"gradient clipping per parameter: each parameter's gradient is scaled by its own factor "
                f"({lo:.3g} to {hi:.3g}) instead of one global-norm factor")
    return None


def _first_moment_cause(s: _Step) -> str:
    """m is off, not by a scaled gradient: by alpha x the parameter (coupled L2 weight decay, on every parameter or
    on the decayed matrices), or along (m before the step - g) (beta1)."""
    with_p = [n for n in s.m_names if n in s.base]
    d = concat(s.qa["adam_m"], with_p) - concat(s.qb["adam_m"], with_p)
    alpha, rest = proportional(d, concat(s.base, with_p))
    if rest < EXPLAINED:
        return (f"coupled (L2) weight decay: m differs by {alpha:.3g} x the parameter on all parameters (weight "
                "decay added to the gradient instead of applied to the weights)")
    mat = [n for n in with_p if n in s.matrices]
    if mat and not [n for n in s.m_over if n not in mat]:
        d = concat(s.qa["adam_m"], mat) - concat(s.qb["adam_m"], mat)
        alpha, rest = proportional(d, concat(s.base, mat))
        if rest < EXPLAINED:
            return (f"coupled (L2) weight decay: m differs by {alpha:.3g} x the parameter on the decayed "
                    "matrices (weight decay added to the gradient instead of applied to the weights, AdamW)")
    if s.beta1 is not None and not s.fresh:
        d = concat(s.qa["adam_m"], s.m_names) - concat(s.qb["adam_m"], s.m_names)
        direction = concat(s.m_before, s.m_names) - s.joined(s.qb, s.fed, s.m_names)
        alpha, rest = proportional(d, direction)
        if rest < EXPLAINED:
            return f"beta1: m differs by {alpha:.3g} x (m before the step - g), i.e. beta1 differs by {alpha:.3g}"
    return "the first moment m differs: beta1, or the gradient fed to AdamW"


def _second_moment_cause(s: _Step) -> str:
    """v is off while m agrees: by one common factor at step 1, or along (v before the step - g^2): beta2."""
    va, vb = concat(s.qa["adam_v"], s.v_names), concat(s.qb["adam_v"], s.v_names)
    if s.fresh:
        fv, rest = common_factor(va, vb)
        if rest < EXPLAINED:
            return (f"beta2: m agrees but v differs by one common factor {fv:.3g} for every parameter "
                    f"(after step {s.step})")
    elif s.beta2 is not None:
        direction = concat(s.v_before, s.v_names) - s.joined(s.qb, s.fed_square, s.v_names)
        alpha, rest = proportional(va - vb, direction)
        if rest < EXPLAINED:
            return f"beta2: m agrees but v differs by {alpha:.3g} x (v before the step - g^2): beta2 differs"
    return "the second moment v differs (beta2, or the squared gradient) while m agrees"


def _decayed_parameters_cause(s: _Step) -> str | None:
    """Some parameters' updates differ by exactly +-lr x wd x p: which parameters are decayed (`decay_cause`)."""
    if s.lr is not None and s.wd:
        found = decay_cause(decay_ratios(s.qa["update"], s.qb["update"], s.base, s.lr * s.wd),
                            {n: np.shape(s.qb["update"][n]) for n in s.params}, s.names)
        if found:
            return found[1]
    return None


def _update_cause(s: _Step, probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray]) -> str:
    """Only the updates differ (m and v agree): on 1-D parameters only (weight decay on them), by one common factor
    (the step size), by alpha x p on the matrices (decoupled weight decay), where v is small (eps)."""
    u_over = s.over("update")
    if not u_over:
        return "no single pattern (the parameters differ, the updates and moments do not)"
    if not [n for n in u_over if n in s.matrices]:
        return ("weight decay applied to 1-D parameters (biases, LayerNorm weights): only 1-D parameters' updates "
                f"differ ({', '.join(u_over[:3])}{', ...' if len(u_over) > 3 else ''})")
    return (_step_size_cause(s, probe_a, probe_b) or _decoupled_decay_cause(s, u_over) or _eps_cause(s)
            or UPDATE_RULE)


def _step_size_cause(s: _Step, probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray]) -> str | None:
    """Every update off by one common factor: the step counter's t (the factor bias correction gives for another
    t), bias correction (a factor that changes with t) or the learning rate (one that does not)."""
    f, share = typical_factor(concat(s.qa["update"], s.params), concat(s.qb["update"], s.params))
    if not (share >= 1 - EXPLAINED and abs(f - 1) > 0.01):
        return None
    if s.beta1 is not None and s.beta2 is not None:
        counter = step_counter_cause(f, s.step, s.beta1, s.beta2, s.names)
        if counter:
            return counter
    factors = _update_factors(s, probe_a, probe_b)
    shown = ", ".join(f"{x:.3g}" for x in factors)
    if len(factors) > 1 and max(factors) - min(factors) > 0.02 * abs(factors[0]):
        return (f"bias correction: every parameter's update is off by one common factor that changes with t "
                f"({shown} at steps 1..{len(factors)}); a missing correction gives (1-beta1^t)/sqrt(1-beta2^t)")
    return (f"the step size: every parameter's update is off by one common factor ({shown} at steps "
            f"1..{len(factors)}): learning rate or bias correction (missing: 3.16 at t=1 for betas 0.9, 0.999)")


def _update_factors(s: _Step, probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray]) -> list[float]:
    """The typical factor between the two sides' updates at each of the first five steps both probes hold."""
    factors = []
    for k in opt_steps(probe_b):
        if k not in opt_steps(probe_a):
            continue
        base_k = start_state(probe_a, probe_b, k)["param"] if s.synced else None
        a_k, b_k = opt_quantities(probe_a, k, base_k)["update"], opt_quantities(probe_b, k, base_k)["update"]
        common = [n for n in s.params if n in a_k and n in b_k]
        factors.append(typical_factor(concat(a_k, common), concat(b_k, common))[0])
        if len(factors) == 5:
            break
    return factors


def _decoupled_decay_cause(s: _Step, u_over: list[str]) -> str | None:
    """Only the matrices' updates differ, by alpha x the parameter: the decoupled weight decay."""
    if [n for n in u_over if n in s.one_d]:
        return None
    with_p = [n for n in s.matrices if n in s.base]
    d = concat(s.qa["update"], with_p) - concat(s.qb["update"], with_p)
    alpha, rest = proportional(d, concat(s.base, with_p))
    if rest < EXPLAINED:
        return f"decoupled weight decay on the matrices: the update differs by {alpha:.3g} x the parameter"
    return None


def _eps_cause(s: _Step) -> str | None:
    """The updates differ most where sqrt(v) is small, where the update is most sensitive to eps."""
    ua, ub = concat(s.qa["update"], s.params), concat(s.qb["update"], s.params)
    sv = np.sqrt(np.maximum(concat(s.qb["adam_v"], s.v_names), 0.0)) if s.v_names else np.zeros(0)
    if s.v_names and sv.size == ua.size:
        r = np.abs(ua - ub) / np.maximum(np.abs(ub), 1e-300)
        live = sv > 0
        if live.sum() >= 20:
            low, high = np.quantile(sv[live], [0.1, 0.5])
            small, large = np.median(r[live & (sv <= low)]), np.median(r[live & (sv >= high)])
            if small > 10 * large and small > s.tol:
                return (f"eps: the updates differ most where v is small (median relative difference {small:.2g} in "
                        f"the smallest tenth of sqrt(v), {large:.2g} in the upper half)")
    return None
