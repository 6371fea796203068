"""No orphans: every command that starts children ends them all when it is stopped (SIGINT or SIGTERM, within
seconds), and every child, the busy-loop hogs of `harness bench noise` included, ends with the harness even when it
is killed with SIGKILL (the parent-death signal, harness.run.processes).

Each test starts a real command in its own session, lets its children stop at a named point of their life
(HARNESS_TEST_PAUSE_AT, harness.run.child: no sleeping), sends the signal at a moment, and then finds no process
left: none of the command's descendants seen before the signal, and none in their sessions (walked in /proc).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import data_path

QUIET = ["--quiet", "--no-text"]


# --- /proc ----------------------------------------------------------------------------------------------------------
def table() -> dict[int, tuple[str, int, int, str]]:
    """Every live process: pid -> (state, parent, session, command line)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            out[int(stat.parent.name)] = (fields[0], int(fields[1]), int(fields[3]), cmd)
    return out


def descendants(pid: int) -> dict[int, str]:
    """The live descendants of `pid`: pid -> command line."""
    procs = table()
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (_, ppid, _, cmd) in procs.items():
            if ppid == parent and child not in found:
                found[child] = cmd
                frontier.append(child)
    return found


def left(pids: set[int], sessions: set[int]) -> dict[int, str]:
    """Which of `pids`, or of any process in `sessions`, is still alive."""
    return {p: cmd for p, (_, _, sid, cmd) in table().items() if p in pids or sid in sessions}


def wait_for(predicate: Callable[[], object], timeout: float = 90.0, what: str = "") -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def start(argv: list[str], pause: str) -> subprocess.Popen:
    env = dict(os.environ, HARNESS_DATA=str(data_path()), PYTHONUNBUFFERED="1", HARNESS_TEST_PAUSE_AT=pause,
               HARNESS_KILL_GRACE_S="5")
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=heard)


