"""A backend's checkpoint, `<backend>.ckpt.npz` of a run (`RunPaths.checkpoint`): what it holds (`contents`,
written whole by `write`, harness.store.writes) and reading it back for a resume (`read`), validated against the run
before anything of it is used.

A checkpoint holds the backend's state_dict (`param/<name>`, `adam_m/<name>`, `adam_v/<name>`, `adam_t` and the
backend's RNG state `rng/...`) and the curves up to its step (`harness/step`, `harness/loss`, `harness/time_s`,
`harness/evals`, `harness/chunks`: the contention evidence as JSON bytes), so that a resume needs nothing else
(harness/run/worker.py says why).

It lies in `--out`, where anyone may have edited it, so `read` trusts none of it. Through the one bounded reader
(harness.npz: a regular file, every declared size capped, no pickles, nothing under another name inflated) it checks,
before the backend sees a byte:

- every parameter and both AdamW moments of every parameter under its canonical name and shape
  (harness.core.weights) in the backend's own dtype (the dtype of the state the backend holds after its set-up):
  float16, int64, complex, a scalar or a missing moment is refused, never converted;
- `adam_t` and the step whole numbers (a float or a string is refused), the step within the run's 1..steps and
  AdamW's count equal to it (one update a step); the second moments never negative;
- exactly the RNG entries the backend's own state holds, each of its dtype and shape (a serialized state of bytes
  may differ in length, and one that is JSON must be JSON of the same keys);
- the curves consistent with the step: one finite loss and one step time per step, evaluations as rows of four
  numbers at increasing steps within 0..step, contention evidence of the types the records hold, ending by the step.

Anything else is one line (UsageError: exit status 2) naming the file and the fix, and the resume writes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from harness.errors import UsageError
from harness.files import parse_json
from harness.npz import MEMBER_OVERHEAD, Want, read_npz, spec_bytes
from harness.store import RunPaths
from harness.store.contention import check_chunks, truncate_chunks
from harness.store.curves import Curves, Eval
from harness.store.record import CHUNK_BYTES
from harness.store.writes import atomic_write_bytes, npz_bytes

STEP, LOSS, TIME, EVALS, CHUNKS = "harness/step", "harness/loss", "harness/time_s", "harness/evals", "harness/chunks"
CURVES = (LOSS, TIME, EVALS, CHUNKS)  # beside STEP
STATE_PARTS = ("param/", "adam_m/", "adam_v/")
ADAM_T, RNG = "adam_t", "rng/"
BLOB_BYTES = 2**20  # the most bytes of a serialized RNG state
RNG_ENTRIES = 4  # more RNG entries than any backend's state holds (torch: its CPU and CUDA generators)
WHAT = "checkpoint"


def contents(state: dict[str, np.ndarray], done: int, curves: Curves) -> dict[str, np.ndarray]:
    """What the checkpoint after training step `done` holds: the backend's `state` and the curves up to `done`."""
    state = dict(state)
    state[STEP] = np.array(done, dtype=np.int64)
    state[LOSS] = np.array(curves.loss[:done], dtype=np.float64)
    state[TIME] = np.array(curves.time_s[:done], dtype=np.float64)
    state[EVALS] = np.array([[e.step, e.train_loss, e.val_loss, e.time_s] for e in curves.evals if e.step <= done],
                            dtype=np.float64).reshape(-1, 4)
    state[CHUNKS] = np.frombuffer(json.dumps(truncate_chunks(curves.chunks, done)).encode(),
                                  dtype=np.uint8)  # JSON bytes: no pickle needed to read them
    return state


def write(paths: RunPaths, backend: str, state: dict[str, np.ndarray], done: int, curves: Curves,
          before_rename: Callable[[], None] | None = None) -> Path:
    """`backend`'s checkpoint of run `paths` after training step `done` (`contents`), written whole
    (harness.store.writes: temporary file, fsync, rename; `before_rename`: the test hook's point); its path."""
    path = paths.checkpoint(backend)
    atomic_write_bytes(path, npz_bytes(contents(state, done, curves)), before_rename=before_rename)
    return path


def restart_fix(paths: RunPaths, backend: str) -> str:
    """What to do about `backend`'s checkpoint that cannot be used: the end of every message about it."""
    return f"delete {paths.checkpoint(backend).name} to restart {backend} from step 0, or start a new run"


def _blob(value: np.ndarray) -> bool:
    """Whether an RNG entry is a serialized state (bytes of a length of its own), not an array of fixed shape."""
    return value.dtype == np.uint8 and value.ndim == 1


