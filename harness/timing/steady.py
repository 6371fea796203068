"""Steady-state figures of a training run: which steps count (after the warm-up, undisturbed), and their median,
percentiles and tokens per second.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

WARMUP_STEPS = 10  # steps left out of the steady-state statistics (JIT, allocator and cache warm-up)


# `timings.figures_from` of a record: which steady steps its figures come from. Stored in records on disk and
# compared by the reports, so these strings never change.
FIGURES_UNDISTURBED = "undisturbed steps"


FIGURES_ALL = "all steady steps (none undisturbed)"


def steady_start(n_steps: int, warmup: int = WARMUP_STEPS) -> int:
    """Index of the first steady-state step: after `warmup` steps, or after the first one in a shorter run."""
    return warmup if n_steps > warmup else (1 if n_steps > 1 else 0)


def steady_times(times: Sequence[float], warmup: int = WARMUP_STEPS,
                 disturbed: Sequence[bool] | None = None) -> tuple[np.ndarray, dict]:
    """The steady-state step times the figures come from, and what was chosen: the steps after `warmup`, less
    those judged disturbed (`disturbed`, per step: harness.timing.contention.disturbed_steps), unless every one was; a
    step without a time (NaN) is left out after the flags are matched to their steps."""
    first = steady_start(len(times), warmup)
    steady = np.asarray(times[first:], dtype=np.float64)
    info: dict = {"warmup_steps": min(warmup, len(times)), "steady_steps_all": int(steady.size)}
    if disturbed is not None and steady.size:
        flags = np.asarray(list(disturbed)[first:len(times)], dtype=bool)
        flags = np.pad(flags, (0, steady.size - flags.size))  # steps beyond the evidence count as undisturbed
        clean = steady[~flags]
        info["disturbed_steps"] = int(flags.sum())
        info["figures_from"] = FIGURES_UNDISTURBED if clean.size else FIGURES_ALL
        steady = clean if clean.size else steady
    return steady[np.isfinite(steady)], info


def summarize_times(times: list[float], tokens_per_step: int, warmup: int = WARMUP_STEPS,
                    disturbed: Sequence[bool] | None = None) -> dict:
    """Steady-state step-time statistics (median, p10, p90, IQR) and tokens/s of `steady_times`.

    `disturbed_steps` says how many steady steps were dropped as disturbed, `steady_steps` how many were used, and
    `figures_from` whether they are the undisturbed ones or (every one disturbed) all of them."""
    steady, out = steady_times(times, warmup, disturbed)
    if steady.size == 0:
        return {}
    q10, q25, q50, q75, q90 = np.percentile(steady, [10, 25, 50, 75, 90])
    out.update({"steady_steps": int(steady.size), "step_median_s": float(q50), "step_p10_s": float(q10),
                "step_p90_s": float(q90), "step_iqr_s": float(q75 - q25), "step_mean_s": float(steady.mean()),
                "tokens_per_s": float(tokens_per_step / q50) if q50 > 0 else None})
    return out
