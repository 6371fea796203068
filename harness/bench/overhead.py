"""`harness bench`: how much the harness adds to a training step, and whether the batch stream keeps up.

For every requested backend and size, four things are measured in one process, in alternation
(runner, bare, stream, harness only; runner, bare, ...) so that drift and other load on the machine hit
all of them alike, and summarised by medians:

(a) **runner**: the backend driven by `harness.run.loop.train` (progress off, no evaluation batches) on the
    corpus's BatchStream, exactly as `harness run` drives it: batch fetch, per-step timing (host clock on the CPU,
    CUDA events without a per-step sync on CUDA), loss bookkeeping (device losses fetched every FLUSH_EVERY steps);
(b) **bare**: the same work with no harness code, the floor. For torch a hand-written loop (GPT loaded with the
    same weights, torch.optim.AdamW with the same two parameter groups and flags, clip_grad_norm_) over pre-built
    NumPy batches, each copied to the device inside the step exactly as the torch backend copies it (pinned,
    non-blocking on CUDA); for jax a bare jitted loop (harness.models.jax_gpt.train_step under one `jax.jit` with
    the state donated, dropout masks drawn inside it, each batch put on the device in the step, every step waited
    for with `block_until_ready` as the runner's host clock waits); for the other backends a loop calling
    `backend.train_step` over pre-built NumPy batches;
(c) **stream**: `BatchStream.batch` alone;
(d) **harness only**: the runner driving a backend whose step does nothing, i.e. the harness's own cost per step
    (with warm caches, so a lower bound; it is steady where (a)/(b) is noisy).

The overhead ratio is the median over rounds of runner time / bare time for the same number of steps (paired
rounds cancel slow drift; odd rounds run bare first). On the CPU it is process CPU time: every cost of either loop
is CPU work of this process, and CPU time leaves out the time other processes hold the cores, which on a shared
machine swamps a 1% difference in wall time; on CUDA, whose work is not CPU time, it is wall time. Both are
recorded (`overhead_ratio_cpu_time`, `overhead_ratio_wall`). Both loops time every step the same way (host clock,
or CUDA events with no per-step sync), so the ratio is the cost of the harness's own Python, not of timing. A
compiled model (`--compile`) is compiled once per measurement, after `torch._dynamo.reset()`, before any timed step
(`compile_s`), exactly as `harness run` does before step 0.

torch and numpy are measured in this process (one after the other, never at once). flux and jax always run in a child
process (`python -m harness --worker bench`): juliacall must be imported before torch, and JAX's float64 switch and
platform hold for the life of a process; `--isolate` does the same for every backend (then the peak RSS figure is that
configuration's own, not this process's high-water mark).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from harness import environment
from harness.backends import BackendUnavailable, create_backend, declaration
from harness.backends.base import Timed
from harness.backends.declaration import Declaration
from harness.config.fields import Config
from harness.config.presets import SIZES
from harness.core.data import BatchStream, load_corpus
from harness.core.weights import init_weights
from harness.environment import loadavg
from harness.errors import UsageError
from harness.progress import left_s
from harness.run import loop as run_loop
from harness.run.loop import Curves, LoopOptions, train
from harness.run.processes import spawn, stop
from harness.store.bench import (
    BenchCheck,
    HarnessOnly,
    LoopTiming,
    OverheadResult,
    ProbeCost,
    StreamTiming,
)
from harness.store.record import Environment, Memory
from harness.timing.stats import median_ci as _median_ci
from harness.units import fmt_duration

# timed steps per repeat by default: on the CPU short rounds pair the two loops closely in time; on CUDA a repeat is
# one flush interval of the runner (harness.run.loop.FLUSH_EVERY), so its flushes count at the rate a run has them
# and the fixed cost of starting a loop is spread as in a run, not over 5 steps
TIMED_STEPS = {"cpu": 5, "cuda": run_loop.FLUSH_EVERY}


MIN_STREAM_BATCHES = 200  # batches timed per round for (c) and steps for (d), at least


PROGRESS_EVERY_S = 2.0  # at most one progress line per this many seconds (and one at the end of each measurement)


TARGETS = {
    # harness overhead: runner / bare - 1 (process CPU time on cpu, wall time on cuda), at most this, these sizes
    "overhead": {"cpu": {"max": 0.03, "sizes": ("medium", "large")},
                 "cuda": {"max": 0.01, "sizes": SIZES}},
    # the batch stream must produce a batch at least this many times faster than a training step, every size
    "stream_x_step_min": 50.0,
}


RESULT_FIELDS = ("backend", "size", "device", "status", "config", "tokens_per_step", "steps", "warmup", "repeats",
                 "isolated", "setup_s", "compile_s", "first_step_s", "runner", "bare", "overhead_ratio", "overhead_pct",
                 "overhead_basis", "overhead_ratio_ci95", "overhead_ratio_wall", "overhead_ratio_cpu_time",
                 "stream", "harness_only", "contention_probe", "memory", "backend_info", "checks")


TIMING_FIELDS = ("step_ms_median", "step_ms_p90", "loop_ms_per_step_median", "loop_ms_per_step", "tokens_per_s")


# --- argument parsing --------------------------------------------------------------------------------------------
def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum}")
        return value

    parse.__name__ = "count"
    return parse


@dataclass
class Job:
    """One backend at one size: everything `measure` needs (JSON-able, so it can go to a child process)."""

    backend: str
    size: str
    config: dict
    data: str
    device: str
    seed: int
    steps: int
    warmup: int
    repeats: int
    options: dict = field(default_factory=dict)
    threads: int | None = None
    progress: bool = True
    isolated: bool = False


# --- the loops (Timed: harness.backends.base, where a backend's own floor returns it too) ---------------------
def runner_repeat(backend: Any, config: Config, stream: BatchStream, start: int, steps: int) -> Timed:
    """(a): `harness.run.loop.train` over steps [start, start + steps), progress off, no evaluation batches.

    The wall time is the whole `train` call (set-up, batch fetch, timing, flushes) less its evaluation time.
    """
    curves = Curves()
    c0, t0 = time.process_time(), time.perf_counter()
    outcome = train(backend, config, stream, {}, curves, start + steps, LoopOptions(start_step=start, progress=False))
    wall = time.perf_counter() - t0 - outcome.eval_s - (outcome.compile_s or 0.0)
    cpu = time.process_time() - c0
    if outcome.status != "completed":
        raise RuntimeError(f"runner-driven {backend.name} did not complete: {outcome.text}")
    return Timed(wall, list(curves.time_s), list(curves.loss), cpu, outcome.compile_s)


def backend_repeat(backend: Any, batches: Sequence[tuple[np.ndarray, np.ndarray]], lr: float,
                   sync_each_step: bool = False) -> Timed:
    """(b) for backends other than torch: `backend.train_step` over pre-built NumPy batches, nothing else.

    Steps are timed as the runner times them: with the backend's device clock (no per-step sync) where it has one,
    else on the host; `sync_each_step` synchronises after every step instead (what that costs on a GPU).
    """
    clock = None if sync_each_step else run_loop.device_clock(backend)
    losses: list[Any] = []
    times: list[Any] = []
    c_start, t_start = time.process_time(), time.perf_counter()
    for x, y in batches:
        if clock is not None:
            start = clock.mark()
            losses.append(backend.train_step(x, y, lr))
            times.append((start, clock.mark()))
            continue
        t0 = time.perf_counter()
        losses.append(backend.train_step(x, y, lr))
        backend.synchronize()
        times.append(time.perf_counter() - t0)
    values = backend.losses_to_floats(losses)
    wall = time.perf_counter() - t_start
    step_s = [t if isinstance(t, float) else clock.elapsed_s(*t) for t in times]
    return Timed(wall, step_s, values, time.process_time() - c_start)


class NullBackend:
    """A backend whose step does no work: driving it measures the runner's own cost per step.

    It returns host floats, as the CPU backends do, so the runner takes its per-step flush path (the dearer one).
    """

    name = "null"
    declaration = Declaration(name="null", dtypes=("float32",))  # no optional method: the loop's plainest path

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
        """Nothing to train."""
        return 0.0

    def losses_to_floats(self, losses: list[Any]) -> list[float]:
        """The losses as floats."""
        return [float(v) for v in losses]

    def synchronize(self) -> None:
        """Nothing to wait for."""


def stream_repeat(stream: BatchStream, start: int, n: int) -> list[float]:
    """(c): seconds per `stream.batch(k)` for k in [start, start + n)."""
    times = []
    for k in range(start, start + n):
        t0 = time.perf_counter()
        stream.batch(k)
        times.append(time.perf_counter() - t0)
    return times


# --- one measurement ---------------------------------------------------------------------------------------------
def _current_rss() -> int | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _timing(repeats: list[Timed], steps: int, tokens_per_step: int) -> LoopTiming:
    """Per-step median and p90 over every timed step, and the loop's wall time per step (median over repeats)."""
    pooled = np.asarray([t for r in repeats for t in r.step_s], dtype=np.float64)
    loop = [r.wall_s / steps for r in repeats]
    loop_median = float(np.median(loop))
    return LoopTiming(step_ms_median=float(np.median(pooled) * 1e3),
                      step_ms_p90=float(np.percentile(pooled, 90) * 1e3), loop_ms_per_step_median=loop_median * 1e3,
                      loop_ms_per_step=[v * 1e3 for v in loop],
                      tokens_per_s=tokens_per_step / loop_median if loop_median > 0 else None)


