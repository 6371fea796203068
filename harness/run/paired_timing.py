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

The record is `paired.json` (`SCHEMA`, versioned): the plan, the contenders, and every session with every round
(step times and evidence), never rewritten with less: a later session (resume, a rerun) is appended. It lives in
the run directory of `harness run` (`<run>/paired.json`) and in the sweep's directory for a sweep
(`<out>/sweeps/<id>/paired/<n>.json`, contenders from several cells' run directories). This module is the
coordinator (a SLURM job runs it as `python -m harness --worker paired RECORD`); the record's analysis is
harness.timing.paired.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.run import processes, records
from harness.run.processes import spawn
from harness.run.timed import MARK, WARMUP_S, WARMUP_STEPS
from harness.timing import contention
from harness.timing.paired import (
    MAX_ROUNDS_FACTOR,
    ROUNDS,
    SCHEMA,
    SCHEMA_VERSION,
    _burst_median,
    clean_rounds,
    complete,
    load,
    lock_path,
    round_clean,
)
from harness.units import utc_now

BURST_S = 0.25  # a burst's target length


MIN_BURST, MAX_BURST = 3, 500  # steps per burst


GAP_S = 0.05  # pause between bursts: lets the previous contender's spinning worker threads fall asleep


REPLY_TIMEOUT_S = 600.0  # a timing process silent this long is hung
QUIT_S = 2.0  # a timing process asked to quit that has not within this is sent SIGTERM


PERSIST_EVERY_S = 5.0  # how often the record is rewritten during a session (and always at its end)


def plan(rounds: int = ROUNDS) -> dict:
    """The timing plan stored in the record. HARNESS_PAIRED_BURST_S sets another burst length (the test suite
    uses short ones); the gap and the warm-up shrink with it."""
    burst_s = float(os.environ.get("HARNESS_PAIRED_BURST_S") or BURST_S)
    return {"rounds": rounds, "max_rounds": rounds * MAX_ROUNDS_FACTOR, "burst_s": burst_s, "min_burst": MIN_BURST,
            "max_burst": MAX_BURST, "gap_s": min(GAP_S, burst_s / 5), "warmup_steps": WARMUP_STEPS,
            "warmup_s": min(WARMUP_S, 4 * burst_s), "order": "alternating (forward, then reversed)"}


def new_doc(contenders: list[dict], label: str, seed: int, rounds: int = ROUNDS, threads: int | None = None) -> dict:
    """A paired-timing record with no session yet. `contenders`: [{"name", "run_dir", "backend", "options",
    "device"}], names unique (a backend name; in a sweep the backend with its options)."""
    names = [c["name"] for c in contenders]
    if len(set(names)) != len(names) or len(names) < 2:
        raise ValueError(f"paired timing needs two or more distinct contenders, got {names}")
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "label": label, "seed": seed,
            "contenders": contenders, "threads": threads, "plan": plan(rounds), "rule": contention.RULE,
            "sessions": [], "status": "pending", "created_at": utc_now()}


def check_contenders(doc: dict, path: Path) -> None:
    """Every contender is a backend of a run directory (`<out>/runs/<run id>`) beside this record's `--out`: a
    record (written by the harness, but read back from disk) never makes the coordinator start anything else."""
    from harness.backends import check_names

    contenders = doc.get("contenders")
    if not isinstance(contenders, list) or len(contenders) < 2:
        raise UsageError(f"{str(path)!r} names fewer than two contenders; delete it to time again")
    for c in contenders:
        run_dir = Path(str(c.get("run_dir", "")))
        if run_dir.parent.name != records.RUNS or not records.RUN_ID_RE.match(run_dir.name) or not run_dir.is_dir():
            raise UsageError(f"{str(path)!r}: contender {c.get('name')!r} points at {str(run_dir)!r}, which is not a "
                             "run directory of the harness; delete the record to time again")
        check_names([str(c.get("backend"))])


