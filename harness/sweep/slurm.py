"""The SLURM executor: the cells as job arrays through submitit (no hand-written sbatch scripts).

All the cells of one submission go to sbatch as ONE job array (`executor.batch()`; job ids `JOBID_0` ..
`JOBID_{n-1}`, in the order of the cells), so a 1000-cell sweep is one job for the scheduler (clusters limit
`MaxSubmitJobs`), and `--array-parallelism N` caps how many elements run at once. More cells than the cluster's
`MaxArraySize` become several arrays; a single cell is a plain job.

Each element runs the ordinary worker (`python -m harness --worker train RUN_DIR BACKEND --resume`) on a node that sees
the same filesystem, so the RunRecord lands under `--out` as on this machine. The callable is a
`submitit.helpers.Checkpointable`: when SLURM signals a time limit or a preemption, submitit calls `checkpoint()`,
which stops the worker (it saves its record) and requeues that element alone (`scontrol requeue JOBID_i`); the
requeued worker resumes from the cell's last `--checkpoint-every` checkpoint, not from step 0.

Before anything is written, the job script submitit would write is shown to `sbatch --test-only`
(`check_submission`): an option sbatch does not know or a value it refuses is one line with sbatch's own reason.
Should sbatch still refuse the real submission, `SubmissionError` carries that reason and the sweep command removes
what it had prepared. Security: every setting was checked by harness.sweep.settings (no newline, no option name of
its own making); the pickles under `<out>/sweeps/<id>/slurm/` are code that the jobs run, so `--out` must be a
directory only you can write.

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
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import submitit
from submitit.core.utils import FailedJobError, FailedSubmissionError

from harness.errors import UsageError
from harness.run.processes import child_env, pdeathsig
from harness.store import os_error_message
from harness.store.sweep import PairedEntry, SlurmSettings, SweepCell
from harness.sweep.executors import Notify, cell_run, paired_command, worker_command
from harness.sweep.settings import DEFAULT_TIME_MIN, check_text, parse_sbatch

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


def max_array_size() -> int:
    """How many elements one job array may have on this cluster (`MaxArraySize`; SLURM's default 1001)."""
    done = _run(["scontrol", "show", "config"])
    found = re.search(r"^MaxArraySize\s*=\s*(\d+)", done.stdout if done else "", re.MULTILINE)
    return max(1, int(found.group(1))) if found else 1001


def sbatch_reason(text: str) -> str:
    """sbatch's reason for a refusal, on one line (its error lines, without the "Try sbatch --help" advice)."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip() and not ln.strip().startswith("Try ")]
    errors = [ln for ln in lines if "error" in ln.lower() or "unrecognized" in ln.lower() or "invalid" in ln.lower()]
    return "; ".join(errors or lines[:1]) or "no reason given"


def job_states(job_ids: list[str]) -> dict[str, str] | None:
    """{job id: SLURM state} of this user's jobs known to squeue (recently ended ones too), one entry per array
    element (`JOBID_i`); None if squeue fails."""
    if not job_ids:
        return {}
    done = _run(["squeue", "-h", "-r", "--states=all", "-u", getpass.getuser(), "-o", "%i|%T"])
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
        env = child_env(self.threads)
        # SLURM sends the time-limit signal (USR2) to every process of the job step, the worker included, whose
        # default action would kill it on the spot (record left "running"): the worker ignores it, and
        # checkpoint() below stops it with SIGTERM, so it saves its record first
        cmd = getattr(self, "command", None) or worker_command(Path(self.run_dir), self.backend, True)
        self._proc = subprocess.Popen(cmd, env=env, preexec_fn=_ignore_requeue_signal)
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


def _ignore_requeue_signal() -> None:  # runs in the worker between fork and exec; SIG_IGN survives exec
    signal.signal(submitit.JobEnvironment._usr_sig(), signal.SIG_IGN)
    pdeathsig()  # and, as every child of the harness, it stops if the job's own process dies


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie awaiting its parent's wait counts as finished)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class SubmissionError(UsageError):
    """sbatch refused a submission (its reason in the message); `submitted` cells had been submitted before."""

    def __init__(self, message: str, submitted: int = 0):
        super().__init__(message)
        self.submitted = submitted


class SlurmExecutor:
    """The cells as job arrays (submitit); waits for them unless `wait` is False (`harness status` follows them)."""

    kind = "slurm"

    def __init__(self, folder: Path, partition: str | None = None, gpus_per_job: int | None = None,
                 cpus_per_job: int | None = None, mem_gb: float | None = None, time_min: int = DEFAULT_TIME_MIN,
                 sbatch: list[str] | None = None, array_parallelism: int | None = None, wait: bool = True,
                 poll_s: float = 5.0, job_name: str = "harness"):
        check_text(str(Path(folder).resolve()), "--out")  # a stored sweep's folder goes into the job script too
        check_text(job_name, "the sweep's name")  # #SBATCH --job-name=...: the manifest's schema holds it too
        self.folder, self.wait, self.poll_s, self.job_name = Path(folder), wait, poll_s, job_name
        self.params: dict = {"time": time_min, "signal_delay_s": 90}
        if partition:
            self.params["partition"] = partition
        if gpus_per_job:
            self.params["gpus_per_node"] = gpus_per_job
        if cpus_per_job:
            self.params["cpus_per_task"] = cpus_per_job
        self.mem_mb = math.ceil(mem_gb * 1024) if mem_gb else None
        if self.mem_mb:
            self.params["mem"] = f"{self.mem_mb}M"  # sbatch --mem takes whole units, not "1.5"
        if array_parallelism:
            self.params["array_parallelism"] = array_parallelism
        extra = parse_sbatch(sbatch or [])
        if extra:
            self.params["additional_parameters"] = extra

    @classmethod
    def from_settings(cls, folder: Path, slurm: SlurmSettings, wait: bool = True,
                      job_name: str = "harness") -> SlurmExecutor:
        """From the `slurm` settings of a sweep (already checked by harness.sweep.settings)."""
        return cls(folder, partition=slurm.partition, gpus_per_job=slurm.gpus_per_job,
                   cpus_per_job=slurm.cpus_per_job, mem_gb=slurm.mem_gb,
                   time_min=slurm.time_min or DEFAULT_TIME_MIN, sbatch=slurm.sbatch,
                   array_parallelism=slurm.array_parallelism, wait=wait, job_name=job_name)

    def params_for(self, members: int = 0) -> dict:
        """The sbatch parameters of a training array (`members` 0) or of the paired timings' array whose elements
        hold up to `members` contenders each: those all run at once on one node, so its memory is theirs together."""
        params = dict(self.params)
        if members and self.mem_mb:
            params["mem"] = f"{self.mem_mb * members}M"
        return params

    def script(self, n_cells: int, members: int = 0) -> str:
        """The job script submitit writes for an array of `n_cells` (a plain job for one), as sbatch reads it; with
        `members`, the paired timings' array, each element holding that many contenders' memory."""
        from submitit.slurm.slurm import _make_sbatch_string

        params = self.params_for(members)
        executor = submitit.SlurmExecutor(folder=self.folder)
        executor.update_parameters(job_name=self.job_name, **params)  # submitit's own checks of the names
        return _make_sbatch_string(command="true", folder=executor.folder, map_count=n_cells if n_cells > 1 else None,
                                   **executor.parameters)

    def check_submission(self, n_cells: int, paired: tuple[int, int] | None = None) -> None:
        """Ask `sbatch --test-only` whether it would accept these cells' job array and, with `paired` (entries,
        most contenders in one), the paired timings' array (nothing is submitted or written under --out); a refusal
        is a UsageError with sbatch's reason."""
        jobs = [("this sweep's jobs", min(n_cells, max_array_size()), 0)] if n_cells else []
        if paired and paired[0]:
            jobs.append(("this sweep's paired timings", min(paired[0], max_array_size()), paired[1]))
        for what, n, members in jobs:
            try:
                text = self.script(n, members)
            except (ValueError, TypeError) as exc:
                raise UsageError(f"submitit refuses the SLURM settings ({str(exc).splitlines()[0]}); fix the [slurm] "
                                 "settings or the flags") from None
            with tempfile.TemporaryDirectory(prefix="harness-sbatch-") as tmp:
                path = Path(tmp) / "job.sh"
                path.write_text(text, encoding="utf-8")
                done = _run(["sbatch", "--test-only", str(path)])
            if done is None:
                raise UsageError("sbatch --test-only did not answer within 20 s; check the SLURM controller, or use "
                                 "--executor local")
            if done.returncode != 0:
                raise UsageError(f"sbatch refuses {what}: {sbatch_reason(done.stderr or done.stdout)}; fix "
                                 "the [slurm] settings or the flags (--partition, --gpus-per-job, --cpus-per-job, "
                                 "--mem-gb, --time-min, --sbatch)")

    def submit(self, out: Path, cells: list[SweepCell | PairedEntry], dependency: str | None = None) -> list[str]:
        """Submit `cells` as one job array (one plain job for a single cell); returns their job ids, in order.

        Paired-timing entries go as their own array, after `dependency` (the training jobs they
        time): each element starts every contender of its block on one node, so its memory is theirs together."""
        executor = submitit.SlurmExecutor(folder=self.folder)
        paired = [c for c in cells if isinstance(c, PairedEntry)]
        params = self.params_for(max((len(c.members) for c in paired), default=0))
        if dependency:
            params["dependency"] = dependency
        executor.update_parameters(job_name=self.job_name + ("-paired" if paired else ""), **params)
        self.folder.mkdir(parents=True, exist_ok=True)
        before = set(os.listdir(self.folder))
        said = io.StringIO()  # submitit prints sbatch's stderr itself when sbatch fails: that goes into our one line
        try:
            with contextlib.redirect_stderr(said), executor.batch():
                jobs = [executor.submit(CellJob(str(out), "paired", None, paired_command(out, c))
                                        if isinstance(c, PairedEntry) else
                                        CellJob(str(cell_run(out, c).dir), c.backend, c.threads))
                        for c in cells]
        except BaseException:
            for name in set(os.listdir(self.folder)) - before:  # the pickles and script of a refused submission
                with contextlib.suppress(OSError):
                    os.unlink(self.folder / name)
            raise
        sys.stderr.write(said.getvalue())
        return [str(job.job_id) for job in jobs]

    def run(self, out: Path, cells: list[SweepCell | PairedEntry], notify: Notify) -> int:
        """Submit the cells as job arrays, then the paired-timing entries as one more array that starts once every
        training job of this submission is over (`afterany`), and wait for all of them unless `wait` is False."""
        training = [c for c in cells if not isinstance(c, PairedEntry)]
        entries = [c for c in cells if isinstance(c, PairedEntry)]
        size = max_array_size()
        submitted, arrays = 0, []
        chunks = [training[i:i + size] for i in range(0, len(training), size)]
        chunks += [entries[i:i + size] for i in range(0, len(entries), size)]
        for chunk in chunks:
            paired = isinstance(chunk[0], PairedEntry)
            after = f"afterany:{':'.join(arrays)}" if paired and arrays else None
            what = "paired timing(s)" if paired else "cell(s)"
            try:
                job_ids = self.submit(out, chunk, dependency=after)
            except (FailedJobError, FailedSubmissionError) as exc:
                raise SubmissionError(f"sbatch refused the {'job array' if len(chunk) > 1 else 'job'} of "
                                      f"{len(chunk)} {what}: {sbatch_reason(str(exc))}", submitted) from None
            except OSError as exc:
                raise SubmissionError(os_error_message(exc, "cannot submit the SLURM jobs"),
                                      submitted) from None
            for cell, job_id in zip(chunk, job_ids):
                cell.job_ids.append(job_id)
            notify(chunk, "queued")  # the whole array at once: one write of the manifest
            submitted += len(chunk)
            array, limit = job_ids[0].split("_")[0], self.params.get("array_parallelism")
            if not paired:
                arrays.append(array)
            where = (f"job array {array} ({array}_[0-{len(chunk) - 1}]" + (f", at most {limit} at once)" if limit
                                                                           else ")")
                     if len(chunk) > 1 else f"job {array}")
            print(f"sweep: submitted {len(chunk)} {what} as SLURM {where}"
                  + (f", after job(s) {', '.join(arrays)}" if after else ""), file=sys.stderr, flush=True)
        if not self.wait:
            return 0
        return self.follow(cells, notify)

    def follow(self, cells: list[SweepCell | PairedEntry], notify: Notify) -> int:
        """Wait until every cell's job is over (result file written, or squeue no longer lists it as alive)."""
        pending = {cell.job: cell for cell in cells}
        seen_running: set[str] = set()
        failures = 0
        try:
            while pending:
                states = job_states(list(pending))
                if states is None:
                    failures += 1
                    if failures in (1, 10) or failures % 60 == 0:  # say so, but never once per poll
                        print(f"sweep: squeue did not answer ({failures}x); still waiting", file=sys.stderr)
                over, began = [], []
                for jid, cell in list(pending.items()):
                    state = None if states is None else states.get(jid)
                    result = self.folder / f"{jid}_0_result.pkl"
                    if result.exists() or (states is not None and not is_alive(state)):
                        del pending[jid]
                        over.append(cell)
                    elif state and state.startswith("RUNNING") and jid not in seen_running:
                        seen_running.add(jid)
                        began.append(cell)
                for cells_now, event in ((began, "running"), (over, "finished")):
                    if cells_now:  # what one poll found: one write of the manifest per event, not one per job
                        notify(cells_now, event)
                if pending:
                    time.sleep(self.poll_s)
        except KeyboardInterrupt:
            print(f"sweep: stopped waiting; {len(pending)} job(s) continue on the cluster "
                  "(follow them with `harness status SWEEP_ID`)", file=sys.stderr)
            return 130
        return 0
