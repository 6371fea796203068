"""Known bugs, planted on purpose to watch parity name them (tests/test_parity_taps.py, tests/test_parity_depths.py,
tools/planted_bugs.py).

Each plant patches one thing in this process and returns a function that undoes it: `apply(name)` (also from a
`sitecustomize.py`, so that a `harness parity` command and its worker processes all carry it: see `SITECUSTOMIZE`),
or `with planted(name): ...`. NUMPY plants change the NumPy oracle (harness/models/numpy_gpt.py or its backend) forward
and backward consistently, so the planted oracle is a coherent, differently-defined model; TORCH plants change the
PyTorch model or optimizer. SLOWDOWNS (`harness bench parts`: tests/test_bench_parts.py, tools/planted_slowdowns.py)
make one part of one backend's model 20x slower or more, its results unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

Undo = Callable[[], None]


def _patch(owner: Any, name: str, value: Any) -> Undo:
    old = getattr(owner, name)
    setattr(owner, name, value)
    return lambda: setattr(owner, name, old)


# --- the NumPy oracle ----------------------------------------------------------------------------------------------
def _ln_eps() -> Undo:
    from harness.models import numpy_gpt

    f = numpy_gpt.layernorm_forward
    old = f.__defaults__
    f.__defaults__ = (1e-3,)

    def undo() -> None:
        f.__defaults__ = old
    return undo


def _mask_wide() -> Undo:
    from harness.models import numpy_gpt as g

    def causal_attention_forward(q: Any, k: Any, v: Any, p: float = 0.0, rng: Any = None,
                                 keep: Any = None) -> tuple[Any, Any]:
        T, D = q.shape[-2], q.shape[-1]
        scale = 1.0 / math.sqrt(D)
        scores = (q @ k.swapaxes(-1, -2)) * scale
        future = g.xp.triu(g.xp.ones((T, T), dtype=bool), k=2)  # the bug: key t + 1 stays visible
        probs, cache = g.softmax_forward(g.xp.where(future, -g.xp.inf, scores))
        dropped, drop_cache = g.dropout_forward(probs, p, rng, keep)
        return dropped @ v, (q, k, v, probs, cache, dropped, drop_cache, scale)
    return _patch(g, "causal_attention_forward", causal_attention_forward)


def _scale_1_over_d() -> Undo:
    from harness.models import numpy_gpt as g

    def causal_attention_forward(q: Any, k: Any, v: Any, p: float = 0.0, rng: Any = None,
                                 keep: Any = None) -> tuple[Any, Any]:
        T, D = q.shape[-2], q.shape[-1]
        scale = 1.0 / D  # the bug: 1/D instead of 1/sqrt(D)
        scores = (q @ k.swapaxes(-1, -2)) * scale
        future = g.xp.triu(g.xp.ones((T, T), dtype=bool), k=1)
        probs, cache = g.softmax_forward(g.xp.where(future, -g.xp.inf, scores))
        dropped, drop_cache = g.dropout_forward(probs, p, rng, keep)
        return dropped @ v, (q, k, v, probs, cache, dropped, drop_cache, scale)
    return _patch(g, "causal_attention_forward", causal_attention_forward)


def _gelu_exact() -> Undo:
    from harness.models import numpy_gpt as g

    # the bug: the oracle's own exact (erf) form where config.gelu asks for the tanh form (gelu_pair looks the
    # functions up at each call, so every model built from the module gets them)
    undo = [_patch(g, "gelu_forward", g.gelu_erf_forward), _patch(g, "gelu_backward", g.gelu_erf_backward)]
    return lambda: [u() for u in undo] and None


def _pos_shift() -> Undo:
    from harness.models import numpy_gpt as g

    def embedding_forward(idx: Any, wte: Any, wpe: Any) -> tuple[Any, Any]:
        T = idx.shape[1]
        pos = (g.xp.arange(T) - 1) % T  # the bug: position t reads wpe[t - 1]
        return wte[idx] + wpe[pos], (idx, wte.shape, wpe.shape)

    def embedding_backward(dout: Any, cache: Any) -> tuple[Any, Any]:
        idx, wte_shape, wpe_shape = cache
        T, C = idx.shape[1], dout.shape[-1]
        dwte = g.xp.zeros(wte_shape, dtype=dout.dtype)
        g._scatter_add(dwte, idx.reshape(-1), dout.reshape(-1, C))
        dwpe = g.xp.zeros(wpe_shape, dtype=dout.dtype)
        dwpe[(g.xp.arange(T) - 1) % T] = dout.sum(axis=0)
        return dwte, dwpe
    undo = [_patch(g, "embedding_forward", embedding_forward), _patch(g, "embedding_backward", embedding_backward)]
    return lambda: [u() for u in undo] and None


def _adam_counter_stops_at_3() -> Undo:
    from harness.models import numpy_gpt as g

    step = g.AdamW.step

    def planted(self: Any, params: dict, grads: dict, lr: float) -> None:
        if self.t >= 3:  # the bug: the step counter stops advancing after step 3 (step() adds the 1 back)
            self.t -= 1
        step(self, params, grads, lr)
    return _patch(g.AdamW, "step", planted)


def _clip_per_parameter() -> Undo:
    from harness.models import numpy_gpt as g

    def clip_grad_norm(grads: dict, max_norm: float) -> Any:
        norms = []
        for gr in grads.values():  # the bug: every gradient clipped by its own norm, not the global one
            n = g.xp.sqrt((gr * gr).sum())
            gr *= g.xp.minimum(max_norm / (n + 1e-6), 1.0)
            norms.append(n)
        return g.xp.sqrt(sum(n * n for n in norms))
    return _patch(g, "clip_grad_norm", clip_grad_norm)


def _embeddings_not_decayed() -> Undo:
    from harness.backends.numpy_backend import NumpyBackend

    setup = NumpyBackend.setup

    def planted_setup(self: Any, *args: Any, **kwargs: Any) -> None:
        setup(self, *args, **kwargs)
        for name in ("wte.weight", "wpe.weight"):  # the bug: minGPT's convention, no decay on the embeddings
            self.optimizer.decay[name] = False
    return _patch(NumpyBackend, "setup", planted_setup)


def _masks_of_previous_step() -> Undo:
    from harness.backends.numpy_backend import NumpyBackend

    train_step = NumpyBackend.train_step

    def planted(self: Any, x: Any, y: Any, lr: float, masks: dict | None = None) -> float:
        stale = getattr(self, "_planted_masks", None)  # the bug: step k applies the masks of step k - 1
        self._planted_masks = masks
        return train_step(self, x, y, lr, stale if stale is not None else masks)
    return _patch(NumpyBackend, "train_step", planted)


def _dropout_in_train_step() -> Undo:
    from harness.backends.numpy_backend import NumpyBackend

    train_step = NumpyBackend.train_step

    def planted(self: Any, x: Any, y: Any, lr: float, masks: dict | None = None) -> float:
        config = self.config
        self.config = config.replace(dropout=0.1)  # the bug: dropout 0.1 in training, whatever the config says
        try:
            return train_step(self, x, y, lr, masks)
        finally:
            self.config = config
    return _patch(NumpyBackend, "train_step", planted)


def _attention_dropout(mode: str) -> Callable[[], Undo]:
    """The oracle's attention dropout done wrong, forward and backward alike: "missing" (the probabilities not
    dropped), "unscaled" (kept ones not divided by 1 - p), "after-v" (dropout on y = probs @ v instead of on the
    probabilities, with the mask's first D key columns as y's mask, so the harness's masks still decide)."""
    def apply_() -> Undo:
        from harness.models import numpy_gpt as g

        forward, backward = g.causal_attention_forward, g.causal_attention_backward

        def planted_forward(q: Any, k: Any, v: Any, p: float = 0.0, rng: Any = None,
                            keep: Any = None) -> tuple[Any, Any]:
            if keep is None and rng is not None and p > 0:
                keep = rng.random((*q.shape[:-1], q.shape[-2])) >= p  # its own draw, as the model's
            if mode == "missing" or keep is None:
                return forward(q, k, v, 0.0, None, None)
            if mode == "unscaled":
                y, cache = forward(q, k, v, 0.0, None, None)
                mask = g.xp.asarray(keep, dtype=q.dtype)  # the bug: no 1 / (1 - p)
                dropped = cache[3] * mask
                return dropped @ v, (*cache[:5], dropped, mask, cache[7])
            y, cache = forward(q, k, v, 0.0, None, None)  # after-v: y = (probs @ v) * mask / (1 - p)
            mask = g.xp.asarray(keep[..., :v.shape[-1]], dtype=q.dtype) / (1 - p)
            return y * mask, (*cache, "after-v", mask)  # cache[3] stays the probabilities (the tap)

        def planted_backward(dout: Any, cache: Any) -> tuple[Any, Any, Any]:
            if len(cache) == 10 and isinstance(cache[8], str):
                return backward(dout * cache[9], cache[:8])
            return backward(dout, cache)

        undo = [_patch(g, "causal_attention_forward", planted_forward),
                _patch(g, "causal_attention_backward", planted_backward)]
        return lambda: [u() for u in undo] and None
    return apply_


def _transposed(masks: dict | None) -> dict | None:
    """Every mask transposed: query and key swapped at the attention probabilities, the axes reversed (mask.T)
    where that keeps a (B, T, C) mask's shape (B = C, as on small and medium)."""
    if masks is None:
        return None
    return {k: m.swapaxes(-1, -2) if m.ndim == 4 else m.T if m.T.shape == m.shape else m for k, m in masks.items()}


def _numpy_masks(change: Callable[[Any, dict | None], dict | None]) -> Callable[[], Undo]:
    """A NumpyBackend that applies `change(backend, masks)` instead of the masks it is handed, in every call that
    takes them (train_step, gradients, taps)."""
    def apply_() -> Undo:
        from harness.backends.numpy_backend import NumpyBackend

        train_step, gradients, taps = NumpyBackend.train_step, NumpyBackend.gradients, NumpyBackend.taps

        def planted_train_step(self: Any, x: Any, y: Any, lr: float, masks: dict | None = None) -> float:
            return train_step(self, x, y, lr, change(self, masks))

        def planted_gradients(self: Any, x: Any, y: Any, masks: dict | None = None) -> dict:
            return gradients(self, x, y, change(self, masks))

        def planted_taps(self: Any, x: Any, masks: dict | None = None) -> dict:
            return taps(self, x, change(self, masks))

        undo = [_patch(NumpyBackend, "train_step", planted_train_step),
                _patch(NumpyBackend, "gradients", planted_gradients), _patch(NumpyBackend, "taps", planted_taps)]
        return lambda: [u() for u in undo] and None
    return apply_


def _previous_step(backend: Any, masks: dict | None) -> dict | None:
    """The masks of the step before the backend's (its AdamW step count), as a port that indexes the run's masks
    by step - 1 gets them: step 0 reads index -1, the run's last step. Cut to the rows handed (the taps')."""
    if masks is None:
        return None
    from harness.core.masks import dropout_masks

    c = backend.config
    previous = dropout_masks(c, PLANT_SEED, (backend.optimizer.t - 1) % c.steps)
    return {k: previous[k][:len(m)] for k, m in masks.items()}


PLANT_SEED = 1337  # the seed the masks plants assume (the tests' and tools/planted_bugs.py's)


# --- the torch model and optimizer ---------------------------------------------------------------------------------
def _torch_attention_dropout(mode: str) -> Callable[[], Undo]:
    """torch's attention with the harness's mask done wrong ("missing", "unscaled", "after-v", as
    `_attention_dropout`): CausalSelfAttention.forward with its written-out path changed; autograd follows."""
    def apply_() -> Undo:
        from harness.models import torch_gpt as tg

        forward = tg.CausalSelfAttention.forward

        def planted(self: Any, x: Any, mask: Any = None, taps: Any = None, probs_mask: Any = None) -> Any:
            if probs_mask is None:
                return forward(self, x, mask, taps, probs_mask)
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
            probs = self.probabilities(q, k)
            if mode == "missing":
                y = probs @ v
            elif mode == "unscaled":
                y = (probs * probs_mask) @ v
            else:
                y = (probs @ v) * probs_mask[..., :v.size(-1)] / (1 - self.attn_dropout.p)
            if taps is not None:
                taps.update({"attn.q": q, "attn.k": k, "attn.v": v, "attn.probs": probs})
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            out = self.c_proj(y)
            if taps is not None:
                taps.update({"attn.y": y, "attn.proj": out})
            return self.resid_dropout(out, mask)
        return _patch(tg.CausalSelfAttention, "forward", planted)
    return apply_



def torch_attention_call(**forced: Any) -> Callable[[], Undo]:
    """A plant in torch's attention call only: F.scaled_dot_product_attention, as harness/models/torch_gpt.py calls
    it, with `forced` keyword arguments (scale=1.0, is_causal=False, dropout_p=...). The probabilities torch_gpt taps
    are written out apart from that call, so they stay right, exactly as with a real bug in the call."""
    def apply_() -> Undo:
        import torch.nn.functional as F

        sdpa = F.scaled_dot_product_attention

        def planted(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
            return sdpa(q, k, v, *args, **{**kwargs, **forced})
        return _patch(F, "scaled_dot_product_attention", planted)
    return apply_


def _torch_gelu_exact() -> Undo:
    import torch.nn.functional as F

    gelu = F.gelu
    return _patch(F, "gelu", lambda x, approximate="none": gelu(x))  # the bug: the exact form, whatever is asked


def _torch_ln_eps() -> Undo:
    import torch

    layer_norm = torch.nn.functional.layer_norm
    return _patch(torch.nn.functional, "layer_norm",
                  lambda x, shape, w=None, b=None, eps=1e-5: layer_norm(x, shape, w, b, 1e-10))


class AdamWWithoutBiasCorrection:
    """torch.optim.AdamW's update with one planted bug: no bias correction of m and v (built lazily: torch)."""

    def __new__(cls, groups: list[dict], lr: float, betas: tuple[float, float], eps: float) -> Any:
        import torch

        class Planted(torch.optim.Optimizer):
            def __init__(self) -> None:
                super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})

            @torch.no_grad()
            def step(self, closure: object = None) -> None:
                for group in self.param_groups:
                    b1, b2 = group["betas"]
                    for p in group["params"]:
                        st = self.state[p]
                        if not st:
                            st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                      exp_avg_sq=torch.zeros_like(p))
                        st["step"] += 1
                        p.mul_(1 - group["lr"] * group["weight_decay"])
                        st["exp_avg"].lerp_(p.grad, 1 - b1)
                        st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                        p.addcdiv_(st["exp_avg"], st["exp_avg_sq"].sqrt().add_(group["eps"]), value=-group["lr"])
        return Planted()


