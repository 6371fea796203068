"""The SLURM executor against a real cluster (`.ci/slurm-single-node.sh` starts one; CI does).

Skipped, with the reason, where `sinfo` does not answer. Accounting is off on that cluster (`sacct` fails), which is
what the executor's status handling must cope with.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import data_path, record_doc, run_cli

pytestmark = pytest.mark.slurm


def _partition() -> str:
    if shutil.which("sinfo") is None:
        pytest.skip("no SLURM here (no sinfo on PATH); start one with .ci/slurm-single-node.sh")
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.skip("sinfo does not answer (no SLURM controller); start one with .ci/slurm-single-node.sh")
    if done.returncode != 0 or not done.stdout.split():
        pytest.skip(f"sinfo does not answer ({done.stderr.strip() or 'no partitions'}); start the cluster with "
                    ".ci/slurm-single-node.sh")
    return done.stdout.split()[0].rstrip("*")


@pytest.fixture(scope="module")
def partition() -> str:
    return _partition()


# What one tiny cell needs. Without a request the cluster's default applies, and on the CI cluster (no DefMemPerCPU)
# that is the whole node's memory: every job, this test's and anyone else's, then runs alone on the one node and
# waits for all the others. With it, the cell shares the node with other jobs where CPUs are free.
SMALL_JOB = ("--mem-gb", "1", "--cpus-per-job", "1")
# How long a job may wait in the queue behind other people's jobs (the one-node cluster is shared); the tests' own
# deadlines count from when their jobs run, so a busy cluster slows a test down but does not fail it.
QUEUE_WAIT_S = 240


def _state(job: str) -> str:
    q = subprocess.run(["squeue", "-h", "-r", "-j", job, "-o", "%T %r"], capture_output=True, text=True)
    return q.stdout.strip() if q.returncode == 0 else ""


def _queue() -> str:
    q = subprocess.run(["squeue", "-h", "-o", "%i %T %j %u"], capture_output=True, text=True)
    return "; ".join(q.stdout.strip().splitlines())


def _wait_until_running(job: str) -> None:
    """Wait while the job is queued behind other jobs; return once it runs (or has already ended)."""
    deadline = time.monotonic() + QUEUE_WAIT_S
    while (state := _state(job)).startswith(("PENDING", "CONFIGURING", "REQUEUED")):
        assert time.monotonic() < deadline, f"job {job} still queued after {QUEUE_WAIT_S} s ({state}): the " \
            f"cluster is busy with other jobs: {_queue()}"
        time.sleep(0.5)


def _manifest(out: Path) -> dict:
    (path,) = (out / "sweeps").glob("*/sweep.json")
    return json.loads(path.read_text())


def _losses(out: Path) -> dict[tuple[str, int], list[float]]:
    doc = _manifest(out)
    result = {}
    for cell in doc["cells"]:
        rec = record_doc(out / "runs" / cell["run_id"] / f"{cell['backend']}.json")
        assert rec["status"] == "completed"
        result[(cell["backend"], cell["seed"])] = rec["steps"]["loss"] + [e["val_loss"] for e in rec["evals"]]
    return result


def _own_array(array: str) -> set[str]:
    """The elements of job array `array` that squeue lists (one line each, ended ones too): only our own job."""
    q = subprocess.run(["squeue", "-h", "-r", "--states=all", "-j", array, "-o", "%i"], capture_output=True, text=True)
    return set(q.stdout.split())


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc is None or proc.poll() is None, f"the sweep ended while waiting for {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_twelve_cells_one_array_cancel_one_resume_bit_identical(partition: str, tmp_path: Path, tiny_config):
    """12 cells go to sbatch as ONE job array (JOBID_0..JOBID_11); `scancel JOBID_3`
    while that cell sits at its checkpoint interrupts it alone; the waiting sweep exits 1 naming `harness sweep
    --resume ID`; the resume continues the cell from its checkpoint (`resumed_from_step` = [10]); every final loss
    equals the local sweep's bit for bit."""
    config = str(tiny_config(interval=10))
    # numpy cells (a cell's backend is the worker's business: test_paired_timing_runs_after_the_array runs torch's
    # on SLURM); twelve seeds make the twelve elements
    common = ["sweep", "--configs", config, "--backends", "numpy", "--seeds", "12", "--steps", "20",
              "--checkpoint-every", "10", "--threads", "1", "--no-text", "--no-report", "--quiet",
              "--paired-rounds", "0"]  # the paired timing on SLURM: test_paired_timing_runs_after_the_array
    local = run_cli(*common, "--jobs", "2", "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    out = tmp_path / "slurm"
    env = dict(os.environ, HARNESS_DATA=str(data_path()), PYTHONUNBUFFERED="1",
               HARNESS_TEST_PAUSE_AT="after-checkpoint:sleep", HARNESS_TEST_PAUSE_S="1")  # every cell rests at step 10
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *common, "--executor", "slurm", "--partition",
                             partition, "--mem-gb", "1", "--array-parallelism", "2", "--out", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: (out / "sweeps").is_dir() and any((out / "sweeps").glob("*/sweep.json"))
              and all(c["job_ids"] for c in _manifest(out)["cells"]), 120, "the submission", proc)
        cells = _manifest(out)["cells"]
        array = cells[0]["job_ids"][0].split("_")[0]
        assert [c["job_ids"] for c in cells] == [[f"{array}_{i}"] for i in range(12)]  # one array, in cell order
        assert _own_array(array) == {f"{array}_{i}" for i in range(12)}  # squeue shows JOBID_0 .. JOBID_11
        third = cells[3]
        assert (third["backend"], third["seed"]) == ("numpy", 1340)
        run = out / "runs" / third["run_id"]
        _wait_until_running(f"{array}_3")  # other jobs may hold the node first
        _wait(lambda: (run / "numpy.ckpt.npz").exists(), 240, "cell 3's checkpoint", proc)
        subprocess.run(["scancel", f"{array}_3"], check=True)  # that element only, while it rests at step 10
        _, err = proc.communicate(timeout=QUEUE_WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["scancel", array], capture_output=True)
    sweep_id = _manifest(out)["sweep_id"]
    assert proc.returncode == 1, err
    assert "11 completed" in err and "1 interrupted" in err and f"harness resume {sweep_id}" in err, err
    before = record_doc(run / "numpy.json")
    assert before["status"] == "interrupted" and before["checkpoint"]["step"] == 10, before["status"]
    res = run_cli("resume", sweep_id, "--out", str(out), "--no-report", timeout=QUEUE_WAIT_S)
    assert res.returncode == 0, res.stderr
    assert "1 of 12 cells to run" in res.stderr and "resuming from step 10" in (
        "".join(p.read_text() for p in (out / "sweeps" / sweep_id / "slurm").glob("*_log.err")))
    doc = _manifest(out)
    assert [c["status"] for c in doc["cells"]] == ["completed"] * 12
    assert len(doc["cells"][3]["job_ids"]) == 2 and doc["cells"][3]["attempts"] == 2
    after = record_doc(run / "numpy.json")
    assert after["resumed_from_step"] == [10] and after["steps"]["time_s"][:10] == before["steps"]["time_s"][:10]
    a, b = _losses(tmp_path / "local"), _losses(out)
    assert len(a) == 12 and a.keys() == b.keys() and a == b  # exactly equal floats, every step and evaluation


