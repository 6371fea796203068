"""The likely cause of a difference under the harness's dropout masks (docs/parity.md, "Diagnoses").

With `--dropout P` every backend is handed the same keep-masks (harness.core.masks), so a side that applies them
in another place, with another scale, transposed or from another step is found by recomputing what it would then
give and comparing:

- at the taps (`attention_dropout_cause`): with attention dropout the taps are taken with the step-0 masks of the
  attention probabilities (harness.core.taps.tap_masks), so a side's `attn.y` must be its own
  `(attn.probs * mask / (1 - p)) @ attn.v`; the hypotheses (the mask missing, not rescaled, rescaled otherwise,
  applied after the value product, transposed, read in the other memory order, of another step) are evaluated on
  that side's own taps;
- at the gradients under the masks (`dropout_gradient_cause`): the float64 oracle's step-0 gradients from the
  initial parameters under each hypothesis of wrong masks (transposed, the other memory order, another step's), at
  every site at once, then at each kind of site; the hypothesis whose gradients a side's equal (within the
  gradient tolerance) is named. Without a fit, harness.parity.forward.dropout_cause (placement or scaling).

`Masks` is what a comparison knows of the masks: p, the masks of any step and those the taps were taken with.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.parity.forward import merge_heads
from harness.parity.numeric import TINY, relative_error
from harness.parity.states import arrays, initial_params
from harness.run.probe import DROPOUT_GRAD_PREFIX

FITS = 1e-3  # a hypothesis explains a tap when it leaves less than this fraction of the tap's scale
OTHER_STEPS = 4  # the steps after step 0 whose masks are tried (and the last step of the run: index -1)
BUDGET_S = 30.0  # at most this long for the hypotheses of the gradients under the masks (only when they fail)


@dataclass(frozen=True)
class Masks:
    """The dropout masks of a comparison: the probability `p`, `of_step(k)` the harness's masks of training step k
    ({site: bool array}, full batch; None: unknown), `steps` the run's training steps (the steps whose masks exist),
    `taps` the masks the taps were taken with ({site: mask on the tap rows})."""

    p: float
    of_step: Callable[[int], Mapping[str, np.ndarray]] | None = None
    steps: int = 0
    taps: Mapping[str, np.ndarray] = field(default_factory=dict)

    def step(self, k: int) -> Mapping[str, np.ndarray] | None:
        """The masks of step k, None when they are not known (no source, or a step the run does not have)."""
        if self.of_step is None or k < 0 or (self.steps and k >= self.steps):
            return None
        try:
            return self.of_step(k)
        except (IndexError, KeyError, ValueError):
            return None

    def other_steps(self) -> list[int]:
        """The steps after 0 whose masks a hypothesis tries: 1 .. OTHER_STEPS, and the last step (where step 0's
        "previous step" lands when masks are indexed by step - 1 from the end)."""
        last = self.steps - 1 if self.steps else OTHER_STEPS
        return sorted({*range(1, min(OTHER_STEPS, last) + 1), last} - {0})


# --- wrong masks: transposed, in the other memory order, of another step ----------------------------------------------
AXES = {3: ("batch", "time", "feature"), 4: ("batch", "head", "query", "key")}


def _permutation_text(perm: tuple[int, ...], ndim: int) -> str:
    names = AXES.get(ndim, tuple(f"axis {i}" for i in range(ndim)))
    moved = [i for i in range(ndim) if perm[i] != i]
    if len(moved) == 2:
        a, b = moved
        how = ("query and key swapped: the mask of (query s, key t) used at (query t, key s)"
               if {names[a], names[b]} == {"query", "key"} else f"{names[a]} and {names[b]} axes swapped")
    else:
        how = "axes " + ", ".join(names[i] for i in perm) + f" where {', '.join(names)} is meant"
    return f"transposed ({how})"


def _transposition(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The axis permutation a transposed mask of this shape most likely had, keeping the shape: query and key
    swapped for the attention probabilities' (B, H, T, T), the axes reversed for a (B, T, C) mask when B = C
    (`mask.T`), else any other two axes of equal length swapped; None when no permutation keeps the shape."""
    n = len(shape)
    first = [(0, 1, 3, 2)] if n == 4 else [tuple(reversed(range(n)))]
    swaps = [tuple(b if i == a else a if i == b else i for i in range(n))
             for a, b in itertools.combinations(range(n), 2)]
    for perm in first + swaps:
        if perm != tuple(range(n)) and tuple(shape[i] for i in perm) == tuple(shape):
            return perm
    return None


