"""What a parity probe holds, read as the comparison and its diagnoses need it: the arrays under a prefix, the
optimizer state and update after training step k, which side re-synchronised from which, and the learning rate of a
step. The probe's names are harness.run.probe's; nothing here compares."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from harness.run.probe import (
    ADAM_T,
    GRAD_PREFIX,
    OPT_PREFIX,
    STATE_QUANTITIES,
    SYNC_STEPS,
    opt_key,
    split_state,
    state_at,
)

# what depth 3 grades per parameter: the update (param after step k - param after step k - 1) and the moments
OPT_QUANTITIES = ("update", *STATE_QUANTITIES[1:])


def arrays(probe: Mapping[str, np.ndarray], prefix: str = GRAD_PREFIX) -> dict[str, np.ndarray]:
    """The probe's arrays under `prefix` (gradients by default; TAP_PREFIX: the taps), by name without it."""
    return {k[len(prefix):]: v for k, v in probe.items() if k.startswith(prefix)}


def initial_params(*probes: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The parameters before step 1 (`opt/0/param/`) of the first probe that holds them, float64."""
    for probe in probes:
        params = opt_state(probe, 0)["param"]
        if params:
            return params
    return {}


def opt_steps(probe: Mapping[str, np.ndarray]) -> list[int]:
    """The training steps k >= 1 whose optimizer state the probe holds (`opt/<k>/...`), ascending."""
    steps = {int(k.split("/")[1]) for k in probe if k.startswith(OPT_PREFIX) and k.split("/")[1].isdigit()}
    return sorted(k for k in steps if k >= 1)


def opt_state(probe: Mapping[str, np.ndarray], step: int) -> dict[str, dict[str, np.ndarray]]:
    """{"param" | "adam_m" | "adam_v": {name: float64 array}} after training step `step` (0: before the first step,
    zero moments), read by harness.run.probe.state_at."""
    return split_state(state_at(probe, step))


def adam_t(probe: Mapping[str, np.ndarray], step: int) -> int | None:
    """AdamW's step counter after training step `step` as the probe recorded it (None: not recorded)."""
    value = probe.get(opt_key(step, ADAM_T))
    return None if value is None else int(np.asarray(value))


def opt_quantities(probe: Mapping[str, np.ndarray], step: int,
                   before: Mapping[str, np.ndarray] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """What depth 3 grades after training step `step`: {"update": p_k - p_(k-1), "adam_m": m_k, "adam_v": v_k},
    each {name: float64 array}. `before`: the parameters the step started from (re-synchronised: the reference's);
    default the probe's own after step - 1. Without those the update is the parameter p_k itself."""
    now = opt_state(probe, step)
    prev = opt_state(probe, step - 1)["param"] if before is None else before
    update = {n: (p - prev[n] if n in prev and np.shape(prev[n]) == p.shape else p) for n, p in now["param"].items()}
    return {"update": update, "adam_m": now["adam_m"], "adam_v": now["adam_v"]}


def synchronised(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray]) -> int | None:
    """Which probe (0 or 1) is the reference the other re-synchronised its steps from (the other holds
    `sync/steps`), None for two free-running probes."""
    if SYNC_STEPS in probe_a and SYNC_STEPS not in probe_b:
        return 1
    if SYNC_STEPS in probe_b and SYNC_STEPS not in probe_a:
        return 0
    return None


def start_state(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], step: int
                ) -> dict[str, dict[str, np.ndarray]]:
    """The state both sides started training step `step` from: the reference's after step - 1 when re-synchronised,
    else probe_b's (the same as probe_a's when every earlier step agreed); zero moments at step 1."""
    ref = synchronised(probe_a, probe_b)
    return opt_state(probe_a if ref == 0 else probe_b, step - 1)


def concat(arrays: Mapping[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    """The arrays of `names`, flattened and joined in that order (empty without names)."""
    return np.concatenate([np.ravel(arrays[n]) for n in names]) if names else np.zeros(0)


def hyper_value(hyper: Mapping[str, Any] | None, key: str) -> float | None:
    """A number of the config `hyper` (learning_rate, weight_decay, beta1, beta2), None when absent or not one."""
    value = (hyper or {}).get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def step_rate(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray], step: int,
              hyper: Mapping[str, Any] | None) -> float | None:
    """The learning rate of optimizer step `step` (1-based): the harness's schedule as the probes hold it (`lr`, what
    the runner handed `train_step`), else the config's constant `learning_rate` (probes from before the schedule)."""
    for probe in (probe_a, probe_b):
        lrs = probe.get("lr")
        if lrs is not None and np.ndim(lrs) == 1 and len(lrs) >= step >= 1:
            return float(lrs[step - 1])
    return hyper_value(hyper, "learning_rate")
