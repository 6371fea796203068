"""The child's side of every process the harness starts: which kinds there are, its tie to its parent, the test hook.

Every child is the same program, `python -m harness --worker KIND ARGS...` (pyperf's model: the `harness` command
with a hidden flag; `harness.run.processes.child_command` builds the command line, `harness/__main__.py` dispatches).
This module imports nothing heavy, so that the entry point can check its parent, and a test can stop the worker at
"start", before any framework is imported.

Test hook: `HARNESS_TEST_PAUSE_AT=<point>[:<action>[:<n>]]` makes the worker act at the n-th (default first) time
it passes a named point of its life. Points: start (every other child kind passes its own before its imports:
timed-start, paired-start, bench-start), before-record, after-record, mid-checkpoint (temporary file
complete, not yet renamed), after-checkpoint (checkpoint renamed, record not yet rewritten), final-persist (CSVs
written, record not), end (everything written). Actions: stop (SIGSTOP itself), kill (SIGKILL itself), term
(SIGTERM itself), hang (block SIGTERM/SIGINT and sleep: a wedged worker), sleep (sleep, signals still work).
"""

from __future__ import annotations

import os
import signal
import sys
import time

WORKER_FLAG = "--worker"  # `python -m harness --worker KIND ...`: hidden from `harness --help`
# train: one backend's training (harness.run.worker); timed: a paired timing's timed process (harness.run.timed);
# paired: a paired-timing coordinator, as a SLURM job runs it (harness.run.paired_timing); bench: one measurement of
# `harness bench` in a fresh interpreter (harness.bench.overhead); parts: one backend's timed process of `harness
# bench parts` (harness.bench.parts_process)
KINDS = ("train", "timed", "paired", "bench", "parts")
PARENT_PID_ENV = "HARNESS_PARENT_PID"  # set by harness.run.processes.spawn; not passed further down


def check_parent(kind: str) -> None:
    """Stop now (exit status 130) if the process that started this child is already gone.

    The parent asks for PR_SET_PDEATHSIG at spawn (harness.run.processes.pdeathsig, before the child's first
    instruction); a parent that died between the fork and that request sends no signal, so the child compares its
    parent with the one named in HARNESS_PARENT_PID. A child started without it (a SLURM job's) skips the check."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent and parent.isdigit() and os.getppid() != int(parent):
        who = "worker" if kind == "train" else f"{kind} process"
        print(f"harness {who}: the harness process that started this {who} is gone; stopping", file=sys.stderr)
        sys.exit(130)


_passed: dict[str, int] = {}


def pause_at(point: str) -> None:
    """The test hook (see the module docstring); does nothing unless HARNESS_TEST_PAUSE_AT names `point`."""
    want = os.environ.get("HARNESS_TEST_PAUSE_AT")
    if not want:
        return
    parts = want.split(":")
    name, action, nth = parts[0], (parts[1:2] or ["stop"])[0], (parts[2:3] or ["1"])[0]
    if name != point:
        return
    _passed[point] = _passed.get(point, 0) + 1
    if _passed[point] != int(nth):
        return
    print(f"harness worker: test hook: {action} at {point}", file=sys.stderr, flush=True)
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif action == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        time.sleep(3600)
    elif action == "sleep":
        time.sleep(float(os.environ.get("HARNESS_TEST_PAUSE_S", "3600")))