def plant_optimizer_bug(bug: str) -> Callable[[Any], None]:
    """A function that plants `bug` in a set-up TorchBackend (its optimizer or its config)."""

    def plant(backend: Any) -> None:
        import torch

        opt, c = backend.optimizer, backend.config
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]
        if bug == "no bias correction":
            backend.optimizer = AdamWWithoutBiasCorrection(groups, c.learning_rate, (c.beta1, c.beta2), c.eps)
        elif bug == "decay on 1-D parameters":
            opt.param_groups[1]["weight_decay"] = c.weight_decay  # the group of biases and LayerNorm weights
        elif bug == "clip at 0.5":
            backend.config = c.replace(grad_clip=0.5)
        elif bug == "eps 1e-6":
            for g in opt.param_groups:
                g["eps"] = 1e-6
        elif bug == "beta2 0.99":
            for g in opt.param_groups:
                g["betas"] = (c.beta1, 0.99)
        elif bug == "coupled weight decay":  # torch.optim.Adam adds weight_decay * p to the gradient (L2)
            backend.optimizer = torch.optim.Adam(groups, lr=c.learning_rate, betas=(c.beta1, c.beta2), eps=c.eps)
        else:
            raise ValueError(bug)

    return plant


def _torch_optimizer(bug: str) -> Callable[[], Undo]:
    def apply_() -> Undo:
        from harness.backends.torch_backend import TorchBackend

        setup = TorchBackend.setup

        def planted_setup(self: Any, *args: Any, **kwargs: Any) -> None:
            setup(self, *args, **kwargs)
            plant_optimizer_bug(bug)(self)
        return _patch(TorchBackend, "setup", planted_setup)
    return apply_


