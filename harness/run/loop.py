"""The training loop every backend runs under: same batches, same evaluation points, same records.

It times each step, keeps losses on the device until a flush point, evaluates on the fixed batches,
checkpoints, and turns Ctrl-C / SIGTERM / a non-finite loss into a record status instead of a lost run.

What a step time is:
- on a synchronous device (CPU) or a backend without a device clock: host wall time of `train_step` plus
  `synchronize()` (a no-op there), read with `time.perf_counter`;
- on an asynchronous device whose backend offers `device_clock()` (torch on CUDA: CUDA events): the time on the
  device's stream from an event recorded just before the step's work was queued to one recorded just after it.
  The host never waits for the device between steps; the events are read at the next flush (every FLUSH_EVERY
  steps, an evaluation, a checkpoint, the end), where one synchronisation fetches the losses anyway. When the
  device is the bottleneck that is the device's time for the step's kernels; when the host is (small models), it
  is the time from queueing the step's first kernel to the end of its last, so host launch overhead counts and the
  harness's own work between steps does not (as on the CPU, where the batch fetch is outside the step).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from harness.backends.base import Backend
from harness.config.fields import Config
from harness.core.data import BatchStream
from harness.core.schedule import learning_rate
from harness.timing.contention import Sampler
from harness.timing.steady import truncate_chunks

FLUSH_EVERY = 50  # fetch device losses (one sync) at most this many steps apart


class DeviceClock(Protocol):
    """Timing markers on an asynchronous device's stream (torch: CUDA events), read without a per-step sync."""

    def mark(self) -> Any:
        """Record a marker on the device's stream now (no synchronisation) and return it."""

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds between two markers; waits for `end` to complete if it has not (at most once per flush)."""


def device_clock(backend: Backend) -> DeviceClock | None:
    """The backend's device clock (`backend.device_clock()`), or None: then steps are timed on the host."""
    get = getattr(backend, "device_clock", None)
    return get() if callable(get) else None


def warm_up(backend: Backend, stream: BatchStream, step: int) -> float | None:
    """Run the backend's one-off warm-up (torch --compile: compile the training and evaluation graphs) on batch
    `step` without changing its parameters, optimizer or dropout stream; returns its seconds, or None when the
    backend has nothing to warm up (`backend.needs_warm_up` false or absent: then not even the batch is fetched).
    `harness run` and `harness bench` both call it once before step 0, so that neither the step-0 evaluation nor
    the first step absorbs the compile, and both record it as `compile_s`."""
    if not getattr(backend, "needs_warm_up", False):
        return None
    t0 = time.perf_counter()
    backend.warm_up(*stream.batch(step))
    return time.perf_counter() - t0


class Interrupted(Exception):
    """Raised by the SIGTERM handler (SIGINT raises KeyboardInterrupt) to stop the loop cleanly."""


@dataclass
class Curves:
    """What training measured so far: per-step losses and times, the evaluation points, and the contention
    evidence of each chunk of steps (harness.timing.contention)."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    time_s: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    chunks: list[dict] = field(default_factory=list)

    def truncate(self, steps: int) -> None:
        """Keep what was measured before training step `steps` (for resuming from a checkpoint)."""
        keep = sum(1 for s in self.step if s < steps)
        del self.step[keep:], self.loss[keep:], self.time_s[keep:]
        self.evals[:] = [e for e in self.evals if e["step"] < steps]
        self.chunks[:] = truncate_chunks(self.chunks, steps)


def evaluate(backend: Backend, eval_sets: dict[str, list[tuple[np.ndarray, np.ndarray]]]) -> dict[str, float]:
    """Mean loss over each split's fixed evaluation batches, dropout off."""
    return {f"{split}_loss": float(np.mean([backend.eval_loss(x, y) for x, y in batches]))
            for split, batches in eval_sets.items()}


@dataclass
class Outcome:
    status: str  # "completed", "interrupted" or "failed: ..."
    steps_done: int
    eval_s: float
    train_s: float
    compile_s: float | None = None  # the backend's warm-up (torch --compile), before step 0; None: none


