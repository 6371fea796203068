"""Paired timing: the contenders of a speed comparison timed under the same conditions.

A speed ratio taken from two whole training runs made one after another compares two machines: whatever else ran
during either run is in the ratio. Here every contender (a backend with its options, from a run directory's
spec) runs in its own timing process (`python -m harness.paired serve RUN_DIR BACKEND`, one interpreter per
backend as for training: juliacall before torch, separate memory pools), all of them alive at once, set up and
warmed up, then driven by one coordinator in **rounds**: every round gives each contender one short burst of
training steps (about `BURST_S` seconds, at least `MIN_BURST` steps), the order alternating between rounds
(A B, then B A) so that neither always goes first. The contender that is not running waits on a pipe and uses no
CPU. Steps are timed exactly as `harness run` times them (the same `harness.runner.train`: host clock on the CPU,
CUDA events on CUDA) on the run's own batches, continuing after the warm-up.

Per round and pair (a, b) the time ratio is median(a's step times) / median(b's step times) in that round; drift
of the machine over seconds hits both bursts of a round alike. Each burst carries its contention evidence
(harness.contention, one chunk per burst); a round in which either burst was disturbed is left out of the ratio.
The coordinator keeps going until `rounds` undisturbed rounds are in, or `MAX_ROUNDS_FACTOR` x `rounds` rounds were
made. The estimate is the geometric mean of the undisturbed round ratios with a Student-t interval on their
logarithms; several sessions (sweep seeds) are combined across sessions (the level where process-to-process
variation arises).

The record is `paired.json` (`SCHEMA`, versioned): the plan, the contenders, and every session with every round
(step times and evidence), never rewritten with less: a later session (resume, a rerun) is appended. It lives in
the run directory of `harness run` (`<run>/paired.json`) and in the sweep's directory for a sweep
(`<out>/sweeps/<id>/paired/<n>.json`, contenders from several cells' run directories).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
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

import numpy as np

from harness import contention, records, stats
from harness.errors import UsageError
from harness.processes import child_env, pdeathsig

SCHEMA = "nanogpt-parity/paired-timing"
SCHEMA_VERSION = 1
ROUNDS = 10  # undisturbed rounds wanted (the default of --paired-rounds)
MAX_ROUNDS_FACTOR = 4  # give up after this many times `rounds` rounds
MAX_ROUNDS = 1000  # the most undisturbed rounds one may ask for
MIN_USABLE_ROUNDS = 3  # fewer undisturbed rounds than this (and than half the wanted ones): not usable
BURST_S = 0.25  # a burst's target length
MIN_BURST, MAX_BURST = 3, 500  # steps per burst
GAP_S = 0.05  # pause between bursts: lets the previous contender's spinning worker threads fall asleep
WARMUP_STEPS, WARMUP_S, WARMUP_MAX = 10, 1.0, 400  # warm-up: at least 10 steps and 1 s, at most 400 steps
CV_MAX = 0.10  # a coefficient of variation of the paired ratios above this is said in the verdict
MARK = "@harness-paired "  # protocol lines on the timing process's stdout start with this (others are passed on)
REPLY_TIMEOUT_S = 600.0  # a timing process silent this long is hung
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
            "sessions": [], "status": "pending", "created_at": _now()}


def load(path: Path) -> dict:
    """A paired-timing record; UsageError naming the file when it is unreadable or not one."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"paired-timing record {str(path)!r} does not exist") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"paired-timing record {str(path)!r} is unreadable ({exc}); delete it to time again"
                         ) from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("sessions"), list):
        raise UsageError(f"{str(path)!r} is not a nanogpt-parity paired-timing record")
    if doc.get("schema_version", 0) > SCHEMA_VERSION:
        raise UsageError(f"{str(path)!r} has schema version {doc['schema_version']}; upgrade nanogpt-parity")
    return doc


# --- analysis (pure: the report reads it) ---------------------------------------------------------------------------
def rounds_of(doc: dict) -> list[dict]:
    """Every round of every session, in order."""
    return [r for s in doc.get("sessions") or [] for r in s.get("rounds") or []]


