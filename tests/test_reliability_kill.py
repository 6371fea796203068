"""Hard kills at every named point of a worker's life, for torch and numpy: the run always resumes, bit-exact.

The worker kills itself (SIGKILL) at a named point through the HARNESS_TEST_PAUSE_AT hook, so every moment is hit
deterministically: before its record exists, right after it, with a checkpoint's temporary file complete but not
renamed, between the checkpoint rename and the record write, and during the final persist (CSVs written, record
not). One run directory goes through all of them in turn and must still end with the losses of an uninterrupted
run, bit for bit.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import check_files, record_doc, run_cli

STEPS, EVERY = 60, 20
# (hook, what must hold on disk right after the kill)
STAGES = [
    ("before-record:kill", "fresh run, killed before its first record"),
    ("after-checkpoint:kill", "killed between the checkpoint rename and the record write"),
    ("before-record:kill", "a resume killed before its record replaces the old one"),
    ("mid-checkpoint:kill", "killed with a complete checkpoint temp file, not renamed"),
    ("after-record:kill", "a resume killed right after writing its record"),
    ("final-persist:kill", "killed during the final persist (CSVs written, record not)"),
]


def read(path: Path) -> dict | None:
    return record_doc(path) if path.exists() else None


# torch's checkpoints resume bit-exact in test_reliability.py::test_resume_is_bit_exact too; every moment for torch
# as well: `pytest -m slow`
@pytest.mark.parametrize("backend", ["numpy", pytest.param("torch", marks=pytest.mark.slow)])
def test_kill_at_every_point_then_resume_bit_exact(tmp_path, tiny_config, backend):
    config = str(tiny_config(dropout=0.1 if backend == "torch" else 0.0))
    common = ["--config", config, "--steps", str(STEPS), "--backend", backend, "--quiet", "--no-text",
              "--no-report", "--checkpoint-every", str(EVERY)]
    ref = run_cli("run", *common, "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    reference = read(next((tmp_path / "ref" / "runs").iterdir()) / f"{backend}.json")

    out = tmp_path / "out"
    run = None
    for hook, what in STAGES:
        args = ["run", *common] if run is None else ["resume", run.name]
        before = (run / f"{backend}.json").read_bytes() if run and (run / f"{backend}.json").exists() else None
        result = run_cli(*args, "--out", str(out), "--quiet", "--no-report", env={"HARNESS_TEST_PAUSE_AT": hook})
        assert result.returncode != 0 and "Traceback" not in result.stderr, (what, result.stderr)
        run = run or next((out / "runs").iterdir())
        check_files(run)
        record = read(run / f"{backend}.json")
        ckpt = run / f"{backend}.ckpt.npz"
        if hook.startswith("before-record"):
            if before is None:
                assert record is None, what
            else:  # the old record is untouched: the resume had not built its own yet
                assert (run / f"{backend}.json").read_bytes() == before, what
        else:
            assert record["status"] == "failed: killed by SIGKILL" and record["signal"] == "SIGKILL", what
            assert "killed by SIGKILL" in result.stderr
        if hook.startswith("after-checkpoint"):  # the record lags behind its checkpoint: resume must reconcile
            with np.load(ckpt) as f:
                assert len(record["steps"]["loss"]) < int(f["harness/step"]), what
        if hook.startswith("mid-checkpoint"):
            assert any(p.name.startswith(f".{backend}.ckpt.npz.") for p in run.iterdir()), what
        if record is not None:  # whatever is on disk agrees with the uninterrupted run, as far as it goes
            n = len(record["steps"]["loss"])
            assert record["steps"]["loss"] == reference["steps"]["loss"][:n], what
    result = run_cli("resume", run.name, "--out", str(out), "--quiet", "--no-report")
    assert result.returncode == 0, result.stderr
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]  # stale temp files were cleaned
    final = read(run / f"{backend}.json")
    assert final["status"] == "completed"
    assert final["steps"]["loss"] == reference["steps"]["loss"]  # bit for bit
    assert final["steps"]["step"] == list(range(STEPS))
    assert [(e["step"], e["val_loss"]) for e in final["evals"]] == [(e["step"], e["val_loss"])
                                                                   for e in reference["evals"]]
    rows = list(csv.DictReader((run / f"{backend}.steps.csv").open()))
    assert [float(r["loss"]) for r in rows] == reference["steps"]["loss"]
