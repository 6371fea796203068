"""The optimizer-step depth and the shared dropout masks of `harness parity`, proved by planting bugs.

Every optimizer bug of the planted-bug table is planted in the torch backend (float32) and compared, exactly as
`harness parity` does, with the unchanged NumPy float64 oracle on small and medium: the run must fail with a FAIL
line that names a parameter and, for the optimizer bugs, the likely cause. Correct backends must pass, with dropout 0
and with dropout 0.2.
In-process runs use the real training loop (harness.run.loop.train with the worker's mask and optimizer hooks);
two end-to-end tests plant a bug in the worker processes of the real command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import data_path

from harness.config.load import load_config
from harness.core.masks import dropout_masks, fingerprint, mask_keys
from harness.parity.compare import compare
from harness.parity.optimizer import diagnose_optimizer
from harness.parity.result import ParityResult
from harness.parity.tolerances import Tolerances, default_tolerances, precision_pair
from tests.plants import plant_optimizer_bug

torch = pytest.importorskip("torch")
F = torch.nn.functional

REPO = Path(__file__).resolve().parents[1]
DATA = str(data_path())
SEED = 1337
OPT_STEPS = 3


# ------------------------------------------------------------------------------------------ the masks


def test_masks_contract() -> None:
    config = load_config("medium").replace(dropout=0.2)
    masks = dropout_masks(config, SEED, 0)
    assert list(masks) == mask_keys(config) == ["emb", "h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp"]
    for m in masks.values():
        assert m.dtype == bool and m.shape == (config.batch_size, config.block_size, config.n_embd)
    keep = np.mean([m.mean() for m in masks.values()])
    assert abs(keep - 0.8) < 0.005  # kept with probability 1 - p
    again = dropout_masks(config, SEED, 0)
    assert fingerprint(again) == fingerprint(masks)  # a function of (seed, step) only
    assert fingerprint(dropout_masks(config, SEED, 1)) != fingerprint(masks)
    assert fingerprint(dropout_masks(config, SEED + 1, 0)) != fingerprint(masks)
    assert not np.array_equal(masks["emb"], masks["h.0.attn"])  # every site its own mask
    assert all(m.all() for m in dropout_masks(config.replace(dropout=0.0), SEED, 0).values())


def test_numpy_dropout_applies_the_given_mask() -> None:
    from harness.models import numpy_gpt

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4))
    keep = rng.random((2, 3, 4)) >= 0.25
    out, cache = numpy_gpt.dropout_forward(x, 0.25, None, keep)  # applied even without an rng (gradients)
    np.testing.assert_allclose(out, x * keep / 0.75, rtol=1e-15)
    np.testing.assert_allclose(numpy_gpt.dropout_backward(np.ones_like(x), cache), keep / 0.75, rtol=1e-15)
    with pytest.raises(ValueError, match="mask of shape"):
        numpy_gpt.dropout_forward(x, 0.25, None, keep[:, :2])


# ------------------------------------------------------------------------------------------ in-process parity


def parity_run(backend: object, size: str, dropout: float, plant: Callable[[object], None] | None = None,
               ref: dict[str, np.ndarray] | None = None) -> tuple[dict[str, np.ndarray], list[float]]:
    """What a parity worker measures, in process (harness.run.probe.run, the worker's own code): the probe (with
    `opt/<k>/...` after each of the OPT_STEPS training steps, re-synchronised from `ref` when given) and the losses,
    through the real training loop."""
    from harness.core.data import load_corpus
    from harness.run.probe import run

    config = load_config(size).replace(dropout=dropout, steps=OPT_STEPS)
    return run(backend, config, load_corpus(DATA), SEED, reference=ref, reference_name="numpy", prepare=plant)


_REFERENCES: dict[tuple[str, float], tuple] = {}


def reference(size: str, dropout: float) -> tuple[dict[str, np.ndarray], list[float]]:
    """The NumPy float64 oracle's probe and losses (computed once per size and dropout)."""
    from harness.backends.numpy_backend import NumpyBackend

    if (size, dropout) not in _REFERENCES:
        _REFERENCES[size, dropout] = parity_run(NumpyBackend(dtype="float64"), size, dropout)
    return _REFERENCES[size, dropout]


