"""Running the checks: each in a process of its own under OUT/checks/NAME/, within the budget, the summary written
after every one.

This process never holds a CUDA context (it would be "another process on the GPU" in every paired timing's
evidence): every check is a child, started in a session of its own with the parent-death signal (killed with this
process, even by SIGKILL), and a check stopped by its time limit or a signal is ended with its whole process group.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpucheck import preflight as pre
from gpucheck import schedule, summary
from gpucheck.judges import Outcome, last_lines
from gpucheck.plan import ROOT

RUNNING: set[subprocess.Popen] = set()  # the checks' processes now running (ended on a stop)
_LOCK = threading.Lock()


class Stop(Exception):
    """SIGINT or SIGTERM: end the running checks, write the summary, exit."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum: int, frame: Any) -> None:
    raise Stop(signum)


def _pdeathsig() -> None:
    """In the child between fork and exec: SIGTERM when this process dies (the harness's own parent-death signal,
    harness.run.processes.pdeathsig)."""
    from harness.run.processes import pdeathsig

    pdeathsig()


def end_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the check's process group (the harness command ends its workers), SIGKILL after `grace_s`: the
    harness's own `processes.stop`."""
    from harness.run.processes import stop

    stop([proc], signal.SIGTERM, grace_s)


def child(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int | None, str, str, bool]:
    """(exit status or None, stdout, stderr, timed out) of `argv` in a session of its own."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True, preexec_fn=_pdeathsig)
    with _LOCK:
        RUNNING.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err, False
    except subprocess.TimeoutExpired:
        end_group(proc)
        out, err = proc.communicate()
        return None, out, err, True
    finally:
        if proc.poll() is None:
            end_group(proc, grace_s=2.0)
        with _LOCK:
            RUNNING.discard(proc)


def in_process(args: list[str]) -> tuple[int | None, str, str]:
    """`harness ARGS` through harness.cli.main.main in this process, its output captured: a dry run's refusals of
    CUDA-only modes (refused before anything starts: no process, no torch import, no CUDA)."""
    sys.path.insert(0, str(ROOT))
    from harness.cli.main import main as harness_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = harness_main(args)
        except SystemExit as exc:  # argparse's own errors
            rc = exc.code if isinstance(exc.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


def fresh_dir(where: Path) -> None:
    """The check's directory, empty: an earlier attempt's is kept beside it as NAME.earlier (judges read only the
    new one)."""
    if where.exists():
        earlier = where.with_name(where.name + ".earlier")
        shutil.rmtree(earlier, ignore_errors=True)
        where.rename(earlier)
    where.mkdir(parents=True)


def execute(check: Any, where: Path, env: dict[str, str], timeout_s: float) -> Outcome:
    """Run one check in `where` (a harness command gets `--out where`), within `timeout_s`."""
    fresh_dir(where)
    argv = list(check.argv)
    if argv[1:3] == ["-m", "harness"] and argv[3] != "doctor":
        argv += ["--out", str(where)]
    (where / "command.txt").write_text(shlex.join(argv) + "\n")
    t0, timed_out = time.perf_counter(), False
    try:
        if check.refuse:
            rc, stdout, stderr = in_process(argv[3:])
        else:
            if check.prepare is not None:
                check.prepare(where)
            rc, stdout, stderr, timed_out = child(argv, where / check.cwd if check.cwd else where, env, timeout_s)
    except (OSError, ValueError) as exc:
        rc, stdout, stderr = None, "", f"could not run: {type(exc).__name__}: {exc}"
    finally:
        if check.cleanup is not None:
            check.cleanup(where)
    wall = time.perf_counter() - t0
    (where / "stdout.txt").write_text(stdout)
    (where / "stderr.txt").write_text(stderr)
    return Outcome(rc, wall, where, stdout, stderr, {"timed_out": timed_out})


STOPPING = threading.Event()  # set on SIGINT/SIGTERM: the checks still running are recorded as stopped


def stop_running() -> None:
    """A stop: every check still running is ended with its process group, and recorded as stopped."""
    STOPPING.set()
    for proc in list(RUNNING):
        end_group(proc, grace_s=5.0)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Session:
    """One call: the plan, every check's row (this call's and the earlier calls'), the budget and the clock."""

    def __init__(self, args: Any, checks: list[Any]) -> None:
        self.args, self.checks, self.out = args, checks, Path(args.out)
        prev = summary.load(self.out, args.dry_run)
        self.rows = summary.rows_by_name(prev)
        self.calls = [c for c in (prev or {}).get("calls", []) if isinstance(c, dict)]
        self.call: dict[str, Any] = {"call": len(self.calls) + 1, "started_at": now(), "budget_s": args.budget,
                                     "argv": list(args.argv), "environment": "", "wall_s": 0.0}
        self.t0 = time.perf_counter()
        self.current: dict[str, float] = {}  # checks running now: their start
        self.env = {**os.environ, "HARNESS_DATA": str(args.data), "PYTHONDONTWRITEBYTECODE": "1"}
        for c in checks:
            self.rows.setdefault(c.name, self.row(c, "not run", "not run yet"))

    def left(self) -> float | None:
        """Seconds of the budget left for checks (None: no budget)."""
        if self.args.budget is None:
            return None
        return self.args.budget - (time.perf_counter() - self.t0) - schedule.RESERVE_S

    def row(self, c: Any, result: str, text: str, **kw: Any) -> dict[str, Any]:
        return {"name": c.name, "tier": c.tier, "result": result, "summary": text, "estimate_s": c.estimate_s,
                "wall_s": kw.pop("wall_s", None), "call": self.call["call"], "at": now(), **kw}

    def set(self, c: Any, result: str, text: str, **kw: Any) -> None:
        with _LOCK:
            self.rows[c.name] = self.row(c, result, text, **kw)
            self.save()

    def save(self) -> None:
        self.call["wall_s"] = round(time.perf_counter() - self.t0, 1)
        doc = {"schema": summary.SCHEMA, "version": summary.VERSION, "dry_run": self.args.dry_run,
               "out": str(self.out), "calls": [*self.calls, self.call],
               "checks": [self.rows[c.name] for c in self.checks]}
        summary.write(self.out, doc)

    def failed(self) -> bool:
        return any(self.rows[c.name]["result"] == "FAIL" for c in self.checks)


