"""The learning rate of every training step: computed here once and handed to every backend's `train_step`.

`learning_rate(config, step)` is karpathy/nanoGPT's `get_lr(it)` (train.py) with it = step (0-based): a linear
warm-up over the first `warmup_steps` steps, lr * (it + 1) / (warmup_steps + 1), then for lr_schedule "cosine" a
half cosine from the learning rate at it = warmup_steps down to `min_lr` at it = decay_steps, and `min_lr` after
it; for "constant" the learning rate itself after the warm-up (with warmup_steps 0: every step, nanoGPT's
decay_lr = False). The operations are nanoGPT's, in its order, so the rates are bit-identical to its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from harness.config.fields import Config
from harness.core.weights import decays


def learning_rate(config: Config, step: int) -> float:
    """The learning rate of training step `step` (0-based: the first update is step 0)."""
    lr, warmup = config.learning_rate, config.warmup_steps
    if step < warmup:  # linear warm-up; (step + 1) so that step 0 does not get 0
        return lr * (step + 1) / (warmup + 1)
    if config.lr_schedule == "constant":
        return lr
    if step > config.decay_steps:
        return config.min_lr
    decay_ratio = (step - warmup) / (config.decay_steps - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 at the end of the warm-up, 0 at decay_steps
    return config.min_lr + coeff * (lr - config.min_lr)


def learning_rates(config: Config, steps: int) -> list[float]:
    """The rates of training steps 0 .. steps - 1."""
    return [learning_rate(config, k) for k in range(steps)]


def describe(config: Config) -> str:
    """The schedule in one line, with its formula (for the kit's manifest and the docs)."""
    lr, w = config.learning_rate, config.warmup_steps
    warm = f"linear warm-up lr * (k + 1) / ({w} + 1) for steps k < {w}, then " if w else ""
    if config.lr_schedule == "constant":
        return f"{warm}constant lr = {lr:g}"
    return (f"{warm}cosine: min_lr + 0.5 * (1 + cos(pi * (k - {w}) / ({config.decay_steps} - {w}))) * (lr - min_lr) "
            f"for {w} <= k <= {config.decay_steps}, min_lr after; lr = {lr:g}, min_lr = {config.min_lr:g} "
            "(nanoGPT's get_lr, k = its iter_num, 0-based)")


def effective_rate(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray], m: Mapping[str, np.ndarray],
                   v: Mapping[str, np.ndarray], t: int, config: Config) -> float:
    """The learning rate an AdamW step took, read from the parameters before and after it and the moments m, v
    after it (step count t): the step is p_t = p_(t-1) - lr u with u = weight_decay p_(t-1) (decayed parameters)
    + m / (1 - beta1^t) / (sqrt(v) / sqrt(1 - beta2^t) + eps), so lr = -<p_t - p_(t-1), u> / <u, u>, over every
    parameter, in float64. A backend that was handed one rate and stepped with another shows it here, whatever
    the other backend did before (parity: the diagnosis of a schedule mistake,
    harness.parity.options.diagnose_schedule)."""
    bc1, bc2 = 1 - config.beta1 ** t, math.sqrt(1 - config.beta2 ** t)
    num = den = 0.0
    for name, p0 in before.items():
        p0 = np.asarray(p0, dtype=np.float64)
        u = np.asarray(m[name], dtype=np.float64) / bc1 / (np.sqrt(np.asarray(v[name], dtype=np.float64)) / bc2
                                                           + config.eps)
        if config.weight_decay and decays(name, p0.shape, config.decay):
            u = u + config.weight_decay * p0
        num -= float(np.vdot(np.asarray(after[name], dtype=np.float64) - p0, u))
        den += float(np.vdot(u, u))
    return num / den if den > 0 else math.nan
