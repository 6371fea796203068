"""nanoGPT in plain JAX: pure functions over a parameter dict, after karpathy/nanoGPT's model.py.

The parameters are a dict keyed by the harness's canonical names (harness/core/weights.py) in PyTorch's layouts (a
Linear weight is (out, in), so a Linear computes y = x @ W.T + b): canonical weights go in and gradients come out
under the same names, without any mapping. The model options are the config's, as in the other backends: `bias`,
`lm_head_bias`, `tie_embeddings` (lm_head is wte.weight; jax.grad sums the gradients of both uses, as autograd does),
`gelu` ("tanh" or "exact"), `decay` (which parameters AdamW decays).

Dropout is a dict of keep-masks by site, True = keep, applied as x * keep / (1 - p): "emb" (B, T, C) after the
embedding sum, "h.{i}.attn" and "h.{i}.mlp" (B, T, C) after block i's output projections, and, with
`config.attn_dropout`, "h.{i}.attn.probs" (B, H, T, T) on the attention probabilities (att = softmax(scores);
att = att * keep / (1 - p); y = att @ v). In parity the harness draws the masks (harness/core/masks.py); otherwise
`draw_masks` draws them, at the harness's sites, from JAX's PRNG. A site without a mask: no dropout there.

`forward(..., taps=dict)` fills the dict with the activation taps of harness/core/taps.py (parity's depth 0).
AdamW is written out with torch.optim.AdamW's semantics (`adamw`); its scalars come from the caller, computed in
double precision as torch computes them (`adamw_scalars`).

Shapes: B batch, T time, C = n_embd, H heads, D = C / H head size, V vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from harness.config.fields import Config
from harness.core.weights import decays

Params = dict[str, jax.Array]
Masks = dict[str, jax.Array]

LN_EPS = 1e-5  # added to the biased variance, as torch.nn.LayerNorm
GELU_C = math.sqrt(2.0 / math.pi)  # constant of GELU's tanh form
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ divides by (total norm + 1e-6)


# --------------------------------------------------------------------------------------------------- layers


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """y = x @ W.T + b with W of shape (out, in); `b` None: no bias."""
    y = x @ w.T
    return y if b is None else y + b


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array | None = None, eps: float = LN_EPS) -> jax.Array:
    """Normalise each feature vector to mean 0 and variance 1 (biased, + eps, as torch), then scale and shift."""
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)  # divide by C, not C - 1
    y = xc * (1.0 / jnp.sqrt(var + eps)) * w
    return y if b is None else y + b


def gelu(x: jax.Array, form: str) -> jax.Array:
    """GELU: "tanh" 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), or "exact" x Phi(x) (nanoGPT's nn.GELU())."""
    if form == "exact":
        return 0.5 * x * (1.0 + jax.scipy.special.erf(x / math.sqrt(2.0)))
    return 0.5 * x * (1.0 + jnp.tanh(GELU_C * (x + 0.044715 * x * x * x)))


def dropout(x: jax.Array, keep: jax.Array | None, p: float) -> jax.Array:
    """Inverted dropout with a keep-mask: kept entries scaled by 1/(1-p), so E[out] = x. No mask: the identity."""
    return x if keep is None else x * keep / (1.0 - p)


def split_heads(x: jax.Array, n_head: int) -> jax.Array:
    """(B, T, C) -> (B, H, T, D): head h owns the contiguous features h*D .. (h+1)*D - 1."""
    B, T, C = x.shape
    return x.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def merge_heads(y: jax.Array) -> jax.Array:
    """(B, H, T, D) -> (B, T, C), the inverse of split_heads."""
    B, H, T, D = y.shape
    return y.transpose(0, 2, 1, 3).reshape(B, T, H * D)


def causal_attention(q: jax.Array, k: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(D)) over the keys s <= t of each query t: the attention probabilities (B, H, T, T)."""
    T, D = q.shape[-2], q.shape[-1]
    scores = (q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(D))  # keeps the scores' variance near 1, whatever D
    future = jnp.triu(jnp.ones((T, T), dtype=bool), k=1)  # s > t: a position may not look ahead
    return jax.nn.softmax(jnp.where(future, -jnp.inf, scores), axis=-1)  # exp(-inf) = 0: exactly 0 there


def embed(p: Params, idx: jax.Array) -> jax.Array:
    """wte[idx] + wpe[t]: what the token is, plus where it is; idx (B, T) -> (B, T, C)."""
    return p["wte.weight"][idx] + p["wpe.weight"][:idx.shape[1]]


def qkv_heads(x: jax.Array, w: jax.Array, b: jax.Array | None, n_head: int) -> tuple[jax.Array, ...]:
    """q, k, v of the fused qkv Linear (rows [q; k; v]), heads split: (B, T, C) -> 3 x (B, H, T, D)."""
    return tuple(split_heads(t, n_head) for t in jnp.split(linear(x, w, b), 3, axis=-1))


def attend(probs: jax.Array, v: jax.Array, keep: jax.Array | None, p: float) -> jax.Array:
    """The probabilities dropped (`keep`: nanoGPT's attn_dropout; None: none), @ v, heads merged: (B, T, C)."""
    return merge_heads(dropout(probs, keep, p) @ v)


# --------------------------------------------------------------------------------------------------- model


def attention(x: jax.Array, p: Params, prefix: str, config: Config, masks: Masks,
              taps: dict[str, jax.Array] | None) -> jax.Array:
    """Causal multi-head self-attention of block `prefix`: one fused qkv Linear (rows [q; k; v]), heads, c_proj."""
    q, k, v = qkv_heads(x, p[prefix + "attn.c_attn.weight"], p.get(prefix + "attn.c_attn.bias"), config.n_head)
    probs = causal_attention(q, k)
    y = attend(probs, v, masks.get(prefix + "attn.probs"), config.dropout)  # nanoGPT's attn_dropout: a mask here
    out = linear(y, p[prefix + "attn.c_proj.weight"], p.get(prefix + "attn.c_proj.bias"))
    if taps is not None:  # attn.probs before the probabilities' dropout, attn.y after it
        taps.update({prefix + "attn.q": q, prefix + "attn.k": k, prefix + "attn.v": v, prefix + "attn.probs": probs,
                     prefix + "attn.y": y, prefix + "attn.proj": out})
    return dropout(out, masks.get(prefix + "attn"), config.dropout)  # after c_proj, before the residual add


def mlp(x: jax.Array, p: Params, prefix: str, config: Config, masks: Masks,
        taps: dict[str, jax.Array] | None) -> jax.Array:
    """Linear(C, d_hidden) -> GELU (the config's form) -> Linear(d_hidden, C) -> dropout."""
    h = linear(x, p[prefix + "mlp.c_fc.weight"], p.get(prefix + "mlp.c_fc.bias"))
    a = gelu(h, config.gelu)
    out = linear(a, p[prefix + "mlp.c_proj.weight"], p.get(prefix + "mlp.c_proj.bias"))
    if taps is not None:
        taps.update({prefix + "mlp.fc": h, prefix + "mlp.act": a, prefix + "mlp.proj": out})
    return dropout(out, masks.get(prefix + "mlp"), config.dropout)


def block(x: jax.Array, p: Params, i: int, config: Config, masks: Masks,
          taps: dict[str, jax.Array] | None) -> jax.Array:
    """Pre-LayerNorm residual block i: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""
    prefix = f"h.{i}."
    h = layer_norm(x, p[prefix + "ln_1.weight"], p.get(prefix + "ln_1.bias"))
    x = x + attention(h, p, prefix, config, masks, taps)
    if taps is not None:
        taps.update({prefix + "ln_1": h, prefix + "res1": x})
    h = layer_norm(x, p[prefix + "ln_2.weight"], p.get(prefix + "ln_2.bias"))
    x = x + mlp(h, p, prefix, config, masks, taps)
    if taps is not None:
        taps.update({prefix + "ln_2": h, prefix + "res2": x})
    return x


def forward(p: Params, idx: jax.Array, config: Config, masks: Masks | None = None,
            taps: dict[str, jax.Array] | None = None) -> jax.Array:
    """Logits (B, T, V) of token ids idx (B, T). `masks`: dropout keep-masks by site (None: no dropout); `taps`:
    filled with the named activations of harness/core/taps.py."""
    masks = masks or {}
    x = embed(p, idx)
    if taps is not None:
        taps["emb"] = x
    x = dropout(x, masks.get("emb"), config.dropout)
    for i in range(config.n_layer):
        x = block(x, p, i, config, masks, taps)
    h = layer_norm(x, p["ln_f.weight"], p.get("ln_f.bias"))
    # tied embeddings: the output layer is the token table itself, and jax.grad adds up both uses' gradients
    w_head = p["wte.weight"] if config.tie_embeddings else p["lm_head.weight"]
    logits = linear(h, w_head, p.get("lm_head.bias"))
    if taps is not None:
        taps.update({"ln_f": h, "logits": logits})
    return logits


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean over all B*T positions of -log softmax(logits)[target]."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logprobs, targets[..., None], axis=-1).mean()


def loss(p: Params, idx: jax.Array, targets: jax.Array, config: Config, masks: Masks | None = None) -> jax.Array:
    """Mean cross-entropy of the logits of `idx` against `targets`."""
    return cross_entropy(forward(p, idx, config, masks), targets)


def draw_masks(key: jax.Array, sites: dict[str, tuple[int, ...]], p: float) -> Masks:
    """JAX's own dropout: a keep-mask for each site of `sites` ({name: shape}, the harness's
    harness.core.masks.mask_shapes), each entry kept with probability 1 - p; none when p is 0."""
    if p <= 0:
        return {}
    keys = jax.random.split(key, len(sites))
    return {name: jax.random.bernoulli(k, 1.0 - p, shape) for k, (name, shape) in zip(keys, sites.items())}


# --------------------------------------------------------------------------------------------------- optimizer


def clip_by_global_norm(grads: Params, max_norm: float) -> Params:
    """As torch.nn.utils.clip_grad_norm_: total = sqrt(sum of squared per-tensor norms), every gradient times
    min(max_norm / (total + 1e-6), 1). (optax.clip_by_global_norm divides by the norm itself, without the 1e-6.)"""
    norms = jnp.stack([jnp.sqrt(jnp.sum(g * g)) for g in grads.values()])
    total = jnp.sqrt(jnp.sum(norms * norms))
    coef = jnp.minimum(max_norm / (total + CLIP_EPS), 1.0)
    return {name: g * coef for name, g in grads.items()}


def adamw_scalars(lr: float, t: int, config: Config) -> tuple[float, float, float]:
    """(1 - lr * weight_decay, lr / (1 - beta1^t), sqrt(1 - beta2^t)) of step t (from 1), in double precision on the
    host, as torch.optim.AdamW computes them; the step rounds them once to the parameters' dtype."""
    return (1.0 - lr * config.weight_decay, lr / (1.0 - config.beta1 ** t), (1.0 - config.beta2 ** t) ** 0.5)


def adamw(p: Params, g: Params, m: Params, v: Params, scalars: jax.Array, config: Config
          ) -> tuple[Params, Params, Params]:
    """One AdamW step with torch.optim.AdamW's semantics and order (single-tensor path): per parameter

        p *= 1 - lr * weight_decay                    only where harness.core.weights.decays (config.decay)
        m  = m + (1 - beta1) (g - m)                  torch's lerp
        v  = beta2 v + (1 - beta2) g^2
        p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)     eps outside the square root

    `scalars` = adamw_scalars(lr, t) as an array of the parameters' dtype. Returns the new (p, m, v)."""
    decay_factor, step_size, bc2_sqrt = scalars[0], scalars[1], scalars[2]
    b1, b2 = config.beta1, config.beta2
    new_p, new_m, new_v = {}, {}, {}
    for name, w in p.items():
        if config.weight_decay != 0 and decays(name, w.shape, config.decay):
            w = w * decay_factor  # decoupled: shrink the weight itself, not through the gradient
        new_m[name] = m[name] + (1 - b1) * (g[name] - m[name])
        new_v[name] = b2 * v[name] + (1 - b2) * g[name] * g[name]
        new_p[name] = w - step_size * (new_m[name] / (jnp.sqrt(new_v[name]) / bc2_sqrt + config.eps))
    return new_p, new_m, new_v


def train_step(state: tuple[Params, Params, Params], idx: jax.Array, targets: jax.Array, scalars: jax.Array,
               dropout_masks: Masks | None, config: Config) -> tuple[tuple[Params, Params, Params], jax.Array]:
    """Forward, backward (jax.value_and_grad), global-norm clipping (grad_clip > 0) and AdamW: one training step of
    `state` = (parameters, m, v); returns the new state and the loss. The caller jits it (harness/backends)."""
    p, m, v = state
    value, grads = jax.value_and_grad(loss)(p, idx, targets, config, dropout_masks)
    if config.grad_clip > 0:
        grads = clip_by_global_norm(grads, config.grad_clip)
    return adamw(p, grads, m, v, scalars, config), value


def zeros_like(p: Params) -> Params:
    """AdamW's initial moments: zeros of every parameter's shape and dtype."""
    return {name: jnp.zeros_like(w) for name, w in p.items()}


def tree_to(tree: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """Every array of a flat dict cast to `dtype`."""
    return {name: jnp.asarray(a, dtype=dtype) for name, a in tree.items()}