def _burst_median(burst: dict) -> float | None:
    times = [t for t in burst.get("times") or [] if isinstance(t, (int, float)) and math.isfinite(t) and t > 0]
    return float(np.median(times)) if times else None


def burst_disturbed(burst: dict) -> bool:
    return bool(contention.judge(burst.get("chunk") or {}))


def pair_rounds(doc: dict, a: str, b: str) -> list[dict]:
    """Per round holding both: {"ratio": time a / time b, "disturbed": either burst disturbed, "session": i}."""
    out = []
    for i, s in enumerate(doc.get("sessions") or []):
        for r in s.get("rounds") or []:
            ba, bb = (r.get("bursts") or {}).get(a), (r.get("bursts") or {}).get(b)
            if not ba or not bb:
                continue
            ma, mb = _burst_median(ba), _burst_median(bb)
            if ma is None or mb is None:
                continue
            out.append({"ratio": ma / mb, "disturbed": burst_disturbed(ba) or burst_disturbed(bb), "session": i,
                        "a_s": ma, "b_s": mb})
    return out


def round_clean(rnd: dict) -> bool:
    """Whether no burst of round `rnd` was disturbed (every contender)."""
    return not any(burst_disturbed(b) for b in (rnd.get("bursts") or {}).values())


def clean_rounds(doc: dict) -> int:
    """Rounds in which no burst was disturbed (every contender)."""
    return sum(1 for r in rounds_of(doc) if round_clean(r))