def test_unknown_partition_is_one_line(partition: str, tmp_path: Path, tiny_config):
    out = tmp_path / "out"
    proc = run_cli("sweep", "--configs", str(tiny_config()), "--steps", "2", "--executor", "slurm",
                   "--partition", "no-such-partition", "--out", str(out))
    assert proc.returncode == 2 and "unknown SLURM partition 'no-such-partition'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()


PAYLOAD = "requeue\ntouch PWNED\n#SBATCH --comment=b"  # a newline ends the #SBATCH line, bash runs the rest


@pytest.mark.parametrize("how", ["sweep file", "--sbatch", "stored sweep.json"])
def test_sbatch_injection_does_not_run_on_the_cluster(partition: str, tmp_path: Path, tiny_config, how: str):
    """Written as the attack: the payload in a sweep file, on the command line, or in a stored
    sweep.json on --resume. It is refused up front (one line, exit 2), nothing is submitted, and no job ever runs
    `touch PWNED` in the submission directory. (Before the fix each of these ran the job, and the sweep waited for
    it, so PWNED existed when the command returned.)"""
    config = tiny_config()
    out = tmp_path / "out"
    common = ["--configs", str(config), "--backends", "numpy", "--steps", "2", "--no-text", "--no-report"]
    if how == "sweep file":
        spec = tmp_path / "grid.toml"
        spec.write_text(f"[slurm]\nsbatch = [{json.dumps(PAYLOAD)}]\n")
        args = ["sweep", str(spec), *common, "--executor", "slurm", "--partition", partition, "--out", str(out)]
    elif how == "--sbatch":
        args = ["sweep", *common, "--executor", "slurm", "--partition", partition, "--sbatch", PAYLOAD,
                "--out", str(out)]
    else:
        done = run_cli("sweep", *common, "--quiet", "--out", str(out))
        assert done.returncode == 0, done.stderr
        (path,) = (out / "sweeps").glob("*/sweep.json")
        doc = json.loads(path.read_text())
        doc["executor"] = {"kind": "slurm", "jobs": 1, "slurm": {"partition": partition, "sbatch": [PAYLOAD]}}
        doc["cells"][0].update(status="pending", run_id=None)
        path.write_text(json.dumps(doc))
        args = ["resume", doc["sweep_id"], "--out", str(out)]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    result = run_cli(*args, cwd=tmp_path, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "control character" in lines[0], result.stderr
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written: no sweep, no job script
    time.sleep(2)
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("option, reason", [("bogus-option=1", "unrecognized option"),
                                            ("gres=gpu:-1", "Invalid generic resource")])
def test_what_sbatch_refuses_is_refused_up_front(partition: str, tmp_path: Path, tiny_config, option, reason):
    """An option sbatch does not know, or a value it refuses, is found by `sbatch --test-only`
    before anything is written: one line with sbatch's own reason, no half-made sweep."""
    out = tmp_path / "out"
    result = run_cli("sweep", "--configs", str(tiny_config()), "--backends", "numpy", "--steps", "2", "--executor",
                     "slurm", "--partition", partition, "--sbatch", option, "--out", str(out))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "sbatch refuses this sweep's jobs" in lines[0] and reason in lines[0], lines[0]
    assert not out.exists()


def _read(path: Path) -> dict:
    """The record with its curves (conftest.record_doc), or {} while there is none to read."""
    from harness.errors import UsageError

    try:
        return record_doc(path)
    except (OSError, ValueError, UsageError):
        return {}


def _array_at_checkpoint(out: Path, partition: str, tiny_config) -> tuple[str, Path]:
    """Submit two 20-step numpy cells as one job array (--no-wait); each rests 3 s at its checkpoint (step 10).
    Returns element 1's job id and record path once that element sits at its checkpoint."""
    sub = run_cli("sweep", "--configs", str(tiny_config(interval=10)), "--backends", "numpy", "--seeds", "2",
                  "--steps", "20", "--checkpoint-every", "10", "--threads", "1", "--no-text", "--no-report",
                  "--executor", "slurm", "--partition", partition, *SMALL_JOB, "--no-wait", "--out", str(out),
                  "--paired-rounds", "0",
                  env={"HARNESS_TEST_PAUSE_AT": "after-checkpoint:sleep", "HARNESS_TEST_PAUSE_S": "3"})
    assert sub.returncode == 0, sub.stderr
    cells = _manifest(out)["cells"]
    array = cells[0]["job_ids"][0].split("_")[0]
    assert [c["job_ids"] for c in cells] == [[f"{array}_0"], [f"{array}_1"]]
    run = out / "runs" / cells[1]["run_id"]
    _wait_until_running(f"{array}_1")
    _wait(lambda: (run / "numpy.ckpt.npz").exists(), 180, "the cell's checkpoint")
    return f"{array}_1", run / "numpy.json"


def test_time_limit_signal_requeues_the_element_and_it_resumes(partition: str, tmp_path: Path, tiny_config):
    """SLURM's pre-time-limit signal (USR2, as submitit's own `_interrupt(timeout=True)` sends it) to ONE element of
    the array: submitit calls CellJob.checkpoint(), requeues that element alone, and the cell continues from its
    checkpoint without `--resume`."""
    out = tmp_path / "out"
    job, path = _array_at_checkpoint(out, partition, tiny_config)
    subprocess.run(["scancel", job, "--signal", "USR2"], check=True)
    # SLURM holds a requeued job back for about two minutes (its begin time); let it start sooner, but not within
    # the second of the requeue: slurmd refuses a launch credential made in the same second as the requeue revoked
    # the old one (`cred->ctime <= j->revoked`, whole seconds) and the job then FAILS ("Job credential revoked").
    deadline = time.monotonic() + 60
    while True:
        state = _state(job)
        if state.startswith("PENDING") and _read(path).get("status") == "interrupted":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+2"], capture_output=True)
            break
        assert time.monotonic() < deadline, f"the job was not requeued ({state})"
        time.sleep(0.3)
    before = _read(path)
    assert before["checkpoint"]["step"] == 10 and len(before["steps"]["loss"]) >= 10
    _wait_until_running(job)  # other jobs may have taken the node meanwhile
    deadline, ended = time.monotonic() + 240, 0
    while _read(path).get("status") != "completed" or not _read(path).get("resumed_at"):
        state = _state(job)
        ended = 0 if state.startswith(("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")) else ended + 1
        if ended >= 4:  # the job is over (seen four times) and the cell is not complete: fail now, not at a timeout
            pytest.fail(f"the requeued job ended ({state or 'gone from squeue'}) without completing the cell")
        assert time.monotonic() < deadline, f"the requeued cell did not complete: {_read(path).get('status')}"
        time.sleep(0.5)
    rec = _read(path)
    assert len(rec["steps"]["loss"]) == 20 and rec["resumed_from_step"] == [10]
    # continued from the checkpoint, not from step 0: the first attempt's timings and losses are kept
    assert rec["steps"]["time_s"][:10] == before["steps"]["time_s"][:10]
    assert rec["steps"]["loss"][:10] == before["steps"]["loss"][:10]
    doc = _manifest(out)
    assert [c["job_ids"] for c in doc["cells"]][1] == [job]  # requeued as the same element, not resubmitted by us
    folder = out / "sweeps" / doc["sweep_id"] / "slurm"
    log = "".join(p.read_text(errors="replace") for p in folder.glob(f"{job}_*log.err"))
    assert "timed-out" in log or "preempted" in log, log[-2000:]  # submitit's handler ran and requeued the job
    _wait(lambda: "2 completed" in run_cli("status", doc["sweep_id"], "--out", str(out)).stdout, 120,
          "both cells to complete")


def test_paired_timing_runs_after_the_array(partition: str, tmp_path: Path, tiny_config):
    """On SLURM: a block's paired timing is one more job, started once the training array is over
    (`afterany`), with every contender alive at once on its one node; the cells' losses equal a local sweep's."""
    from harness.sweep.slurm import is_alive, job_states

    config = str(tiny_config(interval=10))
    common = ["sweep", "--configs", config, "--backends", "torch,numpy", "--seeds", "1", "--steps", "20",
              "--threads", "1", "--no-text", "--no-report", "--quiet", "--paired-rounds", "3"]
    local = run_cli(*common, "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *common, "--executor", "slurm", "--partition",
                             partition, *SMALL_JOB, "--out", str(tmp_path / "slurm")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, HARNESS_DATA=str(data_path()), PYTHONUNBUFFERED="1"))
    # SLURM's own view of the paired job while the training array is alive: it waits on that array
    try:
        _wait(lambda: _submitted_paired(tmp_path / "slurm"), 120, "the paired job's submission", proc)
        early = _manifest(tmp_path / "slurm")
        dependency = _scontrol(early["paired"][0]["job_ids"][-1]).get("Dependency", "")
        array = early["cells"][0]["job_ids"][0].split("_")[0]
        if any(is_alive(s) for s in (job_states([c["job_ids"][-1] for c in early["cells"]]) or {}).values()):
            assert dependency.startswith(f"afterany:{array}"), dependency  # read while the array was still alive
        out, err = proc.communicate(timeout=QUEUE_WAIT_S)
    except BaseException:  # leave no sweep waiting and no job queued behind a failed test
        proc.kill()
        proc.communicate()
        if _submitted_paired(tmp_path / "slurm"):
            now = _manifest(tmp_path / "slurm")
            subprocess.run(["scancel", *(i["job_ids"][-1].split("_")[0] for i in [*now["cells"], *now["paired"]])],
                           check=False)
        raise
    slurm = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert slurm.returncode == 0, slurm.stderr
    assert "Bypassing sacct" not in slurm.stderr  # no status noise where accounting is off
    doc = _manifest(tmp_path / "slurm")
    assert all(c["job_ids"] and c["status"] == "completed" for c in doc["cells"])
    a, b = _losses(tmp_path / "local"), _losses(tmp_path / "slurm")
    assert a.keys() == b.keys() and a == b  # exactly equal floats, every step and every evaluation
    (entry,) = doc["paired"]
    array = doc["cells"][0]["job_ids"][0].split("_")[0]
    assert entry["job_ids"] and entry["job_ids"][0].split("_")[0] != array, entry
    assert f"after job(s) {array}" in slurm.stderr, slurm.stderr
    assert entry["status"] in ("completed", "incomplete"), entry
    rec = json.loads((tmp_path / "slurm" / entry["path"]).read_text())
    (session,) = rec["sessions"]
    assert set(session["ready"]) == {"torch", "numpy"} and session["rounds"], session.get("failure")
    # what SLURM did, not what the harness said: the paired job started once every training element had ended
    # (SLURM's own StartTime and EndTime, kept MinJobAge seconds), and the timing began after both records closed
    paired_start = _scontrol(entry["job_ids"][-1]).get("StartTime")
    ends = [_scontrol(c["job_ids"][-1]).get("EndTime") for c in doc["cells"]]
    if paired_start and all(ends):  # a busy cluster may have purged the jobs already: the records still say it
        assert all(paired_start >= end for end in ends), (paired_start, ends)
    finished = [json.loads((tmp_path / "slurm" / "runs" / c["run_id"] / f"{c['backend']}.json").read_text()
                           )["finished_at"] for c in doc["cells"]]
    assert all(f and session["started_at"] >= f for f in finished), (session["started_at"], finished)


def _submitted_paired(out: Path) -> bool:
    """Whether the sweep under `out` has submitted its paired job (the manifest names its job id)."""
    try:
        return bool(_manifest(out)["paired"][0].get("job_ids"))
    except (ValueError, OSError, KeyError, IndexError):  # not written yet, or caught between its writes
        return False


def _scontrol(job: str) -> dict[str, str]:
    """`scontrol show job JOB` as {field: value} ({} once SLURM has forgotten the job)."""
    q = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True)
    if q.returncode != 0:
        return {}
    return dict(tok.split("=", 1) for tok in q.stdout.split() if "=" in tok)
