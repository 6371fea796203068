"""What a script and a person read: stdout carries what a command made (a run's id) or, with --json, one JSON object,
and nothing else; `harness status` with no id lists the recent runs and sweeps, bounded and never failing on one
broken directory; the tables line up; long work shows its progress on a terminal and nowhere else."""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TINY

from harness.cli.main import main


def test_run_json_is_one_object_on_stdout_and_nothing_else(tmp_path: Path, capfd: pytest.CaptureFixture):
    """`--json`: stdout (the file descriptor: the workers' too) holds the object alone; everything else is on
    stderr."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "out"
    code = main(["run", "--config", str(config), "--steps", "2", "--backend", "numpy", "--no-text", "--json",
                 "--out", str(out)])
    stdout, stderr = capfd.readouterr()
    doc = json.loads(stdout)  # the whole of stdout is one object
    (run,) = doc["runs"]
    assert code == doc["exit_status"] == 0 and doc["command"] == "run" and (out / "runs" / run["id"]).is_dir()
    (backend,) = run["backends"]
    assert backend["status"] == "completed" and Path(backend["record"]).is_file() and backend["steps"] == 2
    assert Path(doc["report"]).is_file() and doc["report"].endswith(f"{run['id']}.html")
    assert f"run {run['id']}" in stderr and "report:" in stderr  # what people read


def tables(text: str) -> list[list[str]]:
    return [line for line in text.splitlines() if line.strip()]


def column_starts(rule: str) -> list[int]:
    """Where each column of a table starts: after each run of dashes of its rule line."""
    return [m.start() for m in re.finditer(r"-+", rule)]


def assert_lines_up(text: str, right: tuple[int, ...] = ()) -> None:
    """Under a header and a rule of dashes, every cell starts (or, for the `right` columns, ends) where its column's
    dashes do, continuation lines of a wrapped cell included, with the gap of two spaces before every column."""
    header, rule, *rows = tables(text)
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", rule)]
    for line in (header, *rows):
        for i, (a, b) in enumerate(spans):
            cell = line[a:b]
            assert i == 0 or line[a - 2:a] in ("  ", " ", ""), (line, i)  # nothing runs over from the column before
            if i == 0 or not cell.strip():  # the first column may indent a row of its own ("  Julia packages")
                continue
            if i in right:
                assert len(line) >= b and line[b - 1] != " ", (line, i)
            else:
                assert line[a] != " " and (a == 0 or line[a - 1] == " "), (line, i)


def test_a_long_cell_wraps_within_its_column_and_the_columns_line_up():
    from harness.units import text_table

    rows = [("Python", "3.11", ""), ("  Julia packages", "not installed (Flux, NNlib, Optimisers, Zygote, "
            "OneHotArrays, CUDA, and the rest of what NanoGPTFlux needs)", "run `harness setup julia`, or install "
            "Julia 1.10+ and set PYTHON_JULIAPKG_EXE=/path/to/julia")]
    text = text_table(("component", "status", "fix"), rows, width=100)
    assert_lines_up(text)
    assert max(len(line) for line in text.splitlines()) <= 100 + len("PYTHON_JULIAPKG_EXE=/path/to/julia")
    status_col = column_starts(text.splitlines()[1])[1]
    wrapped = [line for line in text.splitlines()[2:] if line[:status_col].strip() == ""]
    assert wrapped and all(line[status_col] != " " for line in wrapped if len(line) > status_col)


def test_the_doctor_table_and_the_status_table_line_up(capsys: pytest.CaptureFixture, tmp_path: Path):
    from test_report import make_run

    from harness.cli import doctor
    from harness.run.state import print_status
    from harness.store import RunPaths

    doctor._print_table([("a component", "a status " * 12, "a fix " * 20), ("b", "ok", "")])
    assert_lines_up(capsys.readouterr().out)
    run_id = make_run(tmp_path, statuses={"numpy": "failed: a reason long enough to stretch its column"})
    print_status(RunPaths(tmp_path, run_id))
    text = capsys.readouterr().out.split("\n", 1)[1]  # after the run's headline
    assert_lines_up("\n".join(text.splitlines()[:4]), right=(2, 3))  # steps and val_loss end where their headers do


def test_status_lists_the_recent_runs_and_sweeps_newest_first(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch):
    """id, kind, size, backends, state, verdict; one broken run directory among them is a row saying so, not an
    error; --last bounds it; --json gives the rows."""
    from test_report import make_run

    from harness.store import paths

    out = tmp_path / "out"
    clock = iter([1.7e9, 1.7e9 + 60])  # run ids begin with their UTC time: a minute apart
    monkeypatch.setattr(paths, "time", SimpleNamespace(strftime=time.strftime, gmtime=lambda: time.gmtime(next(clock))))
    done = make_run(out)
    failed = make_run(out, backends=("numpy",), statuses={"numpy": "failed: disk full"})
    broken = out / "runs" / "20991231-235959-small-dead"
    broken.mkdir()
    (broken / "spec.json").write_text("{not json")
    (out / "sweeps" / "20991231-235958-sweep-beef").mkdir(parents=True)  # no sweep.json
    assert main(["status", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = tables(text)[2:]
    assert [r.split()[0] for r in rows] == [broken.name, "20991231-235958-sweep-beef", failed, done]
    assert "unreadable" in rows[0] and "unreadable" in rows[1] and "sweep" in rows[1]
    assert re.search(r"run\s+small\s+numpy\s+failed", rows[2]) and re.search(r"torch,numpy\s+completed", rows[3])
    assert_lines_up(text)
    assert main(["status", "--out", str(out), "--last", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in doc["recent"]] == [broken.name, "20991231-235958-sweep-beef"]


def test_status_reads_only_the_runs_it_shows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture):
    """Bounded: of 200 runs, `--last 5` reads 5 (by name: ids begin with their time), whatever they hold."""
    from harness.cli import status
    from harness.run import state

    for k in range(200):
        (tmp_path / "runs" / f"20260101-{k:06d}-small-0000").mkdir(parents=True)
    read = []
    monkeypatch.setattr(state, "run_summary", lambda paths: read.append(paths.run_id) or {
        "id": paths.run_id, "kind": "run", "size": "small", "backends": "torch", "state": "completed", "verdict": ""})
    assert [r["id"] for r in status.recent(tmp_path, 5)] == read == [f"20260101-{k:06d}-small-0000"
                                                                      for k in range(199, 194, -1)]
    assert main(["status", "--out", str(tmp_path / "empty")]) == 0
    assert "no runs or sweeps under" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_line_shows_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch):
    from harness import progress

    monkeypatch.setenv("COLUMNS", "200")
    for stream, enabled, shown in ((Terminal(), True, True), (io.StringIO(), True, False), (Terminal(), False, False)):
        line = progress.Line("work", enabled, stream)
        line.show("3 of 10", "about 0:07 left")
        line.say("a lasting line")
        line.close()
        text = stream.getvalue()
        assert ("\rwork: 3 of 10, 0:00 elapsed, about 0:07 left" in text) == shown, text
        assert "a lasting line\n" in text
    assert progress.left_s(30.0, 3, 10) == 70.0 and progress.left_s(0.0, 0, 10) is None


def test_a_sweep_says_how_long_the_rest_will_take():
    from harness.sweep.drive import Events

    events = Events(SimpleNamespace(doc=SimpleNamespace(executor=SimpleNamespace(contended=False))), 4)
    events.start -= 60
    events.done = 1
    assert events.pace() == "1/4 done, 1:00 elapsed, about 3:00 left"
    events.done = 4
    assert events.pace() == "4/4 done, 1:00 elapsed"