def usable(n_clean: int, wanted: int) -> bool:
    return n_clean >= max(1, min(MIN_USABLE_ROUNDS, wanted), (wanted + 1) // 2)


def pair_summary(doc: dict, a: str, b: str) -> dict:
    """The time ratio a / b of one session or several: estimate, 95 % interval, CV, rounds used and dropped.

    Within one session the interval is over its undisturbed rounds; with several sessions each session's
    geometric mean is one value and the interval is across sessions. `usable` False: too few undisturbed rounds,
    the figures come from every round and must stay out of a verdict.
    """
    rows = pair_rounds(doc, a, b)
    wanted = (doc.get("plan") or {}).get("rounds", ROUNDS)
    clean = [r for r in rows if not r["disturbed"]]
    ok = usable(len(clean), wanted)
    use = clean if ok else rows
    out: dict[str, Any] = {"a": a, "b": b, "rounds": len(rows), "clean_rounds": len(clean),
                           "disturbed_rounds": len(rows) - len(clean), "usable": ok, "ratio": None, "lo": None,
                           "hi": None, "cv": None, "n": 0, "level": "rounds", "sessions": 0}
    if not use:
        return out
    sessions = sorted({r["session"] for r in use})
    out["sessions"] = len(sessions)
    if len(sessions) > 1:
        values = [math.exp(np.mean([math.log(r["ratio"]) for r in use if r["session"] == s])) for s in sessions]
        out["level"] = "sessions"
    else:
        values = [r["ratio"] for r in use]
    ci = stats.geometric_mean_ci(values)
    out.update(ratio=ci.estimate, n=ci.n, per_value=values, lo=ci.lo, hi=ci.hi)
    if len(values) > 1:
        out["cv"] = float(np.std(values, ddof=1) / np.mean(values))
    out["a_step_s"] = float(np.median([r["a_s"] for r in use]))
    out["b_step_s"] = float(np.median([r["b_s"] for r in use]))
    return out


def combine(summaries: list[dict]) -> dict:
    """Several sessions' pair summaries (one per sweep seed) as one: geometric mean of the usable sessions' ratios,
    t interval across them (n = sessions), CV across them; with one usable session, that session's own. With none
    usable, the same over every session that has a ratio, marked `usable` False (no verdict may rest on it)."""
    good = [s for s in summaries if s.get("usable") and s.get("ratio")]
    if len(good) == 1:
        return dict(good[0], seeds=1, seeds_dropped=len(summaries) - 1)
    use = good or [s for s in summaries if s.get("ratio")]
    base = {"a": summaries[0]["a"] if summaries else None, "b": summaries[0]["b"] if summaries else None,
            "seeds": len(use), "seeds_dropped": len(summaries) - len(good), "level": "seeds", "usable": bool(good),
            "ratio": None, "lo": None, "hi": None, "cv": None, "n": len(use),
            "rounds": sum(s.get("rounds", 0) for s in summaries),
            "clean_rounds": sum(s.get("clean_rounds", 0) for s in summaries),
            "disturbed_rounds": sum(s.get("disturbed_rounds", 0) for s in summaries)}
    if not use:
        return base
    values = [s["ratio"] for s in use]
    ci = stats.geometric_mean_ci(values)
    base.update(ratio=ci.estimate, per_value=values, lo=ci.lo, hi=ci.hi,
                cv=float(np.std(values, ddof=1) / np.mean(values)) if len(values) > 1 else None)
    return base


def speed_words(s: dict, a: str | None = None, b: str | None = None) -> dict:
    """The comparison in the report's convention: "FAST is R× faster than SLOW [lo, hi]" (R >= 1, the faster one
    named); `conclusive` when the interval excludes 1 (no difference)."""
    a, b = a or s["a"], b or s["b"]
    r, lo, hi = s["ratio"], s.get("lo"), s.get("hi")
    if r >= 1:  # a's steps take longer: b is faster by r
        fast, slow, x, xlo, xhi = b, a, r, lo, hi
    else:
        fast, slow, x = a, b, 1 / r
        xlo, xhi = (None if hi is None else 1 / hi), (None if lo is None else 1 / lo)
    interval = f" [{xlo:.3g}, {xhi:.3g}]" if xlo is not None and xhi is not None else " (no interval)"
    conclusive = xlo is not None and xlo > 1
    return {"fast": fast, "slow": slow, "x": x, "lo": xlo, "hi": xhi, "conclusive": conclusive,
            "text": f"{fast} is {x:.3g}× faster than {slow}{interval}"}


def judge(s: dict) -> dict:
    """The speed verdict a summary (`pair_summary`, or `combine` over a sweep's seeds) can carry: one rule for
    every report. `level` is "ok" only for a usable timing whose interval excludes 1, from 3 or more seeds, whose
    ratios vary by at most CV_MAX (one pair of processes cannot show how much a process's own speed varies:
    docs/benchmarks.md); "neutral" for an inconclusive, thin or noisy one; "warn" for a timing mostly disturbed.
    Also: `label` (a pill), `claim` (the sentence's core), `over` (what the interval is over) and `notes` (what
    the verdict must say plainly)."""
    w = speed_words(s)
    seeds, cv = s.get("seeds", 1), s.get("cv")
    noisy = cv is not None and cv > CV_MAX
    if s["level"] == "seeds":
        over = f"across {seeds} seeds"
    elif s["level"] == "sessions":
        over = f"across {s['n']} sessions of one seed"
    else:
        over = f"over {s['n']} undisturbed of {s['rounds']} rounds of one seed" if s["usable"] else \
            f"over all {s['rounds']} rounds of one seed"
    if s.get("seeds_dropped"):
        over += f"; {s['seeds_dropped']} seed(s) left out (paired timing mostly disturbed)"
    notes = []
    if seeds < 3:
        notes.append(f"{seeds} seed{'s' if seeds != 1 else ''}, fewer than 3: the interval cannot show how much a "
                     "process's own speed varies")
    if noisy:
        notes.append(f"the paired ratios vary by {cv:.0%} (coefficient of variation over {CV_MAX:.0%}): noisy")
    elif cv is not None:
        over += f", coefficient of variation {cv:.1%}"
    if not s["usable"]:
        return {"level": "warn", "label": "speed: machine too busy", "over": over, "notes": [], "claim": (
            f"no verdict: {s['disturbed_rounds']} of {s['rounds']} paired rounds were disturbed by other work on the "
            f"machine, too many to rely on (all of them together say {w['text']})")}
    if not w["conclusive"]:
        return {"level": "neutral", "label": "speed: no clear difference", "over": over, "notes": notes,
                "claim": f"{w['text']}: the interval includes 1, so no clear difference"}
    label = f"speed: {w['fast']} {w['x']:.3g}× faster" + (" (noisy)" if noisy else "") + (
        f" ({seeds} seed{'s' if seeds != 1 else ''})" if seeds < 3 else "")
    return {"level": "neutral" if noisy or seeds < 3 else "ok", "label": label, "over": over, "notes": notes,
            "claim": w["text"]}


def headline(doc: dict) -> str:
    """One line per pair for the terminal: the ratio, its interval, the rounds behind it."""
    names = [c["name"] for c in doc.get("contenders") or []]
    parts = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            s = pair_summary(doc, a, b)
            if s["ratio"] is None:
                parts.append(f"{a} vs {b}: no paired rounds")
                continue
            note = "" if s["usable"] else "; mostly disturbed: no verdict"
            parts.append(f"{speed_words(s)['text']} ({s['clean_rounds']} undisturbed of {s['rounds']} rounds"
                         f"{note})")
    last = (doc.get("sessions") or [{}])[-1]
    if last.get("failure"):
        parts.append(f"last session failed: {last['failure']}")
    return "paired timing: " + ("; ".join(parts) or "none")


def status_text(doc: dict) -> str:
    """One line: how much paired timing the record holds."""
    n, clean = len(rounds_of(doc)), clean_rounds(doc)
    last = (doc.get("sessions") or [{}])[-1]
    failure = last.get("failure")
    if failure:
        return f"paired timing failed: {failure}"
    return f"{len(doc.get('sessions') or [])} session(s), {n} rounds, {clean} undisturbed"


def complete(doc: dict) -> bool:
    """Whether the record already holds the undisturbed rounds it wants (then no new session is started)."""
    return clean_rounds(doc) >= (doc.get("plan") or {}).get("rounds", ROUNDS)


def check_contenders(doc: dict, path: Path) -> None:
    """Every contender is a backend of a run directory (`<out>/runs/<run id>`) beside this record's `--out`: a
    record (written by the harness, but read back from disk) never makes the coordinator start anything else."""
    from harness.backends import check_names

    contenders = doc.get("contenders")
    if not isinstance(contenders, list) or len(contenders) < 2:
        raise UsageError(f"{str(path)!r} names fewer than two contenders; delete it to time again")
    for c in contenders:
        run_dir = Path(str(c.get("run_dir", "")))
        if run_dir.parent.name != "runs" or not records.RUN_ID_RE.match(run_dir.name) or not run_dir.is_dir():
            raise UsageError(f"{str(path)!r}: contender {c.get('name')!r} points at {str(run_dir)!r}, which is not a "
                             "run directory of the harness; delete the record to time again")
        check_names([str(c.get("backend"))])


# --- the coordinator -----------------------------------------------------------------------------------------------
class Child:
    """One timing process and its protocol pipe (JSON lines prefixed with MARK on its stdout)."""

    def __init__(self, contender: dict, env: dict, warmup_s: float):
        cmd = [sys.executable, "-m", "harness.paired", "serve", str(contender["run_dir"]), contender["backend"],
               repr(warmup_s)]
        self.name = contender["name"]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                     start_new_session=True, preexec_fn=pdeathsig)
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

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send({"quit": True})
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _env(contender: dict, threads: int | None) -> dict:
    compiles = bool((contender.get("options") or {}).get("compile"))
    return child_env(threads, Path(contender["run_dir"]) if compiles else None)


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
    (harness.records.RunLock is the same mechanism for a run directory, with its messages and clean-up.)"""

    def __init__(self, path: Path):
        self.path = Path(path).with_name(f".{Path(path).name}.lock")
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
    if path.exists():  # read under the lock: what another coordinator wrote before is kept
        doc = load(path)
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
    session: dict[str, Any] = {"started_at": _now(), "host": socket.gethostname(), "status": "running",
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
        children = [Child(c, _env(c, doc.get("threads")), p["warmup_s"]) for c in doc["contenders"]]
        for child in children:  # set-up and warm-up run in parallel; they are not timed against each other
            session["ready"][child.name] = child.receive(REPLY_TIMEOUT_S * 3)
        pids = [c.proc.pid for c in children]
        for child in children:
            child.send({"siblings": [p for p in pids if p != child.proc.pid]})
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
            session["finished_at"] = _now()
            doc["status"] = "completed" if n_clean >= wanted else session["status"]
            with contextlib.suppress(OSError):
                records.atomic_write_json(path, doc)
            for child in children:
                child.stop()
    _say(progress, f"{len(session['rounds'])} rounds, {n_clean} undisturbed in all; {path}")
    return doc


def _now() -> str:
    """The current UTC time as the records write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --- the timing process --------------------------------------------------------------------------------------------
