"""JAX's parts (harness/core/parts.py) in JAX's idiom: each part's forward is `jax.jit` of the model's own functions
(harness/models/jax_gpt.py: `embed`, `layer_norm`, `qkv_heads`, `causal_attention`, `attend`, `linear`, `gelu`,
`dropout`, `cross_entropy`, looked up when traced), its backward `jax.jit` of the pullback `jax.vjp` returns for
that forward (with respect to the part's inputs and parameters), the optimizer the model's clipping and AdamW under
one `jax.jit` with its state donated, the step JaxBackend.train_step. Dropout draws its keep-mask inside the part
from JAX's PRNG (`draw_masks`), as the step does.

Every jitted function is compiled before timing; the compilation is `compile_s`, reported apart. The model's step
is one jitted function that XLA fuses across parts: the difference is the "fusion and framework overhead" row (each
part pays a dispatch of its own, which the step pays once).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from harness.backends.parts import GPU_SAMPLE_S, Item, PartRunner, Reference, as_dtype
from harness.config.fields import Config
from harness.core.parts import OPTIMIZER, Part, item, parts


def part_function(m: Any, part: Part, config: Config) -> Callable[..., tuple]:
    """The forward of `part` as a function of (*inputs, params, key) -> outputs, made of the model's functions
    (`m` is harness.models.jax_gpt; its functions are looked up when the part is traced)."""
    k, pre, p = part.kind, "" if part.block is None else f"h.{part.block}.", config.dropout

    def keep(key: Any, shape: tuple, site: str | None) -> Any:
        return None if site is None else m.draw_masks(key, {site: shape}, p)[site]

    def w(params: dict, name: str) -> Any:
        return params.get(pre + name)

    if k == "emb":
        return lambda idx, ps, key: (m.dropout(x := m.embed(ps, idx), keep(key, x.shape, part.dropout), p),)
    if k in ("ln_1", "ln_2", "ln_f"):
        return lambda x, ps, key: (m.layer_norm(x, w(ps, k + ".weight"), w(ps, k + ".bias")),)
    if k == "attn.qkv":
        return lambda x, ps, key: m.qkv_heads(x, w(ps, "attn.c_attn.weight"), w(ps, "attn.c_attn.bias"),
                                              config.n_head)
    if k == "attn.probs":
        return lambda q, k_, ps, key: (m.causal_attention(q, k_),)
    if k == "attn.y":
        return lambda probs, v, ps, key: (m.attend(probs, v, keep(key, probs.shape, part.dropout), p),)
    if k in ("attn.proj", "mlp.fc", "mlp.proj"):
        layer = {"attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}[k]

        def linear(x: Any, ps: dict, key: Any) -> tuple:
            out = m.linear(x, w(ps, layer + ".weight"), w(ps, layer + ".bias"))
            return (m.dropout(out, keep(key, out.shape, part.dropout), p),)
        return linear
    if k in ("res1", "res2"):
        return lambda x, branch, ps, key: (x + branch,)
    if k == "mlp.act":
        return lambda h, ps, key: (m.gelu(h, config.gelu),)
    if k == "logits":
        return lambda h, ps, key: (m.linear(h, ps[part.params[0]], ps.get("lm_head.bias")),)
    if k == "loss":
        return lambda logits, targets, ps, key: (m.cross_entropy(logits, targets),)
    raise ValueError(f"unknown part {part.name!r}")


class JaxParts(PartRunner):
    """JAX's parts: jitted forwards, jitted pullbacks of jax.vjp, the jitted AdamW, the backend's jitted step."""

    name = "jax"

    def setup(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str, seed: int,
              batches: list[tuple[np.ndarray, np.ndarray]], reference: Reference, names: list[str]) -> None:
        from harness.backends.jax_backend import JaxBackend
        from harness.models import jax_gpt

        self.backend = b = JaxBackend(**self.options)
        b.setup(config, weights, vocab_size, device, seed)
        self.config, jax, m = config, b.jax, jax_gpt
        self.sync_each_call = device != "cuda"
        if device == "cuda":  # calls queued back to back for a millisecond, one wait: not one host round trip each
            self.sample_s = GPU_SAMPLE_S
        t0 = time.perf_counter()
        b.warm_up(*batches[0])  # the step's compilation
        compile_s = time.perf_counter() - t0

        def put(a: np.ndarray) -> Any:
            a = as_dtype(a, b.dtype)
            return b._put(a.astype(np.int32) if a.dtype.kind == "i" else a)  # token ids as the backend's: int32

        params = {n: put(weights[n]) for n in weights}
        key = b._put(np.asarray(jax.random.PRNGKey(seed)))
        wait = jax.block_until_ready
        pullback = jax.jit(lambda f, ct: f(ct))
        chosen, backwards = set(names), {}
        for part in parts(config, vocab_size):
            if part.name not in chosen:
                continue
            fn = part_function(m, part, config)
            ins = [put(reference.acts[i]) for i in part.inputs]
            ps = {n: params[n] for n in part.params}
            forward = jax.jit(fn)
            self.items[item(part.name, "forward")] = Item(lambda f=forward, a=ins, p=ps: f(*a, p, key), wait)
            floats = [i for i, a in enumerate(ins) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating)]

            def of(xs: list, p: dict, fn: Callable = fn, ins: list = ins, floats: list = floats) -> tuple:
                full = list(ins)
                for i, x in zip(floats, xs):
                    full[i] = x
                return fn(*full, p, key)
            _, vjp = jax.jit(lambda xs, p, of=of: jax.vjp(of, xs, p))([ins[i] for i in floats], ps)  # one compile
            douts = tuple(put(reference.grads[o]) for o in part.outputs)
            backwards[part.name] = Item(lambda f=vjp, d=douts: pullback(f, d), wait)
        for name in reversed(names):
            self.items[item(name, "backward")] = backwards[name]
        self._optimizer(config, m, params, reference, put, jax)
        self.step_item(self.backend, batches, lambda out: self.backend.synchronize())
        t0 = time.perf_counter()
        self.warm_up(1)  # every jitted part compiled here, before anything is timed
        self.compile_s = compile_s + time.perf_counter() - t0

    def _optimizer(self, config: Config, m: Any, params: dict, reference: Reference, put: Callable, jax: Any
                   ) -> None:
        """Clipping and AdamW, the model's, jitted with the state donated as in the step, on a copy of the
        parameters and the step-0 gradients."""
        b = self.backend

        def opt(state: tuple, grads: dict, scalars: Any) -> tuple:
            p, mm, v = state
            if config.grad_clip > 0:
                grads = m.clip_by_global_norm(grads, config.grad_clip)
            return m.adamw(p, grads, mm, v, scalars, config)
        step = jax.jit(opt, donate_argnums=0)
        grads = {n: put(reference.params[n]) for n in params}
        scalars = b._scalars(config.learning_rate, 1)
        state = {"s": ({n: a.copy() for n, a in params.items()}, m.zeros_like(params), m.zeros_like(params))}

        def call() -> Any:
            state["s"] = step(state["s"], grads, scalars)
            return state["s"]
        self.items[OPTIMIZER] = Item(call, jax.block_until_ready)

    def describe(self) -> dict[str, Any]:
        info = self.backend.describe()
        info["compile_s"] = self.compile_s
        info["parts"] = "each part jitted on its own; backward: jitted pullback of jax.vjp"
        return info
