"""Canonical (PyTorch) <-> Flux layout conversions, in NumPy only (no Julia needed).

The Flux layout is what the Julia package NanoGPTFlux stores:

- Dense weights keep PyTorch's (out, in) shape: Flux's `Dense` stores `weight` as (out, in) too;
- embedding tables are transposed: `wte` (V, d) -> (d, V), `wpe` (n, d) -> (d, n) (Flux's
  `Embedding` stores (dim, vocab), so a token's vector is a column);
- vectors (biases, LayerNorm weights) are unchanged;
- token ids: canonical (B, T) 0-based -> (T, B) 1-based;
- logits: Flux (V, T, B) -> canonical (B, T, V);
- dropout keep-masks (harness.core.masks): canonical bool (B, T, C) -> Flux bool (C, T, B), the layout of the
  activations they multiply in the Flux model; at the attention probabilities (B, H, T_query, T_key) -> NNlib's
  (T_key, T_query, H, B), the layout of the probabilities `dot_product_attention` hands its `fdrop`;
- activation taps (harness.core.taps, NanoGPTFlux `taps`): every tap's axes reversed ((C, T, B) -> (B, T, C), the
  attention probabilities NNlib's (T_key, T_query, H, B) -> (B, H, T_query, T_key)), except q, k and v, which
  NNlib splits as (D, H, T, B) -> canonical (B, H, T, D).

Arrays handed to Julia are Fortran-ordered (column-major), the memory order Julia expects, so the
juliacall wrapper reads them with unit stride; arrays coming back are C-ordered float32.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from harness.core.taps import HEAD_TAPS, kind

# The dropout sites of the shared-mask contract (harness/core/masks.py): after the embedding sum, after block i's
# attention output projection and after its MLP output projection (3-D masks), and on block i's attention
# probabilities (4-D masks).
MASK_KEY = re.compile(r"emb|h\.\d+\.(attn|mlp)")
PROBS_MASK_KEY = re.compile(r"h\.\d+\.attn\.probs")
# Each site's mask: canonical axes -> Flux axes. Activations (B, T, C) -> (C, T, B); attention probabilities
# (B, H, T_query, T_key) -> (T_key, T_query, H, B), NNlib's (kv_len, q_len, nheads, batch). Both reverse the axes,
# and each permutation is its own inverse.
MASK_AXES = (2, 1, 0)
PROBS_MASK_AXES = (3, 2, 1, 0)


# Parameters whose Flux array is the transpose of the canonical one.
TRANSPOSED = ("wte.weight", "wpe.weight")


def _is_transposed(name: str) -> bool:
    # also matches optimizer-state keys such as "adam_m/wte.weight"
    return name.rsplit("/", 1)[-1] in TRANSPOSED


def _relayout(arrays: Mapping[str, np.ndarray], order: str) -> dict[str, np.ndarray]:
    """Transpose the embedding tables (the layouts are each other's transpose there), copy to float32 `order`."""
    out: dict[str, np.ndarray] = {}
    for name, arr in arrays.items():
        a = np.asarray(arr, dtype=np.float32)
        if _is_transposed(name):
            if a.ndim != 2:
                raise ValueError(f"{name}: expected a 2-D embedding table, got shape {a.shape}")
            a = a.T
        out[name] = np.array(a, dtype=np.float32, order=order, copy=True)
    return out


def to_flux(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Canonical {name: array} -> Flux layout, float32, Fortran-ordered (column-major, as Julia stores it)."""
    return _relayout(weights, "F")


def from_flux(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Flux layout {name: array} -> canonical layout, float32, C-ordered (copies)."""
    return _relayout(arrays, "C")


def tokens_to_flux(x: np.ndarray) -> np.ndarray:
    """Canonical (B, T) 0-based token ids -> (T, B) 1-based int64, Fortran-ordered."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"token batch must be 2-D (B, T), got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {x.dtype}")
    return np.asfortranarray(x.T.astype(np.int64) + 1)


def tokens_from_flux(x: np.ndarray) -> np.ndarray:
    """(T, B) 1-based ids -> canonical (B, T) 0-based int64, C-ordered."""
    return np.ascontiguousarray(np.asarray(x).T.astype(np.int64) - 1)


def logits_from_flux(arr: np.ndarray) -> np.ndarray:
    """Flux logits (V, T, B) -> canonical (B, T, V), float32, C-ordered (a copy)."""
    a = np.asarray(arr, dtype=np.float32)
    if a.ndim != 3:
        raise ValueError(f"logits must be 3-D (V, T, B), got shape {a.shape}")
    return np.ascontiguousarray(a.transpose(2, 1, 0))


def logits_to_flux(arr: np.ndarray) -> np.ndarray:
    """Canonical logits (B, T, V) -> Flux (V, T, B), Fortran-ordered."""
    return np.asfortranarray(np.asarray(arr, dtype=np.float32).transpose(2, 1, 0))


def _mask_axes(name: str) -> tuple[int, ...]:
    """The permutation of site `name`'s mask (its own inverse); ValueError for a name that is no dropout site."""
    if MASK_KEY.fullmatch(name):
        return MASK_AXES
    if PROBS_MASK_KEY.fullmatch(name):
        return PROBS_MASK_AXES
    raise ValueError(f"unknown dropout mask {name!r}; expected 'emb', 'h.<i>.attn', 'h.<i>.mlp' or "
                     "'h.<i>.attn.probs'")


def masks_to_flux(masks: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Harness keep-masks {site: bool (B, T, C), or (B, H, T, T) at "h.{i}.attn.probs"} -> Flux layout
    {site: bool (C, T, B), or (T_key, T_query, H, B)}, Fortran-ordered (copies).

    The Flux model's activations are (C, T, B), column-major, so entry [c, t, b] of the result is entry [b, t, c]
    of the harness's mask; NNlib's attention probabilities are (key s, query t, head h, batch b), so entry
    [s, t, h, b] is the harness's [b, h, t, s]. Sites are "emb", "h.{i}.attn", "h.{i}.mlp" and "h.{i}.attn.probs";
    anything else, a non-bool array, a mask of the wrong rank or masks of one kind with different shapes raise
    ValueError.
    """
    out: dict[str, np.ndarray] = {}
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # the shape of each kind's masks (by its permutation)
    for name, mask in masks.items():
        axes = _mask_axes(name)
        m = np.asarray(mask)
        want = "(B, T, C)" if axes == MASK_AXES else "(B, H, T, T)"
        if m.dtype != np.bool_ or m.ndim != len(axes):
            raise ValueError(f"dropout mask {name!r} must be a bool {want} array, got {m.dtype} {m.shape}")
        if shapes.setdefault(axes, m.shape) != m.shape:
            raise ValueError(f"dropout mask {name!r} has shape {m.shape}, the others {shapes[axes]}")
        out[name] = np.asfortranarray(m.transpose(axes))
    return out


def masks_from_flux(masks: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Flux-layout keep-masks {site: (C, T, B) or (T_key, T_query, H, B)} -> harness layout {site: bool (B, T, C)
    or (B, H, T, T)}, C-ordered (copies)."""
    return {name: np.ascontiguousarray(np.asarray(m, dtype=bool).transpose(_mask_axes(name)))
            for name, m in masks.items()}


HEAD_AXES = (3, 1, 2, 0)  # NNlib's split heads (D, H, T, B) <-> canonical (B, H, T, D); its own inverse


def _tap_axes(name: str, ndim: int) -> tuple[int, ...]:
    return HEAD_AXES if kind(name) in HEAD_TAPS else tuple(reversed(range(ndim)))


def taps_from_flux(taps: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """NanoGPTFlux's activation taps {name: Flux-layout array} -> canonical layout (harness.core.taps), C-ordered copies
    in their own dtype."""
    out: dict[str, np.ndarray] = {}
    for name, arr in taps.items():
        a = np.asarray(arr)
        if kind(name) in HEAD_TAPS and a.ndim != 4:
            raise ValueError(f"tap {name!r} must be 4-D (D, H, T, B), got shape {a.shape}")
        out[name] = np.ascontiguousarray(a.transpose(_tap_axes(name, a.ndim)))
    return out


def taps_to_flux(taps: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Canonical activation taps -> the layout NanoGPTFlux's `taps` returns, Fortran-ordered copies (the inverse of
    `taps_from_flux`)."""
    return {name: np.asfortranarray(np.asarray(a).transpose(_tap_axes(name, np.ndim(a)))) for name, a in taps.items()}
