"""One backend's training in its own interpreter: `python -m harness.worker RUN_DIR BACKEND`.

DESIGN.md, "One worker process per backend": juliacall must be imported before torch, CUDA.jl and PyTorch keep
separate memory pools, a crash in one backend keeps the other's results, and neither framework's start-up pollutes
the other's timings. The worker rebuilds the batch stream and the weights from the seed in spec.json and reports
their fingerprints, which the parent compares across backends.

Exit status: 0 completed, 1 failed, 2 bad input (one line on stderr), 130 interrupted.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from harness import environment, records
from harness.backends import create_backend
from harness.backends.base import BackendUnavailable
from harness.config import Config
from harness.data import BatchStream, Corpus, check_fits, eval_batches, load_corpus
from harness.errors import UsageError
from harness.masks import dropout_masks
from harness.runner import Curves, Interrupted, summarize_times, train
from harness.weights import count_parameters, fingerprint, init_weights, param_shapes

OPT_STEPS = 3  # parity: training steps after which the optimizer state goes into the probe (harness parity)
PERSIST_EVERY_S = 15.0  # how often the record is rewritten during training (besides checkpoints and the end)


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signal.Signals(signum).name)


def _stop_with_parent() -> None:
    """Ask Linux to send us SIGTERM if the `harness` process dies, so an orphan never trains on unseen."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker simply finishes its run
        pass


def flops_per_token(config: Config, vocab_size: int) -> int:
    """Training FLOPs per token: 6 x non-embedding parameters + 12 x layers x d x n_ctx (attention), as Kaplan/PaLM."""
    n = count_parameters(param_shapes(config, vocab_size), embeddings=False)
    return 6 * n + 12 * config.n_layer * config.n_embd * config.block_size


