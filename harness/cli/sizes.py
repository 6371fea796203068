"""`harness sizes`: the presets side by side, or one preset's TOML file.
"""

from __future__ import annotations

import argparse
import sys

from harness.config.load import load_config
from harness.config.presets import PRESETS


# --- sizes -------------------------------------------------------------------------------------------------------
def cmd_sizes(args: argparse.Namespace) -> int:
    from harness.config.presets import preset_path

    if args.toml:
        sys.stdout.write(preset_path(args.toml).read_text(encoding="utf-8"))
        return 0
    import pandas as pd

    rows = {}
    yes = {True: "yes", False: "no"}
    for size in PRESETS:
        c = load_config(size)
        rows[size] = {"embedding d": c.n_embd, "block size n": c.block_size, "batch size": c.batch_size,
                      "layers": c.n_layer, "heads": c.n_head, "MLP hidden d_h": c.d_hidden, "dropout": c.dropout,
                      "attention dropout": yes[c.attn_dropout],
                      "tied embeddings": yes[c.tie_embeddings], "GELU": c.gelu, "biases": yes[c.bias],
                      "lm_head bias": yes[c.lm_head_bias], "learning rate": c.learning_rate,
                      "lr schedule": c.lr_schedule if c.lr_schedule == "constant" else f"cosine to {c.min_lr:g}",
                      "warm-up steps": c.warmup_steps, "decay steps": c.decay_steps or "-",
                      "training": f"{c.epochs} epochs" if c.steps is None else f"{c.steps} steps",
                      "batches": c.scheme, "beta2": c.beta2, "weight decay": c.weight_decay,
                      "decay convention": c.decay, "grad clip": c.grad_clip, "eval every": c.eval_interval}
    table = pd.DataFrame({size: {k: v if isinstance(v, str) else f"{v:g}" for k, v in row.items()}
                          for size, row in rows.items()})
    print(table.to_string())
    print("\n`harness sizes --toml NAME` prints a preset's file; nanoGPT's recipes: docs/nanogpt.md")
    return 0