def wrong_masks(site: str, mask: np.ndarray, masks: Masks) -> dict[str, tuple[str, np.ndarray]]:
    """The known ways of applying `site`'s step-0 mask `mask` (the full batch) wrongly: {kind: (how, the mask so
    applied)}, kind "transposed" (`_transposition`), "memory order" (reshaped from its reversed, column-major
    layout instead of permuted), "step j" (the masks of step j). Each distinct from the mask and the others."""
    out: dict[str, tuple[str, np.ndarray]] = {}

    def add(kind: str, how: str, m: np.ndarray) -> None:
        if not any(np.array_equal(m, s) for s in (mask, *(v[1] for v in out.values()))):
            out[kind] = (how, m)

    perm = _transposition(mask.shape)
    if perm is not None:
        add("transposed", _permutation_text(perm, mask.ndim), mask.transpose(perm))
    add("memory order", "read in the other memory order (its reversed, column-major layout reshaped to its shape "
        "instead of permuted)", np.ascontiguousarray(mask.transpose(tuple(reversed(range(mask.ndim))))).reshape(
            mask.shape))
    last = masks.steps - 1
    for j in masks.other_steps():
        other = masks.step(j)
        if other is not None and site in other and np.shape(other[site]) == mask.shape:
            wrap = (" (step k reading masks[k - 1]: step 0 wraps around to the last step)" if j == last and j > 1
                    else " (the next step's)" if j == 1 else "")
            add(f"step {j}", f"of step {j} where step 0's were handed{wrap}", np.asarray(other[site]))
    return out


def _label(way: str) -> str:
    """The cause's first words for a way of applying the masks wrongly (a kind of `wrong_masks`)."""
    return ("masks of another step" if way.startswith("step") else "dropout masks transposed" if way == "transposed"
            else "dropout masks in the other memory order")


def _kind(site: str) -> str:
    """A dropout site's kind: "emb", "attn.probs", "attn", "mlp"."""
    return site if site == "emb" else site.split(".", 2)[2]


KIND_TEXT = {"emb": "on the embedding sum (emb)", "attn.probs": "on the attention probabilities (h.i.attn.probs)",
             "attn": "after the attention projections (h.i.attn)", "mlp": "after the MLP projections (h.i.mlp)"}


# --- at the taps: attn.y under the attention masks ---------------------------------------------------------------
def attention_y(probs: np.ndarray, v: np.ndarray, multiplier: np.ndarray | float = 1.0) -> np.ndarray:
    """(probs * multiplier) @ v with the heads merged, float64: attn.y as a model with that dropout computes it."""
    return merge_heads((np.asarray(probs, dtype=np.float64) * multiplier) @ np.asarray(v, dtype=np.float64))


def _misfit(y: np.ndarray, want: np.ndarray) -> float:
    scale = max(float(np.abs(y).max()), float(np.abs(want).max()), TINY)
    return float(np.abs(y - want).max()) / scale


def _after_product(y: np.ndarray, plain: np.ndarray, p: float) -> str | None:
    """y's entries are 0 or one common multiple s of (probs @ v)'s: dropout on the product, not the probabilities."""
    live = np.abs(plain) > 1e-3 * max(float(np.abs(plain).max()), TINY)
    if live.sum() < 16:
        return None
    r = y[live] / plain[live]
    zero = np.abs(r) < FITS
    if not 0.02 < zero.mean() < 0.98:
        return None
    s = float(np.median(r[~zero]))
    if not np.all(np.abs(r[~zero] - s) < FITS * max(abs(s), 1.0)):
        return None
    scaled = ("scaled by 1/(1 - p)" if abs(s * (1 - p) - 1) < 1e-3 else "not rescaled" if abs(s - 1) < 1e-3
              else f"scaled by {s:.4g}")
    return (f"{zero.mean():.0%} of its entries zeroed and the rest {scaled}: the dropout acts on y after the value "
            "product, not on the probabilities before it (nanoGPT: att = attn_dropout(att); y = att @ v)")


def attention_dropout_cause(side: str, taps: Mapping[str, np.ndarray], block: str, masks: Masks) -> str | None:
    """Why one side's `{block}attn.y` is not its own `(attn.probs * mask / (1 - p)) @ attn.v` (the taps taken with
    the step-0 attention mask `masks.taps`): the mask missing, not rescaled, rescaled by another factor, applied
    after the value product, or the wrong mask (transposed, the other memory order, another step). None when y is
    right or no hypothesis fits."""
    site = block + "attn.probs"
    keep = masks.taps.get(site)
    probs, v, y = (taps.get(block + k) for k in ("attn.probs", "attn.v", "attn.y"))
    if keep is None or probs is None or v is None or y is None or np.shape(keep) != np.shape(probs):
        return None
    y = np.asarray(y, dtype=np.float64)
    p, keep = masks.p, np.asarray(keep, dtype=np.float64)
    right = attention_y(probs, v, keep / (1 - p))
    if right.shape != y.shape or _misfit(y, right) < FITS:
        return None
    what = f"the attention dropout ({site}): {side}'s attn.y"
    plain = attention_y(probs, v)
    if _misfit(y, plain) < FITS:
        return f"{what} is attn.probs @ attn.v, the probabilities not dropped: the attention dropout is missing"
    kept = attention_y(probs, v, keep)
    scale = float((y * kept).sum() / max(float((kept * kept).sum()), TINY))
    if _misfit(y, scale * kept) < FITS:
        how = ("not rescaled: the kept probabilities are not divided by 1 - p" if abs(scale - 1) < 1e-3 else
               f"rescaled by {scale:.4g} instead of 1/(1 - p) = {1 / (1 - p):.4g}"
               + (" (1/p)" if p and abs(scale * p - 1) < 1e-3 else ""))
        return f"{what} is (attn.probs * mask) @ attn.v {how}"
    after = _after_product(y, plain, p)
    if after:
        return f"{what} is attn.probs @ attn.v with {after}"
    full = masks.step(0)
    if full is not None and site in full:
        rows = np.shape(keep)[0]
        for kind, (how, m) in wrong_masks(site, np.asarray(full[site]), masks).items():
            if _misfit(y, attention_y(probs, v, np.asarray(m[:rows], dtype=np.float64) / (1 - p))) < FITS:
                return (f"{_label(kind)}: {side} drops the attention probabilities ({site}) with the mask {how}: its "
                        "attn.y is (attn.probs * that mask / (1 - p)) @ attn.v")
    return None


