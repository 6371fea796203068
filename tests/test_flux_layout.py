"""The Flux layout, checked without Julia.

A NumPy forward pass reads the Flux-layout arrays exactly the way julia/NanoGPTFlux does: features first,
column-major reshapes (`order="F"`, as Julia's `reshape`), 1-based token ids used as `ids - 1`, the fused qkv
rows split [q; k; v], heads as `reshape(x, hs, nh, T, B)` (NNlib's split_heads), NNlib's score layout
(kv_len, q_len, head, batch) with the causal mask m[j, i] = j <= i, softmax over keys (dims=1). Its logits must
match the PyTorch backend's within 1e-5: if they do, the only thing left to Julia is executing the same
index arithmetic. With the harness's dropout keep-masks converted by `masks_to_flux`, applied as NanoGPTFlux does
(`x .* keep ./ (1 - p)` after the embedding sum and after each output projection), it must match the NumPy oracle
given the same masks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.backends.flux_layout import (
    from_flux,
    logits_from_flux,
    logits_to_flux,
    masks_from_flux,
    masks_to_flux,
    to_flux,
    tokens_from_flux,
    tokens_to_flux,
)
from harness.config.load import load_config
from harness.core.weights import init_weights, param_shapes
from harness.models import numpy_gpt

VOCAB = 65


def _dense(w: np.ndarray, b: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Flux Dense on (in, T, B): reshape(W * reshape(x, in, :) .+ b, out, T, B), column-major."""
    n_in, rest = x.shape[0], x.shape[1:]
    flat = x.reshape(n_in, -1, order="F")
    return (w @ flat + b[:, None]).reshape((w.shape[0], *rest), order="F")


def _layernorm(w: np.ndarray, b: np.ndarray, x: np.ndarray) -> np.ndarray:
    mu = x.mean(axis=0, keepdims=True)
    xc = x - mu
    var = (xc**2).mean(axis=0, keepdims=True)
    return xc / np.sqrt(var + 1e-5) * w[:, None, None] + b[:, None, None]


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, nheads: int, fdrop=None) -> tuple[np.ndarray, np.ndarray]:
    """NNlib.dot_product_attention(q, k, v; mask=causal, nheads, fdrop) on (d, T, B) arrays: (y, the scores α after
    the softmax, before `fdrop`, (kv_len, q_len, nheads, batch)); `fdrop` (None: identity) acts on α before the
    product with v, as NNlib's dot_product_attention_scores applies it."""
    d, T, B = q.shape
    hs = d // nheads
    split = [a.reshape(hs, nheads, T, B, order="F") for a in (q, k, v)]  # split_heads
    qh, kh, vh = split
    # logits[j, i, h, b] = sum_d k[d, h, j, b] * q[d, h, i, b] / sqrt(hs)
    scores = np.einsum("dhjb,dhib->jihb", kh, qh) / math.sqrt(hs)
    j, i = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    mask = (j <= i)[:, :, None, None]  # make_causal_mask: m[j, i] = j <= i, true = keep
    scores = np.where(mask, scores, -np.inf)
    scores = scores - scores.max(axis=0, keepdims=True)
    alpha = np.exp(scores)
    alpha /= alpha.sum(axis=0, keepdims=True)
    dropped = alpha if fdrop is None else fdrop(alpha)
    # x[d, h, i, b] = sum_j alpha[j, i, h, b] * v[d, h, j, b]; join_heads = reshape(x, d, T, B)
    y = np.einsum("jihb,dhjb->dhib", dropped, vh)
    return y.reshape(d, T, B, order="F"), alpha


