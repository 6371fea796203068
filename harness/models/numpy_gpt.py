"""A framework-free nanoGPT: forward pass, hand-written backward pass and AdamW, in NumPy (or CuPy).

This is the harness's oracle: it belongs to no deep-learning framework, so when PyTorch and Flux.jl disagree
it says which one follows the math. Every layer is one pair of functions:

    out, cache = <layer>_forward(inputs..., parameters...)
    grads...   = <layer>_backward(dout, cache)

where `dout` is the gradient of the loss with respect to `out` and the backward returns the gradients with
respect to the forward's inputs and parameters, in that order.

Shapes: B batch, T time (sequence position), C = n_embd, H heads, D = C / H head size, F = d_hidden,
V vocabulary. Parameters live in a dict keyed by the canonical names of harness.core.weights, in the canonical
(PyTorch) shapes: a Linear weight is (out, in), so a Linear computes y = x @ W.T + b.

The array module `xp` is NumPy, or CuPy after `use_device("cuda")`. Dropout masks are always drawn on the host
by a NumPy Generator (as float64 uniforms), so a seed gives the same masks on every device and in every dtype.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from harness.config.fields import Config
from harness.core.weights import decays

Array = Any  # an ndarray of the current array module `xp` (numpy.ndarray or cupy.ndarray)
Cache = Any  # whatever a forward keeps for its backward

xp: Any = np  # the array module; chosen by use_device()

LN_EPS = 1e-5  # added to the biased variance, as torch.nn.LayerNorm
GELU_C = math.sqrt(2.0 / math.pi)  # constant of the tanh approximation of GELU


# --------------------------------------------------------------------------------------------------- device


class DeviceUnavailable(RuntimeError):
    """The requested device cannot run here (the backend turns this into its own error for the user)."""


def use_device(device: str) -> Any:
    """Select the array module for `device` ("cpu": NumPy, "cuda": CuPy) and return it.

    Raises DeviceUnavailable for "cuda" without a working CuPy, and for any other device.
    """
    global xp
    if device == "cpu":
        xp = np
        return xp
    if device == "cuda":
        try:
            import cupy
        except ImportError:
            raise DeviceUnavailable("--device cuda needs CuPy, which is not installed") from None
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no CUDA device")
        except Exception as exc:  # CuPy installed, but no driver or no GPU
            raise DeviceUnavailable(f"--device cuda: CuPy found no usable GPU ({exc})") from None
        xp = cupy
        return xp
    raise DeviceUnavailable(f"unknown device {device!r}")


def _erf(x: Array) -> Array:
    """The error function, elementwise, of the current array module (SciPy's, or CuPy's)."""
    if xp is np:
        from scipy.special import erf
    else:
        from cupyx.scipy.special import erf
    return erf(x)


def to_numpy(a: Array) -> np.ndarray:
    """A NumPy copy of an array of the current module (copies device arrays to the host)."""
    if xp is np:
        return np.array(a, copy=True)
    return xp.asnumpy(a)


def _scatter_add(target: Array, index: Array, values: Array) -> None:
    """target[index[i]] += values[i], accumulating repeated indices (plain fancy-index += would not)."""
    if xp is np:
        np.add.at(target, index, values)
    else:
        import cupyx
        cupyx.scatter_add(target, index, values)


# --------------------------------------------------------------------------------------------------- layers


def embedding_forward(idx: Array, wte: Array, wpe: Array) -> tuple[Array, Cache]:
    """x[b, t] = wte[idx[b, t]] + wpe[t]: what the token is plus where it is. idx (B, T) -> (B, T, C)."""
    T = idx.shape[1]
    out = wte[idx] + wpe[:T]
    return out, (idx, wte.shape, wpe.shape)


def embedding_backward(dout: Array, cache: Cache) -> tuple[Array, Array]:
    """Gradients (dwte, dwpe). A token used at several positions collects the gradient of each use."""
    idx, wte_shape, wpe_shape = cache
    C = dout.shape[-1]
    dwte = xp.zeros(wte_shape, dtype=dout.dtype)
    _scatter_add(dwte, idx.reshape(-1), dout.reshape(-1, C))
    dwpe = xp.zeros(wpe_shape, dtype=dout.dtype)
    dwpe[: idx.shape[1]] = dout.sum(axis=0)  # positions beyond T were not used: zero gradient
    return dwte, dwpe


def linear_forward(x: Array, w: Array, b: Array | None) -> tuple[Array, Cache]:
    """y = x @ W.T + b with W of shape (out, in); x (..., in) -> (..., out). `b` None: no bias."""
    # one (N, in) @ (in, out) product over all leading axes: a single large BLAS call, not one per batch row
    y = x.reshape(-1, x.shape[-1]) @ w.T
    if b is not None:
        y = y + b
    return y.reshape(*x.shape[:-1], w.shape[0]), (x, w, b is not None)


def linear_backward(dout: Array, cache: Cache) -> tuple[Array, Array, Array | None]:
    """Gradients (dx, dW, db); the leading axes of x are all "batch" and are summed over for dW and db (None
    without a bias)."""
    x, w, has_bias = cache
    dout2 = dout.reshape(-1, dout.shape[-1])
    dx = (dout2 @ w).reshape(x.shape)
    dw = dout2.T @ x.reshape(-1, x.shape[-1])
    db = dout2.sum(axis=0) if has_bias else None
    return dx, dw, db


def layernorm_forward(x: Array, gamma: Array, beta: Array | None, eps: float = LN_EPS) -> tuple[Array, Cache]:
    """Normalise each feature vector to mean 0, variance 1 (biased variance + eps, as torch), then scale, shift
    (`beta` None: no shift)."""
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)  # biased: divide by C, not C - 1
    rstd = 1.0 / xp.sqrt(var + eps)
    xhat = xc * rstd
    out = xhat * gamma if beta is None else xhat * gamma + beta
    return out, (xhat, rstd, gamma, beta is not None)


def layernorm_backward(dout: Array, cache: Cache) -> tuple[Array, Array, Array | None]:
    """Gradients (dx, dgamma, dbeta); dbeta None without a shift."""
    xhat, rstd, gamma, has_beta = cache
    C = dout.shape[-1]
    dgamma = (dout * xhat).reshape(-1, C).sum(axis=0)
    dbeta = dout.reshape(-1, C).sum(axis=0) if has_beta else None
    dxhat = dout * gamma
    # xhat also moves with x through the mean and the variance; removing the components of dxhat along
    # those two directions (the constant vector and xhat itself) gives the gradient with respect to x.
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, dgamma, dbeta


def gelu_forward(x: Array) -> tuple[Array, Cache]:
    """GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    t = xp.tanh(GELU_C * (x + 0.044715 * x * x * x))
    return 0.5 * x * (1.0 + t), (x, t)


