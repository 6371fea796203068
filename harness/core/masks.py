"""Dropout masks drawn once by the harness and handed to every backend (docs/design.md, "Parity").

With `harness parity --dropout P` every backend must drop exactly the same activations, or two correct backends
could never agree. So the harness draws every keep-mask itself, from its own seeded RNG (independent of the batch
stream), and each backend applies the masks it is given at the three places of docs/design.md, with inverted scaling:

    x * mask / (1 - p)

Keys (one mask per dropout site, the order of the forward pass):

- ``"emb"``: after the token + position embedding sum;
- ``"h.{i}.attn"``: after block i's attention output projection, before the residual add;
- ``"h.{i}.mlp"``: after block i's MLP output projection, before the residual add.

Each mask is a bool keep-mask of shape (batch_size, block_size, n_embd), in PyTorch (batch, time, channel) layout;
the Flux bridge relays it to (n_embd, block_size, batch) (`harness.backends.flux_layout.masks_to_flux`).
"""

from __future__ import annotations

import hashlib

import numpy as np

from harness.config.fields import Config

# Mixed into the seed so the mask stream never coincides with the batch stream or the weights of the same seed.
MASK_STREAM = 0x6D61736B  # "mask"


def mask_keys(config: Config) -> list[str]:
    """The dropout sites of `config`'s model, in forward order: "emb", then "h.{i}.attn", "h.{i}.mlp" per block."""
    keys = ["emb"]
    for i in range(config.n_layer):
        keys += [f"h.{i}.attn", f"h.{i}.mlp"]
    return keys


def mask_shape(config: Config) -> tuple[int, int, int]:
    """(batch_size, block_size, n_embd): the shape of every mask."""
    return (config.batch_size, config.block_size, config.n_embd)


def dropout_masks(config: Config, seed: int, step: int) -> dict[str, np.ndarray]:
    """Every keep-mask of training step `step` (0-based): {site: bool array (B, T, C)}, True = keep.

    Each entry is kept with probability 1 - config.dropout. The masks depend only on (seed, step) and the shapes,
    never on a backend, its dtype or its device, so every backend of a parity run gets the same ones; drawing
    step k never needs steps 0..k-1 (a resumed run gets the same masks). One vectorised draw for all sites of a
    step (about 7 ms for medium's 655,360 entries on this project's CPU; see docs/parity.md).
    """
    p = float(config.dropout)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step!r}")
    keys = mask_keys(config)
    shape = (len(keys), *mask_shape(config))
    n = int(np.prod(shape))
    bits = np.random.PCG64(np.random.SeedSequence([MASK_STREAM, int(seed) & 0xFFFFFFFF, int(step)]))
    # uniform 32-bit integers (two per raw 64-bit draw, half the cost of float uniforms): u >= p 2^32 keeps an
    # entry with probability 1 - p, exact to 2^-32
    u = bits.random_raw((n + 1) // 2).view(np.uint32)[:n]
    keep = (u >= np.uint32(min(round(p * 2.0**32), 2**32 - 1))).reshape(shape)
    return {key: keep[i] for i, key in enumerate(keys)}


def fingerprint(masks: dict[str, np.ndarray]) -> str:
    """sha256 over the sites' names, shapes and bits: equal fingerprints mean the same masks."""
    h = hashlib.sha256()
    for key in sorted(masks):
        m = np.ascontiguousarray(masks[key], dtype=bool)
        h.update(key.encode())
        h.update(repr(m.shape).encode())
        h.update(np.packbits(m).tobytes())
    return h.hexdigest()