def _reply(msg: dict) -> None:
    sys.stdout.write(MARK + json.dumps(msg) + "\n")
    sys.stdout.flush()


def serve(run_dir: Path, backend_name: str, warmup_s: float = WARMUP_S) -> int:
    """The timing process of one contender: set up, warm up, then run the bursts the coordinator asks for."""
    from harness.backends import create_backend
    from harness.runner import Curves, train, warm_up
    from harness.worker import Worker

    worker = Worker(Path(run_dir), backend_name)
    corpus = worker.load_inputs()
    options = worker.spec["backend_options"].get(backend_name, {})
    backend = create_backend(backend_name, **options)
    t0 = time.perf_counter()
    backend.setup(worker.config, worker.weights, corpus.vocab_size, worker.device, worker.seed)
    setup_s = time.perf_counter() - t0
    stream, config = worker.stream, worker.config
    compile_s = warm_up(backend, stream, 0)
    step, t0, last = 0, time.perf_counter(), []
    while step < WARMUP_STEPS or (time.perf_counter() - t0 < warmup_s and step < WARMUP_MAX):
        cv = Curves()
        train(backend, config, stream, {}, cv, step + 5, start_step=step, progress=False)
        step, last = step + 5, cv.time_s
    probe, _ = contention.default_probe(worker.device)
    _reply({"ready": True, "setup_s": setup_s, "compile_s": compile_s, "warmup_steps": step,
            "warmup_s": time.perf_counter() - t0, "step_s": float(np.median(last)), "next_step": step,
            "backend_info": backend.describe(), "pid": os.getpid(), "gpu_evidence": probe.gpu is not None})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("quit"):
            break
        if "siblings" in msg:
            if probe.gpu is not None:
                probe.gpu.siblings = set(msg["siblings"])
            continue
        start, n = int(msg["start"]), int(msg["burst"])
        cv = Curves()
        a = probe.snapshot()
        outcome = train(backend, config, stream, {}, cv, start + n, start_step=start, progress=False)
        b = probe.snapshot()
        if outcome.status != "completed":
            raise RuntimeError(f"{backend_name}: a timing burst did not complete: {outcome.status}")
        _reply({"start": start, "times": cv.time_s, "chunk": contention.chunk(a, b, start, n)})
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """`python -m harness.paired serve RUN_DIR BACKEND` (a timing process) or `python -m harness.paired run PATH`
    (a coordinator: one session for the record at PATH, as a SLURM job runs it)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if len(argv) in (3, 4) and argv[0] == "serve":
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
            return serve(Path(argv[1]), argv[2], float(argv[3]) if len(argv) == 4 else WARMUP_S)
        if len(argv) == 2 and argv[0] == "run":
            signal.signal(signal.SIGTERM, _interrupt)  # a SLURM time limit: keep the rounds measured so far
            doc = run(Path(argv[1]), progress=True)
            last = doc["sessions"][-1] if doc["sessions"] else {}
            return 1 if last.get("status") == "failed" else 0
    except UsageError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print("usage: python -m harness.paired serve RUN_DIR BACKEND [WARMUP_S] | run PAIRED.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