# --- the coordinator -----------------------------------------------------------------------------------------------
class Child:
    """One timed process (harness.run.timed) and its protocol pipe (JSON lines prefixed with MARK on its stdout)."""

    def __init__(self, contender: dict, threads: int | None, warmup_s: float):
        compiles = bool((contender.get("options") or {}).get("compile"))
        self.name = contender["name"]
        self.proc = spawn("timed", [contender["run_dir"], contender["backend"], repr(warmup_s)], threads,
                          Path(contender["run_dir"]) if compiles else None, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, bufsize=0)
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


def stop_children(children: list[Child]) -> None:
    """End every timing process at once: each is asked to quit (between bursts it does at once); one still running
    `QUIT_S` seconds later (in a burst, or wedged) gets SIGTERM, and SIGKILL `processes.KILL_GRACE_S` after that."""
    for child in children:
        with contextlib.suppress(OSError, ValueError):
            child.send({"quit": True})
    deadline = time.monotonic() + QUIT_S
    while any(c.proc.poll() is None for c in children) and time.monotonic() < deadline:
        time.sleep(0.02)
    processes.stop([c.proc for c in children], signal.SIGTERM)


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"paired timing: {text}", file=sys.stderr, flush=True)


def _burst_sizes(p: dict, step_s: dict[str, float | None]) -> dict[str, int]:
    """Steps per burst for each contender from its step time (seconds, None: unknown): about `burst_s` of
    training, within the plan's `min_burst` .. `max_burst`."""
    return {name: int(min(p["max_burst"], max(p["min_burst"], round(p["burst_s"] / max(t or 1e-9, 1e-9)))))
            for name, t in step_s.items()}


class RecordLock:
    """An exclusive, non-blocking `fcntl.flock` on `.<record>.lock` beside a paired-timing record, held while a
    coordinator adds a session. Two coordinators of one record (a SLURM job resubmitted while the first still runs)
    would each read the record, extend it and write it whole, dropping the other's rounds; the second is refused
    instead (UsageError). The kernel drops the lock when its holder exits, however it exits: it is never stale.
    (harness.run.records.RunLock is the same mechanism for a run directory, with its messages and clean-up.)"""

    def __init__(self, path: Path):
        self.path = lock_path(path)
        self.record = Path(path)
        self.fd: int | None = None

    def __enter__(self) -> RecordLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise UsageError(records.os_error_message(exc, f"cannot lock paired-timing record {str(self.record)!r}")
                             ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if not isinstance(exc, BlockingIOError):  # no locks here (some network file systems): say so
                os.close(fd)
                raise UsageError(records.os_error_message(
                    exc, f"cannot lock paired-timing record {str(self.record)!r}")) from None
            try:
                pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            except OSError:
                pid = ""
            os.close(fd)
            holder = f" (pid {pid})" if pid.isdigit() else ""
            raise UsageError(f"another paired timing holds {str(self.record)!r}{holder}; wait for it to finish (or "
                             "stop it) before timing again") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back (delivered at the end): the record's last write and the timing processes' stop
    must not be cut short by a second Ctrl-C or a SLURM time limit's signal."""
    signals = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals) if hasattr(signal, "pthread_sigmask") else None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def run(path: Path, doc: dict | None = None, progress: bool = True, rounds: int | None = None) -> dict:
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


