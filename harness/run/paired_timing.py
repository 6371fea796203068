"""Paired timing: the contenders of a speed comparison timed under the same conditions.

A speed ratio taken from two whole training runs made one after another compares two machines: whatever else ran
during either run is in the ratio. Here every contender (a backend with its options, from a run directory's
spec) runs in its own timed process (harness.run.timed: `python -m harness --worker timed RUN_DIR BACKEND WARMUP_S`,
one interpreter per backend as for training: juliacall before torch, separate memory pools), all of them alive at
once, set up and
warmed up, then driven by one coordinator in **rounds**: every round gives each contender one short burst of
training steps (about `BURST_S` seconds, at least `MIN_BURST` steps), the order alternating between rounds
(A B, then B A) so that neither always goes first. The contender that is not running waits on a pipe and uses no
CPU. Steps are timed exactly as `harness run` times them (the same `harness.run.loop.train`: host clock on the CPU,
CUDA events on CUDA) on the run's own batches, continuing after the warm-up.

Per round and pair (a, b) the time ratio is median(a's step times) / median(b's step times) in that round; drift
of the machine over seconds hits both bursts of a round alike. Each burst carries its contention evidence
(harness.timing.contention, one chunk per burst); a round in which either burst was disturbed is left out of the ratio.
The coordinator keeps going until `rounds` undisturbed rounds are in, or `MAX_ROUNDS_FACTOR` x `rounds` rounds were
made. The estimate is the geometric mean of the undisturbed round ratios with a Student-t interval on their
logarithms; several sessions (sweep seeds) are combined across sessions (the level where process-to-process
variation arises).

The record is `paired.json` (harness.store.paired.PairedRecord, versioned): the plan, the contenders, and every
session with every round (step times and evidence), never rewritten with less: a later session (resume, a rerun) is
appended. It lives in the run directory of `harness run` (`<run>/paired.json`) and in the sweep's directory for a sweep
(`<out>/sweeps/<id>/paired/<n>.json`, contenders from several cells' run directories). This module is the
coordinator (a SLURM job runs it as `python -m harness --worker paired RECORD`); the record's analysis is
harness.timing.paired.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from harness.errors import UsageError
from harness.progress import Line, expected_rounds
from harness.run import processes
from harness.run.processes import spawn
from harness.run.timed import MARK, WARMUP_S, WARMUP_STEPS
from harness.store import RUN_ID_RE, RecordLock
from harness.store.paired import Burst, Contender, PairedPlan, PairedRecord, Ready, Round, Session
from harness.store.paths import RUNS
from harness.timing import contention
from harness.timing.paired import (
    MAX_ROUNDS_FACTOR,
    ROUNDS,
    burst_median,
    clean_rounds,
    complete,
    needed_for_a_verdict,
    out_of_reach,
    round_clean,
)
from harness.units import utc_now

BURST_S = 0.25  # a burst's target length


MIN_BURST, MAX_BURST = 3, 500  # steps per burst


GAP_S = 0.05  # pause between bursts: lets the previous contender's spinning worker threads fall asleep


REPLY_TIMEOUT_S = 600.0  # a timing process silent this long is hung
QUIT_S = 2.0  # a timing process asked to quit that has not within this is sent SIGTERM


PERSIST_EVERY_S = 5.0  # how often the record is rewritten during a session (and always at its end)


def plan(rounds: int = ROUNDS) -> PairedPlan:
    """The timing plan stored in the record. HARNESS_PAIRED_BURST_S sets another burst length (the test suite
    uses short ones); the gap and the warm-up shrink with it."""
    burst_s = float(os.environ.get("HARNESS_PAIRED_BURST_S") or BURST_S)
    return PairedPlan(rounds=rounds, max_rounds=rounds * MAX_ROUNDS_FACTOR, burst_s=burst_s, min_burst=MIN_BURST,
                      max_burst=MAX_BURST, gap_s=min(GAP_S, burst_s / 5), warmup_steps=WARMUP_STEPS,
                      warmup_s=min(WARMUP_S, 4 * burst_s), order="alternating (forward, then reversed)")


def new_doc(contenders: list[Contender], label: str, seed: int, rounds: int = ROUNDS,
            threads: int | None = None) -> PairedRecord:
    """A paired-timing record with no session yet; the contenders' names unique (a backend name; in a sweep the
    backend with its options)."""
    names = [c.name for c in contenders]
    if len(set(names)) != len(names) or len(names) < 2:
        raise ValueError(f"paired timing needs two or more distinct contenders, got {names}")
    return PairedRecord(label=label, seed=seed, contenders=contenders, threads=threads, plan=plan(rounds),
                        rule=contention.RULE, created_at=utc_now())


def check_contenders(doc: PairedRecord, path: Path) -> None:
    """Every contender is a backend of a run directory (`<out>/runs/<run id>`) beside this record's `--out`: a
    record (written by the harness, but read back from disk) never makes the coordinator start anything else."""
    from harness.backends import check_names

    for c in doc.contenders:
        run_dir = Path(c.run_dir)
        if run_dir.parent.name != RUNS or not RUN_ID_RE.match(run_dir.name) or not run_dir.is_dir():
            raise UsageError(f"{str(path)!r}: contender {c.name!r} points at {str(run_dir)!r}, which is not a "
                             "run directory of the harness; delete the record to time again")
        check_names([c.backend])


# --- the coordinator -----------------------------------------------------------------------------------------------
class TimedProcess:
    """A timed process started with pipes on its stdin and stdout (harness.run.processes.spawn), named `name`, and its
    protocol (harness.run.timed): JSON lines to it, JSON lines prefixed with MARK from it; what else it prints is
    passed on. The paired timing's `Child` is one; `harness bench parts` drives its own."""

    def __init__(self, name: str, proc: subprocess.Popen):
        self.name = name
        self.proc = proc
        self.buf = b""

    def send(self, msg: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict:
        """The next protocol message; RuntimeError when the process ends or stays silent for `timeout` s."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                text = line.decode("utf-8", "replace")
                at = text.find(MARK)
                before = text if at < 0 else text[:at]
                if before.strip():
                    print(f"{self.name}: {before}", file=sys.stderr)  # something the backend printed: pass it on
                if at >= 0:
                    return json.loads(text[at + len(MARK):])
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.name}: the timing process did not answer within {timeout:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    code = self.proc.wait()
                    raise RuntimeError(f"{self.name}: the timing process exited with status {code} (its message "
                                       "is above, or in the job's log)")
                self.buf += chunk


def stop_children(children: Sequence[TimedProcess]) -> None:
    """End every timing process at once: each is asked to quit (between bursts it does at once); one still running
    `QUIT_S` seconds later (in a burst, or wedged) gets SIGTERM, and SIGKILL `processes.KILL_GRACE_S` after that."""
    for child in children:
        with contextlib.suppress(OSError, ValueError):
            child.send({"quit": True})
    deadline = time.monotonic() + QUIT_S
    while any(c.proc.poll() is None for c in children) and time.monotonic() < deadline:
        time.sleep(0.02)
    processes.stop([c.proc for c in children], signal.SIGTERM)


class Child(TimedProcess):
    """One contender's timed process of the paired timing (harness.run.timed: its run directory and backend)."""

    def __init__(self, contender: Contender, threads: int | None, warmup_s: float):
        compiles = bool(contender.options.get("compile"))
        super().__init__(contender.name, spawn(
            "timed", [contender.run_dir, contender.backend, repr(warmup_s)], threads, compiles,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0))


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"paired timing: {text}", file=sys.stderr, flush=True)


