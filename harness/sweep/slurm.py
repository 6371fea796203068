"""The SLURM executor: one job per cell through submitit (no hand-written sbatch scripts).

Each job runs the ordinary worker (`python -m harness.worker RUN_DIR BACKEND --resume`) on a node that sees the same
filesystem, so the RunRecord lands under `--out` as on this machine. The callable is a
`submitit.helpers.Checkpointable`: when SLURM signals a time limit or a preemption, submitit calls `checkpoint()`,
which stops the worker (it saves its record) and resubmits the same cell; the requeued job's worker resumes from
the cell's last `--checkpoint-every` checkpoint, not from step 0.

Status without accounting: submitit's `SlurmInfoWatcher` asks `sacct`; where accounting is off (`sacct` prints
"Slurm accounting storage is disabled") it logs "Bypassing sacct error ..., status may be inaccurate" at every
poll and reports every job as UNKNOWN forever, so `job.done()` never turns true for a job that ended without a
result (e.g. cancelled) and `job.result()` would wait for ever. This executor therefore never asks the watcher:
a job is over when submitit's result file exists or when `squeue` no longer lists it as alive, and the cell's state
then comes from its RunRecord.
"""

from __future__ import annotations

import contextlib
import getpass
import io
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import submitit

from harness import launch, records
from harness.errors import UsageError
from harness.sweep.executors import Notify, paired_command, worker_command

ALIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
         "SUSPENDED", "STAGE_OUT", "SIGNALING", "STOPPED"}
STOP_WAIT_S = 30.0  # how long checkpoint() waits for the worker to save its record


def _run(cmd: list[str], timeout: float = 20) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def check_cluster(partition: str | None) -> None:
    """UsageError unless sbatch exists, the controller answers and `partition` (when given) is one of its partitions."""
    if shutil.which("sbatch") is None or shutil.which("squeue") is None:
        raise UsageError("--executor slurm: no sbatch/squeue on PATH; run on a SLURM login node, or use "
                         "--executor local")
    done = _run(["sinfo", "-h", "-o", "%P"])
    if done is None or done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no answer"])[0] if done else "no answer"
        raise UsageError(f"--executor slurm: the SLURM controller does not answer `sinfo` ({why}); start it or "
                         "use --executor local")
    partitions = [p.strip().rstrip("*") for p in done.stdout.split() if p.strip()]
    if partition is not None and partition not in partitions:
        raise UsageError(f"unknown SLURM partition {partition!r}; this cluster has: {', '.join(partitions) or 'none'}")


def job_states(job_ids: list[str]) -> dict[str, str] | None:
    """{job id: SLURM state} of this user's jobs known to squeue (recently ended ones too); None if squeue fails."""
    if not job_ids:
        return {}
    done = _run(["squeue", "-h", "--states=all", "-u", getpass.getuser(), "-o", "%i|%T"])
    if done is None or done.returncode != 0:
        return None
    states = {}
    for line in done.stdout.splitlines():
        jid, _, state = line.strip().partition("|")
        if jid:
            states[jid] = state.strip()
    return {j: states[j] for j in job_ids if j in states}


def is_alive(state: str | None) -> bool:
    return state is not None and state.split()[0].rstrip("+") in ALIVE


