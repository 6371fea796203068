"""The NumPy reference backend: harness.models.numpy_gpt (hand-written backward, AdamW) behind the Backend protocol.

float64 by default (the oracle), float32 on request. `--device cuda` runs the same code on CuPy when it is
installed and ready (`cupy_ready`: a kernel compiles, float64 matmul and cupyx.scatter_add run). On the CPU dropout
masks come from the backend's own seeded NumPy Generator, whose state is part of the checkpoint; on CUDA they are
drawn on the device (`DeviceDropoutRNG`, reseeded from (seed, step) each step, since CuPy's RNG state cannot be
saved), so a resumed run continues exactly on either.
"""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import sys
from typing import Any, ClassVar

import numpy as np

from harness.backends.base import BackendUnavailable, cuda_fix
from harness.backends.declaration import Declaration
from harness.config.fields import OPTION_NAMES, Config
from harness.core.weights import param_shapes
from harness.errors import UsageError
from harness.models import numpy_gpt

DTYPES = ("float64", "float32")
DECLARATION = Declaration(
    name="numpy", dtypes=DTYPES, devices=("cpu", "cuda"), options=frozenset(OPTION_NAMES),
    methods=frozenset({"gradients", "taps", "parts"}), needs="", install="", color="#1c7ed6",
    cuda_install="pip install 'cupy-cuda12x[ctk]' (or 'cupy-cuda13x[ctk]' for CUDA 13)",
    part_runner="harness.backends.numpy_parts:NumpyParts", doctor="harness.backends.numpy_backend:doctor_rows")
CUPY_FIX = f"install CuPy with its CUDA components: {DECLARATION.cuda_install}; or use --device cpu"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def cupy_ready(cupy: Any) -> None:
    """Raise BackendUnavailable unless CuPy can run what the backend needs: a freshly compiled elementwise kernel
    (NVRTC and the CUDA headers), a float64 matmul (cuBLAS) and cupyx.scatter_add (the embedding gradient).

    Without this, a CuPy install that finds a GPU but cannot compile kernels fails at the first kernel inside the
    worker, with a traceback, after the run directory exists.
    """
    def elementwise() -> bool:
        kernel = cupy.ElementwiseKernel("float64 x", "float64 y", "y = 2 * x + 1", "harness_ready_check")
        return bool((cupy.asnumpy(kernel(cupy.arange(4, dtype=cupy.float64))) == [1, 3, 5, 7]).all())

    def matmul() -> bool:
        a = cupy.asarray(np.arange(6, dtype=np.float64).reshape(2, 3))
        return bool(np.array_equal(cupy.asnumpy(a @ a.T), [[5.0, 14.0], [14.0, 50.0]]))

    def scatter_add() -> bool:
        import cupyx

        target = cupy.zeros(3, dtype=cupy.float64)
        cupyx.scatter_add(target, cupy.asarray(np.array([0, 0, 2])), cupy.ones(3, dtype=cupy.float64))
        return bool(np.array_equal(cupy.asnumpy(target), [2.0, 0.0, 1.0]))

    for what, check in (("compile and run an elementwise kernel (NVRTC or the CUDA headers missing?)", elementwise),
                        ("run a float64 matmul (cuBLAS)", matmul), ("run cupyx.scatter_add", scatter_add)):
        try:
            ok = check()
        except Exception as exc:  # CompileException, CUDARuntimeError, ImportError, ...
            raise BackendUnavailable(f"numpy backend: CuPy cannot {what}: {_one_line(exc)}; {CUPY_FIX}") from None
        if not ok:
            raise BackendUnavailable(f"numpy backend: CuPy can {what.split(' (')[0][4:]} but got a wrong result; "
                                     f"{CUPY_FIX}")


READY_CHECK_IN_CHILD = True  # False only in tests that put a stub `cupy` into this process
READY_EXIT = 3  # the child's exit status for "not ready" (its reason is the last line of its stderr)


def cupy_ready_here() -> int:
    """The readiness check as a child process runs it (`cupy_ready_in_child`): 0 ready, READY_EXIT with the reason
    on stderr otherwise."""
    try:
        cupy_ready(_use_device("cuda"))
    except BackendUnavailable as exc:
        print(exc, file=sys.stderr)
        return READY_EXIT
    return 0


