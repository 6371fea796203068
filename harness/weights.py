"""Canonical parameter names, shapes and GPT-2 initial weights: defined once, handed to every backend.

Names and shapes follow PyTorch's conventions (a Linear weight is (out, in)); each backend maps them to its
own layout. The order of `param_shapes` is the order in which the initial weights are drawn.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from harness.config import Config


def param_shapes(config: Config, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every parameter's canonical name and shape, in a fixed order."""
    d, dh, V = config.n_embd, config.d_hidden, vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (V, d),
        "wpe.weight": (config.block_size, d),
    }
    for i in range(config.n_layer):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
            p + "attn.c_attn.weight": (3 * d, d), p + "attn.c_attn.bias": (3 * d,),
            p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
            p + "mlp.c_fc.weight": (dh, d), p + "mlp.c_fc.bias": (dh,),
            p + "mlp.c_proj.weight": (d, dh), p + "mlp.c_proj.bias": (d,),
        })
    shapes.update({
        "ln_f.weight": (d,), "ln_f.bias": (d,),
        "lm_head.weight": (V, d), "lm_head.bias": (V,),
    })
    return shapes


def init_std(name: str, config: Config) -> float | None:
    """GPT-2 initialisation: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 n_layer).

    Returns None for parameters with a constant initial value (LayerNorm weight 1, biases 0).
    """
    if name.endswith(".bias"):
        return None
    if ".ln_" in name or name.startswith("ln_"):
        return None
    if name.endswith("c_proj.weight"):
        # the residual stream sums 2 projections per layer; scaling keeps its variance from growing with depth
        return 0.02 / math.sqrt(2 * config.n_layer)
    return 0.02


def init_weights(config: Config, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """Draw the initial weights from `seed`: float32, C-contiguous, canonical names and shapes."""
    rng = np.random.Generator(np.random.PCG64(seed))
    weights: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(config, vocab_size).items():
        std = init_std(name, config)
        if std is not None:
            weights[name] = (rng.standard_normal(shape) * std).astype(np.float32)
        elif name.endswith(".weight"):  # LayerNorm gain
            weights[name] = np.ones(shape, dtype=np.float32)
        else:
            weights[name] = np.zeros(shape, dtype=np.float32)
    return weights


def decays(name: str, shape: tuple[int, ...]) -> bool:
    """Whether AdamW's weight decay applies: only to >= 2-D tensors (matrices and embeddings), as nanoGPT."""
    return len(shape) >= 2


def count_parameters(shapes: dict[str, tuple[int, ...]], embeddings: bool = True) -> int:
    """Number of scalars; without `embeddings`, the token and position tables are left out (as in nanoGPT)."""
    return sum(int(np.prod(s)) for n, s in shapes.items() if embeddings or n not in ("wte.weight", "wpe.weight"))


def fingerprint(weights: dict[str, np.ndarray]) -> str:
    """sha256 over names, shapes and float32 bytes: equal fingerprints mean bit-identical weights."""
    h = hashlib.sha256()
    for name in sorted(weights):
        arr = np.ascontiguousarray(weights[name], dtype=np.float32)
        h.update(name.encode())
        h.update(repr(arr.shape).encode())
        h.update(arr.tobytes())
    return h.hexdigest()