def gelu_backward(dout: Array, cache: Cache) -> Array:
    """Gradient dx, by the product rule; d tanh(u)/du = 1 - tanh(u)^2."""
    x, t = cache
    du_dx = GELU_C * (1.0 + 3 * 0.044715 * x * x)
    return dout * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du_dx)


def gelu_erf_forward(x: Array) -> tuple[Array, Cache]:
    """GELU, exact form: x Phi(x) = 0.5 x (1 + erf(x / sqrt(2))), Phi the standard normal CDF (torch's nn.GELU())."""
    cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))
    return x * cdf, (x, cdf)


def gelu_erf_backward(dout: Array, cache: Cache) -> Array:
    """Gradient dx = dout (Phi(x) + x phi(x)), phi(x) = exp(-x^2 / 2) / sqrt(2 pi) the normal density."""
    x, cdf = cache
    return dout * (cdf + x * xp.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi))


def gelu_pair(form: str) -> tuple[Any, Any]:
    """(forward, backward) of config.gelu's form, "tanh" or "exact"; looked up at each call, so that a test that
    replaces this module's gelu_forward (a planted bug) reaches every model built from it."""
    return (gelu_forward, gelu_backward) if form == "tanh" else (gelu_erf_forward, gelu_erf_backward)


def dropout_forward(x: Array, p: float, rng: np.random.Generator | None,
                    keep: np.ndarray | None = None) -> tuple[Array, Cache]:
    """Inverted dropout: zero each entry with probability p and scale the rest by 1/(1-p), so E[out] = x.

    `keep` (a bool keep-mask of x's shape, drawn by the harness in parity mode) is applied as given, whatever
    `rng`; otherwise, with `rng` None (evaluation) or p == 0 it is the identity and draws nothing.
    """
    if keep is None:
        if rng is None or p == 0:
            return x, None
        keep = rng.random(x.shape) >= p  # float64 uniforms on the host: same masks for every dtype and device
    elif keep.shape != x.shape:
        raise ValueError(f"dropout mask of shape {keep.shape} for activations of shape {x.shape}")
    mask = xp.asarray(keep, dtype=x.dtype) * (1.0 / (1.0 - p))
    return x * mask, mask


