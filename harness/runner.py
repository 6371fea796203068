"""The training loop every backend runs under: same batches, same evaluation points, same records.

It times each step (after a device synchronisation), keeps losses on the device until a flush point,
evaluates on the fixed batches, checkpoints, and turns Ctrl-C / SIGTERM / a non-finite loss into a
record status instead of a lost run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from harness.backends.base import Backend
from harness.config import Config
from harness.data import BatchStream

FLUSH_EVERY = 50  # fetch device losses (one sync) at most this many steps apart
WARMUP_STEPS = 10  # steps left out of the steady-state statistics (JIT, allocator and cache warm-up)


class Interrupted(Exception):
    """Raised by the SIGTERM handler (SIGINT raises KeyboardInterrupt) to stop the loop cleanly."""


@dataclass
class Curves:
    """What training measured so far: per-step losses and times, and the evaluation points."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    time_s: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)

    def truncate(self, steps: int) -> None:
        """Keep what was measured before training step `steps` (for resuming from a checkpoint)."""
        keep = sum(1 for s in self.step if s < steps)
        del self.step[keep:], self.loss[keep:], self.time_s[keep:]
        self.evals[:] = [e for e in self.evals if e["step"] < steps]


def evaluate(backend: Backend, eval_sets: dict[str, list[tuple[np.ndarray, np.ndarray]]]) -> dict[str, float]:
    """Mean loss over each split's fixed evaluation batches, dropout off."""
    return {f"{split}_loss": float(np.mean([backend.eval_loss(x, y) for x, y in batches]))
            for split, batches in eval_sets.items()}


def summarize_times(times: list[float], tokens_per_step: int, warmup: int = WARMUP_STEPS) -> dict:
    """Steady-state step-time statistics (median, p10, p90, IQR) and tokens/s, after `warmup` steps."""
    steady = np.asarray(times[warmup:] if len(times) > warmup else times[1:] or times, dtype=np.float64)
    if steady.size == 0:
        return {}
    q10, q25, q50, q75, q90 = np.percentile(steady, [10, 25, 50, 75, 90])
    return {"steady_steps": int(steady.size), "warmup_steps": min(warmup, len(times)),
            "step_median_s": float(q50), "step_p10_s": float(q10), "step_p90_s": float(q90),
            "step_iqr_s": float(q75 - q25), "step_mean_s": float(steady.mean()),
            "tokens_per_s": float(tokens_per_step / q50) if q50 > 0 else None}


@dataclass
class Outcome:
    status: str  # "completed", "interrupted" or "failed: ..."
    steps_done: int
    eval_s: float
    train_s: float


def train(backend: Backend, config: Config, stream: BatchStream,
          eval_sets: dict[str, list[tuple[np.ndarray, np.ndarray]]], curves: Curves, total_steps: int,
          start_step: int = 0, on_flush: Callable[[int], None] | None = None,
          checkpoint_every: int = 0, on_checkpoint: Callable[[int], None] | None = None,
          progress: bool = True, label: str = "", masks: Callable[[int], dict] | None = None,
          after_step: Callable[[int], None] | None = None) -> Outcome:
    """Train from `start_step` to `total_steps`, appending to `curves`; never raises for Ctrl-C or NaN.

    Evaluation happens before step 0, every `config.eval_interval` steps and after the last step. `on_flush(k)`
    is called when the curves hold every step before k (to persist them); `on_checkpoint(k)` after k updates.
    Parity mode: `masks(step)` gives the harness's dropout masks of a step (handed to `train_step`), and
    `after_step(k)` is called after k updates (to record the optimizer state).
    """
    tokens_per_step = config.batch_size * config.block_size
    lr = config.learning_rate
    pending: list = []  # losses still on the device
    pending_from = start_step
    eval_s = train_s = 0.0
    step = start_step
    bar = tqdm(total=total_steps, initial=start_step, desc=label, unit="step", disable=not progress,
               dynamic_ncols=True, mininterval=0.5)

    def flush() -> str | None:
        """Fetch pending losses; return a failure status at the first non-finite one."""
        nonlocal pending, pending_from
        values = backend.losses_to_floats(pending)
        for k, v in enumerate(values):
            if not math.isfinite(v):
                n_ok = k  # keep the steps before the bad one, and the bad one itself for the record
                curves.loss.extend(values[:n_ok + 1])
                del curves.time_s[len(curves.loss):]
                del curves.step[len(curves.loss):]
                return f"failed: non-finite loss at step {pending_from + k}"
        curves.loss.extend(values)
        pending, pending_from = [], pending_from + len(values)
        if values:
            recent = curves.time_s[-len(values):]
            bar.set_postfix(loss=f"{values[-1]:.4f}", tok_s=f"{tokens_per_step * len(recent) / sum(recent):,.0f}",
                            refresh=False)
        return None

    def do_eval(at: int) -> None:
        nonlocal eval_s
        t0 = time.perf_counter()
        point = evaluate(backend, eval_sets)
        dt = time.perf_counter() - t0
        eval_s += dt
        curves.evals.append({"step": at, **point, "time_s": dt})
        if progress:
            bar.write(f"{label} step {at}: train {point['train_loss']:.4f}  val {point['val_loss']:.4f}")

    status = "completed"
    try:
        for step in range(start_step, total_steps):
            if step % config.eval_interval == 0:
                failure = flush() if pending else None  # never evaluate a model that already diverged
                if failure:
                    status = failure
                    break
                do_eval(step)
            x, y = stream.batch(step)
            step_masks = masks(step) if masks else None  # drawn outside the timed region
            t0 = time.perf_counter()
            if step_masks is None:
                loss = backend.train_step(x, y, lr)
            else:
                loss = backend.train_step(x, y, lr, masks=step_masks)
            backend.synchronize()
            dt = time.perf_counter() - t0
            train_s += dt
            curves.step.append(step)
            curves.time_s.append(dt)
            pending.append(loss)
            bar.update(1)
            done = step + 1
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
                    on_checkpoint(done)
        else:
            if not curves.evals or curves.evals[-1]["step"] != total_steps:
                do_eval(total_steps)
    except (KeyboardInterrupt, Interrupted):
        status = "interrupted"
        failure = flush() if pending else None  # keep what was measured
        del curves.time_s[len(curves.loss):], curves.step[len(curves.loss):]
        status = failure or status
    finally:
        bar.close()
    return Outcome(status=status, steps_done=len(curves.loss), eval_s=eval_s, train_s=train_s)