def torch_vs_numpy(size: str, dropout: float, dtype: str = "float32",
                   plant: Callable[[object], None] | None = None) -> ParityResult:
    from harness.backends.torch_backend import TorchBackend

    ref_probe, ref_losses = reference(size, dropout)
    probe, losses = parity_run(TorchBackend(dtype=dtype, parity=True), size, dropout, plant, ref=ref_probe)
    tol = default_tolerances(precision_pair(dtype, "float64"), size)
    config = load_config(size).replace(dropout=dropout, steps=OPT_STEPS)  # the runs' own, as the command passes it
    return compare(probe, ref_probe, losses, ref_losses, tol, backends=("torch", "numpy"), config=config)


@pytest.mark.parametrize("size", ["small", "medium"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_correct_backends_pass_every_depth(size: str, dropout: float) -> None:
    result = torch_vs_numpy(size, dropout)
    assert result.passed, result.failures
    assert sorted(result.opt_rel_err) == [1, 2, 3] and result.opt_cause is None
    assert 0 < result.worst_opt_rel_err <= result.tolerances.opt
    assert bool(result.dropout_grad_rel_err) == (dropout > 0)


# ------------------------------------------------------------------------------------------ planted optimizer bugs


OPTIMIZER_BUGS = {  # planted bug: what the FAIL line must say is the likely cause
    "no bias correction": "likely cause: bias correction",
    "decay on 1-D parameters": "likely cause: weight decay applied to 1-D parameters",
    "clip at 0.5": "likely cause: gradient clipping",
    "eps 1e-6": "likely cause: eps",
    "beta2 0.99": "likely cause: beta2",
    "coupled weight decay": "likely cause: coupled (L2) weight decay",
}


@pytest.mark.parametrize("size", ["small", "medium"])
@pytest.mark.parametrize("bug", list(OPTIMIZER_BUGS))
def test_planted_optimizer_bug_is_named(bug: str, size: str) -> None:
    result = torch_vs_numpy(size, 0.0, plant=plant_optimizer_bug(bug))
    assert not result.passed
    # the forward and backward pass are untouched: logits and gradients still agree
    assert not [f for f in result.failures if "logits" in f or "FAIL: gradient" in f], result.failures
    (line,) = [f for f in result.failures if f.startswith("FAIL: optimizer step")]
    step, quantity, name = result.opt_first_bad
    assert step == 1 and f"FAIL: optimizer step 1: {name} " in line  # names the parameter
    assert OPTIMIZER_BUGS[bug] in line, line
    # a wide margin: >= 5x the tolerance (>= 100x the worst deviation measured for a correct float32 backend)
    assert result.opt_rel_err[1][quantity][name] >= 5 * result.tolerances.opt


def test_opt_depth_names_a_missing_parameter_and_skips_old_probes() -> None:
    rng = np.random.default_rng(0)
    p = {"logits": np.zeros((1, 1, 2)), "grad/w": rng.standard_normal(3), "opt/0/param/w": rng.standard_normal(3)}
    for k in (1, 2):
        p.update({f"opt/{k}/param/w": rng.standard_normal(3), f"opt/{k}/adam_m/w": rng.standard_normal(3),
                  f"opt/{k}/adam_v/w": rng.random(3)})
    tol = Tolerances(0.0, 0.0, 0.0, 0.0)
    same = compare(p, dict(p), [1.0], [1.0], tol)
    assert same.passed and same.worst_opt_rel_err == 0.0 and sorted(same.opt_rel_err) == [1, 2]
    q = {k: v for k, v in p.items() if k != "opt/2/adam_v/w"}
    assert "FAIL: optimizer step 2 adam_v of w missing from the b probe" in compare(p, q, [1.0], [1.0],
                                                                                          tol).failures
    old = {k: v for k, v in p.items() if not k.startswith("opt/")}
    assert compare(old, dict(old), [1.0], [1.0], tol).opt_rel_err == {}  # a probe without depth 3


# ------------------------------------------------------------------------------------------ planted dropout bugs


def attention_dropout_on_probabilities(self: torch.nn.Module, x: torch.Tensor,
                                       mask: torch.Tensor | None = None, taps: dict | None = None,
                                       probs_mask: torch.Tensor | None = None) -> torch.Tensor:
    """CausalSelfAttention.forward with a planted bug: dropout on the attention probabilities (own RNG), none
    on the output projection."""
    B, T, C = x.shape
    q, k, v = self.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
    p = self.resid_dropout.p if (mask is not None or self.training) else 0.0
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
    return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def attention_mask_before_projection(self: torch.nn.Module, x: torch.Tensor,
                                     mask: torch.Tensor | None = None, taps: dict | None = None,
                                     probs_mask: torch.Tensor | None = None) -> torch.Tensor:
    """CausalSelfAttention.forward with a planted bug: the dropout mask before the output projection."""
    B, T, C = x.shape
    q, k, v = self.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(self.resid_dropout(y, mask))


def dropout_scaled_by_p(self: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Dropout.forward with a planted bug: kept entries scaled by p instead of 1/(1-p)."""
    return torch.nn.Dropout.forward(self, x) if mask is None else x * mask * self.p


DROPOUT_BUGS = {
    "dropout on the attention probabilities": ("CausalSelfAttention", attention_dropout_on_probabilities),
    "mask before the residual projection": ("CausalSelfAttention", attention_mask_before_projection),
    "scaled by p instead of 1/(1-p)": ("Dropout", dropout_scaled_by_p),
}


@pytest.mark.parametrize("size", ["small", "medium"])
@pytest.mark.parametrize("bug", list(DROPOUT_BUGS))
def test_planted_dropout_bug_is_named(bug: str, size: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.models import torch_gpt

    cls, forward = DROPOUT_BUGS[bug]
    monkeypatch.setattr(getattr(torch_gpt, cls), "forward", forward)
    result = torch_vs_numpy(size, 0.2)
    assert not result.passed
    assert not [f for f in result.failures if "logits" in f], result.failures  # dropout off: still equal
    (line,) = [f for f in result.failures if f.startswith("FAIL: gradient with dropout masks")]
    assert f"FAIL: gradient with dropout masks {result.worst_dropout_grad} rel err" in line
    assert "likely cause: dropout (placement or scaling" in line
    assert result.worst_dropout_grad_rel_err > 1000 * result.tolerances.grad
    (opt_line,) = [f for f in result.failures if f.startswith("FAIL: optimizer step 1:")]
    assert "likely cause: the gradients already differ" in opt_line


# ------------------------------------------------------------------------------------------ the command, end to end

PLANT_CLIP = """
    # Loaded by every Python process of the test (the CLI and both workers): plants clipping at half the max norm.
    import torch
    _clip = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = lambda params, max_norm, *a, **kw: _clip(params, max_norm / 2, *a, **kw)
"""

PLANT_DROPOUT_SCALE = """
    # Loaded by every Python process of the test: torch's shared-mask dropout scales by p instead of 1/(1-p).
    from harness.models import torch_gpt

    def forward(self, x, mask=None):
        return super(torch_gpt.Dropout, self).forward(x) if mask is None else x * mask * self.p

    torch_gpt.Dropout.forward = forward
"""


def run_planted(tmp_path: Path, plant: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(plant))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "parity", "--size", "small", "--steps", "3",
                           "--data", DATA, "--out", str(out), "--quiet", "--threads", "1", *args],
                          env=env, capture_output=True, text=True, timeout=300)
    (path,) = out.glob("runs/*/parity.json")
    return proc, json.loads(path.read_text())


@pytest.mark.slow
def test_cli_names_planted_clipping_bug(tmp_path: Path) -> None:
    proc, rec = run_planted(tmp_path, PLANT_CLIP)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith("FAIL: optimizer step 1: ")]
    assert len(lines) == 1 and "likely cause: gradient clipping" in lines[0], proc.stdout
    opt = rec["results"]["optimizer"]
    assert opt["first_bad"]["step"] == 1 and f"{opt['first_bad']['parameter']} " in lines[0]
    assert opt["cause"].startswith("gradient clipping") and rec["opt_steps"] == 3 and rec["threads"] == 1
    assert rec["backend_info"]["torch"]["threads"] == 1  # --threads reached the worker
    assert "FAIL: logits" not in proc.stdout and "FAIL: gradient" not in proc.stdout


@pytest.mark.slow
def test_cli_dropout_masks_catch_planted_scaling_bug(tmp_path: Path) -> None:
    proc, rec = run_planted(tmp_path, PLANT_DROPOUT_SCALE, "--dropout", "0.2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "dropout 0.2 (shared masks)" in proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("FAIL: gradient with dropout masks ")]
    assert "likely cause: dropout (placement or scaling" in line
    assert rec["dropout"] == 0.2 and rec["config"]["dropout"] == 0.2
    assert rec["results"]["dropout_gradients"]["worst"] in line


@pytest.mark.parametrize("args, message", [
    (["--dropout", "1.0"], "--dropout must be a number in [0, 1)"),
    (["--dropout", "-0.1"], "--dropout must be a number in [0, 1)"),
    (["--opt-steps", "-1"], "--opt-steps must be a whole number >= 0"),
    (["--threads", "0"], "--threads must be a positive whole number"),
    (["--tol-opt", "nan"], "--tol-opt must be a finite number >= 0"),
])
def test_new_options_bad_input_exit_2(args: list[str], message: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    from harness.cli.main import main

    out = tmp_path / "out"
    code = main(["parity", "--data", DATA, *args, "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 2 and stdout == "" and not out.exists()
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], stderr


def synthetic_probe(rng: np.random.Generator, steps: int = 2) -> dict[str, np.ndarray]:
    """A probe of two parameters (a matrix w, a vector b) after `steps` plain AdamW steps (lr 0.01, wd 0.1)."""
    p = {"w": rng.standard_normal((4, 5)) * 0.02, "b": rng.standard_normal(5) * 0.02}
    m = {n: np.zeros_like(v) for n, v in p.items()}
    v2 = {n: np.zeros_like(v) for n, v in p.items()}
    probe = {f"grad/{n}": rng.standard_normal(a.shape) for n, a in p.items()}
    probe.update({f"opt/0/param/{n}": a.copy() for n, a in p.items()})
    for t in range(1, steps + 1):
        for n in p:
            g = probe[f"grad/{n}"] if t == 1 else rng.standard_normal(p[n].shape)
            m[n] = 0.9 * m[n] + 0.1 * g
            v2[n] = 0.999 * v2[n] + 0.001 * g * g
            if n == "w":
                p[n] = p[n] * (1 - 0.01 * 0.1)
            p[n] = p[n] - 0.01 / (1 - 0.9**t) * m[n] / (np.sqrt(v2[n] / (1 - 0.999**t)) + 1e-8)
            probe.update({f"opt/{t}/param/{n}": p[n].copy(), f"opt/{t}/adam_m/{n}": m[n].copy(),
                          f"opt/{t}/adam_v/{n}": v2[n].copy()})
    return probe


def test_diagnosis_of_synthetic_patterns() -> None:
    """The causes no planted torch bug above reaches: per-parameter clipping, a constant step-size factor and
    the decoupled decay strength, on hand-made AdamW states."""
    b = synthetic_probe(np.random.default_rng(0))
    clip = dict(b)  # every parameter's m scaled by its own factor, v by its square
    for n, f in (("w", 0.5), ("b", 0.8)):
        clip[f"opt/1/adam_m/{n}"] = f * b[f"opt/1/adam_m/{n}"]
        clip[f"opt/1/adam_v/{n}"] = f * f * b[f"opt/1/adam_v/{n}"]
    assert diagnose_optimizer(clip, b, 1, 1e-6).startswith("gradient clipping per parameter")
    lr = dict(b)  # every update twice as large, at every step
    for t in (1, 2):
        for n in ("w", "b"):
            step = b[f"opt/{t}/param/{n}"] - b[f"opt/{t - 1}/param/{n}"]
            lr[f"opt/{t}/param/{n}"] = lr[f"opt/{t - 1}/param/{n}"] + 2 * step
    assert diagnose_optimizer(lr, b, 1, 1e-6).startswith("the step size")
    decay = dict(b)  # the matrix decays by an extra 0.05 lr-scaled step
    decay["opt/1/param/w"] = b["opt/1/param/w"] - 0.01 * 0.05 * b["opt/0/param/w"]
    assert diagnose_optimizer(decay, b, 1, 1e-6).startswith("decoupled weight decay on the matrices")
    assert diagnose_optimizer(b, b, 1, 1e-6, gradients_agree=False).startswith("the gradients already")