def flux_forward(fw: dict[str, np.ndarray], ids_tb: np.ndarray, n_layer: int, n_head: int,
                 keeps: dict[str, np.ndarray] | None = None, p_drop: float = 0.0,
                 taps: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """NanoGPTFlux's GPT(idx, mask[, keeps]) in NumPy (float64): Flux-layout weights, (T, B) 1-based ids -> (V, T, B).

    `keeps`: Flux-layout (C, T, B) keep-masks by site, applied as `apply_dropout` does: x .* keep ./ (1 - p_drop);
    with "h.{i}.attn.probs" ((T_key, T_query, H, B), NNlib's layout) also on the attention probabilities, as
    NanoGPTFlux's CausalSelfAttention hands them to dot_product_attention's `fdrop`.
    `taps`: filled as NanoGPTFlux's `taps` fills its Dict (src/taps.jl), in the Flux layout: q, k, v as NNlib splits
    the heads, reshape(a, hs, nh, T, B); the probabilities as NNlib returns α; the rest (features, T, B).
    """
    taps = {} if taps is None else taps
    f = {k: np.asarray(v, dtype=np.float64) for k, v in fw.items()}

    def drop(x: np.ndarray, site: str) -> np.ndarray:
        return x if keeps is None or site not in keeps else x * keeps[site] / (1 - p_drop)

    T, B = ids_tb.shape
    x = f["wte.weight"][:, ids_tb - 1]  # Embedding: gather columns of the (d, V) table, 1-based ids
    taps["emb"] = x = x + f["wpe.weight"][:, :T][:, :, None]  # wpe[:, 1:T] broadcast over the batch
    x = drop(x, "emb")
    for layer in range(n_layer):
        p = f"h.{layer}."
        taps[p + "ln_1"] = h = _layernorm(f[p + "ln_1.weight"], f[p + "ln_1.bias"], x)
        qkv = _dense(f[p + "attn.c_attn.weight"], f[p + "attn.c_attn.bias"], h)
        d = x.shape[0]
        q, k, v = qkv[:d], qkv[d:2 * d], qkv[2 * d:]  # qkv[1:d], qkv[d+1:2d], qkv[2d+1:3d]
        for name, a in (("q", q), ("k", k), ("v", v)):
            taps[p + "attn." + name] = a.reshape(d // n_head, n_head, T, B, order="F")
        taps[p + "attn.y"], taps[p + "attn.probs"] = y, _ = _attention(
            q, k, v, n_head, lambda alpha, site=p + "attn.probs": drop(alpha, site))
        taps[p + "attn.proj"] = a = _dense(f[p + "attn.c_proj.weight"], f[p + "attn.c_proj.bias"], y)
        taps[p + "res1"] = x = x + drop(a, p + "attn")
        taps[p + "ln_2"] = h = _layernorm(f[p + "ln_2.weight"], f[p + "ln_2.bias"], x)
        taps[p + "mlp.fc"] = h = _dense(f[p + "mlp.c_fc.weight"], f[p + "mlp.c_fc.bias"], h)
        taps[p + "mlp.act"] = h = _gelu_tanh(h)
        taps[p + "mlp.proj"] = h = _dense(f[p + "mlp.c_proj.weight"], f[p + "mlp.c_proj.bias"], h)
        taps[p + "res2"] = x = x + drop(h, p + "mlp")
    taps["ln_f"] = x = _layernorm(f["ln_f.weight"], f["ln_f.bias"], x)
    taps["logits"] = out = _dense(f["lm_head.weight"], f["lm_head.bias"], x)
    return out


def _weights(size: str = "small", seed: int = 7, n_layer: int | None = None):
    config = load_config(size)
    if n_layer is not None:
        config = config.replace(n_layer=n_layer)
    return config, init_weights(config, VOCAB, seed)


def _noisy(weights: dict[str, np.ndarray], seed: int = 3) -> dict[str, np.ndarray]:
    """Perturb the constant LayerNorm gains and zero biases so that a swapped weight would show."""
    rng = np.random.default_rng(seed)
    return {k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.1).astype(np.float32)
            for k, v in weights.items()}


def test_to_flux_shapes_and_order():
    config, w = _weights()
    fw = to_flux(w)
    assert set(fw) == set(w)
    d, n = config.n_embd, config.block_size
    assert fw["wte.weight"].shape == (d, VOCAB)
    assert fw["wpe.weight"].shape == (d, n)
    assert fw["h.0.attn.c_attn.weight"].shape == (3 * d, d)  # Dense (out, in) as PyTorch
    assert fw["lm_head.weight"].shape == (VOCAB, d)
    for name, a in fw.items():
        assert a.dtype == np.float32
        assert a.flags.f_contiguous, name
    np.testing.assert_array_equal(fw["wte.weight"], w["wte.weight"].T)
    np.testing.assert_array_equal(fw["h.0.mlp.c_fc.weight"], w["h.0.mlp.c_fc.weight"])


def test_round_trip_is_exact():
    config, w = _weights("medium", seed=11)
    back = from_flux(to_flux(w))
    assert set(back) == set(w)
    for name, a in w.items():
        assert back[name].shape == param_shapes(config, VOCAB)[name]
        assert back[name].dtype == np.float32
        assert back[name].flags.c_contiguous
        np.testing.assert_array_equal(back[name], a)
    # optimizer-state keys carry the parameter name after a prefix
    moments = {"adam_m/wte.weight": w["wte.weight"], "adam_v/h.0.ln_1.bias": w["h.0.ln_1.bias"]}
    fm = to_flux(moments)
    assert fm["adam_m/wte.weight"].shape == (config.n_embd, VOCAB)
    for name, a in from_flux(fm).items():
        np.testing.assert_array_equal(a, moments[name])


def test_tokens_and_logits_layout():
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(4, 9))
    xf = tokens_to_flux(x)
    assert xf.shape == (9, 4) and xf.dtype == np.int64 and xf.flags.f_contiguous
    assert xf.min() >= 1 and xf.max() <= VOCAB
    assert xf[2, 3] == x[3, 2] + 1
    np.testing.assert_array_equal(tokens_from_flux(xf), x)
    logits = rng.standard_normal((4, 9, VOCAB)).astype(np.float32)
    lf = logits_to_flux(logits)
    assert lf.shape == (VOCAB, 9, 4)
    assert lf[5, 2, 1] == logits[1, 2, 5]
    np.testing.assert_array_equal(logits_from_flux(lf), logits)
    with pytest.raises(ValueError):
        tokens_to_flux(np.zeros((2, 3), dtype=np.float32))