class CellJob(submitit.helpers.Checkpointable):
    """One cell on a SLURM node: the worker in a child process; checkpoint() stops it and resubmits with resume.

    `command` replaces the worker's command line (a paired-timing entry: `executors.paired_command`, which starts
    every contender on this one node); stopped and resubmitted the same way (it keeps the rounds measured)."""

    def __init__(self, run_dir: str, backend: str, threads: int | None = None, command: list[str] | None = None):
        self.run_dir, self.backend, self.threads, self.command = run_dir, backend, threads, command
        self._proc: subprocess.Popen | None = None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_proc"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._proc = None

    def __call__(self) -> int:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **launch.thread_env(self.threads))
        cmd = getattr(self, "command", None) or worker_command(Path(self.run_dir), self.backend, True)
        self._proc = subprocess.Popen(cmd, env=env)
        while True:
            try:  # polling (not a blocking wait) so that checkpoint() may run in a signal handler meanwhile
                return self._proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                continue

    def checkpoint(self, *args: object, **kwargs: object) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on a time limit or preemption: stop the worker, resubmit this cell (it resumes)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the worker saves its record (status interrupted) and exits
            deadline = time.monotonic() + STOP_WAIT_S
            while time.monotonic() < deadline and _running(proc.pid):
                time.sleep(0.2)
        return submitit.helpers.DelayedSubmission(CellJob(self.run_dir, self.backend, self.threads,
                                                          getattr(self, "command", None)))


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie awaiting its parent's wait counts as finished)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class SlurmExecutor:
    """One SLURM job per cell (submitit); waits for them unless `wait` is False (then `--status` follows them)."""

    kind = "slurm"

    def __init__(self, folder: Path, partition: str | None = None, gpus_per_job: int | None = None,
                 cpus_per_job: int | None = None, mem_gb: float | None = None, time_min: int = 60,
                 sbatch: list[str] | None = None, wait: bool = True, poll_s: float = 5.0):
        self.folder, self.wait, self.poll_s = Path(folder), wait, poll_s
        self.params: dict = {"time": time_min, "signal_delay_s": 90}
        if partition:
            self.params["partition"] = partition
        if gpus_per_job:
            self.params["gpus_per_node"] = gpus_per_job
        if cpus_per_job:
            self.params["cpus_per_task"] = cpus_per_job
        if mem_gb:
            self.params["mem"] = f"{math.ceil(mem_gb * 1024)}M"  # sbatch --mem takes whole units, not "1.5"
        extra = parse_sbatch(sbatch or [])
        if extra:
            self.params["additional_parameters"] = extra

    def submit(self, out: Path, cell: dict) -> str:
        """Submit one cell (or paired-timing entry); returns its SLURM job id."""
        executor = submitit.SlurmExecutor(folder=self.folder)
        if cell.get("kind") == "paired":  # every contender alive at once on one node: their memory together
            params = dict(self.params)
            if params.get("mem"):
                params["mem"] = params["mem"] * len(cell["members"])
            executor.update_parameters(job_name=f"harness-paired-{cell['index']}", **params)
            job = executor.submit(CellJob(str(out), "paired", cell.get("threads"), paired_command(out, cell)))
            return str(job.job_id)
        executor.update_parameters(job_name=f"harness-{cell['index']}", **self.params)
        said = io.StringIO()  # submitit copies sbatch's stderr to ours; a refusal becomes one line instead
        try:
            with contextlib.redirect_stderr(said):
                job = executor.submit(CellJob(str(records.run_dir(out, cell["run_id"])), cell["backend"],
                                              cell.get("threads")))
        except (submitit.core.utils.FailedJobError, subprocess.CalledProcessError) as exc:
            why = next((line.strip() for line in (said.getvalue() or str(exc)).splitlines() if line.strip()), "")
            raise UsageError(f"sbatch refused cell {cell['key']} ({why[:300]}); fix the SLURM options "
                             "(--partition, --mem-gb, --sbatch, ...) and continue with `harness sweep --resume`"
                             ) from None
        if said.getvalue().strip():
            print(said.getvalue().rstrip(), file=sys.stderr)  # a warning from sbatch on success is kept
        return str(job.job_id)

    def run(self, out: Path, cells: list[dict], notify: Notify) -> int:
        for cell in cells:
            job_id = self.submit(out, cell)
            cell.setdefault("job_ids", []).append(job_id)
            notify(cell, "queued")
        if not self.wait:
            return 0
        return self.follow(cells, notify)

    def follow(self, cells: list[dict], notify: Notify) -> int:
        """Wait until every cell's job is over (result file written, or squeue no longer lists it as alive)."""
        pending = {cell["job_ids"][-1]: cell for cell in cells}
        seen_running: set[str] = set()
        failures = 0
        try:
            while pending:
                states = job_states(list(pending))
                if states is None:
                    failures += 1
                    if failures in (1, 10) or failures % 60 == 0:  # say so, but never once per poll
                        print(f"sweep: squeue did not answer ({failures}x); still waiting", file=sys.stderr)
                for jid, cell in list(pending.items()):
                    state = None if states is None else states.get(jid)
                    result = self.folder / f"{jid}_0_result.pkl"
                    if result.exists() or (states is not None and not is_alive(state)):
                        del pending[jid]
                        notify(cell, "finished")
                    elif state and state.startswith("RUNNING") and jid not in seen_running:
                        seen_running.add(jid)
                        notify(cell, "running")
                if pending:
                    time.sleep(self.poll_s)
        except KeyboardInterrupt:
            print(f"sweep: stopped waiting; {len(pending)} job(s) continue on the cluster "
                  "(follow them with `harness sweep --status ID`)", file=sys.stderr)
            return 130
        return 0


def parse_sbatch(items: list[str]) -> dict[str, object]:
    """`--sbatch account=abc --sbatch exclusive` -> {"account": "abc", "exclusive": True} (sbatch's long options)."""
    extra: dict[str, object] = {}
    for item in items:
        key, sep, value = item.lstrip("-").partition("=")
        if not key:
            raise UsageError(f"--sbatch {item!r}: write an sbatch long option, KEY=VALUE or KEY (e.g. account=abc)")
        extra[key.replace("-", "_")] = value if sep else True
    return extra