def _pace(elapsed_s: float, done: int, total: int) -> str:
    """"0:12 elapsed, about 0:48 left" (nothing left once `done` is `total`)."""
    left = left_s(elapsed_s, done, total)
    return f"{fmt_duration(elapsed_s)} elapsed" + (f", about {fmt_duration(left)} left" if done < total and left
                                                   is not None else "")


def _say(job: Job, text: str) -> None:
    if job.progress:
        print(f"bench {job.backend}/{job.size} {job.device}: {text}", file=sys.stderr, flush=True)


def reset_compiler() -> None:
    """Forget every torch.compile graph and guard of earlier measurements in this process (torch._dynamo.reset()).

    Without it, the second size compiled in one process finds the first size's graph, fails its shape guards and
    recompiles with dynamic shapes ("automatic dynamic"), a graph `harness run` (one size per process) never uses.
    """
    import torch._dynamo

    torch._dynamo.reset()


def measure(job: Job) -> OverheadResult:
    """Measure (a) runner, (b) bare, (c) stream and (d) harness only for one backend and size, in this process."""
    gc.collect()  # the previous measurement's models go now, so their cached device blocks can be released
    if job.options.get("compile"):
        reset_compiler()  # each compiled measurement starts as a fresh process would
    # (--threads: the measurement runs in a process of its own, capped through its environment: measure_isolated)
    return _measure(job)