def cupy_ready_in_child(timeout_s: float = 300.0) -> None:
    """`cupy_ready` in a fresh interpreter, so that the CUDA context it creates (CuPy makes one at its first kernel)
    ends with it. The process that asks (`harness run`, `parity`, `sweep`, `doctor`) never holds a context of its
    own: `harness run` then coordinates the paired timing, and a context there would be one more compute process on
    the GPU in every burst's evidence, judged as another's (harness.timing.contention.NvmlProbe). The first kernel
    compile can take a few seconds: `timeout_s` is generous."""
    code = "import sys; from harness.backends import numpy_backend as m; sys.exit(m.cupy_ready_here())"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BackendUnavailable(f"numpy backend: the CuPy readiness check did not finish within {timeout_s:.0f} s; "
                                 f"{CUPY_FIX}") from None
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    if done.returncode == READY_EXIT and lines:
        raise BackendUnavailable(lines[-1])
    if done.returncode != 0:
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise BackendUnavailable(f"numpy backend: the CuPy readiness check crashed ({why[:200]}); {CUPY_FIX}")


class DeviceDropoutRNG:
    """Dropout uniforms drawn on the GPU (numpy_gpt calls `rng.random(shape)`): no host draw, no host-to-device copy.

    CuPy's random states cannot be serialised, so instead of one stream the generator is reseeded at each training
    step from (seed, step) (cuRAND Philox, cheap to seed): step k's masks depend only on the seed and k, and a run
    resumed from a checkpoint draws exactly what an uninterrupted one draws.
    """

    def __init__(self, cupy: Any, seed: int) -> None:
        self.cupy, self.seed = cupy, int(seed)
        self.state: Any = None

    def start_step(self, step: int) -> None:
        """Reseed for training step `step` (0-based)."""
        derived = int(np.random.SeedSequence([self.seed, int(step)]).generate_state(1, np.uint64)[0] >> 1)
        method = self.cupy.cuda.curand.CURAND_RNG_PSEUDO_PHILOX4_32_10
        self.state = self.cupy.random.RandomState(seed=derived, method=method)

    def random(self, shape: tuple[int, ...]) -> Any:
        """Uniforms in [0, 1), float64, on the device."""
        return self.state.random_sample(shape, dtype=np.float64)


def _use_device(device: str) -> object:
    """numpy_gpt.use_device, with the model's plain DeviceUnavailable turned into the backend layer's error: what is
    missing, and the fix (that there is no GPU, where there is none; else the declaration's CuPy line)."""
    try:
        return numpy_gpt.use_device(device)
    except numpy_gpt.DeviceUnavailable as exc:
        fix = cuda_fix(CUPY_FIX) if device == "cuda" else "use --device cpu"
        raise BackendUnavailable(f"numpy backend: {exc}; {fix}") from None


def _cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


