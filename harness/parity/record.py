"""A `harness parity` run: its plan, the exit statuses that go with its verdicts, and parity.json.

The run is two ordinary worker runs (harness.run) in parity mode; this module says what parity adds to their plan
(`ParityPlan`: each backend's dtype, the tolerances in effect, the optimizer steps compared), builds the record
`<out>/runs/<run_id>/parity.json` (schema `SCHEMA`, docs/parity.md), reads the two workers' records and probes and
hands them to `harness.parity.compare.compare`. The command line (harness.cli.parity) drives it. The record's type is
harness.store.parity.ParityRecord.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from harness.parity.compare import BLIND_SPOTS, compare
from harness.parity.result import ParityResult
from harness.parity.tolerances import Tolerances
from harness.store import DataInfo, RunPaths, RunRecord, compare_fingerprints
from harness.store.parity import ParityCheck, ParityRecord
from harness.units import utc_now

if TYPE_CHECKING:
    from harness.run.plan import Plan

DEFAULT_STEPS = 50


DEFAULT_OPT_STEPS: int | None = None  # None: every training step is re-synchronised and compared, within PROBE_BUDGET


# the optimizer states a parity worker keeps by default (harness.run.plan.probe_bytes): every step of small, medium and
# large at the default 50 steps; the first 27 of nanogpt-cpu's (800,000 parameters: 37 MiB a step)
PROBE_BUDGET = 2**30


# Exit statuses of `harness parity`: a script can tell a numerical disagreement from a backend that never got to
# be compared. Printed by `harness parity --help`.
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_CRASH, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


@dataclass
class ParityPlan:
    """One `harness parity`: the plan of its two workers (harness.run.plan.Plan, with `parity` set to the optimizer
    steps compared and the reference backend), the training steps and dropout asked for, each backend's dtype, the
    precision pair and the tolerances in effect (and where each came from). `budgeted`: the optimizer steps compared
    were not asked for, PROBE_BUDGET chose them."""

    plan: Plan
    steps: int
    dropout: float
    dtypes: dict[str, str]
    pair: str
    tolerances: Tolerances
    tol_source: dict[str, str]
    budgeted: bool

    @property
    def backends(self) -> list[str]:
        return self.plan.backends

    @property
    def reference(self) -> str:
        """The backend whose states the other re-synchronises its optimizer steps from (it runs first)."""
        return self.plan.parity.reference

    @property
    def other(self) -> str:
        return next(n for n in self.backends if n != self.reference)

    @property
    def opt_steps(self) -> int:
        return self.plan.parity.opt_steps


def optimizer_steps(config: Any, vocab_size: int, steps: int, asked: int | None) -> int:
    """The training steps whose optimizer step is re-synchronised and compared: the first `asked` (None: as many as
    PROBE_BUDGET holds, at least one), never more than `steps`."""
    from harness.run import plan as run_plan

    return min(steps, asked if asked is not None else max(1, PROBE_BUDGET // run_plan.probe_bytes(
        config, vocab_size, 1)))


def new_record(pp: ParityPlan, paths: RunPaths, codes: dict[str, int]) -> ParityRecord:
    """parity.json before anything is compared: what was run, with which tolerances, and how each worker exited."""
    plan, config = pp.plan, pp.plan.config
    return ParityRecord(
        run_id=paths.run_id, created_at=utc_now(), config=config, config_name=config.name, steps=pp.steps,
        seed=plan.seed, dropout=pp.dropout, opt_steps=pp.opt_steps, opt_reference=pp.reference,
        threads=plan.threads, device=plan.device, devices=plan.devices, backends=pp.backends, dtypes=pp.dtypes,
        precision_pair=pp.pair, tolerances=asdict(pp.tolerances), tolerance_source=pp.tol_source,
        data=DataInfo(path=plan.corpus.path, sha256=plan.corpus.sha256), worker_exit_codes=codes,
        files={n: {"record": paths.record(n).name, "probe": paths.probe(n).name} for n in pp.backends})


def crash(pp: ParityPlan, codes: dict[str, int]) -> tuple[str, int] | None:
    """Why nothing can be compared after the workers ran (a worker failed or was never started) and the exit status
    that says so (interrupted, a backend that refused its input, else a crash); None when both completed."""
    broken = {n: c for n, c in codes.items() if c != 0}
    if not broken and len(codes) == len(pp.backends):
        return None
    reason = ", ".join(f"{n} exited {c}" for n, c in broken.items())
    reason += "".join(f", {n} not started (it needs {pp.reference}'s results)" for n in pp.backends if n not in codes)
    status = (EXIT_INTERRUPTED if EXIT_INTERRUPTED in codes.values() else EXIT_USAGE if EXIT_USAGE in codes.values()
              else EXIT_CRASH)
    return reason, status


def mark_error(record: ParityRecord, reason: str) -> None:
    """Turn `record` into the record of a run that compared nothing (verdict "error")."""
    record.verdict, record.failures, record.results = "error", [f"ERROR: {reason}; nothing compared"], None


def load_probe(pp: ParityPlan, paths: RunPaths, backend: str) -> dict[str, np.ndarray]:
    """Worker `backend`'s `<backend>.probe.npz` of run `paths`, every array read and checked against the run
    (harness.run.probe.read); ProbeUnreadable ("backend X's probe is unreadable: ...") otherwise."""
    from harness.run.probe import read

    return read(paths.probe(backend), backend, pp.plan.config, pp.plan.corpus.vocab_size, pp.steps, pp.opt_steps)


def unreadable_probe(pp: ParityPlan, paths: RunPaths, codes: dict[str, int]) -> str | None:
    """Why the probe of a worker that completed cannot be read (the cause when the worker after it failed), None
    when each such probe reads."""
    from harness.run.probe import ProbeUnreadable

    for name in (n for n in pp.backends if codes.get(n) == 0):
        try:
            load_probe(pp, paths, name)
        except ProbeUnreadable as exc:
            return str(exc)
    return None


def final_val(rec: RunRecord) -> float | None:
    """A worker record's last validation loss, None without an evaluation."""
    last = rec.curves.last_eval
    return float(last.val_loss) if last is not None else None


