"""What one backend records for `harness parity`: its probe (docs/parity.md, "The probe").

The same code runs in the parity worker (harness/run/worker.py) and in process (tests, tools/planted_bugs.py), so an
in-process measurement is the command's.

A probe maps names to arrays:

- step 0, on the first training batch with the initial weights: `logits`, `x`, `y`, `grad/<name>`, with dropout
  `dropout_grad/<name>` (under the step-0 masks), and the activation taps `tap/<name>` (harness/core/taps.py) on its
  first rows, dropout off except at the attention probabilities of a model with attention dropout, where the
  step-0 masks apply (harness.core.taps.tap_masks; those masks, on the tap rows, as `tap_mask/<site>`); `lr`, the
  schedule's rate of every step (harness/core/schedule.py, what the runner hands `train_step`);
- `lr_used`: the rate each of the backend's own training steps actually took, read from its parameters and AdamW
  moments before and after the step (harness.core.schedule.effective_rate), for every step of the run;
- the optimizer state after training step k: `opt/<k>/param|adam_m|adam_v/<name>` and `opt/<k>/adam_t`
  (k = 0: the initial parameters, zero moments, t = 0).

The optimizer depth is **re-synchronised**: one backend is the reference and trains on its own; the other, after
each of its own training steps k (1..opt_steps), loads the reference's state after step k - 1, takes step k from
it (batch and masks of step k - 1, the same learning rate), records that state as its `opt/<k>/...` and the loss
of that step as `sync/loss[k - 1]`, and restores its own state before going on. Both backends' step k then starts
from the same parameters and AdamW moments, so rounding differences cannot grow from step to step (chaos), and a
defect that first acts at step k shows at step k, however long the run. `sync/steps` lists the re-synchronised
steps and `sync/reference` (a string array) names the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from harness.backends import declared
from harness.config.fields import Config
from harness.core.schedule import effective_rate, learning_rate, learning_rates
from harness.core.taps import MASK_PREFIX as TAP_MASK_PREFIX
from harness.core.taps import PREFIX as TAP_PREFIX
from harness.core.taps import tap_mask_sites, tap_masks, tap_rows, tap_shapes
from harness.core.weights import param_shapes
from harness.errors import UsageError
from harness.npz import Want, read_npz, spec_bytes

# The probe's array names (docs/parity.md, "The probe"): defined here, where they are written; harness.parity
# (harness/parity/states.py) reads them through these names.
GRAD_PREFIX = "grad/"
DROPOUT_GRAD_PREFIX = "dropout_grad/"  # step-0 gradients under the harness's step-0 dropout masks
OPT_PREFIX = "opt/"  # opt/<k>/param|adam_m|adam_v/<name>, opt/<k>/adam_t: the state after training step k
STATE_QUANTITIES = ("param", "adam_m", "adam_v")  # the arrays of a state, per parameter
STATE_PARTS = tuple(f"{q}/" for q in STATE_QUANTITIES)  # their prefixes in a backend's state_dict
ADAM_T = "adam_t"  # AdamW's step counter in a state_dict and under opt/<k>/
SYNC_STEPS, SYNC_LOSS, SYNC_REFERENCE = "sync/steps", "sync/loss", "sync/reference"


def opt_key(step: int, key: str) -> str:
    """The probe's name of state_dict entry `key` ("param/<name>", "adam_t", ...) after training step `step`."""
    return f"{OPT_PREFIX}{step}/{key}"


class ProbeUnreadable(UsageError):
    """A probe that is no probe of this run (damaged, of the wrong shapes, not a regular file): its backend left no
    usable result, which `harness parity` reports as a crash (exit status 3), never as a difference of the model."""


FLOATS = ("float32", "float64")
PROBE_FIX = "run `harness parity` again"