def dropout_backward(dout: Array, cache: Cache) -> Array:
    """Gradient dx: only the kept entries pass, scaled like the forward."""
    return dout if cache is None else dout * cache


def softmax_forward(scores: Array) -> tuple[Array, Cache]:
    """Softmax over the last axis; the row maximum is subtracted first so exp cannot overflow."""
    e = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    return probs, probs


def softmax_backward(dprobs: Array, cache: Cache) -> Array:
    """Gradient dscores = P * (dP - sum_j dP_j P_j), the softmax Jacobian applied row by row."""
    probs = cache
    return probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))


def attention_probs_forward(q: Array, k: Array) -> tuple[Array, Cache]:
    """softmax(q k^T / sqrt(D)) over the keys, future keys masked: the attention probabilities (B, H, T, T), query t
    against key s, of q, k (B, H, T, D)."""
    T, D = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(D)  # keeps the scores' variance near 1, whatever the head size
    scores = (q @ k.swapaxes(-1, -2)) * scale  # (B, H, T, T): query t against key s
    future = xp.triu(xp.ones((T, T), dtype=bool), k=1)  # s > t: a position may not look ahead
    scores = xp.where(future, -xp.inf, scores)  # exp(-inf) = 0: masked keys get probability exactly 0
    probs, softmax_cache = softmax_forward(scores)
    return probs, (q, k, softmax_cache, scale)


def attention_probs_backward(dprobs: Array, cache: Cache) -> tuple[Array, Array]:
    """Gradients (dq, dk). Masked entries have probability 0, so the softmax gives them no gradient."""
    q, k, softmax_cache, scale = cache
    dscores = softmax_backward(dprobs, softmax_cache) * scale
    return dscores @ k, dscores.swapaxes(-1, -2) @ q


def attention_values_forward(probs: Array, v: Array, p: float = 0.0, rng: np.random.Generator | None = None,
                             keep: np.ndarray | None = None) -> tuple[Array, Cache]:
    """The probabilities dropped (nanoGPT's attn_dropout: `dropout_forward` with `p`, `rng`, `keep`; the identity
    with p = 0, or without both `rng` and `keep`), then @ v: (B, H, T, T), (B, H, T, D) -> (B, H, T, D)."""
    dropped, drop_cache = dropout_forward(probs, p, rng, keep)
    return dropped @ v, (v, dropped, drop_cache)


def attention_values_backward(dout: Array, cache: Cache) -> tuple[Array, Array]:
    """Gradients (dprobs, dv); dropped probabilities pass no gradient back through the dropout."""
    v, dropped, drop_cache = cache
    ddropped = dout @ v.swapaxes(-1, -2)
    dv = dropped.swapaxes(-1, -2) @ dout
    return dropout_backward(ddropped, drop_cache), dv  # the kept entries, scaled by 1/(1-p) as in the forward


def causal_attention_forward(q: Array, k: Array, v: Array, p: float = 0.0, rng: np.random.Generator | None = None,
                             keep: np.ndarray | None = None) -> tuple[Array, Cache]:
    """softmax(q k^T / sqrt(D), future masked), dropped, then @ v, for each head; q, k, v (B, H, T, D) -> (B, H, T, D):
    `attention_probs_forward`, then `attention_values_forward` with `p`, `rng`, `keep`. The cache's fourth entry is
    the probabilities before the dropout."""
    probs, (_, _, softmax_cache, scale) = attention_probs_forward(q, k)
    y, (_, dropped, drop_cache) = attention_values_forward(probs, v, p, rng, keep)
    return y, (q, k, v, probs, softmax_cache, dropped, drop_cache, scale)


