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

The flush every FLUSH_EVERY steps does not wait for the device either, where the backend can fetch its losses
asynchronously (`fetch_losses`, torch on CUDA): it starts the copy of this group's losses and completes the group
before it, whose copy finished long ago, so a GPU-bound loop never drains its queue for a flush. The losses (and
a non-finite one) are known one flush later; every other flush (an evaluation, a checkpoint, the end, Ctrl-C)
completes everything, so a diverged model is never evaluated or checkpointed.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from harness.backends import declared
from harness.backends.base import Backend
from harness.config.fields import Config
from harness.core.data import BatchStream
from harness.core.schedule import learning_rate
from harness.progress import watched
from harness.store.contention import truncate_chunks
from harness.store.curves import Curves, Eval
from harness.store.record import Status
from harness.timing.contention import Sampler

FLUSH_EVERY = 50  # fetch device losses (one sync) at most this many steps apart


class DeviceClock(Protocol):
    """Timing markers on an asynchronous device's stream (torch: CUDA events), read without a per-step sync."""

    def mark(self) -> Any:
        """Record a marker on the device's stream now (no synchronisation) and return it."""

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds between two markers; waits for `end` to complete if it has not (at most once per flush)."""


def device_clock(backend: Backend) -> DeviceClock | None:
    """The backend's device clock (`backend.device_clock()`, where it declares one), or None: then steps are timed
    on the host."""
    return backend.device_clock() if declared(backend, "device_clock") else None


def warm_up(backend: Backend, stream: BatchStream, step: int) -> float | None:
    """Run the backend's one-off warm-up (torch --compile: compile the training and evaluation graphs) on batch
    `step` without changing its parameters, optimizer or dropout stream; returns its seconds, or None when the
    backend has nothing to warm up (no warm_up declared, or `backend.needs_warm_up` false: then not even the batch
    is fetched).
    `harness run` and `harness bench` both call it once before step 0, so that neither the step-0 evaluation nor
    the first step absorbs the compile, and both record it as `compile_s`."""
    if not declared(backend, "warm_up") or not backend.needs_warm_up:
        return None
    t0 = time.perf_counter()
    backend.warm_up(*stream.batch(step))
    return time.perf_counter() - t0


class Interrupted(Exception):
    """Raised by the SIGTERM handler (SIGINT raises KeyboardInterrupt) to stop the loop cleanly."""


def evaluate(backend: Backend, eval_sets: dict[str, list[tuple[np.ndarray, np.ndarray]]]) -> dict[str, float]:
    """Mean loss over each split's fixed evaluation batches, dropout off."""
    return {f"{split}_loss": float(np.mean([backend.eval_loss(x, y) for x, y in batches]))
            for split, batches in eval_sets.items()}


@dataclass
class Outcome:
    """How a loop ended: completed, interrupted, or failed for `reason` (a non-finite loss), after `steps_done`
    steps, with the seconds it spent evaluating, training and warming up."""

    status: Status
    steps_done: int
    eval_s: float
    train_s: float
    compile_s: float | None = None  # the backend's warm-up (torch --compile), before step 0; None: none
    reason: str | None = None  # why it failed

    @property
    def text(self) -> str:
        """"completed", "interrupted" or "failed: <reason>"."""
        return self.status.stored(self.reason)

    def stop(self, reason: str | None) -> None:
        """End as failed for `reason`, or as interrupted when there is none."""
        self.status, self.reason = (Status.FAILED, reason) if reason else (Status.INTERRUPTED, None)


@dataclass
class LoopOptions:
    """How `train` runs, beyond what it trains: where it starts, what it shows, and the callers' hooks.

    `on_flush(k)` is called when the curves hold every step before k (to persist them); `on_checkpoint(k)` every
    `checkpoint_every` updates (before the last); parity mode: `masks(step)` gives the harness's dropout masks of a
    step (handed to `train_step`), `after_step(k)` is called after k updates (to record the optimizer state).
    `sampler` (harness.timing.contention.Sampler) reads the machine's state at chunk boundaries; None: nothing is
    read (`NoSampler`)."""

    start_step: int = 0
    checkpoint_every: int = 0
    progress: bool = True
    label: str = ""
    on_flush: Callable[[int], None] | None = None
    on_checkpoint: Callable[[int], None] | None = None
    masks: Callable[[int], dict] | None = None
    after_step: Callable[[int], None] | None = None
    sampler: Sampler | None = None


class NoSampler:
    """The sampler of a loop that reads nothing about the machine (bench, paired bursts, tests): every call is a
    no-op, so the loop needs no `if sampler` of its own."""

    def __init__(self) -> None:
        self.chunks: list[dict] = []

    def open(self, step: int) -> None:
        """Nothing to read."""

    def close(self, step: int) -> None:
        """Nothing to read."""

    def tick(self, done: int) -> None:
        """Nothing to read."""