def _measure(job: Job) -> OverheadResult:
    """The four measurements of `measure`, one job each: set up (a), build the floor (b), run the paired rounds,
    summarise."""
    runner = _set_up(job)
    bare_repeat, bare_info = _bare_loop(job, runner)
    rounds = _rounds(job, runner, bare_repeat)
    return _result(job, runner, rounds, bare_info)


@dataclass
class _Runner:
    """(a) set up and warmed up, with what the later measurements share: the config, corpus, weights and stream."""

    config: Config
    corpus: Any
    weights: dict[str, np.ndarray]
    stream: BatchStream
    backend: Any
    setup_s: float
    compile_s: float | None
    first_step_s: float
    first_round: Timed | None  # --warmup 0: the first timed runner round, run before the bare model existed
    memory: Memory


def _set_up(job: Job) -> _Runner:
    """(a): set up, compile (if asked) and warm up first; read the memory after steps have run and before the bare
    loop's model exists."""
    config = Config(**job.config)
    corpus = load_corpus(job.data)
    weights = init_weights(config, corpus.vocab_size, job.seed)
    stream = BatchStream(corpus.train, config.block_size, config.batch_size, job.seed, config.scheme)
    rss_before = _current_rss()
    backend = create_backend(job.backend, **job.options)
    t0 = time.perf_counter()
    backend.setup(config, weights, corpus.vocab_size, job.device, job.seed)
    setup_s = time.perf_counter() - t0
    # the same one-off warm-up `harness run` does before step 0 (torch --compile: the compile), timed apart
    compile_s = run_loop.warm_up(backend, stream, 0)
    first_round = None
    if job.warmup:
        first_step_s = runner_repeat(backend, config, stream, 0, job.warmup).step_s[0]
    else:  # no warm-up: the first timed runner round runs now, so that memory is read after steps, not before any
        first_round = runner_repeat(backend, config, stream, 0, job.steps)
        first_step_s = first_round.step_s[0]
    memory = Memory.from_dict(backend.memory())
    rss_after = _current_rss()
    if memory.kind == "rss":
        memory.extra["scope"] = "this configuration's process" if job.isolated else \
            "process-wide high-water mark so far (in-process measurement; --isolate gives per-configuration figures)"
    if rss_before is not None and rss_after is not None:
        memory.extra["rss_growth_bytes"] = rss_after - rss_before
    return _Runner(config, corpus, weights, stream, backend, setup_s, compile_s, first_step_s, first_round, memory)


