"""The protocol every backend implements (docs/design.md, "Backend"). The runner never imports a framework.

Arrays crossing this boundary are NumPy, in canonical names and PyTorch layouts (see harness.core.weights):
token batches are int64 (B, T), 0-based; logits are float (B, T, V); gradients and parameters are
{canonical name: ndarray of the canonical shape}.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from harness.config.fields import Config


@runtime_checkable
class Backend(Protocol):
    """One framework's nanoGPT, its optimizer and its device."""

    name: str

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
