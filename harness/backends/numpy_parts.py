"""The NumPy oracle's parts (harness/core/parts.py): each part's forward and backward are the oracle's own layer
functions (harness/models/numpy_gpt.py), looked up when called, so a change to the oracle reaches its parts; the
whole step is NumpyBackend.train_step.

`reference` runs these parts once, forward then backward, in float64 with dropout off: the step-0 activations and
gradients every backend's runner times its parts on (harness.backends.parts.Reference). A test checks that they are
the oracle's taps and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from harness.backends.parts import GPU_SAMPLE_S, SAMPLE_S, Item, PartRunner, Reference, as_dtype
from harness.config.fields import Config
from harness.core.masks import attention_sites
from harness.core.parts import OPTIMIZER, Part, item, parts
from harness.models import numpy_gpt as g

Forward = Callable[..., tuple[tuple, Any]]  # (context, *inputs) -> (outputs, cache)
Backward = Callable[..., tuple[tuple, dict]]  # (context, cache, *output gradients) -> (input gradients, params)


class Context:
    """What a part's functions read besides its inputs: its parameters (canonical names), its block's prefix, the
    config, the dropout probability of its site (0: none) and the dropout RNG (None: dropout off)."""

    def __init__(self, part: Part, params: dict[str, Any], config: Config, rng: Any) -> None:
        self.part, self.params, self.config, self.rng = part, params, config, rng
        self.prefix = "" if part.block is None else f"h.{part.block}."
        on = part.dropout is not None and rng is not None
        self.p = config.dropout if on else 0.0

    def w(self, name: str) -> Any:
        """A parameter of the part's block (None: a bias the config leaves out)."""
        return self.params.get(self.prefix + name)

    def grads(self, names: tuple[str, ...], values: tuple) -> dict[str, Any]:
        """{prefix + name: gradient} of the gradients that exist (no bias: none)."""
        return {self.prefix + n: v for n, v in zip(names, values) if v is not None}


def _emb(c: Context, idx: Any) -> tuple[tuple, Any]:
    x, cache = g.embedding_forward(idx, c.params["wte.weight"], c.params["wpe.weight"])
    x, drop = g.dropout_forward(x, c.p, c.rng)
    return (x,), (cache, drop)


def _emb_back(c: Context, cache: Any, dx: Any) -> tuple[tuple, dict]:
    emb, drop = cache
    dwte, dwpe = g.embedding_backward(g.dropout_backward(dx, drop), emb)
    return (None,), {"wte.weight": dwte, "wpe.weight": dwpe}


def _ln(layer: str) -> tuple[Forward, Backward]:
    def forward(c: Context, x: Any) -> tuple[tuple, Any]:
        out, cache = g.layernorm_forward(x, c.w(layer + ".weight"), c.w(layer + ".bias"))
        return (out,), cache

    def backward(c: Context, cache: Any, dout: Any) -> tuple[tuple, dict]:
        dx, dw, db = g.layernorm_backward(dout, cache)
        return (dx,), c.grads((layer + ".weight", layer + ".bias"), (dw, db))
    return forward, backward


def _linear(layer: str, head: bool = False) -> tuple[Forward, Backward]:
    """A Linear then the part's dropout (p 0: none); `head`: lm_head (or the tied token table)."""
    def weights(c: Context) -> tuple[Any, Any]:
        if head:
            return c.params[c.part.params[0]], c.params.get("lm_head.bias")
        return c.w(layer + ".weight"), c.w(layer + ".bias")

    def forward(c: Context, x: Any) -> tuple[tuple, Any]:
        out, cache = g.linear_forward(x, *weights(c))
        out, drop = g.dropout_forward(out, c.p, c.rng)
        return (out,), (cache, drop)

    def backward(c: Context, cache: Any, dout: Any) -> tuple[tuple, dict]:
        lin, drop = cache
        dx, dw, db = g.linear_backward(g.dropout_backward(dout, drop), lin)
        if head:
            return (dx,), {k: v for k, v in zip(c.part.params, (dw, db)) if v is not None}
        return (dx,), c.grads((layer + ".weight", layer + ".bias"), (dw, db))
    return forward, backward


