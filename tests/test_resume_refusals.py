"""`harness resume` continues only the experiment its files say it is: spec.json or a record changed since they were
written is refused in one line naming what changed, exit status 2, and nothing under --out is written. A run of the
previous release (a spec without digests, records with their curves in their JSON) still resumes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.conftest import (
    as_version_3,
    copy_run,
    harness_in_process,
    interrupted_run,
    one_line_error,
    record_doc,
)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, config_file) -> Path:
    """A numpy run of 60 steps killed right after its second checkpoint (step 40; its record lags, at step 20)."""
    return interrupted_run(tmp_path_factory.mktemp("interrupted") / "out", config_file, 60, 20,
                           "after-checkpoint:kill:2")


def hashes(out: Path) -> dict[str, str]:
    """The sha256 of every file under `out` (links and folders by name): what a refused command must leave as it was."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(out.rglob("*"))}


def edit(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def edit_curves(path: Path, change) -> None:
    """Edit the curves of the record at `path` as its JSON holds them (a record of the previous release, whose
    curves are in its JSON; a record of this release is rewritten as one first: both are read)."""
    doc = json.loads(path.read_text())
    if "steps" not in doc:
        doc = as_version_3(path)
    change(doc)
    path.write_text(json.dumps(doc))


def ragged(doc: dict) -> None:
    doc["steps"]["loss"].pop()
    doc["steps"]["time_s"].pop()
    doc["steps"]["step"].pop()
    doc["steps"]["loss"].pop()


def duplicated(doc: dict) -> None:
    doc["steps"]["step"][5] = 4


def csv_row_repeated(run: Path) -> None:
    """numpy.steps.csv with row 7 (step 6) replaced by step 5's, the record's extents made to match: an edit made
    with care, which only the rows themselves give away."""
    path, record = run / "numpy.steps.csv", run / "numpy.json"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[7] = lines[6]
    path.write_bytes(b"".join(lines))
    edit(record, lambda d: d["curves"]["steps"].update(bytes=path.stat().st_size))


def checkpoint_beyond_the_run(run: Path) -> None:
    """numpy's checkpoint moved on to step 80 of this 60-step run (its curves and AdamW's count to match), and its
    record's total_steps raised to let it in: the run's own bound must refuse it, not the record's."""
    import numpy as np

    path = run / "numpy.ckpt.npz"
    with np.load(path) as ckpt:
        arrays = dict(ckpt)
    arrays["harness/step"] = arrays["adam_t"] = np.array(80, dtype=np.int64)
    for key in ("harness/loss", "harness/time_s"):
        arrays[key] = np.resize(arrays[key], 80)
    with path.open("wb") as f:
        np.savez(f, **arrays)
    edit(run / "numpy.json", lambda d: d.update(total_steps=10**6))


CHANGES = {
    # name: (edit of the run directory, what the one line names)
    "learning rate": (lambda r: edit(r / "spec.json", lambda d: d["config"].update(learning_rate=0.02)),
                      "config.learning_rate"),
    "seed": (lambda r: edit(r / "spec.json", lambda d: d.update(seed=7)), "(seed)"),
    "threads": (lambda r: edit(r / "spec.json", lambda d: d.update(threads=3)), "(threads)"),
    "device": (lambda r: edit(r / "spec.json", lambda d: d.update(device="cuda")), "(device)"),
    "backend options": (lambda r: edit(r / "spec.json", lambda d: d["backend_options"].update(numpy={"dtype":
                                                                                                    "float32"})),
                        "backend_options.numpy"),
    "steps ragged": (lambda r: edit_curves(r / "numpy.json", ragged), "ragged steps"),
    "a step duplicated": (lambda r: edit_curves(r / "numpy.json", duplicated), "step 4 where step 5 belongs"),
    "a CSV row repeated": (csv_row_repeated, "step 5 where step 6 belongs"),
    "a checkpoint beyond the run": (checkpoint_beyond_the_run, "at step 80, outside this run's 1..60"),
}


@pytest.mark.parametrize("case", list(CHANGES))
def test_a_changed_run_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, interrupted, case):
    change, named = CHANGES[case]
    out, run = copy_run(interrupted, tmp_path)
    change(run)
    before = hashes(out)
    code, err = harness_in_process(capsys, "resume", run.name, "--out", out, "--quiet", "--no-report")
    one_line_error(code, err, named)
    assert hashes(out) == before


def test_a_run_of_the_previous_release_still_resumes(tmp_path, capsys, interrupted):
    """A spec without digests and a record of schema version 3 (its curves in its JSON): resumed from its checkpoint
    to the end, the record rewritten in this release's form."""
    out, run = copy_run(interrupted, tmp_path)
    edit(run / "spec.json", lambda d: d.pop("experiment"))
    as_version_3(run / "numpy.json")
    code, err = harness_in_process(capsys, "resume", run.name, "--out", out, "--quiet", "--no-report")
    assert code == 0, err
    rec = record_doc(run / "numpy.json")
    assert rec["status"] == "completed" and rec["resumed_from_step"] == [40]
    assert rec["steps"]["step"] == list(range(60)) and rec["schema_version"] == 4


def test_a_worker_resumed_on_a_completed_record_leaves_it_as_it_is(tmp_path, capsys, config_file):
    """A worker started with --resume on a backend whose record says "completed" (an executor that restarts every
    cell) writes nothing: the record keeps its text, memory and times, byte for byte."""
    from harness.run.worker import run_backend
    from harness.store import RunPaths

    out = tmp_path / "out"
    code, _ = harness_in_process(capsys, "run", "--config", config_file, "--steps", "4", "--checkpoint-every", "2",
                                 "--backend", "numpy", "--no-text", "--no-report", "--quiet", "--out", out)
    assert code == 0
    (run,) = (out / "runs").iterdir()
    before = hashes(out)
    assert run_backend(RunPaths.of_dir(run), "numpy", resume=True, progress=False) == 0
    assert hashes(out) == before and "already completed" in capsys.readouterr().err
