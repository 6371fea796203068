"""The NumPy reference's hand-written backward against central finite differences, and its AdamW and clipping
against independent hand computations and torch.

Relative errors are norm-wise per parameter: ||analytic - numeric|| / max(||analytic||, ||numeric||).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.config.fields import Config
from harness.config.load import load_config
from harness.core.weights import decays, init_weights
from harness.models import numpy_gpt as ng

VOCAB = 7
H = 1e-5  # central differences: truncation error O(H^2), rounding error O(1e-16 / H)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Norm-wise relative error."""
    scale = max(np.linalg.norm(a), np.linalg.norm(b))
    return 0.0 if scale == 0 else float(np.linalg.norm(a - b) / scale)


def numeric_grad(f, x: np.ndarray, dout: np.ndarray | None = None, entries: np.ndarray | None = None) -> np.ndarray:
    """Central finite differences of sum(f() * dout) (or scalar f()) with respect to x, perturbed in place.

    `entries`: flat indices to differentiate (others left 0); all by default.
    """
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in (range(x.size) if entries is None else entries):
        old = flat[i]
        flat[i] = old + H
        fp = f()
        flat[i] = old - H
        fm = f()
        flat[i] = old
        if dout is not None:
            fp, fm = np.sum(fp * dout), np.sum(fm * dout)
        gflat[i] = (fp - fm) / (2 * H)
    return grad


def tiny_config(dropout: float = 0.0) -> Config:
    return load_config("small").replace(n_embd=8, n_head=2, n_layer=2, d_hidden=12, block_size=6, batch_size=2,
                                        dropout=dropout)


def tiny_params(config: Config, seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-2 initial weights in float64, with LayerNorm gains/biases and all biases perturbed (non-trivial grads)."""
    rng = np.random.default_rng(seed + 100)
    params = {k: v.astype(np.float64) for k, v in init_weights(config, VOCAB, seed).items()}
    for name, p in params.items():
        if name.endswith(".bias") or ".ln_" in name or name.startswith("ln_"):
            p += 0.1 * rng.standard_normal(p.shape)
        else:
            p *= 10.0  # larger weights: larger, less uniform activations, a sharper test
    return params


@pytest.fixture(autouse=True)
def _cpu() -> None:
    ng.use_device("cpu")


# ------------------------------------------------------------------------------------------ whole model


def check_model_gradients(config: Config, rng_seed: int | None = None,
                          masks: dict[str, np.ndarray] | None = None) -> float:
    """The whole model's gradients against central differences of its loss, every entry of every parameter; the
    dropout masks fixed: drawn from a fresh generator seeded `rng_seed` at every evaluation, or `masks` given.
    Returns the worst per-parameter relative error (each must be <= 1e-6)."""
    params = tiny_params(config)
    data = np.random.default_rng(0)
    x = data.integers(0, VOCAB, (2, 6))
    y = data.integers(0, VOCAB, (2, 6))

    def rng() -> np.random.Generator | None:
        # a fresh generator with one seed per evaluation: the same dropout masks every time
        return None if rng_seed is None else np.random.default_rng(rng_seed)

    _, grads = ng.loss_and_gradients(params, x, y, config, rng(), masks)
    assert set(grads) == set(params)

    def loss() -> float:
        return float(ng.loss_only(params, x, y, config, rng(), masks))

    worst = 0.0
    for name, p in params.items():
        assert grads[name].shape == p.shape and grads[name].dtype == np.float64
        num = numeric_grad(loss, p)
        if name.endswith("attn.c_attn.bias"):
            # the key bias adds q.b_k to every score of a query: softmax ignores it, its gradient is exactly 0
            C = config.n_embd
            key = slice(C, 2 * C)
            assert np.abs(grads[name][key]).max() < 1e-12 and np.abs(num[key]).max() < 1e-9
            grads[name][key] = num[key] = 0.0
        err = rel_err(grads[name], num)
        worst = max(worst, err)
        assert err <= 1e-6, f"{name}: relative error {err:.2e}"
    return worst


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_model_gradients_match_finite_differences(dropout: float) -> None:
    worst = check_model_gradients(tiny_config(dropout), 7 if dropout else None)
    print(f"dropout={dropout}: worst per-parameter relative error {worst:.2e}")


@pytest.mark.parametrize("given", [True, False], ids=["harness-masks", "own-rng"])
def test_model_gradients_with_attention_dropout_match_finite_differences(given: bool) -> None:
    """nanoGPT's fourth dropout site, on the attention probabilities: the backward through it (d probs = d dropped
    * keep / (1 - p), then the softmax backward) matches finite differences, with the harness's masks (parity) and
    with the oracle's own generator."""
    from harness.core.masks import dropout_masks

    config = tiny_config(0.3).replace(attn_dropout=True)
    masks = dropout_masks(config, 5, 0) if given else None
    if given:
        assert masks["h.1.attn.probs"].shape == (2, 2, 6, 6) and not masks["h.1.attn.probs"].all()
    worst = check_model_gradients(config, None if given else 7, masks)
    print(f"attention dropout ({'masks given' if given else 'own rng'}): worst relative error {worst:.2e}")


