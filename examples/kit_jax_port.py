#!/usr/bin/env python3
"""A nanoGPT port in JAX, checked from outside with the conformance kit: reads a kit, runs the model, writes results.

Written as a stranger to the harness would write it: it imports only numpy and jax (nothing from the harness) and
learns everything from the kit's manifest.json and NPZ files (docs/kit.md): the config and model options, the
parameter names (PyTorch layouts: a Linear weight is (out, in)), the per-step learning rates (batches.npz `lr`), the
decayed parameters (manifest `training.decayed_parameters`), the dropout masks (masks.npz) and the tap names.

    harness kit export --out kit/ --size small --steps 5
    python examples/kit_jax_port.py kit/ kit-results.npz --dtype float32
    harness kit check kit/ kit-results.npz

`--plant BUG` plants one known bug, to see the check name it (see PLANTS).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

PLANTS = {
    "attn-scale": "attention scores not scaled by 1/sqrt(head size)",
    "adam-t-late": "AdamW's bias corrections one step late (t - 1 instead of t from step 2 on)",
}


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def build(c: dict, plant: str | None) -> tuple:
    """The model, its gradients and its AdamW step, as pure functions over a dict of arrays."""
    import jax
    import jax.numpy as jnp

    p_drop, H = c["dropout"], c["n_head"]

    def linear(p, x, name):
        y = x @ p[name + ".weight"].T
        return y + p[name + ".bias"] if name + ".bias" in p else y  # bias = false: no bias

    def layer_norm(p, x, name):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        y = (x - mean) / jnp.sqrt(var + 1e-5) * p[name + ".weight"]
        return y + p[name + ".bias"] if name + ".bias" in p else y

    def drop(x, masks, key):
        return x if key not in masks else x * masks[key] / (1 - p_drop)  # inverted dropout with the kit's mask

    def forward(p, idx, masks, taps):
        B, T = idx.shape
        taps["emb"] = x = p["wte.weight"][idx] + p["wpe.weight"][:T]
        x = drop(x, masks, "emb")
        for i in range(c["n_layer"]):
            taps[f"h.{i}.ln_1"] = h = layer_norm(p, x, f"h.{i}.ln_1")
            q, k, v = (t.reshape(B, T, H, -1).transpose(0, 2, 1, 3)
                       for t in jnp.split(linear(p, h, f"h.{i}.attn.c_attn"), 3, axis=-1))
            scale = 1.0 if plant == "attn-scale" else 1.0 / math.sqrt(q.shape[-1])
            scores = jnp.where(jnp.triu(jnp.ones((T, T), bool), 1), -jnp.inf, (q @ k.swapaxes(-1, -2)) * scale)
            probs = jax.nn.softmax(scores, axis=-1)
            taps.update({f"h.{i}.attn.q": q, f"h.{i}.attn.k": k, f"h.{i}.attn.v": v, f"h.{i}.attn.probs": probs})
            y = (drop(probs, masks, f"h.{i}.attn.probs") @ v).transpose(0, 2, 1, 3).reshape(B, T, -1)
            taps[f"h.{i}.attn.y"] = y
            taps[f"h.{i}.attn.proj"] = a = linear(p, y, f"h.{i}.attn.c_proj")
            taps[f"h.{i}.res1"] = x = x + drop(a, masks, f"h.{i}.attn")
            taps[f"h.{i}.ln_2"] = h = layer_norm(p, x, f"h.{i}.ln_2")
            taps[f"h.{i}.mlp.fc"] = h = linear(p, h, f"h.{i}.mlp.c_fc")
            taps[f"h.{i}.mlp.act"] = h = jax.nn.gelu(h, approximate=c.get("gelu", "tanh") == "tanh")
            taps[f"h.{i}.mlp.proj"] = h = linear(p, h, f"h.{i}.mlp.c_proj")
            taps[f"h.{i}.res2"] = x = x + drop(h, masks, f"h.{i}.mlp")
        taps["ln_f"] = h = layer_norm(p, x, "ln_f")
        w = p["wte.weight"] if c.get("tie_embeddings") else p["lm_head.weight"]  # tied: jax.grad sums both uses
        logits = h @ w.T
        taps["logits"] = logits = logits + p["lm_head.bias"] if "lm_head.bias" in p else logits
        return logits

    def loss(p, x, y, masks):
        logprobs = jax.nn.log_softmax(forward(p, x, masks, {}), axis=-1)
        return -jnp.take_along_axis(logprobs, y[..., None], axis=-1).mean()

    def clip(g):
        if c["grad_clip"] <= 0:
            return g
        total = jnp.sqrt(sum(jnp.sum(t * t) for t in g.values()))
        coef = jnp.minimum(c["grad_clip"] / (total + 1e-6), 1.0)  # as torch.nn.utils.clip_grad_norm_
        return {n: t * coef for n, t in g.items()}

    def adamw(p, g, m, v, scalars, decayed):
        """PyTorch's AdamW; `scalars` = (1 - lr * weight_decay, lr / (1 - beta1^t), sqrt(1 - beta2^t)), computed in
        double precision on the host as torch computes them."""
        b1, b2, eps = c["beta1"], c["beta2"], c["eps"]
        shrink, step_size, bc2_sqrt = scalars
        out = ({}, {}, {})
        for n in p:
            w = p[n] * shrink if n in decayed else p[n]  # decoupled decay, on the decayed parameters only
            m_n, v_n = m[n] + (1 - b1) * (g[n] - m[n]), b2 * v[n] + (1 - b2) * g[n] * g[n]
            out[0][n], out[1][n], out[2][n] = w - step_size * (m_n / (jnp.sqrt(v_n) / bc2_sqrt + eps)), m_n, v_n
        return out

    def taps(p, x, masks):
        out = {}
        forward(p, x, masks, out)
        return out

    grad = jax.jit(jax.value_and_grad(loss))
    step = jax.jit(adamw, static_argnums=5)  # the decayed set is a Python value
    return jax.jit(lambda p, x: forward(p, x, {}, {})), jax.jit(taps), grad, clip, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kit", type=Path)
    ap.add_argument("out", type=Path, help="results .npz to write")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--plant", choices=sorted(PLANTS), help="plant one known bug")
    args = ap.parse_args()

    import jax

    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)  # before any array is made
    jax.config.update("jax_default_matmul_precision", "highest")  # full float32 matmuls on a GPU (no TF32)
    manifest = json.loads((args.kit / "manifest.json").read_text())
    c, steps = manifest["config"], manifest["steps"]
    batches = load_npz(args.kit / "batches.npz")
    all_masks = load_npz(args.kit / "masks.npz") if c["dropout"] > 0 else {}
    x, y, lr = batches["x"].astype(np.int32), batches["y"].astype(np.int32), batches["lr"]
    weights = load_npz(args.kit / "weights.npz")
    p = {n: jax.numpy.asarray(weights[n], dtype=args.dtype) for n in manifest["parameters"]}
    logits, taps, grad, clip, step = build(c, args.plant)

    def masks(k: int) -> dict:
        return {name: jax.numpy.asarray(m[k]) for name, m in all_masks.items()}

    rows = manifest["taps"]["rows"]
    out = {"logits": logits(p, x[0])}
    # the taps: dropout off except at the sites of taps.masks (the attention probabilities), with their step-0 masks
    tap_masks = {site: jax.numpy.asarray(all_masks[site][0][:rows]) for site in manifest["taps"].get("masks", [])}
    out.update({f"tap/{n}": v for n, v in taps(p, x[0][:rows], tap_masks).items() if n in manifest["taps"]["names"]})
    out.update({f"grad/{n}": g for n, g in grad(p, x[0], y[0], {})[1].items()})
    if all_masks:
        out.update({f"dropout_grad/{n}": g for n, g in grad(p, x[0], y[0], masks(0))[1].items()})
    decayed = frozenset(manifest["training"]["decayed_parameters"])
    m = {n: jax.numpy.zeros_like(w) for n, w in p.items()}
    v = dict(m)
    losses = []
    for k in range(steps):
        loss, g = grad(p, x[k], y[k], masks(k))
        losses.append(loss)
        t = max(k, 1) if args.plant == "adam-t-late" else k + 1
        rate = float(lr[k])
        scalars = (1 - rate * c["weight_decay"], rate / (1 - c["beta1"] ** t), (1 - c["beta2"] ** t) ** 0.5)
        p, m, v = step(p, clip(g), m, v, scalars, decayed)
        for name in p:
            out.update({f"opt/{k + 1}/param/{name}": p[name], f"opt/{k + 1}/adam_m/{name}": m[name],
                        f"opt/{k + 1}/adam_v/{name}": v[name]})
    out["loss"] = np.asarray(losses, dtype=args.dtype)
    np.savez(args.out, **{k: np.asarray(a) for k, a in out.items()})
    print(f"wrote {args.out}: {len(out)} arrays ({args.dtype}{', plant ' + args.plant if args.plant else ''})")


if __name__ == "__main__":
    main()