def _burst_sizes(p: PairedPlan, step_s: dict[str, float | None]) -> dict[str, int]:
    """Steps per burst for each contender from its step time (seconds, None: unknown): about `burst_s` of
    training, within the plan's `min_burst` .. `max_burst`."""
    return {name: int(min(p.max_burst, max(p.min_burst, round(p.burst_s / max(t or 1e-9, 1e-9)))))
            for name, t in step_s.items()}


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back (delivered at the end): the record's last write and the timing processes' stop
    must not be cut short by a second Ctrl-C or a SLURM time limit's signal."""
    signals = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals) if hasattr(signal, "pthread_sigmask") else None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def run(path: Path, doc: PairedRecord | None = None, progress: bool = True,
        rounds: int | None = None) -> PairedRecord:
    """Add one session to the paired-timing record at `path` (created from `doc` when it does not exist) unless it
    already holds its undisturbed rounds (`rounds` more than its plan's raises the plan); returns the record.
    Ctrl-C keeps the rounds measured so far (the session is marked interrupted) and raises KeyboardInterrupt. A
    timing process that fails ends the session with the reason recorded (`failure`); nothing is raised. Another
    coordinator adding a session to the same record at the same time: UsageError (`RecordLock`)."""
    path = Path(path)
    if not path.exists() and doc is None:
        raise UsageError(f"paired-timing record {str(path)!r} does not exist")
    with RecordLock(path):
        return _run_locked(path, doc, progress, rounds)


