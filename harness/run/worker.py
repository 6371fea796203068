"""One backend's training in its own interpreter: `python -m harness --worker train RUN_DIR BACKEND [--resume]
[--no-progress]` (harness/__main__.py dispatches here, after harness.run.child has checked the parent).

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
- **Signals never cut a write in half.** SIGTERM/SIGINT arriving while the record or a checkpoint is being
  written are deferred to the end of that write; after the record says "completed" a signal changes nothing.

The test hook `HARNESS_TEST_PAUSE_AT` (harness.run.child.pause_at) names the points of a worker's life.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from harness import environment
from harness.backends import create_backend
from harness.backends.base import BackendUnavailable
from harness.config.fields import check_seed, config_from_dict
from harness.core.costs import flops_per_token, time_to_target
from harness.core.data import BatchStream, Corpus, check_fits, eval_batches, load_corpus, sha256_bytes
from harness.core.masks import dropout_masks
from harness.core.weights import count_parameters, fingerprint, init_weights
from harness.errors import UsageError
from harness.run import checkpoint, records
from harness.run.child import pause_at
from harness.run.loop import Curves, Interrupted, LoopOptions, train
from harness.run.probe import OPT_PREFIX, Recorder
from harness.run.probe import read as read_probe
from harness.run.records import RunLock, RunPaths, Status
from harness.timing import contention
from harness.timing.steady import steady_start, summarize_times
from harness.units import utc_now

PERSIST_EVERY_S = 15.0  # how often the record is rewritten during training (besides checkpoints and the end)

_critical = {"depth": 0, "pending": None}


def _raise_interrupted(signum: int, frame: object) -> None:
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


class Worker:
    """Holds one backend's run: its spec, data, backend, curves and record, and persists them."""

    def __init__(self, directory: Path, backend_name: str):
        self.dir, self.name = Path(directory), backend_name
        self.paths = RunPaths.of_dir(self.dir)
        self.spec = records.load_spec_file(self.paths.spec)
        if backend_name not in self.spec["backends"]:
            raise UsageError(f"backend {backend_name!r} is not part of run {self.paths.run_id} (its backends: "
                             f"{', '.join(self.spec['backends'])})")
        self.config = config_from_dict(self.spec["config"], str(self.paths.spec))
        self.seed = check_seed(self.spec["seed"], "seed in spec.json")
        self.device = (self.spec.get("devices") or {}).get(backend_name) or self.spec["device"]  # parity: per backend
        self.curves = Curves()
        self.last_persist = 0.0
        self.record: dict | None = None
        self.tail = Curves()  # what an earlier attempt recorded beyond the checkpoint (kept until passed again)
        self.finished = False  # the record on disk says "completed": nothing may change that
        self.probe: Recorder | None = None  # parity: the probe, completed after step K

    # --- inputs, identical in every backend by construction --------------------------------------------------
    def load_inputs(self) -> Corpus:
        data = self.spec["data"]
        source = self.paths.corpus(data["sha256"])  # the checked copy in --out (harness.run.plan.write_spec)
        try:
            blob = source.read_bytes()
        except OSError as exc:
            raise UsageError(records.os_error_message(exc, "cannot read the run's copy of its data")) from None
        if sha256_bytes(blob) != data["sha256"]:
            raise UsageError(f"data file {str(source)!r} changed since the run started (sha256 differs); "
                             "restore it or start a new run")
        corpus = load_corpus(data["path"], keep_line_endings=data.get("line_endings") == "kept", blob=blob)
        if "vocab" in data and corpus.vocab != data["vocab"]:
            raise UsageError(f"the vocabulary of {data['path']!r} differs from the one in spec.json; start a new run")
        check_fits(corpus, self.config.block_size, self.config.batch_size)
        c = self.config
        self.weights = init_weights(c, corpus.vocab_size, self.seed)
        self.stream = BatchStream(corpus.train, c.block_size, c.batch_size, self.seed, c.scheme)
        self.eval_sets = {split: eval_batches(ids, c.block_size, c.batch_size, c.eval_batches, self.seed)
                          for split, ids in (("train", corpus.train), ("val", corpus.val))}
        self.total_steps = c.steps or self.stream.steps_for_epochs(c.epochs)
        return corpus

    def new_record(self, corpus: Corpus) -> dict:
        c = self.config
        eval_fp = records.sha256_of_arrays([a for b in self.eval_sets.values() for xy in b for a in xy])
        return {
            "schema": records.SCHEMA, "schema_version": records.SCHEMA_VERSION,
            "run_id": self.spec["run_id"], "backend": self.name,
            "backend_options": self.spec["backend_options"].get(self.name, {}),
            "status": Status.RUNNING.value, "started_at": utc_now(), "finished_at": None, "error": None,
            "config": c.to_dict(), "config_hash": c.config_hash(), "seed": self.seed,
            "device": self.device, "data": corpus.describe(),
            "fingerprints": {"weights": fingerprint(self.weights), "batches": self.stream.fingerprint(),
                             "eval_batches": eval_fp},
            "environment": environment.capture(),
            "total_steps": self.total_steps, "batches_per_epoch": self.stream.batches_per_epoch,
            "epochs": self.total_steps / self.stream.batches_per_epoch,
            "tokens_per_step": c.batch_size * c.block_size,
            "n_params": count_parameters(c, corpus.vocab_size),
            "n_params_non_embedding": count_parameters(c, corpus.vocab_size, embeddings=False),
            "flops_per_token": flops_per_token(c, corpus.vocab_size),
            "backend_info": {}, "timings": {}, "memory": {}, "text": None, "checkpoint": None,
            "steps": {}, "evals": [],
        }

    # --- persistence -------------------------------------------------------------------------------------------
    def merged(self) -> Curves:
        """The curves measured now, followed by what an earlier attempt recorded beyond them."""
        cv, tail = self.curves, self.tail
        n = len(cv.loss)
        keep = [i for i, s in enumerate(tail.step[:len(tail.loss)]) if s >= n]
        last_eval = cv.evals[-1]["step"] if cv.evals else -1
        covered = max((c["step"] + c["n"] for c in cv.chunks), default=0)
        return Curves(step=cv.step[:n] + [tail.step[i] for i in keep], loss=cv.loss + [tail.loss[i] for i in keep],
                      time_s=cv.time_s[:n] + [tail.time_s[i] for i in keep],
                      evals=cv.evals + [e for e in tail.evals if e["step"] > last_eval],
                      chunks=cv.chunks + [c for c in tail.chunks if c["step"] >= max(n, covered)])

    def persist(self, final: bool = False) -> None:
        assert self.record is not None
        with critical():
            cv = self.merged()
            self.record["steps"] = {"step": cv.step, "loss": cv.loss, "time_s": cv.time_s}
            self.record["evals"] = cv.evals
            self.record["chunks"] = cv.chunks
            records.atomic_write_csv(self.paths.steps_csv(self.name), ["step", "loss", "time_s"],
                                     [[s, repr(v), repr(t)] for s, v, t in zip(cv.step, cv.loss, cv.time_s)])
            records.atomic_write_csv(self.paths.evals_csv(self.name), ["step", "train_loss", "val_loss", "time_s"],
                                     [[e["step"], repr(e["train_loss"]), repr(e["val_loss"]), repr(e["time_s"])]
                                      for e in cv.evals])
            if final:
                pause_at("final-persist")
            records.atomic_write_json(self.paths.record(self.name), self.record)
            self.finished = self.record["status"] == Status.COMPLETED
            self.last_persist = time.monotonic()

    def maybe_persist(self, done: int) -> None:
        if time.monotonic() - self.last_persist >= PERSIST_EVERY_S:
            self.persist()

    def checkpoint(self, done: int) -> None:
        """Model, optimizer and the curves up to `done`, in one file: resume needs nothing else."""
        with critical():
            state = checkpoint.contents(self.backend.state_dict(), done, self.curves)
            path = self.paths.checkpoint(self.name)
            records.atomic_write_bytes(path, records.npz_bytes(state),
                                       before_rename=lambda: pause_at("mid-checkpoint"))
            pause_at("after-checkpoint")
            self.record["checkpoint"] = {"step": done, "file": path.name}
            self.persist()

    def save_probe(self, parity: dict, vocab_size: int) -> None:
        """`harness parity`: the step-0 probe (harness/run/probe.py: logits, gradients, taps, initial parameters),
        written now and again once the optimizer states are in (`save_opt_step`). A backend that is not the
        run's reference re-synchronises its optimizer steps from the reference's probe, which its worker (run
        first) wrote."""
        reference, ref_name = None, parity.get("reference")
        if ref_name and ref_name != self.name:
            reference = read_probe(self.paths.probe(ref_name), ref_name, self.config, vocab_size, self.total_steps,
                                   self.opt_steps, only=lambda key: key.startswith(OPT_PREFIX))
        self.probe = Recorder(self.backend, self.config, self.stream, self.opt_steps, self.total_steps,
                              masks=self.masks, reference=reference, reference_name=ref_name or "")
        records.atomic_write_npz(self.paths.probe(self.name), self.probe.start())

    def save_opt_step(self, done: int) -> None:
        """Parity: after training step `done` (1..opt_steps), the optimizer state into the probe (re-synchronised
        from the reference's state unless this backend is the reference); written once the last is in."""
        if self.probe is not None and self.probe.after_step(done):
            records.atomic_write_npz(self.paths.probe(self.name), self.probe.arrays)

    def resume(self) -> tuple[int, dict]:
        """Restore the backend and the curves from the checkpoint; returns the step to continue from and what the
        new record takes over from the old one. Writes nothing."""
        record_path, ckpt = self.paths.record(self.name), self.paths.checkpoint(self.name)
        old = records.load_record(record_path, self.name) if os.path.lexists(record_path) else None
        carry: dict = {}
        if old is not None:
            self.tail = Curves(step=list(old["steps"]["step"]), loss=list(old["steps"]["loss"]),
                               time_s=list(old["steps"]["time_s"]), evals=list(old["evals"]),
                               chunks=list(old.get("chunks") or []))
            carry = {"started_at": old.get("started_at"), "timings": old.get("timings") or {},
                     "resumed_from_step": list(old.get("resumed_from_step") or [])}
        if not os.path.lexists(ckpt):
            return 0, carry  # nothing saved: start again from the initial weights (the old curves stay as a tail)
        fix = f"delete {ckpt.name} to restart {self.name} from step 0, or start a new run"
        shapes = {n: w.shape for n, w in self.weights.items()}  # canonical (harness.core.weights)
        step, self.curves, state = checkpoint.read(ckpt, self.backend.state_dict(), shapes, self.total_steps, fix)
        try:
            self.backend.load_state_dict(state)
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise UsageError(f"checkpoint {str(ckpt)!r} does not fit this run's model ({type(exc).__name__}: "
                             f"{exc}); {fix}") from None
        carry["checkpoint"] = {"step": step, "file": ckpt.name}
        return step, carry

    # --- the run -----------------------------------------------------------------------------------------------
    def run(self, resume: bool, progress: bool) -> int:
        wall0 = time.perf_counter()
        corpus = self.load_inputs()
        options = self.spec["backend_options"].get(self.name, {})
        self.backend = create_backend(self.name, **options)
        t0 = time.perf_counter()
        self.backend.setup(self.config, self.weights, corpus.vocab_size, self.device, self.seed)
        setup_s = time.perf_counter() - t0
        start, carry = self.resume() if resume else (0, {})
        pause_at("before-record")
        # only now, with the backend ready and the checkpoint restored, may a new record replace the old one
        record = self.new_record(corpus)
        record["backend_info"] = self.backend.describe()
        if carry.get("started_at") or start:  # a resume of an earlier attempt: say from which step, every time
            record.update(started_at=carry.get("started_at") or record["started_at"], resumed_at=utc_now(),
                          resumed_from_step=[*carry.get("resumed_from_step", []), start])
            print(f"{self.name}: resuming from step {start} of {self.total_steps}"
                  + (f" (checkpoint {self.paths.checkpoint(self.name).name})" if start else
                     " (no checkpoint: from the start)"), file=sys.stderr, flush=True)
        record["timings"] = dict(carry.get("timings") or {})
        record["checkpoint"] = carry.get("checkpoint")
        self.record = record
        parity = self.spec.get("parity")  # True, or {"opt_steps": K, "reference": name} from `harness parity`
        opt_steps = parity.get("opt_steps") if isinstance(parity, dict) else None
        self.opt_steps = self.total_steps if opt_steps is None else int(opt_steps)  # None: every step
        self.masks = ((lambda step: dropout_masks(self.config, self.seed, step))
                      if parity and self.config.dropout > 0 else None)  # the harness draws every mask
        if parity and start == 0:
            self.save_probe(parity if isinstance(parity, dict) else {}, corpus.vocab_size)
        timings = self.record["timings"]
        timings["setup_s"] = setup_s
        self.persist()
        pause_at("after-record")
        label = f"{self.name}/{self.spec['label']}"
        probe, gpu_note = contention.default_probe(self.device)
        options = LoopOptions(start_step=start, checkpoint_every=self.spec.get("checkpoint_every") or 0,
                              progress=progress, label=label, on_flush=self.maybe_persist,
                              on_checkpoint=self.checkpoint, masks=self.masks,
                              after_step=self.save_opt_step if parity else None, sampler=contention.Sampler(probe))
        outcome = train(self.backend, self.config, self.stream, self.eval_sets, self.curves, self.total_steps, options)
        cv = self.merged()  # an interrupted resume: its figures also count what an earlier attempt recorded
        if cv.time_s and start == 0:
            timings["first_step_s"] = cv.time_s[0]  # JIT warm-up, but not torch.compile: that is compile_s
        timings["compile_s"] = outcome.compile_s  # the backend's warm-up before step 0 (None: it has none)
        tokens = self.record["tokens_per_step"]
        n = len(cv.time_s)
        timings.update(summarize_times(cv.time_s, tokens, disturbed=contention.disturbed_steps(cv.chunks, n)))
        timings["contention"] = contention.summarize(cv.chunks, n, steady_start(n))
        if gpu_note:
            timings["contention"]["gpu_evidence"] = gpu_note
        timings["train_s"] = float(sum(cv.time_s))
        self.record["time_to_target"] = time_to_target(self.config.target_val_loss, cv.evals, cv.step, cv.time_s)
        timings["eval_s"] = timings.get("eval_s", 0.0) + outcome.eval_s
        if timings.get("tokens_per_s"):
            timings["achieved_flops"] = timings["tokens_per_s"] * self.record["flops_per_token"]
        self.record["memory"] = self.backend.memory()
        self.record["backend_info"] = self.backend.describe()  # again: JIT compile time is known only now
        if outcome.status == "completed" and self.spec.get("text", True):
            try:
                from harness.run import text

                self.record["text"] = text.text_quality(self.backend, corpus, self.config, self.seed)
            except (KeyboardInterrupt, Interrupted):
                outcome.status = "interrupted"
        timings["wall_s"] = timings.get("wall_s", 0.0) + time.perf_counter() - wall0
        self.record["status"] = outcome.status
        if records.is_failed(outcome.status):
            self.record["failure"] = outcome.status.split(": ", 1)[-1]
        self.record["finished_at"] = utc_now()
        self.persist(final=True)
        pause_at("end")
        if outcome.status == "completed":
            return 0
        print(f"{self.name}: {outcome.status} after {outcome.steps_done} steps; record kept in "
              f"{self.paths.record(self.name)}", file=sys.stderr)
        return 130 if outcome.status == "interrupted" else 1

    def interrupted(self) -> None:
        """Interrupted outside the training loop: mark the record (if this attempt wrote one, and it is not done)."""
        if self.record is not None and not self.finished:
            self.record["status"] = Status.INTERRUPTED.value
            self.record["finished_at"] = utc_now()
            self.persist()

    def fail(self, exc: BaseException) -> None:
        """Keep what was measured under a failed status (only once this attempt has its own record)."""
        if self.record is None or self.finished:
            return
        reason = f"{type(exc).__name__}: {exc}"
        self.record["status"] = Status.FAILED.text(reason)
        self.record["failure"] = reason
        self.record["error"] = traceback.format_exc()
        self.record["finished_at"] = utc_now()
        self.persist()