def expected(config: Config, vocab_size: int, steps: int, opt_steps: int) -> dict[str, Want]:
    """Every array a probe of this parity run may hold (the names of the module docstring), each of its canonical
    shape (harness.core: weights, taps, masks) in float32 or float64 (token ids whole numbers, masks bool): the step-0
    arrays are required, the taps, the optimizer states of steps 0..`opt_steps` and the rest optional."""
    B, T, rows = config.batch_size, config.block_size, tap_rows(config)
    params = param_shapes(config, vocab_size)
    integer = ("integer",)
    spec: dict[str, Want] = {"logits": Want((B, T, vocab_size), FLOATS), "x": Want((B, T), integer, 8 * B * T),
                             "y": Want((B, T), integer, 8 * B * T), "lr": Want((steps,), FLOATS, required=False),
                             "lr_used": Want((steps,), FLOATS, required=False)}
    for name, shape in params.items():
        spec[GRAD_PREFIX + name] = Want(shape, FLOATS)
        spec[DROPOUT_GRAD_PREFIX + name] = Want(shape, FLOATS, required=False)
    spec.update({TAP_PREFIX + n: Want(shape, FLOATS, required=False)
                 for n, shape in tap_shapes(config, vocab_size).items()})
    spec.update({TAP_MASK_PREFIX + site: Want((rows, config.n_head, T, T), ("bool",), required=False)
                 for site in tap_mask_sites(config)})
    for k in range(opt_steps + 1):
        spec[opt_key(k, ADAM_T)] = Want((), integer, 8, required=False)
        spec.update({opt_key(k, part + n): Want(shape, FLOATS, required=False) for part in STATE_PARTS
                     for n, shape in params.items()})
    spec.update({SYNC_STEPS: Want((opt_steps,), integer, 8 * opt_steps, required=False),
                 SYNC_LOSS: Want((opt_steps,), FLOATS, required=False),
                 SYNC_REFERENCE: Want((), ("text",), 4096, required=False)})
    return spec


def read(path: Any, backend: str, config: Config, vocab_size: int, steps: int, opt_steps: int,
         only: Callable[[str], bool] | None = None) -> dict[str, np.ndarray]:
    """Backend `backend`'s probe at `path` (its arrays that `only` keeps), read through the one bounded reader
    (harness.npz) against `expected` and checked whole (the optimizer states of steps 0..K each complete);
    ProbeUnreadable ("backend X's probe is unreadable: ...") otherwise."""
    spec = expected(config, vocab_size, steps, opt_steps)
    try:
        probe = read_npz(path, "probe", PROBE_FIX, spec, max_file_bytes=spec_bytes(spec, 0), max_array_bytes=0,
                         only=only)
        _check_states(probe, list(param_shapes(config, vocab_size)), path)
    except ProbeUnreadable:
        raise
    except UsageError as exc:
        raise ProbeUnreadable(f"backend {backend}'s probe is unreadable: {exc}") from None
    return probe


def _check_states(probe: Mapping[str, np.ndarray], names: list[str], path: Any) -> None:
    """The optimizer states a probe holds are those of steps 0..K, each whole: every parameter (and after step 0
    both moments)."""
    steps = sorted({int(k.split("/")[1]) for k in probe if k.startswith(OPT_PREFIX)})
    if steps != list(range(len(steps))):
        raise UsageError(f"probe {str(path)!r} holds the optimizer states of steps {steps}, not of steps 0..K; "
                         f"{PROBE_FIX}")
    for k in steps:
        for part in STATE_PARTS if k else STATE_PARTS[:1]:
            missing = [n for n in names if opt_key(k, part + n) not in probe]
            if missing:
                raise UsageError(f"probe {str(path)!r} lacks array {opt_key(k, part + missing[0])!r} (a step's "
                                 f"state is kept whole); {PROBE_FIX}")


def state_arrays(backend: Any) -> dict[str, np.ndarray]:
    """The backend's parameters, AdamW moments and step count ("param/<name>", ..., "adam_t").

    No copies: every backend's state_dict returns arrays the caller owns (torch .numpy().copy(), numpy to_numpy,
    flux from Julia), which the backends' load_state_dict copy in turn; see harness.backends.base."""
    return {k: v for k, v in backend.state_dict().items() if k.startswith(STATE_PARTS) or k == ADAM_T}