class NumpyBackend:
    """Framework-free nanoGPT in NumPy (or CuPy), the reference the frameworks are compared with."""

    name = "numpy"
    declaration: ClassVar[Declaration] = DECLARATION

    def __init__(self, dtype: str = "float64") -> None:
        if dtype not in DTYPES:
            raise UsageError(f"numpy backend: dtype must be float64 or float32, got {dtype!r}")
        self.dtype = dtype
        self.config: Config | None = None
        self.device = "cpu"
        self.params: dict[str, Any] = {}
        self.optimizer: numpy_gpt.AdamW | None = None
        self.rng: np.random.Generator | DeviceDropoutRNG | None = None
        self._peak_used = 0  # CuPy: the highest pool used-bytes figure sampled (after each step's backward pass)

    @classmethod
    def check_available(cls, device: str) -> None:
        """Raise BackendUnavailable unless `device` can run here ("cpu" always; "cuda" needs CuPy and a GPU, checked
        in a child process: `cupy_ready_in_child`)."""
        if device == "cpu":
            return
        if device != "cuda":
            raise BackendUnavailable(f"numpy backend: unknown device {device!r}; use --device cpu "
                                     "(or cuda with CuPy)")
        if READY_CHECK_IN_CHILD:
            cupy_ready_in_child()
            return
        previous = numpy_gpt.xp
        try:
            cupy_ready(_use_device("cuda"))
        finally:
            numpy_gpt.xp = previous

    # ------------------------------------------------------------------------------------------ protocol

    def setup(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str,
              seed: int) -> None:
        """Copy the canonical `weights` into `dtype` arrays on `device`, create AdamW and the dropout RNG."""
        xp = _use_device(device)
        expected = param_shapes(config, vocab_size)
        if set(weights) != set(expected):
            missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
            raise ValueError(f"numpy backend: weights do not match the config: missing {missing}, extra {extra}")
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"numpy backend: {name} has shape {tuple(weights[name].shape)}, expected {shape}")
        self.config = config
        self.device = device
        self.params = {name: xp.array(weights[name], dtype=self.dtype) for name in expected}
        self.optimizer = numpy_gpt.AdamW(self.params, betas=(config.beta1, config.beta2), eps=config.eps,
                                         weight_decay=config.weight_decay, decay=config.decay)
        if xp is np:
            self.rng = np.random.Generator(np.random.PCG64(seed))
        else:
            self.rng = DeviceDropoutRNG(xp, seed)
            self._pool = xp.get_default_memory_pool()
            self._peak_used = int(self._pool.used_bytes())

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float,
                   masks: dict[str, np.ndarray] | None = None) -> float:
        """Forward with dropout (the harness's `masks` if given), backward, global-norm clipping (if
        grad_clip > 0), AdamW; returns the loss."""
        config, optimizer = self._ready()
        if isinstance(self.rng, DeviceDropoutRNG):
            self.rng.start_step(optimizer.t)  # t = steps done so far, restored from checkpoints
        loss, grads = numpy_gpt.loss_and_gradients(self.params, self._tokens(x), self._tokens(y), config, self.rng,
                                                   masks)
        if numpy_gpt.xp is not np:  # a host-side counter (no sync): parameters, moments and gradients are all live
            self._peak_used = max(self._peak_used, int(self._pool.used_bytes()))
        if config.grad_clip > 0:
            numpy_gpt.clip_grad_norm(grads, config.grad_clip)
        optimizer.step(self.params, grads, lr)
        return float(loss)

    def losses_to_floats(self, losses: list[Any]) -> list[float]:
        """The losses are already Python floats."""
        return [float(v) for v in losses]

    def synchronize(self) -> None:
        """Wait for queued GPU work under CuPy; NumPy is synchronous."""
        if numpy_gpt.xp is not np:
            numpy_gpt.xp.cuda.Device().synchronize()

    def eval_loss(self, x: np.ndarray, y: np.ndarray) -> float:
        """Mean cross-entropy, dropout off."""
        config, _ = self._ready()
        return float(numpy_gpt.loss_only(self.params, self._tokens(x), self._tokens(y), config))

    def logits(self, x: np.ndarray, last_only: bool = False) -> np.ndarray:
        """(B, T, V) logits, dropout off, in the backend's dtype; with `last_only` (B, 1, V): only the last position
        is copied to the host (generation)."""
        config, _ = self._ready()
        logits = numpy_gpt.gpt_forward(self.params, self._tokens(x), config)[0]
        return numpy_gpt.to_numpy(logits[:, -1:, :] if last_only else logits)

    def gradients(self, x: np.ndarray, y: np.ndarray,
                  masks: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Gradients of the mean loss: dropout off (or exactly the given `masks`), no clipping, no update."""
        config, _ = self._ready()
        _, grads = numpy_gpt.loss_and_gradients(self.params, self._tokens(x), self._tokens(y), config,
                                                masks=masks)
        return {name: numpy_gpt.to_numpy(grads[name]) for name in self.params}

    def taps(self, x: np.ndarray, masks: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The named intermediate activations of the forward pass of `x` (harness/core/taps.py), canonical layout,
        in the backend's dtype; dropout off except at the sites of the harness's `masks` (exactly those applied)."""
        config, _ = self._ready()
        taps: dict[str, Any] = {}
        numpy_gpt.gpt_forward(self.params, self._tokens(x), config, masks=masks, taps=taps)
        return {name: numpy_gpt.to_numpy(value) for name, value in taps.items()}

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters, canonical names and shapes, in the backend's dtype."""
        return {name: numpy_gpt.to_numpy(p) for name, p in self.params.items()}

    def memory(self) -> dict[str, Any]:
        """On the CPU the peak resident set size of this process (ru_maxrss: KiB on Linux, bytes on macOS).

        Under CuPy, device memory: `peak_bytes` is the highest CuPy pool used-bytes figure sampled after each step's
        backward pass (a lower bound of the true peak: the step's activations are freed by then);
        `peak_reserved_bytes` the pool's total (it never shrinks, so it is its peak: an upper bound); the host's
        peak RSS is `rss_peak_bytes`."""
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss = int(maxrss if sys.platform == "darwin" else maxrss * 1024)
        if numpy_gpt.xp is np:
            return {"kind": "rss", "peak_bytes": rss}
        pool = numpy_gpt.xp.get_default_memory_pool()
        used = int(pool.used_bytes())
        self._peak_used = max(self._peak_used, used)
        return {"kind": "device", "peak_bytes": self._peak_used, "peak_reserved_bytes": int(pool.total_bytes()),
                "used_bytes_now": used, "rss_peak_bytes": rss,
                "peak_basis": "CuPy pool used bytes sampled after each backward pass (lower bound)"}

    def describe(self) -> dict[str, Any]:
        """Framework, version, device and dtype."""
        info: dict[str, Any] = {"framework": "numpy", "version": np.__version__, "device": self.device,
                                "device_name": _cpu_name(), "dtype": self.dtype,
                                "array_module": numpy_gpt.xp.__name__, "python": platform.python_version(),
                                "cpu": _cpu_name()}
        if numpy_gpt.xp is not np:
            cupy = numpy_gpt.xp
            props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
            name = props["name"]
            info["device_name"] = name.decode() if isinstance(name, bytes) else str(name)
            info["cupy_version"] = cupy.__version__
        return info

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters, AdamW moments and step count, and the dropout RNG state (JSON as a uint8 array)."""
        _, optimizer = self._ready()
        state: dict[str, np.ndarray] = {}
        for name, p in self.params.items():
            state[f"param/{name}"] = numpy_gpt.to_numpy(p)
            state[f"adam_m/{name}"] = numpy_gpt.to_numpy(optimizer.m[name])
            state[f"adam_v/{name}"] = numpy_gpt.to_numpy(optimizer.v[name])
        state["adam_t"] = np.array(optimizer.t, dtype=np.int64)
        assert self.rng is not None
        if isinstance(self.rng, np.random.Generator):  # the device RNG needs no state: it is reseeded per step
            rng_json = json.dumps(self.rng.bit_generator.state).encode()
            state["rng/state"] = np.frombuffer(rng_json, dtype=np.uint8).copy()
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore what `state_dict` returned (after `setup` with the same config and vocabulary)."""
        _, optimizer = self._ready()
        xp = numpy_gpt.xp
        for name, p in self.params.items():
            for key, target in ((f"param/{name}", p), (f"adam_m/{name}", optimizer.m[name]),
                                (f"adam_v/{name}", optimizer.v[name])):
                if key not in state:
                    raise ValueError(f"numpy backend: checkpoint lacks {key!r}")
                value = np.asarray(state[key])
                if value.shape != tuple(target.shape):
                    raise ValueError(f"numpy backend: checkpoint {key!r} has shape {value.shape}, "
                                     f"expected {tuple(target.shape)}")
                target[...] = xp.asarray(value, dtype=self.dtype)  # in place: AdamW holds the same arrays
        if "adam_t" not in state:
            raise ValueError("numpy backend: checkpoint lacks 'adam_t'")
        optimizer.t = int(state["adam_t"])
        if "rng/state" in state and isinstance(self.rng, np.random.Generator):
            self.rng.bit_generator.state = json.loads(np.asarray(state["rng/state"], dtype=np.uint8).tobytes())

    # ------------------------------------------------------------------------------------------ helpers

    def _ready(self) -> tuple[Config, numpy_gpt.AdamW]:
        if self.config is None or self.optimizer is None:
            raise RuntimeError("numpy backend: call setup() first")
        return self.config, self.optimizer

    def _tokens(self, x: np.ndarray) -> Any:
        """Token ids as int64 arrays of the current array module."""
        return numpy_gpt.xp.asarray(np.asarray(x, dtype=np.int64))


# --- harness doctor -------------------------------------------------------------------------------------------
def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # not installed, or broken metadata
        return None


def cupy_row() -> tuple[str, str, str]:
    """CuPy (the numpy backend on --device cuda): installed, and able to compile and run what the backend needs."""
    import importlib.util

    what = "CuPy (numpy backend on cuda)"
    if importlib.util.find_spec("cupy") is None:
        return (what, "not installed", f"only needed for --backend numpy --device cuda: "
                f"{DECLARATION.cuda_install}")
    version = _dist_version("cupy") or next((v for v in (_dist_version("cupy-cuda12x"),
                                                          _dist_version("cupy-cuda13x")) if v), "?")
    try:
        NumpyBackend.check_available("cuda")
    except BackendUnavailable as exc:
        return (what, f"{version}, not ready", str(exc).removeprefix("numpy backend: "))
    except Exception as exc:  # a broken install is reported, not raised
        return (what, f"{version}, broken ({type(exc).__name__})", "reinstall CuPy")
    return (what, f"{version}, ready (kernel, float64 matmul, scatter_add ran)", "")


def doctor_rows() -> list[tuple[str, str, str]]:
    """The numpy backend's rows of `harness doctor`: NumPy itself, and CuPy for --device cuda."""
    version = _dist_version("numpy")
    return [("numpy", version or "missing", "" if version else "pip install numpy"), cupy_row()]
