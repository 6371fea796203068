"""Faults mid-run: signals, a diverging loss, hard kills at random moments, exact resume."""

from __future__ import annotations

import csv
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from harness.errors import UsageError
from tests.conftest import check_files, children, data_path, record_doc, run_cli


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, HARNESS_DATA=str(data_path()), PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "harness.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def only_run(out: Path) -> Path:
    runs = list((out / "runs").iterdir())
    assert len(runs) == 1
    return runs[0]


def wait_for(predicate, timeout: float = 120.0, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError("timed out waiting")


def read_json(path: Path) -> dict | None:
    """The record at `path` with its curves (conftest.record_doc); None while it is missing or being replaced."""
    try:
        return record_doc(path)
    except (FileNotFoundError, UsageError):
        return None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_keeps_what_was_measured(tmp_path, tiny_config, sig):
    out = tmp_path / "out"
    proc = start("run", "--config", str(tiny_config()), "--steps", "100000", "--out", str(out), "--quiet",
                 "--no-text")
    wait_for(lambda: (out / "runs").exists() and any((out / "runs").iterdir()))
    record_path = only_run(out) / "torch.json"
    wait_for(lambda: (read_json(record_path) or {}).get("status") == "running")
    time.sleep(2.0)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    record = read_json(record_path)
    assert record["status"] == "interrupted"
    n = len(record["steps"]["loss"])
    assert n > 0 and record["steps"]["step"] == list(range(n)) and len(record["steps"]["time_s"]) == n
    assert all(np.isfinite(record["steps"]["loss"]))
    rows = list(csv.DictReader((record_path.parent / "torch.steps.csv").open()))
    assert len(rows) == n  # the CSV and the JSON tell the same story


def test_non_finite_loss_fails_the_run_at_that_step(tmp_path, tiny_config):
    out = tmp_path / "out"
    result = run_cli("run", "--config", str(tiny_config(lr=1e30, clip=0.0)), "--steps", "60", "--out", str(out),
                     "--quiet", "--no-text")
    assert result.returncode == 1
    record = read_json(only_run(out) / "torch.json")
    loss = record["steps"]["loss"]
    k = len(loss) - 1
    assert record["status"] == f"failed: non-finite loss at step {k}"
    assert loss[k] is None and np.all(np.isfinite(loss[:k])) and k < 60  # non-finite is stored as null
    assert all(e["step"] <= k for e in record["evals"])  # nothing evaluated after the divergence
    assert f"non-finite loss at step {k}" in result.stderr


def losses(run: Path) -> list[float]:
    return read_json(run / "torch.json")["steps"]["loss"]


@pytest.mark.parametrize("dropout", [pytest.param(0.0, marks=pytest.mark.slow), 0.2])
def test_resume_is_bit_exact(tmp_path, tiny_config, dropout):
    """Interrupt after a checkpoint, resume: the losses equal an uninterrupted run's, bit for bit."""
    config = str(tiny_config(dropout=dropout))
    common = ["run", "--config", config, "--steps", "200", "--quiet", "--no-text", "--no-report"]
    assert run_cli(*common, "--out", str(tmp_path / "a")).returncode == 0
    reference = losses(only_run(tmp_path / "a"))
    out = tmp_path / "b"
    # the worker waits at its third checkpoint (step 120) until the signal, so no machine is too fast to interrupt it
    proc = start(*common, "--out", str(out), "--checkpoint-every", "40",
                 env={"HARNESS_TEST_PAUSE_AT": "after-checkpoint:sleep:3"})
    wait_for(lambda: (out / "runs").exists() and any((out / "runs").iterdir()))
    run = only_run(out)
    wait_for(lambda: ((read_json(run / "torch.json") or {}).get("checkpoint") or {}).get("step", 0) >= 80
             or proc.poll() is not None, every=0.005)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    record = read_json(run / "torch.json")
    assert record["status"] == "interrupted"
    result = run_cli("resume", run.name, "--out", str(out), "--quiet", "--no-report")
    assert result.returncode == 0, result.stderr
    resumed = read_json(run / "torch.json")
    assert resumed["status"] == "completed"
    assert resumed["steps"]["loss"] == reference  # exact float equality
    assert resumed["steps"]["step"] == list(range(200))
    assert [e["step"] for e in resumed["evals"]] == [*range(0, 200, 20), 200]


@pytest.mark.slow  # every named moment is killed deterministically in test_reliability_kill.py
def test_sigkill_at_random_moments_leaves_parseable_files_and_resumes(tmp_path, tiny_config):
    config = str(tiny_config())
    common = ["run", "--config", config, "--steps", "200", "--quiet", "--no-text", "--checkpoint-every", "25"]
    assert run_cli(*common, "--no-report", "--out", str(tmp_path / "ref")).returncode == 0
    reference = losses(only_run(tmp_path / "ref"))
    rng = random.Random(1234)
    for attempt in range(3):
        out = tmp_path / f"kill{attempt}"
        proc = start(*common, "--out", str(out))
        wait_for(lambda out=out: (out / "runs").exists() and any((out / "runs").iterdir()))
        time.sleep(rng.uniform(0.3, 4.0))
        for pid in [*children(proc.pid), proc.pid]:  # worker and parent die at once, no clean-up
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate(timeout=30)
        run = only_run(out)
        check_files(run)  # every file left behind parses
        result = run_cli("resume", run.name, "--out", str(out), "--quiet", "--no-report")
        assert result.returncode == 0, result.stderr
        assert losses(run) == reference
