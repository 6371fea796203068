"""Parity with the shared attention masks, and the causes of two mask bugs (masks transposed, masks of another step).

With attention dropout the activation taps are taken under the step-0 attention masks (harness.core.taps.tap_masks),
so a bug of the attention dropout is located at `h.{i}.attn.y` with its cause; a side that applies its masks
transposed or from another step is named so, at every site: at attn.y for the attention probabilities, at the
gradients under the masks for the others (harness.parity.dropout). The bugs are planted in the NumPy oracle or in
torch (tests/plants.py); the outside port's plants: tests/test_kit.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import data_path

from harness.config.load import load_config
from harness.core.masks import dropout_masks
from harness.core.taps import MASK_PREFIX, tap_rows
from harness.parity.compare import compare
from harness.parity.dropout import KIND_TEXT, Masks, dropout_gradient_cause
from harness.parity.forward import merge_heads
from harness.parity.record import step_masks
from harness.parity.result import ParityResult
from harness.parity.tolerances import default_tolerances, precision_pair
from harness.run import probe
from tests import plants

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
SEED = plants.PLANT_SEED


def _corpus():
    from harness.core.data import load_corpus

    return load_corpus(data_path())


def _config(size: str = "small", attn: bool = True, steps: int = 5):
    return load_config(size).replace(dropout=0.2, attn_dropout=attn, steps=steps)


def _record(backend: object, config) -> dict:
    """What a parity worker records first (harness.run.probe.Recorder.start): logits, gradients with and without
    the step-0 masks, the taps."""
    from harness.core.data import BatchStream
    from harness.core.weights import init_weights

    corpus = _corpus()
    stream = BatchStream(corpus.train, config.block_size, config.batch_size, SEED, config.scheme)
    backend.setup(config, init_weights(config, corpus.vocab_size, SEED), corpus.vocab_size, "cpu", SEED)
    return probe.Recorder(backend, config, stream, 0, config.steps, masks=step_masks(config, SEED)).start()


def step0(config, plant: str | None = None, torch_dtype: str = "float32") -> ParityResult:
    """torch against the NumPy oracle at step 0, `plant` planted in the side tests/plants.py names, compared as
    `harness parity` compares them (the config and the run's masks)."""
    from harness.backends.numpy_backend import NumpyBackend
    from harness.backends.torch_backend import TorchBackend

    in_torch = plant is not None and plants.PLANTS[plant][0] == "torch"
    with plants.planted(plant) if in_torch else contextlib.nullcontext():
        other = _record(TorchBackend(dtype=torch_dtype, parity=True), config)
    with plants.planted(plant) if plant and not in_torch else contextlib.nullcontext():
        oracle = _record(NumpyBackend(), config)
    tol = default_tolerances(precision_pair(torch_dtype, "float64"), config.name)
    return compare(other, oracle, [1.0], [1.0], tol, backends=("torch", "numpy"), config=config,
                   masks=step_masks(config, SEED))


# ------------------------------------------------------------------------------------------ taps under the masks


def test_taps_are_taken_with_the_step0_attention_masks() -> None:
    """With attention dropout the probe's taps apply the step-0 attention masks (recorded as tap_mask/), attn.probs
    before them and attn.y = (probs * mask / (1 - p)) @ v, in torch as in the oracle; without the option the taps
    are those of dropout off, as before."""
    from harness.backends.numpy_backend import NumpyBackend
    from harness.backends.torch_backend import TorchBackend

    config = _config()
    oracle, other = _record(NumpyBackend(), config), _record(TorchBackend(dtype="float64", parity=True), config)
    keep = dropout_masks(config, SEED, 0)["h.0.attn.probs"][:tap_rows(config)]
    for p in (oracle, other):
        assert sorted(k for k in p if k.startswith(MASK_PREFIX)) == [MASK_PREFIX + "h.0.attn.probs"]
        assert np.array_equal(p[MASK_PREFIX + "h.0.attn.probs"], keep)
        want = merge_heads((p["tap/h.0.attn.probs"] * keep / 0.8) @ p["tap/h.0.attn.v"])
        np.testing.assert_allclose(p["tap/h.0.attn.y"], want, rtol=0, atol=1e-13)
    for name in [k for k in oracle if k.startswith("tap/")]:
        np.testing.assert_allclose(other[name], oracle[name], rtol=0, atol=1e-12, err_msg=name)
    # taps taken without the masks on one side are not compared with the other's; no taps at all is no failure
    tol = default_tolerances("float64/float64", "small")
    stripped = {k: v for k, v in other.items() if not k.startswith(MASK_PREFIX)}
    r = compare(stripped, oracle, [1.0], [1.0], tol, config=config)
    assert any("taps were taken with different dropout masks" in f for f in r.failures), r.failures
    untapped = {k: v for k, v in other.items() if not k.startswith(("tap/", MASK_PREFIX))}
    assert compare(untapped, oracle, [1.0], [1.0], tol, config=config).passed
    plain = NumpyBackend()
    plain.setup(config, *_weights(config))
    assert not np.allclose(plain.taps(oracle["x"][:tap_rows(config)])["h.0.attn.y"], oracle["tap/h.0.attn.y"])
    three = _record(NumpyBackend(), _config(attn=False))  # dropout without the option: the taps of dropout off
    assert not any(k.startswith(MASK_PREFIX) for k in three)
    np.testing.assert_array_equal(three["tap/h.0.attn.y"],
                                  plain.taps(three["x"][:tap_rows(config)])["h.0.attn.y"])


def _weights(config) -> tuple:
    from harness.core.weights import init_weights

    corpus = _corpus()
    return init_weights(config, corpus.vocab_size, SEED), corpus.vocab_size, "cpu", SEED


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_correct_backends_pass_step0_under_the_attention_masks(dtype: str) -> None:
    result = step0(_config(), None, dtype)
    assert result.passed, result.failures
    assert result.taps_rel_err["h.0.attn.y"] < result.tolerances.tap


# ------------------------------------------------------------------------------------------ the three planted bugs


ATTENTION_BUGS = {  # plant: words its cause must hold
    "attn-drop-after-v": "after the value product",
    "attn-drop-unscaled": "not rescaled: the kept probabilities are not divided by 1 - p",
    "attn-drop-missing": "the probabilities not dropped: the attention dropout is missing",
}


@pytest.mark.parametrize("plant", [*ATTENTION_BUGS, *(f"torch-{p}" for p in ATTENTION_BUGS)])
def test_attention_dropout_bug_is_named_at_attn_y_with_its_cause(plant: str) -> None:
    words = ATTENTION_BUGS[plant.removeprefix("torch-")]
    side = "torch" if plant.startswith("torch-") else "numpy"
    result = step0(_config(), plant)
    assert not result.passed and result.first_tap == "h.0.attn.y", result.failures
    assert f"the attention dropout (h.0.attn.probs): {side}'s attn.y is" in result.tap_cause
    assert words in result.tap_cause, result.tap_cause
    line = next(f for f in result.failures if f.startswith("FAIL: forward"))
    assert "first divergent activation h.0.attn.y" in line and words in line, line
    own = [f for f in result.failures if f.startswith(f"FAIL: {side}'s attention taps")]
    assert own and words in own[0], result.failures  # its taps against its own attention, under the mask
    grads = next(f for f in result.failures if f.startswith("FAIL: gradient with dropout masks"))
    assert grads.endswith("follows from the forward difference at h.0.attn.y"), grads


# ----------------------------------------------------------------------------- masks transposed, of another step


@pytest.mark.parametrize("plant, words", [
    ("masks-transposed", "dropout masks transposed: numpy drops the attention probabilities (h.0.attn.probs) with "
                         "the mask transposed (query and key swapped"),
    ("masks-previous-step", "masks of another step: numpy drops the attention probabilities (h.0.attn.probs) with "
                            "the mask of step 4 where step 0's were handed (step k reading masks[k - 1]"),
])
def test_mask_bug_at_the_attention_site_is_named_at_attn_y(plant: str, words: str) -> None:
    result = step0(_config(), plant)
    assert result.first_tap == "h.0.attn.y" and words in result.tap_cause, result.failures


@pytest.mark.parametrize("plant, words", [
    ("masks-transposed", "dropout masks transposed: numpy applies, at every site, the masks transposed (batch and "
                         "feature axes swapped)"),
    ("masks-previous-step", "masks of another step: numpy applies, at every site, the masks of step 4 where step "
                            "0's were handed (step k reading masks[k - 1]: step 0 wraps around to the last step)"),
])
def test_mask_bug_at_the_other_sites_is_named_at_the_dropout_gradients(plant: str, words: str) -> None:
    result = step0(_config(attn=False), plant)
    assert result.first_tap is None, result.failures
    line = next(f for f in result.failures if f.startswith("FAIL: gradient with dropout masks"))
    assert f"likely cause: {words}" in line, line
    assert "placement or scaling" not in line


def _probe_under(config, masks: dict) -> dict:
    """An oracle probe whose dropout gradients were taken under `masks` (float64)."""
    from harness.backends.numpy_backend import NumpyBackend

    b = NumpyBackend()
    b.setup(config, *_weights(config))
    from harness.core.data import BatchStream

    corpus = _corpus()
    x, y = BatchStream(corpus.train, config.block_size, config.batch_size, SEED, config.scheme).batch(0)
    return {"x": x, "y": y, **{f"opt/0/param/{k}": v for k, v in b.parameters().items()},
            **{f"dropout_grad/{k}": v for k, v in b.gradients(x, y, masks=masks).items()}}


@pytest.mark.parametrize("kind, mistake", [("emb", "transposed"), ("attn.probs", "step 4"), ("attn", "transposed"),
                                           ("mlp", "step 4"), ("attn.probs", "memory order")])
def test_the_kind_of_site_whose_masks_are_wrong_is_named(kind: str, mistake: str) -> None:
    """At each kind of site alone (the attention probabilities included): the side's gradients under the masks
    are the oracle's with that kind's masks transposed, in the other memory order or of step 4; the cause names the
    mistake and the site (block_size 16: faster, and every axis of a (B, T, C) mask as long)."""
    config = _config().replace(block_size=16)
    step0, last = dropout_masks(config, SEED, 0), dropout_masks(config, SEED, 4)

    def wrong(site: str, m: np.ndarray) -> np.ndarray:
        if site.split(".")[-1] != kind.split(".")[-1] or (site == "emb") != (kind == "emb"):
            return m
        if mistake == "memory order":  # the reversed (Flux) layout reshaped instead of permuted
            return np.ascontiguousarray(m.transpose(tuple(reversed(range(m.ndim))))).reshape(m.shape)
        if mistake != "transposed":
            return last[site]
        return m.swapaxes(-1, -2) if m.ndim == 4 else m.T

    good, bad = _probe_under(config, step0), _probe_under(config, {s: wrong(s, m) for s, m in step0.items()})
    masks = Masks(p=0.2, of_step=lambda k: dropout_masks(config, SEED, k), steps=config.steps)
    cause = dropout_gradient_cause(bad, good, config, masks, 1e-10, ("port", "oracle"), budget=math.inf)
    assert cause is not None and f"port applies, {KIND_TEXT[kind]}, the masks" in cause, cause
    assert {"transposed": "dropout masks transposed", "memory order": "dropout masks in the other memory order",
            "step 4": "masks of another step"}[mistake] in cause, cause
    assert {"transposed": "transposed (", "memory order": "read in the other memory order",
            "step 4": "of step 4 where step 0's were handed"}[mistake] in cause, cause
    assert dropout_gradient_cause(good, good, config, masks, 1e-10, ("port", "oracle")) is None
    assert dropout_gradient_cause(bad, good, config, masks, 1e-10, ("port", "oracle"), budget=0.0) is None


# ------------------------------------------------------------------------------------------ the command


def test_parity_command_names_attention_dropout_missing(tmp_path: Path) -> None:
    """`harness parity` with the oracle's attention dropout missing (planted in the workers): exit 1, the first
    divergent tap h.0.attn.y and the cause."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(plants.SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO / "tests"), str(REPO)]),
           "HARNESS_TEST_PLANT": "attn-drop-missing"}
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "parity", "--size", "small", "--steps", "2",
                           "--dropout", "0.2", "--set", "attn_dropout=true", "--backend", "torch,numpy",
                           "--data", str(data_path()), "--out", str(tmp_path / "out"), "--quiet"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    record = json.loads(next((tmp_path / "out").rglob("parity.json")).read_text())
    line = next(f for f in record["failures"] if f.startswith("FAIL: forward"))
    assert "first divergent activation h.0.attn.y" in line and "the attention dropout is missing" in line, line


def test_planted_bug_table_rows_are_replaced_in_place_and_new_ones_grouped() -> None:
    """tools/planted_bugs.py --plants/--port-plants --write: the rows of the plants run replace theirs, a new row
    goes after the last row of its kind and size, the others stay as they are."""
    import runpy

    tool = runpy.run_path(str(REPO / "tools" / "planted_bugs.py"), run_name="planted_bugs")
    header = "\n".join(tool["HEADER"])
    text = header + ("\n| a | numpy | small | f32 | taps | old |\n| b | numpy | medium | f32 | x | y |"
                     "\n| c | port | small | f32 | z | w |\n")
    merged = tool["merge_rows"](text, [["a", "numpy", "small", "f32", "taps: `h.0.attn.y`", "new"],
                                      ["d", "numpy", "small", "f32", "q", "r"],
                                      ["e", "torch", "small", "f32", "s", "t"]])
    rows = merged.split("\n")[2:-1]
    assert [r.split(" | ")[0] for r in rows] == ["| a", "| d", "| b", "| c", "| e"], merged
    assert rows[0] == "| a | numpy | small | f32 | taps: `h.0.attn.y` | new |" and rows[2].endswith("| x | y |")


def test_side_by_side_tool_reads_records_and_nanogpt_logs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """tools/nanogpt_side_by_side.py: best (with its step) and final validation loss per seed from the harness's
    torch records and nanoGPT's log lines, the means against nanoGPT's, and an SVG of the curves."""
    import runpy

    tool = runpy.run_path(str(REPO / "tools" / "nanogpt_side_by_side.py"), run_name="side_by_side")
    from tests.conftest import as_version_3
    from tests.test_report import make_run

    runs = []
    for seed, losses in ((1, [4.0, 2.0, 2.1]), (2, [4.0, 2.2, 2.05])):
        out = tmp_path / f"h{seed}"
        (path,) = (out / "runs" / make_run(out, ("torch",), steps=10)).glob("torch.json")
        doc = as_version_3(path)  # a real record, its evaluations made these
        doc["evals"] = [{"step": 100 * i, "train_loss": v, "val_loss": v, "time_s": 0.1} for i, v in enumerate(losses)]
        path.write_text(json.dumps(doc))
        runs.append(str(out))
    log = tmp_path / "n.log"
    log.write_text("iter 0: loss 4.1\nstep 0: train loss 4.1, val loss 4.0\nstep 100: train loss 2, val loss 2.3\n")
    svg = tmp_path / "f.svg"
    tool["main"](["--harness-on", *runs, "--nanogpt", str(log), "--svg", str(svg)])
    out = capsys.readouterr().out
    assert "| harness, attn_dropout on | 1 | 2.0000 (100) | 2.1000 |" in out, out
    assert "| harness, attn_dropout on | 2 | 2.0500 (200) | 2.0500 |" in out, out
    assert "| nanoGPT train.py | 1 | 2.3000 (100) | 2.3000 |" in out, out
    assert "| harness, attn_dropout on | -0.2750 (no) | -0.2250 (no) |" in out, out
    assert svg.read_text().lstrip().startswith("<?xml")
