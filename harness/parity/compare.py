"""`harness parity`'s comparison: do two backends compute the same thing? (docs/design.md, "Parity")

Parity mode trains both backends from the same canonical weights on the same batches (dropout 0, or the same
harness-drawn dropout masks), each in its own worker process (harness.run.supervise), and `compare` holds them, in
float64, to five depths, each failure naming where it first breaks and, where the pattern tells, the likely cause
(harness.parity.forward, .optimizer, .options):

0. the activation taps (harness/core/taps.py): the named intermediate tensors of the step-0 forward pass on the first
   rows of the first batch, walked in forward order; the first divergent tap and its cause are named;
1. step-0 logits on the first training batch: max absolute difference;
2. step-0 gradients of the mean loss, per parameter: relative error ||ga - gb|| / max(||ga||, ||gb||, tiny);
3. the optimizer step, re-synchronised: after each training step k (every step by default, `--opt-steps K`: the
   first K), each parameter's update and AdamW moments m and v, where the non-reference backend took step k from
   the reference's state after step k - 1 (harness/run/probe.py); also the loss of each such step and the learning
   rate each step took;
4. the per-step training loss over N steps: the first step over tolerance and the peak, plus the final
   evaluation's validation loss.

With `--dropout P` the harness draws every dropout mask (harness.core.masks) and hands the same masks to both backends,
so the training steps, the optimizer check and an extra step-0 gradient check under the step-0 masks
(`dropout_grad/`) compare dropout placement and scaling exactly.

The comparison is the pure function `compare`, so tests (and other tools) can feed it the output of in-process
backends; it returns a `ParityResult` (harness.parity.result). The tolerances it is given are measured per precision
pair and size preset (harness.parity.tolerances, docs/parity.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.core.taps import MASK_PREFIX as TAP_MASK_PREFIX
from harness.core.taps import PREFIX as TAP_PREFIX
from harness.core.taps import block_of, in_forward_order
from harness.parity.dropout import Masks, attention_dropout_cause, dropout_gradient_cause, p_of
from harness.parity.forward import attention_self_error, dropout_cause, logits_cause, tap_cause
from harness.parity.numeric import (
    TINY,
    first_over,
    fmt,
    fmt_index,
    loss_deviation,
    max_abs_diff,
    relative_error,
    storage_eps,
    tap_error,
    update_error,
    within,
    worst,
    worst_key,
)
from harness.parity.optimizer import (
    UPDATE_RULE,
    WRONG_STEP_INPUTS,
    aliased_quantities,
    decay_cause,
    decay_ratios,
    diagnose_optimizer,
)
from harness.parity.options import diagnose_gelu, diagnose_schedule, diagnose_tying, rate_ratios, update_ratios
from harness.parity.result import ParityResult
from harness.parity.states import (
    OPT_QUANTITIES,
    arrays,
    hyper_value,
    opt_quantities,
    opt_steps,
    start_state,
    step_rate,
    synchronised,
)
from harness.parity.tolerances import Tolerances
from harness.run.probe import DROPOUT_GRAD_PREFIX, OPT_PREFIX, SYNC_LOSS, SYNC_REFERENCE

# What each depth cannot see (printed with the verdict; docs/parity.md, "What each depth cannot see").
BLIND_SPOTS: dict[str, str] = {
    "taps": "step 0 only, with the initial weights: biases start at 0 and LayerNorm gains at 1, so a missing or "
            "misplaced bias or gain (lm_head.bias, a c_attn or c_proj bias, a LayerNorm affine) changes no "
            "activation; dropout is off (except the attention probabilities' step-0 masks, with attention "
            "dropout); nothing after the forward pass",
    "logits": "the same as the taps (a missing lm_head.bias passes, biases start at 0), and where in the forward "
              "pass a difference arises (the taps name it)",
    "gradients": "the optimizer, clipping, weight decay and the learning rate; dropout (off); any step after 0",
    "dropout_gradients": "the optimizer and any step after 0; dropout masks of later steps",
    "optimizer": "steps after the last one compared; with `harness parity` each step starts from the reference's "
                 "state, so a difference that only accumulates over many steps shows in the loss, not here",
    "loss": "which layer or parameter differs; on medium and large in float32 its tolerance is a divergence guard "
            "(rounding grows chaotically), so only large differences fail there",
}


def compare(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray],
            losses_a: Sequence[float], losses_b: Sequence[float], tolerances: Tolerances,
            val_losses: tuple[float, float] | None = None, backends: tuple[str, str] = ("a", "b"),
            hyper: Mapping[str, Any] | None = None, config: Any = None, precision: str | None = None,
            masks: Callable[[int], Mapping[str, np.ndarray]] | None = None) -> ParityResult:
    """Compare two backends' probes and training-loss curves, in float64.

    A probe maps "logits" (B, T, V), "x", "y" (the batch) and "grad/<canonical name>" to arrays, as the worker's
    `<backend>.probe.npz` (harness/run/probe.py); optionally "tap/<name>" (depth 0, harness/core/taps.py: any subset;
    the taps both hold are compared), "dropout_grad/<name>" (gradients under the step-0 dropout masks) and
    "opt/<k>/param|adam_m|adam_v/<name>", "opt/<k>/adam_t" (the state after training step k; k = 0: the parameters
    before it), graded by depth 3 with `tolerances.opt` and `diagnose_optimizer` (re-synchronised when one probe
    holds "sync/steps": then "sync/loss" is checked against the other's losses with `tolerances.step`).
    `losses_*` are the per-step training losses, `val_losses` the two final validation losses (checked against the
    loss tolerance), `hyper` the config (learning_rate, weight_decay, beta1, beta2) some diagnoses need; `config`
    (the run's harness Config, optional; its fields serve as `hyper` when that is not given) lets the FAIL lines
    name option and schedule causes (diagnose_gelu, diagnose_tying, diagnose_schedule). `precision`: the coarser
    dtype the two sides computed in (default: read from the probes' parameter arrays), whose storage rounding the
    update's error allows for (`update_error`). `masks(k)`: the harness's dropout masks of training step k, as both
    sides were handed them (with dropout): the causes of a mistake of the masks are read from them
    (harness.parity.dropout). Taps taken with masks (the probes' "tap_mask/<site>", harness.core.taps.tap_masks) are
    checked against them. Every deviation beyond its tolerance, a NaN, a missing or misshapen array or a different
    batch is a failure, named in `result.failures`, the first divergent place first.
    """
    a, b = backends
    if hyper is None and config is not None:
        hyper = config.to_dict()
    eps = float(np.finfo(precision).eps) if precision else storage_eps(
        *(v for probe in (probe_a, probe_b) for k, v in probe.items() if k.startswith(OPT_PREFIX) and "/param/" in k))
    tap_masks = {k[len(TAP_MASK_PREFIX):]: v for k, v in probe_b.items() if k.startswith(TAP_MASK_PREFIX)}
    other = {k[len(TAP_MASK_PREFIX):]: v for k, v in probe_a.items() if k.startswith(TAP_MASK_PREFIX)}
    p = _Sides(probe_a, probe_b, losses_a, losses_b, hyper, config,
               Masks(p=p_of(hyper, config), of_step=masks, steps=int(getattr(config, "steps", 0) or 0),
                     taps=tap_masks or other), eps)
    r = ParityResult(backends=(a, b), tolerances=tolerances)
    for key in ("x", "y"):
        if key in probe_a and key in probe_b and not np.array_equal(probe_a[key], probe_b[key]):
            r.failures.append(f"FAIL: the probes used different batches ({key} differs): the comparison is "
                              "meaningless")
    both_tap = all(any(k.startswith(TAP_PREFIX) for k in probe) for probe in (probe_a, probe_b))
    if both_tap and (set(tap_masks) != set(other) or not all(np.array_equal(tap_masks[k], other[k]) for k in other)):
        r.failures.append(f"FAIL: the probes' taps were taken with different dropout masks ({a}: "
                          f"{', '.join(other) or 'none'}; {b}: {', '.join(tap_masks) or 'none'}): the taps are not "
                          "comparable")
    _compare_taps(p, r)  # (0)
    _compare_logits(p, r)  # (1)
    grads_ok = _compare_gradients(p, r)  # (2), and with dropout the gradients under the step-0 masks
    # (3) the rate each step took first (its cause explains an optimizer difference at the same step): a tenth of
    # the optimizer tolerance, 1e-4 float32, 1e-13 float64, each 10x the worst measured (1.5e-6, 3.6e-15)
    rate_line = _compare_rates(p, r, tolerances.opt / 10)
    _compare_optimizer(p, r, grads_ok and not r.first_tap)
    if rate_line:
        r.failures.append(rate_line)
    _compare_losses(p, r, val_losses)  # (4)
    return r


@dataclass(frozen=True)
class _Sides:
    """The two sides under comparison: their probes and training losses, and the config some diagnoses read."""

    a: Mapping[str, np.ndarray]
    b: Mapping[str, np.ndarray]
    losses_a: Sequence[float]
    losses_b: Sequence[float]
    hyper: Mapping[str, Any] | None
    config: Any
    masks: Masks
    eps: float = 0.0  # the machine epsilon of the coarser precision (the parameters' storage rounding)


def _downstream(r: ParityResult) -> str:
    """What a later depth's FAIL line adds when the forward pass already differs."""
    return f"; follows from the forward difference at {r.first_tap}" if r.first_tap else ""


# --- (0) the activation taps -----------------------------------------------------------------------------------------
def _compare_taps(p: _Sides, r: ParityResult) -> None:
    """Depth 0 into `r`: every tap both probes hold, in forward order; the first over tolerance is named with the
    likely cause read from its pattern (harness.parity.forward.tap_cause)."""
    a, b = r.backends
    tol = r.tolerances.tap
    ta, tb = arrays(p.a, TAP_PREFIX), arrays(p.b, TAP_PREFIX)
    for name, probe, taps in ((a, p.a, ta), (b, p.b, tb)):
        _check_own_taps(name, probe, taps, tol, r, p.masks)
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
    over = [n for n in common if not within(r.taps_rel_err.get(n, math.nan), tol)]
    if not over:
        return
    first = r.first_tap = over[0]
    if np.shape(ta[first]) != np.shape(tb[first]):
        r.tap_cause = "the tap's shape differs (layout)"
        return
    r.tap_cause = _attention_dropout_cause(first, ta, tb, r.backends, p.masks) or tap_cause(
        first, ta, tb, p.a, p.b, r.backends, p.masks.taps, p.masks.p)
    more = f" ({len(over) - 1} later tap(s) over tol)" if len(over) > 1 else ""
    r.failures.append(f"FAIL: forward: first divergent activation {first} (max abs {fmt(r.taps_max_abs[first])} at "
                      f"{fmt_index(r.taps_where[first])}, {fmt(r.taps_rel_err[first])} of its scale > tol "
                      f"{tol:g}){more}; likely cause: {r.tap_cause}")


def _attention_dropout_cause(first: str, ta: Mapping[str, np.ndarray], tb: Mapping[str, np.ndarray],
                             names: tuple[str, str], masks: Masks) -> str | None:
    """A first divergent attn.y under the attention masks: the mistake of a side's attention dropout
    (harness.parity.dropout.attention_dropout_cause), if one explains its attn.y."""
    block = first[:-len("attn.y")]
    if not first.endswith("attn.y") or block + "attn.probs" not in masks.taps:
        return None
    return next((c for c in (attention_dropout_cause(n, t, block, masks) for n, t in zip(names, (ta, tb))) if c), None)


def _check_own_taps(name: str, probe: Mapping[str, np.ndarray], taps: Mapping[str, np.ndarray], tol: float,
                    r: ParityResult, masks: Masks) -> None:
    """One side's taps against its own forward pass: its tap logits against its logits (taps taken with dropout off
    only), and each block's attn.y against its own attn.probs @ attn.v (torch taps probabilities SDPA does not
    return), with the attention masks the taps were taken with: (attn.probs * mask / (1 - p)) @ attn.v."""
    with_masks = any(k.startswith(TAP_MASK_PREFIX) for k in probe)
    if "logits" in taps and "logits" in probe and np.ndim(probe["logits"]) == 3 and not with_masks:
        rows = taps["logits"].shape[0]
        if np.shape(probe["logits"][:rows]) == np.shape(taps["logits"]):
            err, diff, _ = tap_error(taps["logits"], probe["logits"][:rows])
            if not within(err, tol):
                r.failures.append(f"FAIL: {name}'s activation taps are not its forward pass: its tap logits "
                                  f"differ from its logits by {fmt(diff)} (the path that records the taps "
                                  "and the model's forward differ)")
    for block in sorted({n[:-len("attn.y")] for n in taps if n.endswith("attn.y")},
                        key=lambda head: block_of(head + "attn.y") or 0):
        keep = masks.taps.get(block + "attn.probs")
        err = attention_self_error(taps, block, keep, masks.p if keep is not None else 0.0)
        if err is None or within(err, tol):
            continue
        if keep is None:
            r.failures.append(f"FAIL: {name}'s attention taps are not its attention: its {block}attn.y differs "
                              f"from its own {block}attn.probs @ {block}attn.v by {fmt(err)} of its scale (the "
                              "probabilities are computed apart from the attention call: the SDPA call's scale "
                              "or mask)")
            continue
        cause = attention_dropout_cause(name, taps, block, masks) or (
            "its attention dropout, or probabilities computed apart from the attention call")
        r.failures.append(f"FAIL: {name}'s attention taps do not follow the step-0 attention mask: its {block}attn.y "
                          f"differs from its own ({block}attn.probs * mask / (1 - p)) @ {block}attn.v by {fmt(err)} "
                          f"of its scale; likely cause: {cause}")


# --- (1) the logits and (2) the gradients ----------------------------------------------------------------------------
def _compare_logits(p: _Sides, r: ParityResult) -> None:
    """Depth 1 into `r`: the step-0 logits' max |diff|, where it is, and why, when the taps did not say."""
    a, b = r.backends
    tol = r.tolerances.logits
    if "logits" not in p.a or "logits" not in p.b:
        r.failures.append(f"FAIL: logits missing from the {a if 'logits' not in p.a else b} probe")
    elif np.shape(p.a["logits"]) != np.shape(p.b["logits"]):
        r.failures.append(f"FAIL: logits shapes differ: {a} {np.shape(p.a['logits'])} vs {b} "
                          f"{np.shape(p.b['logits'])}")
    else:
        r.logits_max_abs, r.logits_where = max_abs_diff(p.a["logits"], p.b["logits"])
        if not within(r.logits_max_abs, tol):
            r.logits_cause = logits_cause(p.a, p.b, r.first_tap, r.backends) or (
                p.config is not None and diagnose_gelu(p.a, p.b, p.config, r.backends)) or None
            cause = ("" if not r.logits_cause or r.first_tap else f"; likely cause: {r.logits_cause}")
            r.failures.append(f"FAIL: logits max abs diff {fmt(r.logits_max_abs)} > tol {tol:g}{cause}"
                              f"{_downstream(r)}")


def _compare_gradients(p: _Sides, r: ParityResult) -> bool:
    """Depth 2 into `r`: the step-0 gradients (dropout off) and, where the probes hold them, the gradients under the
    step-0 dropout masks; True when all are within tolerance."""
    tol = r.tolerances.grad
    downstream = _downstream(r)
    tying = diagnose_tying(arrays(p.a), arrays(p.b), p.b.get("x"), tol)
    r.grad_rel_err, r.worst_grad, r.worst_grad_rel_err, r.first_grad = _compare_grads(
        arrays(p.a), arrays(p.b), tol, "gradient", r.backends, r.failures.append, required=True,
        cause=f"likely cause: {tying}" if tying else downstream[2:] or None)
    grads_ok = all(within(e, tol) for e in r.grad_rel_err.values())
    if any(k.startswith(DROPOUT_GRAD_PREFIX) for k in (*p.a, *p.b)):
        def masks_cause() -> str:
            """Which mistake of the masks (harness.parity.dropout), else where the masks act."""
            return "likely cause: " + (dropout_gradient_cause(p.a, p.b, p.config, p.masks, tol, r.backends)
                                       or dropout_cause(p.config if p.config is not None else p.hyper))

        r.dropout_grad_rel_err, r.worst_dropout_grad, r.worst_dropout_grad_rel_err, r.first_dropout_grad = \
            _compare_grads(arrays(p.a, DROPOUT_GRAD_PREFIX), arrays(p.b, DROPOUT_GRAD_PREFIX),
                           tol, "gradient with dropout masks", r.backends, r.failures.append,
                           cause=(downstream[2:] if r.first_tap else masks_cause if grads_ok and r.grad_rel_err
                                  else None))
        grads_ok = grads_ok and all(within(e, tol) for e in r.dropout_grad_rel_err.values())
    return grads_ok


def _compare_grads(ga: dict[str, np.ndarray], gb: dict[str, np.ndarray], tol: float, what: str,
                   backends: tuple[str, str], fail: Any, required: bool = False,
                   cause: str | Callable[[], str] | None = None
                   ) -> tuple[dict[str, float], str | None, float, str | None]:
    """Per-parameter relative errors of two gradient sets, the worst one, the first over tolerance in backward
    order (nearest the loss first: the backward pass computes them in that order) and FAIL lines through `fail`
    (`cause`: the FAIL line's cause, or a function computing it, asked only when one is over tolerance)."""
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
    over = [n for n in reversed(list(errs)) if not within(errs[n], tol)]
    unused = [(n, side) for n in over for side, g, other in ((a, ga, gb), (b, gb, ga))
              if np.shape(g[n]) == np.shape(other[n]) and not np.any(g[n]) and np.any(other[n])]
    if over and callable(cause):
        cause = cause()
    if unused and cause is None:
        n, side = unused[0]
        cause = (f"likely cause: {n} gets no gradient in {side}: its forward pass does not use it (a missing bias or "
                 "an unused parameter)")
    if over:
        more = f" ({len(over) - 1} more parameter(s) over tol)" if len(over) > 1 else ""
        fail(f"FAIL: {what} {bad} rel err {fmt(errs[bad])} > tol {tol:g}{more}"
             + (f"; {cause}" if cause else ""))
    return errs, bad, errs[bad], (over[0] if over else None)



# --- (3) the learning rate and the optimizer step --------------------------------------------------------------------
def _compare_rates(p: _Sides, r: ParityResult, tol: float) -> str | None:
    """Into `r`: per backend, the worst relative error of the rate its steps took (`lr_used`) against the
    harness's schedule (`lr`), the first step over `tol` and, from the pattern, the likely cause. Each backend
    is measured on its own states, so drift between the two cannot enter; returns the FAIL line when over `tol`
    (the caller places it after the optimizer depth's, whose cause may cite it)."""
    if not all("lr_used" in probe and "lr" in probe for probe in (p.a, p.b)):
        return  # probes from before the rates were recorded
    r.rate_tol = tol
    for name, probe in zip(r.backends, (p.a, p.b)):
        used = np.asarray(probe["lr_used"], dtype=np.float64).ravel()
        lr = np.asarray(probe["lr"], dtype=np.float64).ravel()[:len(used)]
        err = np.abs(used - lr) / np.maximum(np.abs(lr), TINY)
        r.rate_rel_err[name] = float(np.nan_to_num(err, nan=np.inf).max()) if err.size else 0.0
        over = np.flatnonzero(~(err <= tol))
        if over.size and (r.rate_first_bad is None or over[0] + 1 < r.rate_first_bad[1]):
            k = int(over[0])
            r.rate_first_bad = (name, k + 1)
            r.rate_cause = (p.config is not None and diagnose_schedule(rate_ratios(p.a, p.b), p.config, r.backends)) \
                or (f"{name}'s steps took other rates than the ones the harness handed it (or its AdamW update "
                    "differs: see the optimizer depth)")
            line = (f"FAIL: learning rate of optimizer step {k + 1}: {name} stepped with {used[k]:.6g}, the schedule "
                    f"gives {lr[k]:.6g} (rel err {fmt(float(err[k]))} > tol {tol:g}); likely cause: {r.rate_cause}")
    if r.rate_first_bad is not None:
        return line
    return None


@dataclass(frozen=True)
class _OptStep:
    """Training step k as both probes hold it: the state it started from and each side's update and moments."""

    k: int
    start: dict[str, dict[str, np.ndarray]]
    qa: dict[str, dict[str, np.ndarray]]
    qb: dict[str, dict[str, np.ndarray]]


def _compare_optimizer(p: _Sides, r: ParityResult, grads_ok: bool) -> None:
    """Depth 3 into `r`: per step and parameter, the relative error of the update and of m and v, each side's step
    from the same state (re-synchronised, or the first steps of two free runs); aliased states; the decay
    pattern (exactly +-lr x wd x p), which fails even within tolerance; the cause at the first step that breaks
    (with the run's `config`, a learning-rate schedule mistake is named before the optimizer's own patterns)."""
    a, b = r.backends
    sa, sb = opt_steps(p.a), opt_steps(p.b)
    if not sa and not sb:
        return  # probes from before the optimizer check (or a kit that does not ask for it)
    if sa != sb:
        r.failures.append(f"FAIL: optimizer steps recorded differ: {a} {sa} vs {b} {sb}")
    ref = synchronised(p.a, p.b)
    if ref is not None:
        r.opt_reference = r.backends[ref]
        named = str(np.asarray((p.b if ref == 0 else p.a).get(SYNC_REFERENCE, "")))
        if named and named != r.opt_reference:  # the probe says whose states it took its steps from
            r.failures.append(f"FAIL: {r.backends[1 - ref]} re-synchronised its optimizer steps from {named}'s "
                              f"states, not from {r.opt_reference}'s: its probe belongs to another comparison")
        _step_loss_check(p, r)
    aliased = {name: aliased_quantities(probe, [k for k in sa if k in sb]) for name, probe in ((a, p.a), (b, p.b))}
    alias_cause = next((f"aliased optimizer states: every opt/<k> {', '.join(q)} array {name} recorded is the same "
                        "array (the final state), as when references to the live arrays are saved instead of copies"
                        for name, q in aliased.items() if q), None)
    for k in [k for k in sa if k in sb]:
        start = start_state(p.a, p.b, k)
        base = start["param"] if ref is not None else None  # free runs: each update from its own previous state
        step = _OptStep(k, start, opt_quantities(p.a, k, base), opt_quantities(p.b, k, base))
        r.opt_rel_err[k] = _step_errors(step, r, p.eps)
        if r.opt_first_bad is None:
            _first_bad_step(p, r, step, sa, sb, grads_ok, alias_cause)
    every = {(k, q, n): e for k, step in r.opt_rel_err.items() for q, errs in step.items() for n, e in errs.items()}
    r.worst_opt = worst(every)
    r.worst_opt_rel_err = every[r.worst_opt] if every else math.nan
    k = r.step_loss_first_bad
    stated = r.opt_first_bad is not None and r.opt_first_bad[0] == k and r.opt_cause == WRONG_STEP_INPUTS
    if k > 0 and grads_ok and not stated:  # with the forward pass already different, it follows from that
        r.failures.append(f"FAIL: step {k}'s loss from the same state differs by {fmt(r.step_loss_abs_dev[k - 1])} > "
                          f"tol {r.tolerances.step:g}; likely cause: {WRONG_STEP_INPUTS}")


def _step_loss_check(p: _Sides, r: ParityResult) -> None:
    """Re-synchronised: the loss of each step k (from the reference's state after k - 1) against the reference's
    loss of that step."""
    ref = synchronised(p.a, p.b)
    if ref is None:
        return
    other = p.b if ref == 0 else p.a
    ref_losses = p.losses_a if ref == 0 else p.losses_b
    sync = [float(v) for v in np.ravel(other.get(SYNC_LOSS, []))]
    n = min(len(sync), len(ref_losses))
    r.step_loss_abs_dev = [abs(sync[i] - float(ref_losses[i])) for i in range(n)]
    first = first_over(r.step_loss_abs_dev, r.tolerances.step)
    r.step_loss_first_bad = first + 1 if first >= 0 else -1


def _step_errors(step: _OptStep, r: ParityResult, eps: float) -> dict[str, dict[str, float]]:
    """{"update" | "adam_m" | "adam_v": {name: relative error}} of one step (the update's without the entries at
    rounding level and less the parameters' storage rounding at machine epsilon `eps`, `update_error`); a parameter
    only one side holds is a FAIL line in `r`."""
    a, b = r.backends
    qa, qb = step.qa, step.qb
    step_err: dict[str, dict[str, float]] = {}
    for q in OPT_QUANTITIES:
        errs = step_err[q] = {}
        for name in sorted(set(qa[q]) ^ set(qb[q])):
            r.failures.append(f"FAIL: optimizer step {step.k} {q} of {name} missing from the "
                              f"{a if name not in qa[q] else b} probe")
        for name in [n for n in qa[q] if n in qb[q]]:
            shape_ok = np.shape(qa[q][name]) == np.shape(qb[q][name])
            if not shape_ok:
                errs[name] = math.nan
            elif q == "update":
                errs[name] = update_error(qa[q][name], qb[q][name], qa["adam_v"].get(name), qb["adam_v"].get(name),
                                          _update_scale(step.start["param"].get(name), qa[q][name], qb[q][name]),
                                          eps)
            else:
                errs[name] = relative_error(qa[q][name], qb[q][name])
    return step_err


def _update_scale(start: np.ndarray | None, ua: np.ndarray, ub: np.ndarray) -> np.ndarray | None:
    """|p| around a step, entry-wise: the largest of the parameter before it and after either side's update."""
    if start is None or np.shape(start) != np.shape(ua):
        return None
    return np.maximum(np.abs(start), np.maximum(np.abs(start + ua), np.abs(start + ub)))


def _first_bad_step(p: _Sides, r: ParityResult, step: _OptStep, sa: list[int], sb: list[int], grads_ok: bool,
                    alias_cause: str | None) -> None:
    """When `step` is the first that breaks (a value over tolerance; the decay pattern within it; aliased states,
    seen at the last step), name it in `r`: where, the likely cause, and its FAIL line. The cause, in this order:
    aliased states, the decay pattern, a learning-rate schedule mistake, then `diagnose_optimizer`."""
    k, tol = step.k, r.tolerances.opt
    step_err = r.opt_rel_err[k]
    bad = [(q, n, e) for q, errs in step_err.items() for n, e in errs.items() if not within(e, tol)]
    decay = _decay_pattern(p, r, step) if not bad and grads_ok else None
    if not bad and decay is None and not (alias_cause and k == sa[-1]):
        return
    schedule_cause = None
    if bad:
        q, n, e = max(bad, key=lambda t: worst_key(t[2]))
        schedule_cause = _schedule_cause(p, r, k, sa, sb) if grads_ok else None
        params = {name for _, name, _ in bad}
    elif decay is not None:
        q, n = "update", decay[0][0]
        e, params = step_err["update"].get(n, math.nan), set(decay[0])
    else:
        q, n = "param", next(iter(step.qb["adam_m"]), "")
        e, params = math.nan, set()
    r.opt_first_bad, r.opt_first_bad_rel_err = (k, q, n), e
    if alias_cause:
        r.opt_cause = alias_cause
    elif decay is not None:
        r.opt_cause = decay[1]
    elif bad and schedule_cause:
        r.opt_cause = schedule_cause
    else:
        r.opt_cause = _optimizer_cause(p, r, step, grads_ok)
    what = {"update": "update", "adam_m": "AdamW m", "adam_v": "AdamW v", "param": "state"}[q]
    more = f" ({len(params) - 1} more parameter(s) over tol)" if len(params) > 1 and bad else ""
    how = (f"rel err {fmt(e)} > tol {tol:g}{more}" if bad else
           f"rel err {fmt(e)}, within tol {tol:g} but exactly the pattern below" if decay is not None else
           "identical arrays at every step")
    r.failures.append(f"FAIL: optimizer step {k}: {n} {what} {how}; likely cause: {r.opt_cause}")


def _decay_pattern(p: _Sides, r: ParityResult, step: _OptStep) -> tuple[list[str], str] | None:
    """The parameters whose update differs by exactly +-lr x wd x p, and the convention that names (needs the
    step's learning rate and the weight decay)."""
    lr, wd = step_rate(p.a, p.b, step.k, p.hyper), hyper_value(p.hyper, "weight_decay")
    if not (lr and wd):
        return None
    return decay_cause(decay_ratios(step.qa["update"], step.qb["update"], step.start["param"], lr * wd),
                       {n: np.shape(v) for n, v in step.qb["update"].items()}, r.backends)


def _schedule_cause(p: _Sides, r: ParityResult, k: int, sa: list[int], sb: list[int]) -> str | None:
    """A learning-rate schedule mistake that explains the rates of the steps up to `k` (with the run's config):
    from the rates each step took, else from the updates of the steps both sides took from the same state."""
    ref = synchronised(p.a, p.b)
    synced = [s for s in sa if s <= k and s in sb and (ref is not None or s == 1 or s - 1 in sa)]
    return (p.config is not None and diagnose_schedule(
        rate_ratios(p.a, p.b) or update_ratios(p.a, p.b, synced), p.config, r.backends)) or None


def _optimizer_cause(p: _Sides, r: ParityResult, step: _OptStep, grads_ok: bool) -> str:
    """`diagnose_optimizer` at `step`, told whether the step's loss already differs; when no pattern fits and the
    learning rate broke at this step or before, the learning rate."""
    ref = synchronised(p.a, p.b)
    k = step.k
    step_loss_bad = (0 < r.step_loss_first_bad <= k) if ref is not None else (
        k == 1 and len(p.losses_a) > 0 and len(p.losses_b) > 0
        and not within(abs(float(p.losses_a[0]) - float(p.losses_b[0])), r.tolerances.step))
    cause = diagnose_optimizer(p.a, p.b, k, r.tolerances.opt, gradients_agree=grads_ok,
                               before=step.start if ref is not None else None, hyper=p.hyper,
                               step_loss_differs=step_loss_bad, names=r.backends)
    if cause == UPDATE_RULE and r.rate_first_bad is not None and r.rate_first_bad[1] <= k:
        return f"the learning rate: {r.rate_cause}"  # no other pattern fits, and the rate is off
    return cause


# --- (4) the training loss -------------------------------------------------------------------------------------------
def _compare_losses(p: _Sides, r: ParityResult, val_losses: tuple[float, float] | None) -> None:
    """Depth 4 into `r`: the per-step training losses of the two free runs and the final validation losses."""
    a, b = r.backends
    tol = r.tolerances.loss
    r.loss_steps = min(len(p.losses_a), len(p.losses_b))
    if len(p.losses_a) != len(p.losses_b):
        r.failures.append(f"FAIL: training ran {len(p.losses_a)} steps in {a} but {len(p.losses_b)} in {b}")
    r.loss_max_abs_dev, r.loss_peak_step, r.loss_abs_dev = loss_deviation(p.losses_a, p.losses_b)
    r.loss_first_bad = first_over(r.loss_abs_dev, tol)
    if r.loss_steps == 0:
        r.failures.append("FAIL: no training losses to compare")
    elif not within(r.loss_max_abs_dev, tol):
        k = r.loss_first_bad
        r.failures.append(f"FAIL: training loss: first over tol {tol:g} at step {k} (abs dev "
                          f"{fmt(r.loss_abs_dev[k])}), peak {fmt(r.loss_max_abs_dev)} at step {r.loss_peak_step}")
    if val_losses is not None:
        va, vb = (float(v) for v in val_losses)
        r.val_loss = {a: va, b: vb}
        r.val_loss_abs_diff = abs(va - vb) if math.isfinite(va) and math.isfinite(vb) else math.nan
        if not within(r.val_loss_abs_diff, tol):
            r.failures.append(f"FAIL: final val loss abs diff {fmt(r.val_loss_abs_diff)} > tol {tol:g}")
