"""Long runs stay readable: a run of ten million planned steps, interrupted early, is shown, reported and resumed
within a few hundred megabytes (its record holds what was done, never what was planned), a spec of 10^15 steps is no
traceback, and a report of a record with very many evaluations draws a few thousand points while its CSV keeps every
value."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import copy_run, data_path, harness_in_process, interrupted_run, one_line_error

PLANNED = 10_000_000
MEMORY_MB = 500

# status (all runs, then this one), report and resume, each in a process forked from this small one: its exit status
# and its peak resident memory, its worker's included (wait4's ru_maxrss, KiB on Linux). Not getrusage(RUSAGE_SELF)
# of a process started from pytest: Linux counts the peak of the image it was exec'd from (the pytest worker's).
MEASURE = """
import json, os, sys
from harness.cli.main import main
out, run_id = sys.argv[1:3]
codes, peak = {}, {}
for name, args in (("status", ["status"]), ("status ID", ["status", run_id]), ("report", ["report", run_id]),
                   ("resume", ["resume", run_id, "--quiet", "--no-report"])):
    if name == "resume":
        os.environ["HARNESS_TEST_PAUSE_AT"] = "after-checkpoint:term"  # its first checkpoint stops it
    pid = os.fork()
    if pid == 0:
        try:
            code = main([*args, "--out", out])
        except SystemExit as exc:
            code = exc.code
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    codes[name], peak[name] = os.waitstatus_to_exitcode(status), usage.ru_maxrss // 1024
print(json.dumps({"codes": codes, "peak_mb": peak}))
"""


@pytest.fixture(scope="module")
def long_run(tmp_path_factory, config_file) -> Path:
    """A numpy run of 10^7 planned steps killed right after its fourth checkpoint (every 200 steps: the checkpoint
    at step 800, the record, which lags it, at 600)."""
    return interrupted_run(tmp_path_factory.mktemp("long") / "out", config_file, PLANNED, 200,
                           "after-checkpoint:kill:4")


def test_ten_million_planned_steps_are_shown_reported_and_resumed_in_little_memory(tmp_path, long_run):
    out, run = copy_run(long_run, tmp_path)
    # a record holds what was done: 600 steps of curves in files of tens of kilobytes, a record of a few
    sizes = {p.name: p.stat().st_size for p in run.iterdir()}
    assert sizes["numpy.json"] < 16_000 and sizes["numpy.steps.csv"] < 100 * 600, sizes
    result = subprocess.run([sys.executable, "-c", MEASURE, str(out), run.name], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "HARNESS_DATA": str(data_path())})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["codes"] == {"status": 0, "status ID": 0, "report": 0, "resume": 130}, result.stderr
    assert f"600/{PLANNED}" in result.stdout  # the status line of the backend
    assert max(measured["peak_mb"].values()) < MEMORY_MB, measured
    rec = json.loads((run / "numpy.json").read_text())
    assert rec["resumed_from_step"] == [800] and rec["curves"]["steps"]["rows"] == 1000  # its next checkpoint
    assert (run / "numpy.json").stat().st_size < 16_000


def test_a_spec_of_1e15_steps_is_no_traceback(tmp_path, capsys, long_run):
    out, run = copy_run(long_run, tmp_path)
    spec = json.loads((run / "spec.json").read_text())
    spec["config"]["steps"] = 10**15
    (run / "spec.json").write_text(json.dumps(spec))
    for args in (["status"], ["status", run.name], ["report", run.name]):
        code, err = harness_in_process(capsys, *args, "--out", out)
        assert code == 0 and "Traceback" not in err, (args, err)
    code, err = harness_in_process(capsys, "resume", run.name, "--out", out, "--quiet", "--no-report")
    one_line_error(code, err, "spec.json", "changed since the run was written (config.steps)")
    del spec["experiment"]  # a spec without digests: its record, written under 10^7 steps, tells
    (run / "spec.json").write_text(json.dumps(spec))
    code, err = harness_in_process(capsys, "resume", run.name, "--out", out, "--quiet", "--no-report")
    one_line_error(code, err, "numpy.json", "config.steps (10000000, spec.json has 1000000000000000)")


# --- a report of very many evaluations ------------------------------------------------------------------------------
def many_evaluations(out: Path, n: int) -> str:
    """A run whose numpy record holds `n` steps and an evaluation at each (written by the store's own writers); its
    id. The validation loss has one spike, at step n // 3."""
    from test_report import make_run

    from harness import store
    from harness.store import Curves, Eval

    run_id = make_run(out, ("numpy",), steps=120)
    paths = store.RunPaths(out, run_id)
    rec = store.RunRecord.load(paths.record("numpy"))
    noise = np.random.default_rng(0).normal(0, 0.05, n)  # noisy, as measured: matplotlib cannot simplify it away
    loss = (2.5 + np.exp(-np.arange(n) / (n / 5)) + noise).tolist()
    evals = [Eval(i, v, v + 0.02, 0.001) for i, v in enumerate(loss)]
    evals[n // 3].val_loss = 9.0
    rec.schema_version = store.record.SCHEMA_VERSION
    rec.curves = Curves(step=list(range(n)), loss=loss, time_s=[0.01] * n, evals=evals)
    rec.timings, rec.time_to_target = store.Timings(), None  # recomputed from the curves: the slowest case
    rec.dump(paths)
    return run_id


def path_points(svg: str) -> list[int]:
    """The number of points of every drawn line (an SVG path's M and L commands) in `svg`."""
    return [len(re.findall(r"[ML]\s*-?[\d.]", d)) for d in re.findall(r'<path[^>]* d="([^"]+)"', svg)]


@pytest.mark.parametrize("n", [50_000, pytest.param(1_000_000, marks=pytest.mark.slow)])
def test_a_report_of_many_evaluations_draws_few_points_and_keeps_every_value(tmp_path, capsys, n):
    """The figure decimates (harness.report.figures: MAX_POINTS a line, each bin's lowest and highest point kept, so
    a one-evaluation spike is still drawn); the record's CSV keeps every evaluation. A million take seconds
    (docs/records.md has the time measured): speed is a benchmark's to check, not a test's."""
    from harness.report.figures import MAX_POINTS

    out = tmp_path / "out"
    run_id = many_evaluations(out, n)
    code, err = harness_in_process(capsys, "report", run_id, "--out", out)
    assert code == 0 and "Traceback" not in err, err
    page = (out / f"{run_id}.html").read_text()
    points = path_points(page)
    # a line at most MAX_POINTS (and its ends); a min-max band, its lower and upper edge, twice that
    assert points and max(points) <= 2 * MAX_POINTS + 4, sorted(points)[-5:]
    from harness.report.figures import decimated

    steps, val = np.arange(n), 2.52 + np.exp(-np.arange(n) / (n / 5))
    val[n // 3] = 9.0
    xs, ys = decimated(steps, val)
    assert len(xs) <= MAX_POINTS + 2 and 9.0 in ys and xs[0] == 0 and xs[-1] == n - 1  # the spike is drawn
    rows = (out / "runs" / run_id / "numpy.evals.csv").read_text().splitlines()
    assert len(rows) == n + 1 and rows[n // 3 + 1].split(",")[2] == "9.0"