def test_attention_dropout_changes_the_gradient() -> None:
    """The attention-probability masks do enter the loss and the gradient (the test above is not vacuous), and
    without attn_dropout they are not applied."""
    from harness.core.masks import dropout_masks

    config = tiny_config(0.3).replace(attn_dropout=True)
    params = tiny_params(config)
    x = np.random.default_rng(0).integers(0, VOCAB, (2, 6))
    masks = dropout_masks(config, 5, 0)
    three = {k: m for k, m in masks.items() if not k.endswith(".probs")}
    g_all = ng.loss_and_gradients(params, x, x, config, masks=masks)[1]
    g_three = ng.loss_and_gradients(params, x, x, config.replace(attn_dropout=False), masks=three)[1]
    assert rel_err(g_all["h.0.attn.c_attn.weight"], g_three["h.0.attn.c_attn.weight"]) > 1e-3
    g_off = ng.loss_and_gradients(params, x, x, config.replace(attn_dropout=False), masks=masks)[1]
    assert all(np.array_equal(g_off[k], g_three[k]) for k in g_off)  # option off: the probs masks are not read


def test_dropout_changes_the_gradient() -> None:
    """With p > 0 the masks do enter the gradient (the test above is not vacuous)."""
    config = tiny_config(0.3)
    params = tiny_params(config)
    x = np.random.default_rng(0).integers(0, VOCAB, (2, 6))
    g0 = ng.loss_and_gradients(params, x, x, config)[1]
    g1 = ng.loss_and_gradients(params, x, x, config, np.random.default_rng(7))[1]
    assert rel_err(g0["wte.weight"], g1["wte.weight"]) > 1e-3


# ------------------------------------------------------------------------------------------ single layers


def check_layer(forward, backward, inputs: list[np.ndarray], seed: int = 0, tol: float = 1e-7) -> None:
    """For each input, backward's gradient of sum(out * dout) matches finite differences."""
    out, cache = forward(*inputs)
    dout = np.random.default_rng(seed).standard_normal(out.shape)
    grads = backward(dout.copy(), cache)
    grads = grads if isinstance(grads, tuple) else (grads,)
    assert len(grads) == len(inputs)
    for i, (a, inp) in enumerate(zip(grads, inputs, strict=True)):
        num = numeric_grad(lambda: forward(*inputs)[0], inp, dout)
        err = rel_err(a, num)
        assert err <= tol, f"input {i}: relative error {err:.2e}"


def test_layernorm_backward() -> None:
    rng = np.random.default_rng(1)
    x = 3.0 * rng.standard_normal((2, 3, 5)) + 1.0
    check_layer(ng.layernorm_forward, ng.layernorm_backward,
                [x, 1 + 0.5 * rng.standard_normal(5), rng.standard_normal(5)])


def test_layernorm_forward_matches_definition() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 6))
    out, _ = ng.layernorm_forward(x, np.ones(6), np.zeros(6))
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)  # np.var is biased
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-14)


def test_gelu_backward_and_form() -> None:
    x = np.linspace(-5, 5, 41).reshape(1, 41)
    check_layer(ng.gelu_forward, ng.gelu_backward, [x])
    want = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(ng.gelu_forward(x)[0], want, rtol=0, atol=1e-15)


def test_linear_backward() -> None:
    rng = np.random.default_rng(3)
    check_layer(ng.linear_forward, ng.linear_backward,
                [rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4)), rng.standard_normal(5)])


def test_causal_attention_core_backward() -> None:
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 2, 5, 3)) for _ in range(3))
    check_layer(ng.causal_attention_forward, ng.causal_attention_backward, [q, k, v])


