"""Flux.jl's parts (harness/core/parts.py) in Flux's idiom, through the NanoGPTFlux package
(julia/NanoGPTFlux/src/parts.jl): each part's forward is the model's own layers (on a copy of the model with its
dropout on, as in a training step), its backward the Zygote pullback of that forward taken once, applied to the
step-0 gradients; the optimizer is the package's clipping and AdamW on copies of the state; the step is
FluxBackend.train_step. Each item is a Julia closure called from here (juliacall's call costs a few microseconds,
as every step of the backend pays it).

The step-0 activations and gradients go to Julia in the Flux layout (harness/backends/flux_layout.py, as the taps
come back from it), Float32. Julia compiles each closure at its first call: the warm-up's compile time, read from
Julia's own counter, is `compile_s`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from harness.backends.flux_layout import taps_to_flux, to_flux, tokens_to_flux
from harness.backends.parts import GPU_SAMPLE_S, WARM_CALLS, Item, PartRunner, Reference
from harness.config.fields import Config
from harness.core.parts import OPTIMIZER, item, parts

TOKENS = ("idx", "targets")


class FluxParts(PartRunner):
    """Flux's parts: Julia closures of the model's layers and their Zygote pullbacks, the package's AdamW, its step."""

    name = "flux"

    def setup(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str, seed: int,
              batches: list[tuple[np.ndarray, np.ndarray]], reference: Reference, names: list[str]) -> None:
        from harness.backends.flux import FluxBackend

        self.backend = b = FluxBackend(**self.options)
        b.setup(config, weights, vocab_size, device, seed)
        self.config, mod, state = config, b._mod, b._state
        self.sync_each_call = device != "cuda"
        if device == "cuda":
            self.sample_s = GPU_SAMPLE_S
        floats = {k: np.asarray(v, dtype=np.float32) for k, v in reference.acts.items() if k not in (*TOKENS, "loss")}
        acts = {**taps_to_flux(floats), **{k: tokens_to_flux(reference.acts[k]) for k in TOKENS}}
        cts = taps_to_flux({k: np.asarray(v, dtype=np.float32) for k, v in reference.grads.items()
                            if k not in (*TOKENS, "loss")})
        cts["loss"] = float(reference.grads["loss"])
        jacts, jcts = b._jdict(acts), b._jdict(cts)
        wait = self._wait
        chosen, backwards = set(names), {}
        for part in parts(config, vocab_size):
            if part.name not in chosen:
                continue
            block, ins, outs = -1 if part.block is None else part.block, ",".join(part.inputs), ",".join(part.outputs)
            forward = mod.part_forward(state, part.kind, block, ins, jacts)
            self.items[item(part.name, "forward")] = Item(lambda f=forward: f(), wait)
            backward = mod.part_backward(state, part.kind, block, ins, jacts, outs, jcts)
            backwards[part.name] = Item(lambda f=backward: f(), wait)
        for name in reversed(names):
            self.items[item(name, "backward")] = backwards[name]
        optimizer = mod.optimizer_closure(state, b._jdict(to_flux(reference.params)))
        self.items[OPTIMIZER] = Item(lambda: optimizer(), wait)
        self.step_item(b, batches, wait)
        before = sum(b.compile_time().values())
        t0 = time.perf_counter()
        self.warm_up(WARM_CALLS)  # Julia compiles each closure at its first call
        self.compile_s = sum(b.compile_time().values()) - before or time.perf_counter() - t0

    def _wait(self, out: Any) -> None:
        self.backend.synchronize()

    def describe(self) -> dict[str, Any]:
        info = self.backend.describe()
        info["parts"] = "Julia closures of the model's layers; backward: Zygote.pullback, taken once"
        return info
