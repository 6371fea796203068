"""One backend's training in its own interpreter: `python -m harness --worker train RUN_DIR BACKEND [--resume]
[--no-progress]` (harness/__main__.py dispatches here, after harness.run.child has checked the parent).

The `Worker` holds what one backend's run needs, all of it made in `__init__`: the spec, the inputs (`Inputs`: the
corpus, the initial weights, the batch stream and the evaluation batches, identical in every backend by
construction) and the backend, set up. `run` restores a checkpoint, makes the typed record (`RunRecord`), hands the
training loop the small objects that write (harness.run.persist) and fills in the figures at the end.

docs/design.md, "One worker process per backend": juliacall must be imported before torch, CUDA.jl and PyTorch keep
separate memory pools, a crash in one backend keeps the other's results, and neither framework's start-up pollutes
the other's timings. The worker rebuilds the batch stream and the weights from the seed in spec.json and reports
their fingerprints, which the parent compares across backends.

Exit status: 0 completed, 1 failed, 2 bad input (one line on stderr), 130 interrupted.

Why a resume after a hard kill at any moment works (the record and the checkpoint are always consistent):

- **The checkpoint is self-sufficient.** `<backend>.ckpt.npz` holds the model and optimizer state *and* the curves
  up to its step (losses, step times, evaluation points). Resume restores both from it alone, so a kill between
  writing the checkpoint and writing the record (which then lags behind) loses nothing.
- **A record is never replaced by one that knows less.** The record of the resumed run is built only after the
  backend was imported, set up and restored; until then the old record is untouched (an interrupt, a corrupt
  checkpoint or a missing framework leaves it as it was). Steps and evaluations the old record holds beyond the
  checkpoint (persisted after it) are kept in every rewrite until training has passed them again; the training
  is deterministic, so they are the same numbers.
- **Every file is written whole** (temporary file, fsync, rename): a kill mid-write leaves the old file and a
  stale `.tmp`, which the next holder of the run-directory lock removes.
- **Signals never cut a write in half** (harness.run.persist: the writes the loop's hooks make).

The test hook `HARNESS_TEST_PAUSE_AT` (harness.run.child.pause_at) names the points of a worker's life.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness import environment
from harness.backends import create_backend
from harness.backends.base import Backend, BackendUnavailable
from harness.config.fields import check_seed
from harness.core.costs import flops_per_token, time_to_target
from harness.core.data import BatchStream, Corpus, check_fits, eval_batches, load_corpus, sha256_arrays, sha256_bytes
from harness.core.masks import dropout_masks
from harness.core.weights import count_parameters, fingerprint, init_weights
from harness.errors import UsageError
from harness.run import checkpoint, resumable
from harness.run.child import pause_at
from harness.run.loop import Interrupted, LoopOptions, Outcome, train
from harness.run.persist import Checkpointer, ProbeWriter, RecordWriter, raise_interrupted, reference_states
from harness.run.probe import Recorder
from harness.store import LOCK_FD_ENV, RunLock, RunPaths, RunRecord, RunSpec, Status
from harness.store.curves import Curves
from harness.store.record import CheckpointRef, Environment, Fingerprints, Memory, Timings
from harness.store.spec import DataInfo
from harness.store.writes import os_error_message
from harness.timing import contention
from harness.timing.steady import steady_start, summarize_times
from harness.units import utc_now


@dataclass
class Inputs:
    """What every backend of a run is fed, rebuilt from the seed in spec.json: the corpus (the run's checked copy),
    the initial weights, the batch stream, the fixed evaluation batches of both splits, and the steps to train."""

    corpus: Corpus
    weights: dict[str, np.ndarray]
    stream: BatchStream
    eval_sets: dict[str, list[tuple[np.ndarray, np.ndarray]]]
    total_steps: int

    def fingerprints(self) -> Fingerprints:
        """sha256 of the weights, the batches and the evaluation batches: compared across backends."""
        evals = [a for b in self.eval_sets.values() for xy in b for a in xy]
        return Fingerprints(weights=fingerprint(self.weights), batches=self.stream.fingerprint(),
                            eval_batches=sha256_arrays(evals))


def load_inputs(paths: RunPaths, spec: RunSpec, seed: int) -> Inputs:
    """The run's inputs: its copy of the corpus (checked against the spec's sha256 and vocabulary), and from the
    seed the weights, the batch stream and the evaluation batches."""
    data, c = spec.data, spec.config
    source = paths.corpus(data.sha256)  # the checked copy in --out (harness.run.plan.write_spec)
    try:
        blob = source.read_bytes()
    except OSError as exc:
        raise UsageError(os_error_message(exc, "cannot read the run's copy of its data")) from None
    if sha256_bytes(blob) != data.sha256:
        raise UsageError(f"data file {str(source)!r} changed since the run started (sha256 differs); "
                         "restore it or start a new run")
    corpus = load_corpus(data.path, keep_line_endings=data.line_endings == "kept", blob=blob)
    if data.vocab is not None and corpus.vocab != data.vocab:
        raise UsageError(f"the vocabulary of {data.path!r} differs from the one in spec.json; start a new run")
    check_fits(corpus, c.block_size, c.batch_size)
    stream = BatchStream(corpus.train, c.block_size, c.batch_size, seed, c.scheme)
    return Inputs(corpus=corpus, weights=init_weights(c, corpus.vocab_size, seed), stream=stream,
                  eval_sets={split: eval_batches(ids, c.block_size, c.batch_size, c.eval_batches, seed)
                             for split, ids in (("train", corpus.train), ("val", corpus.val))},
                  total_steps=c.steps or stream.steps_for_epochs(c.epochs))


def make_backend(name: str, spec: RunSpec, inputs: Inputs, seed: int) -> tuple[Backend, float]:
    """Backend `name` with the run's options, set up on its device with the initial weights; and its seconds."""
    backend = create_backend(name, **spec.options_of(name))
    t0 = time.perf_counter()
    backend.setup(spec.config, inputs.weights, inputs.corpus.vocab_size, spec.device_of(name), seed)
    return backend, time.perf_counter() - t0


