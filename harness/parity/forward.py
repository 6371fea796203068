"""The likely cause of a difference in the forward pass (depth 0 and the logits), read from its pattern.

Each function looks at one kind of difference and returns one sentence (or None when its pattern is absent). The
causes read the first divergent activation tap (harness/core/taps.py) against the taps before it, which agree
(docs/parity.md, "Diagnoses"); `tap_cause` and `logits_cause` are what the comparison asks. Side names are passed in,
so a sentence says which side does what; where the pattern is symmetric, the sentence says so instead of guessing
which side is right. `dropout_cause` is the forward pass's dropout, named when only the gradients under the masks
differ (harness.parity.dropout names particular mistakes of the masks, and those of the attention dropout at attn.y,
where the taps of a model with attention dropout are taken under the step-0 attention masks).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from harness.core.taps import BLOCK_TAPS, block_of, kind
from harness.core.taps import PREFIX as TAP_PREFIX
from harness.parity.numeric import TINY, relative_error
from harness.parity.states import arrays, initial_params


def dropout_cause(config: Any = None) -> str:
    """What gradients that differ only under the dropout masks point at, when no particular mistake of the masks
    fits (harness.parity.dropout): the sites of `config`'s model (a Config or its dict; harness parity and the kit
    say it alike)."""
    where = "masks on the embedding sum and after each c_proj, before the residual add"
    get = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
    if get("attn_dropout", False) and (get("dropout", 0) or 0) > 0:
        where += ", and on the attention probabilities (after the softmax, before @ v)"
    return f"dropout (placement or scaling; the gradients agree with dropout off): {where}, kept values x / (1 - p)"


CLOSE = 1e-3  # a candidate explains a tap when it leaves less than this fraction of the tap's size


def _close(a: np.ndarray, b: np.ndarray, tol: float = CLOSE) -> bool:
    return a.shape == b.shape and relative_error(a, b) < tol


def previous_tap(name: str, n_layer: int) -> str | None:
    """The tap computed just before `name` that is its input where that matters: a LayerNorm's input is the
    residual stream before it; otherwise the tap before it in forward order."""
    i = block_of(name)
    k = kind(name)
    if name == "emb":
        return None
    if name in ("ln_f", "logits"):
        return f"h.{n_layer - 1}.res2" if name == "ln_f" else "ln_f"
    if k == "ln_1":
        return "emb" if i == 0 else f"h.{i - 1}.res2"
    if k == "ln_2":
        return f"h.{i}.res1"
    return f"h.{i}.{BLOCK_TAPS[BLOCK_TAPS.index(k) - 1]}"


def embedding_cause(ea: np.ndarray, eb: np.ndarray, params: Mapping[str, np.ndarray], x: np.ndarray | None,
                    names: tuple[str, str]) -> str:
    """`emb` differs: a shifted or missing position table, token ids off by one, or the sum itself."""
    a, b = names
    d = ea - eb
    T = ea.shape[1]
    if "wte.weight" in params and "wpe.weight" in params and x is not None and x.shape == ea.shape[:2]:
        wte, wpe = params["wte.weight"], params["wpe.weight"]
        for side, e in ((a, ea), (b, eb)):
            pos = e - wte[x]  # what this side added for the positions
            if np.linalg.norm(pos - pos[:1]) > CLOSE * np.linalg.norm(pos):
                continue  # not a function of the position alone
            p = pos[0]
            if _close(p, wpe[:T]):
                continue  # this side is right about the positions
            if np.linalg.norm(p) < CLOSE * np.linalg.norm(wpe[:T]):
                return f"position embedding: {side} adds no position embedding (wpe) to the token embedding"
            for s in (-1, 1, -2, 2, -3, 3):
                t = np.arange(T)
                ok = (t + s >= 0) & (t + s < len(wpe))
                if ok.sum() >= 2 and _close(p[ok], wpe[t[ok] + s]):
                    return (f"position embedding shifted by {s:+d}: {side}'s position t reads wpe[t{s:+d}] "
                            "(expected wpe[t])")
            return f"position embedding: {side} adds something else than wpe[t] at position t (its layout?)"
        for side, e in ((a, ea), (b, eb)):
            tok = e - wpe[:T][None]
            for s in (-1, 1):
                ids = x + s
                if ids.min() >= 0 and ids.max() < len(wte) and _close(tok, wte[ids]):
                    return f"token embedding: {side} reads wte[x{s:+d}] for token x (0-based vs 1-based ids)"
    if np.linalg.norm(d - d[:1]) <= CLOSE * np.linalg.norm(d):
        return ("position embedding (wpe): every batch row differs the same way at each position (an offset, a "
                "shift or the table's layout)")
    return "the embedding sum wte[x] + wpe[t] (token ids, the tables' layouts)"


def layernorm_cause(ya: np.ndarray, yb: np.ndarray, x: np.ndarray, weight: np.ndarray | None,
                    bias: np.ndarray | None, names: tuple[str, str]) -> str:
    """A LayerNorm's output differs while its input agrees: eps, the variance's divisor or the affine part."""
    a, b = names
    C = x.shape[-1]
    w = np.ones(C) if weight is None else np.where(np.abs(weight) > 0, weight, 1.0)
    beta = np.zeros(C) if bias is None else bias
    xc = (x - x.mean(axis=-1, keepdims=True)).reshape(-1, C)
    var = (xc * xc).mean(axis=-1)

    def inverse_variance(y: np.ndarray) -> tuple[np.ndarray, float]:
        """Per token 1/rstd^2 and the fraction of y that a per-token normalisation leaves unexplained."""
        z = ((y - beta) / w).reshape(-1, C)
        r = (z * xc).sum(axis=-1) / np.maximum((xc * xc).sum(axis=-1), TINY)
        rest = float(np.linalg.norm(z - r[:, None] * xc) / max(np.linalg.norm(z), TINY))
        return 1.0 / np.maximum(r * r, TINY), rest

    (sa, rest_a), (sb, rest_b) = inverse_variance(ya), inverse_variance(yb)
    for side, rest in ((a, rest_a), (b, rest_b)):
        if rest > CLOSE:
            return (f"LayerNorm: {side}'s output is not its input normalised per token times weight plus bias "
                    "(the affine weight and bias, or the axis it normalises over)")
    design = np.stack([var, np.ones_like(var)], axis=1)
    (alpha_a, eps_a), (alpha_b, eps_b) = (np.linalg.lstsq(design, s, rcond=None)[0] for s in (sa, sb))
    unbiased = C / (C - 1)

    def near(alpha: float, target: float) -> bool:
        return abs(alpha - target) < 0.1 * (unbiased - 1)

    for side, other, mine, theirs in ((a, b, alpha_a, alpha_b), (b, a, alpha_b, alpha_a)):
        if near(mine, unbiased) and near(theirs, 1.0):
            return (f"LayerNorm variance: {side} divides by C - 1 (unbiased), {other} by C (biased, as "
                    "torch.nn.LayerNorm)")
    if near(alpha_a, 1.0) and near(alpha_b, 1.0):
        return (f"LayerNorm eps: {a} adds {max(eps_a, 0):.1e} to the variance, {b} {max(eps_b, 0):.1e} "
                "(torch.nn.LayerNorm: 1e-5)")
    return "LayerNorm: eps, the variance (biased, divided by C) or where eps is added"


def qkv_cause(name: str, ta: Mapping[str, np.ndarray], tb: Mapping[str, np.ndarray],
              names: tuple[str, str]) -> str:
    """q, k or v differs while ln_1 agrees: the order of c_attn's rows, the head split, or the projection."""
    a, b = names
    prefix, which = name.rsplit(".", 1)
    qa = ta[name]
    for other in ("q", "k", "v"):
        key = f"{prefix}.{other}"
        if other != which and key in tb and _close(qa, tb[key]):
            return (f"c_attn's rows are split in another order: {a}'s {which} is {b}'s {other} (rows 0..C-1 are q, "
                    "C..2C-1 k, 2C..3C-1 v)")
    if qa.ndim == 4:
        R, H, T, D = qa.shape
        merged_a = qa.transpose(0, 2, 1, 3).reshape(R, T, H * D)
        merged_b = tb[name].transpose(0, 2, 1, 3).reshape(R, T, H * D)
        if np.allclose(np.sort(merged_a, axis=-1), np.sort(merged_b, axis=-1), rtol=CLOSE, atol=0):
            return (f"the head split: {a}'s {which} holds the same features in another order (head h owns features "
                    "h*D..(h+1)*D-1: view(B, T, H, D) then transpose)")
    return f"the qkv projection c_attn (its weight layout or bias) or the head split, seen first in {which}"


