"""Part runners: each backend's parts of the training step (harness/core/parts.py), forward and backward, in its
framework's own idiom, ready to be timed by `harness bench parts` (harness/bench/parts.py).

A backend's declaration says whether it can time its parts (the method `parts`, harness.backends.declaration) and
names its part runner (`part_runner`, "module:Class"), so a backend from outside can bring its own (`supports`,
`runner_class`); a backend that declares none is refused in one line. A runner's module imports its framework;
this one imports none.

Every runner times the same computation on the same numbers: a part's inputs are the real step-0 activations of the
first batch (the taps of harness/core/taps.py, on every row) and its backward's upstream gradients are the real
step-0 gradients, both computed once by the NumPy oracle's parts in float64 (`Reference`,
harness.backends.numpy_parts.reference) and cast to the runner's dtype. Each runner builds one `Item` per timed
thing (a part's forward, its backward, the optimizer, the whole step): a call with no arguments and the wait that
makes its work finished (`time`).
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.config.fields import Config
from harness.core.parts import STEP
from harness.errors import UsageError

MAX_CALLS = 100_000  # the most calls of one item in a row
SAMPLE_S = 2e-5  # an item's calls in a row last at least this long on the host clock (a part too short for it)
# ... and on a GPU timed on the host: calls queued back to back for this long, one wait at the end (a part's cost
# is then what it adds to a stream of work, not a round trip between host and device per call)
GPU_SAMPLE_S = 1e-3
MIN_PASSES = 3  # passes in a burst, at least (an item's figure in a burst is the fastest of them)
# timings of the whole step in a burst, at least: the longest item is the likeliest to be cut by the scheduler on a
# busy machine, so it gets more tries at a clean one (several a pass where the passes are few)
MIN_STEP_SAMPLES = 9
WARM_CALLS = 2  # untimed calls of every item before it is timed (JIT compilation, allocator, caches)


def supports(name: str) -> bool:
    """Whether backend `name` can time its parts: its declaration has the method `parts` (and so a part runner)."""
    from harness.backends import declared, options_class

    return declared(options_class(name), "parts")


def check_supported(names: list[str]) -> None:
    """UsageError (one line) for a backend that cannot time its parts (an unknown or refused one: its own line)."""
    from harness.backends import declarations

    for name in names:
        if not supports(name):
            able = [n for n, d in declarations().items() if "parts" in d.methods]
            raise UsageError(f"backend {name!r} cannot time its parts (its declaration has no part runner); "
                             f"`harness bench parts` runs {', '.join(able)}; drop {name} from --backend")


def runner_class(name: str) -> type:
    """Import and return the part runner class its declaration names for backend `name` (imports its framework's
    module, not the framework itself until setup)."""
    from harness.backends import declaration

    check_supported([name])
    module, cls = declaration(name).part_runner.split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass
class Reference:
    """The step-0 numbers every runner times its parts on, float64 NumPy: `acts` the activations by name (the tap
    names, plus "idx", "targets", "loss"), `grads` the gradient of the mean loss with respect to each activation,
    `params` the gradient of each parameter (canonical names), `branch` the gradient each part's backward hands to
    each of its inputs ({(part, input): array}: at a residual fork, the branch's share)."""

    acts: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    params: dict[str, np.ndarray]
    branch: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)


@dataclass
class Item:
    """One timed thing: `call()` does its work once and returns what `wait` waits for (None: nothing)."""

    call: Callable[[], Any]
    wait: Callable[[Any], None] = lambda out: None


