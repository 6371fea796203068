"""The numbers parity reads differences with: relative errors, "worst first", least-squares factors.

Shared by the comparison (harness.parity.compare), its diagnoses (forward, optimizer, options) and the kit; every
computation is in float64, and a NaN anywhere is never read as "within tolerance".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

TINY = 1e-300  # floor of the relative error's denominator: two all-zero arrays agree exactly


# An entry whose sqrt(v) is below this fraction of its parameter's median is rounding noise. Its gradient carries an
# absolute rounding error of a few epsilon times the parameter's gradient scale (measured: 3.3 eps), which Adam's
# division by sqrt(v) turns into the update's relative error: at 1e-3 of the median about 3e3 eps for that entry
# (4e-4 in float32, 7e-13 in float64), below either pair's optimizer tolerance (1e-3, 1e-12) before the parameter's
# other entries dilute it; at 1e-4, ten times over it. (1e-4 before: one entry of h.0.ln_2.weight at 1.1e-4
# of the median, tied medium, seed 5, step 1, alone made float32's worst correct update error 1.5e-4 and float64's
# 1.3e-13.)
NOISE_FLOOR = 1e-3


def relative_error(a: np.ndarray, b: np.ndarray, tiny: float = TINY) -> float:
    """||a - b|| / max(||a||, ||b||, tiny), Frobenius norms in float64; NaN if either holds a non-finite value."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"shapes differ: {a64.shape} vs {b64.shape}")
    if not (np.isfinite(a64).all() and np.isfinite(b64).all()):
        return math.nan
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(a64), np.linalg.norm(b64), tiny))


def worst_key(value: float) -> tuple[bool, float]:
    """The order "worst first" of errors and deviations: NaN (or inf) above every finite value, then the largest."""
    return (not math.isfinite(value), value if math.isfinite(value) else 0.0)


def worst(values: Mapping[Any, float]) -> Any:
    """The key of the worst value of `values` (NaN first, then the largest; the first of equals); None if empty."""
    return max(values, key=lambda k: worst_key(values[k])) if values else None


def within(value: float, tol: float) -> bool:
    """value <= tol; False for NaN."""
    return bool(value <= tol)


def fmt(value: float) -> str:
    """An error or deviation as the tables and FAIL lines print it: "nan" or 1.2e-05."""
    return "nan" if value != value else f"{value:.1e}"


def fmt_index(where: Sequence[int]) -> str:
    """An array index as the tables and FAIL lines print it: [0,3,7]."""
    return "[" + ",".join(str(i) for i in where) + "]"


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


def tap_error(a: np.ndarray, b: np.ndarray) -> tuple[float, float, tuple[int, ...]]:
    """(max |a - b| / the larger of max |a| and max |b|, max |a - b|, its index): a tap's deviation relative to its
    own scale (activations range from ~0.01 to ~4), NaN anywhere gives NaN."""
    diff, where = max_abs_diff(a, b)
    scale = max(float(np.max(np.abs(a))) if np.size(a) else 0.0, float(np.max(np.abs(b))) if np.size(b) else 0.0)
    return (diff / scale if scale > 0 else diff) if math.isfinite(scale) else math.nan, diff, where


def loss_deviation(losses_a: Sequence[float], losses_b: Sequence[float]) -> tuple[float, int, list[float]]:
    """Over the common steps: max |la - lb|, the step where it peaks (first NaN wins) and every step's |diff|."""
    n = min(len(losses_a), len(losses_b))
    if n == 0:
        return math.nan, -1, []
    d = np.abs(np.asarray(losses_a[:n], dtype=np.float64) - np.asarray(losses_b[:n], dtype=np.float64))
    bad = ~np.isfinite(d)
    step = int(np.argmax(bad)) if bad.any() else int(np.argmax(d))
    return (math.nan if bad.any() else float(d[step])), step, [float(v) for v in d]


def first_over(values: Sequence[float], tol: float) -> int:
    """The index of the first value over `tol` (NaN counts as over), -1 if none."""
    return next((i for i, v in enumerate(values) if not within(v, tol)), -1)


STORAGE_ROUNDINGS = 2  # roundings of a parameter-sized value a step's stored result carries, at most (docs/parity.md)