def run_all(args: Any, checks: list[Any], selected: list[Any], explicit: set[str]) -> int:
    """The call: preflight, then every selected check without a result (or named by --only) that fits the budget,
    in order; the summary after each. Returns 1 when any check of the summary failed, else 0 (128 + the signal
    when stopped)."""
    s = Session(args, checks)
    STOPPING.clear()
    handlers = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        s.save()
        missing = run_preflight(s, selected)
        loop(s, todo(s, selected, explicit, missing))
    except Stop as stop:
        stop_running()
        s.call["stopped"] = str(stop)
        for name, t0 in list(s.current.items()):
            c = next(c for c in checks if c.name == name)
            s.set(c, "not run", f"stopped by {stop} after {time.perf_counter() - t0:.0f} s",
                  wall_s=round(time.perf_counter() - t0, 1), stopped=True)
        s.save()
        say(f"gpu check: stopped by {stop}; the summary holds what finished: {s.out / 'summary.md'}")
        return 128 + stop.signum
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    s.save()
    doc = summary.load(s.out, args.dry_run) or {}
    rest = "" if doc.get("complete") else (f"; {doc['not_run']} not run, {doc['skipped']} skipped: run the same "
                                           "command again (same --out) to continue")
    say(f"gpu check: {doc['passed']} passed, {doc['failed']} failed{rest} ({s.call['wall_s']:.0f} s) -> "
        f"{s.out / 'summary.md'}")
    return 1 if s.failed() else 0


def run_preflight(s: Session, selected: list[Any]) -> set[str]:
    """The preflight's lines on the console and its row; returns the parts missing."""
    c = next(c for c in s.checks if c.name == schedule.PREFLIGHT)
    t0 = time.perf_counter()
    s.current[c.name] = t0
    ok, text, figs, lines = pre.preflight(s.args, [c for c in selected if c.name != schedule.PREFLIGHT])
    s.current.pop(c.name)
    s.call["environment"] = figs.get("environment", "")
    say("preflight:\n" + "\n".join(lines))
    s.set(c, "PASS" if ok else "FAIL", text, wall_s=round(time.perf_counter() - t0, 1), figures=figs)
    return set(figs["missing"])


