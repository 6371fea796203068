"""The records of the benchmarks: `harness bench overhead` (`OverheadRecord`, `<out>/bench/bench-*.json`: what the
harness adds to a training step, per backend and size) and `harness bench noise` (`NoiseRecord`,
`<out>/bench/noise-*/noise.json`: whether a speed verdict survives other work on the machine). harness.bench
measures them; docs/benchmarks.md reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.files import read_json
from harness.store.record import Environment, Memory, Status, failure_of
from harness.store.stored import Stored, read_document, typed
from harness.store.writes import atomic_write_json

SCHEMA = "nanogpt-parity/bench"
SCHEMA_VERSION = 1
MAX_BENCH_BYTES = 64 * 2**20  # a few KB per backend and size; far more than any bench writes


# --- harness bench overhead -------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class LoopTiming(Stored):
    """One loop's timing over the paired rounds: per-step median and p90 over every timed step, the loop's wall
    time per step (per round and its median), tokens/s, and the loop's time outside the timed steps."""

    OMIT_NONE = ("outside_step_us_median",)

    step_ms_median: float
    step_ms_p90: float | None = None
    loop_ms_per_step_median: float | None = None
    loop_ms_per_step: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    outside_step_us_median: float | None = None


@dataclass(kw_only=True)
class StreamTiming(Stored):
    """The batch stream alone: ms per batch, batches/s, and how many times faster than a bare step (`x_step`)."""

    batches_timed: int | None = None
    ms_per_batch_median: float | None = None
    ms_per_batch_p90: float | None = None
    batches_per_s: float | None = None
    x_step: float | None = None


@dataclass(kw_only=True)
class HarnessOnly(Stored):
    """The runner driving a backend whose step does nothing: the harness's own cost per step."""

    us_per_step_median: float
    pct_of_step: float | None = None
    steps_timed: int | None = None


@dataclass(kw_only=True)
class ProbeCost(Stored):
    """What the contention evidence costs a loop (harness.bench.overhead.contention_probe_cost)."""

    snapshot_us: float
    tick_us: float
    chunk_s: float
    per_step_us: float
    pct_of_step: float
    per_step_snapshot_pct: float


@dataclass(kw_only=True)
class BenchCheck(Stored):
    """One target (harness.bench.overhead.TARGETS) against what was measured: at most `max` or at least `min`."""

    OMIT_NONE = ("max", "min", "ci95")

    name: str
    value: float | None = None
    max: float | None = None
    min: float | None = None
    ok: bool = False
    ci95: list[float] | None = None


@dataclass(kw_only=True)
class OverheadResult(Stored):
    """One backend at one size: its loops' timings, the overhead ratios with their interval, the stream, the
    harness's own cost, the contention probe's cost, memory and the checks. `status` "completed", or failed for
    `failure` (stored as "failed: <reason>", as a run record's)."""

    OMIT_NONE = ("config", "tokens_per_step", "steps", "warmup", "repeats", "isolated", "options", "setup_s",
                 "first_step_s", "step_timing", "runner", "bare", "overhead_ratio", "overhead_pct", "overhead_basis",
                 "overhead_ratio_ci95", "overhead_ratios", "overhead_ratio_wall", "overhead_ratios_wall",
                 "overhead_ratio_cpu_time", "overhead_ratio_of_medians", "overhead_ratio_step_medians", "stream",
                 "contention_probe", "harness_only", "memory", "backend_info", "bare_sync_each_step", "failure")

    backend: str
    size: str
    device: str
    status: Status = Status.COMPLETED
    config: dict[str, Any] | None = None
    tokens_per_step: int | None = None
    steps: int | None = None
    warmup: int | None = None
    repeats: int | None = None
    isolated: bool | None = None
    options: dict[str, Any] | None = None
    setup_s: float | None = None
    compile_s: float | None = None
    first_step_s: float | None = None
    step_timing: str | None = None
    runner: LoopTiming | None = None
    bare: LoopTiming | None = None
    overhead_ratio: float | None = None
    overhead_pct: float | None = None
    overhead_basis: str | None = None
    overhead_ratio_ci95: list[float] | None = None
    overhead_ratios: list[float] | None = None
    overhead_ratio_wall: float | None = None
    overhead_ratios_wall: list[float] | None = None
    overhead_ratio_cpu_time: float | None = None
    overhead_ratio_of_medians: float | None = None
    overhead_ratio_step_medians: float | None = None
    stream: StreamTiming | None = None
    contention_probe: ProbeCost | None = None
    harness_only: HarnessOnly | None = None
    memory: Memory | None = None
    backend_info: dict[str, Any] | None = None  # the backend's own describe(): a free-form map
    bare_sync_each_step: LoopTiming | None = None
    checks: list[BenchCheck] = field(default_factory=list)
    failure: str | None = None

    @property
    def status_text(self) -> str:
        return self.status.stored(self.failure)

    @classmethod
    def failed(cls, backend: str, size: str, device: str, reason: str) -> OverheadResult:
        """The result of a measurement that did not complete, for `reason`."""
        return cls(backend=backend, size=size, device=device, status=Status.FAILED, failure=reason)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> OverheadResult:
        stored = str(doc.get("status", Status.COMPLETED.value))
        doc = dict(doc, status=Status.of(stored))
        if doc.get("failure") is None and failure_of(stored) is not None:
            doc["failure"] = failure_of(stored)
        return super().from_dict(doc)

    def to_dict(self) -> dict[str, Any]:
        return dict(super().to_dict(), status=self.status_text)