class Worker:
    """Holds one backend's run: its spec, data, backend, curves and record, and persists them."""

    def __init__(self, directory: Path, backend_name: str):
        self.dir, self.name = directory, backend_name
        self.spec = json.loads((directory / "spec.json").read_text(encoding="utf-8"))
        self.config = Config(**self.spec["config"])
        self.seed = int(self.spec["seed"])
        self.curves = Curves()
        self.last_persist = 0.0

    # --- inputs, identical in every backend by construction --------------------------------------------------
    def load_inputs(self) -> Corpus:
        corpus = load_corpus(self.spec["data"]["path"])
        if corpus.sha256 != self.spec["data"]["sha256"]:
            raise UsageError(f"data file {corpus.path!r} changed since the run started (sha256 differs); "
                             "restore it or start a new run")
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
            "status": "running", "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "finished_at": None, "error": None,
            "config": c.to_dict(), "config_hash": c.config_hash(), "seed": self.seed,
            "device": self.spec["device"], "data": corpus.describe(),
            "fingerprints": {"weights": fingerprint(self.weights), "batches": self.stream.fingerprint(),
                             "eval_batches": eval_fp},
            "environment": environment.capture(),
            "total_steps": self.total_steps, "batches_per_epoch": self.stream.batches_per_epoch,
            "epochs": self.total_steps / self.stream.batches_per_epoch,
            "tokens_per_step": c.batch_size * c.block_size,
            "n_params": count_parameters(param_shapes(c, corpus.vocab_size)),
            "n_params_non_embedding": count_parameters(param_shapes(c, corpus.vocab_size), embeddings=False),
            "flops_per_token": flops_per_token(c, corpus.vocab_size),
            "backend_info": {}, "timings": {}, "memory": {}, "text": None, "checkpoint": None,
            "steps": {}, "evals": [],
        }

    # --- persistence -------------------------------------------------------------------------------------------
    def persist(self) -> None:
        cv = self.curves
        self.record["steps"] = {"step": cv.step[:len(cv.loss)], "loss": cv.loss, "time_s": cv.time_s[:len(cv.loss)]}
        self.record["evals"] = cv.evals
        records.atomic_write_csv(self.dir / f"{self.name}.steps.csv", ["step", "loss", "time_s"],
                                 [[s, repr(v), repr(t)] for s, v, t in zip(cv.step, cv.loss, cv.time_s)])
        records.atomic_write_csv(self.dir / f"{self.name}.evals.csv", ["step", "train_loss", "val_loss", "time_s"],
                                 [[e["step"], repr(e["train_loss"]), repr(e["val_loss"]), repr(e["time_s"])]
                                  for e in cv.evals])
        records.atomic_write_json(self.dir / f"{self.name}.json", self.record)
        self.last_persist = time.monotonic()

    def maybe_persist(self, done: int) -> None:
        if time.monotonic() - self.last_persist >= PERSIST_EVERY_S:
            self.persist()

    def checkpoint(self, done: int) -> None:
        state = self.backend.state_dict()
        state["harness/step"] = np.array(done, dtype=np.int64)
        path = self.dir / f"{self.name}.ckpt.npz"
        records.atomic_write_npz(path, state)
        self.record["checkpoint"] = {"step": done, "file": path.name}
        self.persist()

    def save_probe(self) -> None:
        """Step-0 logits and per-parameter gradients on the first training batch, for `harness parity`; with
        dropout also the gradients under the step-0 masks (`dropout_grad/`); the parameters before step 1."""
        x, y = self.stream.batch(0)
        arrays = {"logits": np.asarray(self.backend.logits(x)), "x": x, "y": y}
        arrays.update({f"grad/{k}": np.asarray(v) for k, v in self.backend.gradients(x, y).items()})
        if self.masks:
            arrays.update({f"dropout_grad/{k}": np.asarray(v)
                           for k, v in self.backend.gradients(x, y, masks=self.masks(0)).items()})
        arrays.update({f"opt/0/param/{k}": np.asarray(v) for k, v in self.backend.parameters().items()})
        self.probe = arrays
        records.atomic_write_npz(self.dir / f"{self.name}.probe.npz", arrays)

    def save_opt_step(self, done: int) -> None:
        """Parity: after training step `done` (1..opt_steps), the parameters and AdamW moments into the probe
        (`opt/<done>/param|adam_m|adam_v/<name>`); written once the last of them is in."""
        if not hasattr(self, "probe") or done > self.opt_steps:
            return
        state = self.backend.state_dict()
        self.probe.update({f"opt/{done}/{k}": np.asarray(v) for k, v in state.items()
                           if k.startswith(("param/", "adam_m/", "adam_v/"))})
        if done == min(self.opt_steps, self.total_steps):
            records.atomic_write_npz(self.dir / f"{self.name}.probe.npz", self.probe)

    def resume(self) -> int:
        """Restore the backend and the curves from the checkpoint; returns the step to continue from."""
        if not (self.dir / f"{self.name}.json").exists():
            return 0  # killed before its first record: start again from the initial weights
        old = records.load_record(self.dir / f"{self.name}.json")
        self.record.update(started_at=old["started_at"], resumed_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        ckpt = self.dir / f"{self.name}.ckpt.npz"
        if not ckpt.exists():
            return 0  # nothing saved: start again from the initial weights
        with np.load(ckpt) as f:
            state = {k: f[k] for k in f.files}
        step = int(state.pop("harness/step"))
        self.backend.load_state_dict(state)
        steps = old["steps"]
        self.curves = Curves(step=list(steps["step"]), loss=list(steps["loss"]), time_s=list(steps["time_s"]),
                             evals=list(old["evals"]))
        self.curves.truncate(step)
        if len(self.curves.loss) < step:
            raise UsageError(f"run {self.spec['run_id']}: the {self.name} record holds fewer steps than its "
                             "checkpoint; it cannot be resumed, start a new run")
        self.record["timings"] = old.get("timings", {})
        self.record["checkpoint"] = old.get("checkpoint")
        return step

    # --- the run -----------------------------------------------------------------------------------------------
    def run(self, resume: bool, progress: bool) -> int:
        wall0 = time.perf_counter()
        corpus = self.load_inputs()
        self.record = self.new_record(corpus)
        options = self.spec["backend_options"].get(self.name, {})
        self.backend = create_backend(self.name, **options)
        t0 = time.perf_counter()
        self.backend.setup(self.config, self.weights, corpus.vocab_size, self.spec["device"], self.seed)
        setup_s = time.perf_counter() - t0
        self.record["backend_info"] = self.backend.describe()
        start = self.resume() if resume else 0
        parity = self.spec.get("parity")  # True, or {"opt_steps": K} from `harness parity`
        self.opt_steps = int(parity.get("opt_steps", OPT_STEPS)) if isinstance(parity, dict) else OPT_STEPS
        self.masks = ((lambda step: dropout_masks(self.config, self.seed, step))
                      if parity and self.config.dropout > 0 else None)  # the harness draws every mask
        if parity and start == 0:
            self.save_probe()
        timings = self.record["timings"]
        timings["setup_s"] = setup_s
        self.persist()
        label = f"{self.name}/{self.spec['label']}"
        outcome = train(self.backend, self.config, self.stream, self.eval_sets, self.curves, self.total_steps,
                        start_step=start, on_flush=self.maybe_persist,
                        checkpoint_every=self.spec.get("checkpoint_every") or 0, on_checkpoint=self.checkpoint,
                        progress=progress, label=label, masks=self.masks,
                        after_step=self.save_opt_step if parity else None)
        cv = self.curves
        if cv.time_s and start == 0:
            timings["first_step_s"] = cv.time_s[0]  # includes JIT/compilation: reported apart from the steady state
        tokens = self.record["tokens_per_step"]
        timings.update(summarize_times(cv.time_s, tokens))
        timings["train_s"] = float(sum(cv.time_s))
        timings["eval_s"] = timings.get("eval_s", 0.0) + outcome.eval_s
        if timings.get("tokens_per_s"):
            timings["achieved_flops"] = timings["tokens_per_s"] * self.record["flops_per_token"]
        self.record["memory"] = self.backend.memory()
        self.record["backend_info"] = self.backend.describe()  # again: JIT compile time is known only now
        if outcome.status == "completed" and self.spec.get("text", True):
            try:
                from harness import metrics

                self.record["text"] = metrics.text_quality(self.backend, corpus, self.config, self.seed)
            except (KeyboardInterrupt, Interrupted):
                outcome.status = "interrupted"
        timings["wall_s"] = timings.get("wall_s", 0.0) + time.perf_counter() - wall0
        self.record["status"] = outcome.status
        self.record["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.persist()
        if outcome.status == "completed":
            return 0
        print(f"{self.name}: {outcome.status} after {outcome.steps_done} steps; record kept in "
              f"{self.dir / (self.name + '.json')}", file=sys.stderr)
        return 130 if outcome.status == "interrupted" else 1

    def fail(self, exc: BaseException) -> None:
        """Keep what was measured under a failed status (the record exists once setup has begun)."""
        if not hasattr(self, "record"):
            return
        self.record["status"] = f"failed: {type(exc).__name__}: {exc}"
        self.record["error"] = traceback.format_exc()
        self.record["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.persist()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    directory, name = Path(argv[0]), argv[1]
    resume = "--resume" in argv
    progress = "--no-progress" not in argv
    signal.signal(signal.SIGTERM, _raise_interrupted)
    _stop_with_parent()
    worker = Worker(directory, name)
    try:
        return worker.run(resume=resume, progress=progress)
    except (UsageError, BackendUnavailable) as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted):
        if hasattr(worker, "record"):  # interrupted outside the training loop (setup, resume, text metrics)
            worker.record["status"] = "interrupted"
            worker.persist()
        return 130
    except Exception as exc:  # a backend bug: keep the record, show the traceback (it is not the user's fault)
        worker.fail(exc)
        traceback.print_exc()
        print(f"{name}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