# name: (where, description, apply)
PLANTS: dict[str, tuple[str, str, Callable[[], Undo]]] = {
    "ln-eps": ("numpy", "LayerNorm eps 1e-3 instead of 1e-5", _ln_eps),
    "mask-wide": ("numpy", "causal mask one too wide (key t + 1 visible to query t)", _mask_wide),
    "scale-1/D": ("numpy", "attention scale 1/D instead of 1/sqrt(D)", _scale_1_over_d),
    "gelu-exact": ("numpy", "exact (erf) GELU where the tanh form is expected", _gelu_exact),
    "pos-shift": ("numpy", "position embedding shifted by one (position t reads wpe[t-1])", _pos_shift),
    "adam-t-stops": ("numpy", "AdamW step counter stops advancing after step 3", _adam_counter_stops_at_3),
    "clip-per-param": ("numpy", "gradient clipping per parameter instead of by the global norm",
                       _clip_per_parameter),
    "no-decay-emb": ("numpy", "no weight decay on the embeddings (minGPT's convention)", _embeddings_not_decayed),
    "masks-off-by-one": ("numpy", "dropout masks of step k - 1 used at step k, in the training loop only",
                         _masks_of_previous_step),
    "dropout-in-step": ("numpy", "dropout 0.1 inside the training step only (dropout 0 configured)",
                        _dropout_in_train_step),
    "attn-drop-after-v": ("numpy", "attention dropout applied after the value product (on y = probs @ v)",
                          _attention_dropout("after-v")),
    "attn-drop-unscaled": ("numpy", "attention dropout not rescaled by 1/(1-p)", _attention_dropout("unscaled")),
    "attn-drop-missing": ("numpy", "attention dropout missing (the probabilities not dropped)",
                          _attention_dropout("missing")),
    "masks-transposed": ("numpy", "dropout masks transposed (query and key swapped; (B, T, C) masks as mask.T)",
                         _numpy_masks(lambda backend, masks: _transposed(masks))),
    "masks-previous-step": ("numpy", "dropout masks of the previous step (step k reads masks[k - 1], step 0 the "
                            "last step's)", _numpy_masks(_previous_step)),
    "torch-unscaled": ("torch", "attention scale 1 instead of 1/sqrt(head size)", torch_attention_call(scale=1.0)),
    "torch-attn-drop-after-v": ("torch", "attention dropout applied after the value product (on y = probs @ v)",
                                _torch_attention_dropout("after-v")),
    "torch-attn-drop-unscaled": ("torch", "attention dropout not rescaled by 1/(1-p)",
                                 _torch_attention_dropout("unscaled")),
    "torch-attn-drop-missing": ("torch", "attention dropout missing (the probabilities not dropped)",
                                _torch_attention_dropout("missing")),
    "torch-gelu-exact": ("torch", "exact (erf) GELU where the tanh form is expected", _torch_gelu_exact),
    "torch-ln-eps": ("torch", "LayerNorm eps 1e-10 instead of 1e-5", _torch_ln_eps),
    **{f"torch-{bug.replace(' ', '-')}": ("torch", f"AdamW: {bug}", _torch_optimizer(bug))
       for bug in ("no bias correction", "decay on 1-D parameters", "clip at 0.5", "eps 1e-6", "beta2 0.99",
                   "coupled weight decay")},
}


