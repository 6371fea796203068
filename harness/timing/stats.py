"""Interval statistics, in one place: Student-t intervals across seeds, paired comparisons, a bootstrap median.

Used by the sweep report (across seeds), the run report and `harness bench`. No SciPy: the t quantile comes from
the regularised incomplete beta function (a continued fraction, as in Numerical Recipes) and bisection, which is
exact to far more digits than a 95 % interval needs (tests check it against the printed t table).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), converges for x < (a+1)/(a+b+2)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (0 < p < 1), by bisection on `t_cdf`."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


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


def median_ci(values: Sequence[float], n_boot: int = 2000, level: float = LEVEL) -> list[float]:
    """A bootstrap interval of the median (fixed seed): how far noise alone could move it ([] when empty)."""
    if len(values) < 2:
        return [values[0], values[0]] if len(values) else []
    rng = np.random.default_rng(0)
    data = np.asarray(values, dtype=np.float64)
    medians = np.median(data[rng.integers(0, len(data), size=(n_boot, len(data)))], axis=1)
    tail = (1.0 - level) / 2.0 * 100.0
    return [float(np.percentile(medians, tail)), float(np.percentile(medians, 100.0 - tail))]


def loglog_fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares fit of log y = log c + k log x: returns (k, c), or None with fewer than two distinct x."""
    lx = np.log(np.asarray(x, dtype=np.float64))
    ly = np.log(np.asarray(y, dtype=np.float64))
    if lx.size < 2 or np.ptp(lx) == 0:
        return None
    k, logc = np.polyfit(lx, ly, 1)
    return float(k), float(math.exp(logc))
