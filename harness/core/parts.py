"""The parts of a training step, named as the activation taps (harness/core/taps.py): what `harness bench parts`
times in every backend, forward and backward, on the same step-0 activations (docs/benchmarks.md, "Where the time
goes").

In forward order:

- ``emb``: wte[x] + wpe[t], then the embedding dropout;
- per block i: ``h.{i}.ln_1``; ``h.{i}.attn.qkv`` (c_attn, heads split: q, k, v); ``h.{i}.attn.probs`` (scores,
  causal mask, softmax); ``h.{i}.attn.y`` (the attention dropout where the model has it, then probs @ v, heads
  merged); ``h.{i}.attn.proj`` (c_proj, then the residual dropout); ``h.{i}.res1`` (the residual add x + attention);
  ``h.{i}.ln_2``; ``h.{i}.mlp.fc`` (c_fc); ``h.{i}.mlp.act`` (GELU); ``h.{i}.mlp.proj`` (c_proj, then the
  dropout); ``h.{i}.res2`` (the residual add);
- ``ln_f``, ``logits`` (lm_head), ``loss`` (mean cross-entropy);

then ``optimizer`` (global-norm clipping and AdamW on the step-0 gradients) and the whole training ``step``, timed
in the same rounds. A part's inputs and outputs are named as the taps hold them (``h.{i}.attn.q`` ...), plus
``idx`` (the token ids), ``targets`` and ``loss``. Each part's backward is the vector-Jacobian product with respect
to its inputs and its parameters.

Blocks are shown summed (``h.*.attn.probs``) with a per-block view available; `select` reads a user's filter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from harness.config.fields import Config
from harness.core.masks import attention_sites
from harness.core.weights import param_shapes
from harness.errors import UsageError

BLOCK_PARTS = ("ln_1", "attn.qkv", "attn.probs", "attn.y", "attn.proj", "res1", "ln_2", "mlp.fc", "mlp.act",
               "mlp.proj", "res2")
HEAD_PARTS = ("emb",)
TAIL_PARTS = ("ln_f", "logits", "loss")
KINDS = (*HEAD_PARTS, *BLOCK_PARTS, *TAIL_PARTS)
OPTIMIZER = "optimizer"  # clipping + AdamW
STEP = "step"  # the whole training step (the backend's own train_step)
REST = "fusion and framework overhead"  # the whole step minus the sum of the timed parts (positive or negative)
SUMMED = "h.*."  # the prefix of a block part summed over the blocks
_BLOCK = re.compile(r"^h\.(\d+|\*)\.(.+)$")

MEANING = {
    "emb": "wte[x] + wpe[t], then the embedding dropout",
    "ln_1": "LayerNorm before the attention",
    "attn.qkv": "c_attn (q, k, v in one Linear), heads split",
    "attn.probs": "scores q.k / sqrt(D), causal mask, softmax",
    "attn.y": "attention dropout (where on), probs @ v, heads merged",
    "attn.proj": "c_proj of the attention, then the residual dropout",
    "res1": "residual add x + attention",
    "ln_2": "LayerNorm before the MLP",
    "mlp.fc": "c_fc, before the activation",
    "mlp.act": "GELU",
    "mlp.proj": "c_proj of the MLP, then the dropout",
    "res2": "residual add x + MLP",
    "ln_f": "the final LayerNorm",
    "logits": "lm_head",
    "loss": "mean cross-entropy",
    OPTIMIZER: "global-norm clipping and AdamW",
    STEP: "the whole training step, as `harness run` times it",
    REST: "the whole step minus the sum of the parts: what the framework fuses away (negative) or adds (positive)",
}


@dataclass(frozen=True)
class Part:
    """One part of the forward pass: its inputs and outputs (tap names, `idx`, `targets`, `loss`), its parameters
    (canonical names, those the config has) and its dropout site (harness.core.masks' key; None: none)."""

    name: str
    kind: str
    block: int | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[str, ...]
    dropout: str | None = None


def _block(i: int, x_in: str, config: Config, have: dict) -> list[Part]:
    """The parts of block i, whose input is the activation `x_in`."""
    h = f"h.{i}."

    def params(*layers: str) -> tuple[str, ...]:
        return tuple(n for layer in layers for n in (h + layer + ".weight", h + layer + ".bias") if n in have)

    probs_site = h + "attn.probs" if attention_sites(config) else None
    drop = (lambda site: site) if config.dropout > 0 else (lambda site: None)
    return [
        Part(h + "ln_1", "ln_1", i, (x_in,), (h + "ln_1",), params("ln_1")),
        Part(h + "attn.qkv", "attn.qkv", i, (h + "ln_1",), (h + "attn.q", h + "attn.k", h + "attn.v"),
             params("attn.c_attn")),
        Part(h + "attn.probs", "attn.probs", i, (h + "attn.q", h + "attn.k"), (h + "attn.probs",), ()),
        Part(h + "attn.y", "attn.y", i, (h + "attn.probs", h + "attn.v"), (h + "attn.y",), (), probs_site),
        Part(h + "attn.proj", "attn.proj", i, (h + "attn.y",), (h + "attn.proj",), params("attn.c_proj"),
             drop(h + "attn")),
        Part(h + "res1", "res1", i, (x_in, h + "attn.proj"), (h + "res1",), ()),
        Part(h + "ln_2", "ln_2", i, (h + "res1",), (h + "ln_2",), params("ln_2")),
        Part(h + "mlp.fc", "mlp.fc", i, (h + "ln_2",), (h + "mlp.fc",), params("mlp.c_fc")),
        Part(h + "mlp.act", "mlp.act", i, (h + "mlp.fc",), (h + "mlp.act",), ()),
        Part(h + "mlp.proj", "mlp.proj", i, (h + "mlp.act",), (h + "mlp.proj",), params("mlp.c_proj"),
             drop(h + "mlp")),
        Part(h + "res2", "res2", i, (h + "res1", h + "mlp.proj"), (h + "res2",), ()),
    ]


def parts(config: Config, vocab_size: int) -> list[Part]:
    """Every part of `config`'s model, in forward order."""
    have = param_shapes(config, vocab_size)
    out = [Part("emb", "emb", None, ("idx",), ("emb",), ("wte.weight", "wpe.weight"),
                "emb" if config.dropout > 0 else None)]
    x = "emb"
    for i in range(config.n_layer):
        out += _block(i, x, config, have)
        x = f"h.{i}.res2"
    head = ("wte.weight" if config.tie_embeddings else "lm_head.weight",)
    out += [Part("ln_f", "ln_f", None, (x,), ("ln_f",), tuple(n for n in ("ln_f.weight", "ln_f.bias") if n in have)),
            Part("logits", "logits", None, ("ln_f",), ("logits",), head + (("lm_head.bias",) if "lm_head.bias" in have
                                                                              else ())),
            Part("loss", "loss", None, ("logits", "targets"), ("loss",), ())]
    return out


def part_names(n_layer: int) -> list[str]:
    """Every part's name for a model of `n_layer` blocks, in forward order."""
    return [*HEAD_PARTS, *(f"h.{i}.{k}" for i in range(n_layer) for k in BLOCK_PARTS), *TAIL_PARTS]


def kind(name: str) -> str:
    """A part's name without its block: "h.3.attn.probs" -> "attn.probs"."""
    m = _BLOCK.match(name)
    return m.group(2) if m else name


def summed(name: str) -> str:
    """The summed view's name of a part: "h.3.attn.probs" -> "h.*.attn.probs"; others unchanged."""
    m = _BLOCK.match(name)
    return SUMMED + m.group(2) if m else name


def item(part: str, direction: str) -> str:
    """The key of a timed item: "h.0.ln_1/forward"; the optimizer and the step are items of their own."""
    return f"{part}/{direction}"


def split_item(key: str) -> tuple[str, str | None]:
    """(part, direction) of an item key; direction None for the optimizer, the step and the rest."""
    part, sep, direction = key.partition("/")
    return (part, direction) if sep else (key, None)


def items(names: Iterable[str]) -> list[str]:
    """The timed items of parts `names` (forward order): every forward, then every backward in reverse order (the
    order a step runs them), then the optimizer and the step."""
    names = list(names)
    return [*(item(n, "forward") for n in names), *(item(n, "backward") for n in reversed(names)), OPTIMIZER, STEP]


def select(filters: list[str] | None, n_layer: int) -> list[str]:
    """The parts a `--parts` filter names, in forward order: a part's name ("h.0.ln_1", "logits"), a kind summed
    over the blocks ("attn.probs" or "h.*.attn.probs"), each of which must exist; None or empty: every part.
    UsageError (one line, the valid names) for a name that matches nothing."""
    every = part_names(n_layer)
    if not filters:
        return every
    chosen: set[str] = set()
    for text in filters:
        name = text.strip()
        if name in every:
            chosen.add(name)
            continue
        k = name[len(SUMMED):] if name.startswith(SUMMED) else name
        if k in BLOCK_PARTS:
            chosen.update(f"h.{i}.{k}" for i in range(n_layer))
            continue
        blocks = f"h.0 .. h.{n_layer - 1}" if n_layer > 1 else "h.0"
        raise UsageError(f"--parts: unknown part {name!r}; choose from {', '.join(KINDS)} (a block part for every "
                         f"block, or h.*.NAME), or one block's (h.I.NAME, I in {blocks})")
    return [n for n in every if n in chosen]