# --- planted slowdowns (harness bench parts): one part made 20x+ slower, the model's result unchanged -----------------
COPIES = 2000  # the torch plant's extra copies of the MLP's activation
REPEATS = 100  # the jax plant's repeats of GELU's pullback


def _numpy_softmax_loop() -> Undo:
    from harness.models import numpy_gpt as g

    def softmax_forward(scores: Any) -> tuple[Any, Any]:
        rows = scores.reshape(-1, scores.shape[-1])
        probs = g.xp.empty_like(rows)
        for i in range(rows.shape[0]):  # the slowdown: one row at a time, in Python
            e = g.xp.exp(rows[i] - rows[i].max())
            probs[i] = e / e.sum()
        probs = probs.reshape(scores.shape)
        return probs, probs
    return _patch(g, "softmax_forward", softmax_forward)


def _torch_activation_copies() -> Undo:
    from harness.models import torch_gpt as tg

    act = tg.MLP.act

    def planted(self: Any, h: Any) -> Any:
        import torch

        a = act(self, h)
        with torch.no_grad():
            for _ in range(COPIES):  # the slowdown: copies of the activation, made and dropped (forward only)
                a.clone()
        return a
    return _patch(tg.MLP, "act", planted)


def _jax_gelu_backward_repeated() -> Undo:
    import jax
    import jax.numpy as jnp

    from harness.models import jax_gpt as m

    gelu = m.gelu

    def planted(x: Any, form: str) -> Any:
        @jax.custom_vjp
        def f(x: Any) -> Any:
            return gelu(x, form)

        def forward(x: Any) -> tuple[Any, Any]:
            return gelu(x, form), x

        def backward(x: Any, g: Any) -> tuple[Any]:
            # the slowdown: the pullback recomputed REPEATS times in a loop (x * (1 + i * 1e-30) is x itself, but
            # XLA cannot know it, so it cannot hoist the work out of the loop); the last one is the result
            def again(i: Any, acc: Any) -> Any:
                return jax.vjp(lambda t: gelu(t, form), x * (1 + i * 1e-30))[1](g)[0]
            return (jax.lax.fori_loop(0, REPEATS, again, jnp.zeros_like(x)),)
        f.defvjp(forward, backward)
        return f(x)
    return _patch(m, "gelu", planted)


