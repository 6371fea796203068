"""The NumPy-oracle fixture that NanoGPTFlux's Julia tests read (julia/NanoGPTFlux/test/fixture.txt).

Julia cannot run here, so these tests check the Python half: the committed file is exactly what its generator
(make_fixture.py) produces from the oracle today (so it cannot go stale), it is small, its arrays are in the
Flux layout, and the mask replay the generator relies on reproduces the given masks in the oracle.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from harness.backends.flux_layout import masks_to_flux, to_flux
from harness.core.weights import decays

TEST_DIR = Path(__file__).resolve().parent.parent / "julia" / "NanoGPTFlux" / "test"


def _generator():
    spec = importlib.util.spec_from_file_location("make_fixture", TEST_DIR / "make_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_fixture = _generator()


def _differences(text_a: str, text_b: str, rtol: float = 1e-10) -> list[str]:
    """What differs between two fixture texts: config lines exactly, numbers to `rtol` (13 digits are written)."""
    cfg_a, sc_a, ar_a = make_fixture.parse(text_a)
    cfg_b, sc_b, ar_b = make_fixture.parse(text_b)
    out = []
    if cfg_a != cfg_b:
        out.append(f"config {cfg_a} != {cfg_b}")
    if set(sc_a) != set(sc_b) or set(ar_a) != set(ar_b):
        out.append(f"names differ: {set(sc_a) ^ set(sc_b)} {set(ar_a) ^ set(ar_b)}")
        return out
    out += [f"scalar {k}" for k in sc_a if not np.isclose(sc_a[k], sc_b[k], rtol=rtol, atol=0)]
    for k, a in ar_a.items():
        b = ar_b[k]
        if a.shape != b.shape or not np.allclose(a, b, rtol=rtol, atol=1e-15):
            out.append(f"array {k}")
    return out


@pytest.fixture(scope="module")
def fresh() -> str:
    return make_fixture.render()


def test_committed_fixture_is_what_the_generator_writes(fresh: str):
    committed = (TEST_DIR / "fixture.txt").read_text(encoding="utf-8")
    assert not _differences(committed, fresh), (
        "julia/NanoGPTFlux/test/fixture.txt is stale: run `python julia/NanoGPTFlux/test/make_fixture.py`")
    assert len(committed.encode()) < 140_000  # with the options and attention-dropout cases: 130 kB


def test_stale_fixture_is_caught(fresh: str):
    """Planted: one gradient entry changed in its 7th digit, a config value changed, an array dropped."""
    line = next(ln for ln in fresh.splitlines() if ln.startswith("array grad/h.1.mlp.c_fc.weight"))
    values = fresh.splitlines()[fresh.splitlines().index(line) + 1]
    first = values.split()[0]
    bumped = fresh.replace(values, values.replace(first, repr(float(first) * (1 + 1e-6)), 1))
    assert _differences(fresh, bumped) == ["array grad/h.1.mlp.c_fc.weight"]
    assert _differences(fresh, fresh.replace("config beta2 0.95", "config beta2 0.99"))
    assert _differences(fresh, fresh.replace("array step2/", "array step2x/"))


def test_fixture_layout_and_contents(fresh: str):
    cfg, scalars, arrays = make_fixture.parse(fresh)
    config = make_fixture.tiny_config()
    weights = make_fixture.tiny_weights(config)
    assert cfg["decay"].split(",") == [k for k, w in weights.items() if decays(k, w.shape)]
    for name, a in to_flux(weights).items():
        np.testing.assert_array_equal(arrays[f"param/{name}"].astype(np.float32), a)  # float32 values survive
        for prefix in ("grad", "grad_masked", "step1/param", "step2/adam_m", "step2/adam_v"):
            assert arrays[f"{prefix}/{name}"].shape == a.shape, (prefix, name)
    d, V, T, B = config.n_embd, make_fixture.VOCAB, make_fixture.T, make_fixture.B
    assert arrays["param/wte.weight"].shape == (d, V) and arrays["logits"].shape == (V, T, B)
    assert arrays["x"].shape == (T, B) and arrays["x"].min() >= 1 and arrays["x"].max() <= V
    masks = masks_to_flux(make_fixture.tiny_masks(config))
    for site, m in masks.items():
        np.testing.assert_array_equal(arrays[f"mask/{site}"], m.astype(np.float64))
    # the masks change the gradients, and the two steps change the parameters
    assert not np.allclose(arrays["grad/wte.weight"], arrays["grad_masked/wte.weight"])
    assert not np.allclose(arrays["step1/param/h.0.ln_1.bias"], arrays["param/h.0.ln_1.bias"])
    assert scalars["loss_step_1"] == scalars["loss_masked"]


def test_fixture_options_case(fresh: str):
    """The options case (nanoGPT's model options and a cosine schedule): its parameters are those the options leave
    (no biases, no lm_head.weight), in the Flux layout, and its two rates are the schedule's."""
    from harness.core.schedule import learning_rates
    from harness.core.weights import param_shapes

    cfg, scalars, arrays = make_fixture.parse(fresh)
    config = make_fixture.options_config()
    assert (cfg["options.tie_embeddings"], cfg["options.gelu"], cfg["options.bias"]) == ("true", "exact", "false")
    names = list(param_shapes(config, make_fixture.VOCAB))
    assert "lm_head.weight" not in names and not [n for n in names if n.endswith(".bias")]
    assert cfg["options.decay"].split(",") == [n for n, s in param_shapes(config, make_fixture.VOCAB).items()
                                               if decays(n, s, config.decay)]
    weights = make_fixture.tiny_weights(config)
    for name, a in to_flux(weights).items():
        np.testing.assert_array_equal(arrays[f"options/param/{name}"].astype(np.float32), a)
        for prefix in ("options/grad", "options/step1/param", "options/step2/param", "options/step2/adam_v"):
            assert arrays[f"{prefix}/{name}"].shape == a.shape, (prefix, name)
    rates = [scalars["options/lr_1"], scalars["options/lr_2"]]
    np.testing.assert_allclose(rates, learning_rates(config, 2), rtol=1e-12)
    assert scalars["options/lr_1"] != scalars["options/lr_2"]  # a warm-up step, then the peak
    assert not [k for k in arrays if k.startswith("options/") and "lm_head.weight" in k]


def test_fixture_attention_dropout_case(fresh: str):
    """The attention-dropout case: a one-layer model with attn_dropout, its attention keep-mask in NNlib's layout
    (key, query, head, batch) = the harness's (B, H, T_query, T_key) reversed, which changes the gradients; the
    oracle's gradients under the masks, and its parameters after two steps with them."""
    cfg, scalars, arrays = make_fixture.parse(fresh)
    config = make_fixture.attention_config()
    assert cfg["attn.attn_dropout"] == "true" and int(cfg["attn.n_layer"]) == config.n_layer == 1
    T, B, H = make_fixture.T, make_fixture.B, config.n_head
    mask = arrays["attn/mask/h.0.attn.probs"]
    assert mask.shape == (T, T, H, B) and set(np.unique(mask)) == {0.0, 1.0}
    assert not [k for k in arrays if k.startswith("mask/") and k.endswith(".probs")]  # the main case has none
    weights = make_fixture.tiny_weights(config)
    for name, a in to_flux(weights).items():
        np.testing.assert_array_equal(arrays[f"attn/param/{name}"].astype(np.float32), a)
        for prefix in ("attn/grad_masked", "attn/step1/param", "attn/step2/param"):
            assert arrays[f"{prefix}/{name}"].shape == a.shape, (prefix, name)
    # replayed in the oracle from the fixture's own arrays: the recorded gradients need the attention mask
    from harness.backends.flux_layout import masks_from_flux, tokens_from_flux
    from harness.models import numpy_gpt

    three = {k[len("mask/"):]: a for k, a in arrays.items() if k.startswith("mask/") and k[5:] in
             ("emb", "h.0.attn", "h.0.mlp")}
    masks = masks_from_flux({**three, "h.0.attn.probs": mask})
    assert masks["h.0.attn.probs"].shape == (B, H, T, T)
    x, y = tokens_from_flux(arrays["x"]), tokens_from_flux(arrays["y"])
    params = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    loss, grads = numpy_gpt.loss_and_gradients(params, x, y, config, masks=masks)
    assert np.isclose(float(loss), scalars["attn/loss_masked"], rtol=1e-11)
    np.testing.assert_allclose(grads["h.0.attn.c_attn.weight"], arrays["attn/grad_masked/h.0.attn.c_attn.weight"],
                               rtol=1e-10)
    without = numpy_gpt.loss_and_gradients(params, x, y, config.replace(attn_dropout=False), masks=masks)[1]
    assert not np.allclose(without["h.0.attn.c_attn.weight"], arrays["attn/grad_masked/h.0.attn.c_attn.weight"])
    assert scalars["attn/loss_step_1"] == scalars["attn/loss_masked"]
