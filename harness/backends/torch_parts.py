"""PyTorch's parts (harness/core/parts.py) in autograd's idiom: each part's forward is the model's own modules and
methods (harness/models/torch_gpt.py: `heads`, `probabilities`, `merge`, `MLP.act`, the Linears, LayerNorms and
Dropouts) called with gradients recorded, as in a training step; its backward is `torch.autograd.grad` of the part's
outputs with respect to its inputs and its parameters (the graph of one forward, kept); the optimizer is the
backend's clipping and AdamW; the step is TorchBackend.train_step.

The model's step runs the attention probabilities and their product with v as one fused call
(F.scaled_dot_product_attention); the parts time them written out, as the taps are taken, so the fusion's gain is
in the "fusion and framework overhead" row.

On CUDA the items are timed with CUDA events around calls launched back to back (`time`), and `launches` counts the
kernels one call launches and their GPU time with torch.profiler, so that a launch-bound part is named as such. On
the CPU `launches` counts the operators a call dispatches (the same profiler, its CPU events).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from harness.backends.parts import GPU_SAMPLE_S, Item, PartRunner, Reference, as_dtype
from harness.config.fields import Config
from harness.core.parts import OPTIMIZER, Part, item, parts

Fn = Callable[..., tuple[torch.Tensor, ...]]


def part_function(model: Any, part: Part) -> Fn:
    """The forward of `part` as a function of its inputs, made of `model`'s own modules (bound now: a test that
    plants a change in the model before this call reaches the part)."""
    blk = model.h[part.block] if part.block is not None else None
    k = part.kind
    if k == "emb":
        return lambda idx: (model.drop(model.wte(idx) + model.wpe(torch.arange(idx.shape[1], device=idx.device))),)
    if k in ("ln_1", "ln_2"):
        ln = getattr(blk, k)
        return lambda x: (ln(x),)
    if k == "attn.qkv":
        return blk.attn.heads
    if k == "attn.probs":
        probabilities = blk.attn.probabilities
        return lambda q, k_: (probabilities(q, k_),)
    if k == "attn.y":
        drop, merge = blk.attn.attn_dropout, blk.attn.merge
        return lambda probs, v: (merge(drop(probs) @ v),)
    if k == "attn.proj":
        proj, drop = blk.attn.c_proj, blk.attn.resid_dropout
        return lambda y: (drop(proj(y)),)
    if k in ("res1", "res2"):
        return lambda x, branch: (x + branch,)
    if k == "mlp.fc":
        return lambda x: (blk.mlp.c_fc(x),)
    if k == "mlp.act":
        act = blk.mlp.act
        return lambda h: (act(h),)
    if k == "mlp.proj":
        proj, drop = blk.mlp.c_proj, blk.mlp.dropout
        return lambda a: (drop(proj(a)),)
    if k == "ln_f":
        return lambda x: (model.ln_f(x),)
    if k == "logits":
        return lambda h: (model.lm_head(h),)
    if k == "loss":
        return lambda logits, targets: (F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)),)
    raise ValueError(f"unknown part {part.name!r}")


class TorchParts(PartRunner):
    """PyTorch's parts: autograd forward and backward of the model's modules, the backend's AdamW, its step."""

    name = "torch"

    def setup(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str, seed: int,
              batches: list[tuple[np.ndarray, np.ndarray]], reference: Reference, names: list[str]) -> None:
        from harness.backends.torch_backend import TorchBackend, adamw_flags, adamw_groups, build_model

        self.backend = TorchBackend(**self.options)
        self.backend.setup(config, weights, vocab_size, device, seed)
        self.config, self.device = config, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.sync_each_call = not self.cuda
        if self.cuda:
            self.clock = "CUDA events around each item's calls, launched back to back"
            self.device_clock = True
            self.sample_s = GPU_SAMPLE_S  # queued back to back, as in a step (an event resolves half a microsecond)
        dtype = self.backend.dtype
        model = build_model(config, weights, vocab_size).to(device=self.device, dtype=dtype)
        model.train()  # dropout on, as in a training step
        self.model = model
        named = dict(model.named_parameters())
        if config.tie_embeddings:
            named["wte.weight"] = model.wte.weight

        def put(a: np.ndarray, grad: bool = False) -> torch.Tensor:
            t = torch.from_numpy(np.array(as_dtype(a, str(dtype).split(".")[-1]), order="C"))  # 0-d stays 0-d
            t = t.to(self.device)
            return t.requires_grad_(grad) if t.is_floating_point() else t

        chosen, backwards = set(names), {}
        for part in parts(config, vocab_size):
            if part.name not in chosen:
                continue
            fn = part_function(model, part)
            ins = [put(reference.acts[i], grad=True) for i in part.inputs]
            self.items[item(part.name, "forward")] = Item(lambda f=fn, a=ins: f(*a), self._wait)
            outs = fn(*ins)
            wrt = [t for t in ins if t.requires_grad] + [named[p] for p in part.params]
            douts = [put(reference.grads[o]) for o in part.outputs]
            backwards[part.name] = Item(
                lambda o=outs, w=wrt, d=douts: torch.autograd.grad(o, w, d, retain_graph=True), self._wait)
        for name in reversed(names):
            self.items[item(name, "backward")] = backwards[name]
        self._optimizer(config, model, reference, put, adamw_groups, adamw_flags)
        self.step_item(self.backend, batches, self._wait)

    def _optimizer(self, config: Config, model: Any, reference: Reference, put: Callable[..., torch.Tensor],
                   groups: Callable, flags: Callable) -> None:
        """Clipping and AdamW as the backend's (its groups and flags) on a copy of the model holding the step-0
        gradients: the parts' model is never updated."""
        import copy

        twin = copy.deepcopy(model)
        for name, p in twin.named_parameters():
            p.grad = put(reference.params[name])
        params = list(twin.parameters())
        opt = torch.optim.AdamW(groups(twin, config), lr=config.learning_rate, betas=(config.beta1, config.beta2),
                                eps=config.eps, **flags(self.device.type, self.backend.parity))

        def call() -> None:
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            opt.step()
        self.items[OPTIMIZER] = Item(call, self._wait)

    def _wait(self, out: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Any:
        """On CUDA a CUDA event recorded on the current stream (no synchronisation); on the CPU the host clock."""
        if not self.cuda:
            return super().mark()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a: Any, b: Any) -> float:
        return b - a if not self.cuda else a.elapsed_time(b) / 1e3

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def launches(self, key: str) -> dict | None:
        """What one call of item `key` launches, by torch.profiler: on CUDA the kernels (and copies) on the GPU and
        their GPU time; on the CPU the operators dispatched."""
        import os
        import warnings

        from torch.profiler import ProfilerActivity, profile

        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own start and stop lines, never shown
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        it = self.items[key]
        it.wait(it.call())  # nothing of an earlier call in the profile
        with warnings.catch_warnings():  # "the profiler clears events at the end of each cycle": one cycle here
            warnings.simplefilter("ignore", UserWarning)
            with profile(activities=activities) as prof:
                it.wait(it.call())
        return count_launches(prof.events(), self.cuda)

    def describe(self) -> dict[str, Any]:
        info = self.backend.describe()
        info["attention_in_step"] = "F.scaled_dot_product_attention (one fused call)"
        info["attention_in_parts"] = "written out: probabilities, then probs @ v"
        return info


def count_launches(events: Any, cuda: bool) -> dict:
    """From torch.profiler's events of one call: on CUDA {"kernels": device events (kernels, copies, memsets),
    "kernel_us": their summed GPU time}; on the CPU {"ops": top-level operators}."""
    from torch.autograd import DeviceType

    if cuda:
        device = [e for e in events if e.device_type == DeviceType.CUDA]
        return {"kernels": len(device), "kernel_us": float(sum(e.time_range.elapsed_us() for e in device))}
    # the first level of operators: not the ones an operator calls (aten::linear's aten::addmm), but those that
    # autograd's engine calls in a backward pass
    top = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return {"ops": len(top)}