@dataclass
class _Group:
    """Steps whose losses are on their way to the host: the first step, the step times (or device markers) and
    the function that waits for the losses (`fetch_losses`), or the losses themselves."""

    first: int
    times: list
    result: Callable[[], list[float]]


def _fetched(losses_to_floats: Callable[[list], list[float]]) -> Callable[[list], Callable[[], list[float]]]:
    """A synchronous fetch in the shape of `fetch_losses`: the floats now (one sync), handed out later."""
    def fetch(losses: list) -> Callable[[], list[float]]:
        values = losses_to_floats(losses)
        return lambda: values

    return fetch


class StepTimer:
    """Times every training step (see the module docstring) and keeps its loss until a flush fetches them, at most
    FLUSH_EVERY steps apart (host floats: at once): `flush()` completes every step (one synchronisation),
    `flush(wait=False)` starts fetching the pending steps and completes the group fetched before. The curves
    (step, loss, time) grow by whole completed groups, in order. `train_s` sums the completed steps' times."""

    def __init__(self, backend: Backend, curves: Curves, first_step: int, bar: tqdm | None, tokens_per_step: int):
        self.backend, self.curves, self.bar, self.tokens_per_step = backend, curves, bar, tokens_per_step
        self.clock = device_clock(backend)
        fetch = backend.fetch_losses if declared(backend, "fetch_losses") else None
        self.fetch = fetch if self.clock is not None else None
        self.losses: list = []  # losses still on the device
        self.times: list = []  # per pending step: host seconds, or (start, end) device markers read at the flush
        self.first = first_step  # the step of losses[0]
        self.flying: list[_Group] = []  # fetched, not yet completed (at most one after a flush)
        self.failed: str | None = None  # why the loop must stop: the first non-finite loss
        self.train_s = 0.0

    def step(self, x: np.ndarray, y: np.ndarray, lr: float, kw: dict) -> Any:
        """One timed `train_step`; returns its loss (a host float, or a value still on the device)."""
        backend, clock = self.backend, self.clock
        if clock is None:  # synchronous device: host clock around the step and its (no-op) sync
            t0 = time.perf_counter()
            loss = backend.train_step(x, y, lr, **kw)
            backend.synchronize()
            self.times.append(time.perf_counter() - t0)
        else:  # asynchronous device: markers on its stream, no host sync per step
            start = clock.mark()
            loss = backend.train_step(x, y, lr, **kw)
            self.times.append((start, clock.mark()))  # read at the flush, after its one synchronisation
        self.losses.append(loss)
        return loss

    def flush(self, wait: bool = True) -> str | None:
        """Move the pending steps into the curves; the reason of a failure at the first non-finite loss (the steps
        before it and the bad one itself are kept for the record; nothing after it). `wait=False` (the periodic flush):
        where the backend fetches asynchronously, start fetching the pending steps and complete only the groups
        fetched before (their copies are done); else, and with `wait`, complete everything."""
        if self.losses:
            fetch = self.fetch if self.fetch is not None and not wait else _fetched(self.backend.losses_to_floats)
            self.flying.append(_Group(self.first, self.times, fetch(self.losses)))
            self.first += len(self.losses)
            self.losses, self.times = [], []
        keep = 0 if wait or self.fetch is None else 1  # the group just started stays in flight
        while len(self.flying) > keep and self.failed is None:
            self._complete(self.flying.pop(0))
        if self.failed is not None:
            self.flying.clear()
        return self.failed

    def _complete(self, group: _Group) -> None:
        """Append a fetched group to the curves, up to and including a first non-finite loss."""
        curves = self.curves
        values = group.result()  # the copy is complete, and with it every marker recorded before it
        times = [t if isinstance(t, float) else self.clock.elapsed_s(*t) for t in group.times[:len(values)]]
        n_ok = len(values)
        for k, v in enumerate(values):
            if not math.isfinite(v):
                n_ok, self.failed = k + 1, f"non-finite loss at step {group.first + k}"
                break
        curves.step.extend(range(group.first, group.first + n_ok))
        curves.loss.extend(values[:n_ok])
        curves.time_s.extend(times[:n_ok])
        self.train_s += sum(times[:n_ok])
        if self.failed is None and self.bar is not None and times:  # None: no progress shown, no postfix to format
            self.bar.set_postfix(loss=f"{values[-1]:.4f}",
                                 tok_s=f"{self.tokens_per_step * len(times) / sum(times):,.0f}", refresh=False)


