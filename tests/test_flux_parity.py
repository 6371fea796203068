"""End-to-end tests of the flux backend; they need Julia with the environment of `harness setup julia`.

Marked `julia`: where Julia cannot run they skip with the reason (on CI: `harness setup julia`, then
`pytest -m julia`). Everything runs in subprocesses, as users run it: juliacall must be imported before torch,
and the pytest process imports torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.backends import flux
from tests.conftest import run_cli

pytestmark = pytest.mark.julia


def require_julia() -> None:
    """Skip with a clear reason unless the flux backend can start without installing anything."""
    reason = flux.unavailable_reason("cpu")
    if reason is not None:
        pytest.skip(f"flux backend unavailable here: {reason}")
    if not flux.environment_resolved():
        pytest.skip("the Julia environment is not installed yet: run `harness setup julia` first")


def _records(out: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(out.glob(f"runs/*/{name}.json"))]


def test_parity_torch_vs_flux(tmp_path: Path):
    require_julia()
    out = tmp_path / "reports"
    result = run_cli("parity", "--size", "small", "--steps", "50", "--backends", "torch,flux", "--quiet",
                     "--out", str(out), timeout=3000)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    parity = [json.loads(p.read_text(encoding="utf-8")) for p in out.glob("runs/*/parity.json")]
    assert len(parity) == 1
    assert parity[0]["worker_exit_codes"] == {"torch": 0, "flux": 0}


def test_run_both_small(tmp_path: Path):
    require_julia()
    out = tmp_path / "reports"
    result = run_cli("run", "--size", "small", "--steps", "20", "--both", "--no-text", "--quiet",
                     "--out", str(out), timeout=3000)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (torch_rec,), (flux_rec,) = _records(out, "torch"), _records(out, "flux")
    for rec in (torch_rec, flux_rec):
        assert rec["status"] == "completed"
        losses = rec["steps"]["loss"]
        assert len(losses) == 20 and all(0 < v < 10 for v in losses)
    assert flux_rec["fingerprints"] == torch_rec["fingerprints"]  # same weights and batches
    info = flux_rec["backend_info"]
    assert info["framework"] == "flux" and info["dtype"] == "float32" and info["Flux"].startswith("0.16")
    # dropout 0.2: the random streams differ, so only the scale of the losses is compared here
    assert abs(sum(flux_rec["steps"]["loss"][-5:]) - sum(torch_rec["steps"]["loss"][-5:])) / 5 < 0.5
    assert flux_rec["memory"]["peak_bytes"] > 0


BRIDGE_SCRIPT = textwrap.dedent("""
    import numpy as np
    from harness.backends.flux import FluxBackend
    from harness.config.load import load_config
    from harness.core.weights import init_weights

    config = load_config("small").replace(dropout=0.0, n_layer=2)
    V = 65
    w = init_weights(config, V, 3)
    b = FluxBackend()
    b.setup(config, w, V, "cpu", 0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, V, size=(4, 64)); y = rng.integers(0, V, size=(4, 64))
    assert b.logits(x).shape == (4, 64, V)
    p = b.parameters()
    assert all(np.array_equal(p[k], w[k]) for k in w), "parameters differ from the weights handed over"
    g = b.gradients(x, y)
    assert set(g) == set(w) and all(g[k].shape == w[k].shape for k in w)
    l0 = b.eval_loss(x, y)
    assert abs(l0 - np.log(V)) < 0.1, l0
    losses = [b.train_step(x, y, 1e-2) for _ in range(5)]
    state = b.state_dict()
    assert int(state["adam_t"]) == 5 and state["adam_m/wte.weight"].shape == w["wte.weight"].shape
    b2 = FluxBackend()
    b2.setup(config, w, V, "cpu", 0)
    b2.load_state_dict(state)
    assert b.train_step(x, y, 1e-2) == b2.train_step(x, y, 1e-2)
    assert losses[-1] < losses[0]
    info = b.describe()
    assert info["device"] == "cpu" and "compile_time_s" in info, info

    # the harness's dropout masks (bool (B, T, C)) through masks_to_flux: the NumPy oracle's gradients
    from harness.models import numpy_gpt
    cfg_d = config.replace(dropout=0.25)
    sites = ["emb"] + [f"h.{i}.{s}" for i in range(cfg_d.n_layer) for s in ("attn", "mlp")]
    masks = {k: rng.random((4, 64, cfg_d.n_embd)) >= 0.25 for k in sites}

    class Replay:  # the oracle's dropout draws replaced by the masks, in forward order
        def __init__(self):
            self.queue = [masks[k] for k in sites]

        def random(self, shape):
            return np.where(self.queue.pop(0), 1.0, 0.0)

    _, ref = numpy_gpt.loss_and_gradients({k: v.astype(np.float64) for k, v in w.items()}, x, y, cfg_d, Replay())
    bd = FluxBackend()
    bd.setup(cfg_d, w, V, "cpu", 0)
    gm = bd.gradients(x, y, masks)
    for k in w:
        assert np.abs(gm[k] - ref[k]).max() <= 1e-4 * np.abs(ref[k]).max() + 1e-8, k
    assert bd.train_step(x, y, 1e-2, masks) > 0 and int(bd.state_dict()["adam_t"]) == 1

    # attention dropout: the harness's masks with the attention probabilities' (B, H, T, T) through masks_to_flux
    from harness.core.masks import dropout_masks
    cfg_a = cfg_d.replace(attn_dropout=True, batch_size=4)
    masks_a = dropout_masks(cfg_a, 5, 0)
    assert masks_a["h.1.attn.probs"].shape == (4, cfg_a.n_head, 64, 64)
    _, ref = numpy_gpt.loss_and_gradients({k: v.astype(np.float64) for k, v in w.items()}, x, y, cfg_a,
                                          masks=masks_a)
    ba = FluxBackend()
    ba.setup(cfg_a, w, V, "cpu", 0)
    ga = ba.gradients(x, y, masks_a)
    for k in w:
        assert np.abs(ga[k] - ref[k]).max() <= 1e-4 * np.abs(ref[k]).max() + 1e-8, k
    assert ba.train_step(x, y, 1e-2) > 0  # its own dropout, on the probabilities too
    print("bridge ok", losses[0], losses[-1], info["compile_time_s"])
""")


def test_bridge_round_trips_in_a_fresh_interpreter():
    require_julia()
    result = subprocess.run([sys.executable, "-c", BRIDGE_SCRIPT], capture_output=True, text=True, timeout=3000,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "bridge ok" in result.stdout


def test_julia_package_tests():
    """NanoGPTFlux's own test suite (Pkg.test) in the environment juliapkg installed."""
    require_julia()
    status = flux.julia_status(probe_network=False)
    exe, project = status["julia_exe"], status["project"]
    script = 'import Pkg; Pkg.test("NanoGPTFlux")'
    result = subprocess.run([exe, f"--project={project}", "--startup-file=no", "-e", script],
                            capture_output=True, text=True, timeout=3000)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
