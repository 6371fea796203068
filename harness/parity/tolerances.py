"""Parity's tolerances: what each depth is held to, measured per precision pair and size preset (docs/parity.md),
and which backend is the reference the other re-synchronises from."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from harness.errors import UsageError


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


# Tied embeddings (measured with nanoGPT's options: tied, exact GELU, no biases), by the same rule and commands
# (tools/measure_resync.py --set ..., docs/parity.md "Tolerances per option set"), never tighter than the preset's.
# At the presets' learning rate 0.01 a tied model's free runs amplify rounding about tenfold a step once training
# moves the attention (from step 4 or 5 on): over 50 steps the float64 loss deviation reached 1.4e-2 on medium and
# the float32 one 1.4e-1, so the loss check is a divergence guard there in either precision (the re-synchronised
# depths, which each start from the same state, are as sharp as the presets': worst optimizer step 5.0e-14 in float64
# and 3.5e-5 in float32 pairs, with NOISE_FLOOR 1e-3). One stated exception: small's float32/float64 logits stay at
# the preset's 1e-6, 9.9x the worst (1.01e-7, seed 1337), not 1e-5. Large was not measured: a tied large config gets
# the loosest over both tables.
TIED_TOLERANCES: dict[str, dict[str, Tolerances]] = {
    "float64/float64": {
        "small": Tolerances(logits=1e-14, grad=1e-13, loss=1e-10, opt=1e-12, taps=1e-14, step_loss=1e-13),
        "medium": Tolerances(logits=1e-14, grad=1e-13, loss=1.0, opt=1e-12, taps=2e-14, step_loss=1e-13),
    },
    "float32/float64": {
        "small": Tolerances(logits=1e-6, grad=1e-5, loss=1e-1, opt=1e-3, taps=5e-6, step_loss=1e-5),
        "medium": Tolerances(logits=1e-5, grad=1e-4, loss=10.0, opt=1e-3, taps=1e-5, step_loss=1e-5),
    },
    "float32/float32": {
        "small": Tolerances(logits=1e-6, grad=1e-5, loss=1e-1, opt=1e-3, taps=5e-6, step_loss=1e-5),
        "medium": Tolerances(logits=1e-5, grad=1e-4, loss=10.0, opt=1e-3, taps=1e-5, step_loss=1e-5),
    },
}
TIED = "tied embeddings"  # the option set of TIED_TOLERANCES


TOL_KEYS = tuple(f.name for f in fields(Tolerances))  # --tol-<key> options, parity.json's "tolerances"


LOOSEST = "float32/float32"  # used for a dtype pair that was never measured


# What a command may change without leaving its measured entry: the run's length, dropout (measured at 0 and 0.2,
# the attention masks with the tied set) and evaluation; a tied config may also change the model options it was
# measured with (nanoGPT's, and tied embeddings alone).
FREE_FIELDS = frozenset({"name", "steps", "epochs", "dropout", "attn_dropout", "eval_interval", "eval_batches",
                         "target_val_loss"})
TIED_FIELDS = frozenset({"tie_embeddings", "gelu", "bias", "lm_head_bias"})


def precision_pair(dtype_a: str, dtype_b: str) -> str:
    """The precision pair of two backends' dtypes, e.g. "float32/float64" (order does not matter)."""
    return "/".join(sorted((str(dtype_a), str(dtype_b))))


def default_tolerances(pair: str, size: str | None = None, options: str | None = None) -> Tolerances:
    """The measured default tolerances of a precision pair, size preset and option set (None: the presets' own
    model; TIED: tied embeddings, TIED_TOLERANCES).

    For a size not measured with those options (`size` None: a config of one's own) the loosest over the measured
    sizes (with TIED, over both tables); for a pair never measured, those of the loosest pair.
    """
    presets = DEFAULT_TOLERANCES.get(pair, DEFAULT_TOLERANCES[LOOSEST])
    table = TIED_TOLERANCES.get(pair, TIED_TOLERANCES[LOOSEST]) if options == TIED else presets
    if size in table:
        return table[size]
    over = [*table.values(), *(presets.values() if options == TIED else ())]
    return Tolerances(**{k: max(getattr(t, k) for t in over) for k in TOL_KEYS})


def tolerance_entry(config: Any) -> tuple[str | None, str | None]:
    """(size, option set) of the measured tolerances that apply to `config`: its preset (by name) when that was
    measured with its options and `config` differs from it at most in FREE_FIELDS (and, tied, in TIED_FIELDS), else
    None: a config of one's own; the option set TIED when its embeddings are tied, else None."""
    from harness.config.presets import read_preset

    options = TIED if getattr(config, "tie_embeddings", False) else None
    name = getattr(config, "name", None)
    if name not in (TIED_TOLERANCES if options == TIED else DEFAULT_TOLERANCES)[LOOSEST]:
        return None, options
    preset, mine = read_preset(name).to_dict(), config.to_dict()
    free = FREE_FIELDS | (TIED_FIELDS if options == TIED else frozenset())
    same = all(mine.get(k) == v for k, v in preset.items() if k not in free)
    return (name if same else None), options


def tolerances_for(pair: str, config: Any) -> tuple[Tolerances, str]:
    """The measured default tolerances of `pair` for `config` (tolerance_entry) and where they come from, in words
    ("medium preset", "medium preset, tied embeddings", "loosest over the presets", ...)."""
    size, options = tolerance_entry(config)
    tol = default_tolerances(pair, size, options)
    tied = ", tied embeddings" if options == TIED else ""
    if size is not None:
        return tol, f"{size} preset{tied}"
    return tol, "loosest over the presets" + (" and tied embeddings" if options == TIED else "")


def reference_backend(backends: Sequence[str]) -> str:
    """The backend whose optimizer states the other re-synchronises from: the NumPy oracle (harness.backends.ORACLE)
    where it takes part, else the first named."""
    from harness.backends import ORACLE

    return ORACLE if ORACLE in backends else backends[0]
