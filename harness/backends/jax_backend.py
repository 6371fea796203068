"""The JAX backend: harness.models.jax_gpt driven through the Backend protocol, one jitted training step.

JAX is imported only when the backend is set up, in its worker process (importing this module imports no JAX):
float64 needs `jax_enable_x64` before any array is made, a CPU run keeps JAX off the GPU (JAX_PLATFORMS=cpu), and a
CUDA run does not let JAX take 75 % of the GPU's memory up front (XLA_PYTHON_CLIENT_PREALLOCATE=false), so that its
peak memory is its own and a second process fits beside it (the paired timing). Matmuls are full float32
(`jax_default_matmul_precision = "highest"`: no TF32 on Ampere+ GPUs, as the torch backend's fp32).

The training step (forward, jax.value_and_grad, global-norm clipping, AdamW) is one jitted function whose state
(parameters, AdamW moments) is donated: XLA updates it in place. AdamW is written out with torch.optim.AdamW's
semantics, its scalars (bias corrections, decay factor) computed on the host in double precision as torch computes
them (docs/parity.md, "JAX": optax's adamw measured against it). Dropout: the harness's masks when given (parity),
else masks drawn inside the step from JAX's PRNG, keyed by (seed, step): a resumed run draws what an uninterrupted
one draws, with no RNG state in the checkpoint.

Timing: `warm_up` (harness.run.loop.warm_up, before step 0) compiles the training step ahead of time
(`jax.jit(step).lower(...).compile()`: no step runs, no state is copied) and the evaluation, so the loop records the
compilation as `compile_s` and neither step 0 nor the step-0 evaluation absorbs it; `synchronize` (which the loop
calls after every step on the host clock) blocks until the step's outputs are ready, so asynchronous dispatch cannot
make a step look free.

Compilation is cached across processes: JAX's persistent compilation cache in the user cache directory
(`<harness cache>/jax`, harness.environment.cache_dir; JAX_COMPILATION_CACHE_DIR chooses another), every program
cached however small or quick to compile. `backend_info.compile_cache` says whether the warm-up's compiles were
read from it (a hit) or compiled; a hit reads an executable XLA compiled earlier for the same program, flags and
device, so it computes what a fresh compile computes. CPU threads: `--threads N` reaches XLA through PJRT_NPROC
(harness.run.processes.thread_env), the size of its intra-op (Eigen) pool.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, ClassVar

import numpy as np

from harness.backends.base import BackendUnavailable, cuda_fix
from harness.backends.declaration import Declaration
from harness.backends.jax_options import CUDA_INSTALL, CUDA_PLUGINS, DECLARATION, INSTALL, installed
from harness.config.fields import Config
from harness.core.weights import param_shapes
from harness.environment import cpu_model, peak_rss_bytes
from harness.errors import UsageError

DTYPES = ("float32", "float64")
def import_jax(device: str, dtype: str) -> Any:
    """Import JAX for `device` and `dtype` in this process (see the module docstring); BackendUnavailable when
    JAX is missing."""
    if "jax" not in sys.modules:  # read when JAX starts: too late once it is imported
        if device == "cpu":
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        else:
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
    except ImportError as exc:
        raise BackendUnavailable(f"jax backend: JAX is not installed ({exc}); {INSTALL}") from None
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")
    compile_cache(jax)
    return jax


# JAX's monitoring events of its persistent cache, counted for this process (a listener registered once)
CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
                "/jax/compilation_cache/cache_hits": "hits"}
CACHE_COUNTS = {"requests": 0, "hits": 0, "listening": 0}


def _count_cache_event(event: str, **_: Any) -> None:
    if event in CACHE_EVENTS:
        CACHE_COUNTS[CACHE_EVENTS[event]] += 1


def compile_cache(jax: Any) -> str:
    """Turn on JAX's persistent compilation cache for this process (once) and return its directory: the user's
    JAX_COMPILATION_CACHE_DIR (JAX reads it), else `<harness cache>/jax`. Every program is cached (JAX's defaults
    skip programs that compile in under a second, which is every one of the small presets on a GPU)."""
    if jax.config.jax_compilation_cache_dir is None:
        from harness.environment import cache_dir

        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size threshold, no override
    if not CACHE_COUNTS["listening"]:
        jax.monitoring.register_event_listener(_count_cache_event)
        CACHE_COUNTS["listening"] = 1
    return str(jax.config.jax_compilation_cache_dir)


def _xla_threads() -> int | str:
    """XLA's CPU compute threads in this process: PJRT_NPROC (set by --threads), else its default."""
    n = os.environ.get("PJRT_NPROC", "")
    return int(n) if n.isdigit() and int(n) > 0 else "XLA's own (every usable core)"