def attention_probs_cause(pa: np.ndarray, pb: np.ndarray, head_dim: int, names: tuple[str, str],
                          keep: np.ndarray | None = None, p: float = 0.0) -> str:
    """The attention probabilities differ while q and k agree: one side taps them after the dropout (with `keep`,
    the attention mask the taps were taken with), the causal mask, or the scale (a uniform temperature), or
    something else."""
    a, b = names
    T = pa.shape[-1]
    if keep is not None and np.shape(keep) == pa.shape:
        dropped = np.asarray(keep, dtype=np.float64) / (1 - p)
        for side, other, mine, theirs in ((a, b, pa, pb), (b, a, pb, pa)):
            if _close(mine, theirs * dropped):
                return (f"attn.probs tapped after the attention dropout: {side}'s are {other}'s times mask / (1 - p); "
                        "the tap is the probabilities before it (attn.y is the dropped ones @ v)")
    t, s = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    za, zb = pa == 0, pb == 0
    if (za != zb).any():
        for side, other, zs, zo in ((a, b, za, zb), (b, a, zb, za)):
            extra = (~zs & zo).any(axis=tuple(range(pa.ndim - 2)))  # (query, key): this side sees, the other not
            if (extra & (s > t)).any():
                reach = int((s - t)[extra].max())
                how = "one too wide" if reach == 1 else f"{reach} too wide" if reach < T - 1 else "missing"
                rows = np.unique(t[extra])
                return (f"causal mask: {side}'s query t attends to future keys up to s = t + {reach} (first at query "
                        f"{rows[0]}): its mask is {how}; {other} masks every s > t")
            if (extra & (s == t)).any() or (extra & (s < t)).any():
                return (f"causal mask: {other} masks keys s <= t that {side} sees (the current position or the past, "
                        "e.g. the mask's diagonal)")
        return "causal mask: the two sides mask different keys"
    live = ~za  # every unmasked entry (the same in both)
    la = np.where(live, np.log(np.where(live, pa, 1.0)), 0.0)
    lb = np.where(live, np.log(np.where(live, pb, 1.0)), 0.0)
    n = live.sum(axis=-1, keepdims=True)
    rows = n[..., 0] >= 2
    ca = np.where(live, la - la.sum(axis=-1, keepdims=True) / np.maximum(n, 1), 0.0)[rows]
    cb = np.where(live, lb - lb.sum(axis=-1, keepdims=True) / np.maximum(n, 1), 0.0)[rows]
    if len(ca):
        tau = (ca * cb).sum(axis=-1) / np.maximum((cb * cb).sum(axis=-1), TINY)
        rest = np.linalg.norm(ca - tau[:, None] * cb) / max(np.linalg.norm(ca), TINY)
        f = float(np.median(tau))
        if rest < 0.01 and np.percentile(np.abs(tau - f), 90) < 0.02 * abs(f) and abs(f - 1) > 0.01:
            root = math.sqrt(head_dim)
            known = (" = sqrt(D): one side scales q.k by 1/sqrt(D), the other by 1/D or 1" if abs(f / root - 1) < 0.02
                     else " = 1/sqrt(D): one side scales q.k by 1/sqrt(D), the other by 1/D or 1"
                     if abs(f * root - 1) < 0.02 else "")
            return (f"attention scale: {a}'s scores are {b}'s times {f:.3g}{known} (D = {head_dim}; the "
                    "probabilities differ by a uniform temperature)")
    return ("attention scores: the probabilities differ under the same mask and by no common temperature (q.k, "
            "the softmax axis, or the head split)")


