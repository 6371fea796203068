"""The CUDA path's logic, tested on the CPU (no GPU here): a fake device clock that counts synchronisations, a stub
`cupy` module that runs on NumPy, monkeypatched torch.cuda queries, and CPU torch.compile (eager backend) for the
compile warm-up. Each test fails when the bug it guards against is planted (noted in its docstring).
"""

from __future__ import annotations

import json
import math
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest

from harness.backends.base import BackendUnavailable
from harness.backends.declaration import Declaration
from harness.cli.options import parse_devices
from harness.config.load import load_config
from harness.core.data import BatchStream
from harness.core.weights import init_weights
from harness.errors import UsageError
from harness.run import loop
from harness.timing import steady

torch = pytest.importorskip("torch")
VOCAB = 11


def tiny(dropout: float = 0.0):
    return load_config("small").replace(block_size=16, batch_size=4, dropout=dropout, eval_interval=1000)


def stream_for(config) -> BatchStream:
    ids = np.random.default_rng(0).integers(0, VOCAB, size=4000)
    return BatchStream(ids, config.block_size, config.batch_size, 1, config.scheme)


# --- finding 1: no per-step host sync on an asynchronous device ------------------------------------------------
class FakeDevice:
    """An asynchronous device: markers complete only at a sync (losses_to_floats); counts synchronize() calls."""

    def __init__(self, step_s: list[float]):
        self.step_s, self.now, self.k = step_s, 0.0, 0
        self.syncs = self.fetches = 0
        self.completed = 0  # markers [0, completed) are complete
        self.marks: list[float] = []

    # the clock
    def mark(self) -> int:
        self.marks.append(self.now)
        return len(self.marks) - 1

    def elapsed_s(self, start: int, end: int) -> float:
        assert end < self.completed, "a marker was read before the flush's synchronisation"
        return self.marks[end] - self.marks[start]


class ClockBackend:
    """A backend on the fake device: each step advances the device time by its scripted duration."""

    name = "fake"
    declaration = Declaration(name="fake", dtypes=("float32",), methods=frozenset({"device_clock"}))

    def __init__(self, device: FakeDevice | None, step_s: list[float]):
        self.device, self.step_s, self.k, self.syncs = device, step_s, 0, 0

    def device_clock(self) -> FakeDevice | None:
        return self.device

    def train_step(self, x, y, lr):
        if self.device is not None:
            self.device.now += self.step_s[self.k]
        self.k += 1
        return np.float32(2.0 - 0.01 * self.k)  # a "device scalar" (not a Python float: flushed in groups)

    def losses_to_floats(self, losses):
        if self.device is not None:
            self.device.fetches += 1
            self.device.completed = len(self.device.marks)
        return [float(v) for v in losses]

    def synchronize(self) -> None:
        self.syncs += 1

    def eval_loss(self, x, y) -> float:
        return 1.0


def test_runner_times_async_steps_with_markers_and_no_per_step_sync() -> None:
    """Planted bug: calling backend.synchronize() per step (the old runner) makes syncs == 120."""
    config = tiny()
    steps = 120
    durations = [3.0] + [0.01 * (1 + k % 3) for k in range(steps - 1)]  # a slow first (compile-like) step
    device = FakeDevice(durations)
    backend = ClockBackend(device, durations)
    curves = loop.Curves()
    outcome = loop.train(backend, config, stream_for(config), {}, curves, steps, loop.LoopOptions(progress=False))
    assert outcome.status == "completed" and len(curves.loss) == len(curves.time_s) == len(curves.step) == steps
    assert backend.syncs == 0  # never waited for the device per step
    assert device.fetches == 3  # one fetch per FLUSH_EVERY (50) steps: 50, 100, 120
    np.testing.assert_allclose(curves.time_s, durations)  # the device's own step times, first step included
    assert outcome.train_s == pytest.approx(sum(durations))
    summary = steady.summarize_times(curves.time_s, 64)
    assert summary["step_median_s"] == pytest.approx(0.02)  # steady state excludes the slow first step


def test_runner_on_a_synchronous_device_keeps_host_timing() -> None:
    """Without a device clock (CPU) the runner synchronises and reads the host clock around every step, as before."""
    config = tiny()
    backend = ClockBackend(None, [0.0] * 7)
    curves = loop.Curves()
    loop.train(backend, config, stream_for(config), {}, curves, 7, loop.LoopOptions(progress=False))
    assert backend.syncs == 7 and len(curves.time_s) == 7 and all(t >= 0 for t in curves.time_s)


