"""`harness bench parts`: where the time of a training step goes, part by part, side by side in every backend.

Each backend runs in a timed process of its own (harness.bench.parts_process: its part runner, set up on the
step-0 activations of the first batch, warmed up, a JIT compiled and calibrated), all of them alive at once. The
coordinator here then drives them in **rounds**, as the paired timing does (harness.run.paired_timing): each round
gives each process one burst, the order alternating between rounds. A burst of about `BURST_S` seconds times every
item (each part's forward and backward, the optimizer, the whole step) in passes: every item in the order of a
step, each timed apart, the fastest of the passes (harness.backends.parts.PartRunner), between two readings of
the machine (its contention evidence). The others wait on a pipe, using no CPU. Rounds go on until `rounds` are
undisturbed (harness.timing.contention's rule; any burst disturbed makes its round disturbed),
`MAX_ROUNDS_FACTOR` times as many were made, or, as in the paired timing, so many were disturbed that no verdict
can come any more (status "incomplete", `stopped` saying why). The record (harness.store.parts.PartsRecord) is
written as the rounds come in; harness.bench.parts_analysis reads it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.bench.parts_process import PartsJob
from harness.config.fields import Config
from harness.core.costs import flops_per_token, part_flops
from harness.core.parts import items, part_names
from harness.environment import capture, loadavg, usable_cores
from harness.progress import Line, expected_rounds
from harness.run.paired_timing import (
    BURST_S,  # a burst's target length: here passes of every item for about this long (at least 3)
    GAP_S,
    PERSIST_EVERY_S,
    REPLY_TIMEOUT_S,
    TimedProcess,
    signals_deferred,
    stop_children,
)
from harness.run.processes import spawn
from harness.store.parts import (
    PartsBurst,
    PartsContender,
    PartsEnvironment,
    PartsOptions,
    PartsPlan,
    PartsReady,
    PartsRecord,
    PartsRound,
    new_id,
)
from harness.timing import contention, paired
from harness.units import utc_now

ROUNDS = paired.ROUNDS  # undisturbed rounds wanted (--rounds)
MAX_ROUNDS = 200  # the most one may ask for
MAX_ROUNDS_FACTOR = paired.MAX_ROUNDS_FACTOR  # give up after this many times `rounds` rounds


def plan(rounds: int = ROUNDS) -> PartsPlan:
    """The timing plan stored in the record. HARNESS_PAIRED_BURST_S (the paired timing's test knob) sets another
    burst length; the gap shrinks with it."""
    burst_s = float(os.environ.get("HARNESS_PAIRED_BURST_S") or BURST_S)
    return PartsPlan(rounds=rounds, max_rounds=rounds * MAX_ROUNDS_FACTOR, burst_s=burst_s,
                     gap_s=min(GAP_S, burst_s / 5), order="alternating (forward, then reversed)")


def new_record(config: Config, corpus: Any, contenders: list[dict], names: list[str], rounds: int, seed: int,
               options: dict) -> tuple[PartsRecord, list[PartsJob]]:
    """A record with no round yet and the jobs of its timed processes. `contenders`: [{"name", "backend", "device",
    "options", and optionally "env" (the process's extra environment: tests plant slowdowns with it, never
    recorded)}]; `names`: the parts to time (harness.core.parts.select); `options`: what the command was asked
    (PartsOptions' fields but the size, seed and data; the backends default to the contenders')."""
    asked = {"backends": [c["backend"] for c in contenders], **options}
    record = PartsRecord(
        id=new_id(), created_at=utc_now(), config=config, vocab_size=corpus.vocab_size,
        tokens_per_step=config.batch_size * config.block_size, parts=names,
        all_parts=names == part_names(config.n_layer), items=items(names),
        flops=part_flops(config, corpus.vocab_size), flops_per_token=flops_per_token(config, corpus.vocab_size),
        plan=plan(rounds), rule=contention.RULE,
        options=PartsOptions(size=config.name, **asked, seed=seed, data=corpus.path),
        contenders=[PartsContender(name=c["name"], backend=c["backend"], device=c["device"], options=c["options"])
                    for c in contenders])
    jobs = [PartsJob(name=c["name"], backend=c["backend"], options=c["options"], device=c["device"],
                     config=config.to_dict(), data=corpus.path, seed=seed, parts=names,
                     burst_s=record.plan.burst_s, env=c.get("env") or {},
                     profile=c["device"] == "cuda")  # kernel counts: what names a launch-bound part
            for c in contenders]
    return record, jobs


def start(job: PartsJob, threads: int | None) -> TimedProcess:
    """The timed process of `job` (harness.bench.parts_process), started; its protocol is the paired timing's."""
    return TimedProcess(job.name, spawn("parts", [job.to_json()], threads, env=job.env or None,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0))


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"parts: {text}", file=sys.stderr, flush=True)