def causal_attention_backward(dout: Array, cache: Cache) -> tuple[Array, Array, Array]:
    """Gradients (dq, dk, dv): `attention_values_backward`, then `attention_probs_backward`."""
    q, k, v, _, softmax_cache, dropped, drop_cache, scale = cache
    dprobs, dv = attention_values_backward(dout, (v, dropped, drop_cache))
    dq, dk = attention_probs_backward(dprobs, (q, k, softmax_cache, scale))
    return dq, dk, dv


def split_heads(x: Array, n_head: int) -> Array:
    """(B, T, C) -> (B, H, T, D): head h owns the contiguous features h*D .. (h+1)*D - 1."""
    B, T, C = x.shape
    return x.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def merge_heads(y: Array) -> Array:
    """(B, H, T, D) -> (B, T, C), the inverse of split_heads."""
    B, H, T, D = y.shape
    return y.transpose(0, 2, 1, 3).reshape(B, T, H * D)


def qkv_forward(x: Array, w_attn: Array, b_attn: Array | None, n_head: int) -> tuple[tuple[Array, Array, Array], Cache]:
    """The fused qkv Linear (q, k, v in that order along the features), heads split: x (B, T, C) -> q, k, v
    (B, H, T, D)."""
    qkv, cache = linear_forward(x, w_attn, b_attn)  # (B, T, 3C)
    q, k, v = (split_heads(t, n_head) for t in xp.split(qkv, 3, axis=-1))
    return (q, k, v), cache


def qkv_backward(dq: Array, dk: Array, dv: Array, cache: Cache) -> tuple[Array, Array, Array | None]:
    """Gradients (dx, dw_attn, db_attn) from the heads' gradients."""
    dqkv = xp.concatenate([merge_heads(dq), merge_heads(dk), merge_heads(dv)], axis=-1)
    return linear_backward(dqkv, cache)


def attention_forward(x: Array, w_attn: Array, b_attn: Array, w_proj: Array, b_proj: Array,
                      n_head: int, taps: dict[str, Array] | None = None, p: float = 0.0,
                      rng: np.random.Generator | None = None, keep: np.ndarray | None = None) -> tuple[Array, Cache]:
    """Causal multi-head self-attention: one fused qkv Linear (q, k, v in that order), heads, output Linear; `p`,
    `rng`, `keep`: the dropout on the attention probabilities (causal_attention_forward).

    `taps` (parity's depth 0, harness/core/taps.py): filled with "attn.q", "attn.k", "attn.v", "attn.probs" (before
    dropout), "attn.y" (the dropped probabilities @ v, heads merged) and "attn.proj"."""
    (q, k, v), attn_cache = qkv_forward(x, w_attn, b_attn, n_head)
    y, core_cache = causal_attention_forward(q, k, v, p, rng, keep)
    merged = merge_heads(y)
    out, proj_cache = linear_forward(merged, w_proj, b_proj)
    if taps is not None:
        taps.update({"attn.q": q, "attn.k": k, "attn.v": v, "attn.probs": core_cache[3], "attn.y": merged,
                     "attn.proj": out})
    return out, (attn_cache, core_cache, proj_cache, n_head)


def attention_backward(dout: Array, cache: Cache) -> tuple[Array, Array, Array, Array, Array]:
    """Gradients (dx, dw_attn, db_attn, dw_proj, db_proj)."""
    attn_cache, core_cache, proj_cache, n_head = cache
    dy, dw_proj, db_proj = linear_backward(dout, proj_cache)
    dq, dk, dv = causal_attention_backward(split_heads(dy, n_head), core_cache)
    dx, dw_attn, db_attn = qkv_backward(dq, dk, dv, attn_cache)
    return dx, dw_attn, db_attn, dw_proj, db_proj