def test_non_finite_loss_keeps_curves_aligned_with_device_markers() -> None:
    config = tiny()
    device = FakeDevice([0.01] * 10)

    class Diverges(ClockBackend):
        def train_step(self, x, y, lr):
            loss = super().train_step(x, y, lr)
            return float("nan") if self.k == 4 else loss

    curves = loop.Curves()
    outcome = loop.train(Diverges(device, [0.01] * 10), config, stream_for(config), {}, curves, 10,
                         loop.LoopOptions(progress=False))
    assert outcome.text == "failed: non-finite loss at step 3"
    assert len(curves.loss) == len(curves.time_s) == len(curves.step) == 4


class AsyncBackend(ClockBackend):
    """A backend that also fetches its losses asynchronously (torch on CUDA): `fetch_losses` starts a copy, the
    function it returns waits for it (the markers recorded before it are then complete)."""

    declaration = ClockBackend.declaration.replace(methods=frozenset({"device_clock", "fetch_losses"}))

    def __init__(self, device: FakeDevice, step_s: list[float], nan_at: int | None = None):
        super().__init__(device, step_s)
        self.nan_at, self.log = nan_at, []

    def train_step(self, x, y, lr):
        loss = super().train_step(x, y, lr)
        return np.float32("nan") if self.k - 1 == self.nan_at else loss

    def fetch_losses(self, losses):
        n, marks = len(self.log), len(self.device.marks)
        self.log.append(f"fetch {n}")

        def result():
            self.log.append(f"wait {n}")
            self.device.completed = max(self.device.completed, marks)
            return [float(v) for v in losses]

        return result


def test_the_periodic_flush_never_waits_for_the_device() -> None:
    """Every 50 steps the runner starts fetching that group and completes the one before (whose copy is long done):
    a GPU-bound loop never drains its queue for a flush. The last step waits for everything; curves come out whole
    and in order. Planted bug: waiting at every flush (the old runner) logs `wait 0` before `fetch 1`."""
    config = tiny()
    steps = 120
    durations = [0.01 * (1 + k % 3) for k in range(steps)]
    device = FakeDevice(durations)
    backend = AsyncBackend(device, durations)
    curves = loop.Curves()
    outcome = loop.train(backend, config, stream_for(config), {}, curves, steps, loop.LoopOptions(progress=False))
    assert outcome.status == "completed" and backend.syncs == 0
    # at 50: start; at 100: start the next and complete the first; at the end complete the second, and fetch the
    # last group (100..119) synchronously
    assert backend.log == ["fetch 0", "fetch 1", "wait 0", "wait 1"] and device.fetches == 1
    assert curves.step == list(range(steps)) and len(curves.loss) == len(curves.time_s) == steps
    np.testing.assert_allclose(curves.time_s, durations)
    assert outcome.train_s == pytest.approx(sum(durations))


def test_a_non_finite_loss_found_a_flush_late_still_ends_the_curves_at_it() -> None:
    """The loss of step 60 is NaN: the group holding it completes at the flush of step 150, the loop stops there
    with the failure at step 60 and the curves end with it (61 steps), nothing after it."""
    config = tiny()
    device = FakeDevice([0.01] * 200)
    backend = AsyncBackend(device, [0.01] * 200, nan_at=60)
    curves = loop.Curves()
    outcome = loop.train(backend, config, stream_for(config), {}, curves, 200, loop.LoopOptions(progress=False))
    assert outcome.text == "failed: non-finite loss at step 60"
    assert backend.k == 150 and len(curves.loss) == len(curves.time_s) == len(curves.step) == 61
    assert math.isnan(curves.loss[-1]) and curves.step[-1] == 60


def test_torch_clock_is_cuda_events_only_on_cuda() -> None:
    from harness.backends.torch_backend import CudaEventClock, TorchBackend

    backend = TorchBackend()
    backend.setup(tiny(), init_weights(tiny(), VOCAB, 0), VOCAB, "cpu", 0)
    assert backend.device_clock() is None and backend.describe()["step_timing"] == "host clock"
    backend._cuda = True  # what setup sets on a GPU
    assert isinstance(backend.device_clock(), CudaEventClock)