class PartRunner:
    """The common part of every runner: the items, their timing in passes, their calibration.

    A subclass builds `self.items` ({item key: Item}, harness.core.parts.items' keys, the step last) in `setup`,
    and may time on a device clock (`device_clock`; `mark`, `seconds`, `finish`) or count what an item launches
    (`launches`).

    A **pass** (`run_pass`) runs the items in the order of a step: every part's forward, every backward, the
    optimizer, each `calls[item]` times in a row and timed apart, keeping each item's last output alive until the
    pass ends, as a step keeps its activations until its backward (so that the memory a step allocates, and the
    page faults that come with it, are paid in the parts that allocate it); then the whole step, timed
    `step_samples` times. A burst is `passes` passes, and an item's figure in it the fastest of them (`burst`).
    `sync_each_call`: wait after every call (on the CPU, as the training loop waits after every step) or only at the
    end of an item (an asynchronous device: the calls are queued back to back, as inside a step)."""

    name = ""
    clock = "host clock (time.perf_counter)"  # how the items are timed, in words (the record's)
    device_clock = False  # True: `mark` reads a device clock, not the host's, so an item's last call is not waited for
    sync_each_call = True
    sample_s = SAMPLE_S

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.items: dict[str, Item] = {}
        self.compile_s: float | None = None
        self.config: Config | None = None

    def setup(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str, seed: int,
              batches: list[tuple[np.ndarray, np.ndarray]], reference: Reference, names: list[str]) -> None:
        """Build the items of parts `names` (and the optimizer and the whole step on `batches`), on `device`."""
        raise NotImplementedError

    def step_item(self, backend: Any, batches: list[tuple[np.ndarray, np.ndarray]], wait: Callable[[Any], None]
                  ) -> None:
        """The whole training step as the last item: `backend`'s own train_step on `batches` in turn, as `harness
        run` times it (every runner's, so that the step is the same work everywhere)."""
        lr, k = self.config.learning_rate, [0]

        def call() -> Any:
            x, y = batches[k[0] % len(batches)]
            k[0] += 1
            return backend.train_step(x, y, lr)
        self.items[STEP] = Item(call, wait)

    def warm_up(self, calls: int = WARM_CALLS) -> float:
        """Call every item `calls` times, untimed; returns the seconds it took (a JIT's compilation is in it)."""
        t0 = time.perf_counter()
        for it in self.items.values():
            out = None
            for _ in range(calls):
                out = it.call()
            it.wait(out)
        return time.perf_counter() - t0

    # --- the clock: the host's here; a runner on a device clock replaces these three ---------------------------
    def mark(self) -> Any:
        """A reading of the clock (after the work before it is done, for the host clock)."""
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        """Seconds between two readings (after `finish`)."""
        return b - a

    def finish(self) -> None:
        """Wait until every queued piece of work is done (a device clock is read after it)."""

    def timed(self, key: str, n: int) -> tuple[Any, Any, Any]:
        """`n` calls of item `key` in a row between two readings of the clock: (start, end, the last output)."""
        it = self.items[key]
        out = None
        a = self.mark()
        for _ in range(n):
            out = it.call()
            if self.sync_each_call:
                it.wait(out)
        if not self.sync_each_call and not self.device_clock:
            it.wait(out)
        return a, self.mark(), out

    def time(self, key: str, n: int) -> float:
        """Seconds per call of item `key`, over `n` calls in a row."""
        a, b, _ = self.timed(key, n)
        self.finish()
        return self.seconds(a, b) / n

    def run_pass(self, calls: dict[str, int], step_samples: int = 1) -> dict[str, float]:
        """One pass (see the class): seconds per call of every item of `calls`; the whole step timed `step_samples`
        times, the fastest counting."""
        keep, marks = [], {}
        for key, n in calls.items():
            if key != STEP:
                a, b, out = self.timed(key, n)
                marks[key] = (a, b, n)
                keep.append(out)  # alive until the pass ends, as a step's activations until its backward
        self.finish()
        times = {key: self.seconds(a, b) / n for key, (a, b, n) in marks.items()}
        keep.clear()
        if STEP in calls:
            times[STEP] = min(self.time(STEP, calls[STEP]) for _ in range(step_samples))
        return times

    def burst(self, calls: dict[str, int], passes: int, step_samples: int = 1) -> dict[str, float]:
        """Seconds per call of every item: the fastest of `passes` passes (other work on the machine can only add
        time, and adds more to a long item than to a short one, so that a median over the passes would still
        inflate the whole step against its parts on a busy machine)."""
        runs = [self.run_pass(calls, step_samples) for _ in range(passes)]
        return {key: float(min(r[key] for r in runs)) for key in calls}

    def calibrate(self, burst_s: float, max_calls: int = MAX_CALLS) -> tuple[dict[str, int], int, int]:
        """(calls of every item in a row, passes per burst, timings of the step per pass): an item shorter than
        `sample_s` is called that often in a row (a part too short for the clock), a burst holds passes for about
        `burst_s` seconds, at least MIN_PASSES, and at least MIN_STEP_SAMPLES timings of the step."""
        once = self.run_pass({key: 1 for key in self.items})
        few = {key: max(1, min(max_calls, math.ceil(self.sample_s / max(t, 1e-9)) // 4)) for key, t in once.items()}
        once = self.run_pass(few)  # the short ones again, over a few calls: one call is mostly the clock's own
        calls = {key: max(1, min(max_calls, math.ceil(self.sample_s / max(t, 1e-9)))) for key, t in once.items()}
        pass_s = sum(calls[k] * once[k] for k in calls)
        passes = max(MIN_PASSES, math.ceil(burst_s / max(pass_s, 1e-9)))
        return calls, passes, max(1, math.ceil(MIN_STEP_SAMPLES / passes))

    def launches(self, key: str) -> dict | None:
        """What one call of item `key` launches (kernels on a GPU), where the runner can count it; None here."""
        return None

    def describe(self) -> dict[str, Any]:
        """Framework, versions, device, dtype (the backend's own description where the runner has a backend)."""
        return {}


def as_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """A reference array in the runner's floating type (integer arrays, the token ids, unchanged)."""
    a = np.asarray(a)
    return a if a.dtype.kind in "iub" else a.astype(dtype)
