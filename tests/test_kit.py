"""`harness kit`: export a kit, run the outside port (examples/kit_torch_port.py, numpy + torch only) as a separate
program, and check its results: green in float32 and float64 (small, medium, with dropout), red with the parameter
and the cause named for every planted bug, exit 2 with one line for malformed results and tampered kits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.cli.main import main
from harness.core.taps import tap_names
from tests.conftest import data_path

REPO = Path(__file__).resolve().parents[1]
PORT = REPO / "examples" / "kit_torch_port.py"
# Runs the port like `python examples/kit_torch_port.py ARGS`, then fails if it imported anything of the harness.
OUTSIDE = ("import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
           "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('harness',)); "
           "sys.exit(f'the port imported {bad}') if bad else None")

pytest.importorskip("torch")


def export(out: Path, *args: str) -> Path:
    code = main(["kit", "export", "--out", str(out), "--data", str(data_path()), *args])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(tmp_path_factory.mktemp("kit") / "kit", "--size", "small", "--steps", "3")


@pytest.fixture(scope="module")
def kit_drop(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(tmp_path_factory.mktemp("kit") / "kit-drop", "--size", "small", "--steps", "3", "--dropout", "0.2")


@pytest.fixture(scope="module")
def kit_attn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kit with nanoGPT's fourth dropout site: masks for the attention probabilities too."""
    return export(tmp_path_factory.mktemp("kit") / "kit-attn", "--size", "small", "--steps", "3", "--dropout", "0.2",
                  "--set", "attn_dropout=true")


