"""The SLURM executor against a real cluster (`.ci/slurm-single-node.sh` starts one; CI does).

Skipped, with the reason, where `sinfo` does not answer. Accounting is off on that cluster (`sacct` fails), which is
what the executor's status handling must cope with.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_cli

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


def _manifest(out: Path) -> dict:
    (path,) = (out / "sweeps").glob("*/sweep.json")
    return json.loads(path.read_text())


def _losses(out: Path) -> dict[tuple[str, int], list[float]]:
    doc = _manifest(out)
    result = {}
    for cell in doc["cells"]:
        rec = json.loads((out / "runs" / cell["run_id"] / f"{cell['backend']}.json").read_text())
        assert rec["status"] == "completed"
        result[(cell["backend"], cell["seed"])] = rec["steps"]["loss"] + [e["val_loss"] for e in rec["evals"]]
    return result


def test_slurm_and_local_give_bit_identical_losses(partition: str, tmp_path: Path, tiny_config):
    config = str(tiny_config(interval=10))
    common = ["sweep", "--configs", config, "--backends", "torch,numpy", "--seeds", "1", "--steps", "20",
              "--threads", "1", "--no-text", "--no-report", "--quiet"]
    local = run_cli(*common, "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    slurm = run_cli(*common, "--executor", "slurm", "--partition", partition, *SMALL_JOB,
                    "--out", str(tmp_path / "slurm"), timeout=QUEUE_WAIT_S)
    assert slurm.returncode == 0, slurm.stderr
    assert "Bypassing sacct" not in slurm.stderr  # no status noise where accounting is off
    doc = _manifest(tmp_path / "slurm")
    assert all(c["job_ids"] and c["status"] == "completed" for c in doc["cells"])
    a, b = _losses(tmp_path / "local"), _losses(tmp_path / "slurm")
    assert a.keys() == b.keys() and a == b  # exactly equal floats, every step and every evaluation
    # the paired timing is one SLURM job of its own: both contenders started on one node, alive at once
    (entry,) = doc["paired"]
    assert entry["job_ids"] and entry["status"] in ("completed", "incomplete"), entry
    rec = json.loads((tmp_path / "slurm" / entry["path"]).read_text())
    (session,) = rec["sessions"]
    assert set(session["ready"]) == {"torch", "numpy"} and session["rounds"], session.get("failure")


def test_unknown_partition_is_one_line(partition: str, tmp_path: Path, tiny_config):
    out = tmp_path / "out"
    proc = run_cli("sweep", "--configs", str(tiny_config()), "--steps", "2", "--executor", "slurm",
                   "--partition", "no-such-partition", "--out", str(out))
    assert proc.returncode == 2 and "unknown SLURM partition 'no-such-partition'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()


def test_sbatch_refusal_is_one_line(partition: str, tmp_path: Path, tiny_config):
    out = tmp_path / "out"
    proc = run_cli("sweep", "--configs", str(tiny_config()), "--steps", "2", "--executor", "slurm",
                   "--partition", partition, "--sbatch", "no-such-sbatch-option=1", "--out", str(out))
    assert proc.returncode == 2 and "sbatch refused cell" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 3 and "Traceback" not in proc.stderr  # 2 progress lines


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# What one tiny numpy cell needs. Without a request the cluster's default applies, and on the CI cluster (no
# DefMemPerCPU) that is the whole node's memory: every job, this test's and anyone else's, then runs alone on the
# one node and waits for all the others. With it, the cell shares the node with other jobs where CPUs are free.
SMALL_JOB = ("--mem-gb", "1", "--cpus-per-job", "1")
# How long a job may wait in the queue behind other people's jobs (the one-node cluster is shared); the test's own
# deadlines count from when its job runs, so a busy cluster slows the test down but does not fail it.
QUEUE_WAIT_S = 900


def _state(job: str) -> str:
    q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True)
    return q.stdout.strip() if q.returncode == 0 else ""


def _wait_until_running(job: str) -> None:
    """Wait while the job is queued behind other jobs; return once it runs (or has already ended)."""
    deadline = time.monotonic() + QUEUE_WAIT_S
    while (state := _state(job)).startswith(("PENDING", "CONFIGURING", "REQUEUED")):
        assert time.monotonic() < deadline, f"job {job} still queued after {QUEUE_WAIT_S} s ({state}): the " \
            f"cluster is busy with other jobs: {_queue()}"
        time.sleep(0.5)


def _queue() -> str:
    q = subprocess.run(["squeue", "-h", "-o", "%i %T %j %u"], capture_output=True, text=True)
    return "; ".join(q.stdout.strip().splitlines())


def _long_cell_at_checkpoint(out: Path, partition: str, tiny_config) -> tuple[str, Path, dict]:
    """Submit one 4000-step numpy cell (checkpoint every 100) and wait until it has checkpointed past step 200;
    returns its job id, its record's path and the record then."""
    sub = run_cli("sweep", "--configs", str(tiny_config(interval=1000)), "--backends", "numpy", "--seeds", "1",
                  "--steps", "4000", "--checkpoint-every", "100", "--threads", "1", "--no-text", "--no-report",
                  "--executor", "slurm", "--partition", partition, *SMALL_JOB, "--no-wait", "--out", str(out))
    assert sub.returncode == 0, sub.stderr
    (cell,) = _manifest(out)["cells"]
    path = out / "runs" / cell["run_id"] / "numpy.json"
    _wait_until_running(cell["job_ids"][0])
    deadline = time.monotonic() + 180
    while (_read(path).get("checkpoint") or {}).get("step", 0) < 200:
        assert time.monotonic() < deadline, f"the cell never checkpointed ({_state(cell['job_ids'][0])})"
        time.sleep(0.3)
    return cell["job_ids"][0], path, _read(path)