def expected(template: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]], steps: int
             ) -> dict[str, Want]:
    """Every array a checkpoint of this run may hold, after `steps` steps at most: the state of `shapes` (canonical
    parameter shapes) in the dtype of the backend's own state `template` (its state_dict after set-up, which also
    names its RNG entries), and the curves."""
    spec: dict[str, Want] = {}
    for name, shape in shapes.items():
        own = template.get(f"param/{name}")
        dtype = (own.dtype.name,) if own is not None else ("float32", "float64")
        for part in STATE_PARTS:
            spec[part + name] = Want(tuple(shape), dtype)
    spec[ADAM_T] = spec[STEP] = Want((), ("integer",), 8)
    for key, value in template.items():
        if key.startswith(RNG):
            spec[key] = (Want((None,), ("uint8",), BLOB_BYTES) if _blob(value)
                         else Want(tuple(value.shape), (value.dtype.name,)))
    spec.update(curves_expected(steps))
    return spec


def max_bytes(shapes: Mapping[str, tuple[int, ...]], steps: int) -> int:
    """The most bytes a checkpoint of a run of canonical parameter `shapes` after at most `steps` steps can take,
    whichever its backend (`expected` with the widest dtype and `RNG_ENTRIES` serialized RNG states): the cap of
    `read_curves` where no backend is set up."""
    return spec_bytes(expected({}, shapes, steps), 0) + RNG_ENTRIES * (BLOB_BYTES + MEMBER_OVERHEAD)


def curves_expected(steps: int, exact: bool = False) -> dict[str, Want]:
    """The curves a checkpoint after at most `steps` steps holds (`exact`: after exactly `steps`, one loss and one
    step time each)."""
    steps = max(int(steps), 0)
    per_step = Want((steps,), ("float64",), required=False) if exact else Want((None,), ("float64",), 8 * steps,
                                                                                required=False)
    return {LOSS: per_step, TIME: per_step, EVALS: Want((None, 4), ("float64",), 32 * (steps + 1), required=False),
            CHUNKS: Want((None,), ("uint8",), CHUNK_BYTES * steps + 2**16, required=False)}


def read(paths: RunPaths, backend: str, template: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]],
         total_steps: int) -> tuple[int, Curves, dict[str, np.ndarray]]:
    """`backend`'s checkpoint of run `paths`: its step, the curves up to it and the backend's state (the arrays
    `load_state_dict` takes), every array validated against the run (the module docstring); UsageError ending in
    `restart_fix` when anything is off.

    `template`: the backend's state_dict after its set-up (its dtype and RNG entries); `shapes`: the canonical
    parameter shapes; `total_steps`: the run's steps. Read in two passes: the step first, then everything with the
    curves' sizes fixed by it (so a lying curve is refused by its header, never inflated)."""
    path, fix = paths.checkpoint(backend), restart_fix(paths, backend)
    cap = spec_bytes(expected(template, shapes, total_steps), 0)
    step = _step(path, fix, cap, total_steps)
    spec = expected(template, shapes, step)
    spec.update(curves_expected(step, exact=True))
    state = read_npz(path, WHAT, fix, spec, max_file_bytes=cap, max_array_bytes=0)
    del state[STEP]
    _check_state(state, template, step, path, fix)
    return step, _curves(state, step, path, fix), state


def read_curves(paths: RunPaths, backend: str, total_steps: int, max_file_bytes: int | None = None
                ) -> tuple[int, Curves]:
    """`backend`'s checkpoint's step and the curves up to it, validated as `read` validates them, without its state
    (which only the backend can check): what a resume compares with the record before any worker starts. Nothing
    but the step and the curves is opened; `max_file_bytes`: the file's cap where the caller knows it."""
    path, fix = paths.checkpoint(backend), restart_fix(paths, backend)
    step = _step(path, fix, max_file_bytes, total_steps)
    spec = {STEP: Want((), ("integer",), 8), **curves_expected(step, exact=True)}
    state = read_npz(path, WHAT, fix, spec, max_file_bytes=max_file_bytes, max_array_bytes=0,
                     only=lambda key: key in spec)
    return step, _curves(state, step, path, fix)


def _step(path: Path, fix: str, cap: int | None, total_steps: int) -> int:
    """The checkpoint's step (the one array read), within the run's 1..`total_steps`."""
    step_only = read_npz(path, WHAT, fix, {STEP: Want((), ("integer",), 8)}, max_file_bytes=cap,
                         max_array_bytes=8, only=lambda key: key == STEP)
    step = int(step_only[STEP])
    if not 0 < step <= total_steps:
        raise UsageError(f"{WHAT} {str(path)!r} is at step {step}, outside this run's 1..{total_steps}; {fix}")
    return step