class JaxBackend:
    """nanoGPT in plain JAX (harness/models/jax_gpt.py): one jitted, donated training step; AdamW as torch's."""

    name = "jax"
    declaration: ClassVar[Declaration] = DECLARATION  # what the parent reads (harness.backends.jax_options)

    def __init__(self, dtype: str = "float32", parity: bool = False) -> None:
        if dtype not in DTYPES:
            raise UsageError(f"jax backend: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.dtype, self.parity = dtype, parity  # parity: the harness hands the dropout masks
        self.needs_warm_up = True  # the jitted step is compiled by warm_up(), once (harness.run.loop.warm_up)
        self.compile_s: float | None = None
        self.compile_cache: dict[str, Any] | None = None  # the warm-up's compiles: read from the cache or not
        self._compiled: Any = None  # the training step compiled ahead of time by warm_up
        self._compiled_masks = False  # whether it takes the harness's masks (else JAX's own)
        self.config: Config | None = None

    @classmethod
    def check_available(cls, device: str) -> None:
        """BackendUnavailable (one line: what is missing and the fix) unless JAX can run on `device`, without
        importing JAX (the parent process must not start it, nor create a CUDA context)."""
        if device not in ("cpu", "cuda"):
            raise BackendUnavailable(f"jax backend: unknown device {device!r}; use cpu or cuda")
        if not installed("jax"):
            raise BackendUnavailable(f"jax backend: JAX is not installed; {INSTALL}")
        if device == "cuda" and not any(installed(m) for m in CUDA_PLUGINS):
            raise BackendUnavailable("jax backend: --device cuda needs JAX's CUDA plugin; "
                                     + cuda_fix(f"{CUDA_INSTALL}, or use --device cpu"))

    # --- setup -------------------------------------------------------------------------------------------------
    def setup(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str,
              seed: int) -> None:
        """Import JAX, put the canonical `weights` on `device` in the backend's dtype, zero the AdamW moments and
        build the jitted functions (compiled at their first call: warm_up() for the training step)."""
        self.check_available(device)
        jax = import_jax(device, self.dtype)
        from harness.models import jax_gpt

        self.jax, self.model, self.config, self.device_type = jax, jax_gpt, config, device
        try:
            self.device = jax.devices("gpu" if device == "cuda" else "cpu")[0]
        except RuntimeError as exc:
            raise BackendUnavailable(f"jax backend: --device {device} but JAX finds no such device "
                                     f"({' '.join(str(exc).split())[:200]}); use --device cpu") from None
        expected = param_shapes(config, vocab_size)
        if set(weights) != set(expected):
            raise ValueError(f"jax backend: weights do not match the config: missing "
                             f"{sorted(set(expected) - set(weights))}, extra {sorted(set(weights) - set(expected))}")
        for name, shape in expected.items():
            if tuple(np.shape(weights[name])) != shape:
                raise ValueError(f"jax backend: {name} has shape {tuple(np.shape(weights[name]))}, expected {shape}")
        self.names = list(expected)
        params = {n: self._put(np.asarray(weights[n], dtype=self.dtype)) for n in self.names}
        self.state = (params, jax_gpt.zeros_like(params), jax_gpt.zeros_like(params))
        self.t = 0  # AdamW steps taken
        self.key = self._put(np.asarray(jax.random.PRNGKey(seed)))
        self._jit(config)

    def _jit(self, config: Config) -> None:
        """The jitted functions. The model's functions are looked up when each is traced (its first call), so a
        test that replaces one of harness.models.jax_gpt's functions after setup reaches all of them."""
        from harness.core.masks import mask_shapes

        jax, m = self.jax, self.model
        sites = mask_shapes(config)  # the harness's dropout sites and shapes, for JAX's own masks

        def step(state: Any, x: Any, y: Any, scalars: Any, dropout: Any) -> Any:
            # dropout: the harness's masks (a dict), or (key, step): JAX's own masks for this step
            masks = dropout if isinstance(dropout, dict) else m.draw_masks(jax.random.fold_in(*dropout), sites,
                                                                           config.dropout)
            return m.train_step(state, x, y, scalars, masks, config)

        def taps(p: Any, x: Any, masks: Any) -> dict:
            out: dict = {}
            m.forward(p, x, config, masks, taps=out)
            return out

        self._step = jax.jit(step, donate_argnums=0)  # the state is replaced by the step's output
        self._loss = jax.jit(lambda p, x, y: m.loss(p, x, y, config))
        self._logits = jax.jit(lambda p, x: m.forward(p, x, config))
        # generation: the context padded to block_size and the logits of position `last` only, so that one
        # compiled function serves every context length (causal attention: padding after `last` cannot reach it)
        self._last = jax.jit(lambda p, x, last: jax.lax.dynamic_slice_in_dim(m.forward(p, x, config), last, 1, 1))
        self._grads = jax.jit(lambda p, x, y, masks: jax.grad(m.loss)(p, x, y, config, masks))
        self._taps = jax.jit(taps)

    def _put(self, a: np.ndarray) -> Any:
        return self.jax.device_put(a, self.device)

    def _tokens(self, a: np.ndarray) -> Any:
        """Token ids as int32 on the device (ids are far below 2^31; int64 would need x64 in float32 runs)."""
        return self._put(np.asarray(a, dtype=np.int32))

    def _masks(self, masks: dict[str, np.ndarray] | None) -> dict[str, Any] | None:
        """The harness's keep-masks on the device (bool; the model scales them)."""
        return None if masks is None else {k: self._put(np.asarray(v, dtype=bool)) for k, v in masks.items()}

    def _dropout(self, masks: dict[str, np.ndarray] | None, t: int) -> Any:
        """What the step's `dropout` argument is: the harness's masks, or JAX's own PRNG key and step number."""
        return self._masks(masks) if masks is not None else (self.key, np.int32(t))

    def _scalars(self, lr: float, t: int) -> np.ndarray:
        assert self.config is not None
        return np.asarray(self.model.adamw_scalars(lr, t, self.config), dtype=self.dtype)

    def warm_up(self, x: np.ndarray, y: np.ndarray) -> bool:
        """Compile the training step ahead of time (`lower(...).compile()`, in the variant the run will use: the
        harness's masks in parity mode with dropout, JAX's own otherwise) and the evaluation (one call); nothing
        is trained, no state is copied. Records whether the compiles were persistent-cache hits. Returns False
        when already done."""
        if not self.needs_warm_up:
            return False
        from harness.core.masks import dropout_masks

        t0, before = time.perf_counter(), dict(CACHE_COUNTS)
        config = self.config
        assert config is not None
        masks = dropout_masks(config, 0, 0) if self.parity and config.dropout > 0 else None
        tx, ty = self._tokens(x), self._tokens(y)
        self._compiled = self._step.lower(self.state, tx, ty, self._scalars(config.learning_rate, 1),
                                          self._dropout(masks, 1)).compile()
        self._compiled_masks = masks is not None
        self.jax.block_until_ready(self._loss(self.state[0], tx, ty))
        self.compile_s = time.perf_counter() - t0
        requests, hits = (CACHE_COUNTS[k] - before[k] for k in ("requests", "hits"))
        self.compile_cache = {"dir": self.jax.config.jax_compilation_cache_dir, "requests": requests, "hits": hits,
                              "hit": requests > 0 and hits == requests}
        self.needs_warm_up = False
        return True

    # --- training ----------------------------------------------------------------------------------------------
    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float,
                   masks: dict[str, np.ndarray] | None = None) -> Any:
        """One jitted step; returns the loss as a device scalar (`losses_to_floats` fetches a list of them)."""
        t = self.t + 1
        # the warm-up's executable when this step is its variant; else the jitted function (compiles once)
        step = self._compiled if self._compiled is not None and (masks is not None) == self._compiled_masks \
            else self._step
        self.state, loss = step(self.state, self._tokens(x), self._tokens(y), self._scalars(lr, t),
                                self._dropout(masks, t))
        self.t = t
        return loss

    def losses_to_floats(self, losses: list[Any]) -> list[float]:
        return [float(v) for v in self.jax.device_get(list(losses))]

    def synchronize(self) -> None:
        """Wait until the last step's outputs (the new state) are computed."""
        self.jax.block_until_ready(self.state)

    # --- inspection --------------------------------------------------------------------------------------------
    def eval_loss(self, x: np.ndarray, y: np.ndarray) -> float:
        return float(self._loss(self.state[0], self._tokens(x), self._tokens(y)))

    def logits(self, x: np.ndarray, last_only: bool = False) -> np.ndarray:
        """(B, T, V) logits, dropout off; with `last_only` (B, 1, V), the last position's only."""
        assert self.config is not None
        p = self.state[0]
        if not last_only:
            return np.array(self._logits(p, self._tokens(x)))
        T = x.shape[1]
        padded = np.pad(np.asarray(x), ((0, 0), (0, self.config.block_size - T)))
        return np.array(self._last(p, self._tokens(padded), np.int32(T - 1)))

    def gradients(self, x: np.ndarray, y: np.ndarray,
                  masks: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Gradients of the mean loss (no clipping, no update); dropout off, or exactly the given `masks`."""
        g = self._grads(self.state[0], self._tokens(x), self._tokens(y), self._masks(masks))
        return {n: np.array(g[n]) for n in self.names}

    def taps(self, x: np.ndarray, masks: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The named intermediate activations of the forward pass of `x` (harness/core/taps.py): dropout off except
        at the sites of `masks` (parity's step-0 attention masks, harness.core.taps.tap_masks)."""
        return {n: np.array(v) for n, v in self._taps(self.state[0], self._tokens(x), self._masks(masks)).items()}

    def parameters(self) -> dict[str, np.ndarray]:
        return {n: np.array(self.state[0][n]) for n in self.names}

    def memory(self) -> dict[str, Any]:
        """CPU: the process's peak RSS. CUDA: XLA's allocator peak of bytes in use (`memory_stats()`; JAX does not
        preallocate in this backend, so it is the backend's own), with its limit and the host's peak RSS."""
        if self.device_type != "cuda":
            return {"kind": "rss", "peak_bytes": peak_rss_bytes()}
        stats = self.device.memory_stats() or {}
        return {"kind": "device", "peak_bytes": int(stats.get("peak_bytes_in_use", 0)),
                "bytes_limit": stats.get("bytes_limit"), "rss_peak_bytes": peak_rss_bytes(),
                "peak_basis": "XLA allocator peak_bytes_in_use (memory_stats)"}

    def describe(self) -> dict[str, Any]:
        jax = self.jax
        import jaxlib

        info = {"framework": "jax", "version": jax.__version__, "jaxlib": jaxlib.__version__,
                "device": self.device_type, "platform": self.device.platform, "dtype": self.dtype, "precision": "fp32",
                "x64": bool(jax.config.jax_enable_x64), "matmul_precision": jax.config.jax_default_matmul_precision,
                "parity_mode": self.parity, "jit": "one jitted training step, state donated",
                "adamw": "written out, torch.optim.AdamW semantics (scalars in float64 on the host)",
                "dropout": "harness masks" if self.parity else "jax.random, keyed by (seed, step)",
                "threads": _xla_threads() if self.device_type == "cpu" else None,
                "step_timing": "host clock, block_until_ready on the step's outputs", "compile_s": self.compile_s,
                "compile": "ahead of time before step 0 (lower().compile())", "compile_cache": self.compile_cache}
        if self.device_type == "cuda":
            stats = self.device.memory_stats() or {}
            info.update(device_name=self.device.device_kind, device_memory_bytes=stats.get("bytes_limit"))
        else:
            info["device_name"] = cpu_model()
        return info

    # --- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters, AdamW moments (copies on the host), the step count and the PRNG key."""
        p, m, v = self.state
        out: dict[str, np.ndarray] = {}
        for n in self.names:
            out[f"param/{n}"], out[f"adam_m/{n}"], out[f"adam_v/{n}"] = np.array(p[n]), np.array(m[n]), np.array(v[n])
        out["adam_t"] = np.array(self.t, dtype=np.int64)
        out["rng/jax"] = np.array(self.key)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore what `state_dict` returned, or another backend's state (no RNG entry); at adam_t 0 the moments
        may be absent (zeros)."""
        if "adam_t" not in state:
            raise ValueError("jax backend: the state lacks 'adam_t'")
        t = int(np.asarray(state["adam_t"]))
        shapes = {n: a.shape for n, a in self.state[0].items()}
        out: tuple[dict, dict, dict] = ({}, {}, {})
        for part, target in zip(("param", "adam_m", "adam_v"), out):
            for n in self.names:
                key = f"{part}/{n}"
                if key not in state:
                    if part == "param" or t > 0:
                        raise ValueError(f"jax backend: the state lacks {key!r}")
                    target[n] = np.zeros(shapes[n], dtype=self.dtype)
                    continue
                value = np.array(state[key], dtype=self.dtype)  # a copy: never aliases the caller's array
                if value.shape != shapes[n]:
                    raise ValueError(f"jax backend: {key!r} has shape {value.shape}, expected {shapes[n]}")
                target[n] = value
        self.state = tuple({n: self._put(a) for n, a in part.items()} for part in out)
        self.t = t
        if "rng/jax" in state:
            self.key = self._put(np.asarray(state["rng/jax"], dtype=np.uint32))