def run_backend(directory: Path, name: str, resume: bool = False, progress: bool = True,
                lock_fd: int | None = None) -> int:
    """Train backend `name` of run `directory` in this process, under the run-directory lock; the exit status.

    No signal or argv handling here (see `main`): an executor decides how the process is stopped. `lock_fd`: an
    open lock file inherited from the parent, which already holds the lock.
    """
    worker = None
    try:
        with RunLock(RunPaths.of_dir(Path(directory)), fd=lock_fd):
            worker = Worker(Path(directory), name)
            try:
                return worker.run(resume=resume, progress=progress)
            except (KeyboardInterrupt, Interrupted):
                try:
                    worker.interrupted()
                except (KeyboardInterrupt, Interrupted):
                    worker.interrupted()
                if worker.finished and worker.record is not None and worker.record["status"] == "completed":
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
        print(f"harness: error: {records.os_error_message(exc, f'{name}: cannot write')}", file=sys.stderr)
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
    directory, name = Path(argv[0]), argv[1]
    signal.signal(signal.SIGTERM, _raise_interrupted)
    signal.signal(signal.SIGINT, _raise_interrupted)
    fd = os.environ.get(records.LOCK_FD_ENV)
    return run_backend(directory, name, resume="--resume" in argv, progress="--no-progress" not in argv,
                       lock_fd=int(fd) if fd and fd.isdigit() else None)
