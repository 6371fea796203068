"""The launch-free torch step (`--cuda-graphs`, `--compile MODE`): everything around the CUDA graph capture, tested
on the CPU (static buffers, the learning-rate tensor, the loss ring, the warm-up undone before the capture, the
refusals and the record), and the capture itself on a GPU (skipped without one). Each CPU test fails when the bug
named in its docstring is planted.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from harness.config.load import load_config
from harness.core.data import BatchStream
from harness.core.masks import dropout_masks
from harness.core.weights import init_weights
from harness.errors import UsageError

torch = pytest.importorskip("torch")
from harness.backends.torch_backend import TorchBackend, adamw_flags, build_model  # noqa: E402
from harness.backends.torch_step import CudaGraphCapture, PinnedBatches, StaticStep  # noqa: E402

VOCAB = 11
GPU = torch.cuda.is_available()


def tiny(dropout: float = 0.0):
    return load_config("small").replace(block_size=16, batch_size=4, dropout=dropout, eval_interval=1000)


def stream_for(config) -> BatchStream:
    ids = np.random.default_rng(0).integers(0, VOCAB, size=4000)
    return BatchStream(ids, config.block_size, config.batch_size, 1, config.scheme)


class CpuCapture(CudaGraphCapture):
    """CudaGraphCapture's record (warm-up, restore in place, capture) with the CUDA parts replaced: no side stream,
    and a "graph" that, like a CUDA graph, runs nothing while recorded and the recorded body at each replay."""

    def __init__(self, warmup_steps: int = 3):
        super().__init__(warmup_steps)
        self.recorded = 0

    @contextlib.contextmanager
    def side_stream(self):
        yield

    def graph_of(self, body):
        self.recorded += 1
        return SimpleNamespace(replay=body)


def static_step(config, device: str = "cpu", capture=None, seed: int = 5, parity: bool = False) -> StaticStep:
    """A StaticStep as TorchBackend.setup builds one for --cuda-graphs, from the same weights every time."""
    torch.manual_seed(seed)
    dev = torch.device(device)
    model = build_model(config, init_weights(config, VOCAB, 3), VOCAB).to(dev).train()
    lr = StaticStep.make_lr(config.learning_rate, torch.float32, dev)
    from harness.backends.torch_backend import adamw_groups

    opt = torch.optim.AdamW(adamw_groups(model, config), lr=lr, betas=(config.beta1, config.beta2), eps=config.eps,
                            **adamw_flags(dev.type, parity, graphs=True))
    return StaticStep(model, opt, list(model.parameters()), lr, config.grad_clip,
                      (config.batch_size, config.block_size), dev, contextlib.nullcontext, capture=capture)


def run(step: StaticStep, stream: BatchStream, n: int, masks=None) -> tuple[list[float], list[np.ndarray]]:
    tokens = [step(*stream.batch(k), 0.01 * (k + 1), masks(k) if masks else None) for k in range(n)]
    return step.read(tokens), [p.detach().cpu().numpy().copy() for p in step.params]


def test_a_recorded_step_trains_exactly_as_the_eager_static_step() -> None:
    """Recording warms the step up (three real steps, dropout on: parameters, AdamW state, loss slot and the dropout
    generator all move) and must put everything back in place, so the first replay is step 0 of the untouched model:
    losses and parameters bitwise equal to the eager static step, one recording. Planted bugs: no restore (the
    warm-up's updates stay), restoring parameters but not the RNG (other dropout masks), or not zeroing the state the
    warm-up created (AdamW starts at step 3)."""
    config = tiny(dropout=0.2)
    stream = stream_for(config)
    eager_losses, eager_params = run(static_step(config), stream, 5)
    capture = CpuCapture()
    graphed = static_step(config, capture=capture)
    losses, params = run(graphed, stream, 5)
    assert losses == eager_losses and capture.recorded == 1 and graphed.captures == 1
    assert all(np.array_equal(a, b) for a, b in zip(params, eager_params, strict=True))
    state = graphed.optimizer.state[graphed.params[0]]
    assert float(state["step"]) == 5  # five replays, the warm-up's three steps forgotten


def test_the_static_step_matches_the_backends_eager_step() -> None:
    """The static step (rate as a 0-d tensor, loss into the ring) computes the backend's ordinary eager step: same
    losses and parameters to float32 rounding (the rate tensor is float32, the eager rate a Python float). Planted
    bug: the rate tensor not refilled (`load` skipping `lr.fill_`) trains at the first rate throughout."""
    config = tiny()
    stream = stream_for(config)
    backend = TorchBackend()
    backend.setup(config, init_weights(config, VOCAB, 3), VOCAB, "cpu", 5)
    eager = [backend.train_step(*stream.batch(k), 0.01 * (k + 1)) for k in range(4)]
    losses, params = run(static_step(config), stream, 4)
    np.testing.assert_allclose(losses, eager, rtol=1e-5)
    for p, q in zip(params, backend.parameters().values(), strict=True):
        # Adam divides by the root of tiny second moments: a near-zero gradient's rounding moves its update by up to
        # the rate itself (0.04 here), so parameters agree to a fraction of that, not to relative rounding
        np.testing.assert_allclose(p, q, rtol=1e-4, atol=1e-4)


def test_static_buffers_rate_tensor_and_loss_ring() -> None:
    """Everything the step reads lives in memory made once: the batch buffer (x in out[0], y in out[1]), the rate
    tensor the optimizer holds (refilled in place), the loss ring read by token; a token whose slot was overwritten
    is refused, not answered with another step's loss. Planted bugs: a fresh batch tensor per step, a new rate tensor
    per step, or no overwrite check."""
    config = tiny()
    stream = stream_for(config)
    step = static_step(config)
    step.ring = 4
    step.losses = torch.zeros(4)
    out_ptr, lr = step.batches.out.data_ptr(), step.lr
    assert all(g["lr"] is lr for g in step.optimizer.param_groups)
    tokens = []
    for k in range(6):
        x, y = stream.batch(k)
        tokens.append(step(x, y, 0.5 + k))
        assert step.batches.out.data_ptr() == out_ptr and step.lr is lr and float(lr) == 0.5 + k
        assert np.array_equal(step.batches.out[0].numpy(), x) and np.array_equal(step.batches.out[1].numpy(), y)
    assert tokens == list(range(6)) and int(step.slot) == 6 % 4
    assert len(step.read(tokens[2:])) == 4 and step.fetch(tokens[3:])() == step.read(tokens[3:])
    with pytest.raises(RuntimeError, match="overwritten"):
        step.read(tokens[1:])


def test_a_new_mask_layout_is_recorded_again() -> None:
    """Parity's keep-masks are copied into buffers the graph reads; a step without masks after steps with them, or
    masks of another shape, reallocates those buffers, so the step is recorded again (replaying the old recording
    would read freed memory). Planted bug: recording again only when the mask names change (the shape change is
    replayed on the old buffers)."""
    config = tiny(dropout=0.1)
    stream = stream_for(config)
    capture = CpuCapture(warmup_steps=1)
    step = static_step(config, capture=capture, parity=True)
    masks = dropout_masks(config, 1, 0)
    step(*stream.batch(0), 0.01, masks)
    step(*stream.batch(1), 0.01, masks)
    assert capture.recorded == 1
    step(*stream.batch(2), 0.01, None)
    assert capture.recorded == 2
    name = next(iter(masks))
    other = dict(masks)
    other[name] = np.ones((1, *np.shape(masks[name])[1:]), dtype=np.float32)
    step.load(*stream.batch(3), 0.01, masks)
    before = step.mask_layout()
    step.load(*stream.batch(3), 0.01, other)
    assert step.mask_layout() != before


def test_pinned_batches_on_the_cpu_copy_into_one_buffer() -> None:
    config = tiny()
    stream = stream_for(config)
    batches = PinnedBatches((config.batch_size, config.block_size), torch.device("cpu"))
    a = batches(*stream.batch(0))
    b = batches(*stream.batch(1))
    assert a is b and np.array_equal(b[0].numpy(), stream.batch(1)[0]) and b.dtype == torch.int64


def test_the_modes_are_refused_in_one_line_where_they_cannot_apply(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """--cuda-graphs and --compile reduce-overhead need CUDA; --cuda-graphs with --compile is a contradiction; both
    are torch options. Each refusal is one line, exit 2, nothing written."""
    from harness.cli.main import main

    with pytest.raises(UsageError, match="--cuda-graphs needs --device cuda"):
        TorchBackend(cuda_graphs=True).check_device("cpu")
    with pytest.raises(UsageError, match=r"reduce-overhead .* needs --device cuda"):
        TorchBackend(compile="reduce-overhead").check_device("cpu")
    with pytest.raises(UsageError, match="does not combine with --compile"):
        TorchBackend(compile="max-autotune", cuda_graphs=True)
    with pytest.raises(UsageError, match="choose one of default, reduce-overhead, max-autotune"):
        TorchBackend(compile="fast")
    assert TorchBackend(compile=True).compile == "default" and TorchBackend().compile is None
    for argv in (["run", "--cuda-graphs"], ["run", "--compile", "reduce-overhead"],
                 ["run", "--cuda-graphs", "--backend", "numpy"],
                 ["bench", "overhead", "--cuda-graphs"]):
        out = tmp_path / "out"
        steps = "--timed-steps" if argv[0] == "bench" else "--steps"  # bench overhead times steps, trains none
        assert main([*argv, steps, "1", "--out", str(out)]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "cuda" in err.lower() and not out.exists(), (argv, err)


def test_the_step_mode_is_recorded_in_backend_info() -> None:
    """backend_info says how each step ran, so that a record of a captured or compiled run is never read as eager."""
    info = TorchBackend(compile="max-autotune")
    info.setup(tiny(), init_weights(tiny(), VOCAB, 3), VOCAB, "cpu", 1)
    described = info.describe()
    assert described["compile"] == "max-autotune" and described["cuda_graphs"] is False
    assert "max-autotune" in described["step"]
    plain = TorchBackend()
    plain.setup(tiny(), init_weights(tiny(), VOCAB, 3), VOCAB, "cpu", 1)
    assert plain.describe()["compile"] is False and plain.describe()["step"] == "eager"


def test_the_parent_asks_nvidia_smi_not_torch_for_the_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    """The preflight of `harness run` (the coordinator of a paired timing) must create no CUDA context: the GPU's
    compute capability for --precision comes from nvidia-smi. Planted bug: asking torch.cuda in the parent."""
    from harness.backends import torch_options

    def no_context(*a, **k):
        raise AssertionError("the parent asked torch.cuda for the capability")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_context)
    monkeypatch.setattr(torch_options, "gpu_capability", lambda: (7, 5))
    with pytest.raises(UsageError, match=r"compute capability 8\.0\+.*7\.5"):
        TorchBackend(precision="bf16").check_device("cuda")
    monkeypatch.setattr(torch_options, "gpu_capability", lambda: (9, 0))
    TorchBackend(precision="bf16").check_device("cuda")


PARENT = """
import sys
from harness.cli.main import main
code = main(sys.argv[1:])
print("torch imported" if "torch" in sys.modules else "no torch", code)
"""


def test_the_parent_of_a_torch_run_and_parity_never_imports_torch(tmp_path: Path) -> None:
    """The parent checks torch's options with TorchOptions (harness.backends.torch_options, through
    harness.backends.options_class), so it never imports torch: a second of CPU per command, and no CUDA runtime in
    the coordinator of a paired timing. Planted bug: the preflight using the backend class (torch_backend)."""
    import subprocess
    import sys

    from conftest import data_path

    env = {**__import__("os").environ, "HARNESS_DATA": str(data_path())}
    for args in (["run", "--size", "small", "--backend", "torch", "--steps", "1", "--paired-rounds", "0",
                  "--no-text", "--no-report"],
                 ["parity", "--size", "small", "--backend", "torch,numpy", "--steps", "1"]):
        done = subprocess.run([sys.executable, "-c", PARENT, *args, "--quiet", "--out", str(tmp_path / args[0])],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.stdout.strip().splitlines()[-1] == "no torch 0", (args[0], done.stdout[-500:], done.stderr[-2000:])


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (the capture itself; everything around it is tested above)")
@pytest.mark.parametrize("parity", [False, True])
def test_on_cuda_the_captured_step_equals_the_eager_step(parity: bool) -> None:
    """On a GPU: the step captured as one CUDA graph (real capture, side-stream warm-up undone) gives the eager static
    step's losses and parameters bitwise, dropout on through the graph-safe generator; the backend's --cuda-graphs
    run trains on the same numbers."""
    config = tiny(dropout=0.1)
    stream = stream_for(config)
    eager_losses, eager_params = run(static_step(config, "cuda", parity=parity), stream, 6)
    graphed = static_step(config, "cuda", capture=CudaGraphCapture(), parity=parity)
    losses, params = run(graphed, stream, 6)
    assert graphed.captures == 1 and losses == eager_losses
    assert all(np.array_equal(a, b) for a, b in zip(params, eager_params, strict=True))
    backend = TorchBackend(cuda_graphs=True)
    backend.setup(config, init_weights(config, VOCAB, 3), VOCAB, "cuda", 5)
    assert backend.warm_up(*stream.batch(0)) is True
    tokens = [backend.train_step(*stream.batch(k), 0.01 * (k + 1)) for k in range(6)]
    values = backend.fetch_losses(tokens)()
    assert values == backend.losses_to_floats(tokens) and all(np.isfinite(values))
    assert backend.describe()["cuda_graphs"] is True