def _run_locked(path: Path, doc: dict | None, progress: bool, rounds: int | None) -> dict:
    """One session, under the record's lock: start the contenders, time rounds of alternating bursts until enough
    are undisturbed, and write the record. One function, a little over 80 lines, because its `finally` must hold
    every round measured so far and the children it started: a stop or a signal then loses nothing measured and
    leaves no timed process behind."""
    if path.exists():  # read under the lock: what another coordinator wrote before is kept
        doc = load(path)
        for old in doc["sessions"]:  # we hold the lock: a session still "running" lost its coordinator (SIGKILL)
            if old.get("status") == "running":
                old["status"] = "interrupted"
    elif doc is None:
        raise UsageError(f"paired-timing record {str(path)!r} does not exist")
    if rounds and rounds > doc["plan"]["rounds"]:
        doc["plan"].update(rounds=rounds, max_rounds=rounds * MAX_ROUNDS_FACTOR)
    if complete(doc):
        return doc
    check_contenders(doc, path)
    p = doc["plan"]
    wanted, max_rounds, gap_s = p["rounds"], p["max_rounds"], p["gap_s"]
    n_clean = clean_rounds(doc)  # judged once here, then counted round by round (the record only grows)
    session: dict[str, Any] = {"started_at": utc_now(), "host": socket.gethostname(), "status": "running",
                               "ready": {}, "rounds": []}
    doc["sessions"].append(session)
    doc["status"] = "running"
    records.atomic_write_json(path, doc)
    last_write = time.monotonic()
    names = [c["name"] for c in doc["contenders"]]
    _say(progress, f"{' and '.join(names)} side by side, {wanted} undisturbed rounds of short alternating bursts "
                   f"(at most {max_rounds} rounds)")
    children: list[Child] = []
    try:
        for c in doc["contenders"]:  # one by one: a signal between two starts leaves none unstopped
            children.append(Child(c, doc.get("threads"), p["warmup_s"]))
        for child in children:  # set-up and warm-up run in parallel; they are not timed against each other
            session["ready"][child.name] = child.receive(REPLY_TIMEOUT_S * 3)
        pids = [c.proc.pid for c in children]
        for child in children:
            child.send({"siblings": [p for p in pids if p != child.proc.pid], "coordinator": os.getpid()})
        steps = {c.name: int(session["ready"][c.name]["next_step"]) for c in children}
        burst = _burst_sizes(p, {c.name: session["ready"][c.name]["step_s"] for c in children})
        session["burst_steps"] = burst
        last_said = time.monotonic()
        for r in range(max_rounds):
            order = children if r % 2 == 0 else children[::-1]
            rnd: dict[str, Any] = {"order": [c.name for c in order], "bursts": {}}
            for child in order:
                time.sleep(gap_s)
                child.send({"burst": burst[child.name], "start": steps[child.name]})
                reply = child.receive(max(REPLY_TIMEOUT_S, 50 * session["ready"][child.name]["step_s"]
                                          * burst[child.name]))
                steps[child.name] += burst[child.name]
                rnd["bursts"][child.name] = {"start": reply["start"], "times": reply["times"],
                                             "chunk": reply["chunk"]}
            session["rounds"].append(rnd)
            n_clean += round_clean(rnd)
            if r == 0:  # the warm-up ran with every contender at once: size the bursts again from a timed round
                burst = _burst_sizes(p, {name: _burst_median(b) for name, b in rnd["bursts"].items()})
                session["burst_steps_after_first_round"] = burst
            # the whole record is rewritten every few seconds, not every round (it grows with the rounds); the
            # `finally` below writes it once more, so a stop or a signal loses nothing measured
            if time.monotonic() - last_write >= PERSIST_EVERY_S:
                records.atomic_write_json(path, doc)
                last_write = time.monotonic()
            if time.monotonic() - last_said > 5:
                last_said = time.monotonic()
                _say(progress, f"{r + 1} rounds, {n_clean} undisturbed")
            if n_clean >= wanted:
                break
        session["status"] = "completed" if n_clean >= wanted else "incomplete"
    except KeyboardInterrupt:
        session["status"] = "interrupted"
        raise
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        session["status"] = "failed"
        session["failure"] = str(exc)
        print(f"paired timing: {exc}; the speed comparison has no paired timing", file=sys.stderr)
    finally:
        with _signals_deferred():
            session["finished_at"] = utc_now()
            doc["status"] = "completed" if n_clean >= wanted else session["status"]
            with contextlib.suppress(OSError):
                records.atomic_write_json(path, doc)
            stop_children(children)
    _say(progress, f"{len(session['rounds'])} rounds, {n_clean} undisturbed in all; {path}")
    return doc



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
    last = doc["sessions"][-1] if doc["sessions"] else {}
    return 1 if last.get("status") == "failed" else 0