def _bare_loop(job: Job, r: _Runner) -> tuple[Callable[..., Timed], Callable[[], dict]]:
    """(b): the floor, over pre-built NumPy batches (the first `steps` of the stream), copied to the device per step,
    warmed up as the runner was; returns one repeat of it (`sync_each_step`: what a per-step sync would cost) and
    what it adds to the backend's description. The floor is the backend's own where its declaration names one
    (`bare_loop`: torch's hand-written loop, jax's bare jitted step), else `backend_repeat`."""
    batches = [r.stream.batch(k) for k in range(job.steps)]
    decl = declaration(job.backend)
    if not decl.bare_loop:
        lr = r.config.learning_rate
        if job.warmup:
            backend_repeat(r.backend, list(itertools.islice(itertools.cycle(batches), job.warmup)), lr)
        return (lambda sync_each_step=False: backend_repeat(r.backend, batches, lr, sync_each_step)), dict
    module, _, cls = decl.bare_loop.partition(":")
    options = {**job.options, "dtype": job.options.get("dtype") or decl.default_dtype}
    bare = getattr(importlib.import_module(module), cls)(r.config, r.weights, r.corpus.vocab_size, job.device,
                                                         job.seed, **options)
    warm_batches = [r.stream.batch(k) for k in range(job.warmup)]
    if bare.compiles and not warm_batches:
        warm_batches = batches[:1]  # never let a timed bare round include the bare model's compile or capture
    if warm_batches:
        bare.repeat(warm_batches)
    return (lambda sync_each_step=False: bare.repeat(batches, sync_each_step)), bare.info


@dataclass
class _Rounds:
    """What the paired rounds measured: (a), (b), (b) with a sync per step (CUDA), (c) per batch, (d) per step."""

    runner: list[Timed] = field(default_factory=list)
    bare: list[Timed] = field(default_factory=list)
    bare_sync: list[Timed] = field(default_factory=list)
    stream_s: list[float] = field(default_factory=list)
    harness_only_s: list[float] = field(default_factory=list)
    n_stream: int = 0