# name: (backend, the part it slows, direction, description, apply)
SLOWDOWNS: dict[str, tuple[str, str, str, str, Callable[[], Undo]]] = {
    "numpy-softmax-loop": ("numpy", "h.*.attn.probs", "forward", "the softmax of the attention computed row by row "
                           "in a Python loop", _numpy_softmax_loop),
    "torch-activation-copies": ("torch", "h.*.mlp.act", "forward", f"{COPIES} extra copies of the MLP's activation "
                                "(made and dropped, no gradient)", _torch_activation_copies),
    "jax-gelu-backward-loop": ("jax", "h.*.mlp.act", "backward", f"GELU's pullback recomputed {REPEATS} times in a "
                               "lax.fori_loop", _jax_gelu_backward_repeated),
}


def apply(name: str) -> Undo:
    """Plant bug (or slowdown) `name` in this process; returns the undo."""
    if name in SLOWDOWNS:
        return SLOWDOWNS[name][4]()
    return PLANTS[name][2]()


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    """Bug `name` planted for the duration of the block."""
    undo = apply(name)
    try:
        yield
    finally:
        undo()


# A sitecustomize.py that plants $HARNESS_TEST_PLANT in every Python process started with the tests directory on
# PYTHONPATH (the harness command and its workers).
SITECUSTOMIZE = """
import os
if os.environ.get("HARNESS_TEST_PLANT"):
    import plants
    plants.apply(os.environ["HARNESS_TEST_PLANT"])
"""