@dataclass(kw_only=True)
class OverheadOptions(Stored):
    """What `harness bench overhead` was asked: backends, sizes, device (per backend in `devices` where one was
    put elsewhere), timed steps, warm-up, repeats, seed, data, threads, isolation, --check."""

    OMIT_NONE = ("devices",)

    backends: list[str]
    sizes: list[str]
    device: str
    steps: int | list[int]
    warmup: int
    repeats: int
    seed: int
    data: str | None = None
    threads: int | None = None
    isolate: bool = False
    check: bool = False
    devices: dict[str, str] | None = None


@dataclass(kw_only=True)
class OverheadRecord(Stored):
    """One `harness bench overhead`: its options, the targets, the machine, a result per backend and size, and
    the targets missed."""

    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    started_at: str | None = None
    finished_at: str | None = None
    options: OverheadOptions
    targets: dict[str, Any] = field(default_factory=dict)
    environment: Environment = field(default_factory=Environment)  # with the torch version and the device
    results: list[OverheadResult] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> OverheadRecord:
        fix = "run `harness bench overhead` again"
        doc = read_document(Path(path), SCHEMA, "bench record", fix, MAX_BENCH_BYTES, SCHEMA_VERSION)
        return typed(cls, doc, path, fix)

    def dump(self, path: Path) -> None:
        atomic_write_json(path, self.to_dict())


# --- harness bench noise ----------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class DuringHogs(Stored):
    """A training chunk or paired burst that ran mostly during the hogs: its median step, and whether the contention
    rule judged it disturbed."""

    kind: str
    backend: str
    median_s: float
    judged: bool


@dataclass(kw_only=True)
class NoiseCell(Stored):
    """One cell of a noise sweep leg: its contention and median step."""

    backend: str
    seed: int
    contended_fraction: float | None = None
    mostly_disturbed: bool = False
    step_median_s: float | None = None


@dataclass(kw_only=True)
class PairedLeg(Stored):
    """A sweep leg's paired-timing ratio (first / second backend) with its interval and the rounds behind it."""

    time_ratio: float
    lo: float | None = None
    hi: float | None = None
    usable: bool = False
    rounds: int = 0
    disturbed_rounds: int = 0
    text: str = ""


@dataclass(kw_only=True)
class TrainingLeg(Stored):
    """A sweep leg's ratio of the separate training runs' median steps (information, no verdict)."""

    time_ratio: float
    lo: float | None = None
    hi: float | None = None
    text: str = ""


@dataclass(kw_only=True)
class SweepLeg(Stored):
    """A sweep leg of the noise benchmark: its first comparison, its cells and what ran during the hogs; `error`
    when it could not be read."""

    OMIT_NONE = ("sweep_id", "comparison", "a", "b", "verdict", "level", "cells", "disturbed_cells",
                 "report_names_them", "during_hogs", "report", "error")

    sweep_id: str | None = None
    comparison: str | None = None
    a: str | None = None
    b: str | None = None
    verdict: str | None = None
    level: str | None = None
    paired: PairedLeg | None = None
    training: TrainingLeg | None = None
    cells: list[NoiseCell] | None = None
    disturbed_cells: list[NoiseCell] | None = None
    report_names_them: bool | None = None
    during_hogs: list[DuringHogs] | None = None
    report: str | None = None
    error: str | None = None


@dataclass(kw_only=True)
class RunLeg(Stored):
    """A run leg of the noise benchmark: its median step, where its figures come from, its contention and what ran
    during the hogs; `error` when it could not be read."""

    OMIT_NONE = ("run_id", "backend", "status", "mostly_disturbed", "during_hogs", "error")

    run_id: str | None = None
    backend: str | None = None
    status: str | None = None
    step_median_s: float | None = None
    steady_steps: int | None = None
    figures_from: str | None = None
    disturbed_steps: int | None = None
    contended_fraction: float | None = None
    mostly_disturbed: bool | None = None
    reasons: dict[str, int] | None = None
    during_hogs: list[DuringHogs] | None = None
    error: str | None = None


@dataclass(kw_only=True)
class LegTiming(Stored):
    """How long a leg's two invocations took, when the hogs ran, and their exit statuses."""

    quiet_s: float
    disturbed_s: float
    hogs_window_s: list[float] = field(default_factory=list)
    hogs_epochs: list[float] = field(default_factory=list)
    exit_status: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class NoiseCheck(Stored):
    """One check of docs/benchmarks.md: what it asks, the value, whether it passed."""

    check: str
    value: Any = None
    ok: bool = False


@dataclass(kw_only=True)
class NoiseOptions(Stored):
    size: str
    backends: list[str]
    seeds: int
    steps: int
    run_steps: int
    hogs: int
    cores: int
    threads: int | None = None


@dataclass(kw_only=True)
class NoiseRecord(Stored):
    """One `harness bench noise`: its options, its four legs, their timing and the checks. (noise.json carries no
    schema name: it is read back by nothing but this type.)"""

    options: NoiseOptions
    started_at: str | None = None
    dir: str | None = None
    sweep_quiet: SweepLeg = field(default_factory=SweepLeg)
    sweep_disturbed: SweepLeg = field(default_factory=SweepLeg)
    run_quiet: RunLeg = field(default_factory=RunLeg)
    run_disturbed: RunLeg = field(default_factory=RunLeg)
    timing: dict[str, LegTiming] = field(default_factory=dict)
    checks: list[NoiseCheck] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> NoiseRecord:
        fix = "run `harness bench noise` again"
        return typed(cls, read_json(path, "noise record", fix, MAX_BENCH_BYTES), path, fix)

    def dump(self, path: Path) -> None:
        atomic_write_json(path, self.to_dict())