def train(backend: Backend, config: Config, stream: BatchStream,
          eval_sets: dict[str, list[tuple[np.ndarray, np.ndarray]]], curves: Curves, total_steps: int,
          start_step: int = 0, on_flush: Callable[[int], None] | None = None,
          checkpoint_every: int = 0, on_checkpoint: Callable[[int], None] | None = None,
          progress: bool = True, label: str = "", masks: Callable[[int], dict] | None = None,
          after_step: Callable[[int], None] | None = None, sampler: Sampler | None = None) -> Outcome:
    """Train from `start_step` to `total_steps`, appending to `curves`; never raises for Ctrl-C or NaN.

    Step k trains with the schedule's rate `harness.core.schedule.learning_rate(config, k)` (nanoGPT's get_lr(k)).
    Evaluation happens before step 0, every `config.eval_interval` steps and after the last step. `on_flush(k)` is
    called when the curves hold every step before k (to persist them); `on_checkpoint(k)` after k updates. Parity mode:
    `masks(step)` gives the harness's dropout masks of a step (handed to `train_step`), and `after_step(k)` is called
    after k updates (to record the optimizer state). `sampler` (harness.timing.contention.Sampler) reads the machine's
    state at chunk boundaries (about every half second, and around every evaluation, never per step); its chunks go to
    `curves.chunks`.
    """
    tokens_per_step = config.batch_size * config.block_size
    clock = device_clock(backend)
    pending: list = []  # losses still on the device
    pending_t: list = []  # per pending step: host seconds, or (start, end) device markers read at the flush
    pending_from = start_step
    eval_s = train_s = 0.0
    step = start_step
    bar = tqdm(total=total_steps, initial=start_step, desc=label, unit="step", disable=not progress,
               dynamic_ncols=True, mininterval=0.5)
    compile_s = None

    def flush() -> str | None:
        """Fetch pending losses (and device step times); return a failure status at the first non-finite loss."""
        nonlocal pending, pending_t, pending_from, train_s
        values = backend.losses_to_floats(pending)  # one synchronisation: every marker below is complete
        times = [t if isinstance(t, float) else clock.elapsed_s(*t) for t in pending_t[:len(values)]]
        n_ok = len(values)
        failure = None
        for k, v in enumerate(values):
            if not math.isfinite(v):
                n_ok = k + 1  # keep the steps before the bad one, and the bad one itself for the record
                failure = f"failed: non-finite loss at step {pending_from + k}"
                break
        curves.loss.extend(values[:n_ok])
        curves.time_s.extend(times[:n_ok])
        train_s += sum(times[:n_ok])
        del curves.step[len(curves.loss):]
        pending, pending_t, pending_from = [], [], pending_from + len(values)
        if failure:
            return failure
        if values:
            recent = times
            bar.set_postfix(loss=f"{values[-1]:.4f}", tok_s=f"{tokens_per_step * len(recent) / sum(recent):,.0f}",
                            refresh=False)
        return None

    def do_eval(at: int) -> None:
        nonlocal eval_s
        if sampler:
            sampler.close(at)  # evaluation is not training: no chunk spans it
        t0 = time.perf_counter()
        point = evaluate(backend, eval_sets)
        dt = time.perf_counter() - t0
        if sampler:
            sampler.open(at)
        eval_s += dt
        curves.evals.append({"step": at, **point, "time_s": dt})
        if progress:
            bar.write(f"{label} step {at}: train {point['train_loss']:.4f}  val {point['val_loss']:.4f}")

    status = "completed"
    if sampler:
        sampler.chunks = curves.chunks
    try:
        if start_step < total_steps:
            compile_s = warm_up(backend, stream, start_step)
        if sampler:
            sampler.open(start_step)
        for step in range(start_step, total_steps):
            if step % config.eval_interval == 0:
                failure = flush() if pending else None  # never evaluate a model that already diverged
                if failure:
                    status = failure
                    break
                do_eval(step)
            x, y = stream.batch(step)
            lr = learning_rate(config, step)  # the schedule's rate, the same for every backend
            step_masks = masks(step) if masks else None  # drawn outside the timed region
            kw = {} if step_masks is None else {"masks": step_masks}
            if clock is None:  # synchronous device: host clock around the step and its (no-op) sync
                t0 = time.perf_counter()
                loss = backend.train_step(x, y, lr, **kw)
                backend.synchronize()
                pending_t.append(time.perf_counter() - t0)
            else:  # asynchronous device: markers on its stream, no host sync per step
                start = clock.mark()
                loss = backend.train_step(x, y, lr, **kw)
                pending_t.append((start, clock.mark()))  # read at the flush, after its one synchronisation
            curves.step.append(step)
            pending.append(loss)
            bar.update(1)
            done = step + 1
            if sampler:
                sampler.tick(done)  # a clock read and one comparison, unless a chunk is due
            if after_step:
                after_step(done)
            # a host float costs nothing to check; device losses are fetched in groups to avoid a sync per step
            if (isinstance(loss, float) or len(pending) >= FLUSH_EVERY or done == total_steps
                    or (checkpoint_every and done % checkpoint_every == 0)):
                failure = flush()
                if failure:
                    status = failure
                    break
                if on_flush:
                    on_flush(done)
                if checkpoint_every and done % checkpoint_every == 0 and on_checkpoint and done < total_steps:
                    if sampler:
                        sampler.close(done)  # the checkpoint carries the evidence of every step before it
                    on_checkpoint(done)
                    if sampler:
                        sampler.open(done)
        else:
            if sampler:
                sampler.close(total_steps)
            if not curves.evals or curves.evals[-1]["step"] != total_steps:
                do_eval(total_steps)
    except (KeyboardInterrupt, Interrupted):
        status = "interrupted"
        failure = flush() if pending else None  # keep what was measured
        del curves.time_s[len(curves.loss):], curves.step[len(curves.loss):]
        status = failure or status
    finally:
        bar.close()
        if sampler:
            sampler.close(len(curves.loss))
            curves.chunks[:] = truncate_chunks(curves.chunks, len(curves.loss))
    return Outcome(status=status, steps_done=len(curves.loss), eval_s=eval_s, train_s=train_s, compile_s=compile_s)
