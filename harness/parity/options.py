"""The likely cause when a backend implements a model option or the learning-rate schedule another way
(docs/nanogpt.md): tied embeddings, the GELU form, the schedule's warm-up, decay and floor.

Each takes the quantities of one depth and the config, and returns a cause (a phrase) or None when its pattern is
absent; harness.parity.compare appends the cause to the FAIL line of that depth.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from harness.core.schedule import learning_rate
from harness.parity.numeric import TINY, common_factor, relative_error, within
from harness.parity.states import concat, initial_params, opt_quantities, start_state, synchronised

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
        a, b = concat(ua, names), concat(ub, names)
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


def schedule_hypotheses(config: Any) -> list[tuple[str, Callable[[int], float]]]:
    """The known schedule mistakes that differ from `config`'s schedule: (the sentence, the rate of iteration it)
    for the warm-up off by one step (the rate of the step after, or before, with 0 at the first step; or nanoGPT's
    old lr * it / warmup), the warm-up missing, the cosine decaying to 0 instead of min_lr, the schedule ignored (a
    constant learning_rate)."""
    lr, w = config.learning_rate, config.warmup_steps
    hypotheses: list[tuple[str, Callable[[int], float]]] = [
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
    return hypotheses


def diagnose_schedule(ratios: Mapping[int, tuple[float, float]], config: Any,
                      backends: tuple[str, str] = ("a", "b")) -> str | None:
    """The learning-rate schedule a backend used, when it is a known mistake: `ratios` from `update_ratios` (steps
    where both backends started from the same state), `config` the run's (harness.core.schedule gives the rates).

    Hypotheses: `schedule_hypotheses`. A backend's implied rates are the schedule's times its ratio (b: s, a: t); a
    hypothesis fits when, at the step where it differs most from the schedule, it explains all but EXPLAINS of the
    difference, and at every step the implied rate is no further from it than that.
    """
    steps = sorted(ratios)
    if not steps:
        return None
    lrs = {k: learning_rate(config, k - 1) for k in steps}  # optimizer step k (1-based) used get_lr(k - 1)
    hypotheses = schedule_hypotheses(config)
    lr = config.learning_rate

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


def diagnose_tying(grads_a: Mapping[str, np.ndarray], grads_b: Mapping[str, np.ndarray], x: np.ndarray | None,
                   tol: float) -> str | None:
    """Tied embeddings (the probes hold wte.weight and no lm_head.weight): when wte.weight is the only gradient out of
    tolerance, the shared matrix's gradient is not the sum of its two uses. A difference confined to the rows of the
    tokens in the batch `x` is the embedding lookup's part; one on other rows too, the output layer's."""
    if "wte.weight" not in grads_b or "lm_head.weight" in grads_a or "lm_head.weight" in grads_b:
        return None
    over = [n for n in grads_a if n in grads_b and np.shape(grads_a[n]) == np.shape(grads_b[n])
            and not within(relative_error(grads_a[n], grads_b[n]), tol)]
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

    params = initial_params(probe_b, probe_a)
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