def test_batches_go_to_cuda_pinned_and_non_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy both the runner's step and the bench floor make (finding 2): pinned, then non-blocking on CUDA;
    a plain tensor on the CPU."""
    from harness.backends.torch_backend import to_device

    calls: list = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: calls.append(("to", *a, kw)) or self)
    a = np.arange(6).reshape(2, 3)
    assert to_device(a, torch.device("cpu")).dtype == torch.int64 and calls == []
    to_device(a, torch.device("cuda"))
    assert calls == ["pin", ("to", torch.device("cuda"), {"non_blocking": True})]


# --- finding 4: compile warm-up before step 0, apart from eval_s and the first step ------------------------------
def test_warm_up_runs_once_before_the_step0_evaluation() -> None:
    """Planted bug: warming up after the first evaluation (or never) puts the compile into eval_s / first_step_s."""
    calls: list[str] = []

    class Compiled(ClockBackend):
        declaration = ClockBackend.declaration.replace(methods=frozenset({"device_clock", "warm_up"}))
        needs_warm_up = True

        def warm_up(self, x, y) -> bool:
            calls.append("warm_up")
            self.needs_warm_up = False
            return True

        def eval_loss(self, x, y) -> float:
            calls.append("eval")
            return 1.0

    config = tiny().replace(eval_interval=2)
    backend = Compiled(None, [0.0] * 4)
    evals = {"val": [stream_for(config).batch(0)], "train": [stream_for(config).batch(1)]}
    outcome = loop.train(backend, config, stream_for(config), evals, loop.Curves(), 4, loop.LoopOptions(progress=False))
    assert calls[0] == "warm_up" and calls.count("warm_up") == 1
    assert outcome.compile_s is not None and outcome.compile_s >= 0
    outcome = loop.train(backend, config, stream_for(config), evals, loop.Curves(), 6,
                         loop.LoopOptions(start_step=4, progress=False))
    assert outcome.compile_s is None  # nothing left to compile
    assert loop.train(ClockBackend(None, [0.0] * 2), config, stream_for(config), {}, loop.Curves(), 2,
                      loop.LoopOptions(progress=False)).compile_s is None  # a backend without warm-up


def test_torch_compile_warm_up_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up (real dynamo, eager backend to stay cheap) leaves parameters, optimizer and the dropout stream
    alone: a warmed-up compiled backend then trains exactly like one that compiles inside its first step, dropout
    on. Planted bug: not restoring the RNG state shifts every dropout mask and the losses differ."""
    from harness.backends.torch_backend import TorchBackend

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real_compile(model, backend="eager"))
    torch._dynamo.reset()
    config = tiny(dropout=0.2)
    weights = init_weights(config, VOCAB, 3)
    stream = stream_for(config)

    def losses(backend: TorchBackend, warm_up: bool) -> list[float]:
        backend.setup(config, weights, VOCAB, "cpu", 5)  # seeds torch's (global) dropout generator
        if warm_up:
            before = backend.parameters()
            assert backend.warm_up(*stream.batch(0)) is True and backend.warm_up(*stream.batch(0)) is False
            after = backend.parameters()
            assert all(np.array_equal(before[k], after[k]) for k in before) and not backend.optimizer.state
        return [backend.train_step(*stream.batch(k), 0.01) for k in range(3)]

    cold = losses(TorchBackend(compile=True), warm_up=False)
    assert losses(TorchBackend(compile=True), warm_up=True) == cold
    assert TorchBackend().warm_up(*stream.batch(0)) is False  # nothing to compile
    torch._dynamo.reset()


# --- finding 3: dynamo reset between compiled measurements --------------------------------------------------------
def test_dynamo_reset_keeps_the_second_size_static() -> None:
    """Two shapes through one torch.compile in one process: without reset the second graph has symbolic (dynamic)
    shapes, which `harness run` (one size per process) never uses; with bench.reset_compiler() it is static."""
    from harness.bench import overhead

    def compile_twice(reset: bool) -> list[bool]:
        dynamic: list[bool] = []

        def record(gm, example_inputs):
            dynamic.append(any(isinstance(e, torch.SymInt) or (isinstance(e, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in e.shape)) for e in example_inputs))
            return gm.forward

        overhead.reset_compiler()
        model = torch.nn.Linear(4, 3)
        for n in (2, 5):
            torch.compile(model, backend=record)(torch.ones(n, 4))
            if reset:
                overhead.reset_compiler()
                model = torch.nn.Linear(4, 3)
        return dynamic

    assert compile_twice(reset=False) == [False, True]  # the bug bench --compile across sizes had
    assert compile_twice(reset=True) == [False, False]
    torch._dynamo.reset()