def _rounds(job: Job, r: _Runner, bare_repeat: Callable[..., Timed]) -> _Rounds:
    """`job.repeats` rounds of runner and bare (A B, then B A), each followed by (c) stream and (d) harness only."""
    c = r.config
    out = _Rounds(n_stream=max(job.steps, MIN_STREAM_BATCHES))
    stream_c = BatchStream(r.corpus.train, c.block_size, c.batch_size, job.seed, c.scheme)
    null, stream_n = NullBackend(), BatchStream(r.corpus.train, c.block_size, c.batch_size, job.seed, c.scheme)
    first_round, n = r.first_round, out.n_stream
    _say(job, f"{job.repeats} rounds of {job.steps} steps (runner, bare, stream, harness only)")
    last_said = started = time.monotonic()
    for k in range(job.repeats):
        if k == 0 and first_round is not None:  # run before the bare model existed (--warmup 0)
            a, first_round = first_round, None
            b = bare_repeat()
        elif k % 2 == 0:  # A B, then B A: whatever comes first in a round is not always the same loop
            a = runner_repeat(r.backend, c, r.stream, job.warmup + k * job.steps, job.steps)
            b = bare_repeat()
        else:
            b = bare_repeat()
            a = runner_repeat(r.backend, c, r.stream, job.warmup + k * job.steps, job.steps)
        out.runner.append(a)
        out.bare.append(b)
        if job.device == "cuda":  # what a per-step synchronisation would cost on an asynchronous device
            out.bare_sync.append(bare_repeat(sync_each_step=True))
        batch_s = stream_repeat(stream_c, k * n, n)
        out.stream_s.extend(batch_s)
        out.harness_only_s.append(runner_repeat(null, c, stream_n, k * n, n).wall_s / n)
        if time.monotonic() - last_said >= PROGRESS_EVERY_S or k + 1 == job.repeats:
            last_said = time.monotonic()
            _say(job, f"round {k + 1}/{job.repeats} ({_pace(last_said - started, k + 1, job.repeats)}): runner "
                      f"{a.wall_s / job.steps * 1e3:.3f} ms/step, bare {b.wall_s / job.steps * 1e3:.3f} ms/step, "
                      f"stream {np.median(batch_s) * 1e3:.4f} ms/batch")
    return out


