"""The jax backend's floor for `harness bench overhead` (harness.backends.base.BareLoop): a bare jitted loop with no
harness code between its steps, named by the jax declaration's `bare_loop`. Imports JAX when constructed: used only in
the measuring process.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from harness.backends.base import Timed
from harness.config.fields import Config


class BareJax:
    """The overhead benchmark's (b) for jax: the hand-written jitted floor. No harness code runs between its steps.

    The same weights and dtype, harness.models.jax_gpt.train_step (forward, backward, clipping, AdamW) under one
    `jax.jit` with the state donated, dropout masks drawn inside the step from JAX's PRNG keyed by the step (as the
    backend draws them), the AdamW scalars computed on the host; each batch is put on the device as int32 in the
    step, and every step is waited for (`block_until_ready`) and timed on the host clock, as the runner times the
    jax backend. Compiled by the first call, which the benchmark makes before any timed round (`compiles`).
    """

    compiles = True  # its first repeat compiles the step

    def __init__(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str, seed: int,
                 dtype: str = "float32"):
        from harness.backends.jax_backend import import_jax
        from harness.core.masks import mask_shapes

        jax = self.jax = import_jax(device, dtype)
        from harness.models import jax_gpt

        self.model, self.config, self.dtype = jax_gpt, config, dtype
        self.device = jax.devices("gpu" if device == "cuda" else "cpu")[0]
        params = {n: jax.device_put(np.asarray(w, dtype=dtype), self.device) for n, w in weights.items()}
        self.state = (params, jax_gpt.zeros_like(params), jax_gpt.zeros_like(params))
        self.key = jax.device_put(np.asarray(jax.random.PRNGKey(seed)), self.device)
        self.t = 0
        sites = mask_shapes(config)

        def step(state: Any, x: Any, y: Any, scalars: Any, key: Any, t: Any) -> Any:
            masks = jax_gpt.draw_masks(jax.random.fold_in(key, t), sites, config.dropout)
            return jax_gpt.train_step(state, x, y, scalars, masks, config)

        self.step = jax.jit(step, donate_argnums=0)

    def repeat(self, batches: Sequence[tuple[np.ndarray, np.ndarray]], sync_each_step: bool = False) -> Timed:
        """One jitted step per batch, each waited for; the losses stay on the device until the end.
        (`sync_each_step` changes nothing: every step is already waited for.)"""
        jax, put, lr, config = self.jax, self.jax.device_put, self.config.learning_rate, self.config
        losses, times = [], []
        c_start, t_start = time.process_time(), time.perf_counter()
        for x, y in batches:
            t0 = time.perf_counter()
            t = self.t + 1
            scalars = np.asarray(self.model.adamw_scalars(lr, t, config), dtype=self.dtype)
            self.state, loss = self.step(self.state, put(x.astype(np.int32), self.device),
                                         put(y.astype(np.int32), self.device), scalars, self.key, np.int32(t))
            self.t = t
            jax.block_until_ready(self.state)
            losses.append(loss)
            times.append(time.perf_counter() - t0)
        values = [float(v) for v in jax.device_get(losses)]
        wall = time.perf_counter() - t_start
        return Timed(wall, times, values, time.process_time() - c_start)

    def info(self) -> dict[str, Any]:
        """Nothing beyond the backend's own description."""
        return {}
