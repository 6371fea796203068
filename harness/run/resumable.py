"""What a resume checks before it continues a run: that the run is the one its files say it is.

`harness resume` (and a sweep's resume) continues a run from its spec, each backend's record and checkpoint. If any
of them changed since they were written (spec.json edited, a record edited or swapped, a checkpoint replaced by
another run's or an older one), continuing would mix two experiments in one record. So, before anything is written
and before any worker starts (`check_run`, the parent's, for every backend; `check_backend_files`, again in each
worker, for executors that start workers alone):

- the spec against the digests written with it (harness.store.spec.Experiment: one line naming what changed); a
  spec of the previous release, without them, skips this check;
- each backend's options as the backend checks them (harness.backends.check_backend), as a new run's are;
- each record against the spec: the experiment digest it was written under, and field by field (config, seed,
  device, backend options, data) for records of the previous release;
- each record's curves: steps 0, 1, 2, ... each once (no ragged, repeated or missing step), evaluations in order and
  within the steps, chunks in order;
- each checkpoint against its record: not older than the step the record names, and, where both hold a step, the
  same losses, step times and evaluations (the checkpoint's curves are the record's up to its step).

Every refusal is a UsageError in one line naming the file and what changed, with the fix; nothing is written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from harness.core.weights import param_shapes
from harness.errors import UsageError
from harness.run import checkpoint
from harness.store import RunPaths, RunRecord, RunSpec
from harness.store.curves import Curves, eval_array, eval_columns

FIX = "restore it, or start a new run"


def check_spec(paths: RunPaths, spec: RunSpec) -> None:
    """UsageError naming the defining fields of spec.json changed since it was written (`RunSpec.changed`)."""
    changed = spec.changed()
    if changed:
        shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
        raise UsageError(f"run {paths.run_id}: {str(paths.spec)!r} changed since the run was written ({shown}); "
                         f"resuming would mix two experiments in one record; {FIX}")


def check_options(spec: RunSpec, backends: Sequence[str]) -> None:
    """Each backend's options in the spec, checked as a new run's are (no framework imported)."""
    from harness.backends import check_backend

    for name in backends:
        try:
            check_backend(name, spec.device_of(name), spec.options_of(name), spec.config.options())
        except TypeError as exc:  # an option the backend's constructor does not take
            raise UsageError(f"spec.json's backend_options for {name} are not options {name} takes ({exc}); "
                             f"{FIX}") from None


def _differs(rec: RunRecord, spec: RunSpec) -> str | None:
    """The first defining field in which record `rec` differs from `spec` (None: none)."""
    name = rec.backend
    experiment = spec.experiment
    if rec.experiment_sha256 and experiment is not None and rec.experiment_sha256 != experiment.sha256:
        return "the spec it was written under (its experiment digest differs from spec.json's)"
    mine, theirs = rec.config.to_dict(), spec.config.to_dict()
    for key in theirs:
        if key in mine and mine[key] != theirs[key]:
            return f"config.{key} ({mine[key]!r}, spec.json has {theirs[key]!r})"
    pairs = [("seed", rec.seed, spec.seed), ("device", rec.device, spec.device_of(name)),
             ("backend_options", rec.backend_options, spec.options_of(name)),
             ("data.sha256", rec.data.sha256 if rec.data else None, spec.data.sha256)]
    for field, got, want in pairs:
        if got is not None and got != want:
            return f"{field} ({got!r}, spec.json has {want!r})"
    return None


def curves_problem(cv: Curves) -> str | None:
    """What is wrong with curves `cv` as a resume must continue them (None: nothing): every step once, in order,
    with its loss and time; evaluations in order, within the steps; chunks in order, none overlapping."""
    n = len(cv.loss)
    if len(cv.step) != n or len(cv.time_s) != n:
        return f"ragged steps ({len(cv.step)} steps, {n} losses, {len(cv.time_s)} step times)"
    steps = np.asarray(cv.step, dtype=np.int64) if not isinstance(cv.step, range) else None
    if steps is not None and not np.array_equal(steps, np.arange(n)):
        i = int(np.flatnonzero(steps != np.arange(n))[0])
        return f"step {int(steps[i])} where step {i} belongs (steps repeated, missing or out of order)"
    evals, _, _ = eval_columns(cv.evals)
    if len(evals) and ((np.diff(evals) <= 0).any() or evals[0] < 0 or evals[-1] > n):
        return "evaluations repeated, out of order or beyond the steps"
    end = 0
    for c in cv.chunks:
        if c["step"] < end:
            return f"contention chunks out of order or overlapping (one at step {c['step']}, after step {end})"
        end = c["step"] + c["n"]
    return None


def check_record(paths: RunPaths, spec: RunSpec, rec: RunRecord) -> None:
    """UsageError when record `rec` does not belong to `spec` or its curves cannot be continued."""
    path = paths.record(rec.backend)
    differs = _differs(rec, spec)
    if differs:
        raise UsageError(f"run {paths.run_id}: {str(path)!r} was changed since it was written, or belongs to another "
                         f"run: it differs from spec.json in {differs}; {FIX}")
    problem = curves_problem(rec.curves)
    if problem:
        raise UsageError(f"run {paths.run_id}: {str(path)!r} holds {problem}; {FIX}")


def _first_difference(a: Sequence[float], b: Sequence[float]) -> int | None:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    same = (x == y) | (np.isnan(x) & np.isnan(y))
    return None if same.all() else int(np.flatnonzero(~same)[0])


def _eval_rows(evals: Sequence, upto: int) -> np.ndarray:
    """The evaluations of `evals` before step `upto` as rows (step, train loss, val loss, seconds): the one at
    `upto` itself may have been taken after a record that lags its checkpoint was written."""
    rows = eval_array(evals)
    return rows[rows[:, 0] < upto]


def check_checkpoint(paths: RunPaths, rec: RunRecord | None, step: int, curves: Curves) -> None:
    """UsageError when checkpoint (at `step`, holding `curves`) and record `rec` disagree: the checkpoint older than
    the one the record names, or, for a record of this release (whose curves up to a checkpoint are the
    checkpoint's, bit for bit), different losses, step times or evaluations where both hold a step."""
    if rec is None:
        return
    name = rec.backend
    ckpt, path = paths.checkpoint(name), paths.record(name)
    fix = f"restore them, or delete {ckpt.name} to restart {name} from step 0"
    if rec.checkpoint is not None and step < rec.checkpoint.step:
        raise UsageError(f"run {paths.run_id}: checkpoint {str(ckpt)!r} is at step {step}, older than the step "
                         f"{rec.checkpoint.step} its record names (it was replaced); {fix}")
    if rec.curves_in_json:
        return  # the previous release kept a resumed attempt's steps first: its times may differ from its checkpoint
    common = min(step, rec.curves.steps_done)
    cv = rec.curves
    for what, mine, theirs in (("losses", cv.loss, curves.loss), ("step times", cv.time_s, curves.time_s)):
        at = _first_difference(mine[:common], theirs[:common])
        if at is not None:
            raise UsageError(f"run {paths.run_id}: checkpoint {str(ckpt)!r} and {str(path)!r} hold different {what} "
                             f"at step {at} (one of them was changed or replaced); {fix}")
    mine_e, theirs_e = _eval_rows(cv.evals, common), _eval_rows(curves.evals, common)
    if mine_e.shape != theirs_e.shape or _first_difference(mine_e.ravel(), theirs_e.ravel()) is not None:
        raise UsageError(f"run {paths.run_id}: checkpoint {str(ckpt)!r} and {str(path)!r} hold different "
                         f"evaluations (one of them was changed or replaced); {fix}")


def check_run(paths: RunPaths, spec: RunSpec, backends: Sequence[str]) -> None:
    """Every check above, for every backend of `backends` that a resume would continue (a completed one is left as
    it is), before any worker starts: a refusal of one backend continues none."""
    check_spec(paths, spec)
    check_options(spec, backends)
    for name in backends:
        rec = RunRecord.load(paths.record(name), name, spec) if os.path.lexists(paths.record(name)) else None
        if rec is not None and rec.finished:
            continue
        if rec is not None:
            check_record(paths, spec, rec)
        ckpt = paths.checkpoint(name)
        if rec is not None and os.path.lexists(ckpt):
            total = spec.steps_bound() or rec.total_steps or 2**63 - 1  # the spec's, not the record's, first
            vocab = spec.data.vocab_size
            cap = checkpoint.max_bytes(param_shapes(spec.config, vocab), total) if vocab is not None else None
            # its step and curves alone (the worker checks the state against its backend's): each array capped
            step, curves = checkpoint.read_curves(paths, name, total, max_file_bytes=cap)
            check_checkpoint(paths, rec, step, curves)