def _qkv(c: Context, x: Any) -> tuple[tuple, Any]:
    return g.qkv_forward(x, c.w("attn.c_attn.weight"), c.w("attn.c_attn.bias"), c.config.n_head)


def _qkv_back(c: Context, cache: Any, dq: Any, dk: Any, dv: Any) -> tuple[tuple, dict]:
    dx, dw, db = g.qkv_backward(dq, dk, dv, cache)
    return (dx,), c.grads(("attn.c_attn.weight", "attn.c_attn.bias"), (dw, db))


def _probs(c: Context, q: Any, k: Any) -> tuple[tuple, Any]:
    probs, cache = g.attention_probs_forward(q, k)
    return (probs,), cache


def _probs_back(c: Context, cache: Any, dprobs: Any) -> tuple[tuple, dict]:
    return g.attention_probs_backward(dprobs, cache), {}


def _y(c: Context, probs: Any, v: Any) -> tuple[tuple, Any]:
    y, cache = g.attention_values_forward(probs, v, c.p, c.rng)
    return (g.merge_heads(y),), cache


def _y_back(c: Context, cache: Any, dy: Any) -> tuple[tuple, dict]:
    return g.attention_values_backward(g.split_heads(dy, c.config.n_head), cache), {}


def _res(c: Context, x: Any, branch: Any) -> tuple[tuple, Any]:
    return (x + branch,), None


def _res_back(c: Context, cache: Any, dout: Any) -> tuple[tuple, dict]:
    return (dout, dout), {}  # as autograd's and jax.vjp's: the sum at the fork is the overhead row's, every runner's


def _act(c: Context, h: Any) -> tuple[tuple, Any]:
    a, cache = g.gelu_pair(c.config.gelu)[0](h)
    return (a,), cache


def _act_back(c: Context, cache: Any, da: Any) -> tuple[tuple, dict]:
    return (g.gelu_pair(c.config.gelu)[1](da, cache),), {}


def _loss(c: Context, logits: Any, targets: Any) -> tuple[tuple, Any]:
    loss, cache = g.cross_entropy_forward(logits, targets)
    return (loss,), cache


def _loss_back(c: Context, cache: Any, dloss: Any) -> tuple[tuple, dict]:
    return (g.cross_entropy_backward(dloss, cache), None), {}


FUNCTIONS: dict[str, tuple[Forward, Backward]] = {
    "emb": (_emb, _emb_back), "ln_1": _ln("ln_1"), "attn.qkv": (_qkv, _qkv_back), "attn.probs": (_probs, _probs_back),
    "attn.y": (_y, _y_back), "attn.proj": _linear("attn.c_proj"), "res1": (_res, _res_back), "ln_2": _ln("ln_2"),
    "mlp.fc": _linear("mlp.c_fc"), "mlp.act": (_act, _act_back), "mlp.proj": _linear("mlp.c_proj"),
    "res2": (_res, _res_back), "ln_f": _ln("ln_f"), "logits": _linear("lm_head", head=True),
    "loss": (_loss, _loss_back),
}


def reference(config: Config, weights: dict[str, np.ndarray], vocab_size: int, x: np.ndarray,
              y: np.ndarray) -> Reference:
    """The step-0 activations and gradients of batch (x, y): the oracle's parts run forward, then backward in
    reverse, in float64 on the CPU with dropout off (the taps' convention); a gradient that reaches an activation
    from two parts (a residual fork) is the sum of both."""
    config = config.replace(dropout=0.0)
    params = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    acts: dict[str, Any] = {"idx": np.asarray(x, dtype=np.int64), "targets": np.asarray(y, dtype=np.int64)}
    caches = {}
    previous = g.xp
    g.xp = np  # the reference is NumPy's whatever device this process uses
    try:
        every = parts(config, vocab_size)
        for part in every:
            outs, caches[part.name] = FUNCTIONS[part.kind][0](Context(part, params, config, None),
                                                              *(acts[i] for i in part.inputs))
            acts.update(zip(part.outputs, outs))
        grads: dict[str, Any] = {"loss": np.asarray(1.0)}
        pgrads: dict[str, Any] = {}
        branch = {}
        for part in reversed(every):
            dins, dparams = FUNCTIONS[part.kind][1](Context(part, params, config, None), caches[part.name],
                                                    *(grads[o] for o in part.outputs))
            for name, d in zip(part.inputs, dins):
                if d is not None:
                    branch[(part.name, name)] = d
                    grads[name] = grads[name] + d if name in grads else d
            for name, d in dparams.items():
                pgrads[name] = pgrads[name] + d if name in pgrads else d
    finally:
        g.xp = previous
    return Reference({k: np.asarray(v) for k, v in acts.items()}, grads, pgrads, branch)


