"""Dropout masks drawn once by the harness and handed to every backend (docs/design.md, "Parity").

With `harness parity --dropout P` every backend must drop exactly the same activations, or two correct backends
could never agree. So the harness draws every keep-mask itself, from its own seeded RNG (independent of the batch
stream), and each backend applies the masks it is given at the places of docs/design.md, with inverted scaling:

    x * mask / (1 - p)

Keys (one mask per dropout site, the order of the forward pass):

- ``"emb"``: after the token + position embedding sum;
- ``"h.{i}.attn.probs"``: on block i's attention probabilities, after the softmax, before the product with v
  (nanoGPT's attn_dropout; only with ``config.attn_dropout``);
- ``"h.{i}.attn"``: after block i's attention output projection, before the residual add;
- ``"h.{i}.mlp"``: after block i's MLP output projection, before the residual add.

Each mask is a bool keep-mask in PyTorch layout: (batch_size, block_size, n_embd) (batch, time, channel) at the
three activation sites, (batch_size, n_head, block_size, block_size) (batch, head, query t, key s) at the attention
probabilities (`mask_shapes`). The Flux bridge relays them with their axes reversed: (n_embd, block_size, batch) and
(key, query, head, batch), NNlib's layout (`harness.backends.flux_layout.masks_to_flux`).

The three activation sites are drawn from one stream and the attention probabilities from another, so turning
`attn_dropout` on leaves the other masks of a (seed, step) bit for bit what they were (kits and fixtures stay valid).
"""

from __future__ import annotations

import hashlib

import numpy as np

from harness.config.fields import Config

# Mixed into the seed so the mask stream never coincides with the batch stream or the weights of the same seed.
MASK_STREAM = 0x6D61736B  # "mask"
# The attention probabilities' own stream, SeedSequence([ATTENTION_STREAM, seed, step]): another first word than the
# activation sites' SeedSequence([MASK_STREAM, seed, step]), so the two never share a state, whatever seed and step.
ATTENTION_STREAM = 0x6174746E  # "attn"


def attention_sites(config: Config) -> bool:
    """Whether the model has the attention-probability dropout sites: `attn_dropout` on and dropout > 0."""
    return bool(config.attn_dropout) and config.dropout > 0


def mask_keys(config: Config) -> list[str]:
    """The dropout sites of `config`'s model, in forward order: "emb", then per block "h.{i}.attn.probs" (with
    attention dropout), "h.{i}.attn", "h.{i}.mlp"."""
    probs = attention_sites(config)
    keys = ["emb"]
    for i in range(config.n_layer):
        keys += [f"h.{i}.attn.probs"] * probs + [f"h.{i}.attn", f"h.{i}.mlp"]
    return keys


def mask_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """{site: shape of its mask}, in forward order: (batch_size, block_size, n_embd) at the activation sites,
    (batch_size, n_head, block_size, block_size) at the attention probabilities."""
    B, T, C, H = config.batch_size, config.block_size, config.n_embd, config.n_head
    return {key: (B, H, T, T) if key.endswith(".probs") else (B, T, C) for key in mask_keys(config)}


def _keep(seed_words: list[int], n_sites: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """(n_sites, *shape) keep bits of one seeded stream, each True with probability 1 - p."""
    full = (n_sites, *shape)
    n = int(np.prod(full))
    bits = np.random.PCG64(np.random.SeedSequence(seed_words))
    # uniform 32-bit integers (two per raw 64-bit draw, half the cost of float uniforms): u >= p 2^32 keeps an
    # entry with probability 1 - p, exact to 2^-32
    u = bits.random_raw((n + 1) // 2).view(np.uint32)[:n]
    return (u >= np.uint32(min(round(p * 2.0**32), 2**32 - 1))).reshape(full)


def dropout_masks(config: Config, seed: int, step: int) -> dict[str, np.ndarray]:
    """Every keep-mask of training step `step` (0-based): {site: bool array of `mask_shapes`}, True = keep, in
    forward order.

    Each entry is kept with probability 1 - config.dropout. The masks depend only on (seed, step) and the shapes,
    never on a backend, its dtype or its device, so every backend of a parity run gets the same ones; drawing
    step k never needs steps 0..k-1 (a resumed run gets the same masks). One vectorised draw per stream and step
    (about 7 ms for medium's 655,360 activation entries on this project's CPU; see docs/parity.md).
    """
    p = float(config.dropout)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step!r}")
    seed, step = int(seed) & 0xFFFFFFFF, int(step)
    shapes = mask_shapes(config)
    sites = [k for k in shapes if not k.endswith(".probs")]
    keep = _keep([MASK_STREAM, seed, step], len(sites), (config.batch_size, config.block_size, config.n_embd), p)
    masks = {key: keep[i] for i, key in enumerate(sites)}
    probs = [k for k in shapes if k.endswith(".probs")]
    if probs:
        keep = _keep([ATTENTION_STREAM, seed, step], len(probs), shapes[probs[0]], p)
        masks.update({key: keep[i] for i, key in enumerate(probs)})
    return {key: masks[key] for key in shapes}


def fingerprint(masks: dict[str, np.ndarray]) -> str:
    """sha256 over the sites' names, shapes and bits: equal fingerprints mean the same masks."""
    h = hashlib.sha256()
    for key in sorted(masks):
        m = np.ascontiguousarray(masks[key], dtype=bool)
        h.update(key.encode())
        h.update(repr(m.shape).encode())
        h.update(np.packbits(m).tobytes())
    return h.hexdigest()
