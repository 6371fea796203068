"""What a worker writes while it trains, each write whole and never cut in half by a signal: the record and its CSVs
(`RecordWriter`), the checkpoint (`Checkpointer`) and, in parity mode, the probe (`ProbeWriter`).

These are the small objects the training loop (harness.run.loop.train) is handed as its hooks: `on_flush`,
`on_checkpoint`, `after_step`. None of them reaches back into the worker.

**A record never knows less than before.** The curves files only grow (harness.store.curves); the record, rewritten
after each append, vouches for what they hold. A resume keeps what the earlier attempt recorded and appends only what
it measures beyond it.

**Signals never cut a write in half.** SIGTERM/SIGINT arriving while the record or a checkpoint is being written
are deferred to the end of that write (`critical`); after the record says "completed" a signal changes nothing.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harness.config.fields import Config
from harness.run import checkpoint
from harness.run.child import pause_at
from harness.run.loop import Interrupted
from harness.run.probe import OPT_PREFIX, Recorder
from harness.run.probe import read as read_probe
from harness.store import RunPaths, RunRecord
from harness.store.curves import Curves, append_curves, write_curves
from harness.store.record import CheckpointRef
from harness.store.writes import atomic_write_npz

PERSIST_EVERY_S = 15.0  # how often the record is rewritten during training (besides checkpoints and the end)

_critical = {"depth": 0, "pending": None}


def raise_interrupted(signum: int, frame: object) -> None:
    """The worker's SIGTERM/SIGINT handler: `Interrupted`, or, in the middle of a write, once the write is done."""
    name = signal.Signals(signum).name
    if _critical["depth"]:
        _critical["pending"] = name  # in the middle of a write: finish it first
        return
    raise Interrupted(name)


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """A write that SIGTERM/SIGINT must not cut in half: the signal takes effect when it is done."""
    _critical["depth"] += 1
    try:
        yield
    finally:
        _critical["depth"] -= 1
        if not _critical["depth"] and _critical["pending"]:
            name, _critical["pending"] = _critical["pending"], None
            raise Interrupted(name)


@dataclass
class RecordWriter:
    """Writes one backend's record and its curves files: what an earlier attempt recorded (`tail`: the old record's
    curves, kept as they are: a record is never replaced by one that knows less), followed by what this attempt
    measured beyond it (`curves`, which the loop fills: from the checkpoint's step on, so steps trained again add
    nothing until they pass the tail). The files are appended to (harness.store.curves), then the record that
    vouches for them is rewritten; a tail held in a version-3 record is written out whole first. `finished`: the
    record on disk says "completed", and nothing may change that."""

    paths: RunPaths
    record: RunRecord
    curves: Curves = field(default_factory=Curves)
    tail: Curves = field(default_factory=Curves)
    finished: bool = False
    last_write: float = 0.0

    def __post_init__(self) -> None:
        backend = self.record.backend
        # what the files hold now: the tail where it is in them, else nothing yet (the first write writes them whole)
        self.extents = self.tail.extents if self.tail.stored_at(self.paths, backend) else None
        self.evals_to = self.tail.last_eval.step if self.tail.last_eval is not None else -1
        self.chunks_to = max(self.tail.chunks_end, self.tail.steps_done)  # evidence of the steps beyond the tail
        self.evals_at = self.chunks_at = 0  # the curves' evaluations and chunks before these were appended already

    def merged(self) -> Curves:
        """The tail, followed by the curves measured now beyond it."""
        return self.curves.followed_by(self.tail)

    def _append(self) -> None:
        """Append to the files what the curves measured beyond them (steps, later evaluations, chunks whose steps
        are all in), then point the record at them."""
        cv, backend = self.curves, self.record.backend
        if self.extents is None:  # a first write, or a tail from a record of version 3: the files whole
            self.record.curves = write_curves(self.paths, backend, self.merged())
            self.chunks_to, self.chunks_at = self.record.curves.chunks_end, len(cv.chunks)
        else:
            first = self.extents.steps.rows
            done = max(first, len(cv.loss))
            evals = [e for e in cv.evals[self.evals_at:] if e.step > self.evals_to]
            end = self.chunks_at  # chunks in order: those whose steps are all in, the rest wait for the next write
            while end < len(cv.chunks) and cv.chunks[end]["step"] + cv.chunks[end]["n"] <= done:
                end += 1
            chunks = [c for c in cv.chunks[self.chunks_at:end] if c["step"] >= self.chunks_to]
            extents = append_curves(self.paths, backend, self.extents, (first, cv.loss[first:], cv.time_s[first:]),
                                    evals, chunks)
            self.record.curves = Curves.on_disk(self.paths, backend, extents)
            self.chunks_at = end
            if chunks:
                self.chunks_to = chunks[-1]["step"] + chunks[-1]["n"]
        self.extents = self.record.curves.extents
        self.evals_to = max([self.evals_to, *(e.step for e in cv.evals[self.evals_at:])])
        self.evals_at = len(cv.evals)

    def write(self, final: bool = False) -> None:
        """The curves files, then the record (`final`: the test hook's "final-persist" point between them)."""
        with critical():
            self._append()
            if final:
                pause_at("final-persist")
            self.record.dump(self.paths)
            self.finished = self.record.finished
            self.last_write = time.monotonic()

    def every_while(self, done: int) -> None:
        """The loop's `on_flush`: rewrite the record once `PERSIST_EVERY_S` seconds have passed since the last."""
        if time.monotonic() - self.last_write >= PERSIST_EVERY_S:
            self.write()