@pytest.mark.parametrize("size,n_layer,T", [("small", None, 64), ("medium", 2, 37)])
def test_flux_layout_forward_matches_torch(size, n_layer, T):
    torch_backend = pytest.importorskip("harness.backends.torch_backend")
    config, w = _weights(size, n_layer=n_layer)
    config = config.replace(dropout=0.0)
    w = _noisy(w)
    rng = np.random.default_rng(5)
    x = rng.integers(0, VOCAB, size=(3, T))
    backend = torch_backend.TorchBackend(dtype="float32")
    backend.setup(config, w, VOCAB, "cpu", 0)
    expected = np.asarray(backend.logits(x), dtype=np.float64)
    got = logits_from_flux(flux_forward(to_flux(w), tokens_to_flux(x), config.n_layer, config.n_head))
    assert got.shape == expected.shape == (3, T, VOCAB)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def test_flux_layout_forward_is_causal():
    config, w = _weights()
    w = _noisy(w)
    rng = np.random.default_rng(1)
    x = rng.integers(0, VOCAB, size=(2, 20))
    base = flux_forward(to_flux(w), tokens_to_flux(x), config.n_layer, config.n_head)
    x2 = x.copy()
    x2[:, 12:] = (x2[:, 12:] + 5) % VOCAB
    changed = flux_forward(to_flux(w), tokens_to_flux(x2), config.n_layer, config.n_head)
    np.testing.assert_allclose(changed[:, :12], base[:, :12], atol=1e-12)
    assert not np.allclose(changed[:, 12:], base[:, 12:])


def _harness_masks(config, B: int, T: int, seed: int = 9) -> dict[str, np.ndarray]:
    """Keep-masks of the shared-mask contract: bool (B, T, C) per site, kept with probability 1 - dropout."""
    rng = np.random.default_rng(seed)
    sites = ["emb"] + [f"h.{i}.{site}" for i in range(config.n_layer) for site in ("attn", "mlp")]
    return {k: rng.random((B, T, config.n_embd)) >= config.dropout for k in sites}


def test_masks_to_flux_layout():
    config, _ = _weights()
    masks = _harness_masks(config.replace(dropout=0.3), B=3, T=7)
    fm = masks_to_flux(masks)
    assert set(fm) == set(masks)
    for name, m in fm.items():
        assert m.shape == (config.n_embd, 7, 3) and m.dtype == np.bool_ and m.flags.f_contiguous, name
        b, t, c = 2, 5, 11
        assert m[c, t, b] == masks[name][b, t, c]
        np.testing.assert_array_equal(m, masks[name].transpose(2, 1, 0))
    back = masks_from_flux(fm)
    for name, m in masks.items():
        np.testing.assert_array_equal(back[name], m)
        assert back[name].flags.c_contiguous
    with pytest.raises(ValueError, match="unknown dropout mask"):
        masks_to_flux({"h.0.attn_probs": masks["emb"]})
    with pytest.raises(ValueError, match="bool"):
        masks_to_flux({"emb": masks["emb"].astype(np.float32)})
    with pytest.raises(ValueError, match="shape"):
        masks_to_flux({"emb": masks["emb"], "h.0.mlp": masks["h.0.mlp"][:, :3]})


