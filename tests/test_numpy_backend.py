"""NumpyBackend against an independent plain-autograd torch nanoGPT (written here, not the torch backend) on the
same canonical weights, plus the backend's protocol details: dtypes, errors, checkpoints.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness.backends.base import Backend, BackendUnavailable
from harness.backends.numpy_backend import NumpyBackend
from harness.config.fields import Config
from harness.config.load import load_config
from harness.core.weights import decays, init_weights, param_shapes
from harness.errors import UsageError

torch = pytest.importorskip("torch")
F = torch.nn.functional

VOCAB = 65
SEED = 0


# ------------------------------------------------------------------------------------------ torch reference


def torch_logits(p: dict[str, torch.Tensor], idx: torch.Tensor, config: Config) -> torch.Tensor:
    """A compact functional torch nanoGPT on canonical parameters (dropout 0)."""
    B, T = idx.shape
    C, nh = config.n_embd, config.n_head
    x = p["wte.weight"][idx] + p["wpe.weight"][:T]
    for i in range(config.n_layer):
        def q(name: str, i: int = i) -> torch.Tensor:
            return p[f"h.{i}.{name}"]

        h = F.layer_norm(x, (C,), q("ln_1.weight"), q("ln_1.bias"), eps=1e-5)
        qs, ks, vs = F.linear(h, q("attn.c_attn.weight"), q("attn.c_attn.bias")).split(C, dim=-1)
        qs, ks, vs = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (qs, ks, vs))
        y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + F.linear(y, q("attn.c_proj.weight"), q("attn.c_proj.bias"))
        h = F.layer_norm(x, (C,), q("ln_2.weight"), q("ln_2.bias"), eps=1e-5)
        h = F.gelu(F.linear(h, q("mlp.c_fc.weight"), q("mlp.c_fc.bias")), approximate="tanh")
        x = x + F.linear(h, q("mlp.c_proj.weight"), q("mlp.c_proj.bias"))
    x = F.layer_norm(x, (C,), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5)
    return F.linear(x, p["lm_head.weight"], p["lm_head.bias"])


def torch_loss(p: dict[str, torch.Tensor], x: np.ndarray, y: np.ndarray, config: Config) -> torch.Tensor:
    logits = torch_logits(p, torch.from_numpy(x), config)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y).reshape(-1))


def torch_params(weights: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in weights.items()}


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def config() -> Config:
    return load_config("small").replace(dropout=0.0)


@pytest.fixture(scope="module")
def weights(config: Config) -> dict[str, np.ndarray]:
    return init_weights(config, VOCAB, SEED)


def batch(config: Config, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (config.batch_size, config.block_size)
    return rng.integers(0, VOCAB, shape), rng.integers(0, VOCAB, shape)


def make_backend(config: Config, weights: dict[str, np.ndarray], dtype: str = "float64",
                 seed: int = 1) -> NumpyBackend:
    backend = NumpyBackend(dtype)
    backend.setup(config, weights, VOCAB, "cpu", seed)
    return backend


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    scale = max(np.linalg.norm(a), np.linalg.norm(b))
    return 0.0 if scale == 0 else float(np.linalg.norm(a - b) / scale)


# ------------------------------------------------------------------------------------------ parity with torch


def test_logits_match_torch(config: Config, weights: dict[str, np.ndarray]) -> None:
    x, _ = batch(config, 0)
    got = make_backend(config, weights).logits(x)
    with torch.no_grad():
        want = torch_logits(torch_params(weights), torch.from_numpy(x), config).numpy()
    assert got.shape == (config.batch_size, config.block_size, VOCAB) and got.dtype == np.float64
    diff = np.abs(got - want).max()
    print(f"logits max abs diff {diff:.2e}")
    assert diff <= 1e-10


def test_gradients_match_torch(config: Config, weights: dict[str, np.ndarray]) -> None:
    x, y = batch(config, 1)
    backend = make_backend(config, weights)
    got = backend.gradients(x, y)
    tp = torch_params(weights)
    loss = torch_loss(tp, x, y, config)
    loss.backward()
    assert abs(backend.eval_loss(x, y) - loss.item()) <= 1e-12
    worst = 0.0
    for name, p in tp.items():
        want = p.grad.numpy()
        assert got[name].shape == want.shape
        a, b = got[name].copy(), want.copy()
        if name.endswith("attn.c_attn.bias"):
            # the key bias's gradient is mathematically 0 (softmax ignores a per-query constant): compare the
            # rounding noise absolutely, the query and value parts relatively
            key = slice(config.n_embd, 2 * config.n_embd)
            assert np.abs(a[key] - b[key]).max() <= 1e-15
            a[key] = b[key] = 0.0
        err = rel_err(a, b)
        worst = max(worst, err)
        assert err <= 1e-9, f"{name}: relative error {err:.2e}"
    print(f"gradients: worst relative error {worst:.2e}")
    # gradients() must not have changed the parameters
    for name, w in weights.items():
        np.testing.assert_array_equal(backend.parameters()[name], w.astype(np.float64))


@pytest.mark.parametrize("grad_clip", [1.0, 0.05, 0.0])
def test_training_losses_match_torch_adamw(config: Config, weights: dict[str, np.ndarray], grad_clip: float) -> None:
    """5 steps of forward, backward, global-norm clipping and AdamW (decay on 2-D tensors only).

    The initial gradient norm is about 0.22: the preset's clip 1.0 leaves it alone, 0.05 engages, 0 disables.
    """
    config = config.replace(grad_clip=grad_clip)
    lr = config.learning_rate
    backend = make_backend(config, weights)
    tp = torch_params(weights)
    groups = [{"params": [p for k, p in tp.items() if decays(k, tuple(p.shape))], "weight_decay": config.weight_decay},
              {"params": [p for k, p in tp.items() if not decays(k, tuple(p.shape))], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(config.beta1, config.beta2), eps=config.eps)
    ours, theirs = [], []
    for step in range(5):
        x, y = batch(config, 10 + step)
        ours.append(backend.train_step(x, y, lr))
        opt.zero_grad()
        loss = torch_loss(tp, x, y, config)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(list(tp.values()), grad_clip)
        opt.step()
        theirs.append(loss.item())
    assert all(isinstance(v, float) for v in ours)
    diff = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
    params = backend.parameters()
    pdiff = max(np.abs(params[k] - p.detach().numpy()).max() for k, p in tp.items())
    print(f"grad_clip={grad_clip}: 5-step losses max abs diff {diff:.2e}; "
          f"parameters after 5 steps max abs diff {pdiff:.2e}")
    assert diff <= 1e-9
    assert pdiff <= 1e-9
    assert ours[-1] < ours[0]


def test_float32_path(config: Config, weights: dict[str, np.ndarray]) -> None:
    x, y = batch(config, 2)
    b32, b64 = make_backend(config, weights, "float32"), make_backend(config, weights)
    assert b32.logits(x).dtype == np.float32
    grads = b32.gradients(x, y)
    assert all(g.dtype == np.float32 for g in grads.values())
    g64 = b64.gradients(x, y)
    worst = max(rel_err(grads[k].astype(np.float64), g64[k]) for k in g64 if not k.endswith("c_attn.bias"))
    assert worst <= 1e-4
    assert np.abs(b32.logits(x) - b64.logits(x)).max() <= 1e-5
    l32 = [b32.train_step(x, y, 0.01) for _ in range(3)]
    l64 = [b64.train_step(x, y, 0.01) for _ in range(3)]
    assert max(abs(a - b) for a, b in zip(l32, l64, strict=True)) <= 1e-4
    state = b32.state_dict()
    assert all(v.dtype == np.float32 for k, v in state.items() if k.startswith(("param/", "adam_")) and k != "adam_t")
    print(f"float32 vs float64: gradient rel err {worst:.2e}")


# ------------------------------------------------------------------------------------------ protocol


def test_protocol_and_describe(config: Config, weights: dict[str, np.ndarray]) -> None:
    backend = make_backend(config, weights)
    assert isinstance(backend, Backend)
    assert backend.name == "numpy"
    info = backend.describe()
    assert info["framework"] == "numpy" and info["version"] == np.__version__
    assert info["device"] == "cpu" and info["dtype"] == "float64" and info["device_name"]
    mem = backend.memory()
    assert mem["kind"] == "rss" and mem["peak_bytes"] > 10 * 2**20
    params = backend.parameters()
    assert {k: v.shape for k, v in params.items()} == param_shapes(config, VOCAB)
    params["wte.weight"][:] = 0  # a copy: the model is untouched
    assert np.any(backend.parameters()["wte.weight"] != 0)
    assert backend.losses_to_floats([1.5, np.float64(2.0)]) == [1.5, 2.0]
    backend.synchronize()


def test_errors() -> None:
    with pytest.raises(UsageError, match="dtype must be float64 or float32"):
        NumpyBackend("float16")
    NumpyBackend.check_available("cpu")
    with pytest.raises(BackendUnavailable):
        NumpyBackend.check_available("tpu")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match="CuPy"):
            NumpyBackend.check_available("cuda")
        with pytest.raises(BackendUnavailable, match="CuPy"):
            NumpyBackend().setup(load_config("small"), {}, VOCAB, "cuda", 0)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_state_dict_resume_is_exact(config: Config, weights: dict[str, np.ndarray], dropout: float) -> None:
    cfg = config.replace(dropout=dropout, batch_size=4, block_size=32)
    w = init_weights(cfg, VOCAB, SEED)
    batches = [batch(cfg, 20 + i) for i in range(6)]
    a = make_backend(cfg, w, seed=5)
    for x, y in batches[:3]:
        a.train_step(x, y, 0.01)
    state = {k: v.copy() for k, v in a.state_dict().items()}
    assert state["adam_t"].shape == () and state["adam_t"].dtype == np.int64 and int(state["adam_t"]) == 3
    continued = [a.train_step(x, y, 0.01) for x, y in batches[3:]]

    b = make_backend(cfg, w, seed=99)  # a different dropout seed: the checkpoint's RNG state must win
    b.load_state_dict(state)
    resumed = [b.train_step(x, y, 0.01) for x, y in batches[3:]]
    assert resumed == continued
    for k, v in a.parameters().items():
        np.testing.assert_array_equal(b.parameters()[k], v)
