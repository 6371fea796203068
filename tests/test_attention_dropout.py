"""nanoGPT's fourth dropout site, on the attention probabilities: the `attn_dropout` option, the
harness's attention masks (their own stream: the three other sites' masks are what they were), and the torch model's
two paths (SDPA's dropout_p without masks, the written-out probabilities with the harness's masks) against the NumPy
oracle. The oracle's backward: tests/test_numpy_gradcheck.py; Flux: tests/test_flux_*.py; the kit: tests/test_kit.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness.config.fields import OPTION_DEFAULTS, config_from_dict
from harness.config.load import load_config
from harness.config.nanogpt import parse_sets
from harness.core.masks import ATTENTION_STREAM, MASK_STREAM, dropout_masks, fingerprint, mask_keys, mask_shapes
from harness.core.weights import init_weights
from harness.errors import UsageError

torch = pytest.importorskip("torch")

# sha256 of the three sites' masks (emb, h.i.attn, h.i.mlp), taken before the attention masks existed (commit
# 01fc450): kits, parity records and the Flux fixture drawn then hold exactly these bits.
PINNED = {("small", 1337, 0): "7e224234d21037b18299d790282b1f21ee5a2a675a76d223e1252049aea164a2",
          ("small", 7, 3): "ff0e877687b11e30e99793b0e93dca89da567bcea59f337af36b199da8fa3525",
          ("medium", 1337, 0): "8861871c291edd55028e0eff354d5869e136a6ab7f8486670addb06c66535528",
          ("medium", 7, 3): "f6d127cdac692e0086027329479e75c9b4bf5db01dd52ef85929744313b36ec3",
          ("nanogpt-cpu", 1337, 0): "c4b6f8a974fe72c1d32a1c9d18fc51b80b4bb2422b7caeaab0b22ae813bae847",
          ("nanogpt-cpu", 7, 3): "f174befa25438d1991f84c776e1a535878bd38429de7c0ee16f381c63b8311ef"}


def three_sites(masks: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: m for k, m in masks.items() if not k.endswith(".probs")}


# ------------------------------------------------------------------------------------------ masks


@pytest.mark.parametrize("size, seed, step", list(PINNED))
@pytest.mark.parametrize("attn", [False, True])
def test_the_three_sites_masks_are_bit_identical_to_before(size: str, seed: int, step: int, attn: bool) -> None:
    config = load_config(size).replace(dropout=0.2, attn_dropout=attn)  # nanogpt-cpu's preset dropout is 0
    masks = dropout_masks(config, seed, step)
    assert any(k.endswith(".probs") for k in masks) == attn
    assert fingerprint(three_sites(masks)) == PINNED[size, seed, step]


def test_attention_masks_keys_shapes_and_keep_rate() -> None:
    config = load_config("medium").replace(attn_dropout=True, dropout=0.3)
    B, T, C, H = config.batch_size, config.block_size, config.n_embd, config.n_head
    assert mask_keys(config) == ["emb", "h.0.attn.probs", "h.0.attn", "h.0.mlp", "h.1.attn.probs", "h.1.attn",
                                 "h.1.mlp"]
    shapes = mask_shapes(config)
    assert list(shapes) == mask_keys(config)
    assert shapes["h.1.attn.probs"] == (B, H, T, T) and shapes["emb"] == shapes["h.1.mlp"] == (B, T, C)
    masks = dropout_masks(config, 11, 4)
    assert list(masks) == mask_keys(config)  # forward order
    for key, m in masks.items():
        assert m.dtype == np.bool_ and m.shape == shapes[key], key
    probs = np.stack([masks["h.0.attn.probs"], masks["h.1.attn.probs"]])
    n = probs.size  # 4 M entries: the keep rate within 5 standard deviations of 1 - p
    assert abs(probs.mean() - 0.7) < 5 * np.sqrt(0.7 * 0.3 / n)
    assert not np.array_equal(masks["h.0.attn.probs"], masks["h.1.attn.probs"])
    again = dropout_masks(config, 11, 4)
    assert all(np.array_equal(again[k], m) for k, m in masks.items())  # a function of (seed, step) alone
    other = dropout_masks(config, 11, 5)["h.0.attn.probs"]
    assert 0.5 < (other == masks["h.0.attn.probs"]).mean() < 0.65  # independent: agree with 0.7^2 + 0.3^2


def test_attention_masks_come_from_their_own_stream() -> None:
    """The attention masks are the first bits of PCG64(SeedSequence([ATTENTION_STREAM, seed, step])), not of the
    three sites' stream; turning the option on or off leaves the other masks as they were."""
    config = load_config("small").replace(attn_dropout=True, dropout=0.25)
    masks = dropout_masks(config, 5, 2)
    B, T, H = config.batch_size, config.block_size, config.n_head
    for stream, expected in ((ATTENTION_STREAM, True), (MASK_STREAM, False)):
        bits = np.random.PCG64(np.random.SeedSequence([stream, 5, 2]))
        u = bits.random_raw((B * H * T * T + 1) // 2).view(np.uint32)[:B * H * T * T]
        own = (u >= np.uint32(round(0.25 * 2.0**32))).reshape(B, H, T, T)
        assert np.array_equal(own, masks["h.0.attn.probs"]) == expected
    off = dropout_masks(config.replace(attn_dropout=False), 5, 2)
    assert list(off) == ["emb", "h.0.attn", "h.0.mlp"]
    assert all(np.array_equal(off[k], masks[k]) for k in off)
    # the attention bits do not repeat the activation bits of the same step
    flat = masks["h.0.attn.probs"].reshape(-1)[: masks["emb"].size]
    assert 0.55 < (flat == masks["emb"].reshape(-1)).mean() < 0.7


def test_no_attention_masks_without_the_option_or_without_dropout() -> None:
    assert "h.0.attn.probs" not in dropout_masks(load_config("small"), 1, 0)  # small: three sites, as before
    assert mask_keys(load_config("small").replace(attn_dropout=True, dropout=0.0)) == ["emb", "h.0.attn", "h.0.mlp"]


# ------------------------------------------------------------------------------------------ the config option


def test_option_default_hash_and_old_stored_configs() -> None:
    assert OPTION_DEFAULTS["attn_dropout"] is False
    pinned = {"small": "9beb1f22bd21016d10686f937555619d69f16d46140f7627ef0456794f443926",  # before the option
              "medium": "11f64cbf0e10f9d2823a26dbfb8468e74fcc398cd8677f7227282860aa6ba487",
              "large": "d703f6587f306d40575f70fd07ec2699dde12881d9e856e58a3545e85767e9b2"}
    for size, digest in pinned.items():
        c = load_config(size)
        assert c.attn_dropout is False and c.config_hash() == digest and c.options() == {}
        stored = {k: v for k, v in c.to_dict().items() if k != "attn_dropout"}  # a record written before
        assert config_from_dict(stored, "spec.json") == c
        on = c.replace(attn_dropout=True)
        assert on.config_hash() != digest and on.options() == {"attn_dropout": True}
        assert config_from_dict(on.to_dict(), "spec.json") == on
    with pytest.raises(UsageError, match="attn_dropout must be true or false"):
        load_config("small").replace(attn_dropout="yes")


def test_option_from_toml_set_presets_and_nanogpt_files(tmp_path: Path) -> None:
    from harness.config.presets import preset_path

    for size in ("nanogpt-cpu", "nanogpt-shakespeare-char"):
        assert load_config(size).attn_dropout is True, size
    for size in ("small", "medium", "large"):
        assert load_config(size).attn_dropout is False, size
    toml = preset_path("small").read_text().replace("dropout = 0.2", "dropout = 0.2\nattn_dropout = true")
    (tmp_path / "mine.toml").write_text(toml)
    assert load_config(path=tmp_path / "mine.toml").attn_dropout is True
    (tmp_path / "bad.toml").write_text(toml.replace("attn_dropout = true", "attn_dropout = 1"))
    with pytest.raises(UsageError, match="attn_dropout must be true or false"):
        load_config(path=tmp_path / "bad.toml")
    assert load_config("small", overrides=parse_sets(["attn_dropout=true"])).attn_dropout is True
    assert load_config("nanogpt-cpu", overrides=parse_sets(["attn_dropout=false"])).attn_dropout is False
    # a nanoGPT config file: nanoGPT always drops attention probabilities; --set can still turn it off
    (tmp_path / "train_x.py").write_text("n_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 16\ndropout = 0.2\n"
                                         "dataset = 'shakespeare_char'\ngradient_accumulation_steps = 1\n")
    assert load_config(path=tmp_path / "train_x.py").attn_dropout is True
    assert load_config(path=tmp_path / "train_x.py",
                       overrides=parse_sets(["attn_dropout=False"])).attn_dropout is False


def test_set_attn_dropout_reaches_every_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--set attn_dropout=...` is a config field like the others on every command that takes --set: a bad value is
    one line and exit 2."""
    from harness.cli.main import main

    for command in (["run"], ["parity"], ["kit", "export", "--out", str(tmp_path / "k")]):
        code = main([*command, "--size", "small", "--set", "attn_dropout=maybe"])
        err = capsys.readouterr().err
        assert code == 2 and "attn_dropout must be true or false" in err and len(err.strip().splitlines()) == 1, (
            command, err)
    assert not (tmp_path / "k").exists()


# ------------------------------------------------------------------------------------------ torch and the oracle


def _pair(config, seed: int = 3):
    from harness.backends.numpy_backend import NumpyBackend
    from harness.backends.torch_backend import TorchBackend

    weights = init_weights(config, 65, seed)
    t = TorchBackend(dtype="float64", parity=True)
    t.setup(config, weights, 65, "cpu", seed)
    n = NumpyBackend("float64")
    n.setup(config, weights, 65, "cpu", seed)
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 65, (config.batch_size, config.block_size))
    y = rng.integers(0, 65, x.shape)
    return t, n, x, y


@pytest.mark.parametrize("size", ["small", "medium", "nanogpt-cpu"])
def test_torch_equals_the_oracle_with_attention_masks(size: str) -> None:
    """float64 both: the step-0 loss and every gradient under the harness's masks (attention sites included), and a
    training step taken with them, agree to rounding; without the attention masks they would not."""
    config = load_config(size).replace(dropout=0.2, attn_dropout=True, batch_size=4, block_size=32)
    t, n, x, y = _pair(config)
    masks = dropout_masks(config, 3, 0)
    assert sum(k.endswith(".probs") for k in masks) == config.n_layer
    gt, gn = t.gradients(x, y, masks=masks), n.gradients(x, y, masks=masks)
    worst = max(np.linalg.norm(gt[k] - gn[k]) / np.linalg.norm(gn[k]) for k in gn)
    assert worst < 1e-12, worst
    g3 = n.gradients(x, y, masks=three_sites(masks))
    assert max(np.linalg.norm(g3[k] - gn[k]) / np.linalg.norm(gn[k]) for k in gn) > 1e-3
    lt, ln = t.train_step(x, y, 1e-3, masks=masks), n.train_step(x, y, 1e-3, masks=masks)
    assert abs(lt - ln) < 1e-12 * abs(ln)
    pt, pn = t.parameters(), n.parameters()
    assert max(np.abs(pt[k] - pn[k]).max() for k in pn) < 1e-12


def test_torch_taps_are_the_probabilities_before_dropout_and_y_after() -> None:
    from harness.models.torch_gpt import GPT

    config = load_config("small").replace(dropout=0.3, attn_dropout=True, batch_size=2, block_size=8)
    model = GPT(65, 8, config.n_embd, 1, config.n_head, config.d_hidden, 0.3, attn_dropout=True).double().eval()
    idx = torch.randint(0, 65, (2, 8), generator=torch.Generator().manual_seed(0))
    keep = torch.from_numpy(dropout_masks(config, 1, 0)["h.0.attn.probs"]).double()
    masks = {"h.0.attn.probs": keep}  # the attention site alone: the same input to the attention as below
    taps: dict = {}
    model(idx, masks=masks, taps=taps)
    plain: dict = {}
    model(idx, taps=plain)  # eval, no masks: SDPA without dropout
    probs, v = taps["h.0.attn.probs"], taps["h.0.attn.v"]
    torch.testing.assert_close(probs, plain["h.0.attn.probs"], rtol=0, atol=1e-15)  # before the dropout
    y = (probs * keep / 0.7) @ v
    torch.testing.assert_close(taps["h.0.attn.y"], y.transpose(1, 2).reshape(2, 8, -1), rtol=1e-14, atol=0)
    assert not torch.allclose(taps["h.0.attn.y"], plain["h.0.attn.y"])


def _only_attention_dropout(p: float, attn_dropout: bool):
    """torch_gpt.GPT with dropout p at the attention probabilities alone (the other sites' p set to 0)."""
    from harness.models.torch_gpt import GPT

    torch.manual_seed(0)
    model = GPT(65, 16, 16, 2, 2, 32, p, attn_dropout=attn_dropout).double()
    for name, module in model.named_modules():
        if name == "drop" or name.endswith(("resid_dropout", "mlp.dropout")):
            module.p = 0.0
    return model


def test_torch_fast_path_is_sdpa_dropout_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without masks, training hands SDPA dropout_p = p (its fused kernels, flash in bf16 on CUDA): the loss then
    differs from evaluation's; evaluation and p = 0 hand it 0, and the option off leaves training = evaluation."""
    import torch.nn.functional as F

    calls: list[float] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("dropout_p", 0.0))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    idx = torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(1))
    model = _only_attention_dropout(0.3, True)
    _, train = model.train()(idx, idx)
    train = train.detach()
    assert calls == [0.3, 0.3]
    calls.clear()
    with torch.no_grad():
        _, evaluated = model.eval()(idx, idx)
    assert calls == [0.0, 0.0] and abs(float(train) - float(evaluated)) > 1e-3
    for p, on in ((0.0, True), (0.3, False)):  # p = 0, or the option off: no dropout at the probabilities
        model = _only_attention_dropout(p, on)
        calls.clear()
        with torch.no_grad():
            _, train = model.train()(idx, idx)
            _, evaluated = model.eval()(idx, idx)
        assert calls == [0.0] * 4 and float(train) == float(evaluated), (p, on)


def test_torch_backend_trains_with_its_own_attention_dropout() -> None:
    """A run without harness masks (harness run): seeded, so repeatable; different from the three-site model."""
    from harness.backends.torch_backend import TorchBackend

    config = load_config("small").replace(attn_dropout=True, batch_size=4, block_size=16)
    weights = init_weights(config, 65, 1)
    x = np.random.default_rng(0).integers(0, 65, (4, 16))

    def losses(c) -> list[float]:
        b = TorchBackend()
        b.setup(c, weights, 65, "cpu", 1)
        return [b.train_step(x, x, 1e-2) for _ in range(3)]

    assert losses(config) == losses(config)
    assert losses(config) != losses(config.replace(attn_dropout=False))


def test_memory_estimate_counts_the_dropped_probabilities() -> None:
    """The preflight's activations: 2 B*H*T*T more per layer with attention dropout (the dropped probabilities and
    their mask), nothing more at dropout 0."""
    from harness.core.data import load_corpus
    from harness.run.plan import estimate_memory
    from tests.conftest import data_path

    corpus = load_corpus(data_path())
    c = load_config("medium")
    base = estimate_memory(c, corpus)["activations"]
    B, H, T, L = c.batch_size, c.n_head, c.block_size, c.n_layer
    assert estimate_memory(c.replace(attn_dropout=True), corpus)["activations"] == base + 4 * L * 2 * B * H * T * T
    assert estimate_memory(c.replace(attn_dropout=True, dropout=0.0), corpus)["activations"] == base