def test_masks_to_flux_layout_of_the_attention_probabilities():
    """The 4-D masks (B, H, T_query, T_key) -> NNlib's (T_key, T_query, H, B): entry [s, t, h, b] is the harness's
    [b, h, t, s]; back again exactly; the wrong rank or mixed shapes are refused."""
    from harness.core.masks import dropout_masks

    config = _weights()[0].replace(dropout=0.3, attn_dropout=True, batch_size=3, block_size=7, n_layer=2)
    masks = dropout_masks(config, 4, 1)
    fm = masks_to_flux(masks)
    assert list(fm) == list(masks)
    H = config.n_head
    for name in ("h.0.attn.probs", "h.1.attn.probs"):
        m = fm[name]
        assert m.shape == (7, 7, H, 3) and m.dtype == np.bool_ and m.flags.f_contiguous, name
        for s_, t, h, b in ((0, 6, 1, 2), (5, 2, 0, 1), (3, 3, 1, 0)):
            assert m[s_, t, h, b] == masks[name][b, h, t, s_]
        np.testing.assert_array_equal(m, masks[name].transpose(3, 2, 1, 0))
        assert not np.array_equal(m, masks[name].transpose(2, 3, 1, 0))  # query and key are not interchangeable
    assert fm["emb"].shape == (config.n_embd, 7, 3)  # the activation sites as before
    back = masks_from_flux(fm)
    for name, m in masks.items():
        np.testing.assert_array_equal(back[name], m)
        assert back[name].flags.c_contiguous
    with pytest.raises(ValueError, match=r"bool \(B, H, T, T\)"):
        masks_to_flux({"h.0.attn.probs": masks["emb"]})
    with pytest.raises(ValueError, match=r"bool \(B, T, C\)"):
        masks_to_flux({"h.0.attn": masks["h.0.attn.probs"]})
    with pytest.raises(ValueError, match="shape"):
        masks_to_flux({"h.0.attn.probs": masks["h.0.attn.probs"], "h.1.attn.probs": masks["h.1.attn.probs"][:2]})
    with pytest.raises(ValueError, match="unknown dropout mask"):
        masks_to_flux({"h.0.attn.prob": masks["h.0.attn.probs"]})


def _masked_case(T: int = 9, B: int = 2, attn_dropout: bool = False):
    config, w = _weights(n_layer=2)
    config = config.replace(dropout=0.25, attn_dropout=attn_dropout)
    w = _noisy(w)
    rng = np.random.default_rng(4)
    x = rng.integers(0, VOCAB, size=(B, T))
    masks = _harness_masks(config, B, T)
    if attn_dropout:  # the attention masks, drawn as the harness draws them (at this T and B)
        from harness.core.masks import dropout_masks

        drawn = dropout_masks(config.replace(block_size=T, batch_size=B), 6, 0)
        masks.update({k: m for k, m in drawn.items() if k.endswith(".probs")})
    params = {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}
    expected, _ = numpy_gpt.gpt_forward(params, x, config, masks=masks)
    return config, w, x, masks, expected


def test_flux_layout_forward_with_masks_matches_oracle():
    """The masks converted by masks_to_flux, applied where NanoGPTFlux applies them, give the oracle's logits."""
    config, w, x, masks, expected = _masked_case()
    got = logits_from_flux(flux_forward(to_flux(w), tokens_to_flux(x), config.n_layer, config.n_head,
                                        masks_to_flux(masks), config.dropout))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    plain, _ = numpy_gpt.gpt_forward({k: np.asarray(v, dtype=np.float64) for k, v in w.items()}, x, config)
    assert not np.allclose(got, plain, atol=1e-3)  # the masks matter at this size