def _evaluate_at(step: int, backend: Backend, eval_sets: dict, curves: Curves, sampler: Sampler | NoSampler,
                 bar: tqdm | None, label: str, say: bool = False) -> float:
    """Evaluate before training step `step` into `curves.evals` (no chunk spans it: evaluation is not training);
    its line goes above the bar, or (`say`: progress asked for where no bar is shown) on a line of its own; returns
    its seconds."""
    sampler.close(step)
    t0 = time.perf_counter()
    point = evaluate(backend, eval_sets)
    dt = time.perf_counter() - t0
    sampler.open(step)
    curves.evals.append(Eval(step, point.get("train_loss", math.nan), point.get("val_loss", math.nan), dt))
    if bar is not None or say:
        line = f"{label} step {step}: train {point['train_loss']:.4f}  val {point['val_loss']:.4f}"
        if bar is not None:
            bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)
    return dt


def train(backend: Backend, config: Config, stream: BatchStream,
          eval_sets: dict[str, list[tuple[np.ndarray, np.ndarray]]], curves: Curves, total_steps: int,
          opts: LoopOptions | None = None) -> Outcome:
    """Train from `opts.start_step` to `total_steps`, appending to `curves`; never raises for Ctrl-C or NaN.

    nanoGPT's loop: evaluate when due, fetch the batch and the rate, step, flush, checkpoint. Step k trains with the
    schedule's rate `harness.core.schedule.learning_rate(config, k)` (nanoGPT's get_lr(k)). Evaluation happens before
    step 0, every `config.eval_interval` steps and after the last step. Per step there is the batch, the rate, one
    timed step (`StepTimer`) and a sampler tick; the contention sampler's chunks (about every half second, and
    around every evaluation, never per step) go to `curves.chunks`. The curves grow at flushes (see the module
    docstring); `opts.on_flush(k)` is called after each, k the steps run so far (the curves may hold fewer).
    """
    opts = opts or LoopOptions()
    sampler = opts.sampler or NoSampler()
    sampler.chunks = curves.chunks
    # the bar (steps done, elapsed and expected time, loss, tokens/s) only on a terminal; in a log the evaluations'
    # lines say how far it is (harness.progress)
    bar = tqdm(total=total_steps, initial=opts.start_step, desc=opts.label, unit="step", dynamic_ncols=True,
               mininterval=0.5) if opts.progress and watched() else None
    timer = StepTimer(backend, curves, opts.start_step, bar, config.batch_size * config.block_size)
    out = Outcome(status=Status.COMPLETED, steps_done=0, eval_s=0.0, train_s=0.0)
    every, ckpt_every, masks, after_step, tick = (config.eval_interval, opts.checkpoint_every, opts.masks,
                                                  opts.after_step, sampler.tick)
    try:
        if opts.start_step < total_steps:
            out.compile_s = warm_up(backend, stream, opts.start_step)
        sampler.open(opts.start_step)
        for step in range(opts.start_step, total_steps):
            if step % every == 0:
                failure = timer.flush()  # never evaluate a model that already diverged
                if failure:
                    out.stop(failure)
                    break
                out.eval_s += _evaluate_at(step, backend, eval_sets, curves, sampler, bar, opts.label, opts.progress)
            x, y = stream.batch(step)
            lr = learning_rate(config, step)  # the schedule's rate, the same for every backend
            step_masks = masks(step) if masks else None  # drawn outside the timed region
            loss = timer.step(x, y, lr, _NO_KW if step_masks is None else {"masks": step_masks})
            if bar is not None:
                bar.update(1)
            done = step + 1
            tick(done)  # a clock read and one comparison, unless a chunk is due
            if after_step:
                after_step(done)
            checkpoint = ckpt_every and done % ckpt_every == 0
            # a host float costs nothing to check; device losses are fetched in groups to avoid a sync per step, and
            # the periodic flush does not wait for the device (only the last step and a checkpoint do)
            if isinstance(loss, float) or len(timer.losses) >= FLUSH_EVERY or done == total_steps or checkpoint:
                failure = timer.flush(wait=isinstance(loss, float) or done == total_steps or bool(checkpoint))
                if failure:
                    out.stop(failure)
                    break
                if opts.on_flush:
                    opts.on_flush(done)
                if checkpoint and opts.on_checkpoint and done < total_steps:
                    sampler.close(done)  # the checkpoint carries the evidence of every step before it
                    opts.on_checkpoint(done)
                    sampler.open(done)
        else:
            sampler.close(total_steps)
            if not curves.evals or curves.evals[-1].step != total_steps:
                out.eval_s += _evaluate_at(total_steps, backend, eval_sets, curves, sampler, bar, opts.label,
                                           opts.progress)
    except (KeyboardInterrupt, Interrupted):
        out.stop(timer.flush())  # keep what was measured
    finally:
        if bar is not None:
            bar.close()
        sampler.close(len(curves.loss))
        curves.chunks[:] = truncate_chunks(curves.chunks, len(curves.loss))
    out.steps_done, out.train_s = len(curves.loss), timer.train_s
    return out


_NO_KW: dict = {}  # the keyword arguments of a step without dropout masks (never changed)