def test_scancel_mid_run_then_resume_from_the_checkpoint(partition: str, tmp_path: Path, tiny_config):
    out = tmp_path / "out"
    job, path, _ = _long_cell_at_checkpoint(out, partition, tiny_config)
    subprocess.run(["scancel", job], check=True)
    deadline = time.monotonic() + 60
    while True:
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
        if q.returncode != 0 or not q.stdout.strip() or q.stdout.split()[0] not in ("RUNNING", "PENDING",
                                                                                  "COMPLETING"):
            break
        assert time.monotonic() < deadline, "scancel did not end the job"
        time.sleep(0.5)
    time.sleep(1)
    before = json.loads(path.read_text())
    assert before["status"] == "interrupted" and len(before["steps"]["loss"]) < 4000
    ckpt = before["checkpoint"]["step"]
    status = run_cli("sweep", "--status", _manifest(out)["sweep_id"], "--out", str(out))
    assert status.returncode == 0 and "interrupted" in status.stdout and "Bypassing" not in status.stderr
    res = run_cli("sweep", "--resume", _manifest(out)["sweep_id"], "--out", str(out), "--no-report",
                  timeout=QUEUE_WAIT_S)
    assert res.returncode == 0, res.stderr
    (cell,) = _manifest(out)["cells"]
    assert cell["status"] == "completed" and len(cell["job_ids"]) == 2 and cell["attempts"] == 2
    after = json.loads(path.read_text())
    assert after["status"] == "completed" and after["resumed_at"] and len(after["steps"]["loss"]) == 4000
    # continued from the checkpoint: the steps before it keep the first job's timings and losses
    assert after["steps"]["time_s"][:ckpt] == before["steps"]["time_s"][:ckpt]
    assert after["steps"]["loss"][:ckpt] == before["steps"]["loss"][:ckpt]


def test_time_limit_signal_requeues_the_cell_and_it_resumes(partition: str, tmp_path: Path, tiny_config):
    """SLURM's pre-time-limit signal (USR2, as submitit's own `_interrupt(timeout=True)` sends it): submitit calls
    CellJob.checkpoint(), requeues the same job, and the cell continues from its checkpoint without `--resume`."""
    out = tmp_path / "out"
    job, path, before = _long_cell_at_checkpoint(out, partition, tiny_config)
    ckpt = before["checkpoint"]["step"]
    subprocess.run(["scancel", job, "--signal", "USR2"], check=True)
    # SLURM holds a requeued job back for about two minutes (its begin time); let it start sooner, but not within
    # the second of the requeue: slurmd refuses a launch credential made in the same second as the requeue revoked
    # the old one (`cred->ctime <= j->revoked`, whole seconds) and the job then FAILS ("Job credential revoked").
    deadline = time.monotonic() + 60
    while True:
        state = _state(job)
        if state.startswith("PENDING"):
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+2"], capture_output=True)
            break
        assert time.monotonic() < deadline, f"the job was not requeued ({state})"
        time.sleep(0.3)
    _wait_until_running(job)  # other jobs may have taken the node meanwhile
    deadline, ended = time.monotonic() + 240, 0
    while _read(path).get("status") != "completed" or not _read(path).get("resumed_at"):
        state = _state(job)
        ended = 0 if state.startswith(("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")) else ended + 1
        if ended >= 4:  # the job is over (seen four times running) and the cell is not complete: fail now
            pytest.fail(f"the requeued job ended ({state or 'gone from squeue'}) without completing the cell")
        assert time.monotonic() < deadline, f"the requeued cell did not complete: {_read(path).get('status')}"
        time.sleep(0.5)
    rec = _read(path)
    assert len(rec["steps"]["loss"]) == 4000
    # continued from a checkpoint, not from step 0: the first attempt's timings and losses are kept
    assert rec["steps"]["time_s"][:ckpt] == before["steps"]["time_s"][:ckpt]
    assert rec["steps"]["loss"][:ckpt] == before["steps"]["loss"][:ckpt]
    assert len(_manifest(out)["cells"][0]["job_ids"]) == 1  # requeued as the same job, not resubmitted by us
    folder = out / "sweeps" / _manifest(out)["sweep_id"] / "slurm"
    log = "".join(p.read_text(errors="replace") for p in folder.glob(f"{job}_*log.err"))
    assert "timed-out" in log or "preempted" in log, log[-2000:]  # submitit's handler ran and requeued the job
    status = run_cli("sweep", "--status", _manifest(out)["sweep_id"], "--out", str(out))
    assert status.returncode == 0 and "1 completed" in status.stdout, status.stdout