def test_flux_layout_forward_with_attention_masks_matches_oracle():
    """With attention dropout: the 4-D masks converted by masks_to_flux and applied to NNlib's probabilities (fdrop)
    give the oracle's logits under the same masks; without them the logits differ."""
    config, w, x, masks, expected = _masked_case(attn_dropout=True)
    assert masks["h.1.attn.probs"].shape == (2, config.n_head, 9, 9)
    got = logits_from_flux(flux_forward(to_flux(w), tokens_to_flux(x), config.n_layer, config.n_head,
                                        masks_to_flux(masks), config.dropout))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    three = {k: m for k, m in masks.items() if not k.endswith(".probs")}
    without = logits_from_flux(flux_forward(to_flux(w), tokens_to_flux(x), config.n_layer, config.n_head,
                                            masks_to_flux(three), config.dropout))
    assert not np.allclose(without, expected, atol=1e-3)


@pytest.mark.parametrize("wrong", ["reshape", "time_reversed", "sites_swapped", "scaled_by_p", "query_key_swapped",
                                   "probs_reshaped"])
def test_flux_layout_forward_with_wrong_masks_fails(wrong):
    """A wrong conversion (or wrong scaling) of the same masks is caught by the checks above."""
    config, w, x, masks, expected = _masked_case(attn_dropout=wrong in ("query_key_swapped", "probs_reshaped"))
    fm = masks_to_flux(masks)
    p_drop = config.dropout
    if wrong == "reshape":  # the same bits in the Flux shape, without the transpose
        fm = {k: np.asfortranarray(m.reshape(fm[k].shape)) for k, m in masks.items()}
    elif wrong == "time_reversed":
        fm = {k: np.asfortranarray(m[:, ::-1, :]) for k, m in fm.items()}
    elif wrong == "sites_swapped":
        fm = {**fm, "h.0.attn": fm["h.0.mlp"], "h.0.mlp": fm["h.0.attn"]}
    elif wrong == "scaled_by_p":
        p_drop = 1 - config.dropout  # x * keep / p instead of / (1 - p)
    elif wrong == "query_key_swapped":  # (T_query, T_key, H, B): the key and query axes exchanged
        fm = {**fm, **{k: np.asfortranarray(m.transpose(2, 3, 1, 0)) for k, m in masks.items() if k.endswith("probs")}}
    elif wrong == "probs_reshaped":  # the same bits in NNlib's shape, without the permutation
        fm = {**fm, **{k: np.asfortranarray(m.reshape(fm[k].shape)) for k, m in masks.items() if k.endswith("probs")}}
    got = logits_from_flux(flux_forward(to_flux(w), tokens_to_flux(x), config.n_layer, config.n_head, fm, p_drop))
    assert not np.allclose(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("n_layer", [1, 2])
def test_taps_from_flux_give_the_oracles_taps(n_layer):
    """NanoGPTFlux's taps (src/taps.jl, emulated in the Flux layout above), converted by taps_from_flux, are the
    oracle's taps: every name of harness.core.taps, its canonical shape and values."""
    from harness.backends.flux_layout import taps_from_flux, taps_to_flux
    from harness.core.taps import tap_names, tap_shapes

    config, w = _weights(n_layer=n_layer)
    config = config.replace(dropout=0.0)
    w = _noisy(w)
    x = np.random.default_rng(2).integers(0, VOCAB, size=(3, 11))
    flux_taps: dict[str, np.ndarray] = {}
    flux_forward(to_flux(w), tokens_to_flux(x), config.n_layer, config.n_head, taps=flux_taps)
    assert list(flux_taps) == tap_names(n_layer) or set(flux_taps) == set(tap_names(n_layer))
    got = taps_from_flux(flux_taps)
    oracle: dict[str, np.ndarray] = {}
    numpy_gpt.gpt_forward({k: np.asarray(v, dtype=np.float64) for k, v in w.items()}, x, config, taps=oracle)
    shapes = tap_shapes(config.replace(block_size=11), VOCAB, rows=3)
    for name, value in oracle.items():
        assert got[name].shape == value.shape == shapes[name], name
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-12, err_msg=name)  # both float64
        back = taps_to_flux({name: value})[name]
        assert back.shape == flux_taps[name].shape and back.flags.f_contiguous, name
    assert flux_taps["h.0.attn.probs"].shape == (11, 11, config.n_head, 3)  # NNlib: (key, query, head, batch)
    assert flux_taps["h.0.attn.q"].shape == (config.n_embd // config.n_head, config.n_head, 11, 3)
    with pytest.raises(ValueError, match="4-D"):
        taps_from_flux({"h.0.attn.k": np.zeros((3, 4, 5))})