@dataclass
class Checkpointer:
    """The loop's `on_checkpoint`: the model's and optimizer's state (`state`, the backend's `state_dict`) and the
    curves up to step `done`, in one file (harness.run.checkpoint: resume needs nothing else, and validates it all),
    then the record that names it."""

    writer: RecordWriter
    state: Callable[[], dict[str, np.ndarray]]

    def __call__(self, done: int) -> None:
        writer = self.writer
        with critical():
            # the curves up to `done` as the record holds them (an earlier attempt's steps kept, never re-measured)
            path = checkpoint.write(writer.paths, writer.record.backend, self.state(), done, writer.merged(),
                                    before_rename=lambda: pause_at("mid-checkpoint"))
            pause_at("after-checkpoint")
            writer.record.checkpoint = CheckpointRef(step=done, file=path.name)
            writer.write()


@dataclass
class ProbeWriter:
    """`harness parity`: the probe of `recorder` (harness/run/probe.py: step-0 logits, gradients, taps, initial
    parameters) at `path`, written at the start and again once the optimizer states are in (`after_step`, the
    loop's hook)."""

    recorder: Recorder
    path: Path

    def start(self) -> None:
        atomic_write_npz(self.path, self.recorder.start())

    def after_step(self, done: int) -> None:
        """After training step `done`, the optimizer state into the probe (re-synchronised from the reference's
        state unless this backend is the reference); written once the last is in."""
        if self.recorder.after_step(done):
            atomic_write_npz(self.path, self.recorder.arrays)


def reference_states(paths: RunPaths, reference: str, config: Config, vocab_size: int, steps: int,
                     opt_steps: int) -> dict[str, np.ndarray]:
    """The optimizer states of the reference's probe (its worker ran first), which the other backend re-synchronises
    its optimizer steps from: read through the one bounded reader against what a probe of this run holds
    (harness.run.probe.read: `config`, `vocab_size`, the run's `steps` and its `opt_steps` compared); ProbeUnreadable
    ("backend X's probe is unreadable: ...", exit status 2 from the worker, which `harness parity` reports as the
    reference's crash) when it cannot be read."""
    return read_probe(paths.probe(reference), reference, config, vocab_size, steps, opt_steps,
                      only=lambda key: key.startswith(OPT_PREFIX))