def mlp_forward(x: Array, w_fc: Array, b_fc: Array | None, w_proj: Array, b_proj: Array | None,
                gelu: str = "tanh", taps: dict[str, Array] | None = None) -> tuple[Array, Cache]:
    """Linear(C, F) -> GELU (`gelu`: "tanh" or "exact") -> Linear(F, C); `taps`: filled with "mlp.fc", "mlp.act"
    and "mlp.proj"."""
    h, fc_cache = linear_forward(x, w_fc, b_fc)
    a, gelu_cache = gelu_pair(gelu)[0](h)
    out, proj_cache = linear_forward(a, w_proj, b_proj)
    if taps is not None:
        taps.update({"mlp.fc": h, "mlp.act": a, "mlp.proj": out})
    return out, (fc_cache, gelu_cache, proj_cache, gelu)


def mlp_backward(dout: Array, cache: Cache) -> tuple[Array, Array, Array, Array, Array]:
    """Gradients (dx, dw_fc, db_fc, dw_proj, db_proj)."""
    fc_cache, gelu_cache, proj_cache, gelu = cache
    da, dw_proj, db_proj = linear_backward(dout, proj_cache)
    dh = gelu_pair(gelu)[1](da, gelu_cache)
    dx, dw_fc, db_fc = linear_backward(dh, fc_cache)
    return dx, dw_fc, db_fc, dw_proj, db_proj


def cross_entropy_forward(logits: Array, targets: Array) -> tuple[Array, Cache]:
    """Mean over all B*T positions of -log softmax(logits)[target]; a 0-d array."""
    V = logits.shape[-1]
    z = logits.reshape(-1, V)
    y = targets.reshape(-1)
    # log-softmax as (z - max) - log(sum(exp(z - max))): exact in exact arithmetic, and exp never overflows
    shifted = z - z.max(axis=-1, keepdims=True)
    logprobs = shifted - xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
    rows = xp.arange(y.shape[0])
    loss = -logprobs[rows, y].mean()
    return loss, (logprobs, rows, y, logits.shape)


def cross_entropy_backward(dloss: float | Array, cache: Cache) -> Array:
    """Gradient dlogits = (softmax - onehot(target)) / N, times dloss."""
    logprobs, rows, y, shape = cache
    dz = xp.exp(logprobs)
    dz[rows, y] -= 1.0
    dz *= dloss / y.shape[0]
    return dz.reshape(shape)


# --------------------------------------------------------------------------------------------------- model


def block_forward(x: Array, params: dict[str, Array], prefix: str, config: Config,
                  rng: np.random.Generator | None, masks: dict[str, np.ndarray] | None = None,
                  taps: dict[str, Array] | None = None) -> tuple[Array, Cache]:
    """Pre-LayerNorm transformer block: x + drop(attn(ln_1(x))), then x + drop(mlp(ln_2(x))); with
    config.attn_dropout the attention probabilities are dropped too.

    `masks` are the harness's keep-masks by site ("h.{i}.attn.probs", "h.{i}.attn", "h.{i}.mlp"; see gpt_forward);
    `taps` is filled with the block's activation taps under `prefix` (see gpt_forward).
    """
    def p(name: str) -> Array | None:
        return params.get(prefix + name)  # a bias is absent (None) with config.bias false

    masks = masks or {}
    own: dict[str, Array] | None = None if taps is None else {}

    h, ln1_cache = layernorm_forward(x, p("ln_1.weight"), p("ln_1.bias"))
    # nanoGPT's attn_dropout: on the attention probabilities, only with the option (otherwise p = 0: the identity)
    p_attn, keep_attn = (config.dropout, masks.get(prefix + "attn.probs")) if config.attn_dropout else (0.0, None)
    a, attn_cache = attention_forward(h, p("attn.c_attn.weight"), p("attn.c_attn.bias"),
                                      p("attn.c_proj.weight"), p("attn.c_proj.bias"), config.n_head, own,
                                      p_attn, rng, keep_attn)
    a, drop1_cache = dropout_forward(a, config.dropout, rng, masks.get(prefix + "attn"))
    x = x + a
    if own is not None:
        own.update({"ln_1": h, "res1": x})
    h, ln2_cache = layernorm_forward(x, p("ln_2.weight"), p("ln_2.bias"))
    m, mlp_cache = mlp_forward(h, p("mlp.c_fc.weight"), p("mlp.c_fc.bias"),
                               p("mlp.c_proj.weight"), p("mlp.c_proj.bias"), config.gelu, own)
    m, drop2_cache = dropout_forward(m, config.dropout, rng, masks.get(prefix + "mlp"))
    out = x + m
    if own is not None:
        own.update({"ln_2": h, "res2": out})
        taps.update({prefix + name: value for name, value in own.items()})
    return out, (ln1_cache, attn_cache, drop1_cache, ln2_cache, mlp_cache, drop2_cache)


