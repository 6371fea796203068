"""Parity names the broken part. Depth 0 (activation taps) names the first divergent tap and its cause;
the re-synchronised optimizer depth names the step where a bug first acts; the diagnoses of the issue's patterns.

Bugs are planted in the NumPy oracle (tests/plants.py; the same code plants them in a `harness parity` command's
workers through sitecustomize) or in the outside torch port (examples/kit_torch_port.py --plant). Each must be named
where it is, with a cause containing the issue's word, on small and medium, float32/float64 and float64/float64.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import data_path

from harness.config.load import load_config
from harness.core.taps import in_forward_order, tap_names, tap_rows, tap_shapes
from harness.parity.compare import compare
from harness.parity.forward import (
    activation_cause,
    layernorm_cause,
    linear_cause,
    output_cause,
    qkv_cause,
    residual_cause,
)
from harness.parity.numeric import float32_stored_as_float64, update_error
from harness.parity.optimizer import aliased_quantities, decay_cause, decay_ratios, step_counter_cause
from harness.parity.result import ParityResult
from harness.parity.tolerances import Tolerances, default_tolerances, precision_pair
from harness.run import probe
from tests import plants

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
DATA = str(data_path())
SEED = 1337


def _corpus():
    from harness.core.data import load_corpus

    return load_corpus(DATA)


# ------------------------------------------------------------------------------------------ the taps, defined once


@pytest.mark.parametrize("n_layer", [1, 2])
def test_every_backend_fills_every_tap_in_its_canonical_shape(n_layer: int) -> None:
    from harness.backends.numpy_backend import NumpyBackend
    from harness.backends.torch_backend import TorchBackend
    from harness.core.data import BatchStream
    from harness.core.weights import init_weights

    corpus = _corpus()
    config = load_config("small").replace(n_layer=n_layer, dropout=0.0)
    names = tap_names(n_layer)
    assert names[0] == "emb" and names[-2:] == ["ln_f", "logits"] and len(names) == 3 + 13 * n_layer
    assert in_forward_order(reversed(names)) == names
    x, _ = BatchStream(corpus.train, config.block_size, config.batch_size, SEED, config.scheme).batch(0)
    x = x[:tap_rows(config)]
    shapes = tap_shapes(config, corpus.vocab_size)
    taps = {}
    for backend in (NumpyBackend(), TorchBackend(dtype="float64")):
        backend.setup(config, init_weights(config, corpus.vocab_size, SEED), corpus.vocab_size, "cpu", SEED)
        taps[backend.name] = backend.taps(x)
        # every tap, by name; their order in the dict is no part of the contract (parity walks them in forward
        # order itself: in_forward_order, checked above)
        assert set(taps[backend.name]) == set(names)
        assert {k: v.shape for k, v in taps[backend.name].items()} == shapes
        np.testing.assert_allclose(taps[backend.name]["logits"], backend.logits(x), rtol=0, atol=1e-14)
    for name in names:  # the two models' taps are the same tensors (float64: to rounding)
        np.testing.assert_allclose(taps["torch"][name], taps["numpy"][name], rtol=0, atol=1e-13, err_msg=name)
    probs = taps["numpy"]["h.0.attn.probs"]
    assert np.allclose(probs.sum(-1), 1) and not np.triu(probs[0, 0], 1).any()  # causal, rows sum to 1


# ------------------------------------------------------------------------------------------ forward bugs (depth 0)


_STEP0: dict[tuple, dict] = {}


def step0(size: str, torch_dtype: str, plant: str | None) -> ParityResult:
    """The step-0 probes of torch and of the NumPy oracle with `plant` planted in the side tests/plants.py names
    (harness.run.probe.Recorder.start, what a parity worker records first; on medium the taps and logits only, to keep
    the test fast), compared as `harness parity` compares them. The unplanted torch probe is computed once per size
    and dtype."""
    from harness.backends.numpy_backend import NumpyBackend
    from harness.backends.torch_backend import TorchBackend
    from harness.core.data import BatchStream
    from harness.core.weights import init_weights

    corpus = _corpus()
    config = load_config(size).replace(dropout=0.0, steps=1)
    stream = BatchStream(corpus.train, config.block_size, config.batch_size, SEED, config.scheme)

    def record(backend: object) -> dict:
        backend.setup(config, init_weights(config, corpus.vocab_size, SEED), corpus.vocab_size, "cpu", SEED)
        if size == "small":
            return probe.Recorder(backend, config, stream, 0, 1).start()
        x, _ = stream.batch(0)
        x = x[:tap_rows(config)]
        return {"x": x, "logits": backend.logits(x), **{f"tap/{k}": v for k, v in backend.taps(x).items()}}

    in_torch = plant is not None and plants.PLANTS[plant][0] == "torch"
    if in_torch:
        with plants.planted(plant):
            other = record(TorchBackend(dtype=torch_dtype, parity=True))
    else:
        if (size, torch_dtype) not in _STEP0:
            _STEP0[size, torch_dtype] = record(TorchBackend(dtype=torch_dtype, parity=True))
        other = _STEP0[size, torch_dtype]
    with plants.planted(plant) if plant and not in_torch else contextlib.nullcontext():
        oracle = record(NumpyBackend())
    tol = default_tolerances(precision_pair(torch_dtype, "float64"), size)
    result = compare(other, oracle, [1.0], [1.0], tol, backends=("torch", "numpy"), config=config)
    result.inputs = (other, oracle)  # for a look at the taps themselves
    return result


FORWARD_BUGS = {  # plant: (the first divergent tap, a word its cause must contain)
    "ln-eps": ("h.0.ln_1", "LayerNorm"),
    "mask-wide": ("h.0.attn.probs", "mask"),
    "scale-1/D": ("h.0.attn.probs", "scale"),
    "gelu-exact": ("h.0.mlp.act", "GELU"),
    "pos-shift": ("emb", "position"),
    # torch's SDPA call alone: its written-out probabilities (the tap) stay right, its output y does not
    "torch-unscaled": ("h.0.attn.y", "the SDPA call's scale or mask: torch's attn.y is q, k, v attended with "
                                     "scale 1 instead of 1/sqrt(D)"),
}


@pytest.mark.parametrize("size, dtype", [("small", "float32"), ("small", "float64"), ("medium", "float32")])
@pytest.mark.parametrize("plant", list(FORWARD_BUGS))
def test_forward_bug_is_named_by_its_first_divergent_tap(plant: str, size: str, dtype: str) -> None:
    tap, word = FORWARD_BUGS[plant]
    result = step0(size, dtype, plant)
    assert not result.passed and result.first_tap == tap, result.failures
    i = next(i for i, f in enumerate(result.failures) if f.startswith("FAIL: forward"))
    # only a side's own inconsistency (its taps against its own forward pass) may be named before it
    assert all(" taps are not its " in f for f in result.failures[:i]), result.failures
    line = result.failures[i]
    assert line.startswith(f"FAIL: forward: first divergent activation {tap} (max abs ") and " at [" in line, line
    assert "likely cause: " in line and word in line.split("likely cause: ")[1], line
    assert result.taps_rel_err[tap] > 2 * result.tolerances.tap  # not by rounding noise
    later = [f for f in result.failures[1:] if f.startswith(("FAIL: logits", "FAIL: gradient"))]
    assert all(f.endswith(f"follows from the forward difference at {tap}") for f in later), later


def test_sdpa_scale_bug_names_the_attention_call() -> None:
    """A scale bug in torch's SDPA call only: y is q, k, v attended with scale 1 (checked against the
    oracle's own attention with that scale), and the diagnosis says so; the probabilities tapped agree."""
    result = step0("small", "float64", "torch-unscaled")
    assert result.taps_rel_err["h.0.attn.probs"] <= result.tolerances.tap
    assert "scale 1 instead of 1/sqrt(D) (D = 8)" in result.tap_cause, result.tap_cause
    (own,) = [f for f in result.failures if f.startswith("FAIL: torch's attention taps are not its attention")]
    assert "h.0.attn.y differs from its own h.0.attn.probs @ h.0.attn.v" in own
    # the independent truth: the oracle's own attention of the same q, k, v with scale 1 gives torch's y
    from harness.models import numpy_gpt

    q, k, v = (np.asarray(result.inputs[1][f"tap/h.0.attn.{x}"]) for x in "qkv")
    T = q.shape[-2]
    probs, _ = numpy_gpt.softmax_forward(np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, q @ k.swapaxes(-1, -2)))
    y = (probs @ v).transpose(0, 2, 1, 3).reshape(q.shape[0], T, -1)
    np.testing.assert_allclose(result.inputs[0]["tap/h.0.attn.y"], y, rtol=0, atol=1e-12)