def update_error(ua: np.ndarray, ub: np.ndarray, va: np.ndarray | None, vb: np.ndarray | None,
                 scale: np.ndarray | None = None, eps: float = 0.0) -> float:
    """The relative error of two updates, robust where they are near zero against their parameter.

    - Storage: an update is the difference of two stored parameters, so each entry is exact only to the rounding
      of a value of the parameter's size, not of the update's: with the learning rate in a warm-up (1e-5) a
      LayerNorm gain of 1 moves by 1e-5 while float32 holds it to 6e-8. Each entry's |ua - ub| is first reduced
      by STORAGE_ROUNDINGS x eps x `scale` (`scale`: the entry's |parameter| around the step, `eps`: the machine
      epsilon of the coarser precision compared; the loaded start and the rounded result, each at most half an
      ulp <= eps x |p| / 2, and one more rounding of the update's own arithmetic at that size); what is left is
      held to the update's own size. A real defect moves the update by a fraction of itself, which is far above
      eps x |p| unless the update itself is within a few thousand ulps of the parameter.
    - Rounding noise of gradients: leaves out the entries whose gradient is at rounding level on both sides: sqrt(v)
      > 0 but below NOISE_FLOOR x the parameter's median sqrt(v) (e.g. the key bias, whose exact gradient is 0:
      Adam divides its rounding noise by sqrt(v) and moves it by up to the learning rate, differently in every
      backend). Entries with v exactly 0 (rows no token used: decay only) are kept.
    """
    ua64, ub64 = np.asarray(ua, dtype=np.float64), np.asarray(ub, dtype=np.float64)
    if ua64.shape != ub64.shape:
        raise ValueError(f"shapes differ: {ua64.shape} vs {ub64.shape}")
    diff = np.abs(ua64 - ub64)
    if scale is not None and eps > 0 and np.shape(scale) == ua64.shape:
        with np.errstate(invalid="ignore"):  # a NaN stays NaN: never within tolerance
            diff = np.where(np.isfinite(diff), np.maximum(diff - STORAGE_ROUNDINGS * eps * np.abs(scale), 0.0), diff)
    keep = np.ones(ua64.shape, dtype=bool)
    if va is not None and vb is not None and np.shape(va) == ua64.shape and np.shape(vb) == ua64.shape:
        s = np.sqrt(np.maximum(np.maximum(np.asarray(va, dtype=np.float64), np.asarray(vb, dtype=np.float64)), 0.0))
        live = s > 0
        if live.any():
            keep = ~(live & (s < NOISE_FLOOR * float(np.median(s[live]))))
    ua64, ub64, diff = ua64[keep], ub64[keep], diff[keep]
    if not (np.isfinite(ua64).all() and np.isfinite(ub64).all()):
        return math.nan
    return float(np.linalg.norm(diff) / max(np.linalg.norm(ua64), np.linalg.norm(ub64), TINY))


def storage_eps(*arrays: np.ndarray) -> float:
    """The machine epsilon of the coarsest floating-point precision among `arrays` (0 if none is floating point)."""
    kinds = [np.asarray(a).dtype for a in arrays if np.asarray(a).dtype.kind == "f"]
    return max((float(np.finfo(k).eps) for k in kinds), default=0.0)


def common_factor(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """The least-squares factor f with a ~ f b, and the fraction ||a - f b|| / ||a - b|| of the difference it
    leaves unexplained (0: a is exactly a scaled b; nan when a == b)."""
    bb = float(b @ b)
    f = float(a @ b) / bb if bb > 0 else math.nan
    diff = float(np.linalg.norm(a - b))
    if not (diff > 0 and math.isfinite(f)):
        return f, math.nan
    return f, float(np.linalg.norm(a - f * b)) / diff


def proportional(d: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """alpha with d ~ alpha p (least squares) and the fraction ||d - alpha p|| / ||d|| it leaves unexplained; (nan,
    nan) when d or p is zero."""
    pp, nd = float(p @ p), float(np.linalg.norm(d))
    if pp == 0 or nd == 0:
        return math.nan, math.nan
    alpha = float(d @ p) / pp
    return alpha, float(np.linalg.norm(d - alpha * p)) / nd


def float32_stored_as_float64(arrays: Mapping[str, np.ndarray]) -> bool:
    """Whether every float64 array holds only float32 values (a float32 computation written as float64)."""
    floats = [np.asarray(v) for v in arrays.values() if np.asarray(v).dtype == np.float64 and np.size(v)]
    return bool(floats) and all(np.array_equal(v, v.astype(np.float32).astype(np.float64)) for v in floats)
