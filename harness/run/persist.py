"""What a worker writes while it trains, each write whole and never cut in half by a signal: the record and its CSVs
(`RecordWriter`), the checkpoint (`Checkpointer`) and, in parity mode, the probe (`ProbeWriter`).

These are the small objects the training loop (harness.run.loop.train) is handed as its hooks: `on_flush`,
`on_checkpoint`, `after_step`. None of them reaches back into the worker.

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
from harness.store.record import CheckpointRef, Curves, write_curves_csv
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
    """Writes one backend's record and its CSVs: the curves measured now (`curves`, which the loop fills),
    followed by what an earlier attempt recorded beyond them (`tail`, kept until training passes it again: a
    record is never replaced by one that knows less). `finished`: the record on disk says "completed", and nothing
    may change that."""

    paths: RunPaths
    record: RunRecord
    curves: Curves = field(default_factory=Curves)
    tail: Curves = field(default_factory=Curves)
    finished: bool = False
    last_write: float = 0.0

    def merged(self) -> Curves:
        """The curves measured now, followed by the tail."""
        return self.curves.followed_by(self.tail)

    def write(self, final: bool = False) -> None:
        """The CSVs, then the record (`final`: the test hook's "final-persist" point between them)."""
        with critical():
            self.record.curves = self.merged()
            write_curves_csv(self.paths, self.record.backend, self.record.curves)
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
            path = checkpoint.write(writer.paths, writer.record.backend, self.state(), done, writer.curves,
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
