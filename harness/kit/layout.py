"""The layout of every array in a kit: its axes in the canonical (PyTorch, row-major) order and what a column-major,
features-first framework (Flux, Lux) receives. The Flux shapes come from harness.backends.flux_layout, the one place
the harness converts layouts; this module only asks it, on empty arrays of the right shape."""

from __future__ import annotations

from typing import Any

import numpy as np

from harness.backends import flux_layout
from harness.core.taps import HEAD_TAPS, kind, tap_axes
from harness.core.taps import PREFIX as TAP_PREFIX


def param_axes(name: str, ndim: int) -> list[str]:
    """Axis names of a canonical parameter (a Linear weight is (out, in), an embedding table (rows, embd))."""
    if name == "wte.weight":
        return ["vocab", "embd"]
    if name == "wpe.weight":
        return ["position", "embd"]
    return ["out", "in"] if ndim == 2 else ["features"]


def _flux_param_shape(name: str, shape: tuple[int, ...]) -> list[int]:
    return list(flux_layout.to_flux({name: np.zeros(shape, dtype=np.float32)})[name].shape)


def _flux_mask_shape(key: str, shape: tuple[int, ...]) -> list[int] | None:
    # the layout the Flux backend hands its masks to Julia in (harness.backends.flux_layout), not merely reversed
    return list(flux_layout.masks_to_flux({key: np.zeros(shape, dtype=bool)})[key].shape)


def describe(group: str, key: str, shape: tuple[int, ...]) -> dict[str, Any]:
    """Layout of array `key` of a kit file (`group`: weights, batches, masks, expected): canonical axes (row-major,
    last axis fastest) and, for Flux/Lux, the per-step shape and the conversion."""
    name = key.rsplit("/", 1)[-1]
    out: dict[str, Any] = {"shape": list(shape), "order": "C"}
    if group == "batches" and key == "lr":
        out.update(axes=["step"], flux="unchanged: lr[k] is step k's learning rate (0-based k)")
    elif group == "batches":
        step = flux_layout.tokens_to_flux(np.zeros(shape[1:], dtype=np.int64))
        out.update(axes=["step", "batch", "time"], flux_per_step_shape=list(step.shape),
                   flux="x[k] is (B, T) 0-based: transpose to (T, B) and add 1 (flux_layout.tokens_to_flux)")
    elif group == "masks" and key.endswith(".probs"):  # the attention probabilities' masks (attn_dropout)
        out.update(axes=["step", "batch", "head", "query", "key"],
                   flux_per_step_shape=_flux_mask_shape(key, shape[1:]),
                   flux="masks[k] is (B, H, T_query, T_key): permutedims to NNlib's (T_key, T_query, H, B), the "
                        "layout of dot_product_attention's probabilities (flux_layout.masks_to_flux)")
    elif group == "masks":
        out.update(axes=["step", "batch", "time", "embd"], flux_per_step_shape=_flux_mask_shape(key, shape[1:]),
                   flux="masks[k] is (B, T, C): permutedims to (C, T, B) (flux_layout.masks_to_flux)")
    elif key == "logits":
        out.update(axes=["batch", "time", "vocab"],
                   flux_shape=list(flux_layout.logits_to_flux(np.zeros(shape, dtype=np.float32)).shape),
                   flux="Flux logits are (V, T, B): permutedims(l, (3, 2, 1)) (flux_layout.logits_from_flux)")
    elif key.startswith(TAP_PREFIX):  # an activation tap (harness/core/taps.py)
        name = key[len(TAP_PREFIX):]
        out.update(axes=tap_axes(name),
                   flux_shape=list(flux_layout.taps_to_flux({name: np.zeros(shape, dtype=np.float32)})[name].shape),
                   flux="NanoGPTFlux.taps gives (D, H, T, B): permutedims(a, (4, 2, 3, 1))" if kind(name) in HEAD_TAPS
                   else "NanoGPTFlux.taps gives the axes reversed: permutedims(a, ndims(a):-1:1) "
                        "(flux_layout.taps_from_flux)")
    elif key in ("loss", "logits_loss"):
        out.update(axes=["step"] if shape else [], flux="unchanged")
    else:  # a parameter, its gradient or an AdamW moment
        flux_shape = _flux_param_shape(name, shape)
        out.update(axes=param_axes(name, len(shape)), flux_shape=flux_shape,
                   flux="transposed (Flux Embedding is (embd, rows))" if name in flux_layout.TRANSPOSED
                   else "unchanged (Flux Dense weight is (out, in) too)")
    return out
