"""The torch backend's training step on static buffers, and its capture as one CUDA graph (`--cuda-graphs`).

A small model's step on a GPU is launch-bound: its kernels take microseconds, launching them from Python takes
milliseconds (docs/benchmarks.md, "CUDA"). A CUDA graph records the whole step once, forward, backward,
`clip_grad_norm_` and the AdamW update, and replays it with one launch. Replay runs the recorded kernels on the
recorded addresses, so everything the step reads or writes lives in memory made once (`StaticStep`):

- the batch, copied into one device buffer through a ring of pinned host buffers (`PinnedBatches`);
- the learning rate: a 0-d device tensor the optimizer reads (AdamW takes `lr` as a Tensor; with
  `capturable=True` its step count and bias corrections stay on the device too), refilled before each step;
- parity's dropout keep-masks, copied into buffers of their own;
- the gradients: set to None before the capture, so that the captured backward allocates them in the graph's pool;
- the loss: each step writes its loss into a ring at a slot kept on the device and advanced by the step itself, so
  the host reads losses only at flushes (`read`), a whole ring at once.

Dropout draws from the default CUDA generator, which is graph-safe: the captured kernels read their Philox seed and
offset from the generator at each replay, and each replay advances it by the whole graph's offset, as the eager
kernels would, so a replayed step draws exactly the masks the eager step draws (torch/cuda/graphs.py; ATen's note
"CUDA Graph-safe RNG states").

`StaticStep` runs the same step eagerly (`capture=None`: the CPU, the tests, and the eager half of the CUDA test
that compares the two) or through a `Capture`: `CudaGraphCapture` warms the step up on a side stream (optimizer
state, cuBLAS workspaces and autograd's lazy state must exist before a capture), puts the parameters, the optimizer
state, the loss slot and the random generators back as they were, in place, and captures; so step 0 is the eager
step 0 and the captured step's numbers equal the eager step's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
import torch

LOSS_RING = 1024  # losses kept on the device: the runner reads them every 50 steps (harness.run.loop.FLUSH_EVERY)
PINNED_DEPTH = 4  # pinned host buffers a batch is staged through: the host runs at most this many steps ahead
WARMUP_STEPS = 3  # eager steps on a side stream before a capture (torch's examples use 3)


class PinnedBatches:
    """Batches (x, y) to one device buffer (2, B, T) int64 through a ring of `depth` pinned host buffers.

    Copying from pinned memory is asynchronous (non_blocking) and overlaps with queued work; pinning a fresh host
    buffer for every batch costs tens of microseconds, so the buffers are pinned once and reused. A buffer is
    reused only after the copy that last read it has completed (its event), which also keeps the host at most
    `depth` steps ahead of the device. On the CPU the batch is copied into the buffer directly."""

    def __init__(self, shape: tuple[int, int], device: torch.device, depth: int = PINNED_DEPTH):
        self.device, self.shape = device, tuple(shape)
        self.out = torch.empty((2, *self.shape), dtype=torch.int64, device=device)
        self.cuda = device.type == "cuda"
        self.host = [torch.empty((2, *self.shape), dtype=torch.int64, pin_memory=self.cuda)
                     for _ in range(depth if self.cuda else 1)]
        self.views = [h.numpy() for h in self.host]  # numpy views of the pinned memory: copyto is a memcpy
        self.copied = [torch.cuda.Event() for _ in self.host] if self.cuda else []
        self.used = [False] * len(self.host)
        self.k = 0

    def __call__(self, x: np.ndarray, y: np.ndarray) -> torch.Tensor:
        """The device buffer, holding (x, y) once the copy queued now has run: out[0] is x, out[1] is y."""
        if not self.cuda:
            np.copyto(self.views[0][0], x, casting="unsafe")
            np.copyto(self.views[0][1], y, casting="unsafe")
            self.out.copy_(self.host[0])
            return self.out
        i = self.k % len(self.host)
        self.k += 1
        if self.used[i]:
            self.copied[i].synchronize()  # the copy `depth` steps ago that read this buffer is done
        np.copyto(self.views[i][0], x, casting="unsafe")
        np.copyto(self.views[i][1], y, casting="unsafe")
        self.out.copy_(self.host[i], non_blocking=True)
        self.copied[i].record()
        self.used[i] = True
        return self.out


class Replay(Protocol):
    """A recorded step: `replay()` runs it once (torch.cuda.CUDAGraph)."""

    def replay(self) -> None:
        """Run the recorded work once."""


class Capture(Protocol):
    """How a StaticStep's body is recorded for replay (CudaGraphCapture; tests give fakes)."""

    def record(self, step: StaticStep) -> Replay:
        """Record `step.body()` and return what replays it; the step's state must be as before afterwards."""