def _run_locked(path: Path, doc: PairedRecord | None, progress: bool, rounds: int | None) -> PairedRecord:
    """One session, under the record's lock: start the contenders, time rounds of alternating bursts until enough
    are undisturbed (`_rounds`, which adds each to the session as it is measured), and write the record. Its
    `finally` holds every round measured so far and the children it started: a stop or a signal then loses nothing
    measured and leaves no timed process behind."""
    if path.exists():  # read under the lock: what another coordinator wrote before is kept
        doc = PairedRecord.load(path)
        for old in doc.sessions:  # we hold the lock: a session still "running" lost its coordinator (SIGKILL)
            if old.status == "running":
                old.status = "interrupted"
    elif doc is None:
        raise UsageError(f"paired-timing record {str(path)!r} does not exist")
    p = doc.plan
    if rounds and rounds > p.rounds:
        p.rounds, p.max_rounds = rounds, rounds * MAX_ROUNDS_FACTOR
    if complete(doc):
        return doc
    check_contenders(doc, path)
    clean = [clean_rounds(doc)]  # judged once here, then counted round by round by `_rounds` (the record only grows)
    session = Session(started_at=utc_now(), host=socket.gethostname(), status="running")
    doc.sessions.append(session)
    doc.status = "running"
    doc.dump(path)
    _say(progress, f"{' and '.join(doc.names)} side by side, {p.rounds} undisturbed rounds of short alternating "
                   f"bursts (at most {p.max_rounds} rounds)")
    children: list[Child] = []
    try:
        for c in doc.contenders:  # one by one: a signal between two starts leaves none unstopped
            children.append(Child(c, doc.threads, p.warmup_s))
        for child in children:  # set-up and warm-up run in parallel; they are not timed against each other
            session.ready[child.name] = Ready.from_dict(child.receive(REPLY_TIMEOUT_S * 3))
        pids = [c.proc.pid for c in children]
        for child in children:
            child.send({"siblings": [p for p in pids if p != child.proc.pid], "coordinator": os.getpid()})
        _rounds(path, doc, session, children, clean, progress)
        session.status = "completed" if clean[0] >= p.rounds else "incomplete"
    except KeyboardInterrupt:
        session.status = "interrupted"
        raise
    except (RuntimeError, OSError, ValueError, KeyError, TypeError) as exc:
        session.status, session.failure = "failed", str(exc)
        print(f"paired timing: {exc}; the speed comparison has no paired timing", file=sys.stderr)
    finally:
        with signals_deferred():
            session.finished_at = utc_now()
            doc.status = "completed" if clean[0] >= p.rounds else session.status
            with contextlib.suppress(OSError):
                doc.dump(path)
            stop_children(children)
    _say(progress, f"{len(session.rounds)} rounds, {clean[0]} undisturbed in all; {path}")
    if session.stopped:
        print(f"paired timing: {session.stopped}: no verdict (`harness resume` times more rounds later)",
              file=sys.stderr, flush=True)
    return doc


def _rounds(path: Path, doc: PairedRecord, session: Session, children: list[Child], clean: list[int],
            progress: bool) -> None:
    """Time rounds of alternating bursts into `session` until `doc` holds its undisturbed rounds, its cap of rounds
    is reached, or no verdict can come any more (harness.timing.paired.out_of_reach: then `session.stopped` says
    why); the record rewritten every PERSIST_EVERY_S; `clean[0]`, the undisturbed rounds in all, counted as they
    come (a progress line on a terminal says how far it is)."""
    p = doc.plan
    steps = {c.name: session.ready[c.name].next_step for c in children}
    burst = _burst_sizes(p, {c.name: session.ready[c.name].step_s for c in children})
    session.burst_steps = burst
    line = Line("paired timing", progress)
    last_write, clean_here = time.monotonic(), 0
    for r in range(p.max_rounds):
        order = children if r % 2 == 0 else children[::-1]
        rnd = Round(order=[c.name for c in order])
        for child in order:
            time.sleep(p.gap_s)
            child.send({"burst": burst[child.name], "start": steps[child.name]})
            reply = child.receive(max(REPLY_TIMEOUT_S, 50 * session.ready[child.name].step_s * burst[child.name]))
            steps[child.name] += burst[child.name]
            rnd.bursts[child.name] = Burst(start=reply["start"], times=reply["times"], chunk=reply["chunk"])
        session.rounds.append(rnd)
        undisturbed = round_clean(rnd)  # each burst judged once
        clean_here += undisturbed
        clean[0] += undisturbed
        n_clean = clean[0]
        if r == 0:  # the warm-up ran with every contender at once: size the bursts again from a timed round
            burst = _burst_sizes(p, {name: burst_median(b) for name, b in rnd.bursts.items()})
            session.burst_steps_after_first_round = burst
        # the whole record is rewritten every few seconds, not every round (it grows with the rounds); the
        # coordinator's `finally` writes it once more, so a stop or a signal loses nothing measured
        if time.monotonic() - last_write >= PERSIST_EVERY_S:
            doc.dump(path)
            last_write = time.monotonic()
        left = p.max_rounds - r - 1
        if n_clean >= p.rounds:
            break
        if left and out_of_reach(n_clean, left, p.rounds):
            session.stopped = (f"stopped after {r + 1} of at most {p.max_rounds} rounds: {n_clean} undisturbed, and "
                               f"even {left} more could not make the {needed_for_a_verdict(p.rounds)} a verdict needs")
            break
        line.show(f"round {r + 1} of at most {p.max_rounds}, {n_clean} of {p.rounds} undisturbed",
                  expected_rounds(line.elapsed_s, r + 1, clean_here, p.rounds - n_clean, left))
    line.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    """`RECORD`: one session for the paired-timing record at RECORD, as a SLURM job runs it (`python -m harness
    --worker paired RECORD`); SIGTERM (a time limit) keeps the rounds measured so far."""
    if len(argv) != 1:
        print("usage: python -m harness --worker paired PAIRED.json", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        doc = run(Path(argv[0]), progress=True)
    except UsageError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    last = doc.last_session
    return 1 if last is not None and last.status == "failed" else 0
