"""What `harness.parity.compare.compare` found, as one object: `ParityResult`, its summary rows (the table parity
prints, parity.json's `checks`, the HTML report's) and its JSON form (parity.json's `results`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.parity.numeric import fmt_index, within, worst
from harness.parity.tolerances import Tolerances


@dataclass
class ParityResult:
    """What `compare` found: the deviations, the tolerances they were held to, what broke first and worst."""

    backends: tuple[str, str]
    tolerances: Tolerances
    logits_max_abs: float = math.nan
    logits_where: tuple[int, ...] = ()  # (batch row, position, token) of the largest difference
    logits_cause: str | None = None
    # depth 0: {tap: max |diff| / the tap's scale}, the raw max |diff| and where; the first over tolerance
    taps_rel_err: dict[str, float] = field(default_factory=dict)
    taps_max_abs: dict[str, float] = field(default_factory=dict)
    taps_where: dict[str, tuple[int, ...]] = field(default_factory=dict)
    first_tap: str | None = None
    worst_tap: str | None = None
    tap_cause: str | None = None
    taps_missing: dict[str, list[str]] = field(default_factory=dict)  # backend -> taps only the other gave
    grad_rel_err: dict[str, float] = field(default_factory=dict)
    worst_grad: str | None = None
    worst_grad_rel_err: float = math.nan
    first_grad: str | None = None  # the first over tolerance in backward order (nearest the loss first)
    loss_max_abs_dev: float = math.nan
    loss_peak_step: int = -1
    loss_first_bad: int = -1  # the first step over the loss tolerance
    loss_steps: int = 0
    loss_abs_dev: list[float] = field(default_factory=list)
    val_loss: dict[str, float] | None = None
    val_loss_abs_diff: float | None = None
    dropout_grad_rel_err: dict[str, float] = field(default_factory=dict)  # under the step-0 masks (dropout > 0)
    worst_dropout_grad: str | None = None
    worst_dropout_grad_rel_err: float = math.nan
    first_dropout_grad: str | None = None
    # depth 3: {step k: {"update" | "adam_m" | "adam_v": {name: rel err}}}
    opt_rel_err: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    opt_reference: str | None = None  # re-synchronised: the backend whose state every step started from
    worst_opt: tuple[int, str, str] | None = None  # (step, quantity, parameter)
    worst_opt_rel_err: float = math.nan
    opt_first_bad: tuple[int, str, str] | None = None  # the worst at the first step out of tolerance
    opt_first_bad_rel_err: float = math.nan
    opt_cause: str | None = None
    # the learning rate each training step took (probe `lr_used`) against the harness's schedule (`lr`), per backend
    rate_rel_err: dict[str, float] = field(default_factory=dict)
    rate_tol: float = math.nan
    rate_first_bad: tuple[str, int] | None = None  # (backend, optimizer step)
    rate_cause: str | None = None
    step_loss_abs_dev: list[float] = field(default_factory=list)  # re-synchronised steps 1..K: |loss diff|
    step_loss_first_bad: int = -1  # the first such step (1-based) over the step-loss tolerance
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the reader should know that is no failure

    @property
    def passed(self) -> bool:
        """True when every check is within its tolerance."""
        return not self.failures

    def rows(self) -> list[dict[str, Any]]:
        """The summary table: one row per check, each with its depth (taps, logits, gradients, dropout_gradients,
        optimizer, learning_rate, step_loss, loss) and where it first broke and where it is worst, in two columns.
        parity.json stores these rows (`checks`), and the HTML report shows them as they are."""
        t = self.tolerances
        lw = self.logits_where
        rows = []
        if self.taps_rel_err:
            wt = self.worst_tap
            rows.append({"depth": "taps", "check": "step-0 activation taps max |diff| (scaled)",
                         "value": self.taps_rel_err[wt] if wt else math.nan, "tolerance": t.tap,
                         "first_broken": self.first_tap or "",
                         "worst": f"{wt} {fmt_index(self.taps_where.get(wt, ()))}" if wt else ""})
        rows.append({"depth": "logits", "check": "step-0 logits max |diff|", "value": self.logits_max_abs,
                     "tolerance": t.logits, "first_broken": "",
                     "worst": f"batch row {lw[0]}, position {lw[1]}, token {lw[2]}" if len(lw) == 3 else ""})
        rows.append({"depth": "gradients", "check": "step-0 gradient rel err", "value": self.worst_grad_rel_err,
                     "tolerance": t.grad, "first_broken": self.first_grad or "", "worst": self.worst_grad or ""})
        if self.dropout_grad_rel_err:
            rows.append({"depth": "dropout_gradients", "check": "step-0 gradient rel err, dropout masks",
                         "value": self.worst_dropout_grad_rel_err, "tolerance": t.grad,
                         "first_broken": self.first_dropout_grad or "", "worst": self.worst_dropout_grad or ""})
        if self.opt_rel_err:
            wo, fb = self.worst_opt, self.opt_first_bad
            steps = sorted(self.opt_rel_err)
            span = f"{steps[0]}..{steps[-1]}" if steps != list(range(steps[0], steps[-1] + 1)) or len(steps) > 1 \
                else f"{steps[0]}"
            sync = " (re-synchronised)" if self.opt_reference else ""
            rows.append({"depth": "optimizer", "check": f"optimizer steps {span}{sync} rel err",
                         "value": self.worst_opt_rel_err, "tolerance": t.opt,
                         "first_broken": f"step {fb[0]} {fb[1]} {fb[2]}" if fb else "",
                         "worst": f"step {wo[0]} {wo[1]} {wo[2]}" if wo else ""})
        if self.step_loss_abs_dev:
            dev = self.step_loss_abs_dev
            peak = worst(dict(enumerate(dev)))  # the value and where it is: the same step, a NaN first
            rows.append({"depth": "step_loss", "check": "loss of each step from the same state",
                         "value": dev[peak],
                         "tolerance": t.step,
                         "first_broken": f"step {self.step_loss_first_bad}" if self.step_loss_first_bad > 0 else "",
                         "worst": f"step {peak + 1} of {len(dev)}"})
        if self.rate_rel_err:
            who = worst(self.rate_rel_err)
            bad = self.rate_first_bad
            rows.append({"depth": "learning_rate", "check": "learning rate per step vs schedule",
                         "value": self.rate_rel_err[who], "tolerance": self.rate_tol,
                         "first_broken": f"{bad[0]} at step {bad[1]}" if bad else "", "worst": who})
        rows.append({"depth": "loss", "check": "training loss max |diff|", "value": self.loss_max_abs_dev,
                     "tolerance": t.loss,
                     "first_broken": f"step {self.loss_first_bad}" if self.loss_first_bad >= 0 else "",
                     "worst": f"step {self.loss_peak_step} of {self.loss_steps}" if self.loss_steps else ""})
        if self.val_loss_abs_diff is not None:
            rows.append({"depth": "loss", "check": "final val loss |diff|", "value": self.val_loss_abs_diff,
                         "tolerance": t.loss, "first_broken": "",
                         "worst": ", ".join(f"{k} {v:.6f}" for k, v in (self.val_loss or {}).items())})
        for row in rows:
            row["result"] = "ok" if within(row["value"], row["tolerance"]) else "FAIL"
        if self.opt_first_bad and rows and any(r["depth"] == "optimizer" for r in rows):
            for row in rows:  # a pattern caught within tolerance (decay on the embeddings, aliasing) still fails
                if row["depth"] == "optimizer":
                    row["result"] = "FAIL"
        if self.first_tap:
            for row in rows:
                if row["depth"] == "taps":
                    row["result"] = "FAIL"
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready results (NaN stays NaN; json writes it as NaN)."""
        return {
            "passed": self.passed, "failures": list(self.failures), "notes": list(self.notes),
            "tolerances": asdict(self.tolerances),
            "taps": {"first_divergent": self.first_tap, "cause": self.tap_cause, "worst": self.worst_tap,
                     "rel_err": dict(self.taps_rel_err), "max_abs_diff": dict(self.taps_max_abs),
                     "where": {k: list(v) for k, v in self.taps_where.items()},
                     "missing": {k: list(v) for k, v in self.taps_missing.items()}} if self.taps_rel_err else None,
            "logits": {"max_abs_diff": self.logits_max_abs, "where": list(self.logits_where),
                       "cause": self.logits_cause},
            "gradients": {"worst": self.worst_grad, "worst_rel_err": self.worst_grad_rel_err,
                          "first_broken": self.first_grad, "rel_err": dict(self.grad_rel_err)},
            "loss": {"max_abs_dev": self.loss_max_abs_dev, "peak_step": self.loss_peak_step,
                     "first_bad_step": self.loss_first_bad if self.loss_first_bad >= 0 else None,
                     "steps": self.loss_steps, "abs_dev": list(self.loss_abs_dev)},
            "val_loss": {"values": self.val_loss, "abs_diff": self.val_loss_abs_diff},
            "dropout_gradients": {"worst": self.worst_dropout_grad, "worst_rel_err": self.worst_dropout_grad_rel_err,
                                  "first_broken": self.first_dropout_grad,
                                  "rel_err": dict(self.dropout_grad_rel_err)} if self.dropout_grad_rel_err else None,
            "optimizer": {
                "steps": sorted(self.opt_rel_err),
                "resynchronised_from": self.opt_reference,
                "worst": dict(zip(("step", "quantity", "parameter"), self.worst_opt)) if self.worst_opt else None,
                "worst_rel_err": self.worst_opt_rel_err,
                "first_bad": (dict(zip(("step", "quantity", "parameter"), self.opt_first_bad))
                              if self.opt_first_bad else None),
                "first_bad_rel_err": self.opt_first_bad_rel_err,
                "cause": self.opt_cause,
                "rel_err": {str(k): v for k, v in self.opt_rel_err.items()},
            } if self.opt_rel_err else None,
            "learning_rates": {
                "rel_err": dict(self.rate_rel_err), "tolerance": self.rate_tol,
                "first_bad": dict(zip(("backend", "step"), self.rate_first_bad)) if self.rate_first_bad else None,
                "cause": self.rate_cause,
            } if self.rate_rel_err else None,
            "step_loss": {"abs_dev": list(self.step_loss_abs_dev),
                          "first_bad_step": self.step_loss_first_bad if self.step_loss_first_bad > 0 else None,
                          } if self.step_loss_abs_dev else None,
        }