def state_at(probe: Mapping[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """The state after training step `step` that `probe` recorded, as a state_dict ("param/<name>", "adam_m/<name>",
    "adam_v/<name>", "adam_t") that a backend loads: the one reader of `opt/<k>/...`. Step 0 (the initial
    parameters) gets zero moments and t = 0 where the probe holds none; a step without `adam_t` gets t = step.
    Empty when the probe holds nothing of that step. The arrays are the probe's own (load_state_dict copies)."""
    head = opt_key(step, "")
    state = {k[len(head):]: v for k, v in probe.items() if k.startswith(head)}
    if not state:
        return state
    if step == 0:
        for k, p in list(state.items()):
            if k.startswith(STATE_PARTS[0]):
                name = k[len(STATE_PARTS[0]):]
                for part in STATE_PARTS[1:]:
                    state.setdefault(part + name, np.zeros_like(p))
    state.setdefault(ADAM_T, np.array(step, dtype=np.int64))
    return state


def split_state(state: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """A state_dict as {"param" | "adam_m" | "adam_v": {name: float64 array}} (adam_t and other entries left out)."""
    out: dict[str, dict[str, np.ndarray]] = {q: {} for q in STATE_QUANTITIES}
    for key, value in state.items():
        quantity, _, name = key.partition("/")
        if quantity in out and name:
            out[quantity][name] = np.asarray(value, dtype=np.float64)
    return out


class Recorder:
    """Builds one backend's probe during its parity run.

    `reference`: the reference backend's probe (holding `opt/<k>/...` for k = 0..opt_steps - 1) for the backend that
    re-synchronises, None for the reference itself. `masks(step)`: the harness's dropout masks (None: dropout 0).
    `reference_name`: recorded as `sync/reference`.
    """

    def __init__(self, backend: Any, config: Config, stream: Any, opt_steps: int, total_steps: int,
                 masks: Callable[[int], dict] | None = None, reference: Mapping[str, np.ndarray] | None = None,
                 reference_name: str = "") -> None:
        self.backend, self.config, self.stream = backend, config, stream
        self.opt_steps, self.total_steps = min(int(opt_steps), int(total_steps)), int(total_steps)
        self.masks, self.reference, self.reference_name = masks, reference, reference_name
        self.arrays: dict[str, np.ndarray] = {}
        self.sync_loss: list[float] = []
        self.lr_used: list[float] = []
        self.before: dict[str, np.ndarray] = {}  # the backend's own parameters before its next step

    def learning_rate(self, step: int) -> float:
        """The learning rate of training step `step` (0-based): the one the training loop hands `train_step`."""
        return learning_rate(self.config, step)

    def start(self) -> dict[str, np.ndarray]:
        """The step-0 arrays, before any training step; returns the probe so far."""
        b = self.backend
        x, y = self.stream.batch(0)
        arrays: dict[str, np.ndarray] = {"logits": np.asarray(b.logits(x)), "x": x, "y": y,
                                         "lr": np.asarray(learning_rates(self.config, self.total_steps))}
        arrays.update({GRAD_PREFIX + k: np.asarray(v) for k, v in b.gradients(x, y).items()})
        if self.masks:
            arrays.update({DROPOUT_GRAD_PREFIX + k: np.asarray(v)
                           for k, v in b.gradients(x, y, masks=self.masks(0)).items()})
        arrays.update(self.taps(x))
        self.before = b.parameters()  # copies (every backend's parameters() returns arrays the caller owns)
        arrays.update({opt_key(0, STATE_PARTS[0] + k): v for k, v in self.before.items()})
        arrays[opt_key(0, ADAM_T)] = np.array(0, dtype=np.int64)
        self.arrays = arrays
        return arrays

    def taps(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """The activation taps on the first rows of `x` (`tap/<name>`), taken with the step-0 masks of
        harness.core.taps.tap_masks (the attention probabilities' with attention dropout), and those masks
        (`tap_mask/<site>`, so that the probe says what its taps were taken with). None from a backend without
        taps (its declaration lists no `taps`)."""
        b = self.backend
        if not declared(b, "taps"):
            return {}
        masks = tap_masks(self.config, self.masks(0) if self.masks else None)
        rows = x[:tap_rows(self.config)]
        if not masks:
            return {TAP_PREFIX + k: np.asarray(v) for k, v in b.taps(rows).items()}
        out = {TAP_PREFIX + k: np.asarray(v) for k, v in b.taps(rows, masks=masks).items()}
        return {**out, **{TAP_MASK_PREFIX + k: m for k, m in masks.items()}}

    def after_step(self, done: int) -> bool:
        """Record the rate the backend's own step `done` took and, up to step opt_steps, the optimizer state after
        it (the runner's after_step hook); True when the probe should be written (after step opt_steps, with the
        states complete, and after the last step, with every step's rate)."""
        # state_dict's arrays are the caller's own (no copy needed): the parameters are kept until the next step
        # (the rate's "before"), the whole state only up to step opt_steps (recorded in the probe)
        full = self.backend.state_dict()
        own = {k: v for k, v in full.items() if k.startswith(STATE_PARTS) or k == ADAM_T}
        part = {kind: {k[len(kind):]: v for k, v in own.items() if k.startswith(kind)} for kind in STATE_PARTS}
        self.lr_used.append(effective_rate(self.before, part["param/"], part["adam_m/"], part["adam_v/"],
                                           int(own[ADAM_T]), self.config))
        self.before = part["param/"]
        if done == self.total_steps:
            self.arrays["lr_used"] = np.asarray(self.lr_used, dtype=np.float64)
        if done > self.opt_steps:
            return done == self.total_steps
        state = own if self.reference is None else self._resync(done, full)
        self.arrays.update({opt_key(done, k): v for k, v in state.items()})
        if done == self.opt_steps and self.reference is not None:
            self.arrays[SYNC_STEPS] = np.arange(1, self.opt_steps + 1, dtype=np.int64)
            self.arrays[SYNC_LOSS] = np.asarray(self.sync_loss, dtype=np.float64)
            self.arrays[SYNC_REFERENCE] = np.array(self.reference_name)
        return done in (self.opt_steps, self.total_steps)

    def _resync(self, done: int, own: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Take step `done` from the reference's state after step done - 1; put the backend's own state (`own`, its
        state_dict after its own step `done`) back."""
        b = self.backend
        start = state_at(self.reference, done - 1)
        if not any(k.startswith(STATE_PARTS[0]) for k in start):
            raise UsageError(f"parity: the reference's probe ({self.reference_name}) holds no state after step "
                             f"{done - 1}: its worker did not complete those steps; run the comparison again")
        b.load_state_dict(start)
        x, y = self.stream.batch(done - 1)
        kw = {} if self.masks is None else {"masks": self.masks(done - 1)}
        loss = b.train_step(x, y, self.learning_rate(done - 1), **kw)
        self.sync_loss.append(float(b.losses_to_floats([loss])[0]))
        state = state_arrays(b)
        b.load_state_dict(own)
        return state


def run(backend: Any, config: Config, corpus: Any, seed: int, opt_steps: int | None = None,
        reference: Mapping[str, np.ndarray] | None = None, reference_name: str = "",
        device: str = "cpu", prepare: Callable[[Any], None] | None = None
        ) -> tuple[dict[str, np.ndarray], list[float]]:
    """What a parity worker measures, in this process: `backend` set up from the canonical weights of `seed`,
    trained for `config.steps` steps through the real training loop (harness.run.loop.train, with the harness's dropout
    masks when config.dropout > 0) while the probe is recorded; returns (probe, per-step losses). `opt_steps`: the
    optimizer steps recorded (default every step); `reference`: the reference's probe to re-synchronise from;
    `prepare(backend)`: called after the set-up (tests plant bugs there)."""
    from harness.core.data import BatchStream
    from harness.core.masks import dropout_masks
    from harness.core.weights import init_weights
    from harness.run.loop import Curves, LoopOptions, train

    steps = int(config.steps or 0)
    if steps <= 0:
        raise ValueError("probe.run needs config.steps > 0")
    stream = BatchStream(corpus.train, config.block_size, config.batch_size, seed, config.scheme)
    backend.setup(config, init_weights(config, corpus.vocab_size, seed), corpus.vocab_size, device, seed)
    if prepare is not None:
        prepare(backend)
    masks = (lambda step: dropout_masks(config, seed, step)) if config.dropout > 0 else None
    recorder = Recorder(backend, config, stream, steps if opt_steps is None else opt_steps, steps, masks=masks,
                        reference=reference, reference_name=reference_name)
    recorder.start()
    curves = Curves()
    outcome = train(backend, config, stream, {}, curves, steps,
                    LoopOptions(progress=False, masks=masks, after_step=recorder.after_step))
    if outcome.status != "completed":
        raise RuntimeError(f"training {outcome.status}")
    return recorder.arrays, list(curves.loss)