def _result(job: Job, r: _Runner, rounds: _Rounds, bare_info: Callable[[], dict] = dict) -> OverheadResult:
    """The result of one measurement: per-loop timings, the overhead ratios with their interval, the stream, the
    harness's own cost, the contention probe's cost, memory, and the checks against TARGETS."""
    tokens = r.config.batch_size * r.config.block_size
    runs_a, runs_b = rounds.runner, rounds.bare
    runner_t, bare_t = _timing(runs_a, job.steps, tokens), _timing(runs_b, job.steps, tokens)
    wall_ratios = [a.wall_s / b.wall_s for a, b in zip(runs_a, runs_b, strict=True)]
    cpu_ratios = [a.cpu_s / b.cpu_s for a, b in zip(runs_a, runs_b, strict=True)]
    # On the CPU every cost of either loop is CPU work of this process, and CPU time does not count the time other
    # processes hold the cores, so it is the steadier basis; on CUDA the device's time is not CPU time: wall.
    basis = "cpu_time" if job.device == "cpu" else "wall"
    ratios = cpu_ratios if basis == "cpu_time" else wall_ratios
    ratio = float(np.median(ratios))
    batch_s = float(np.median(rounds.stream_s))
    step_s = bare_t.step_ms_median / 1e3
    for t, runs in ((runner_t, runs_a), (bare_t, runs_b)):  # loop time not inside a timed step, per step
        t.outside_step_us_median = float(np.median([(x.wall_s - sum(x.step_s)) / job.steps for x in runs]) * 1e6)
    # a third estimate, from per-step medians (which ignore a preempted step) plus the time between steps
    robust = ((runner_t.step_ms_median + runner_t.outside_step_us_median / 1e3)
              / (bare_t.step_ms_median + bare_t.outside_step_us_median / 1e3))
    null_s = float(np.median(rounds.harness_only_s))
    result = OverheadResult(
        backend=job.backend, size=job.size, device=job.device, config=job.config, tokens_per_step=tokens,
        steps=job.steps, warmup=job.warmup, repeats=job.repeats, isolated=job.isolated, options=job.options,
        setup_s=r.setup_s, compile_s=r.compile_s, first_step_s=r.first_step_s,
        step_timing="cuda events, no per-step sync" if run_loop.device_clock(r.backend) is not None
        else "host clock",
        runner=runner_t, bare=bare_t, overhead_ratio=ratio, overhead_pct=(ratio - 1) * 100, overhead_basis=basis,
        overhead_ratio_ci95=_median_ci(ratios), overhead_ratios=ratios,
        overhead_ratio_wall=float(np.median(wall_ratios)), overhead_ratios_wall=wall_ratios,
        overhead_ratio_cpu_time=float(np.median(cpu_ratios)),
        overhead_ratio_of_medians=runner_t.loop_ms_per_step_median / bare_t.loop_ms_per_step_median,
        overhead_ratio_step_medians=robust,
        stream=StreamTiming(batches_timed=len(rounds.stream_s), ms_per_batch_median=batch_s * 1e3,
                            ms_per_batch_p90=float(np.percentile(rounds.stream_s, 90) * 1e3),
                            batches_per_s=1.0 / batch_s if batch_s > 0 else None,
                            x_step=step_s / batch_s if batch_s > 0 else None),
        contention_probe=contention_probe_cost(step_s, job.device),
        harness_only=HarnessOnly(us_per_step_median=null_s * 1e6, pct_of_step=null_s / step_s * 100,
                                 steps_timed=rounds.n_stream * job.repeats),
        memory=r.memory, backend_info=r.backend.describe())
    if rounds.bare_sync:
        result.bare_sync_each_step = _timing(rounds.bare_sync, job.steps, tokens)
    result.backend_info.update(bare_info())  # torch on CUDA: the attention kernels it may pick
    result.checks = checks(result)
    return result


def contention_probe_cost(step_s: float, device: str = "cpu", snapshots: int = 200,
                          ticks: int = 20000) -> ProbeCost:
    """What the contention evidence (harness.timing.contention) costs a training loop with steps of `step_s` seconds.

    Per step the loop only calls `Sampler.tick` (a clock read and a comparison); the machine's state is read
    (`Probe.snapshot`: /proc/self/task/*/schedstat, /proc/stat, loadavg, PSI, NVML on CUDA) once at each chunk
    boundary, every CHUNK_S seconds (the reading that ends a chunk starts the next). Both are timed here, as medians
    of repeated calls, and turned into microseconds and percent of a step; `per_step_snapshot_pct` is what reading
    the state at every step would cost instead."""
    from harness.timing import contention

    probe, _ = contention.default_probe(device)
    times = []
    for _ in range(snapshots):
        t0 = time.perf_counter()
        probe.snapshot()
        times.append(time.perf_counter() - t0)
    snapshot_s = float(np.median(times))
    sampler = contention.Sampler(probe, chunk_s=1e9)
    sampler.open(0)
    t0 = time.perf_counter()
    for k in range(ticks):
        sampler.tick(k)
    tick_s = (time.perf_counter() - t0) / ticks
    per_step_s = tick_s + snapshot_s * step_s / contention.CHUNK_S
    return ProbeCost(snapshot_us=snapshot_s * 1e6, tick_us=tick_s * 1e6, chunk_s=contention.CHUNK_S,
                     per_step_us=per_step_s * 1e6, pct_of_step=per_step_s / step_s * 100,
                     per_step_snapshot_pct=snapshot_s / step_s * 100)


