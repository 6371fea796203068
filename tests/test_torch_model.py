"""The PyTorch nanoGPT: causality, initial loss, learning, canonical weights and optimizer groups."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from harness.backends.torch_backend import TorchBackend  # noqa: E402
from harness.config.load import load_config  # noqa: E402
from harness.core.data import BatchStream  # noqa: E402
from harness.core.weights import init_weights  # noqa: E402


def make(config, vocab=65, seed=0, dtype="float32"):
    backend = TorchBackend(dtype=dtype)
    backend.setup(config, init_weights(config, vocab, seed), vocab, "cpu", seed)
    return backend


def test_causal_masking():
    """Changing future tokens never changes earlier logits."""
    c = load_config("small").replace(dropout=0.0)
    b = make(c, dtype="float64")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 65, (2, 64))
    base = b.logits(x)
    for t in (0, 10, 63):
        x2 = x.copy()
        x2[:, t:] = rng.integers(0, 65, (2, 64 - t))
        changed = b.logits(x2)
        assert np.array_equal(base[:, :t], changed[:, :t])
        if t < 63:
            assert not np.allclose(base[:, t:], changed[:, t:])


def test_initial_loss_is_log_vocab(corpus):
    c = load_config("medium")
    b = make(c, corpus.vocab_size)
    x, y = BatchStream(corpus.train, c.block_size, c.batch_size, 0).batch(0)
    assert abs(b.eval_loss(x, y) - math.log(corpus.vocab_size)) < 0.05


def test_training_lowers_loss(corpus):
    c = load_config("small")
    b = make(c, corpus.vocab_size)
    stream = BatchStream(corpus.train, c.block_size, c.batch_size, 0)
    x0, y0 = stream.batch(10_000)  # held out from the 150 training steps
    before = b.eval_loss(x0, y0)
    for step in range(150):
        b.train_step(*stream.batch(step), c.learning_rate)
    assert b.eval_loss(x0, y0) < before - 1.0


def test_weights_round_trip_and_gradient_names():
    c = load_config("small")
    w = init_weights(c, 65, 3)
    b = make(c, 65, 3)
    params = b.parameters()
    assert params.keys() == w.keys() and all(np.array_equal(params[k], w[k]) for k in w)
    x = np.random.default_rng(1).integers(0, 65, (4, 64))
    grads = b.gradients(x, np.roll(x, -1, axis=1))
    assert grads.keys() == w.keys() and all(grads[k].shape == w[k].shape for k in w)
    assert all(np.array_equal(b.parameters()[k], w[k]) for k in w)  # gradients() does not update


def test_weight_decay_only_on_matrices():
    """With a zero gradient AdamW's update is the decay alone: matrices shrink by lr*wd, vectors stay."""
    c = load_config("small").replace(dropout=0.0, grad_clip=0.0)
    b = make(c, 65, 4, dtype="float64")
    w = b.parameters()
    for p in b.model.parameters():
        p.grad = torch.zeros_like(p)
    b.optimizer.step()
    after = b.parameters()
    lr, wd = c.learning_rate, c.weight_decay
    assert np.allclose(after["h.0.mlp.c_fc.weight"], w["h.0.mlp.c_fc.weight"] * (1 - lr * wd), rtol=0, atol=1e-15)
    assert np.array_equal(after["ln_f.weight"], w["ln_f.weight"])


def test_checkpoint_state_restores_exactly():
    c = load_config("small")  # dropout on: the RNG state is part of the checkpoint
    rng = np.random.default_rng(2)
    batches = [(x, np.roll(x, -1, 1)) for x in rng.integers(0, 65, (6, 16, 64))]
    a = make(c, 65, 5)
    for x, y in batches[:3]:
        a.train_step(x, y, 0.01)
    state = a.state_dict()
    rest_a = [a.train_step(x, y, 0.01) for x, y in batches[3:]]
    b = make(c, 65, 99)  # different weights, overwritten by the state
    b.load_state_dict(state)
    rest_b = [b.train_step(x, y, 0.01) for x, y in batches[3:]]
    assert rest_a == rest_b