def _curves(state: dict[str, np.ndarray], step: int, path: Path, fix: str) -> Curves:
    """The curves of a checkpoint at `step`, taken out of `state`: finite losses and step times, checked evaluations
    and contention evidence."""
    name = f"{WHAT} {str(path)!r}"
    if any(k not in state for k in CURVES):
        raise UsageError(f"{name} was written by an older nanogpt-parity (no curves in it); {fix}")
    for key in (LOSS, TIME):
        if not np.isfinite(state[key]).all() or (key == TIME and (state[key] < 0).any()):
            raise UsageError(f"{name}: array {key!r} holds a value no run writes (NaN, inf or a negative time; a "
                             f"diverged run is never checkpointed); {fix}")
    loss, times, evals, blob = (state.pop(k) for k in CURVES)
    return Curves(step=list(range(step)), loss=loss.tolist(), time_s=times.tolist(),
                  evals=_evals(evals, step, name, fix), chunks=_chunks(blob, step, path, fix))


def _check_state(state: Mapping[str, np.ndarray], template: Mapping[str, np.ndarray], step: int, path: Path,
                 fix: str) -> None:
    """The values the headers cannot show: AdamW's count, the second moments, the RNG states (the losses:
    `_curves`)."""
    name = f"{WHAT} {str(path)!r}"
    adam_t = int(state[ADAM_T])
    if adam_t != step:
        raise UsageError(f"{name}: AdamW's step count adam_t is {adam_t}, but the checkpoint is at step {step} (one "
                         f"update a step); {fix}")
    for key, value in state.items():
        if key.startswith("adam_v/") and not (value >= 0).all():
            raise UsageError(f"{name}: array {key!r} holds a negative or NaN second moment, which AdamW never "
                             f"writes; {fix}")
    for key, value in template.items():
        if key.startswith(RNG) and _blob(value):
            _same_json(value, state[key], key, path, fix)


def _same_json(own: np.ndarray, value: np.ndarray, key: str, path: Path, fix: str) -> None:
    """A serialized RNG state that is JSON in the backend's own state must be JSON of the same keys in the file."""
    try:
        mine = json.loads(own.tobytes())
    except ValueError:
        return  # not JSON: bytes the backend checks when it loads them
    try:  # not files.parse_json: an RNG state holds 128-bit numbers (PCG64); the blob is at most BLOB_BYTES
        theirs = json.loads(value.tobytes().decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"{WHAT} {str(path)!r}: array {key!r} is not an RNG state of this backend (not JSON: "
                         f"{str(exc)[:80] or type(exc).__name__}); {fix}") from None
    if isinstance(mine, dict) and (not isinstance(theirs, dict) or set(theirs) != set(mine)):
        raise UsageError(f"{WHAT} {str(path)!r}: array {key!r} is not an RNG state of this backend (its keys "
                         f"differ); {fix}")


def _evals(evals: np.ndarray, step: int, name: str, fix: str) -> list[Eval]:
    """The evaluation rows (step, train loss, val loss, seconds): at whole, increasing steps within 0..`step`."""
    at, seconds = evals[:, 0], evals[:, 3]
    if len(at) and (not np.all(at == np.round(at)) or at.min() < 0 or at.max() > step
                    or (np.diff(at) <= 0).any()):
        raise UsageError(f"{name}: array {EVALS!r} holds evaluations that are not at whole, increasing steps "
                         f"within 0..{step}; {fix}")
    if not np.isfinite(seconds).all() or (seconds < 0).any():
        raise UsageError(f"{name}: array {EVALS!r} holds an evaluation time that is NaN, inf or negative; {fix}")
    return [Eval(int(s), float(a), float(b), float(t)) for s, a, b, t in evals.tolist()]


def _chunks(blob: np.ndarray, step: int, path: Path, fix: str) -> list[dict]:
    """The contention evidence: JSON of the chunks the records hold (harness.store.contention.check_chunks), none
    past `step`."""
    chunks = parse_json(blob.tobytes(), path, f"the contention evidence {CHUNKS!r} of {WHAT}", fix)
    check_chunks(chunks, path, CHUNKS, fix)
    if any(c["step"] + c["n"] > step for c in chunks):
        raise UsageError(f"{str(path)!r} is invalid at field {CHUNKS!r}: a chunk ends after the checkpoint's step "
                         f"{step}; {fix}")
    return chunks