def merge_heads(a: np.ndarray) -> np.ndarray:
    """(B, H, T, D) -> (B, T, H*D): the heads merged back, as attn.y holds them."""
    B, H, T, D = a.shape
    return a.transpose(0, 2, 1, 3).reshape(B, T, H * D)


def attention_self_error(taps: Mapping[str, np.ndarray], block: str, keep: np.ndarray | None = None,
                         p: float = 0.0) -> float | None:
    """How far one side's `{block}attn.y` is from its own `attn.probs @ attn.v` (heads merged), as a fraction of
    y's largest value; with `keep`, the attention mask the taps were taken with (p its dropout), from its own
    `(attn.probs * keep / (1 - p)) @ attn.v`. None when the side lacks one of them. A model that taps probabilities
    it computes apart from its attention call (torch: SDPA returns no probabilities) can tap right ones while its
    output is wrong."""
    probs, v, y = (taps.get(block + k) for k in ("attn.probs", "attn.v", "attn.y"))
    if probs is None or v is None or y is None or np.ndim(probs) != 4 or np.ndim(v) != 4:
        return None
    probs = np.asarray(probs, dtype=np.float64)
    if keep is not None:
        if np.shape(keep) != probs.shape:
            return None
        probs = probs * (np.asarray(keep, dtype=np.float64) / (1 - p))
    want = merge_heads(probs @ np.asarray(v, dtype=np.float64))
    if want.shape != np.shape(y):
        return None
    y = np.asarray(y, dtype=np.float64)
    scale = max(float(np.abs(y).max()), float(np.abs(want).max()), TINY)
    return float(np.abs(y - want).max()) / scale


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool) -> np.ndarray:
    """softmax(q k^T scale, keys s > t masked when `causal`) @ v, heads merged, float64."""
    T = q.shape[-2]
    scores = (q @ k.swapaxes(-1, -2)) * scale
    if causal:
        scores = np.where(np.triu(np.ones((T, T), dtype=bool), 1), -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    return merge_heads((e / e.sum(axis=-1, keepdims=True)) @ v)


def attention_output_cause(name: str, ta: Mapping[str, np.ndarray], tb: Mapping[str, np.ndarray],
                           names: tuple[str, str], keep: np.ndarray | None = None, p: float = 0.0) -> str:
    """attn.y differs while q, k, v and the probabilities agree: a side whose y is not its own probs @ v computes
    its output apart from the probabilities it taps (torch's SDPA call), with another scale or mask; which one is
    read from its q, k, v. Under the attention mask `keep` (the taps taken with it, p its dropout) a side whose y is
    not its own dropped probabilities @ v has its attention dropout wrong in a way no known mistake explains (those
    harness.parity.dropout.attention_dropout_cause names before this is asked)."""
    block = name[:-len("attn.y")]
    for side, taps in zip(names, (ta, tb)):
        err = attention_self_error(taps, block, keep, p)
        if err is None or err < CLOSE:
            continue
        if keep is not None:
            return (f"the attention dropout: {side}'s attn.y is not its own (attn.probs * mask / (1 - p)) @ attn.v "
                    f"({err:.1e} of its scale) under the step-0 mask of {block}attn.probs, and no known mistake of "
                    "the mask explains it")
        q, k, v = (np.asarray(taps[block + x], dtype=np.float64) for x in ("attn.q", "attn.k", "attn.v"))
        D = q.shape[-1]
        y = np.asarray(taps[name], dtype=np.float64)
        which = ""
        for label, scale in (("1/sqrt(D)", 1 / math.sqrt(D)), ("1/D", 1 / D), ("1", 1.0)):
            for causal in (True, False):
                if _close(y, _attention(q, k, v, scale, causal)):
                    wrong = ([f"scale {label} instead of 1/sqrt(D) (D = {D})"] if label != "1/sqrt(D)" else []) + (
                        [] if causal else ["no causal mask (every key visible)"])
                    which = f"q, k, v attended with {' and '.join(wrong)}, " if wrong else ""
                    break
            if which:
                break
        return (f"the SDPA call's scale or mask: {side}'s attn.y is {which}not its own attn.probs @ attn.v ({err:.1e} "
                "of its scale: the probabilities it taps are computed apart from its attention call)")
    return ("attention output: y = probs @ v with the heads merged back (transpose before reshape) differs while "
            "the probabilities and v agree")


def linear_cause(what: str, out_a: np.ndarray, inp: np.ndarray, weight: np.ndarray | None,
                 bias: np.ndarray | None, names: tuple[str, str]) -> str:
    """A Linear's output differs while its input agrees: its weight transposed, or its layout or bias."""
    a, _ = names
    if weight is not None and weight.shape[0] == weight.shape[1]:
        b_ = 0.0 if bias is None else bias
        if _close(out_a, inp @ weight + b_):
            return f"{what}: {a} uses its weight transposed (x W instead of x W^T, W of shape (out, in))"
    return f"{what}: its weight (layout) or bias"


def activation_cause(act_a: np.ndarray, act_b: np.ndarray, fc: np.ndarray, names: tuple[str, str]) -> str:
    """mlp.act differs while mlp.fc agrees: which activation each side computes (GELU's tanh or exact form, ...)."""
    from scipy.special import erf

    forms = {
        "tanh-approximation GELU": 0.5 * fc * (1 + np.tanh(math.sqrt(2 / math.pi) * (fc + 0.044715 * fc ** 3))),
        "exact (erf) GELU": 0.5 * fc * (1 + erf(fc / math.sqrt(2))),
        "sigmoid GELU x*sigmoid(1.702x)": fc / (1 + np.exp(-1.702 * fc)),
        "ReLU": np.maximum(fc, 0),
    }

    def form(act: np.ndarray) -> str | None:
        errs = sorted((float(np.abs(act - f).max()), name) for name, f in forms.items())
        return errs[0][1] if errs[0][0] < 0.2 * errs[1][0] else None

    fa, fb = form(act_a), form(act_b)
    if fa and fb and fa != fb:
        return f"GELU form: {names[0]} computes the {fa}, {names[1]} the {fb} (mlp.fc agrees)"
    side, f = (names[0], fa) if fa else (names[1], fb)
    if f:
        return f"GELU form: {side} computes the {f}; the other side's activation is none of {', '.join(forms)}"
    return "GELU form: the MLP's activation differs while its input mlp.fc agrees (tanh or exact GELU, or another)"


def output_cause(logits_a: np.ndarray, logits_b: np.ndarray, h: np.ndarray, params: Mapping[str, np.ndarray],
                 names: tuple[str, str]) -> str:
    """The logits differ while ln_f agrees: a tied lm_head, a transposed one, or its bias."""
    w, bias = params.get("lm_head.weight"), params.get("lm_head.bias")
    wte = params.get("wte.weight")
    b_ = 0.0 if bias is None else bias
    for side, other, logits in ((names[0], names[1], logits_a), (names[1], names[0], logits_b)):
        if wte is not None and (_close(logits, h @ wte.T + b_) or _close(logits, h @ wte.T)):
            if w is None or not _close(logits, h @ w.T + b_):
                return (f"output layer: {side} ties lm_head to the token embedding wte (tied embeddings, logits = "
                        f"ln_f @ wte^T); {other} has its own lm_head (untied)")
    return "output layer (lm_head): weight tying, its layout or its bias"


def residual_cause(name: str, ta: Mapping[str, np.ndarray], tb: Mapping[str, np.ndarray],
                   names: tuple[str, str]) -> str:
    """res1 or res2 differs while the branch output agrees: the residual is added to the wrong tensor."""
    i = block_of(name)
    if kind(name) == "res1":
        before, normed, branch = ("emb" if i == 0 else f"h.{i - 1}.res2"), f"h.{i}.ln_1", f"h.{i}.attn.proj"
    else:
        before, normed, branch = f"h.{i}.res1", f"h.{i}.ln_2", f"h.{i}.mlp.proj"
    if all(k in tb for k in (normed, branch)) and _close(ta[name], tb[normed] + tb[branch]):
        return (f"residual connection: {names[0]} adds the branch to the normalised input (post-LayerNorm style) "
                f"instead of to the residual stream {before}")
    return "residual connection: x + the branch's output"


def forward_cause(name: str, ta: Mapping[str, np.ndarray], tb: Mapping[str, np.ndarray],
                  params: Mapping[str, np.ndarray], x: np.ndarray | None, n_layer: int,
                  names: tuple[str, str], keeps: Mapping[str, np.ndarray] | None = None, p: float = 0.0) -> str:
    """The likely cause of the first divergent tap `name`; `ta`, `tb` the two sides' taps (float64, the taps before
    `name` agree), `params` the initial parameters (may be empty), `x` the token rows the taps were taken on,
    `keeps` the dropout masks the taps were taken with ({site: mask}: the attention probabilities') and `p`."""
    k = kind(name)
    prev = previous_tap(name, n_layer)
    inp = (tb[prev] if prev in tb else ta.get(prev)) if prev else None  # the input, where it agrees
    pre = f"h.{block_of(name)}." if block_of(name) is not None else ""
    keep = (keeps or {}).get(pre + "attn.probs")
    if name == "emb":
        return embedding_cause(ta[name], tb[name], params, x, names)
    if k in ("ln_1", "ln_2") or name == "ln_f":
        ln = name if name == "ln_f" else pre + k
        if inp is None:
            return "LayerNorm: eps, the variance (biased) or its affine weight and bias"
        return layernorm_cause(ta[name], tb[name], inp, params.get(f"{ln}.weight"), params.get(f"{ln}.bias"), names)
    if k in ("attn.q", "attn.k", "attn.v"):
        return qkv_cause(name, ta, tb, names)
    agreed = {**ta, **tb}  # the taps before `name`, which agree (either side's, where only one gave them)
    if k == "attn.probs":
        q = agreed.get(pre + "attn.q")
        return attention_probs_cause(ta[name], tb[name], int(q.shape[-1]) if q is not None else 1, names, keep,
                                     p if keep is not None else 0.0)
    if k == "attn.y":
        return attention_output_cause(name, ta, tb, names, keep, p if keep is not None else 0.0)
    if k == "attn.proj" and inp is not None:
        return linear_cause("the attention output projection c_proj", ta[name], inp,
                            params.get(pre + "attn.c_proj.weight"), params.get(pre + "attn.c_proj.bias"), names)
    if k in ("res1", "res2"):
        return residual_cause(name, ta, {**agreed, name: tb[name]}, names)
    if k == "mlp.fc" and inp is not None:
        return linear_cause("the MLP's c_fc", ta[name], inp, params.get(pre + "mlp.c_fc.weight"),
                            params.get(pre + "mlp.c_fc.bias"), names)
    if k == "mlp.act" and inp is not None:
        return activation_cause(ta[name], tb[name], inp, names)
    if k == "mlp.proj" and inp is not None:
        return linear_cause("the MLP's c_proj", ta[name], inp, params.get(pre + "mlp.c_proj.weight"),
                            params.get(pre + "mlp.c_proj.bias"), names)
    if name == "logits" and inp is not None:
        return output_cause(ta[name], tb[name], inp, params, names)
    return f"the forward pass at {name}"


def tap_cause(first: str, ta: Mapping[str, np.ndarray], tb: Mapping[str, np.ndarray],
              probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], names: tuple[str, str],
              keeps: Mapping[str, np.ndarray] | None = None, p: float = 0.0) -> str:
    """The likely cause of the first divergent tap `first` of two probes (`ta`, `tb`: their taps, the same shape at
    `first`): `forward_cause` on the taps in float64, the initial parameters, the batch rows the taps were taken
    on and the dropout masks they were taken with (`keeps`, p). A pattern test that trips on odd input says so
    instead of raising."""
    f64a = {k: np.asarray(v, dtype=np.float64) for k, v in ta.items()}
    f64b = {k: np.asarray(v, dtype=np.float64) for k, v in tb.items()}
    n_layer = 1 + max((block_of(n) for n in (*ta, *tb) if block_of(n) is not None), default=-1)
    x = probe_b.get("x", probe_a.get("x"))
    rows = f64b[first].shape[0]
    x = np.asarray(x)[:rows] if x is not None and np.ndim(x) == 2 else None
    try:
        return forward_cause(first, f64a, f64b, initial_params(probe_b, probe_a), x, n_layer, names, keeps, p)
    except (ValueError, IndexError, KeyError, FloatingPointError) as exc:  # a pattern test on odd input
        return f"the forward pass at {first} (no pattern read: {type(exc).__name__})"


def logits_cause(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], first_tap: str | None,
                 names: tuple[str, str]) -> str | None:
    """Why the logits differ, when the taps did not already say (`first_tap`: the first divergent tap, if any): the
    output layer (a tied lm_head) read from the reference's ln_f tap, or that the taps' rows agree."""
    if first_tap:
        return f"follows from the forward difference at {first_tap} (above)"
    ta, tb = arrays(probe_a, TAP_PREFIX), arrays(probe_b, TAP_PREFIX)
    ln_f = tb.get("ln_f", ta.get("ln_f"))
    if "logits" in ta and "logits" in tb:
        return (f"the activation taps (the first {tb['logits'].shape[0]} batch rows) agree: the difference lies in "
                "later batch rows")
    if ln_f is not None:
        rows = ln_f.shape[0]
        la, lb = (np.asarray(p["logits"][:rows], dtype=np.float64) for p in (probe_a, probe_b))
        cause = output_cause(la, lb, np.asarray(ln_f, dtype=np.float64), initial_params(probe_b, probe_a), names)
        if "ties lm_head" in cause:
            return cause
    return None