class Worker:
    """One backend's run: its spec, inputs and backend (set up), and, once `run` has made it, the writer of its
    record."""

    def __init__(self, paths: RunPaths, name: str):
        self.started = time.perf_counter()
        self.paths, self.name = paths, name
        self.spec = RunSpec.load(paths)
        if name not in self.spec.backends:
            raise UsageError(f"backend {name!r} is not part of run {paths.run_id} (its backends: "
                             f"{', '.join(self.spec.backends)})")
        self.config = self.spec.config
        self.seed = check_seed(self.spec.seed, "seed in spec.json")
        self.device = self.spec.device_of(name)  # parity: per backend
        self.inputs = load_inputs(paths, self.spec, self.seed)
        self.backend, self.setup_s = make_backend(name, self.spec, self.inputs, self.seed)
        self.writer: RecordWriter | None = None  # this attempt's record, once the old one may be replaced

    @property
    def total_steps(self) -> int:
        return self.inputs.total_steps

    def restore(self) -> tuple[int, RunRecord | None, Curves]:
        """Restore the backend from the checkpoint; (the step to continue from, the old record, the curves up to
        the checkpoint). The spec, the old record and the checkpoint are checked first (harness.run.resumable: the
        parent has checked them too, but an executor may start a worker alone). Writes nothing."""
        record_path, ckpt = self.paths.record(self.name), self.paths.checkpoint(self.name)
        resumable.check_spec(self.paths, self.spec)
        old = RunRecord.load(record_path, self.name, self.spec) if os.path.lexists(record_path) else None
        if old is not None and old.finished:
            return 0, old, Curves()  # nothing to resume (`run` leaves it as it is)
        if old is not None:
            resumable.check_record(self.paths, self.spec, old)
        if not os.path.lexists(ckpt):
            return 0, old, Curves()  # nothing saved: start again from the initial weights (the old curves: a tail)
        shapes = {n: w.shape for n, w in self.inputs.weights.items()}  # canonical (harness.core.weights)
        step, curves, state = checkpoint.read(self.paths, self.name, self.backend.state_dict(), shapes,
                                              self.total_steps)
        resumable.check_checkpoint(self.paths, old, step, curves)
        try:
            self.backend.load_state_dict(state)
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise UsageError(f"checkpoint {str(ckpt)!r} does not fit this run's model ({type(exc).__name__}: "
                             f"{exc}); {checkpoint.restart_fix(self.paths, self.name)}") from None
        return step, old, curves

    def new_record(self, start: int, old: RunRecord | None) -> RunRecord:
        """This attempt's record: what it runs and was fed; from an earlier attempt (`old`, resumed from step
        `start`) its start, its timings and the steps each resume continued from."""
        c, inputs = self.config, self.inputs
        vocab = inputs.corpus.vocab_size
        record = RunRecord(
            run_id=self.spec.run_id, backend=self.name, backend_options=self.spec.options_of(self.name),
            status=Status.RUNNING, started_at=utc_now(), config=c, config_hash=c.config_hash(), seed=self.seed,
            device=self.device, data=DataInfo.from_dict(inputs.corpus.describe()),
            fingerprints=inputs.fingerprints(), environment=Environment.from_dict(environment.capture()),
            total_steps=self.total_steps, batches_per_epoch=inputs.stream.batches_per_epoch,
            epochs=self.total_steps / inputs.stream.batches_per_epoch, tokens_per_step=c.batch_size * c.block_size,
            n_params=count_parameters(c, vocab), n_params_non_embedding=count_parameters(c, vocab, embeddings=False),
            flops_per_token=flops_per_token(c, vocab), backend_info=self.backend.describe(),
            timings=dataclasses.replace(old.timings) if old is not None else Timings(),
            memory=dataclasses.replace(old.memory) if old is not None else Memory(),
            experiment_sha256=self.spec.experiment.sha256 if self.spec.experiment is not None else None)
        if (old is not None and old.started_at) or start:  # a resume of an earlier attempt: say from which step
            record.started_at = (old.started_at if old is not None else None) or record.started_at
            record.resumed_at = utc_now()
            record.resumed_from_step = [*((old.resumed_from_step or []) if old is not None else []), start]
            print(f"{self.name}: resuming from step {start} of {self.total_steps}"
                  + (f" (checkpoint {self.paths.checkpoint(self.name).name})" if start else
                     " (no checkpoint: from the start)"), file=sys.stderr, flush=True)
        if start:
            record.checkpoint = CheckpointRef(step=start, file=self.paths.checkpoint(self.name).name)
        record.timings.setup_s = self.setup_s
        return record

    # --- the run -----------------------------------------------------------------------------------------------
    def run(self, resume: bool, progress: bool) -> int:
        """Train from the checkpoint (`resume`) or from step 0, writing the record as it goes; the exit status."""
        start, old, curves = self.restore() if resume else (0, None, Curves())
        if old is not None and old.finished:  # a record that says "completed" is never rewritten
            print(f"{self.name}: already completed; nothing to resume", file=sys.stderr, flush=True)
            return 0
        pause_at("before-record")
        # only now, with the backend ready and the checkpoint restored, may a new record replace the old one
        writer = RecordWriter(self.paths, self.new_record(start, old), curves=curves,
                              tail=old.curves if old is not None else Curves())
        self.writer = writer
        parity = self.spec.parity  # from `harness parity` (or the kit's export): the optimizer steps compared
        masks = ((lambda step: dropout_masks(self.config, self.seed, step))
                 if parity is not None and self.config.dropout > 0 else None)  # the harness draws every mask
        probe = self.probe_writer(masks) if parity is not None else None
        if probe is not None and start == 0:
            probe.start()
        writer.write()
        pause_at("after-record")
        sampler_probe, gpu_note = contention.default_probe(self.device)
        options = LoopOptions(start_step=start, checkpoint_every=self.spec.checkpoint_every or 0,
                              progress=progress, label=f"{self.name}/{self.spec.label}", on_flush=writer.every_while,
                              on_checkpoint=Checkpointer(writer, self.backend.state_dict), masks=masks,
                              after_step=probe.after_step if probe is not None else None,
                              sampler=contention.Sampler(sampler_probe))
        inputs = self.inputs
        outcome = train(self.backend, self.config, inputs.stream, inputs.eval_sets, writer.curves, self.total_steps,
                        options)
        self.figures(writer, outcome, start, gpu_note)
        return self.finish(writer, outcome)

    def probe_writer(self, masks: object) -> ProbeWriter:
        """Parity: the probe's recorder and writer. A backend that is not the run's reference re-synchronises its
        optimizer steps from the reference's probe, which its worker (run first) wrote."""
        parity = self.spec.parity
        assert parity is not None
        ref = parity.reference
        opt_steps = self.total_steps if parity.opt_steps is None else int(parity.opt_steps)  # None: every step
        reference = (reference_states(self.paths, ref, self.config, self.inputs.corpus.vocab_size, self.total_steps,
                                      opt_steps) if ref and ref != self.name else None)
        recorder = Recorder(self.backend, self.config, self.inputs.stream, opt_steps, self.total_steps,
                            masks=masks, reference=reference, reference_name=ref or "")
        return ProbeWriter(recorder, self.paths.probe(self.name))

    def figures(self, writer: RecordWriter, outcome: Outcome, start: int, gpu_note: str | None) -> None:
        """The record's figures once training stopped, from every step recorded (an interrupted resume's count what
        an earlier attempt recorded too): steady-state step times, contention, time to target, memory, text."""
        record, cv = writer.record, writer.merged()
        t = record.timings
        if cv.time_s and start == 0:
            t.first_step_s = cv.time_s[0]  # JIT warm-up, but not torch.compile: that is compile_s
        t.compile_s = outcome.compile_s  # the backend's warm-up before step 0 (None: it has none)
        n = len(cv.time_s)
        for key, value in summarize_times(cv.time_s, record.tokens_per_step,
                                          disturbed=contention.disturbed_steps(cv.chunks, n)).items():
            setattr(t, key, value)
        t.contention = contention.summarize(cv.chunks, n, steady_start(n))
        if gpu_note:
            t.contention.gpu_evidence = gpu_note
        t.train_s = float(sum(cv.time_s))
        record.time_to_target = time_to_target(self.config.target_val_loss, cv.evals, cv.step, cv.time_s)
        t.eval_s = (t.eval_s or 0.0) + outcome.eval_s
        if t.tokens_per_s:
            t.achieved_flops = t.tokens_per_s * record.flops_per_token
        record.memory = Memory.from_dict(self.backend.memory())
        record.backend_info = self.backend.describe()  # again: JIT compile time is known only now
        if outcome.status is Status.COMPLETED and self.spec.text:
            try:
                from harness.run import text

                record.text = text.text_quality(self.backend, self.inputs.corpus, self.config, self.seed)
            except (KeyboardInterrupt, Interrupted):
                outcome.stop(None)
        t.wall_s = (t.wall_s or 0.0) + time.perf_counter() - self.started

    def finish(self, writer: RecordWriter, outcome: Outcome) -> int:
        """The record's final write, with how the loop ended; the exit status."""
        record = writer.record
        record.status, record.failure = outcome.status, outcome.reason
        record.finished_at = utc_now()
        writer.write(final=True)
        pause_at("end")
        if outcome.status is Status.COMPLETED:
            return 0
        print(f"{self.name}: {outcome.text} after {outcome.steps_done} steps; record kept in "
              f"{self.paths.record(self.name)}", file=sys.stderr)
        return 130 if outcome.status is Status.INTERRUPTED else 1

    def interrupted(self) -> None:
        """Interrupted outside the training loop: mark the record (if this attempt wrote one, and it is not done)."""
        writer = self.writer
        if writer is not None and not writer.finished:
            writer.record.status = Status.INTERRUPTED
            writer.record.finished_at = utc_now()
            writer.write()

    def fail(self, exc: BaseException) -> None:
        """Keep what was measured under a failed status (only once this attempt has its own record)."""
        writer = self.writer
        if writer is None or writer.finished:
            return
        writer.record.fail(f"{type(exc).__name__}: {exc}")
        writer.record.error = traceback.format_exc()
        writer.record.finished_at = utc_now()
        writer.write()