def test_causal_attention_core_backward_with_dropout_on_the_probabilities() -> None:
    """The core with a given keep-mask on the probabilities (deterministic), and with p = 0 the plain core."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 2, 5, 3)) for _ in range(3))
    keep = rng.random((2, 2, 5, 5)) >= 0.3

    def forward(q, k, v):
        return ng.causal_attention_forward(q, k, v, 0.3, None, keep)

    check_layer(forward, ng.causal_attention_backward, [q, k, v])
    out, cache = forward(q, k, v)
    probs, dropped = cache[3], cache[5]
    np.testing.assert_allclose(dropped, probs * keep / 0.7, rtol=1e-15)  # probs * keep / (1 - p)
    np.testing.assert_allclose(out, dropped @ v, rtol=1e-15)
    plain, _ = ng.causal_attention_forward(q, k, v)
    np.testing.assert_array_equal(ng.causal_attention_forward(q, k, v, 0.3, None)[0], plain)  # no rng, no mask


def test_attention_layer_backward() -> None:
    rng = np.random.default_rng(5)
    C = 6

    def forward(x, wa, ba, wp, bp):
        return ng.attention_forward(x, wa, ba, wp, bp, n_head=3)

    inputs = [rng.standard_normal((2, 4, C)), 0.5 * rng.standard_normal((3 * C, C)), rng.standard_normal(3 * C),
              0.5 * rng.standard_normal((C, C)), rng.standard_normal(C)]
    out, cache = forward(*inputs)
    dout = rng.standard_normal(out.shape)
    grads = ng.attention_backward(dout, cache)
    for i, (a, inp) in enumerate(zip(grads, inputs, strict=True)):
        num = numeric_grad(lambda: forward(*inputs)[0], inp, dout)
        if i == 2:  # key bias: exactly zero gradient (see above)
            assert np.abs(a[C:2 * C]).max() < 1e-12
            a[C:2 * C] = num[C:2 * C] = 0.0
        assert rel_err(a, num) <= 1e-7, f"input {i}"


def test_attention_is_causal() -> None:
    """Changing a later position leaves the outputs at earlier positions unchanged."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 2, 5, 3)) for _ in range(3))
    out1, _ = ng.causal_attention_forward(q, k, v)
    k2, v2 = k.copy(), v.copy()
    k2[..., 3:, :] += 1.0
    v2[..., 3:, :] -= 2.0
    out2, _ = ng.causal_attention_forward(q, k2, v2)
    np.testing.assert_array_equal(out1[..., :3, :], out2[..., :3, :])
    assert not np.allclose(out1[..., 3:, :], out2[..., 3:, :])


def test_cross_entropy_backward_and_value() -> None:
    rng = np.random.default_rng(7)
    logits = 3 * rng.standard_normal((2, 3, 5))
    targets = rng.integers(0, 5, (2, 3))
    loss, cache = ng.cross_entropy_forward(logits, targets)
    z = logits.reshape(-1, 5)
    want = np.mean(np.log(np.exp(z).sum(-1)) - z[np.arange(6), targets.reshape(-1)])
    assert abs(float(loss) - want) < 1e-14
    grad = ng.cross_entropy_backward(1.0, cache)
    num = numeric_grad(lambda: float(ng.cross_entropy_forward(logits, targets)[0]), logits)
    assert rel_err(grad, num) <= 1e-8
    # stable: huge logits neither overflow nor lose the answer
    big, _ = ng.cross_entropy_forward(np.array([[[1000.0, 0.0]]]), np.array([[1]]))
    assert abs(float(big) - 1000.0) < 1e-9


def test_embedding_backward_accumulates_repeated_tokens() -> None:
    rng = np.random.default_rng(8)
    idx = np.array([[1, 1, 3], [1, 0, 3]])
    wte, wpe = rng.standard_normal((4, 2)), rng.standard_normal((5, 2))
    out, cache = ng.embedding_forward(idx, wte, wpe)
    dout = rng.standard_normal(out.shape)
    dwte, dwpe = ng.embedding_backward(dout, cache)
    assert rel_err(dwte, numeric_grad(lambda: ng.embedding_forward(idx, wte, wpe)[0], wte, dout)) <= 1e-9
    assert rel_err(dwpe, numeric_grad(lambda: ng.embedding_forward(idx, wte, wpe)[0], wpe, dout)) <= 1e-9
    assert np.all(dwpe[3:] == 0) and np.all(dwte[2] == 0)


