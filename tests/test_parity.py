"""`harness parity`: the comparison functions against hand-made arrays, a planted bug, the CLI end to end and
its bad-input handling (exit 2, one line, nothing written)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import data_path

from harness.cli import parity
from harness.cli.main import main
from harness.core.taps import tap_names
from harness.errors import UsageError
from harness.parity.compare import compare
from harness.parity.numeric import loss_deviation, max_abs_diff, relative_error
from harness.parity.record import EXIT_CRASH
from harness.parity.result import ParityResult
from harness.parity.states import opt_state
from harness.parity.tolerances import DEFAULT_TOLERANCES, TOL_KEYS, Tolerances, default_tolerances, precision_pair
from tests import plants

REPO = Path(__file__).resolve().parents[1]
DATA = str(data_path())
LOOSE = Tolerances(logits=1.0, grad=1.0, loss=1.0, opt=1.0)


# ------------------------------------------------------------------------------------------ hand-made arrays


def make_probe(rng: np.random.Generator) -> dict[str, np.ndarray]:
    x = rng.integers(0, 7, size=(2, 3))
    return {"logits": rng.standard_normal((2, 3, 7)), "x": x, "y": np.roll(x, -1, axis=1),
            "grad/w": rng.standard_normal((4, 5)), "grad/b": rng.standard_normal(5)}


def test_max_abs_diff_finds_value_and_index() -> None:
    a = np.zeros((2, 3, 4))
    b = a.copy()
    b[1, 2, 3] = 0.5
    b[0, 0, 0] = -0.25
    assert max_abs_diff(a, b) == (0.5, (1, 2, 3))
    assert max_abs_diff(a, a) == (0.0, (0, 0, 0))


def test_max_abs_diff_is_computed_in_float64() -> None:
    a = np.ones(3, dtype=np.float32)
    b = np.ones(3, dtype=np.float64)
    b[2] += 1e-12  # invisible in float32
    value, index = max_abs_diff(a, b)
    assert index == (2,)
    assert value == pytest.approx(1e-12, rel=1e-3)


def test_max_abs_diff_nan_is_never_within_tolerance() -> None:
    b = np.array([0.0, np.nan, 5.0])
    value, index = max_abs_diff(np.zeros(3), b)
    assert math.isnan(value) and index == (1,)


def test_relative_error_known_values() -> None:
    a = np.array([3.0, 4.0])  # norm 5
    b = np.array([3.6, 4.8])  # norm 6; a - b = (-0.6, -0.8), norm 1
    assert relative_error(a, b) == pytest.approx(1 / 6, rel=1e-12)
    assert relative_error(b, a) == relative_error(a, b)  # symmetric
    assert relative_error(np.zeros(4), np.zeros(4)) == 0.0  # two zero gradients agree
    assert relative_error(np.zeros(2), np.array([0.0, 1e-20])) == 1.0  # zero vs tiny: completely different
    assert math.isnan(relative_error(a, np.array([np.inf, 4.0])))
    with pytest.raises(ValueError):
        relative_error(np.zeros(2), np.zeros(3))


def test_loss_deviation_peak_and_curve() -> None:
    value, step, curve = loss_deviation([1.0, 2.0, 3.0], [1.0, 2.1, 2.95])
    assert value == pytest.approx(0.1) and step == 1
    assert curve == pytest.approx([0.0, 0.1, 0.05])
    value, step, _ = loss_deviation([1.0, 2.0, float("nan")], [1.0, 5.0, 3.0])
    assert math.isnan(value) and step == 2


def test_step_loss_row_value_and_worst_name_the_same_step() -> None:
    r = ParityResult(backends=("a", "b"), tolerances=LOOSE, step_loss_abs_dev=[1e-6, math.nan, 0.5, 0.1])
    (row,) = [x for x in r.rows() if x["depth"] == "step_loss"]
    assert math.isnan(row["value"]) and row["worst"] == "step 2 of 4"  # the NaN, not the largest finite (step 3)
    r.step_loss_abs_dev = [1e-6, 0.5, 0.1]
    (row,) = [x for x in r.rows() if x["depth"] == "step_loss"]
    assert row["value"] == 0.5 and row["worst"] == "step 2 of 3"


def test_state_at_reads_a_probe_state_as_a_state_dict() -> None:
    from harness.run.probe import state_at

    w0, w1, m1, v1 = np.arange(3.0), np.ones(3), np.full(3, 0.1), np.full(3, 0.01)
    p = {"opt/0/param/w": w0, "opt/1/param/w": w1, "opt/1/adam_m/w": m1, "opt/1/adam_v/w": v1,
         "opt/10/param/w": w0, "grad/w": w1}
    s0 = state_at(p, 0)  # the initial parameters: zero moments, t = 0
    assert sorted(s0) == ["adam_m/w", "adam_t", "adam_v/w", "param/w"] and int(s0["adam_t"]) == 0
    assert s0["param/w"] is w0 and not s0["adam_m/w"].any() and not s0["adam_v/w"].any()
    s1 = state_at(p, 1)  # not opt/10/...; t = the step where the probe holds none
    assert sorted(s1) == ["adam_m/w", "adam_t", "adam_v/w", "param/w"] and int(s1["adam_t"]) == 1
    assert s1["param/w"] is w1 and s1["adam_m/w"] is m1 and s1["adam_v/w"] is v1
    assert state_at({**p, "opt/1/adam_t": np.array(7)}, 1)["adam_t"] == 7 and state_at(p, 2) == {}
    assert opt_state(p, 1)["adam_m"]["w"].dtype == np.float64


def test_compare_identical_passes_with_zero_tolerance() -> None:
    p = make_probe(np.random.default_rng(0))
    r = compare(p, dict(p), [3.0, 2.5], [3.0, 2.5], Tolerances(0.0, 0.0, 0.0, 0.0), val_losses=(2.0, 2.0))
    assert r.passed, r.failures
    assert r.logits_max_abs == 0.0 and r.worst_grad_rel_err == 0.0 and r.loss_max_abs_dev == 0.0
    assert r.val_loss_abs_diff == 0.0 and r.loss_steps == 2


def test_compare_names_the_worst_gradient() -> None:
    p = make_probe(np.random.default_rng(1))
    q = dict(p)
    q["grad/w"] = p["grad/w"] * (1 + 1e-3)  # relative error exactly 1e-3 / (1 + 1e-3)
    q["grad/b"] = p["grad/b"] * (1 + 1e-6)
    r = compare(p, q, [1.0], [1.0], Tolerances(logits=1e-9, grad=1e-4, loss=1e-9, opt=1e-9),
                backends=("torch", "numpy"))
    assert r.worst_grad == "w"
    assert r.worst_grad_rel_err == pytest.approx(1e-3 / (1 + 1e-3), rel=1e-6)
    assert r.grad_rel_err["b"] == pytest.approx(1e-6 / (1 + 1e-6), rel=1e-4)
    assert r.failures == ["FAIL: gradient w rel err 1.0e-03 > tol 0.0001"]
    assert compare(p, q, [1.0], [1.0], Tolerances(logits=1e-9, grad=1e-2, loss=1e-9, opt=1e-9)).passed


def test_compare_logits_loss_and_val_failures() -> None:
    p = make_probe(np.random.default_rng(2))
    q = dict(p)
    q["logits"] = p["logits"].copy()
    q["logits"][1, 0, 6] += 2e-3
    r = compare(p, q, [4.0, 3.0, 2.0], [4.0, 3.0, 2.0 + 5e-4], Tolerances(logits=1e-3, grad=1e-4, loss=1e-4, opt=1e-4),
                val_losses=(1.5, 1.5 + 2e-4))
    assert r.logits_max_abs == pytest.approx(2e-3) and r.logits_where == (1, 0, 6)
    assert r.loss_max_abs_dev == pytest.approx(5e-4) and r.loss_peak_step == 2
    assert r.val_loss_abs_diff == pytest.approx(2e-4)
    kinds = [f.split()[1] for f in r.failures]
    assert kinds == ["logits", "training", "final"], r.failures
    assert "at step 2" in r.failures[1]
    rows = {row["check"]: row["result"] for row in r.rows()}
    assert list(rows.values()) == ["FAIL", "ok", "FAIL", "FAIL"]


def test_compare_structural_problems_fail() -> None:
    p = make_probe(np.random.default_rng(3))
    q = dict(p)
    q["x"] = p["x"] + 1
    del q["grad/b"]
    r = compare(p, q, [1.0, 1.0], [1.0], LOOSE, backends=("torch", "flux"))
    text = "\n".join(r.failures)
    assert "different batches" in text
    assert "gradient b missing from the flux probe" in text
    assert "ran 2 steps in torch but 1 in flux" in text
    nan_loss = compare(p, dict(p), [1.0, float("nan")], [1.0, 1.0], LOOSE)
    assert not nan_loss.passed and "nan" in nan_loss.failures[0]
    assert not compare(p, dict(p), [], [], LOOSE).passed


def test_tolerance_defaults_and_validation() -> None:
    assert precision_pair("float64", "float64") == "float64/float64"
    assert precision_pair("float64", "float32") == "float32/float64"
    assert precision_pair("float32", "float64") == "float32/float64"
    assert precision_pair("float32", "float32") == "float32/float32"
    assert set(DEFAULT_TOLERANCES) == {"float64/float64", "float32/float64", "float32/float32"}
    for table in DEFAULT_TOLERANCES.values():
        assert set(table) == {"small", "medium", "large"}
        for tol in table.values():
            tol.validate()
    keys = TOL_KEYS
    pairs = ("float64/float64", "float32/float64", "float32/float32")
    for size in ("small", "medium", "large"):  # more float32 never means tighter tolerances
        t64, mixed, t32 = (default_tolerances(p, size) for p in pairs)
        for key in keys:
            assert getattr(t64, key) < getattr(mixed, key) <= getattr(t32, key), (size, key)
    # a config of one's own: the loosest over the presets; a pair never measured: the loosest pair
    own = default_tolerances("float32/float64", None)
    for key in keys:
        assert getattr(own, key) == max(getattr(t, key) for t in DEFAULT_TOLERANCES["float32/float64"].values())
    assert default_tolerances("bfloat16/float32", "small") == DEFAULT_TOLERANCES["float32/float32"]["small"]
    for bad in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(UsageError):
            Tolerances(logits=1e-3, grad=bad, loss=1e-3, opt=1e-3).validate()


def test_tolerances_per_option_set() -> None:
    """Tied embeddings (nanoGPT's options) were measured on their own: their entries are never
    tighter than the preset's, and a config gets them when it is a preset changed only by what was measured."""
    from harness.config.load import load_config
    from harness.parity.tolerances import TIED, TIED_TOLERANCES, tolerance_entry, tolerances_for

    for pair, table in TIED_TOLERANCES.items():
        for size, tied in table.items():
            tied.validate()
            for key in TOL_KEYS:
                assert getattr(tied, key) >= getattr(DEFAULT_TOLERANCES[pair][size], key), (pair, size, key)
    nanogpt = {"tie_embeddings": True, "gelu": "exact", "bias": False, "lm_head_bias": False}
    assert tolerance_entry(load_config("medium")) == ("medium", None)
    assert tolerance_entry(load_config("medium").replace(steps=20, dropout=0.2)) == ("medium", None)
    assert tolerance_entry(load_config("medium", None, nanogpt)) == ("medium", TIED)
    assert tolerance_entry(load_config("small", None, {"tie_embeddings": True})) == ("small", TIED)
    assert tolerance_entry(load_config("small", None, {"gelu": "exact"})) == (None, None)  # never measured alone
    assert tolerance_entry(load_config("medium", None, {**nanogpt, "learning_rate": 1e-3})) == (None, TIED)
    assert tolerance_entry(load_config("nanogpt-cpu")) == (None, TIED)
    tol, what = tolerances_for("float64/float64", load_config("medium", None, nanogpt))
    assert tol == TIED_TOLERANCES["float64/float64"]["medium"] and what == "medium preset, tied embeddings"
    # the tied free runs of medium reach a float64 loss deviation of 1.4e-2 in 50 steps: a divergence guard there
    assert tol.loss > 1e-2 > DEFAULT_TOLERANCES["float64/float64"]["medium"].loss
    own, what = tolerances_for("float32/float64", load_config("nanogpt-cpu"))
    assert what == "loosest over the presets and tied embeddings"
    for key in TOL_KEYS:
        assert getattr(own, key) == max(getattr(t, key) for t in (*DEFAULT_TOLERANCES["float32/float64"].values(),
                                                                   *TIED_TOLERANCES["float32/float64"].values()))


def test_resolve_tolerances_command_line_over_defaults() -> None:
    import argparse

    args = argparse.Namespace(size="small", config=None, tol_logits=None, tol_grad=1e-3, tol_loss=None)
    tol, source = parity.resolve_tolerances(args, "float32/float64")
    small = default_tolerances("float32/float64", "small")
    assert tol == Tolerances(logits=small.logits, grad=1e-3, loss=small.loss, opt=small.opt, taps=small.taps,
                             step_loss=small.step_loss)
    default = "default (float32/float64 pair, small preset)"
    assert source == {"logits": default, "grad": "command line", "loss": default, "opt": default, "taps": default,
                      "step_loss": default}
    args.config = "mine.toml"  # a config of one's own: the loosest over the presets
    tol, source = parity.resolve_tolerances(args, "float32/float64")
    assert tol.loss == default_tolerances("float32/float64", None).loss
    assert source["loss"] == "default (float32/float64 pair, loosest over the presets)"
    args.config, args.set = None, ["tie_embeddings=true", "gelu=exact", "bias=false", "lm_head_bias=false"]
    from harness.config.load import load_config  # the run's config: a preset with nanoGPT's options was measured

    tied = load_config("small", None, {"tie_embeddings": True, "gelu": "exact", "bias": False, "lm_head_bias": False})
    tol, source = parity.resolve_tolerances(args, "float64/float64", tied)
    assert tol.loss == 1e-10 and source["loss"] == "default (float64/float64 pair, small preset, tied embeddings)"
    tol, source = parity.resolve_tolerances(args, "float64/float64", tied.replace(learning_rate=0.02))
    assert source["loss"] == ("default (float64/float64 pair, loosest over the presets and tied embeddings, --set "
                              "changes the preset)")
    args.tol_loss = -1.0
    with pytest.raises(UsageError, match="--tol-loss must be a finite number >= 0"):
        parity.resolve_tolerances(args, "float32/float64")


# ------------------------------------------------------------------------------------------ the modules' layers
# harness/parity/ from the bottom up: the command's run and record over the comparison and its tables, over the
# result, over the diagnoses, over reading a probe, over the numbers and the tolerances (docs/design.md, "Parity")
PARITY_LAYERS = {"numeric": 0, "tolerances": 0, "states": 1, "forward": 2, "optimizer": 2, "options": 2, "result": 3,
                 "dropout": 3, "compare": 4, "format": 4, "record": 5}


def parity_imports(root: Path) -> dict[str, set[str]]:
    """{module of harness/parity/: the modules of harness/parity/ it imports, lazy imports included}."""
    import ast

    found: dict[str, set[str]] = {}
    for path in sorted(root.glob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "harness.parity":
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness.parity."):
                names.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                names |= {a.name.split(".")[2] for a in node.names if a.name.startswith("harness.parity.")}
        found[path.stem] = names
    return found


def test_parity_modules_point_one_way() -> None:
    """Each module of harness/parity/ imports only modules of a lower layer (so no circle, and the diagnoses never
    reach up to the comparison); a new module gets its place in PARITY_LAYERS."""
    found = parity_imports(REPO / "harness" / "parity")
    assert set(found) - {"__init__"} == set(PARITY_LAYERS), "place every harness/parity module in PARITY_LAYERS"
    upward = [f"{me} imports {other}" for me, names in found.items() if me != "__init__" for other in sorted(names)
              if PARITY_LAYERS[other] >= PARITY_LAYERS[me]]
    assert not upward, upward


# ------------------------------------------------------------------------------------------ a planted bug

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def small_setup() -> tuple:
    from harness.config.load import load_config
    from harness.core.data import BatchStream, load_corpus
    from harness.core.weights import init_weights

    corpus = load_corpus(DATA)
    config = load_config("small").replace(dropout=0.0, steps=10)
    weights = init_weights(config, corpus.vocab_size, 1337)
    stream = BatchStream(corpus.train, config.block_size, config.batch_size, 1337, config.scheme)
    return corpus, config, weights, stream


def probe_and_losses(backend: object, setup: tuple, steps: int) -> tuple[dict[str, np.ndarray], list[float]]:
    """What a parity worker measures, in process: the step-0 probe, then `steps` training losses."""
    corpus, config, weights, stream = setup
    backend.setup(config, weights, corpus.vocab_size, "cpu", 1337)
    x, y = stream.batch(0)
    probe = {"logits": backend.logits(x), "x": x, "y": y}
    probe.update({f"grad/{k}": v for k, v in backend.gradients(x, y).items()})
    losses = [backend.train_step(*stream.batch(s), config.learning_rate) for s in range(steps)]
    return probe, backend.losses_to_floats(losses)


@pytest.fixture(scope="module")
def numpy_reference(small_setup: tuple) -> tuple[dict[str, np.ndarray], list[float]]:
    from harness.backends.numpy_backend import NumpyBackend

    return probe_and_losses(NumpyBackend(dtype="float64"), small_setup, 10)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_correct_torch_passes_in_process(dtype: str, small_setup: tuple, numpy_reference: tuple) -> None:
    from harness.backends.torch_backend import TorchBackend

    probe, losses = probe_and_losses(TorchBackend(dtype=dtype), small_setup, 10)
    tol = default_tolerances(precision_pair(dtype, "float64"), "small")
    result = compare(probe, numpy_reference[0], losses, numpy_reference[1], tol, backends=("torch", "numpy"))
    assert result.passed, result.failures


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_planted_attention_bug_is_caught(dtype: str, small_setup: tuple, numpy_reference: tuple) -> None:
    from harness.backends.torch_backend import TorchBackend

    with plants.planted("torch-unscaled"):  # the 1/sqrt(head size) scale dropped in the SDPA call
        probe, losses = probe_and_losses(TorchBackend(dtype=dtype), small_setup, 10)
    tol = default_tolerances(precision_pair(dtype, "float64"), "small")
    result = compare(probe, numpy_reference[0], losses, numpy_reference[1], tol, backends=("torch", "numpy"))
    assert not result.passed
    text = "\n".join(result.failures)
    assert "FAIL: logits max abs diff" in text
    assert "FAIL: gradient " in text
    assert result.worst_grad_rel_err > 100 * tol.grad  # caught by a wide margin, not by noise


# ------------------------------------------------------------------------------------------ the CLI, end to end


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_parity_cli_small_torch_vs_numpy(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    steps = 50
    code, out, err = run_cli(["parity", "--size", "small", "--steps", str(steps), "--backends", "torch,numpy",
                              "--data", DATA, "--out", str(tmp_path), "--quiet", "--per-parameter"], capsys)
    assert code == 0, out + err
    assert "PASS: torch (float32) and numpy (float64)" in out
    assert "optimizer steps 1..50 (re-synchronised) rel err" in out  # the table's depth-3 row: every step
    assert "step-0 activation taps max |diff| (scaled)" in out and "first broken" in out and "worst" in out
    assert "update   adam_m   adam_v" in out and "h.0.attn.c_attn.bias" in out  # --per-parameter: depth 3 too
    run_dirs = list((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 1
    path = run_dirs[0] / "parity.json"
    assert f"parity record: {path}" in out
    page = tmp_path / f"{run_dirs[0].name}.html"  # the parity check's own page, and the index
    assert f"report: {page}" in err and (tmp_path / "index.html").is_file()
    assert "<title>nanogpt-parity parity check: small — torch vs numpy</title>" in page.read_text()
    page.unlink()
    assert main(["report", run_dirs[0].name, "--out", str(tmp_path)]) == 0 and page.is_file()  # rebuilt the same
    rec = json.loads(path.read_text())
    assert rec["schema"] == "nanogpt-parity/parity-record" and rec["schema_version"] == 1
    assert rec["run_id"] == run_dirs[0].name and rec["verdict"] == "pass" and rec["failures"] == []
    assert rec["backends"] == ["torch", "numpy"]
    assert rec["dtypes"] == {"torch": "float32", "numpy": "float64"} and rec["precision_pair"] == "float32/float64"
    tol = default_tolerances("float32/float64", "small")
    assert rec["tolerances"] == {"logits": tol.logits, "grad": tol.grad, "loss": tol.loss, "opt": tol.opt,
                                 "taps": tol.taps, "step_loss": tol.step_loss}
    assert rec["tolerance_source"]["loss"] == "default (float32/float64 pair, small preset)"
    assert rec["config"]["dropout"] == 0.0 and rec["steps"] == steps
    res = rec["results"]
    assert res["passed"] is True
    assert 0 < res["logits"]["max_abs_diff"] <= tol.logits  # float32 vs float64: not bit-identical, but close
    assert 0 < res["gradients"]["worst_rel_err"] <= tol.grad
    assert res["gradients"]["worst"] in res["gradients"]["rel_err"]
    assert len(res["gradients"]["rel_err"]) == 18  # every parameter of the 1-layer model
    assert res["loss"]["steps"] == steps and len(res["loss"]["abs_dev"]) == steps
    assert res["loss"]["max_abs_dev"] == max(res["loss"]["abs_dev"]) <= tol.loss
    assert res["val_loss"]["abs_diff"] <= tol.loss
    opt = res["optimizer"]  # depth 3: every parameter's update, m and v after every step, from numpy's state
    assert opt["steps"] == list(range(1, steps + 1)) and opt["cause"] is None and 0 < opt["worst_rel_err"] <= tol.opt
    assert opt["resynchronised_from"] == "numpy" and rec["opt_reference"] == "numpy"
    assert all(len(opt["rel_err"][str(k)][q]) == 18 for k in (1, 2, steps) for q in ("update", "adam_m", "adam_v"))
    assert len(res["step_loss"]["abs_dev"]) == steps and max(res["step_loss"]["abs_dev"]) <= tol.step_loss
    taps = res["taps"]  # depth 0: every tap of the 1-layer model, in forward order
    assert list(taps["rel_err"]) == tap_names(1) and taps["first_divergent"] is None
    assert 0 < max(taps["rel_err"].values()) <= tol.taps and rec["blind_spots"]["logits"]
    assert res["dropout_gradients"] is None  # dropout 0: no masks
    # what the workers were asked to do: parity probes, no BLEU text step
    spec = json.loads((run_dirs[0] / "spec.json").read_text())
    assert spec["parity"] == {"opt_steps": steps, "reference": "numpy"} and spec["text"] is False
    for name in ("torch", "numpy"):
        assert (run_dirs[0] / f"{name}.probe.npz").is_file()
        worker_rec = json.loads((run_dirs[0] / f"{name}.json").read_text())
        assert worker_rec["text"] is None and worker_rec["status"] == "completed"
        assert worker_rec["config"]["dropout"] == 0.0


def test_parity_cli_worker_failure_is_an_error_record(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.run import supervise

    monkeypatch.setattr(supervise, "execute", lambda directory, backends, **kw: {"torch": 0, "numpy": 1})
    code, out, err = run_cli(["parity", "--data", DATA, "--out", str(tmp_path), "--quiet"], capsys)
    assert code == EXIT_CRASH == 3  # not 1: a crashed backend is no numerical FAIL
    assert "parity record:" in out
    assert "ERROR: numpy exited 1; nothing compared" in err
    assert "report: " in err and len(list(tmp_path.glob("*.html"))) == 2  # its page (nothing compared) and the index
    (path,) = tmp_path.glob("runs/*/parity.json")
    rec = json.loads(path.read_text())
    assert rec["verdict"] == "error" and rec["results"] is None and rec["worker_exit_codes"] == {"torch": 0, "numpy": 1}


@pytest.mark.slow
def test_parity_cli_catches_planted_bug_end_to_end(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(plants.SITECUSTOMIZE)  # the attention bug, in the CLI and both workers
    path = os.pathsep.join([str(site), str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, HARNESS_TEST_PLANT="torch-unscaled")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "parity", "--size", "small", "--steps", "3",
                           "--data", DATA, "--out", str(out), "--quiet"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL: logits max abs diff" in proc.stdout
    assert "FAIL: gradient " in proc.stdout
    (path,) = out.glob("runs/*/parity.json")
    rec = json.loads(path.read_text())
    assert rec["verdict"] == "fail" and rec["results"]["passed"] is False
    assert any(f.startswith("FAIL: logits") for f in rec["failures"])


@pytest.mark.parametrize("args, message", [
    (["--backends", "torch,mxnet"], "unknown backend 'mxnet'"),
    (["--backends", "torch"], "exactly two backends, got 1"),
    (["--backends", "torch,numpy,flux"], "exactly two backends, got 3"),
    (["--backends", "numpy,numpy"], "the same backend twice"),
    (["--backends", "torch,"], "empty entry"),
    (["--tol-grad=-1e-4"], "--tol-grad must be a finite number >= 0"),
    (["--tol-loss", "nan"], "--tol-loss must be a finite number >= 0"),
    (["--tol-logits", "inf"], "--tol-logits must be a finite number >= 0"),
    (["--steps", "0"], "--steps must be a positive whole number"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),
])
def test_parity_bad_input_exit_2_one_line_nothing_written(args: list[str], message: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    argv = ["parity", "--data", DATA, *args, "--out", str(out)]
    code, stdout, stderr = run_cli(argv, capsys)
    assert code == 2
    assert stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("harness: error: ") and message in lines[0], stderr
    assert not out.exists()