def checks(result: OverheadResult) -> list[BenchCheck]:
    """The targets that apply to this result, each with its measured value and whether it was met."""
    out = []
    target = TARGETS["overhead"][result.device]
    if result.size in target["sizes"] and result.overhead_ratio is not None:
        value = result.overhead_ratio - 1
        ci = [c - 1 for c in result.overhead_ratio_ci95 or []]
        out.append(BenchCheck(name="overhead", value=value, max=target["max"], ok=bool(value <= target["max"]),
                              ci95=ci))
    x_step = result.stream.x_step if result.stream is not None else None
    out.append(BenchCheck(name="stream_x_step", value=x_step, min=TARGETS["stream_x_step_min"],
                          ok=bool(x_step is not None and x_step >= TARGETS["stream_x_step_min"])))
    return out


def misses(results: list[OverheadResult]) -> list[str]:
    """One line per missed target (or failed measurement)."""
    lines = []
    for r in results:
        where = f"{r.backend}/{r.size} on {r.device}"
        if r.status != "completed":
            lines.append(f"{where}: {r.status_text}")
            continue
        for c in r.checks:
            if c.ok:
                continue
            if c.name == "overhead":
                ci = c.ci95
                noise = f" (95% interval {ci[0] * 100:+.1f}% to {ci[1] * 100:+.1f}%)" if ci else ""
                lines.append(f"{where}: harness overhead {c.value * 100:+.1f}%{noise} exceeds "
                             f"{c.max * 100:.0f}%")
            else:
                lines.append(f"{where}: batch stream only {c.value:.0f}x faster than a step (target "
                             f"{c.min:.0f}x)")
    return lines


# --- child processes ---------------------------------------------------------------------------------------------
def measure_isolated(job: Job) -> OverheadResult:
    """Run `measure(job)` in a fresh interpreter (`python -m harness --worker bench JOB_JSON`, started as every child
    of the harness is: harness.run.processes.spawn), its CPU threads capped to `job.threads` as every backend
    process's are (harness.run.processes.thread_env); its progress goes to our stderr."""
    proc = spawn("bench", [json.dumps(asdict(job))], job.threads, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                 text=True)
    try:
        stdout, _ = proc.communicate()
    except BaseException:  # Ctrl-C: the child goes with us, with anything it started (harness.run.processes.stop)
        stop([proc], signal.SIGKILL, grace_s=0)
        raise
    lines = stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return OverheadResult.from_dict(json.loads(lines[-1]))
    return OverheadResult.failed(job.backend, job.size, job.device, f"child process exited with status "
                                 f"{proc.returncode} (its message is above)")


def child_main(argv: list[str]) -> int:
    """The child of `measure_isolated`: a Job as JSON in `argv`, the result as one JSON line on stdout."""
    if len(argv) != 1:
        print("usage: python -m harness --worker bench JOB_JSON", file=sys.stderr)
        return 2
    job = Job(**json.loads(argv[0]))
    try:
        result = measure(job)
    except (UsageError, BackendUnavailable) as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict()))
    return 0


# --- environment, table, command ---------------------------------------------------------------------------------
def bench_environment(device: str, results: list[OverheadResult]) -> Environment:
    """environment.capture() plus the torch version and the device's name (from the backends' own description)."""
    env = Environment.from_dict(environment.capture())
    try:
        from importlib.metadata import version

        env.extra["torch"] = version("torch")
    except Exception:  # torch not installed: nothing to record
        env.extra["torch"] = None
    env.extra["device"] = device
    described = [r.backend_info for r in results if r.backend_info]  # each backend's own describe()
    env.extra["device_name"] = next((d["device_name"] for d in described if d.get("device_name")), None) \
        or environment.cpu_model()
    for d in described:
        if d.get("framework") == "pytorch":
            env.extra["torch_threads"] = d.get("threads")
            env.extra.update({k: d[k] for k in ("cuda", "cudnn") if k in d})
            break
    return env


def _loadavg() -> float | None:
    return (loadavg() or (None,))[0]


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"
