"""Canonical parameter names, shapes and GPT-2 initial weights: defined once, handed to every backend.

Names and shapes follow PyTorch's conventions (a Linear weight is (out, in)); each backend maps them to its
own layout. The order of `param_shapes` is the order in which the initial weights are drawn.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from harness.config.fields import Config


def param_shapes(config: Config, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every parameter's canonical name and shape, in a fixed order.

    The options leave parameters out: `bias = false` every bias of the blocks' Linears and LayerNorms and of ln_f
    (nanoGPT's `bias`), `lm_head_bias = false` lm_head's bias, and `tie_embeddings` lm_head's weight (the output
    layer uses wte.weight, which carries the gradient of both uses), as nanoGPT's named_parameters() lists them.
    """
    d, dh, V = config.n_embd, config.d_hidden, vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (V, d),
        "wpe.weight": (config.block_size, d),
    }

    def add(name: str, shape: tuple[int, ...], bias: bool) -> None:
        shapes[name + ".weight"] = shape
        if bias:
            shapes[name + ".bias"] = shape[:1]

    for i in range(config.n_layer):
        p = f"h.{i}."
        add(p + "ln_1", (d,), config.bias)
        add(p + "attn.c_attn", (3 * d, d), config.bias)
        add(p + "attn.c_proj", (d, d), config.bias)
        add(p + "ln_2", (d,), config.bias)
        add(p + "mlp.c_fc", (dh, d), config.bias)
        add(p + "mlp.c_proj", (d, dh), config.bias)
    add("ln_f", (d,), config.bias)
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (V, d)
    if config.lm_head_bias:
        shapes["lm_head.bias"] = (V,)
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


def decays(name: str, shape: tuple[int, ...], convention: str = "nanogpt") -> bool:
    """Whether AdamW's weight decay applies to a parameter (the config's `decay`).

    "nanogpt": every tensor of 2 or more dimensions (Linear weights and the embeddings), as nanoGPT's
    configure_optimizers. "mingpt": Linear weights only (c_attn, c_proj, c_fc, lm_head), not the embeddings, biases
    or LayerNorm weights, as minGPT's; with tied embeddings the shared matrix is wte.weight, an embedding: not decayed.
    """
    if convention == "mingpt":
        return len(shape) >= 2 and name not in ("wte.weight", "wpe.weight")
    if convention != "nanogpt":
        raise ValueError(f"unknown weight-decay convention {convention!r}; use nanogpt or mingpt")
    return len(shape) >= 2


def count_parameters(config: Config, vocab_size: int, embeddings: bool = True) -> int:
    """The number of scalars `param_shapes` lists (a tied matrix once), in closed form: the run's memory estimate
    counts absurd sizes too, where enumerating the tensors would be slow. The options leave parameters out as
    `param_shapes` does: `bias` the biases of the blocks and ln_f, `lm_head_bias` lm_head's bias, tied embeddings
    lm_head's weight. Without `embeddings` the position table is left out, and the token table unless it is also the
    output layer (tied), as nanoGPT's get_num_params(non_embedding)."""
    C, Dh, V, T = config.n_embd, config.d_hidden, vocab_size, config.block_size
    b = int(config.bias)
    per_layer = 2 * C * (1 + b) + 3 * C * C + C * C + C * Dh + Dh * C + b * (3 * C + C + Dh + C)
    head = (0 if config.tie_embeddings else C * V) + (V if config.lm_head_bias else 0)
    total = V * C + T * C + config.n_layer * per_layer + C * (1 + b) + head
    if embeddings:
        return total
    return total - T * C - (0 if config.tie_embeddings else V * C)


def fingerprint(weights: dict[str, np.ndarray]) -> str:
    """sha256 over names, shapes and float32 bytes: equal fingerprints mean bit-identical weights."""
    h = hashlib.sha256()
    for name in sorted(weights):
        arr = np.ascontiguousarray(weights[name], dtype=np.float32)
        h.update(name.encode())
        h.update(repr(arr.shape).encode())
        h.update(arr.tobytes())
    return h.hexdigest()