def block_backward(dout: Array, cache: Cache, prefix: str) -> tuple[Array, dict[str, Array]]:
    """Gradients (dx, {canonical name: gradient}) of one block."""
    ln1_cache, attn_cache, drop1_cache, ln2_cache, mlp_cache, drop2_cache = cache
    g: dict[str, Array] = {}
    # a residual connection passes the gradient through unchanged and adds its branch's gradient
    dm = dropout_backward(dout, drop2_cache)
    dh, g["mlp.c_fc.weight"], g["mlp.c_fc.bias"], g["mlp.c_proj.weight"], g["mlp.c_proj.bias"] = \
        mlp_backward(dm, mlp_cache)
    dx_branch, g["ln_2.weight"], g["ln_2.bias"] = layernorm_backward(dh, ln2_cache)
    dx = dout + dx_branch
    da = dropout_backward(dx, drop1_cache)
    dh, g["attn.c_attn.weight"], g["attn.c_attn.bias"], g["attn.c_proj.weight"], g["attn.c_proj.bias"] = \
        attention_backward(da, attn_cache)
    dx_branch, g["ln_1.weight"], g["ln_1.bias"] = layernorm_backward(dh, ln1_cache)
    dx = dx + dx_branch
    return dx, {prefix + name: grad for name, grad in g.items() if grad is not None}  # no bias: no gradient


def gpt_forward(params: dict[str, Array], idx: Array, config: Config,
                rng: np.random.Generator | None = None, masks: dict[str, np.ndarray] | None = None,
                taps: dict[str, Array] | None = None) -> tuple[Array, Cache]:
    """Logits (B, T, V) for token ids idx (B, T). Dropout is active iff `rng` is given (training).

    `masks` (harness.core.masks.dropout_masks, keys "emb", "h.{i}.attn.probs", "h.{i}.attn", "h.{i}.mlp"): dropout
    with exactly these keep-masks instead of drawing from `rng`. `taps` (parity's depth 0): filled with the named
    intermediate activations of harness/core/taps.py ("emb", "h.{i}.ln_1", ..., "ln_f", "logits").
    """
    T = idx.shape[1]
    if T > config.block_size:
        raise ValueError(f"sequence length {T} exceeds block_size {config.block_size}")
    x, emb_cache = embedding_forward(idx, params["wte.weight"], params["wpe.weight"])
    if taps is not None:
        taps["emb"] = x
    x, drop_cache = dropout_forward(x, config.dropout, rng, (masks or {}).get("emb"))
    block_caches = []
    for i in range(config.n_layer):
        x, c = block_forward(x, params, f"h.{i}.", config, rng, masks, taps)
        block_caches.append(c)
    h, lnf_cache = layernorm_forward(x, params["ln_f.weight"], params.get("ln_f.bias"))
    # tied embeddings: the output layer is the token table itself, logits = h @ wte.T
    w_head = params["wte.weight"] if config.tie_embeddings else params["lm_head.weight"]
    logits, head_cache = linear_forward(h, w_head, params.get("lm_head.bias"))
    if taps is not None:
        taps.update({"ln_f": h, "logits": logits})
    return logits, (emb_cache, drop_cache, block_caches, lnf_cache, head_cache, config.tie_embeddings)


