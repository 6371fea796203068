"""The protocol every backend implements (docs/design.md, "Backend"). The runner never imports a framework.

Arrays crossing this boundary are NumPy, in canonical names and PyTorch layouts (see harness.core.weights):
token batches are int64 (B, T), 0-based; logits are float (B, T, V); gradients and parameters are
{canonical name: ndarray of the canonical shape}.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from harness.config.fields import Config

NO_GPU = "there is no NVIDIA GPU here (no driver, no nvidia-smi): use --device cpu"


def cuda_fix(fix: str) -> str:
    """The fix of a `--device cuda` that cannot work, for every backend: `fix` (an install hint) where this machine
    shows a GPU, else that there is none (harness.environment.gpu_seen), so no one installs a CUDA build for nothing."""
    from harness.environment import gpu_seen

    return fix if gpu_seen() else NO_GPU


@runtime_checkable
class Backend(Protocol):
    """One framework's nanoGPT, its optimizer and its device.

    Its class also declares what it can do (`declaration`, harness.backends.declaration.Declaration): the dtypes,
    devices, precisions and compile modes it takes, its options and which of the optional methods it has (gradients,
    taps, warm_up, device_clock, fetch_losses, ...); the harness calls an optional method only where it is declared.
    The constructor takes keyword options: `dtype` always, `precision`, `compile`, `cuda_graphs` and `parity` where
    declared. docs/backends.md: adding one.
    """

    name: str
    declaration: ClassVar[Any]

    def setup(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str,
              seed: int) -> None:
        """Build the model from canonical `weights`, create the AdamW state, move both to `device`.

        `seed` seeds the backend's own dropout RNG (dropout masks differ between frameworks anyway).
        """

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float,
                   masks: dict[str, np.ndarray] | None = None) -> Any:
        """One forward, backward, clip and AdamW update with dropout active; returns the loss.

        `masks` (parity mode with dropout, harness.core.masks.dropout_masks): a bool keep-mask (B, T, C) per dropout
        site ("emb", "h.{i}.attn", "h.{i}.mlp"), and with config.attn_dropout a (B, H, T, T) one per block on the
        attention probabilities ("h.{i}.attn.probs"), that the backend applies as x * mask / (1 - p) instead of
        drawing its own; None: the backend's own dropout.

        The loss may be a device scalar: `losses_to_floats` turns a list of them into floats, so the
        training loop need not synchronise with the device each step.
        """

    def losses_to_floats(self, losses: list[Any]) -> list[float]:
        """Fetch a list of losses returned by `train_step` as Python floats (one device sync)."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on synchronous devices); called before reading a clock."""

    def eval_loss(self, x: np.ndarray, y: np.ndarray) -> float:
        """Mean cross-entropy with dropout off, no gradient."""

    def logits(self, x: np.ndarray, last_only: bool = False) -> np.ndarray:
        """(B, T, V) logits with dropout off, as float64 or float32 NumPy; with `last_only`, (B, 1, V): only the
        last position's logits leave the device (generation needs no more)."""

    def gradients(self, x: np.ndarray, y: np.ndarray,
                  masks: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Gradients of the mean loss (no update, no clipping), canonical names and shapes.

        Dropout off, unless `masks` are given (as in `train_step`): then exactly those masks are applied.
        """

    def taps(self, x: np.ndarray, masks: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The named intermediate activations of the forward pass of `x` (harness/core/taps.py: "emb",
        "h.{i}.ln_1", ..., "ln_f", "logits"), canonical names and layouts: parity's depth 0.

        Dropout off, except at the sites of `masks` (keep-masks of x's rows, as `gradients` takes them; parity hands
        the attention probabilities' step-0 masks, harness.core.taps.tap_masks): there exactly those masks apply."""

    def parameters(self) -> dict[str, np.ndarray]:
        """Current parameters, canonical names and shapes."""

    def memory(self) -> dict[str, Any]:
        """Memory figures: {'peak_bytes': int, 'kind': 'device' | 'rss', ...}."""

    def describe(self) -> dict[str, Any]:
        """Framework, versions, device name, dtype and numerics flags."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """Model and optimizer state as flat arrays (for checkpoints); `load_state_dict` restores it.

        The arrays are the caller's own (copies, never views of live state), and `load_state_dict` copies what it
        is given: the parity probe (harness/run/probe.py) keeps them without copying again."""

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore what `state_dict` returned. The "param/", "adam_m/", "adam_v/" arrays and "adam_t" of another
        backend's state_dict must also load (harness parity's re-synchronised optimizer depth hands the reference's
        state to the other backend); RNG entries are optional."""


class BackendUnavailable(Exception):
    """The backend cannot run here (framework or device missing); the message says how to fix it."""


@dataclass
class Timed:
    """One repeat of a loop of training steps: wall and process CPU time for the whole repeat, the per-step times,
    the losses (harness.bench.overhead's runner and floor alike)."""

    wall_s: float
    step_s: list[float]
    losses: list[float]
    cpu_s: float = math.nan
    compile_s: float | None = None


class BareLoop(Protocol):
    """A backend's hand-written floor for `harness bench overhead`: the same training steps with no harness code
    between them, named by its declaration's `bare_loop` ("module:Class"; none: the generic loop over train_step).

    Constructed as `Class(config, weights, vocab_size, device, seed, **options)` with the backend's constructor
    options, in the measuring process only (it may import its framework)."""

    compiles: bool  # its first repeat compiles or captures (never a timed one: the benchmark warms it up first)

    def repeat(self, batches: Sequence[tuple[np.ndarray, np.ndarray]], sync_each_step: bool = False) -> Timed:
        """One training step per batch, timed as the runner times the backend (`sync_each_step`: a device sync
        after every step instead, what that would cost)."""

    def info(self) -> dict[str, Any]:
        """What the benchmark adds to the backend's description (e.g. the attention kernels it may pick)."""