def test_bench_resets_dynamo_before_each_compiled_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.bench import overhead

    events: list[str] = []
    monkeypatch.setattr(overhead, "reset_compiler", lambda: events.append("reset"))
    monkeypatch.setattr(overhead, "_measure", lambda job: events.append(f"measure {job.size}") or {})
    for size, opts in (("small", {"compile": True}), ("medium", {"compile": True}), ("large", {})):
        overhead.measure(overhead.Job("torch", size, {}, "", "cpu", 0, 1, 0, 1, options=opts))
    assert events == ["reset", "measure small", "reset", "measure medium", "measure large"]


# --- finding 5: per-backend devices in parity ---------------------------------------------------------------------
def test_parse_devices() -> None:
    both = ["torch", "numpy"]
    assert parse_devices(None, both) == ("cpu", {"torch": "cpu", "numpy": "cpu"})
    assert parse_devices(["cuda"], both) == ("cuda", {"torch": "cuda", "numpy": "cuda"})  # every backend
    assert parse_devices(["torch=cuda"], both) == ("cpu", {"torch": "cuda", "numpy": "cpu"})  # oracle on the CPU
    assert parse_devices(["cuda", "numpy=cpu"], both) == ("cuda", {"torch": "cuda", "numpy": "cpu"})
    assert parse_devices("cpu", both)[1] == {"torch": "cpu", "numpy": "cpu"}
    for bad, words in ((["torch=tpu"], "unknown device"), (["=cuda"], "no backend name"),
                       (["flux=cuda"], "not one of the backends"), (["cpu", "cuda"], "twice"),
                       (["torch=cuda", "torch=cpu"], "twice")):
        with pytest.raises(UsageError, match=words):
            parse_devices(bad, both)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: torch=cuda is valid here")
