"""Interval statistics, in one place: Student-t intervals across seeds, paired comparisons, a bootstrap median.

Used by the sweep report (across seeds), the run report and `harness bench`. The t quantile is SciPy's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (0 < p < 1): `scipy.stats.t.ppf`."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    from scipy.stats import t  # imported when an interval is drawn: a worker never pays for it

    return float(t.ppf(p, df))


@dataclass(frozen=True)
class Interval:
    """An estimate with its interval; `lo`/`hi` are None when there is a single value (no spread to measure)."""

    estimate: float
    lo: float | None
    hi: float | None
    n: int
    level: float = LEVEL

    def fmt(self, spec: str = ".4g", unit: str = "") -> str:
        """'1.42x [1.37, 1.48]' style: the estimate, then the interval in brackets (or 'n=1')."""
        if self.lo is None or self.hi is None:
            return f"{self.estimate:{spec}}{unit} (n={self.n}, no interval)"
        return f"{self.estimate:{spec}}{unit} [{self.lo:{spec}}, {self.hi:{spec}}]"


def mean_ci(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean with the Student-t interval mean ± t_{(1+level)/2, n-1} · s / √n (s: sample standard deviation)."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if x.size == 0:
        raise ValueError("mean_ci of no finite values")
    m = float(x.mean())
    if x.size < 2:
        return Interval(m, None, None, int(x.size), level)
    half = t_quantile((1.0 + level) / 2.0, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Interval(m, m - half, m + half, int(x.size), level)


def geometric_mean_ci(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Geometric mean of positive values with the t interval of their logarithms, exponentiated.

    For times, rates and memory: positive and right-skewed (one slow seed doubles a time, never halves it below
    zero), so an arithmetic interval can reach below zero while this one never does.
    """
    logs = mean_ci([math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0], level)
    lo = None if logs.lo is None else math.exp(logs.lo)
    hi = None if logs.hi is None else math.exp(logs.hi)
    return Interval(math.exp(logs.estimate), lo, hi, logs.n, level)


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean of the per-pair differences a_i - b_i (pairs share a seed) with its t interval."""
    if len(a) != len(b):
        raise ValueError("paired_difference needs pairs")
    return mean_ci([x - y for x, y in zip(a, b)], level)


def paired_ratio(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
    """Geometric mean of the per-pair ratios a_i / b_i with its interval: a t interval on log ratios, exponentiated.

    Ratios of times are skewed (2x and 0.5x are symmetric on a log scale), so the log is the scale where a mean and
    a symmetric interval make sense; the result is a ratio and its interval never crosses zero.
    """
    if len(a) != len(b):
        raise ValueError("paired_ratio needs pairs")
    logs = mean_ci([math.log(x / y) for x, y in zip(a, b) if x > 0 and y > 0], level)
    lo = None if logs.lo is None else math.exp(logs.lo)
    hi = None if logs.hi is None else math.exp(logs.hi)
    return Interval(math.exp(logs.estimate), lo, hi, logs.n, level)


RESAMPLED_MAX = 4_000_000  # values drawn by a resampled bootstrap (n_boot x n); beyond, its exact distribution


def median_ci(values: Sequence[float], n_boot: int = 2000, level: float = LEVEL) -> list[float]:
    """A bootstrap interval of the median: how far noise alone could move it ([] when empty). `n_boot` resamples
    (fixed seed) while they draw at most `RESAMPLED_MAX` values; for more values, the bootstrap's exact distribution
    (`exact_median_ci`), which needs no resample: a million steps take a fraction of a second, not minutes and
    gigabytes."""
    if len(values) < 2:
        return [values[0], values[0]] if len(values) else []
    data = np.asarray(values, dtype=np.float64)
    if n_boot * len(data) > RESAMPLED_MAX:
        return exact_median_ci(data, level)
    rng = np.random.default_rng(0)
    medians = np.median(data[rng.integers(0, len(data), size=(n_boot, len(data)))], axis=1)
    tail = (1.0 - level) / 2.0 * 100.0
    return [float(np.percentile(medians, tail)), float(np.percentile(medians, 100.0 - tail))]


def exact_median_ci(data: np.ndarray, level: float = LEVEL) -> list[float]:
    """The percentile interval of the bootstrap distribution of the median, exactly (the limit of infinitely many
    resamples): a resample's median is at most the k-th smallest value x_(k) exactly when at least m = ceil(n/2)
    of its n draws are, a Binomial(n, k/n) count (SciPy's `bdtrc`), so each bound is the order statistic x_(k) whose
    probability first reaches the tail; found by bisection over k, read with one partial sort."""
    from scipy.special import bdtrc  # Binomial(n, p)'s survival function, P(X > k) (scipy.stats.binom.sf's kernel)

    n = len(data)
    m = (n + 1) // 2

    def first_k(p: float) -> int:
        lo, hi = 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            if bdtrc(m - 1, n, mid / n) >= p:
                hi = mid
            else:
                lo = mid + 1
        return lo

    tail = (1.0 - level) / 2.0
    ks = [first_k(tail) - 1, first_k(1.0 - tail) - 1]
    part = np.partition(data, ks)
    return [float(part[ks[0]]), float(part[ks[1]])]


def loglog_fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares fit of log y = log c + k log x: returns (k, c), or None with fewer than two distinct x."""
    lx = np.log(np.asarray(x, dtype=np.float64))
    ly = np.log(np.asarray(y, dtype=np.float64))
    if lx.size < 2 or np.ptp(lx) == 0:
        return None
    k, logc = np.polyfit(lx, ly, 1)
    return float(k), float(math.exp(logc))