def run_backend(paths: RunPaths, name: str, resume: bool = False, progress: bool = True,
                lock_fd: int | None = None) -> int:
    """Train backend `name` of run `paths` in this process, under the run-directory lock; the exit status.

    No signal or argv handling here (see `main`): an executor decides how the process is stopped. `lock_fd`: an
    open lock file inherited from the parent, which already holds the lock.
    """
    worker = None
    try:
        with RunLock(paths, fd=lock_fd):
            worker = Worker(paths, name)
            try:
                return worker.run(resume=resume, progress=progress)
            except (KeyboardInterrupt, Interrupted):
                try:
                    worker.interrupted()
                except (KeyboardInterrupt, Interrupted):
                    worker.interrupted()
                if worker.writer is not None and worker.writer.finished:
                    return 0  # a signal after the record said "completed" changes nothing
                return 130
    except (UsageError, BackendUnavailable) as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted):  # before the run had started
        return 130
    except OSError as exc:
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.fail(exc)
        print(f"harness: error: {os_error_message(exc, f'{name}: cannot write')}", file=sys.stderr)
        return 2
    except Exception as exc:  # a backend bug: keep the record, show the traceback (it is not the user's fault)
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.fail(exc)
        traceback.print_exc()
        print(f"{name}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print("usage: python -m harness --worker train RUN_DIR BACKEND [--resume] [--no-progress]", file=sys.stderr)
        return 2
    try:
        paths = RunPaths.of_dir(Path(argv[0]))  # where the run's directory enters: made once, passed down
    except UsageError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, raise_interrupted)
    signal.signal(signal.SIGINT, raise_interrupted)
    fd = os.environ.get(LOCK_FD_ENV)
    return run_backend(paths, argv[1], resume="--resume" in argv, progress="--no-progress" not in argv,
                       lock_fd=int(fd) if fd and fd.isdigit() else None)
