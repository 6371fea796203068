"""The kit's optimizer depth from the same state: the oracle takes each of the port's optimizer steps from the
port's own state before it.

A port trains freely, so after a few steps its state differs from the oracle's free-running one by whatever
rounding has grown into: with tied embeddings at learning rate 0.01 the difference grows about tenfold per step
from step 4 on (docs/kit.md, "Why the optimizer steps are re-synchronised"), and a correct port's step 5 differed by
4e-12 in float64 (8e-4 in float32) while each of its steps, taken from the same state, agrees to 1e-14 (1e-5).
So, as `harness parity` re-synchronises, `kit check` has the float64 NumPy oracle take step k from the port's state
after step k - 1 (the kit's weights and zero moments for k = 1), with the kit's batch, learning rate and dropout
masks of step k - 1, and grades the port's step k against that: the tolerances measured for one step from the
same state apply, for any number of steps. The kit's own opt/<k> (the oracle's free run) stay what a port author
debugs against; step 1 is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from harness.run.probe import SYNC_LOSS, SYNC_REFERENCE, SYNC_STEPS, opt_key, state_at

PORT = "port"  # the name the re-synchronised oracle records as its reference (harness.kit.grade.PORT)


def resync_problem(config: Any, kit: dict[str, dict[str, np.ndarray]], opt_k: int) -> str | None:
    """Why the oracle cannot take the port's steps from its states (None: it can): the manifest's config is not one
    this harness reads, or a kit with dropout lacks its masks."""
    if config is None:
        return "the kit's config is not one this harness reads"
    if opt_k and config.dropout > 0 and not kit.get("masks.npz"):
        return "the kit has dropout but no masks"
    return None


def oracle_steps(manifest: dict[str, Any], kit: dict[str, dict[str, np.ndarray]], port: dict[str, np.ndarray],
                 opt_k: int, config: Any, losses_given: int,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """The oracle's steps 1..opt_k, each from the port's state before it (`port`: the port's probe, holding
    opt/0/param/<name>, the kit's weights, and the port's opt/<k>/param|adam_m|adam_v/<name>), as a re-synchronised
    parity probe holds them: opt/<k>/..., sync/steps, sync/reference ("port") and sync/loss, the loss of each step
    from the port's state, for the first `losses_given` steps (the losses the port wrote, which it is compared
    with). `progress(k, opt_k)` is called before each step."""
    from harness.backends.numpy_backend import NumpyBackend

    batches, masks = kit["batches.npz"], kit.get("masks.npz") or {}
    oracle = NumpyBackend(dtype="float64")
    oracle.setup(config, {n: np.asarray(w) for n, w in kit["weights.npz"].items()}, int(manifest["vocab_size"]),
                 "cpu", int(manifest.get("seed") or 0))
    out: dict[str, np.ndarray] = {}
    losses = []
    for k in range(1, opt_k + 1):
        if progress is not None:
            progress(k, opt_k)
        oracle.load_state_dict(state_at(port, k - 1))  # AdamW's t = k - 1 (the port's results carry no t)
        step_masks = {key: m[k - 1] for key, m in masks.items()} if config.dropout > 0 else None
        with np.errstate(all="ignore"):  # a port's state far off may overflow: the comparison reads it as NaN
            loss = oracle.train_step(batches["x"][k - 1], batches["y"][k - 1], float(batches["lr"][k - 1]),
                                     masks=step_masks)
        losses.append(float(loss))
        state = oracle.state_dict()
        out.update({opt_key(k, key): np.asarray(value, dtype=np.float64) for key, value in state.items()
                    if key.partition("/")[0] in ("param", "adam_m", "adam_v")})
    out[SYNC_STEPS] = np.arange(1, opt_k + 1, dtype=np.int64)
    out[SYNC_LOSS] = np.asarray(losses[:losses_given], dtype=np.float64)
    out[SYNC_REFERENCE] = np.array(PORT)
    return out
