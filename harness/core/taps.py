"""Activation taps: the named intermediate tensors of the forward pass that parity compares at depth 0.

Defined once here, for every backend (harness/models/numpy_gpt.py, harness/models/torch_gpt.py and
julia/NanoGPTFlux fill them by these names), the conformance kit (harness/kit) and the Flux layout
(harness/backends/flux_layout.py). docs/parity.md, "Depth 0: activation taps".

A tap is taken at step 0, with the initial weights, on the first `tap_rows(config)` rows of the first training batch
(every row is computed independently of the others, so a few rows show every defect of the forward pass and keep the
probe and the kit small), dropout off, except at the attention probabilities of a model with attention dropout: there
the step-0 masks apply (`tap_masks`), so that a defect of the attention dropout is located at ``attn.y``. The other
dropout sites stay off in the taps (their masks act between taps whose causes read each other as inputs; the
gradients under the masks check them). In forward order:

- ``emb``: token + position embedding, before dropout;
- per block i: ``h.{i}.ln_1``, ``h.{i}.attn.q``, ``h.{i}.attn.k``, ``h.{i}.attn.v`` (heads split),
  ``h.{i}.attn.probs`` (softmax of the masked, scaled scores, before dropout), ``h.{i}.attn.y`` (probs @ v, heads
  merged; with attention dropout the dropped probabilities, probs * mask / (1 - p), @ v),
  ``h.{i}.attn.proj`` (the output projection c_proj), ``h.{i}.res1`` (x + attention), ``h.{i}.ln_2``,
  ``h.{i}.mlp.fc`` (c_fc, before the activation), ``h.{i}.mlp.act`` (GELU), ``h.{i}.mlp.proj`` (c_proj),
  ``h.{i}.res2`` (the block's output);
- ``ln_f`` and ``logits``.

Canonical shapes (PyTorch order, row-major): (B, T, C) for the residual stream and everything of width n_embd,
(B, T, d_hidden) for ``mlp.fc`` and ``mlp.act``, (B, H, T, D) for q, k and v, (B, H, T, T) for ``attn.probs``
(query t, key s), (B, T, V) for the logits.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np

from harness.config.fields import Config
from harness.core.masks import attention_sites

PREFIX = "tap/"  # a tap's array name in a parity probe and in a kit: tap/<name>
MASK_PREFIX = "tap_mask/"  # a probe's record of a mask its taps were taken with: tap_mask/<site>, on the tap rows
TAP_ROWS = 4  # batch rows of the first batch the taps are taken on (fewer if the batch is smaller)
BLOCK_TAPS = ("ln_1", "attn.q", "attn.k", "attn.v", "attn.probs", "attn.y", "attn.proj", "res1",
              "ln_2", "mlp.fc", "mlp.act", "mlp.proj", "res2")
HEAD_TAPS = ("attn.q", "attn.k", "attn.v")  # (B, H, T, D)
_BLOCK = re.compile(r"^h\.(\d+)\.(.+)$")

MEANING = {
    "emb": "wte[x] + wpe[t], before dropout",
    "ln_1": "ln_1(x), the attention's input",
    "attn.q": "q = rows 0..C-1 of c_attn(ln_1), heads split (head h owns features h*D..(h+1)*D-1)",
    "attn.k": "k = rows C..2C-1 of c_attn(ln_1), heads split",
    "attn.v": "v = rows 2C..3C-1 of c_attn(ln_1), heads split",
    "attn.probs": "softmax over keys s of q.k / sqrt(D), keys s > t masked (probability exactly 0), before dropout",
    "attn.y": "probs @ v, heads merged back to (B, T, C); with attention dropout the dropped probabilities "
              "(probs * mask / (1 - p), the step-0 mask of h.i.attn.probs on the tap rows) @ v",
    "attn.proj": "c_proj(y), before dropout",
    "res1": "x + attn.proj",
    "ln_2": "ln_2(res1), the MLP's input",
    "mlp.fc": "c_fc(ln_2), before the activation",
    "mlp.act": "GELU of mlp.fc, in the form the config asks (tanh or exact)",
    "mlp.proj": "c_proj(act), before dropout",
    "res2": "res1 + mlp.proj, the block's output",
    "ln_f": "ln_f(x) of the last block's output",
    "logits": "lm_head(ln_f)",
}


def tap_names(n_layer: int) -> list[str]:
    """Every tap of a model with `n_layer` blocks, in forward order."""
    return ["emb", *(f"h.{i}.{t}" for i in range(n_layer) for t in BLOCK_TAPS), "ln_f", "logits"]


def tap_rows(config: Config) -> int:
    """How many rows of the first batch the taps are taken on."""
    return min(TAP_ROWS, config.batch_size)


def tap_mask_sites(config: Config) -> list[str]:
    """The dropout sites whose step-0 masks the taps are taken with: the attention probabilities
    ("h.{i}.attn.probs") of a model with attention dropout (`attn_dropout` and dropout > 0), none otherwise."""
    if not attention_sites(config):
        return []
    return [f"h.{i}.attn.probs" for i in range(config.n_layer)]


def tap_masks(config: Config, step0: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """The masks the taps are taken with: of the step-0 masks `step0` (harness.core.masks.dropout_masks; None:
    dropout 0), those of `tap_mask_sites`, cut to the tap rows. Empty when the taps are taken with dropout off."""
    if not step0:
        return {}
    rows = tap_rows(config)
    return {site: np.asarray(step0[site])[:rows] for site in tap_mask_sites(config) if site in step0}


def kind(name: str) -> str:
    """A tap's name without its block: "h.3.attn.probs" -> "attn.probs", "emb" -> "emb"."""
    m = _BLOCK.match(name)
    return m.group(2) if m else name


def block_of(name: str) -> int | None:
    """The block index of a block tap ("h.3.ln_1" -> 3), None for emb, ln_f and logits."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def forward_index(name: str) -> tuple[int, ...]:
    """A sort key putting any set of tap names in forward order."""
    m = _BLOCK.match(name)
    if m:
        return (1, int(m.group(1)), BLOCK_TAPS.index(m.group(2)) if m.group(2) in BLOCK_TAPS else len(BLOCK_TAPS))
    return {"emb": (0,), "ln_f": (2,), "logits": (3,)}.get(name, (4,))


def in_forward_order(names: Iterable[str]) -> list[str]:
    """`names` sorted in forward order."""
    return sorted(names, key=forward_index)


def tap_axes(name: str) -> list[str]:
    """The canonical axes of a tap."""
    k = kind(name)
    if k in HEAD_TAPS:
        return ["batch", "head", "time", "head_dim"]
    if k == "attn.probs":
        return ["batch", "head", "query", "key"]
    if k in ("mlp.fc", "mlp.act"):
        return ["batch", "time", "hidden"]
    if k == "logits":
        return ["batch", "time", "vocab"]
    return ["batch", "time", "embd"]


def tap_shapes(config: Config, vocab_size: int, rows: int | None = None) -> dict[str, tuple[int, ...]]:
    """Every tap's canonical shape, in forward order, for `rows` batch rows (default `tap_rows(config)`)."""
    B = tap_rows(config) if rows is None else rows
    T, C, H = config.block_size, config.n_embd, config.n_head
    size = {"batch": B, "time": T, "embd": C, "hidden": config.d_hidden, "vocab": vocab_size, "head": H,
            "head_dim": C // H, "query": T, "key": T}
    return {name: tuple(size[a] for a in tap_axes(name)) for name in tap_names(config.n_layer)}