def todo(s: Session, selected: list[Any], explicit: set[str], missing: set[str]) -> list[Any]:
    """The checks this call will try, in order: selected, without a result (or named by --only), their parts
    found; the others get their rows (skipped: a missing part; --skip-long)."""
    parts = s.rows[schedule.PREFLIGHT].get("figures", {}).get("parts", {})
    pending, kept = [], 0
    for c in selected:
        if c.name == schedule.PREFLIGHT:
            continue
        if s.rows[c.name]["result"] in summary.DONE and c.name not in explicit:
            kept += 1
            continue
        lacking = sorted(c.needs & missing)
        if lacking and set(lacking) <= set(c.optional):  # it runs without them (a backend left out), saying so
            c = c.without({p: parts.get(p, {}).get("status", "missing") for p in lacking})
            lacking = []
        if lacking:
            why = "; ".join(f"{p}: {parts.get(p, {}).get('status', 'missing')}" for p in lacking)
            s.set(c, "skipped", f"needs {', '.join(lacking)} ({why})")
        elif c.long and s.args.skip_long:
            s.set(c, "skipped", "--skip-long")
        else:
            pending.append(c)
    if kept:
        say(f"gpu check: {kept} checks have a result from an earlier call (kept; --only NAME runs one again)")
    return pending


def loop(s: Session, pending: list[Any]) -> None:
    """Run the pending checks in order, each group only when its estimate fits the time left."""
    total, k = len(pending), 0
    while pending:
        left = s.left()
        group, over = schedule.pick(pending, left, s.args.jobs)
        for c in over:
            s.set(c, "not run", f"budget: needs about {c.estimate_s:.0f} s, {left:.0f} s left when its turn came")
            say(f"    {c.name}: not run: budget (about {c.estimate_s:.0f} s, {left:.0f} s left)")
        pending = [c for c in pending if c not in group and c not in over]
        for c in group:
            k += 1
            head = f"{'' if left is None else f', {left:.0f} s left'}"
            say(f"[{k}/{total}] tier {c.tier} {c.name} (about {c.estimate_s:.0f} s{head}): "
                f"{' '.join(c.argv[1:])[:150] or 'from the earlier checks'}")
        if len(group) == 1:
            run_one(s, group[0])
        elif group:
            pool = ThreadPoolExecutor(max_workers=len(group))
            try:
                list(pool.map(lambda c: run_one(s, c), group))
            except Stop:
                stop_running()  # before the pool waits for its threads, which wait for these processes
                raise
            finally:
                pool.shutdown(wait=True)


def run_one(s: Session, c: Any) -> None:
    """Run one check, judge it, record its row and say it (a failure with its last lines)."""
    if c.derive is not None:
        waiting = [a for a in c.after if s.rows[a]["result"] not in summary.DONE]
        if waiting:
            s.set(c, "not run", f"waits for {', '.join(waiting)} (no result yet)")
            say(f"    {c.name}: not run: waits for {', '.join(waiting)}")
            return
        ok, text, figs = c.derive(s.rows)
        s.set(c, "PASS" if ok else "FAIL", text, wall_s=0.0, figures=figs)
        say(f"    {c.name}: {'PASS' if ok else 'FAIL'}: {text}")
        return
    left = s.left()
    timeout = c.timeout_s if left is None else max(1.0, min(c.timeout_s, left))
    s.current[c.name] = time.perf_counter()
    o = execute(c, s.out / "checks" / c.name, s.env, timeout)
    s.current.pop(c.name, None)
    if STOPPING.is_set():
        return
    wall, cmd = round(o.wall_s, 1), c.argv
    if o.extra.get("timed_out") and timeout < c.timeout_s:
        s.set(c, "not run", f"stopped at the end of the budget after {wall:.0f} s (about {c.estimate_s:.0f} s "
              "expected); it runs again in the next call", wall_s=wall, stopped=True, command=cmd)
        say(f"    {c.name}: not run: stopped at the end of the budget after {wall:.0f} s")
        return
    if o.extra.get("timed_out"):
        ok, text, figs = False, f"timed out after {timeout:.0f} s: {last_lines(o)[0]}", {}
    else:
        ok, text, figs = (c.judge)(c, o)
    if c.left_out:
        text = f"{c.left_out}; {text}"
    tail = [] if ok else last_lines(o, 8)
    s.set(c, "PASS" if ok else "FAIL", text, wall_s=wall, rc=o.rc, command=cmd, figures=figs, tail=tail)
    say(f"    {c.name}: {'PASS' if ok else 'FAIL'} in {wall:.1f} s: {text[:200]}")
    for line in tail:
        say(f"      | {line}")
