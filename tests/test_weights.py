"""Canonical names, shapes and GPT-2 initialisation."""

from __future__ import annotations

import math

import numpy as np

from harness.config.load import load_config
from harness.core.weights import count_parameters, decays, fingerprint, init_weights, param_shapes


def test_shapes_and_count_small():
    c = load_config("small")
    shapes = param_shapes(c, 65)
    d, dh, V, n = 16, 64, 65, 64
    # counted by hand: embeddings, one block (2 LN, qkv, proj, fc, proj), final LN, lm_head with bias
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (dh * d + dh) + (d * dh + d)
    total = V * d + n * d + per_block + 2 * d + V * d + V
    assert count_parameters(c, V) == sum(math.prod(s) for s in shapes.values()) == total
    assert count_parameters(c, V, embeddings=False) == total - V * d - n * d
    assert shapes["h.0.attn.c_attn.weight"] == (3 * d, d)  # PyTorch Linear layout (out, in)
    assert shapes["lm_head.weight"] == (V, d) and shapes["wpe.weight"] == (n, d)
    assert len([k for k in shapes if k.startswith("h.")]) == 12 * c.n_layer


def test_gpt2_initialisation_statistics():
    c = load_config("large")
    w = init_weights(c, 65, seed=0)
    assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in w.values())
    assert abs(w["h.0.attn.c_attn.weight"].std() - 0.02) < 0.001
    assert abs(w["h.0.mlp.c_fc.weight"].std() - 0.02) < 0.001
    resid = np.concatenate([w[f"h.{i}.mlp.c_proj.weight"].ravel() for i in range(4)])
    assert abs(resid.std() - 0.02 / math.sqrt(2 * 4)) < 0.0005
    assert np.all(w["ln_f.weight"] == 1) and np.all(w["h.3.ln_2.bias"] == 0)
    assert np.all(w["lm_head.bias"] == 0) and np.all(w["h.0.attn.c_attn.bias"] == 0)


def test_seeded_and_fingerprinted():
    c = load_config("small")
    a, b, other = init_weights(c, 65, 1), init_weights(c, 65, 1), init_weights(c, 65, 2)
    assert fingerprint(a) == fingerprint(b) != fingerprint(other)
    b["ln_f.bias"][0] = np.nextafter(np.float32(0), np.float32(1))  # one ulp anywhere changes it
    assert fingerprint(a) != fingerprint(b)


def test_decay_only_matrices():
    shapes = param_shapes(load_config("small"), 65)
    decayed = {k for k, s in shapes.items() if decays(k, s)}
    assert "wte.weight" in decayed and "h.0.mlp.c_fc.weight" in decayed
    assert not any(k.endswith(".bias") or ".ln_" in k or k.startswith("ln_") for k in decayed)