def heard() -> None:
    """The command hears SIGINT as from a terminal, also where the suite itself was started with SIGINT ignored (in
    the background of a script)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def harness(*args: str) -> list[str]:
    return [sys.executable, "-m", "harness.cli", *args]


def signal_and_check(proc: subprocess.Popen, ready: Callable[[dict[int, str]], bool], sig: int,
                     within_s: float = 20.0) -> None:
    """Once `ready(descendants)`, send `sig` to the command; then nothing it started may be left (a test that fails
    still kills what it found, by pid)."""
    kids: dict[int, str] = {}
    sessions = {proc.pid}
    try:
        kids = wait_for(lambda: (lambda d: d if ready(d) else None)(descendants(proc.pid)), what="the children")
        procs = table()
        sessions |= {procs[p][2] for p in kids if p in procs}
        os.kill(proc.pid, sig)
        proc.wait(timeout=within_s)
        try:
            wait_for(lambda: not left(set(kids), sessions), timeout=within_s, what="the children to end")
        except AssertionError:
            raise AssertionError(f"still running {within_s:g} s after {signal.Signals(sig).name}: "
                                 f"{left(set(kids), sessions)}") from None
    finally:
        for pid in {*descendants(proc.pid), *left(set(kids), sessions), proc.pid}:  # only what this test started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def worker_paused(d: dict[int, str], kind: str = "train", n: int = 1) -> bool:
    return sum(f"--worker {kind}" in cmd for cmd in d.values()) >= n


# --- the mechanism --------------------------------------------------------------------------------------------------
def test_a_child_started_from_another_thread_is_refused() -> None:
    import threading

    from harness.run import processes

    errors: list[BaseException] = []

    def from_a_thread() -> None:
        try:
            processes.start(["true"])
        except RuntimeError as exc:
            errors.append(exc)
    thread = threading.Thread(target=from_a_thread)
    thread.start()
    thread.join()
    assert errors and "main thread" in str(errors[0])


READY = "import signal, time; {}print('ready', flush=True); time.sleep(600)"


def test_ending_stops_every_child_whatever_ends_the_block() -> None:
    """Each child is asked with SIGINT first, and hears it even where the harness itself ignores SIGINT (started in
    the background of a script): only the deaf one is killed."""
    from harness.run import processes

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        children = _two_children_ended(processes)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [p.returncode for p in children] in ([1, -signal.SIGKILL], [-signal.SIGINT, -signal.SIGKILL]), children


def _two_children_ended(processes: Any) -> list[subprocess.Popen]:
    with pytest.raises(KeyboardInterrupt), processes.ending(grace_s=0.5) as children:
        children.append(processes.start([sys.executable, "-c", READY.format("")], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True))
        children.append(processes.start([sys.executable, "-c", READY.format(  # deaf to SIGINT: SIGKILL after 0.5 s
            "signal.signal(signal.SIGINT, signal.SIG_IGN); ")], stdout=subprocess.PIPE, text=True))
        assert [c.stdout.readline() for c in children] == ["ready\n"] * 2  # each is running its own code
        raise KeyboardInterrupt
    for child in children:
        child.stdout.close()
    return children


# Where a process may start (relative to harness/): through harness.run.processes (own session, parent-death signal,
# `stop`), or as a bounded probe (`subprocess.run` with a timeout, which kills its child on any exception, Ctrl-C
# included: nvidia-smi, git, a version or readiness check)
POPEN_ALLOWED = {"run/processes.py": "the one helper (start, spawn)",
                 "sweep/slurm.py": "the worker inside a SLURM job, with the parent-death signal in its preexec_fn"}
NEVER = {("os", "system"), ("os", "popen"), ("os", "fork"), ("os", "forkpty"), ("os", "posix_spawn"),
         ("os", "spawnv"), ("os", "spawnl"), ("subprocess", "call"), ("subprocess", "check_call"),
         ("subprocess", "check_output"), ("subprocess", "getoutput"), ("asyncio", "create_subprocess_exec")}


def test_every_child_starts_through_the_one_helper() -> None:
    """No module of the harness starts a process of its own (subprocess.Popen) but harness.run.processes (and the
    SLURM job's worker), and every other process it runs is a bounded probe (subprocess.run with a timeout): a new
    child that could outlive its command fails here (the tests above signal each command that starts children)."""
    import ast

    root = Path(__file__).resolve().parent.parent / "harness"
    found = []
    for path in sorted(root.rglob("*.py")):
        rel, text = path.relative_to(root).as_posix(), path.read_text()
        if not any(word in text for word in ("subprocess", "multiprocessing", "os.")):
            continue
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)):
                continue
            call = (node.func.value.id, node.func.attr)
            own = call == ("subprocess", "Popen") and rel not in POPEN_ALLOWED
            unbounded = call == ("subprocess", "run") and not any(k.arg == "timeout" for k in node.keywords)
            if own or unbounded or call in NEVER or call[0] == "multiprocessing":
                found.append(f"{rel}:{node.lineno}: {'.'.join(call)}")
    assert not found, found


# --- bench noise: its legs and its hogs -----------------------------------------------------------------------------
NOISE = ["bench", "noise", "--backend", "numpy,torch", "--size", "small", "--seeds", "1", "--steps", "2",
         "--run-steps", "2", "--hogs", "1", "--quiet"]


@pytest.mark.parametrize("sig,moment", [(signal.SIGINT, "worker"), (signal.SIGTERM, "leg"),
                                        (signal.SIGKILL, "worker")])
def test_bench_noise_leaves_nothing_running(sig: int, moment: str, tmp_path: Path) -> None:
    """Stopped while its first leg (`harness sweep`) is starting, or while that leg's worker runs: the leg and its
    worker end too. Before, a SIGINT left the sweep and its workers running."""
    proc = start(harness(*NOISE, "--out", str(tmp_path)), "start:sleep")
    signal_and_check(proc, (lambda d: worker_paused(d)) if moment == "worker" else
                     (lambda d: any("harness.cli sweep" in c for c in d.values())), sig)


LEG = """
import signal, sys
from harness.bench.noise import Hogs, _harness
signal.signal(signal.SIGTERM, signal.default_int_handler)  # as the CLI does
_harness(sys.argv[1:], Hogs(2, 0.0, None), True)
"""


def test_the_hogs_of_a_noise_leg_end_with_it_even_when_it_is_killed(tmp_path: Path, config_file: Path) -> None:
    """A disturbed leg of `harness bench noise` (its `harness run` and two busy-loop hogs), as the benchmark runs
    it: killed with SIGKILL, its hogs and its leg end (before, they burned both cores for good). (Ctrl-C ends the
    hogs in the leg's `finally`; the SIGINT tests above stop a leg.)"""
    proc = start([sys.executable, "-c", LEG, "run", "--config", str(config_file), "--steps", "5", "--backend",
                  "numpy", *QUIET, "--no-report", "--out", str(tmp_path)], "start:sleep")
    signal_and_check(proc, lambda d: worker_paused(d) and sum("while True" in c for c in d.values()) == 2,
                     signal.SIGKILL)


# --- sweeps, bench overhead, the paired timing ----------------------------------------------------------------------
@pytest.mark.parametrize("sig,jobs", [(signal.SIGTERM, "2"), (signal.SIGKILL, "2"), (signal.SIGINT, "1")])
def test_a_sweep_leaves_nothing_running(sig: int, jobs: str, tmp_path: Path, config_file: Path) -> None:
    proc = start(harness("sweep", "--config", str(config_file), "--backend", "numpy", "--seeds", "2", "--steps", "3",
                         "--jobs", jobs, "--yes", "--no-report", *QUIET, "--out", str(tmp_path)), "start:sleep")
    signal_and_check(proc, lambda d: worker_paused(d, n=int(jobs)), sig)


def test_bench_overhead_leaves_nothing_running(tmp_path: Path) -> None:
    """SIGTERM while its isolated child runs (a SIGKILL reaches that child by the parent-death signal of `spawn`, as
    a sweep's workers above)."""
    proc = start(harness("bench", "overhead", "--backend", "numpy", "--size", "small", "--isolate", "--quiet",
                         "--out", str(tmp_path)), "bench-start:sleep")
    signal_and_check(proc, lambda d: worker_paused(d, "bench"), signal.SIGTERM)


@pytest.fixture
def two_backends(tmp_path: Path) -> tuple[Path, str]:
    """(out, run id) of a completed torch + numpy run (synthetic records) without its paired timing: its timing
    processes stop before they import anything, so nothing of it is ever trained."""
    from tests.test_report import make_run

    return tmp_path, make_run(tmp_path, steps=10)


def test_the_paired_timing_leaves_nothing_running(two_backends: tuple[Path, str]) -> None:
    """Ctrl-C while both timing processes start (stopped before they answer): they end within seconds (before, one
    after the other, 10 s each). A SIGKILL reaches them by the parent-death signal, as every child above."""
    out, run_id = two_backends
    proc = start(harness("resume", run_id, "--paired-rounds", "2", "--quiet", "--no-report", "--out", str(out)),
                 "timed-start:sleep")
    signal_and_check(proc, lambda d: worker_paused(d, "timed", 2), signal.SIGINT)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_bench_parts_leaves_nothing_running(sig: int, tmp_path: Path) -> None:
    """Stopped while both of its timed processes start (stopped before they import a framework): both end within
    seconds, and its record says "interrupted"."""
    proc = start(harness("bench", "parts", "--backend", "numpy,torch", "--size", "small", "--quiet",
                         "--out", str(tmp_path)), "parts-start:sleep")
    signal_and_check(proc, lambda d: worker_paused(d, "parts", 2), sig)
    assert proc.returncode != 0
    records = list(tmp_path.glob("bench/**/*.json"))
    assert records and all('"status": "interrupted"' in r.read_text() for r in records), records
