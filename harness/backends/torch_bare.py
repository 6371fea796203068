"""The torch backend's floor for `harness bench overhead` (harness.backends.base.BareLoop): a hand-written training
loop with no harness code between its steps, named by the torch declaration's `bare_loop`. Imports torch: used only
in the measuring process.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from harness.backends.base import Timed
from harness.config.fields import Config


class BareTorch:
    """The overhead benchmark's (b) for torch: the hand-written floor. No harness code runs between its steps.

    harness.models.torch_gpt.GPT loaded with the same weights, torch.optim.AdamW over the same two groups (decay on
    tensors of 2 or more dimensions) with the same implementation flags, global-norm clipping. Each step copies its
    batch to the device exactly as the torch backend's step does (on CUDA through a ring of pinned buffers,
    `torch_backend.PinnedBatches`; on the CPU `torch_backend.to_device`), and steps are timed as the runner times
    them (CUDA events, no per-step sync, on CUDA). With `cuda_graphs` the step is the backend's own captured step
    (`torch_step.StaticStep` with `CudaGraphCapture`) called directly, so that the runner's and the floor's steps
    are the same replay and the difference is the harness's loop. Numerics flags (TF32) are process-global and were
    set by the torch backend's setup, so both loops share them.
    """

    def __init__(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str, seed: int,
                 dtype: str = "float32", precision: str = "fp32", compile: bool | str = False, parity: bool = False,
                 cuda_graphs: bool = False):
        import torch

        from harness.backends.torch_backend import (
            CudaEventClock,
            PinnedBatches,
            adamw_flags,
            adamw_groups,
            build_model,
            to_device,
        )
        from harness.backends.torch_options import compile_mode
        from harness.backends.torch_step import CudaGraphCapture, StaticStep

        self.torch, self.to_device = torch, to_device
        self.device = torch.device(device)
        self.clock = CudaEventClock() if self.device.type == "cuda" else None
        torch.manual_seed(seed)
        model = build_model(config, weights, vocab_size)  # the config's model options, as the backend's
        self.model = model.to(device=self.device, dtype=getattr(torch, dtype))
        self.params = list(self.model.parameters())
        self.lr = config.learning_rate
        lr = StaticStep.make_lr(self.lr, getattr(torch, dtype), self.device) if cuda_graphs else self.lr
        groups = adamw_groups(self.model, config)
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=(config.beta1, config.beta2), eps=config.eps,
                                           **adamw_flags(self.device.type, parity, cuda_graphs))
        self.clip = config.grad_clip
        mode = compile_mode(compile)
        self.forward = torch.compile(self.model, mode=mode) if mode else self.model
        self.clone = mode == "reduce-overhead"  # a CUDA-graph output is overwritten by the next replay
        self.bf16 = precision == "bf16"
        shape = (config.batch_size, config.block_size)
        self.batches = PinnedBatches(shape, self.device) if self.device.type == "cuda" else None
        self.step = (StaticStep(self.model, self.optimizer, self.params, lr, self.clip, shape, self.device,
                                self._autocast, capture=CudaGraphCapture()) if cuda_graphs else None)
        self.compiles = bool(mode) or bool(cuda_graphs)  # its first repeat compiles or captures

    def _autocast(self):
        torch = self.torch
        return (torch.autocast(device_type=self.device.type, dtype=torch.bfloat16,
                               cache_enabled=self.step is None) if self.bf16  # as the backend's (no cache if captured)
                else contextlib.nullcontext())

    def _eager_step(self, x: np.ndarray, y: np.ndarray) -> Any:
        """Copy, forward, backward, clip, AdamW; the loss stays on the device."""
        torch = self.torch
        if self.batches is not None:
            both = self.batches(x, y)
            tx, ty = both[0], both[1]
        else:
            tx, ty = self.to_device(x, self.device), self.to_device(y, self.device)
        if self.clone:
            torch.compiler.cudagraph_mark_step_begin()
        with self._autocast():
            _, loss = self.forward(tx, ty)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        return loss.detach().clone() if self.clone else loss.detach()

    def repeat(self, batches: Sequence[tuple[np.ndarray, np.ndarray]], sync_each_step: bool = False) -> Timed:
        """The step over `batches`; losses stay on the device until the end (a captured step's ring is read every
        half ring). On CUDA steps are timed with events (no per-step sync) unless `sync_each_step`, which
        synchronises after every step and times on the host (what the per-step sync costs)."""
        torch, device, step = self.torch, self.device, self.step
        cuda = device.type == "cuda"
        clock = None if sync_each_step else self.clock
        self.model.train()
        losses: list = []
        values: list[float] = []
        times: list[Any] = []
        c_start, t_start = time.process_time(), time.perf_counter()
        for x, y in batches:
            start = clock.mark() if clock is not None else None
            t0 = time.perf_counter()
            losses.append(step(x, y, self.lr) if step is not None else self._eager_step(x, y))
            if clock is not None:
                times.append((start, clock.mark()))
            else:
                if cuda:
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            if step is not None and len(losses) >= step.ring // 2:
                values += step.read(losses)
                losses = []
        if step is not None:
            values += step.read(losses)
        elif losses:
            values += [float(v) for v in torch.stack(losses).double().cpu().tolist()]
        wall = time.perf_counter() - t_start
        step_s = [t if isinstance(t, float) else clock.elapsed_s(*t) for t in times]
        return Timed(wall, step_s, values, time.process_time() - c_start)

    def info(self) -> dict[str, Any]:
        """On CUDA, which scaled_dot_product_attention kernels torch may pick (flash needs bf16/fp16; fp32 gets
        mem-efficient)."""
        if self.device.type != "cuda":
            return {}
        torch = self.torch
        return {"sdpa": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                         "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                         "math": torch.backends.cuda.math_sdp_enabled(),
                         "float32_matmul_precision": torch.get_float32_matmul_precision()}}