class StaticStep:
    """One training step (forward, backward, clip, AdamW, loss into the ring) on buffers made once.

    `model` in train mode, `optimizer` built with `lr=self.lr` (`make_lr`), `params` the clipped parameters,
    `context()` the autocast / SDPA-kernel context of a forward. Call it with a batch, a learning rate and optional
    keep-masks; it returns a token (the step's number) whose loss `read` fetches later. With `capture` the body is
    recorded at the first call (again if the masks' layout changes) and replayed after."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                 lr: torch.Tensor, grad_clip: float, batch_shape: tuple[int, int], device: torch.device,
                 context: Callable[[], AbstractContextManager], capture: Capture | None = None,
                 ring: int = LOSS_RING):
        self.model, self.optimizer, self.params, self.lr = model, optimizer, params, lr
        self.grad_clip, self.context, self.capture, self.ring = grad_clip, context, capture, ring
        self.batches = PinnedBatches(batch_shape, device)
        self.losses = torch.zeros(ring, dtype=lr.dtype, device=device)
        self.slot = torch.zeros((), dtype=torch.int64, device=device)
        self.masks: dict[str, torch.Tensor] = {}
        self.graph: Replay | None = None
        self.graph_masks: frozenset | None = None  # the mask layout the graph was recorded with (mask_layout)
        self.captures = 0
        self.count = 0  # steps run; step n's loss is at losses[n % ring] until step n + ring overwrites it

    @staticmethod
    def make_lr(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The learning-rate tensor the optimizer is built with (the model's dtype, so float64 keeps its rate)."""
        return torch.tensor(float(value), dtype=dtype, device=device)

    def body(self) -> None:
        """The step on the static buffers: what is recorded, and what runs eagerly without a capture."""
        x, y = self.batches.out[0], self.batches.out[1]
        with self.context():
            _, loss = self.model(x, y, self.masks or None)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)  # no host sync: the clamp is on the device
        self.optimizer.step()
        self.losses.index_copy_(0, self.slot.view(1), loss.detach().to(self.losses.dtype).view(1))
        self.slot.add_(1).remainder_(self.ring)

    def load(self, x: np.ndarray, y: np.ndarray, lr: float, masks: dict[str, np.ndarray] | None) -> None:
        """Copy this step's batch, rate and masks into the static buffers (queued, no host sync on CUDA)."""
        self.batches(x, y)
        self.lr.fill_(lr)
        for name, m in (masks or {}).items():
            src = torch.from_numpy(np.asarray(m))
            buf = self.masks.get(name)
            if buf is None or tuple(buf.shape) != tuple(src.shape):
                buf = self.masks[name] = torch.empty(src.shape, dtype=self.lr.dtype, device=self.lr.device)
            buf.copy_(src)
        for name in set(self.masks) - set(masks or {}):
            del self.masks[name]

    def __call__(self, x: np.ndarray, y: np.ndarray, lr: float, masks: dict[str, np.ndarray] | None = None) -> int:
        """One step; returns its token for `read`."""
        self.load(x, y, lr, masks)
        if self.capture is None:
            self.body()
        else:
            names = self.mask_layout()
            if self.graph is None or names != self.graph_masks:
                self.graph, self.graph_masks = self.capture.record(self), names
                self.captures += 1
            self.graph.replay()
        self.count += 1
        return self.count - 1

    def mask_layout(self) -> frozenset[tuple[str, tuple[int, ...]]]:
        """The names and shapes of the mask buffers: a graph reads the buffers it was recorded with, so another
        layout (a mask more or less, or one reallocated for another shape) needs a new recording."""
        return frozenset((name, tuple(buf.shape)) for name, buf in self.masks.items())

    def prepare(self, x: np.ndarray, y: np.ndarray, lr: float) -> None:
        """Record the step now, on batch (x, y), without running a step (the runner's warm-up before step 0, so
        that the capture is not inside step 0's time); nothing without a capture."""
        if self.capture is not None and self.graph is None:
            self.load(x, y, lr, None)
            self.graph, self.graph_masks = self.capture.record(self), self.mask_layout()
            self.captures += 1

    def _check(self, tokens: list[int]) -> None:
        if tokens and min(tokens) < self.count - self.ring:
            raise RuntimeError(f"the loss of step {min(tokens)} was overwritten (the ring keeps the last {self.ring} "
                               "steps): read losses more often")

    def read(self, tokens: list[int]) -> list[float]:
        """The losses of the steps `tokens` names (one copy of the ring to the host: a sync on CUDA)."""
        self._check(tokens)
        values = self.losses.double().cpu().tolist()
        return [values[t % self.ring] for t in tokens]

    def fetch(self, tokens: list[int]) -> Callable[[], list[float]]:
        """Start copying the ring to the host without waiting; the function returned waits for that copy (by then
        long done, when called a flush later) and gives the losses of `tokens`. The copy is queued after every step
        queued so far and before any later one, so it holds exactly their losses."""
        self._check(tokens)
        if self.losses.device.type != "cuda":
            values = self.read(tokens)
            return lambda: values
        host = torch.empty(self.ring, dtype=self.losses.dtype, pin_memory=True)
        host.copy_(self.losses, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def result() -> list[float]:
            done.synchronize()
            values = host.tolist()
            return [float(values[t % self.ring]) for t in tokens]

        return result

    # --- what a warm-up changes, put back in place (the graph keeps every address) ---------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Copies of the parameters, the optimizer state, the loss slot and the random generators."""
        state = {p: {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                 for p, st in self.optimizer.state.items()}
        cuda = self.lr.device.type == "cuda"
        return {"params": [p.detach().clone() for p in self.params], "state": state, "slot": self.slot.clone(),
                "cpu_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(self.lr.device) if cuda else None}

    @torch.no_grad()
    def restore(self, saved: dict[str, Any]) -> None:
        """Put back what `snapshot` copied, in place. Optimizer state that the warm-up created (there was none
        before: step 0) is zeroed, which is what AdamW's lazy initialisation would create at step 0."""
        for p, value in zip(self.params, saved["params"], strict=True):
            p.copy_(value)
        for p, st in self.optimizer.state.items():
            before = saved["state"].get(p, {})
            for key, value in st.items():
                if torch.is_tensor(value):
                    if key in before:
                        value.copy_(before[key])
                    else:
                        value.zero_()
        self.slot.copy_(saved["slot"])
        torch.set_rng_state(saved["cpu_rng"])
        if saved["cuda_rng"] is not None:
            torch.cuda.set_rng_state(saved["cuda_rng"], self.lr.device)


class CudaGraphCapture:
    """Records a StaticStep's body as one torch.cuda.CUDAGraph, the way torch's documentation captures a whole
    training step: warm-up iterations on a side stream, gradients set to None, the capture (on torch.cuda.graph's
    own side stream). The warm-up's changes are undone in place before the capture, so the first replay is step 0
    of an untouched model."""

    def __init__(self, warmup_steps: int = WARMUP_STEPS):
        self.warmup_steps = warmup_steps

    def record(self, step: StaticStep) -> Replay:
        """Warm up, put everything back in place, capture."""
        saved = step.snapshot()
        with self.side_stream():
            for _ in range(self.warmup_steps):
                step.body()
        step.restore(saved)
        step.optimizer.zero_grad(set_to_none=True)  # the captured backward allocates the gradients in the graph pool
        return self.graph_of(step.body)

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        """The warm-up's stream: a side stream that starts after the work queued so far, and that the current
        stream waits for after it (torch's recipe; the tests run it on the CPU without one)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    def graph_of(self, body: Callable[[], None]) -> Replay:
        """`body` captured as one CUDA graph (torch.cuda.graph captures on a side stream of its own)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return graph
