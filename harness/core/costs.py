"""Cost formulas of the model, beside its shapes (harness/core/weights.py): what a token of training costs.

Kept apart from the worker and the report so that both (and sweeps) read one definition, as nanoGPT keeps
`estimate_mfu` with the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from harness.config.fields import Config
from harness.core.weights import count_parameters
from harness.store.curves import Eval, eval_array
from harness.store.record import TimeToTarget


def flops_per_token(config: Config, vocab_size: int) -> int:
    """Training FLOPs per token: 6 x non-embedding parameters + 12 x layers x d x n_ctx (attention), as Kaplan/PaLM.

    The 6 counts a multiply-add (2) in the forward pass and twice that in the backward pass; the attention term is
    the QK^T and AV products, which have no parameters. With tied embeddings the token table is also the output
    layer's matrix, so it counts (as nanoGPT's estimate_mfu: get_num_params() leaves out only wpe); without biases
    there are fewer parameters to count (harness.core.weights.param_shapes follows the options).
    """
    n = count_parameters(config, vocab_size, embeddings=False)
    return 6 * n + 12 * config.n_layer * config.n_embd * config.block_size


def time_to_target(target: float | None, evals: Sequence[Eval], steps: Sequence[int], times: Sequence[float]
                   ) -> TimeToTarget | None:
    """When the evaluated validation loss first reached `target` (the MLPerf training metric), or that it never did.

    `evals` are the record's evaluation points (the evaluation at step k sees the model after k updates),
    `steps`/`times` the per-step training times. `train_s` is the training time of the k updates (evaluation
    excluded); `train_eval_s` adds the time of the evaluations up to and including that one (an evaluation without
    its time counts none). None when no target is set. Array passes: a million evaluations take milliseconds.
    """
    if target is None:
        return None
    result = TimeToTarget(target_val_loss=float(target))
    rows = eval_array(evals)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    reached = np.flatnonzero(rows[:, 2] <= target)
    if reached.size:
        k, val = int(rows[reached[0], 0]), float(rows[reached[0], 2])
        n = min(len(steps), len(times))
        step_arr = np.asarray(steps[:n], dtype=np.int64)
        train_s = float(np.sum(np.asarray(times[:n], dtype=np.float64)[step_arr < k]))
        eval_s = float(np.nansum(rows[rows[:, 0] <= k, 3]))
        result.reached, result.step, result.val_loss = True, k, val
        result.train_s, result.train_eval_s = train_s, train_s + eval_s
    return result


def part_flops(config: Config, vocab_size: int) -> dict[str, dict[str, int]]:
    """Training FLOPs per token of every part of harness.core.parts, {part: {"forward": F, "backward": 2F}}, split
    so that they add up to `flops_per_token` exactly: each parameter counts 2 in the forward pass and 4 in the
    backward pass in the part that uses it (the non-embedding ones, as `flops_per_token` counts them: with tied
    embeddings the token table is the output layer's matrix and counts in `logits`), and the attention term's two
    products, 2 T d per token and layer each in the forward pass, count in `h.{i}.attn.probs` (q k^T) and
    `h.{i}.attn.y` (probs @ v). Elementwise parts (residual adds, GELU, softmax, the loss) count 0 in this model of
    the cost, as in Kaplan's and PaLM's."""
    from harness.core.parts import parts
    from harness.core.weights import param_shapes

    shapes = param_shapes(config, vocab_size)
    attention = 2 * config.block_size * config.n_embd  # one of the two products, per token and layer, forward
    out = {}
    for part in parts(config, vocab_size):
        # the embedding is a lookup: its tables count nothing there (a tied token table counts in `logits`)
        n = 0 if part.kind == "emb" else sum(math.prod(shapes[p]) for p in part.params)
        forward = 2 * n + (attention if part.kind in ("attn.probs", "attn.y") else 0)
        out[part.name] = {"forward": forward, "backward": 2 * forward}
    return out