def test_parity_torch_on_cuda_without_gpu_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from harness.cli.main import main

    out = tmp_path / "out"
    code = main(["parity", "--device", "torch=cuda", "--steps", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "cuda" in err.lower() and "Traceback" not in err
    assert not out.exists()


def test_parity_spec_carries_devices_and_parity_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    """What the workers get: spec["devices"] per backend and torch's parity options; the worker reads its device
    from there (falling back to spec["device"])."""
    from harness.cli.main import main
    from harness.run import supervise
    from harness.store import RunPaths, RunSpec

    monkeypatch.setattr(supervise, "execute", lambda directory, backends, **kw: {b: 1 for b in backends})
    out = tmp_path / "out"
    assert main(["parity", "--device", "numpy=cpu", "--steps", "2", "--out", str(out)]) == 3  # the workers "crashed"
    [spec_path] = list((out / "runs").glob("*/spec.json"))
    spec = json.loads(spec_path.read_text())
    assert spec["devices"] == {"torch": "cpu", "numpy": "cpu"} and spec["backend_options"]["torch"]["parity"] is True
    record = json.loads((spec_path.parent / "parity.json").read_text())
    assert record["devices"] == {"torch": "cpu", "numpy": "cpu"}
    spec["devices"]["torch"] = "cuda"
    spec_path.write_text(json.dumps(spec))
    paths = RunPaths.of_dir(spec_path.parent)
    assert RunSpec.load(paths).device_of("torch") == "cuda" and RunSpec.load(paths).device_of("numpy") == "cpu"
    del spec["devices"]
    spec_path.write_text(json.dumps(spec))
    assert RunSpec.load(paths).device_of("torch") == spec["device"]  # specs written before per-backend devices
    capsys.readouterr()


# --- finding 6: parity mode arithmetic ----------------------------------------------------------------------------
def test_parity_mode_uses_single_tensor_adamw_and_math_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: fused AdamW in parity mode on CUDA (the old `fused=device == "cuda"`) fails the first asserts."""
    import torch.nn.attention as attention

    from harness.backends.torch_backend import TorchBackend, adamw_flags, attention_kernels
    from harness.cli.parity import parity_options

    assert adamw_flags("cuda", parity=False) == {"fused": True}
    assert adamw_flags("cuda", parity=True) == adamw_flags("cpu", parity=True) == {"fused": False, "foreach": False}
    assert attention_kernels("cuda", parity=True) == [attention.SDPBackend.MATH]
    assert attention_kernels("cuda", parity=False) is None and attention_kernels("cpu", parity=True) is None
    assert parity_options("torch") == {"parity": True} and parity_options("numpy") == {}

    backend = TorchBackend(**parity_options("torch"))
    config = tiny()
    backend.setup(config, init_weights(config, VOCAB, 0), VOCAB, "cpu", 0)
    assert backend.optimizer.defaults["fused"] is False and backend.optimizer.defaults["foreach"] is False
    assert backend.describe()["adamw"] == "single-tensor" and backend.describe()["parity_mode"] is True
    entered: list = []
    real = attention.sdpa_kernel
    monkeypatch.setattr(attention, "sdpa_kernel", lambda kernels: entered.append(kernels) or real(kernels))
    backend._kernels = attention_kernels("cuda", parity=True)  # what setup chooses on a GPU
    x, y = stream_for(config).batch(0)
    backend.train_step(x, y, 0.01)
    backend.eval_loss(x, y)
    backend.logits(x)
    backend.gradients(x, y)
    assert entered == [[attention.SDPBackend.MATH]] * 4


# --- finding 7: memory ---------------------------------------------------------------------------------------------
def test_torch_empties_the_cache_before_resetting_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.backends.torch_backend import reset_device_memory

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls.append("reset_peaks"))
    reset_device_memory(torch.device("cpu"))
    assert calls == []
    reset_device_memory(torch.device("cuda"))
    assert calls == ["empty_cache", "reset_peaks"]


class StubPool:
    """cupy's MemoryPool: used_bytes() scripted (rises and falls within steps), total_bytes() its high-water mark."""

    def __init__(self) -> None:
        self.values = iter([100, 5000, 300, 7000, 250, 6000, 200, 6500, 150] + [120] * 100)
        self.seen: list[int] = []

    def used_bytes(self) -> int:
        self.seen.append(next(self.values))
        return self.seen[-1]

    def total_bytes(self) -> int:
        return 9000


class StubRandomState:
    """cupy.random.RandomState on NumPy: records the seeds it was built with and the draws."""

    seeds: ClassVar[list[int]] = []
    draws = 0

    def __init__(self, seed: int, method: int) -> None:
        assert method == 7
        StubRandomState.seeds.append(seed)
        self.rng = np.random.default_rng(seed)

    def random_sample(self, shape, dtype=np.float64):
        StubRandomState.draws += 1
        return self.rng.random(shape)


class StubCupy(types.ModuleType):
    """A `cupy` that runs on NumPy (anything not defined here is NumPy's), failing one readiness step on request."""

    def __init__(self, fail: str | None = None, devices: int = 1) -> None:
        super().__init__("cupy")
        self.fail, self.__version__ = fail, "13.0.0-stub"
        self.pool = StubPool()
        self.cuda = SimpleNamespace(
            runtime=SimpleNamespace(getDeviceCount=lambda: devices, getDeviceProperties=lambda i: {"name": b"Stub"}),
            Device=lambda *a: SimpleNamespace(id=0, synchronize=lambda: None),
            curand=SimpleNamespace(CURAND_RNG_PSEUDO_PHILOX4_32_10=7))
        self.random = SimpleNamespace(RandomState=StubRandomState)

    def __getattr__(self, name: str):
        return getattr(np, name)

    def asnumpy(self, a):
        return np.array(a, copy=True)

    def get_default_memory_pool(self) -> StubPool:
        return self.pool

    def ElementwiseKernel(self, in_params, out_params, body, name):  # noqa: N802 (CuPy's name)
        if self.fail == "kernel":
            raise RuntimeError("nvrtc: error: failed to open libnvrtc-builtins.so.12")
        return lambda x: 2 * x + 1

    def asarray(self, a, dtype=None):
        out = np.asarray(a, dtype=dtype)
        if self.fail == "matmul" and out.dtype == np.float64 and out.ndim == 2:
            return out.view(FailingMatmul)
        return out


class FailingMatmul(np.ndarray):
    def __matmul__(self, other):
        raise RuntimeError("CUBLAS_STATUS_NOT_INITIALIZED")


@pytest.fixture
def stub_cupy(monkeypatch: pytest.MonkeyPatch):
    """Install a stub cupy (and cupyx) module; returns a factory to choose which readiness step fails."""
    from harness.backends import numpy_backend
    from harness.models import numpy_gpt

    monkeypatch.setattr(numpy_gpt, "xp", np)  # restored after the test (setup switches the module's xp)
    monkeypatch.setattr(numpy_backend, "READY_CHECK_IN_CHILD", False)  # the stub lives in this process only

    def install(fail: str | None = None, devices: int = 1) -> StubCupy:
        cupy = StubCupy(fail, devices)
        cupyx = types.ModuleType("cupyx")

        def scatter_add(target, index, values):
            if fail == "scatter_add":
                raise ImportError("cupyx.scatter_add: libcub missing")
            np.add.at(target, index, values)

        cupyx.scatter_add = scatter_add
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        monkeypatch.setitem(sys.modules, "cupyx", cupyx)
        return cupy

    return install


@pytest.mark.parametrize(("fail", "words"), [("kernel", "elementwise kernel"), ("matmul", "float64 matmul"),
                                             ("scatter_add", "scatter_add")])
def test_cupy_readiness_names_the_failing_step(stub_cupy, fail: str, words: str) -> None:
    """Planted bug: the old check (getDeviceCount only) passes every one of these."""
    from harness.backends.numpy_backend import NumpyBackend
    from harness.models import numpy_gpt

    stub_cupy(fail)
    with pytest.raises(BackendUnavailable) as info:
        NumpyBackend.check_available("cuda")
    message = str(info.value)
    assert words in message and "cupy-cuda12x[ctk]" in message and "\n" not in message
    assert numpy_gpt.xp is np  # the check leaves the array module as it was


FAKE_CUPY = """
import types
class _Runtime:
    @staticmethod
    def getDeviceCount():
        return 1
cuda = types.SimpleNamespace(runtime=_Runtime())
def ElementwiseKernel(*args):
    raise RuntimeError("nvrtc: error: failed to open libnvrtc-builtins.so.13")
"""


def test_the_cupy_check_runs_in_a_child_and_the_parent_never_imports_cupy(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent (`harness run`, which then coordinates the paired timing) must hold no CUDA context: CuPy makes one
    at its first kernel, so the readiness check runs in a child process (a fake `cupy` package on the child's path
    here, failing at the kernel) and its one-line reason comes back. Planted bug: checking in this process imports
    cupy here (and, on a GPU, leaves a context that every paired burst counts as another process)."""
    from harness.backends.numpy_backend import NumpyBackend

    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(FAKE_CUPY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    with pytest.raises(BackendUnavailable) as info:
        NumpyBackend.check_available("cuda")
    message = str(info.value)
    assert message.startswith("numpy backend: CuPy cannot compile and run an elementwise kernel")
    assert "libnvrtc-builtins" in message and "\n" not in message
    assert "cupy" not in sys.modules


def test_cupy_not_ready_is_one_line_exit_2(stub_cupy, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from harness.cli.main import main

    stub_cupy("kernel")
    out = tmp_path / "out"
    assert main(["run", "--backend", "numpy", "--device", "cuda", "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "elementwise kernel" in err and not out.exists()


def test_cupy_path_device_dropout_resume_and_memory(stub_cupy) -> None:
    """On CuPy, dropout uniforms are drawn on the device, reseeded from (seed, step), so a resumed run repeats an
    uninterrupted one exactly; memory() reports the peak of the sampled pool used bytes as device memory.
    Planted bugs: host masks (the NumPy Generator) draw nothing on the device; reporting the pool total or the
    current used bytes as the peak fails the memory asserts."""
    from harness.backends.numpy_backend import DeviceDropoutRNG, NumpyBackend

    cupy = stub_cupy()
    NumpyBackend.check_available("cuda")
    config = tiny(dropout=0.2)
    weights = init_weights(config, VOCAB, 1)
    stream = stream_for(config)

    def fresh() -> NumpyBackend:
        b = NumpyBackend()
        b.setup(config, weights, VOCAB, "cuda", 9)
        return b

    StubRandomState.seeds, StubRandomState.draws = [], 0
    full = fresh()
    assert isinstance(full.rng, DeviceDropoutRNG)
    losses = [full.train_step(*stream.batch(k), 0.01) for k in range(4)]
    assert len(set(StubRandomState.seeds)) == 4 and StubRandomState.draws == 4 * (1 + 2 * config.n_layer)
    sampled = list(cupy.pool.seen)
    memory = full.memory()
    assert memory["kind"] == "device" and memory["peak_reserved_bytes"] == 9000
    assert memory["peak_bytes"] == max(sampled + cupy.pool.seen[len(sampled):]) == 7000
    assert memory["used_bytes_now"] == cupy.pool.seen[-1] != memory["peak_bytes"]

    half = fresh()
    for k in range(2):
        half.train_step(*stream.batch(k), 0.01)
    state = half.state_dict()
    resumed = fresh()
    resumed.load_state_dict(state)
    assert [resumed.train_step(*stream.batch(k), 0.01) for k in (2, 3)] == losses[2:]


# --- finding 9: doctor ---------------------------------------------------------------------------------------------
def test_doctor_tells_cpu_build_from_driver_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.backends import torch_options

    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only build" in torch_options.torch_row()[1]
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, fix = torch_options.torch_row()[1:]
    assert "CUDA 12.8 build, but no usable GPU" in status and "driver" in fix
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (7, 5))
    status, fix = torch_options.torch_row()[1:]
    assert "Tesla T4" in status and "7.5" in status and "fp32 only" in fix


def test_doctor_cupy_and_compile_rows(monkeypatch: pytest.MonkeyPatch, stub_cupy) -> None:
    import importlib.util

    from harness.backends import numpy_backend, torch_options

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "cupy" else real_find_spec(n, *a))
    stub_cupy("matmul")
    name, status, fix = numpy_backend.cupy_row()
    assert name.startswith("CuPy") and "not ready" in status and "float64 matmul" in fix
    stub_cupy()
    assert "ready" in numpy_backend.cupy_row()[1] and numpy_backend.cupy_row()[2] == ""
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    status, fix = torch_options.compile_row()[1:]
    assert "C compiler: none" in status and "compiler" in fix


# --- finding 10: last-position logits, precision refused where it cannot run --------------------------------------
def test_generation_copies_only_the_last_position() -> None:
    """torch and numpy return exactly the last position with last_only; generate asks for it (flux's signature
    takes it too). Planted bug: generate without last_only records full (N, T, V) copies."""
    import inspect

    from harness.backends.flux import FluxBackend
    from harness.backends.numpy_backend import NumpyBackend
    from harness.backends.torch_backend import TorchBackend
    from harness.run import text

    config = tiny()
    x = stream_for(config).batch(0)[0]
    for backend in (TorchBackend(), NumpyBackend()):
        backend.setup(config, init_weights(config, VOCAB, 0), VOCAB, "cpu", 0)
        full, last = backend.logits(x), backend.logits(x, last_only=True)
        assert last.shape == (config.batch_size, 1, VOCAB)
        np.testing.assert_array_equal(last, full[:, -1:, :])
    assert "last_only" in inspect.signature(FluxBackend.logits).parameters

    shapes: list[tuple] = []

    class Recording(NumpyBackend):
        def logits(self, x, last_only=False):
            out = super().logits(x, last_only=last_only)
            shapes.append(out.shape)
            return out

    rec = Recording()
    rec.setup(config, init_weights(config, VOCAB, 0), VOCAB, "cpu", 0)
    ids = text.generate(rec, x[:2, :5], 3, config.block_size, 0.8, seed=1)
    assert ids.shape == (2, 3) and shapes == [(2, 1, VOCAB)] * 3


def test_precision_refused_on_cpu_and_before_ampere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    from harness.backends.torch_options import check_precision
    from harness.cli.main import main

    check_precision("fp32", "cpu")
    with pytest.raises(UsageError, match="needs a CUDA GPU"):
        check_precision("bf16", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (7, 0))
    with pytest.raises(UsageError, match=r"compute capability 8\.0"):
        check_precision("tf32", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    check_precision("bf16", "cuda")
    out = tmp_path / "out"
    assert main(["run", "--precision", "bf16", "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--precision bf16" in err and not out.exists()