# ------------------------------------------------------------------------------------------ dropout


def test_dropout_scale_and_eval_determinism() -> None:
    x = np.full((400, 500), 2.0)
    out, mask = ng.dropout_forward(x, 0.2, np.random.default_rng(0))
    assert abs(out.mean() - 2.0) < 0.01  # inverted dropout keeps the expectation
    assert abs((out == 0).mean() - 0.2) < 0.005
    np.testing.assert_allclose(out[out != 0], 2.0 / 0.8, rtol=1e-15)
    np.testing.assert_array_equal(ng.dropout_backward(np.ones_like(x), mask), mask)
    assert ng.dropout_forward(x, 0.2, None)[0] is x  # evaluation: identity

    config = tiny_config(0.2)
    params = tiny_params(config)
    idx = np.random.default_rng(1).integers(0, VOCAB, (2, 6))
    eval1, eval2 = ng.gpt_forward(params, idx, config)[0], ng.gpt_forward(params, idx, config)[0]
    np.testing.assert_array_equal(eval1, eval2)
    train1 = ng.gpt_forward(params, idx, config, np.random.default_rng(3))[0]
    train2 = ng.gpt_forward(params, idx, config, np.random.default_rng(4))[0]
    assert not np.allclose(train1, eval1) and not np.allclose(train1, train2)


# ------------------------------------------------------------------------------------------ optimizer


def test_adamw_matches_hand_computation() -> None:
    rng = np.random.default_rng(9)
    w0, b0 = rng.standard_normal((3, 2)), rng.standard_normal(3)
    grads_seq = [{"w": rng.standard_normal((3, 2)), "b": rng.standard_normal(3)} for _ in range(3)]
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-8, 0.1
    params = {"w": w0.copy(), "b": b0.copy()}
    opt = ng.AdamW(params, betas=(b1, b2), eps=eps, weight_decay=wd)
    for g in grads_seq:
        opt.step(params, {k: v.copy() for k, v in g.items()}, lr)

    # independent textbook AdamW (Loshchilov & Hutter, torch's placement of the decay), written out
    for name, p0 in (("w", w0), ("b", b0)):
        p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
        for t, g in enumerate(grads_seq, start=1):
            if p.ndim >= 2:
                p = p - lr * wd * p
            m = b1 * m + (1 - b1) * g[name]
            v = b2 * v + (1 - b2) * g[name] ** 2
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
        np.testing.assert_allclose(params[name], p, rtol=1e-14, atol=1e-15)
    assert opt.t == 3


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_adamw_matches_torch(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    shapes = {"w": (4, 3), "emb": (5, 3), "b": (4,), "gain": (3,)}
    init = {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}
    grads_seq = [{k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()} for _ in range(5)]
    lr, wd = 0.01, 0.1

    params = {k: v.copy() for k, v in init.items()}
    opt = ng.AdamW(params, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    tparams = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    groups = [{"params": [p for k, p in tparams.items() if decays(k, p.shape)], "weight_decay": wd},
              {"params": [p for k, p in tparams.items() if not decays(k, p.shape)], "weight_decay": 0.0}]
    topt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    for g in grads_seq:
        opt.step(params, {k: v.copy() for k, v in g.items()}, lr)
        for k, p in tparams.items():
            p.grad = torch.tensor(g[k])
        topt.step()
    for k in shapes:
        got, want = params[k], tparams[k].detach().numpy()
        assert got.dtype == np.dtype(dtype)
        diff = np.abs(got.astype(np.float64) - want).max()
        assert diff <= (1e-15 if dtype == "float64" else 2e-7), f"{k}: {diff:.2e}"


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_matches_torch(max_norm: float) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    grads = {"a": rng.standard_normal((4, 3)), "b": rng.standard_normal(7), "c": rng.standard_normal((2, 2, 2))}
    tparams = [torch.zeros(g.shape, dtype=torch.float64, requires_grad=True) for g in grads.values()]
    for p, g in zip(tparams, grads.values(), strict=True):
        p.grad = torch.tensor(g)
    want_total = float(torch.nn.utils.clip_grad_norm_(tparams, max_norm))
    total = float(ng.clip_grad_norm(grads, max_norm))
    assert abs(total - want_total) <= 1e-14 * want_total
    for p, g in zip(tparams, grads.values(), strict=True):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-15, atol=0)
    norm_after = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    assert norm_after <= max_norm + 1e-9
