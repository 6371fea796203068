"""Size presets equal docs/design.md's table; every invalid field gives a UsageError naming it."""

from __future__ import annotations

import pytest

from harness.config.load import load_config
from harness.config.presets import SIZES
from harness.errors import UsageError

# docs/design.md, "Size presets", copied by hand: the independent truth the TOML files must match.
DESIGN_TABLE = {
    "small": dict(n_embd=16, block_size=64, batch_size=16, n_layer=1, n_head=2, d_hidden=64),
    "medium": dict(n_embd=32, block_size=128, batch_size=32, n_layer=2, n_head=4, d_hidden=128),
    "large": dict(n_embd=64, block_size=256, batch_size=64, n_layer=4, n_head=8, d_hidden=256),
}


@pytest.mark.parametrize("size", SIZES)
def test_presets_match_design_table(size):
    c = load_config(size)
    for key, value in DESIGN_TABLE[size].items():
        assert getattr(c, key) == value, key
    assert (c.dropout, c.learning_rate, c.epochs) == (0.2, 0.01, 20)
    assert (c.beta1, c.beta2, c.eps) == (0.9, 0.999, 1e-8)


def test_unknown_size():
    with pytest.raises(UsageError, match="unknown size 'huge'"):
        load_config("huge")


@pytest.mark.parametrize("change, message", [
    (dict(n_head=3), "does not divide"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(block_size=-1), "block_size must be a positive integer"),
    (dict(learning_rate=0.0), "learning_rate must be positive"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
    (dict(dropout=-0.1), r"dropout must be in \[0, 1\)"),
    (dict(beta2=1.0), r"beta2 must be in \[0, 1\)"),
    (dict(scheme="zigzag"), "scheme must be one of"),
    (dict(steps=0), "steps must be a positive integer"),
    (dict(learning_rate=float("nan")), "learning_rate must be a finite number"),
])
def test_invalid_values(change, message):
    with pytest.raises(UsageError, match=message):
        load_config("small").replace(**change)


def test_user_config_round_trip(tmp_path):
    from harness.config.presets import preset_path

    path = tmp_path / "mine.toml"
    path.write_text(preset_path("medium").read_text().replace("n_layer = 2", "n_layer = 3"))
    c = load_config(path=path)
    assert c.n_layer == 3 and c.n_embd == 32
    assert c.config_hash() != load_config("medium").config_hash()


@pytest.mark.parametrize("text, message", [
    ("[model\nn_embd = 3", "not valid TOML"),
    ("name = 'x'\n[model]\nn_embd = 16\n", "missing"),
    ("name = 'x'\n[modle]\n", "unknown top-level key"),
])
def test_malformed_config(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=message):
        load_config(path=path)


@pytest.mark.parametrize("name", ["a/b", "..", "a\0b", "has space", "a&b", "x" * 65, "", 3])
def test_config_name_must_be_a_plain_name(name):
    with pytest.raises(UsageError, match="config name"):
        load_config("small").replace(name=name)


def test_seed_range():
    import argparse

    from harness.config.fields import SEED_MAX, check_seed, seed_arg

    assert seed_arg("0") == 0 and seed_arg(str(SEED_MAX)) == SEED_MAX == 2**32 - 1
    for bad in ("-1", str(2**32), str(2**64), "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            seed_arg(bad)
    with pytest.raises(UsageError, match="out of range"):
        check_seed(-1)


def test_config_from_stored_dict():
    from harness.config.fields import config_from_dict

    stored = load_config("small").to_dict()
    assert config_from_dict(dict(stored), "spec.json") == load_config("small")
    with pytest.raises(UsageError, match="unknown key"):
        config_from_dict({**stored, "bogus": 1}, "spec.json")
    with pytest.raises(UsageError, match="missing key"):
        config_from_dict({k: v for k, v in stored.items() if k != "n_head"}, "spec.json")
    with pytest.raises(UsageError, match="not a table"):
        config_from_dict([1], "spec.json")
    with pytest.raises(UsageError, match="invalid"):
        config_from_dict({**stored, "n_layer": "2"}, "spec.json")


def test_option_defaults_are_the_original_model_and_every_option_reads_from_toml(tmp_path):
    """The options' defaults, written out: the original model (untied, tanh GELU, biases everywhere) and optimizer
    (nanoGPT's decay set, a constant rate); each option is read from its TOML section, and nothing else is optional."""
    from harness.config.fields import OPTION_DEFAULTS
    from harness.config.presets import preset_path, read_toml

    assert OPTION_DEFAULTS == {"tie_embeddings": False, "gelu": "tanh", "bias": True, "lm_head_bias": True,
                               "attn_dropout": False, "decay": "nanogpt", "lr_schedule": "constant", "warmup_steps": 0,
                               "decay_steps": None, "min_lr": 0.0}
    text = preset_path("small").read_text()
    path = tmp_path / "c.toml"
    path.write_text(text.replace("[model]", "[model]\ntie_embeddings = true\ngelu = \"exact\"\nbias = false\n"
                                 "lm_head_bias = false\nattn_dropout = true")
                    .replace("[train]", "[train]\ndecay = \"mingpt\"\n"
                             "lr_schedule = \"cosine\"\nwarmup_steps = 1\ndecay_steps = 9\nmin_lr = 0.001"))
    c = read_toml(path)
    assert c.options() == {"tie_embeddings": True, "gelu": "exact", "bias": False, "lm_head_bias": False,
                           "attn_dropout": True, "decay": "mingpt", "lr_schedule": "cosine", "warmup_steps": 1,
                           "decay_steps": 9, "min_lr": 0.001}
    path.write_text(text.replace("[model]", "[model]\nsteps = 5"))
    with pytest.raises(UsageError, match=r"unknown key\(s\) steps in \[model\]"):
        read_toml(path)