def test_correct_backends_pass_depth_0_on_every_size() -> None:
    for size in ("small", "medium"):
        result = step0(size, "float32", None)
        assert result.first_tap is None and not [f for f in result.failures if "gradients" not in f], result.failures
        assert 0 < max(result.taps_rel_err.values()) < result.tolerances.tap / 5


def test_pattern_causes_of_other_forward_bugs() -> None:
    """The causes no planted oracle bug above reaches, on hand-made taps: unbiased variance, c_attn's row order,
    the head split, a transposed projection, ReLU, a post-LayerNorm residual, a tied lm_head."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 8))
    xc = x - x.mean(-1, keepdims=True)
    biased, unbiased = (xc / np.sqrt((xc ** 2).sum(-1, keepdims=True) / n + 1e-5) for n in (8, 7))
    assert layernorm_cause(unbiased, biased, x, None, None, ("a", "b")).startswith(
        "LayerNorm variance: a divides by C - 1")
    q, k, v = (rng.standard_normal((2, 2, 5, 4)) for _ in range(3))
    ta, tb = {"h.0.attn.q": k}, {"h.0.attn.q": q, "h.0.attn.k": k, "h.0.attn.v": v}
    assert "a's q is b's k" in qkv_cause("h.0.attn.q", ta, tb, ("a", "b"))
    swapped = q.transpose(0, 2, 1, 3).reshape(2, 5, 8)[..., ::-1].reshape(2, 5, 2, 4).transpose(0, 2, 1, 3)
    assert qkv_cause("h.0.attn.q", {"h.0.attn.q": swapped}, tb, ("a", "b")).startswith("the head split")
    w = rng.standard_normal((8, 8))
    assert "transposed" in linear_cause("c_proj", x @ w, x, w, None, ("a", "b"))
    fc = rng.standard_normal((2, 5, 16))
    tanh = 0.5 * fc * (1 + np.tanh(math.sqrt(2 / math.pi) * (fc + 0.044715 * fc ** 3)))
    assert "a computes the ReLU" in activation_cause(np.maximum(fc, 0), tanh, fc, ("a", "b"))
    emb, ln, proj = (rng.standard_normal((2, 5, 8)) for _ in range(3))
    tb = {"emb": emb, "h.0.ln_1": ln, "h.0.attn.proj": proj, "h.0.res1": emb + proj}
    assert "post-LayerNorm" in residual_cause("h.0.res1", {"h.0.res1": ln + proj}, tb, ("a", "b"))
    wte, lm = rng.standard_normal((11, 8)), rng.standard_normal((11, 8))
    params = {"wte.weight": wte, "lm_head.weight": lm, "lm_head.bias": np.zeros(11)}
    assert "a ties lm_head" in output_cause(ln @ wte.T, ln @ lm.T, ln, params, ("a", "b"))


# ------------------------------------------------------------------------------------------ the optimizer, re-synced


def resynced(size: str, steps: int, plant: str | None, torch_dtype: str = "float32",
             dropout: float = 0.0) -> ParityResult:
    """`harness parity` in process: the (planted) NumPy oracle trains as the reference, torch re-synchronises
    every step from it (harness.run.probe.run: the worker's code)."""
    from harness.backends.numpy_backend import NumpyBackend
    from harness.backends.torch_backend import TorchBackend

    corpus = _corpus()
    config = load_config(size).replace(dropout=dropout, steps=steps)
    with plants.planted(plant) if plant else contextlib.nullcontext():
        ref, ref_losses = probe.run(NumpyBackend(), config, corpus, SEED)
    other, losses = probe.run(TorchBackend(dtype=torch_dtype, parity=True), config, corpus, SEED, reference=ref,
                              reference_name="numpy")
    tol = default_tolerances(precision_pair(torch_dtype, "float64"), size)
    result = compare(other, ref, losses, ref_losses, tol, backends=("torch", "numpy"), config=config)
    result.inputs = (other, ref, losses, ref_losses)  # for a second look with other tolerances
    return result


@pytest.mark.parametrize("size, dtype", [("small", "float32"), ("small", "float64"), ("medium", "float32")])
def test_step_counter_that_stops_is_named_at_step_4(size: str, dtype: str) -> None:
    result = resynced(size, 4, "adam-t-stops", dtype)
    assert not result.passed and result.opt_reference == "numpy"
    (line,) = [f for f in result.failures if f.startswith("FAIL: optimizer step")]
    assert line.startswith("FAIL: optimizer step 4: ") and result.opt_first_bad[0] == 4, line
    assert "likely cause: AdamW's step counter: after step 4 torch's t is 4, numpy's 3" in line
    assert all(e <= result.tolerances.opt for k in (1, 2, 3) for q in result.opt_rel_err[k].values()
               for e in q.values())  # steps 1..3 agree: named where it first acts
    # probes without opt/<k>/adam_t (a port that does not write it): the counter is read from the updates, whose
    # common factor is the bias correction's at t = 3 against t = 4
    other, ref, losses, ref_losses = (
        {k: v for k, v in p.items() if not k.endswith("/adam_t")} if isinstance(p, dict) else p for p in result.inputs)
    assert not [k for k in (*other, *ref) if k.endswith("adam_t")]
    blind = compare(other, ref, losses, ref_losses, result.tolerances, backends=("torch", "numpy"),
                           config=load_config(size).replace(dropout=0.0, steps=4))
    (line,) = [f for f in blind.failures if f.startswith("FAIL: optimizer step")]
    assert line.startswith("FAIL: optimizer step 4: ") and ", exactly what the bias correction gives when numpy uses " \
        "t = 3 at step 4" in line, line
    # the factor measured (eps moves it a little) against the hand-computed (1 - b1^3) / (1 - b1^4) x
    # sqrt((1 - b2^4) / (1 - b2^3)) = 0.90969
    factor = float(re.search(r"the update is off by ([0-9.]+),", line).group(1))
    assert abs(factor / 0.90969 - 1) < 0.002, line


def test_per_parameter_clipping_is_named_where_the_norm_first_exceeds_one() -> None:
    result = resynced("small", 4, "clip-per-param")
    (line,) = [f for f in result.failures if f.startswith("FAIL: optimizer step")]
    assert line.startswith("FAIL: optimizer step 2: ") and "clipping" in line.split("likely cause: ")[1], line


@pytest.mark.parametrize("plant, dropout, step", [("dropout-in-step", 0.0, 1), ("masks-off-by-one", 0.2, 2)])
def test_wrong_inputs_of_a_training_step_are_named(plant: str, dropout: float, step: int) -> None:
    result = resynced("small", 3, plant, dropout=dropout)
    assert not [f for f in result.failures if f.startswith(("FAIL: forward", "FAIL: logits", "FAIL: gradient"))]
    assert result.step_loss_first_bad == step  # that step's loss from the very same state differs
    lines = [f for f in result.failures if f.startswith("FAIL: optimizer step")]
    assert lines and lines[0].startswith(f"FAIL: optimizer step {step}: ")
    assert "the wrong batch or dropout masks for this step" in lines[0]


def test_embeddings_not_decayed_fail_even_within_tolerance() -> None:
    result = resynced("small", 2, "no-decay-emb")
    (line,) = [f for f in result.failures if f.startswith("FAIL: optimizer step")]
    assert line.startswith("FAIL: optimizer step 1: wte.weight update rel err ") and "embeddings" in line, line
    assert "wte.weight -1.000, wpe.weight -1.000" in line
    # the difference (2e-3 of the update) is 10x below the free-run tolerance of before: the pattern still fails it
    loose = dataclasses.replace(result.tolerances, opt=1e-2)
    again = compare(*result.inputs, loose, backends=("torch", "numpy"), hyper=load_config("small").to_dict())
    (line,) = [f for f in again.failures if f.startswith("FAIL: optimizer step")]
    assert "within tol 0.01 but exactly the pattern below" in line and "embeddings" in line, line


def test_correct_backends_pass_every_resynced_step() -> None:
    result = resynced("small", 12, None)
    assert result.passed, result.failures
    assert sorted(result.opt_rel_err) == list(range(1, 13)) and len(result.step_loss_abs_dev) == 12
    assert result.worst_opt_rel_err < result.tolerances.opt / 10  # the rounding-level entries left out


def test_update_error_leaves_out_rounding_level_entries_only() -> None:
    u = np.array([1e-2, -2e-2, 3e-2, 5e-3, -1e-2])
    noisy = u.copy()
    noisy[3] = -5e-3  # an entry with a rounding-level gradient: Adam moves it by ~lr, differently
    v = np.array([1e-4, 4e-4, 9e-4, 1e-30, 0.0])
    assert update_error(noisy, u, v, v) == 0.0
    assert update_error(noisy, u, None, None) > 0.1
    decayed = u.copy()
    decayed[4] += 1e-3  # v exactly 0 (an unused token's row: decay only) is kept
    assert update_error(decayed, u, v, v) > 0.01


def test_update_error_floor_is_where_one_entrys_rounding_reaches_the_tolerance() -> None:
    """As measured: tied medium, seed 5, step 1, one entry of h.0.ln_2.weight with sqrt(v) at
    1.1e-4 of the parameter's median (a gradient of 1.4e-8 carrying its parameter's rounding, 3.3 eps of the
    gradient scale) moved by ~lr differently on each side: alone 1.3e-13 of the update in float64, a tenth of the
    tolerance. Below 1e-3 of the median an entry's update is rounding; above it, it is held to the update."""
    u, s = np.full(128, -1e-2), np.ones(128)  # every entry's Adam update is about lr, whatever its gradient
    s[7] = 1.1e-4  # sqrt(v) of the noisy entry, against the median 1
    noisy = u.copy()
    noisy[7] += 1.3e-13 * np.linalg.norm(u)  # the difference measured there
    assert update_error(noisy, u, s ** 2, s ** 2) == 0.0  # left out (it was kept with the floor at 1e-4)
    assert update_error(noisy, u, None, None) > 1e-13
    s[7] = 2e-3  # an entry above the floor is kept: a real difference there is seen
    assert update_error(noisy, u, s ** 2, s ** 2) > 1e-13


# ------------------------------------------------------------------------------------------ the other diagnoses


def test_optimizer_pattern_helpers() -> None:
    rng = np.random.default_rng(1)
    p = {"wte.weight": rng.standard_normal((5, 4)), "h.0.w": rng.standard_normal((4, 4)), "b": np.ones(4)}
    ub = {n: rng.standard_normal(a.shape) * 1e-2 for n, a in p.items()}
    ua = {n: (u + 1e-3 * p[n] if n == "wte.weight" else u + 1e-9 * rng.standard_normal(u.shape)) for n, u in ub.items()}
    ratios = decay_ratios(ua, ub, p, 1e-3)
    hit, cause = decay_cause(ratios, {n: a.shape for n, a in p.items()}, ("port", "oracle"))
    assert hit == ["wte.weight"] and "port does not decay the embeddings" in cause
    assert decay_cause(decay_ratios(ub, ub, p, 1e-3), {}, ("a", "b")) is None
    # a's update at step 4 with t = 4 against b's with t = 3: lr m / (1 - b1^t) / (sqrt(v) / sqrt(1 - b2^t)), so
    # a / b = (1 - b1^3) / (1 - b1^4) x sqrt((1 - b2^4) / (1 - b2^3)) = 0.271 / 0.3439 x sqrt(3.994e-3 / 2.997e-3)
    f = (1 - 0.9 ** 3) / (1 - 0.9 ** 4) * math.sqrt((1 - 0.999 ** 4) / (1 - 0.999 ** 3))
    assert abs(f - 0.90969) < 1e-5
    assert "off by 0.9097, exactly what the bias correction gives when b uses t = 3 at step 4" in \
        step_counter_cause(f, 4, 0.9, 0.999, ("a", "b"))
    assert "a uses t = 3 at step 4" in step_counter_cause(1 / f, 4, 0.9, 0.999, ("a", "b"))
    assert step_counter_cause(1.3, 4, 0.9, 0.999) is None
    live = {f"opt/{k}/{q}/w": np.full(3, float(k)) for k in (1, 2) for q in ("param", "adam_m", "adam_v")}
    same = {f"opt/{k}/{q}/w": np.zeros(3) for k in (1, 2) for q in ("param", "adam_m", "adam_v")}
    assert aliased_quantities(live, [1, 2]) == []
    assert aliased_quantities(same, [1, 2]) == ["param", "adam_m", "adam_v"]
    assert float32_stored_as_float64({"a": np.float32([0.1, 3]).astype(np.float64)})
    assert not float32_stored_as_float64({"a": np.array([0.1, 3.0])})


def test_loss_line_names_the_first_step_over_tolerance_and_the_peak() -> None:
    p = {"logits": np.zeros((1, 1, 2)), "grad/w": np.ones(3)}
    tol = Tolerances(1.0, 1.0, 1e-3, 1.0)
    r = compare(p, dict(p), [1.0, 1.0, 1.0, 1.0], [1.0, 1.002, 1.5, 1.0], tol)
    assert r.loss_first_bad == 1 and r.loss_peak_step == 2
    assert "FAIL: training loss: first over tol 0.001 at step 1 (abs dev 2.0e-03), peak 5.0e-01 at step 2" \
        in r.failures
    row = next(x for x in r.rows() if x["depth"] == "loss")
    assert row["first_broken"] == "step 1" and row["worst"] == "step 2 of 4"


def test_taps_of_a_side_that_are_not_its_forward_pass_fail() -> None:
    logits = np.random.default_rng(0).standard_normal((2, 3, 4))
    a = {"logits": logits, "grad/w": np.ones(2), "tap/logits": logits[:1] + 1e-3}
    b = {"logits": logits, "grad/w": np.ones(2), "tap/logits": logits[:1]}
    r = compare(a, b, [1.0], [1.0], Tolerances(1e-6, 1e-6, 1e-6, 1e-6, taps=1e-6))
    assert any(f.startswith("FAIL: a's activation taps are not its forward pass") for f in r.failures)


# ------------------------------------------------------------------------------------------ the command


def run_planted(tmp_path: Path, plant: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`harness parity ARGS` with `plant` planted in every process (the command and both workers)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(plants.SITECUSTOMIZE)
    path = os.pathsep.join([str(site), str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, HARNESS_TEST_PLANT=plant)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "parity", "--backends", "torch,numpy", "--data", DATA,
                           "--out", str(out), "--quiet", *args], env=env, capture_output=True, text=True, timeout=600)
    (record,) = out.glob("runs/*/parity.json")
    return proc, json.loads(record.read_text())


def test_cli_names_the_causal_mask_bug(tmp_path: Path) -> None:
    proc, rec = run_planted(tmp_path, "mask-wide", "--size", "small", "--steps", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    first = next(x for x in proc.stdout.splitlines() if x.startswith("FAIL: "))
    assert first.startswith("FAIL: forward: first divergent activation h.0.attn.probs (max abs 5.0e-01 at [")
    assert "likely cause: causal mask: numpy's query t attends to future keys up to s = t + 1" in first
    assert rec["results"]["taps"]["first_divergent"] == "h.0.attn.probs" and rec["verdict"] == "fail"
    assert "re-synchronised: torch takes each from numpy's state" in proc.stderr