def gpt_backward(dlogits: Array, cache: Cache) -> dict[str, Array]:
    """Gradients of every parameter, {canonical name: array of the canonical shape}."""
    emb_cache, drop_cache, block_caches, lnf_cache, head_cache, tied = cache
    g: dict[str, Array | None] = {}
    dh, dw_head, db_head = linear_backward(dlogits, head_cache)
    if not tied:
        g["lm_head.weight"] = dw_head
    g["lm_head.bias"] = db_head
    dx, g["ln_f.weight"], g["ln_f.bias"] = layernorm_backward(dh, lnf_cache)
    for i in reversed(range(len(block_caches))):
        dx, block_grads = block_backward(dx, block_caches[i], f"h.{i}.")
        g.update(block_grads)
    dx = dropout_backward(dx, drop_cache)
    g["wte.weight"], g["wpe.weight"] = embedding_backward(dx, emb_cache)
    if tied:  # one matrix used twice: its gradient is the sum of both uses
        g["wte.weight"] = g["wte.weight"] + dw_head
    return {name: grad for name, grad in g.items() if grad is not None}


def loss_and_gradients(params: dict[str, Array], idx: Array, targets: Array, config: Config,
                       rng: np.random.Generator | None = None, masks: dict[str, np.ndarray] | None = None
                       ) -> tuple[Array, dict[str, Array]]:
    """Mean cross-entropy (0-d array) and the gradients of every parameter; dropout iff `rng` or `masks` given."""
    logits, cache = gpt_forward(params, idx, config, rng, masks)
    loss, ce_cache = cross_entropy_forward(logits, targets)
    grads = gpt_backward(cross_entropy_backward(1.0, ce_cache), cache)
    return loss, grads


def loss_only(params: dict[str, Array], idx: Array, targets: Array, config: Config,
              rng: np.random.Generator | None = None, masks: dict[str, np.ndarray] | None = None) -> Array:
    """Mean cross-entropy (0-d array) without a backward pass; dropout iff `rng` or `masks` given."""
    logits, _ = gpt_forward(params, idx, config, rng, masks)
    return cross_entropy_forward(logits, targets)[0]


# --------------------------------------------------------------------------------------------------- optimizer


def clip_grad_norm(grads: dict[str, Array], max_norm: float) -> Array:
    """Scale all gradients in place so their global L2 norm is at most `max_norm`; returns the norm before.

    As torch.nn.utils.clip_grad_norm_: total = sqrt(sum of squared per-tensor norms), coef =
    max_norm / (total + 1e-6) clamped to at most 1, and every gradient is multiplied by coef (also when 1).
    """
    norms = xp.stack([xp.sqrt((g * g).sum()) for g in grads.values()])
    total = xp.sqrt((norms * norms).sum())
    coef = xp.minimum(max_norm / (total + 1e-6), 1.0)
    for g in grads.values():
        g *= coef
    return total


class AdamW:
    """AdamW with torch.optim.AdamW's semantics and order of operations (single-tensor path, amsgrad off).

    Per parameter p with gradient g, at step t (starting at 1):
        p *= 1 - lr * weight_decay                     only where harness.core.weights.decays(name, shape, decay)
        m  = m + (1 - beta1) (g - m)                   = beta1 m + (1 - beta1) g, written as torch's lerp
        v  = beta2 v + (1 - beta2) g^2
        p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    The state (m, v) has the parameters' shapes and dtype; t is shared by all parameters.
    """

    def __init__(self, params: dict[str, Array], betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decay: str = "nanogpt") -> None:
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.decay = {name: decays(name, tuple(p.shape), decay) for name, p in params.items()}  # config.decay
        self.m = {name: xp.zeros_like(p) for name, p in params.items()}
        self.v = {name: xp.zeros_like(p) for name, p in params.items()}
        self.t = 0

    def step(self, params: dict[str, Array], grads: dict[str, Array], lr: float) -> None:
        """Update `params` in place from `grads`."""
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        # the bias corrections undo the zero initialisation of m and v; scalars in double, as torch
        step_size = lr / (1 - b1 ** self.t)
        bias_correction2_sqrt = (1 - b2 ** self.t) ** 0.5
        for name, p in params.items():
            g, m, v = grads[name], self.m[name], self.v[name]
            if self.decay[name] and self.weight_decay != 0:
                p *= 1 - lr * self.weight_decay  # decoupled: shrink the weight itself, not via the gradient
            m += (1 - b1) * (g - m)
            v *= b2
            v += (1 - b2) * g * g
            denom = xp.sqrt(v) / bias_correction2_sqrt + self.eps
            p -= step_size * (m / denom)