def step_masks(config: Any, seed: int) -> Callable[[int], dict[str, np.ndarray]] | None:
    """The harness's dropout masks of step k of a parity run (what both workers were handed), None at dropout 0."""
    from harness.core.masks import dropout_masks

    return (lambda step: dropout_masks(config, seed, step)) if config.dropout > 0 else None


def compare_workers(pp: ParityPlan, workers: dict[str, RunRecord], paths: RunPaths) -> ParityResult:
    """`compare` of the two workers' probes (in the run's directory) and training losses, in the order of
    `pp.backends`, with the run's config; the workers' data and weight fingerprints must agree too."""
    a, b = pp.backends
    ra, rb = workers[a], workers[b]
    va, vb = final_val(ra), final_val(rb)
    config, seed = pp.plan.config, pp.plan.seed
    result = compare(load_probe(pp, paths, a), load_probe(pp, paths, b), ra.curves.loss, rb.curves.loss,
                     pp.tolerances,
                     val_losses=(va, vb) if va is not None and vb is not None else None,
                     backends=(a, b), config=config, masks=step_masks(config, seed))
    for problem in compare_fingerprints([ra, rb]):
        result.failures.append(f"FAIL: {problem}")
    return result


def finish_record(record: ParityRecord, pp: ParityPlan, result: ParityResult, workers: dict[str, RunRecord]) -> None:
    """Add the comparison to `record`: the verdict, the FAIL lines, the results and summary rows, what each depth
    cannot see, and what each backend said about itself."""
    record.verdict = "pass" if result.passed else "fail"
    record.failures, record.results = list(result.failures), result.to_dict()
    record.checks = [ParityCheck.from_dict(row) for row in result.rows()]
    record.dtypes, record.blind_spots = pp.dtypes, dict(BLIND_SPOTS)
    record.backend_info = {n: workers[n].backend_info for n in pp.backends}