def run_port(kit: Path, out: Path, *args: str) -> Path:
    """The outside port in a fresh interpreter, as a stranger runs it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", OUTSIDE, str(PORT), str(kit), str(out), *args],
                          capture_output=True, text=True, env=env, cwd=out.parent, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def check(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(["kit", "check", *(str(a) for a in args)])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------------ export


def test_export_writes_a_small_self_describing_kit(kit: Path) -> None:
    from harness.backends import flux_layout
    from harness.kit.export import sha256

    manifest = json.loads((kit / "manifest.json").read_text())
    assert manifest["schema"] == "nanogpt-parity/kit" and manifest["schema_version"] == 1
    assert manifest["expected_dtype"] == "float64" and manifest["steps"] == 3 and manifest["size"] == "small"
    assert len(manifest["vocabulary"]) == manifest["vocab_size"] == 65
    assert set(manifest["tolerances"]) == {"float32", "float64"} and "opt" in manifest["tolerances"]["float32"]
    total = 0
    for name, entry in manifest["files"].items():
        blob = (kit / name).read_bytes()
        assert sha256(blob) == entry["sha256"] and len(blob) == entry["bytes"]
        total += len(blob)
    assert sorted(manifest["files"]) == ["batches.npz", "expected.npz", "weights.npz"]  # masks only with dropout
    assert total < 3e6, total  # "a few MB"
    with np.load(kit / "expected.npz") as f:
        keys = set(f.files)
        assert f["logits"].dtype == np.float64 and f["logits"].shape == (16, 64, 65)
    params = manifest["parameters"]
    taps = manifest["taps"]  # depth 0: every tap, in forward order, on the first rows of x[0]
    assert taps["names"] == tap_names(1) and taps["rows"] == 4 and taps["prefix"] == "tap/"
    assert set(taps["meaning"]) == set(taps["names"])
    assert keys == {"logits", "logits_loss", "loss", *(f"grad/{n}" for n in params),
                    *(f"opt/{k}/{q}/{n}" for k in (1, 2, 3) for q in ("param", "adam_m", "adam_v") for n in params),
                    *(f"tap/{n}" for n in taps["names"])}
    arrays = manifest["files"]["expected.npz"]["arrays"]
    assert arrays["tap/h.0.attn.probs"]["shape"] == [4, 2, 64, 64]
    assert arrays["tap/h.0.attn.probs"]["axes"] == ["batch", "head", "query", "key"]
    assert arrays["tap/h.0.attn.probs"]["flux_shape"] == [64, 64, 2, 4]  # NNlib's (key, query, head, batch)
    assert arrays["tap/h.0.attn.q"]["flux_shape"] == [8, 2, 64, 4]  # NNlib's split heads (D, H, T, B)
    assert arrays["tap/h.0.mlp.fc"]["shape"] == [4, 64, 64] and arrays["tap/emb"]["flux_shape"] == [16, 64, 4]
    with np.load(kit / "batches.npz") as f:
        x, y = f["x"], f["y"]
    assert x.shape == y.shape == (3, 16, 64) and x.dtype == np.int64 and x.min() >= 0 and x.max() < 65
    assert np.array_equal(x[:, :, 1:], y[:, :, :-1])  # targets are the inputs shifted by one
    layout = manifest["files"]["weights.npz"]["arrays"]
    flux = flux_layout.to_flux({"wte.weight": np.zeros((65, 16)), "h.0.mlp.c_fc.weight": np.zeros((64, 16))})
    assert layout["wte.weight"]["flux_shape"] == list(flux["wte.weight"].shape) == [16, 65]
    assert layout["h.0.mlp.c_fc.weight"]["flux_shape"] == [64, 16] and layout["wte.weight"]["order"] == "C"
    assert manifest["files"]["batches.npz"]["arrays"]["x"]["flux_per_step_shape"] == [64, 16]


def test_dropout_kit_holds_the_harness_masks(kit_drop: Path) -> None:
    from harness.config.load import load_config
    from harness.core.masks import dropout_masks

    manifest = json.loads((kit_drop / "manifest.json").read_text())
    config = load_config("small").replace(dropout=0.2, steps=3)
    with np.load(kit_drop / "masks.npz") as f:
        assert sorted(f.files) == ["emb", "h.0.attn", "h.0.mlp"]
        for k in range(3):
            for key, mask in dropout_masks(config, 1337, k).items():
                assert np.array_equal(f[key][k], mask)  # the very masks the parity engine hands the backends
    assert manifest["files"]["masks.npz"]["arrays"]["emb"]["flux_per_step_shape"] == [16, 64, 16]
    with np.load(kit_drop / "expected.npz") as f:
        assert "dropout_grad/lm_head.weight" in f.files


def test_attention_dropout_kit_holds_the_attention_masks(kit_attn: Path) -> None:
    """attn_dropout: masks.npz also holds h.i.attn.probs, (steps, B, H, T, T), the parity engine's masks; the
    manifest names them, their shape, axes and NNlib layout, and says where they act."""
    from harness.config.load import load_config
    from harness.core.masks import dropout_masks
    from harness.kit.schema import validate_manifest

    manifest = json.loads((kit_attn / "manifest.json").read_text())
    validate_manifest(manifest, kit_attn / "manifest.json")
    assert manifest["config"]["attn_dropout"] is True and manifest["model_options"]["attn_dropout"] is True
    config = load_config("small").replace(dropout=0.2, steps=3, attn_dropout=True)
    with np.load(kit_attn / "masks.npz") as f:
        assert sorted(f.files) == ["emb", "h.0.attn", "h.0.attn.probs", "h.0.mlp"]
        assert f["h.0.attn.probs"].shape == (3, 16, 2, 64, 64) and f["h.0.attn.probs"].dtype == np.bool_
        assert f["emb"].shape == (3, 16, 64, 16)
        for k in range(3):
            for key, mask in dropout_masks(config, 1337, k).items():
                assert np.array_equal(f[key][k], mask)
    arrays = manifest["files"]["masks.npz"]["arrays"]
    probs = arrays["h.0.attn.probs"]
    assert probs["shape"] == [3, 16, 2, 64, 64] and probs["dtype"] == "bool"
    assert probs["axes"] == ["step", "batch", "head", "query", "key"]
    assert probs["flux_per_step_shape"] == [64, 64, 2, 16] and "T_key, T_query, H, B" in probs["flux"]
    assert arrays["emb"]["axes"] == ["step", "batch", "time", "embd"]  # the other sites as before
    assert "h.i.attn.probs" in manifest["training"]["dropout"]
    assert "dropout on the attention probabilities (after the softmax" in manifest["model"]
    # the taps are taken under the step-0 attention masks, on their first rows, and the manifest says so
    assert manifest["taps"]["masks"] == ["h.0.attn.probs"] and "the step-0 masks apply" in manifest["taps"]["taken_on"]
    rows = manifest["taps"]["rows"]
    with np.load(kit_attn / "expected.npz") as e, np.load(kit_attn / "masks.npz") as m:
        keep = m["h.0.attn.probs"][0][:rows]
        y = (e["tap/h.0.attn.probs"] * keep / 0.8) @ e["tap/h.0.attn.v"]
        np.testing.assert_allclose(e["tap/h.0.attn.y"], y.transpose(0, 2, 1, 3).reshape(rows, 64, -1), atol=1e-14)


def test_taps_of_a_dropout_kit_without_attention_dropout_are_taken_with_dropout_off(kit_drop: Path) -> None:
    manifest = json.loads((kit_drop / "manifest.json").read_text())
    assert manifest["taps"]["masks"] == [] and manifest["taps"]["taken_on"].endswith("dropout off")


def test_a_kit_whose_taps_name_masks_it_lacks_is_malformed(kit_drop: Path, tmp_path: Path) -> None:
    import shutil

    from harness.errors import UsageError
    from harness.kit.load import load_kit

    bad = tmp_path / "kit"
    shutil.copytree(kit_drop, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["taps"]["masks"] = ["h.0.attn.probs"]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UsageError, match=r"masks.npz has no array 'h.0.attn.probs'.*'taps.masks'"):
        load_kit(bad)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_outside_port_is_green_with_attention_dropout(dtype: str, kit_attn: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """examples/kit_torch_port.py applies the attention masks as nanoGPT does: `harness kit check` passes."""
    results = run_port(kit_attn, tmp_path / "results.npz", "--dtype", dtype)
    code, out, _ = check(capsys, kit_attn, results)
    assert code == 0, out
    assert out.count(" ok ") == 8 and "PASS: the port agrees with the oracle" in out


def test_a_port_without_attention_dropout_fails_an_attention_kit(kit_attn: Path, kit_drop: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """The three-site kit's results (the same weights, batches and other masks) do not pass the attention kit: the
    attention masks change the dropout gradients and the training."""
    results = run_port(kit_drop, tmp_path / "results.npz", "--dtype", "float64")
    code, out, _ = check(capsys, kit_attn, results)
    assert code == 1 and "FAIL" in out, out
    assert "dropout masks" in out


# the attention dropout's bugs and the masks' (transposed, of another step), at the attention site and the
# others: (the kit, the depth, the tap named, the cause)
MASK_PLANTS = {
    ("attn-drop-after-v", "kit_attn"): ("taps", "h.0.attn.y", "the dropout acts on y after the value product"),
    ("attn-drop-unscaled", "kit_attn"): ("taps", "h.0.attn.y", "not rescaled: the kept probabilities are not "
                                                               "divided by 1 - p"),
    ("attn-drop-missing", "kit_attn"): ("taps", "h.0.attn.y", "the attention dropout is missing"),
    ("masks-transposed", "kit_attn"): ("taps", "h.0.attn.y", "dropout masks transposed: port drops the attention "
                                       "probabilities (h.0.attn.probs) with the mask transposed (query and key "
                                       "swapped"),
    # (masks-previous-step at the attention site and masks-transposed at the others: tests/test_attention_parity.py)
    ("masks-previous-step", "kit_drop"): ("dropout_gradients", None, "masks of another step: port applies, at every "
                                          "site, the masks of step 2 where step 0's were handed (step k reading "
                                          "masks[k - 1]: step 0 wraps around to the last step)"),
}


@pytest.mark.parametrize("plant, which", list(MASK_PLANTS))
def test_mask_and_attention_dropout_bugs_are_named_with_their_cause(plant: str, which: str,
                                                                    request: pytest.FixtureRequest, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    depth, tap, cause = MASK_PLANTS[plant, which]
    kit = request.getfixturevalue(which)
    results = run_port(kit, tmp_path / "results.npz", "--dtype", "float32", "--plant", plant)
    code, out, _ = check(capsys, kit, results)
    assert code == 1, out
    diagnosis = json.loads((tmp_path / "results.check.json").read_text())["diagnosis"]
    assert diagnosis["depth"] == depth and diagnosis.get("tap") == tap, diagnosis
    assert cause in diagnosis["cause"] and "placement or scaling" not in diagnosis["cause"], diagnosis
    assert cause in out


@pytest.mark.parametrize("args, message", [
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--steps", "5000"], "--steps 5000 is more than"),
    (["--config", "/nonexistent.toml"], "does not exist"),
])
def test_export_bad_input_exit_2_nothing_written(args: list[str], message: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "kit"
    code = main(["kit", "export", "--data", str(data_path()), "--out", str(out), *args])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_export_never_writes_over_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "mine.txt").write_text("keep")
    code = main(["kit", "export", "--data", str(data_path()), "--out", str(tmp_path / "kit")])
    assert code == 2 and "is not empty" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "kit").iterdir()) == ["mine.txt"]


# ------------------------------------------------------------------------------------------ the outside port


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("which", ["kit", "kit_drop"])
def test_outside_port_is_green(which: str, dtype: str, request: pytest.FixtureRequest, tmp_path: Path,
                               capsys: pytest.CaptureFixture) -> None:
    kit = request.getfixturevalue(which)
    results = run_port(kit, tmp_path / "results.npz", "--dtype", dtype)
    code, out, _ = check(capsys, kit, results)
    assert code == 0, out
    assert "PASS: the port agrees with the oracle at taps, logits, gradients, " in out
    # every depth graded, the rate of each step and the loss of each step from the port's state
    assert out.count(" ok ") == (8 if which == "kit_drop" else 7)
    verdict = json.loads((tmp_path / "results.check.json").read_text())
    assert verdict["verdict"] == "pass" and verdict["dtype"] == dtype and verdict["diagnosis"] is None
    assert verdict["results"]["optimizer"]["steps"] == [1, 2, 3]
    page = (tmp_path / "results.check.html").read_text()
    assert "PASS" in page and "<script" not in page and "http" not in page.replace("harness parity", "")


def test_outside_port_is_green_on_medium(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    kit = export(tmp_path / "kit", "--size", "medium", "--steps", "2")
    for dtype in ("float32", "float64"):
        results = run_port(kit, tmp_path / f"{dtype}.npz", "--dtype", dtype)
        code, out, _ = check(capsys, kit, results)
        assert code == 0, out


NANOGPT_OPTIONS = ["--set", "tie_embeddings=true", "--set", "gelu=exact", "--set", "bias=false", "--set",
                   "lm_head_bias=false"]


def test_a_correct_port_passes_the_kit_with_nanogpt_options_on_medium(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """The attack: a kit of medium with nanoGPT's options (5 steps). A correct
    port's free-running states drift from the oracle's (4e-12 at step 5 in float64, 8e-4 in float32, growing about
    tenfold a step), so each of its steps is graded from its own state before it: then it agrees to rounding."""
    kit = export(tmp_path / "kit", "--size", "medium", *NANOGPT_OPTIONS)
    for dtype, worst in (("float64", 1e-13), ("float32", 1e-4)):
        results = run_port(kit, tmp_path / f"{dtype}.npz", "--dtype", dtype)
        code, out, _ = check(capsys, kit, results)
        assert code == 0, out
        assert "float32 computed" not in out
        verdict = json.loads((tmp_path / f"{dtype}.check.json").read_text())
        optimizer = verdict["results"]["optimizer"]
        assert optimizer["steps"] == [1, 2, 3, 4, 5] and optimizer["resynchronised_from"] == "port"
        assert optimizer["worst_rel_err"] < worst  # 10x below the tolerance, as the tolerances were measured


def test_a_correct_float32_port_passes_a_kit_in_its_warm_up(kit: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    """nanoGPT's schedule (learning rate 1e-3, warm-up 100 steps): step 1 moves every LayerNorm gain of 1 by 1e-5,
    which float32 stores to 6e-8, so the updates of a correct float32 port differ by 1e-3 of themselves from
    storage alone; the update's error allows for the parameter's storage rounding."""
    schedule = ["--set", "learning_rate=0.001", "--set", "lr_schedule=cosine", "--set", "warmup_steps=100",
                "--set", "decay_steps=2000", "--set", "min_lr=0.0001"]
    warm = export(tmp_path / "kit", "--size", "small", "--steps", "3", *schedule)
    results = run_port(warm, tmp_path / "results.npz", "--dtype", "float32")
    code, out, _ = check(capsys, warm, results)
    assert code == 0, out
    results = run_port(warm, tmp_path / "decay.npz", "--dtype", "float32", "--plant", "decay-1d")
    code, out, _ = check(capsys, warm, results)  # a defect of that size is still seen there
    assert code == 1 and "likely cause: weight decay applied to 1-D parameters" in out, out


def test_the_float32_hint_needs_float32_evidence(kit: Path, good: dict, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    """Float64 results whose step-0 depths agree to float64 rounding and whose one difference is
    late (an optimizer step off by 1e-7 of itself, within the float32 tolerances) were told "float32 computed,
    float64 written". The hint needs the evidence it names: float32 values, or every step-0 depth at float32
    rounding level."""
    late = dict(good)
    start, end = (good[f"opt/{k}/param/h.0.attn.c_attn.weight"] for k in (2, 3))
    late["opt/3/param/h.0.attn.c_attn.weight"] = start + (end - start) * (1 + 1e-7)
    np.savez(tmp_path / "late.npz", **late)
    code, out, _ = check(capsys, kit, tmp_path / "late.npz")
    assert code == 1 and "first broken: optimizer, parameter h.0.attn.c_attn.weight" in out, out
    assert "float32 computed" not in out and "--dtype float32" not in out, out
    # a float32 computation upcast to float64, no value a float32 number: the step-0 depths show it
    f32 = run_port(kit, tmp_path / "f32.npz", "--dtype", "float32")
    with np.load(f32) as f:
        upcast = {k: f[k].astype(np.float64) * (1 + 1e-12) for k in f.files}
    np.savez(tmp_path / "upcast.npz", **upcast)
    code, out, _ = check(capsys, kit, tmp_path / "upcast.npz")
    assert code == 1 and "likely cause: float32 computed, float64 written" in out, out
    assert "the step-0 values deviate by more than float64 rounding" in out, out  # the evidence it has, named
    assert "every value is a float32 number" not in out, out  # and only that


# planted bug: (the kit, the text that must be printed, what the named parameter must satisfy)
PLANTS = {  # the forward bugs, named by their tap: tests/test_parity_taps.py
    "no-bias-correction": ("kit", "likely cause: bias correction", None),
    "decay-1d": ("kit", "likely cause: weight decay applied to 1-D parameters", "1-D"),
    "clip-0.5": ("kit", "likely cause: gradient clipping", None),
    "eps-1e-6": ("kit", "likely cause: eps", None),
    "beta2-0.99": ("kit", "likely cause: beta2", None),
    "coupled-decay": ("kit", "likely cause: coupled (L2) weight decay", "2-D"),
    "dropout-on-attn-probs": ("kit_drop", "likely cause: dropout (placement or scaling", None),
    "dropout-scale-p": ("kit_drop", "likely cause: dropout (placement or scaling", None),
    "dropout-before-proj": ("kit_drop", "likely cause: dropout (placement or scaling", "h.0.attn."),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_bug_is_red_with_the_parameter_named(plant: str, request: pytest.FixtureRequest, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    which, text, named = PLANTS[plant]
    kit = request.getfixturevalue(which)
    results = run_port(kit, tmp_path / "results.npz", "--dtype", "float32", "--plant", plant)
    code, out, _ = check(capsys, kit, results)
    assert code == 1, out
    assert text in out, out
    verdict = json.loads((tmp_path / "results.check.json").read_text())
    diagnosis, tol = verdict["diagnosis"], verdict["tolerances"]
    shapes = json.loads((kit / "manifest.json").read_text())["parameters"]
    name = diagnosis["parameter"]
    expected_depth = "dropout_gradients" if which == "kit_drop" else "optimizer"
    assert diagnosis["depth"] == expected_depth and name in shapes
    assert f"first broken: {expected_depth}, parameter {name}" in out
    if named == "1-D":
        assert len(shapes[name]) == 1
    elif named == "2-D":
        assert len(shapes[name]) == 2
    elif named:
        assert name.startswith(named), name
    assert "FAIL: logits" not in out  # caught where it is, not before
    if which == "kit_drop":  # by a wide margin, not by noise
        assert verdict["results"]["dropout_gradients"]["worst_rel_err"] > 100 * tol["grad"]
    else:
        assert verdict["results"]["optimizer"]["worst_rel_err"] > 10 * tol["opt"]


def test_a_forward_only_port_checks_logits_alone(kit: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    results = run_port(kit, tmp_path / "logits.npz", "--dtype", "float64", "--depths", "logits")
    code, out, _ = check(capsys, kit, results)
    assert code == 0 and "not given: taps, gradients, optimizer, loss" in out, out
    assert out.count("not given") == 5  # four table rows and the summary line
    assert "logits: the same as the taps (a missing lm_head.bias passes" in out  # what a logits-only check misses
    results = run_port(kit, tmp_path / "bad.npz", "--dtype", "float64", "--depths", "logits", "--plant", "attn-scale")
    code, out, _ = check(capsys, kit, results)
    assert code == 1 and "FAIL: logits max abs diff" in out
    assert "write the activation taps (tap/<name>) to have the layer named" in out  # the checklist, no taps


# ------------------------------------------------------------------------------------------ malformed input


@pytest.fixture(scope="module")
def good(kit: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    path = run_port(kit, tmp_path_factory.mktemp("good") / "results.npz", "--dtype", "float64")
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _drop(r: dict) -> dict:
    r.pop("grad/h.0.ln_2.bias")
    return r


MALFORMED = {
    "missing name": (_drop, "'grad/h.0.ln_2.bias' is missing"),
    "missing opt step": (lambda r: {k: v for k, v in r.items() if not k.startswith("opt/1/adam_v/wte")},
                         "'opt/1/adam_v/wte.weight' is missing"),
    "wrong shape": (lambda r: {**r, "logits": r["logits"].transpose(2, 1, 0)}, "has shape (65, 64, 16)"),
    "wrong dtype": (lambda r: {**r, "loss": r["loss"].astype(np.int64)}, "has dtype int64"),
    "NaN": (lambda r: {**r, "grad/wte.weight": np.where(np.arange(16) == 3, np.nan, r["grad/wte.weight"])},
            "holds nan at index (0, 3)"),
    "unknown name": (lambda r: {**r, "grads/wte.weight": r["grad/wte.weight"]}, "unknown array 'grads/wte.weight'"),
    "step beyond the kit": (lambda r: {**r, "opt/9/param/wte.weight": r["opt/1/param/wte.weight"]},
                            "k must be 1..3"),
    "mixed dtypes": (lambda r: {**r, "logits": r["logits"].astype(np.float32)}, "mix float32 and float64"),
    "empty": (lambda r: {}, "hold no arrays"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_results_exit_2_one_line_nothing_written(case: str, kit: Path, good: dict, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    change, message = MALFORMED[case]
    path = tmp_path / "results.npz"
    np.savez(path, **change(dict(good)))
    code, out, err = check(capsys, kit, path)
    assert code == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.npz"]  # no page, no verdict


def test_results_file_errors_exit_2(kit: Path, good: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    np.savez(tmp_path / "f32.npz", **{k: v.astype(np.float32) for k, v in good.items()})
    for args, message in [
        ([tmp_path / "none.npz"], "does not exist"),
        ([tmp_path / "junk.npz"], "not a readable .npz"),
        ([tmp_path / "f32.npz", "--dtype", "float64"], "cannot carry float64 results"),
    ]:
        code, out, err = check(capsys, kit, *args)
        assert out == ""
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_tampered_or_incomplete_kit_exit_2(kit: Path, good: dict, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    import shutil

    results = tmp_path / "results.npz"
    np.savez(results, **good)
    bad = tmp_path / "kit"
    shutil.copytree(kit, bad)
    blob = bytearray((bad / "expected.npz").read_bytes())
    blob[len(blob) // 2] ^= 1  # one flipped bit in the oracle's answers
    (bad / "expected.npz").write_bytes(bytes(blob))
    code, out, err = check(capsys, bad, results)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "kit file expected.npz does not match its sha256" in err
    (bad / "expected.npz").unlink()
    code, _, err = check(capsys, bad, results)
    assert code == 2 and "kit file expected.npz is missing" in err
    (bad / "manifest.json").unlink()
    code, _, err = check(capsys, bad, results)
    assert code == 2 and "has no manifest.json" in err
    assert not (tmp_path / "results.check.json").exists()


@pytest.mark.parametrize("where", ["logits", "opt/2/adam_v/h.0.attn.c_attn.weight", "loss"])
def test_a_kit_whose_answers_hold_nan_is_malformed_not_a_failing_port(where: str, kit: Path, good: dict,
                                                                      tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """The attack: NaN in expected.npz, the manifest's size and sha256 made to match. The port is
    not failing (exit 1): the kit is malformed (exit 2, one line, nothing written)."""
    import hashlib
    import shutil

    from harness.kit.export import npz_bytes

    results = tmp_path / "results.npz"
    np.savez(results, **good)
    bad = tmp_path / "kit"
    shutil.copytree(kit, bad)
    expected = dict(np.load(bad / "expected.npz"))
    expected[where] = expected[where].copy()
    expected[where].flat[0] = np.nan
    blob = npz_bytes(expected)
    (bad / "expected.npz").write_bytes(blob)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"]["expected.npz"].update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    (bad / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = check(capsys, bad, results)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
    assert f"kit file expected.npz: array {where!r} holds nan" in err and "export the kit again" in err
    assert not (tmp_path / "results.check.json").exists() and not (tmp_path / "results.check.html").exists()


# ------------------------------------------------------------------------------------------ the Julia example
# No Julia here: the example is checked statically against the package it calls and the kit it reads.
JULIA_PORT = REPO / "examples" / "kit_flux_port.jl"


def test_julia_port_calls_only_what_nanogptflux_exports_and_reads_real_manifest_keys(kit: Path) -> None:
    import re

    source = JULIA_PORT.read_text()
    package = (REPO / "julia" / "NanoGPTFlux" / "src" / "NanoGPTFlux.jl").read_text()
    exported = set(re.findall(r"[A-Za-z_!]+", package.split("export", 1)[1].split("include", 1)[0]))
    called = set(re.findall(r"NanoGPTFlux\.([A-Za-z_!]+)\(", source))
    assert called and called <= exported, called - exported
    manifest = json.loads((kit / "manifest.json").read_text())
    block = source.split("const CONFIG_KEYS = [", 1)[1].split("]", 1)[0]
    assert set(re.findall(r'"(\w+)"', block)) <= set(manifest["config"])
    for key in re.findall(r'manifest\["(\w+)"\]', source):
        assert key in manifest, key
    for name in re.findall(r'joinpath\(kit, "([\w.]+)"\)', source):
        assert name == "manifest.json" or name in manifest["files"] or name == "masks.npz", name


@pytest.mark.skipif(not __import__("shutil").which("fatou"), reason="fatou is not installed")
def test_julia_port_is_fatou_clean() -> None:
    for args in (["lint"], ["format", "--check"]):
        proc = subprocess.run(["fatou", *args, str(JULIA_PORT)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_prefix_of_the_steps_is_checked(kit: Path, good: dict, tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "results.npz"
    np.savez(path, **{**{k: v for k, v in good.items() if not k.startswith("opt/3/")}, "loss": good["loss"][:2]})
    code, out, _ = check(capsys, kit, path)
    assert code == 0 and "optimizer steps 1..2" in out and " of 2\n" in out, out
    verdict = json.loads((tmp_path / "results.check.json").read_text())
    assert verdict["optimizer_steps_given"] == 2 and verdict["loss_steps_given"] == 2
    np.savez(path, **{**good, "opt/2/param/wte.weight": good["opt/2/param/wte.weight"] + 1e-3})
    code, out, _ = check(capsys, kit, path)
    assert code == 1 and "first broken: optimizer, parameter wte.weight (first at step 2" in out, out


def test_check_out_is_where_the_page_and_verdict_go(kit: Path, good: dict, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """`kit check --out DIR` (as every command's --out): DIR is created and holds both files; nothing lands beside
    the results file. An --out that cannot be a directory is one line, exit 2, nothing written."""
    path = tmp_path / "port" / "results.npz"
    path.parent.mkdir()
    np.savez(path, **good)
    code, out, _ = check(capsys, kit, path, "--out", tmp_path / "checks" / "today")
    assert code == 0, out
    assert sorted(p.name for p in (tmp_path / "checks" / "today").iterdir()) == ["results.check.html",
                                                                                 "results.check.json"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["results.npz"]
    (tmp_path / "afile").write_text("x")
    code, out, err = check(capsys, kit, path, "--out", tmp_path / "afile" / "sub")
    assert code == 2 and "not a directory" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["results.npz"]


# ------------------------------------------------------------- the planted bugs that parity names, through the kit
# port plant: (kit, port dtype, port depths, what "first broken:" names, a word of the likely cause)
PLANTED_THROUGH_THE_KIT = {
    "tied": ("kit", "float32", None, "taps, tap logits", "tied"),
    "tied (logits only)": ("kit", "float32", "logits", "logits", "tied"),
    "no-decay-emb": ("kit", "float32", None, "optimizer, parameter wte.weight", "embeddings"),
    "aliased": ("kit", "float32", None, "optimizer", "aliased"),
    "masks-off-by-one": ("kit_drop", "float32", None, "optimizer", "the wrong batch or dropout masks"),
    "float64-file": ("kit", "float32", None, "taps, tap emb", "--dtype float32"),  # computed in float32
    "ln-eps": ("kit", "float32", None, "taps, tap h.0.ln_1", "LayerNorm"),
    "pos-shift": ("kit", "float32", None, "taps, tap emb", "position"),
    "attn-scale": ("kit", "float32", None, "taps, tap h.0.attn.probs", "scale"),
}


@pytest.mark.parametrize("case", list(PLANTED_THROUGH_THE_KIT))
def test_issue20_bugs_through_the_kit_are_named(case: str, request: pytest.FixtureRequest, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    which, dtype, depths, named, word = PLANTED_THROUGH_THE_KIT[case]
    kit = request.getfixturevalue(which)
    args = ["--dtype", dtype, "--plant", case.split(" ")[0]] + (["--depths", depths] if depths else [])
    results = run_port(kit, tmp_path / "results.npz", *args)
    code, out, _ = check(capsys, kit, results)
    assert code == 1, out
    first = next(x for x in out.splitlines() if x.startswith("first broken: "))
    cause = next(x for x in out.splitlines() if x.startswith("likely cause: "))
    assert first.startswith(f"first broken: {named}"), out
    assert word in cause, cause
    page = (tmp_path / "results.check.html").read_text()
    verdict = json.loads((tmp_path / "results.check.json").read_text())
    # the failure is stated once: the "First broken" section gives its detail and cause (a hint equal to the cause
    # is not repeated); its own line is not listed again among the other failed checks, each of which is listed once
    diagnosis = verdict["diagnosis"]
    assert page.count(as_html(diagnosis["cause"])) == 1 and page.count(as_html(diagnosis["detail"])) == 1
    (first,) = [f for f in verdict["failures"] if f not in verdict["other_failures"]]
    assert as_html(first) not in page
    assert all(page.count(as_html(f)) == 1 for f in verdict["other_failures"]), verdict["other_failures"]
    assert "<th>first broken</th><th>worst</th>" in page and "What the depths given cannot see" in page


def as_html(text: str) -> str:
    """A message as every page renders it (harness.pages.inline: escaped, `code` and numbers marked up)."""
    from harness.pages import inline

    return str(inline(text))


def test_a_logits_only_port_without_lm_head_bias_passes_and_is_told_why(kit: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    results = run_port(kit, tmp_path / "r.npz", "--dtype", "float64", "--depths", "taps,logits", "--plant",
                       "no-lm-bias")
    code, out, _ = check(capsys, kit, results)
    assert code == 0 and "a missing lm_head.bias passes" in out, out  # the blind spot, said where it matters
    results = run_port(kit, tmp_path / "full.npz", "--dtype", "float64", "--plant", "no-lm-bias")
    code, out, _ = check(capsys, kit, results)
    assert code == 1 and "likely cause: lm_head.bias gets no gradient in port" in out, out


def test_unreadable_results_get_the_harness_s_own_words(kit: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    import pickle

    for name, blob, words in [("junk.npz", b"not a zip at all", "does not start with the zip signature"),
                              ("pickle.npz", pickle.dumps({"logits": [1, 2]}), "a Python pickle"),
                              ("one.npz", None, "a single .npy array")]:
        path = tmp_path / name
        if blob is None:
            np.save(open(path, "wb"), np.zeros(3))
        else:
            path.write_bytes(blob)
        code, out, err = check(capsys, kit, path)
        assert code == 2 and out == "" and words in err, err
        assert "allow_pickle" not in err and len(err.strip().splitlines()) == 1


def test_a_port_whose_rate_alone_is_off_is_named_at_the_learning_rate(kit: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """Every rate 0.05 % too high moves the updates by less than the optimizer's tolerance, but the rate each step
    took is held to a tenth of it: the check fails there, with its own row and diagnosis (no traceback)."""
    results = run_port(kit, tmp_path / "results.npz", "--dtype", "float32", "--plant", "lr-slightly-off")
    code, out, _ = check(capsys, kit, results)
    assert code == 1, out
    assert "first broken: learning_rate" in out and "FAIL: learning rate of optimizer step 1" in out, out
    # in float64 the optimizer depth fails too, at the same step, and names the rate as its cause
    results = run_port(kit, tmp_path / "results64.npz", "--dtype", "float64", "--plant", "lr-slightly-off")
    code, out, _ = check(capsys, kit, results)
    assert code == 1 and "FAIL: optimizer step 1:" in out and "likely cause: the learning rate:" in out, out
    verdict = json.loads((tmp_path / "results.check.json").read_text())
    assert verdict["diagnosis"]["depth"] == "learning_rate"
    assert any(f.startswith("FAIL: learning rate of optimizer step 1:") for f in verdict["failures"]), verdict
    # the table's row of the rate: the planted 0.05 % (the port steps with 1.0005 x the rate), marked FAIL
    row = next(x for x in out.splitlines() if x.startswith("learning rate per step vs schedule")).split()
    assert row[8] == "FAIL" and float(row[6]) == pytest.approx(5e-4, rel=0.01), row