# --- at the gradients under the masks: the oracle under wrong masks ----------------------------------------------
def _oracle_gradients(params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray, config: Any,
                      masks: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    from harness.models import numpy_gpt

    try:
        _, grads = numpy_gpt.loss_and_gradients(dict(params), x, y, config, masks=dict(masks))
    except (KeyError, ValueError):  # parameters or masks that do not fit the config: not this pattern
        return None
    return {n: numpy_gpt.to_numpy(g) for n, g in grads.items()}


def _fits(grads: Mapping[str, np.ndarray], oracle: Mapping[str, np.ndarray], tol: float) -> bool:
    names = [n for n in oracle if n in grads]
    return bool(names) and all(np.shape(grads[n]) == np.shape(oracle[n]) and
                               relative_error(grads[n], oracle[n]) <= tol for n in names)


def dropout_gradient_cause(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], config: Any,
                           masks: Masks, tol: float, names: tuple[str, str], budget: float = BUDGET_S) -> str | None:
    """When the step-0 gradients under the masks differ (and agree without them): the float64 oracle's gradients
    from the probes' initial parameters on their batch under each way of applying the step-0 masks wrongly
    (`wrong_masks`), at every site at once, then at each kind of site, the likeliest first; the side whose
    gradients one of them matches (within `tol`) applies its masks that way. None when nothing fits, when the
    inputs are not there, or when `budget` seconds have gone (each try is one oracle forward and backward on the
    whole batch: seconds on large)."""
    step0 = masks.step(0)
    params = initial_params(probe_b, probe_a)
    if config is None or not step0 or not params or "x" not in probe_b or "y" not in probe_b:
        return None
    x, y = np.asarray(probe_b["x"]), np.asarray(probe_b["y"])
    right = _oracle_gradients(params, x, y, config, step0)
    if right is None:
        return None
    sides = [(name, arrays(probe, DROPOUT_GRAD_PREFIX)) for name, probe in zip(names, (probe_a, probe_b))]
    wrong = [(name, g) for name, g in sides if g and not _fits(g, right, tol)]
    if not wrong:
        return None
    variants = {site: wrong_masks(site, np.asarray(m), masks) for site, m in step0.items()}
    kinds = sorted({_kind(s) for s in step0}, key=list(KIND_TEXT).index)
    groups = [("at every site", list(step0))] + [(KIND_TEXT[k], [s for s in step0 if _kind(s) == k]) for k in kinds]
    last = f"step {masks.steps - 1}"
    likely = {"transposed": 0, last: 1, "step 1": 2, "memory order": 3}  # then the other steps
    ways = sorted({w for v in variants.values() for w in v}, key=lambda w: (likely.get(w, 4), w))
    start = time.monotonic()
    for where, sites in groups:
        for way in ways:
            if not all(way in variants[s] for s in sites):
                continue  # a mistake in the code that applies a kind of mask acts on every mask of the group
            if time.monotonic() - start > budget:
                return None  # a big model: the hypotheses tried so far did not fit
            oracle = _oracle_gradients(params, x, y, config, {**step0, **{s: variants[s][way][1] for s in sites}})
            for name, g in wrong:
                if oracle is not None and _fits(g, oracle, tol):
                    hows = "; ".join(dict.fromkeys(variants[s][way][0] for s in sites))
                    return (f"{_label(way)}: {name} applies, {where}, the masks {hows} (its gradients under the step-0 "
                            "masks are the oracle's under those)")
    return None


def p_of(hyper: Mapping[str, Any] | None, config: Any) -> float:
    """The dropout probability of a comparison (the config's, else the hyperparameters'; 0 when neither says)."""
    if config is not None:
        return float(getattr(config, "dropout", 0.0) or 0.0)
    try:
        return float((hyper or {}).get("dropout", 0.0) or 0.0)
    except (TypeError, ValueError):
        return math.nan