def _ready_line(name: str, ready: PartsReady) -> str:
    compiled = f", compiled in {ready.compile_s:.1f} s" if ready.compile_s else ""
    return (f"{name} ready: set up in {ready.setup_s or 0:.1f} s{compiled}, {len(ready.calls)} items, "
            f"{ready.passes} passes a burst")


def run(path: Path, record: PartsRecord, jobs: list[PartsJob], threads: int | None, progress: bool = True
        ) -> PartsRecord:
    """Time `jobs` (one per contender) in rounds into `record`, written to `path` as the rounds come in; returns it.
    Ctrl-C keeps the rounds so far (status "interrupted") and raises KeyboardInterrupt; a timed process that fails
    ends the rounds with its reason recorded (status "failed")."""
    p = record.plan
    record.environment = PartsEnvironment(**capture(), loadavg_start=(loadavg() or (None,))[0],
                                          cores=usable_cores())
    record.dump(path)
    children: list[TimedProcess] = []
    n_clean = 0
    try:
        for job in jobs:  # one by one: a signal between two starts leaves none unstopped; set-up runs in parallel
            children.append(start(job, threads))
        for child, contender in zip(children, record.contenders):
            contender.ready = PartsReady.from_dict(child.receive(REPLY_TIMEOUT_S * 3))
            _say(progress, _ready_line(child.name, contender.ready))
        pids = [c.proc.pid for c in children]
        for child in children:
            child.send({"siblings": [q for q in pids if q != child.proc.pid], "coordinator": os.getpid()})
        n_clean = _rounds(path, record, children, progress)
        record.status = "completed" if n_clean >= p.rounds else "incomplete"
    except KeyboardInterrupt:
        record.status = "interrupted"
        raise
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        record.status, record.failure = "failed", str(exc)
        print(f"parts: {exc}", file=sys.stderr)
    finally:
        with signals_deferred():
            record.finished_at = utc_now()
            record.environment.loadavg_end = (loadavg() or (None,))[0]
            with contextlib.suppress(OSError):
                record.dump(path)
            stop_children(children)
    return record


def _rounds(path: Path, record: PartsRecord, children: list[TimedProcess], progress: bool) -> int:
    """Rounds of one burst per process, the order alternating, until enough are undisturbed, or until no verdict
    can come any more (harness.timing.paired.out_of_reach: then `record.stopped` says why); the record is
    rewritten every few seconds. Returns the undisturbed rounds."""
    p = record.plan
    n_clean, last_write = 0, time.monotonic()
    line = Line("parts", progress)
    _say(progress, f"{' and '.join(c.name for c in children)} side by side: {p.rounds} undisturbed rounds wanted "
                   f"(at most {p.max_rounds})")
    for r in range(p.max_rounds):
        order = children if r % 2 == 0 else children[::-1]
        rnd = PartsRound(order=[c.name for c in order])
        for child in order:
            time.sleep(p.gap_s or 0.0)
            child.send({"burst": r})
            rnd.bursts[child.name] = PartsBurst.from_dict(child.receive(REPLY_TIMEOUT_S))
        record.rounds.append(rnd)
        n_clean += paired.round_clean(rnd)
        if time.monotonic() - last_write >= PERSIST_EVERY_S:
            record.dump(path)
            last_write = time.monotonic()
        left = p.max_rounds - r - 1
        if n_clean >= p.rounds:
            break
        if left and paired.out_of_reach(n_clean, left, p.rounds):
            record.stopped = (f"stopped after {r + 1} of at most {p.max_rounds} rounds: {n_clean} undisturbed, "
                              f"and even {left} more could not make the {paired.needed_for_a_verdict(p.rounds)} "
                              "a verdict needs")
            break
        line.show(f"round {r + 1} of at most {p.max_rounds}, {n_clean} of {p.rounds} undisturbed",
                  expected_rounds(line.elapsed_s, r + 1, n_clean, p.rounds - n_clean, left))
    line.close()
    if record.stopped:
        _say(progress, record.stopped)
    _say(progress, f"{len(record.rounds)} rounds, {n_clean} undisturbed in all")
    return n_clean