class NumpyParts(PartRunner):
    """The oracle's parts (NumPy, or CuPy on CUDA): forward and backward are its functions; the optimizer is its
    global-norm clipping and AdamW on the step-0 gradients (on copies of the parameters); the step is
    NumpyBackend.train_step."""

    name = "numpy"

    def setup(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str, seed: int,
              batches: list[tuple[np.ndarray, np.ndarray]], reference: Reference, names: list[str]) -> None:
        from harness.backends.numpy_backend import NumpyBackend

        self.backend = NumpyBackend(**self.options)
        self.backend.setup(config, weights, vocab_size, device, seed)
        self.config, dtype, xp = config, self.backend.dtype, g.xp
        self.device = device
        params = {k: xp.asarray(v) for k, v in self.backend.params.items()}  # the backend's copies, never updated
        rng = self.backend.rng if config.dropout > 0 else None
        if rng is not None and hasattr(rng, "start_step"):
            rng.start_step(0)  # CuPy's generator is seeded per step (numpy_backend.DeviceDropoutRNG)
        self.sync_each_call = xp is np  # on a GPU the calls of an item are queued back to back, one wait
        self.sample_s = SAMPLE_S if xp is np else GPU_SAMPLE_S
        wait = (lambda out: self.backend.synchronize()) if xp is not np else (lambda out: None)

        def put(a: np.ndarray) -> Any:
            return xp.asarray(as_dtype(a, dtype))

        chosen = set(names)
        backwards = {}
        for part in parts(config, vocab_size):
            if part.name not in chosen:
                continue
            forward, backward = FUNCTIONS[part.kind]
            ctx = Context(part, params, config, rng)
            ins = [put(reference.acts[i]) for i in part.inputs]
            _, cache = forward(ctx, *ins)
            douts = [put(reference.grads[o]) for o in part.outputs]
            self.items[item(part.name, "forward")] = Item(lambda f=forward, c=ctx, a=ins: f(c, *a), wait)
            backwards[part.name] = Item(lambda b=backward, c=ctx, k=cache, d=douts: b(c, k, *d), wait)
        for name in reversed(names):
            self.items[item(name, "backward")] = backwards[name]
        self._optimizer(config, reference, put, wait)
        self.step_item(self.backend, batches, wait)

    def _optimizer(self, config: Config, reference: Reference, put: Callable[[np.ndarray], Any],
                   wait: Callable[[Any], None]) -> None:
        """Clipping and AdamW, the backend's own functions, on copies of the parameters and the step-0 gradients."""
        params = {k: v.copy() for k, v in self.backend.params.items()}
        grads = {k: put(reference.params[k]) for k in params}
        opt = g.AdamW(params, betas=(config.beta1, config.beta2), eps=config.eps, weight_decay=config.weight_decay,
                      decay=config.decay)

        def call() -> None:
            if config.grad_clip > 0:
                g.clip_grad_norm(grads, config.grad_clip)
            opt.step(params, grads, config.learning_rate)
        self.items[OPTIMIZER] = Item(call, wait)

    def describe(self) -> dict[str, Any]:
        info = self.backend.describe()
        info["attention_dropout"] = bool(self.config and attention_sites(self.config))
        return info
