"""Files read back within bounds, each case written as the attack.

Every file the harness reads back goes through one bounded reader (harness.files.read_json): a device or a FIFO
where paired.json belongs, a file of gigabytes, JSON nested 100,000 deep, a paired.json of the wrong shape, values
that pass a schema and then meet a float; a paired timing left "running" by a process that is gone; a sweep axis
of the wrong type; a busy machine. The answer is one line and exit status 2, or a report that says what it could
not draw, never a traceback, a hang or an unbounded read.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
from test_paired import planted
from test_report import make_run
from test_untrusted_input import deadline

from harness import store
from harness.cli.main import main
from harness.errors import UsageError
from harness.timing import contention, paired

DEEP = b'{"a":' * 100_000 + b"1" + b"}" * 100_000


def harness(capsys: pytest.CaptureFixture, *args: object) -> tuple[int, str, str]:
    with deadline(60):
        code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(code: int, err: str, *fragments: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)
    return lines[0]


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, str]:
    """(out, run id) of a synthetic torch + numpy run with a planted paired.json beside its records."""
    out = tmp_path / "out"
    run_id = make_run(out, steps=120)
    (out / "runs" / run_id / "paired.json").write_text(json.dumps(planted([1.5] * 10).to_dict()))
    return out, run_id


def paired_path(out: Path, run_id: str) -> Path:
    return out / "runs" / run_id / "paired.json"


# --- paired.json is read within a bound, as a regular file only ----------------------------------------------------
@pytest.mark.parametrize("kind", ["/dev/zero", "fifo"])
def test_a_paired_json_that_is_no_regular_file_is_refused_unread(kind, run, capsys):
    out, run_id = run
    path = paired_path(out, run_id)
    path.unlink()
    os.symlink("/dev/zero", path) if kind == "/dev/zero" else os.mkfifo(path)
    code, _, err = harness(capsys, "report", run_id, "--out", out)  # before: grew to 23.6 GB / hung
    one_line(code, err, "paired-timing record", "not a regular file", "delete it to time again")
    assert not list(out.glob("*.html"))


def test_a_paired_json_of_gigabytes_is_refused_by_its_size(run, capsys):
    out, run_id = run
    path = paired_path(out, run_id)
    os.truncate(path, 2 * 2**30)  # 2 GiB (sparse): never read
    code, _, err = harness(capsys, "report", run_id, "--out", out)
    one_line(code, err, "2,147,483,648 bytes", f"more than the {store.paired.MAX_BYTES:,}",
             "no paired timing writes so much")


# --- paired.json has a schema, checked on load ----------------------------------------------------------------------
def _set(doc: dict, path: str, value: object) -> dict:
    *parents, last = path.split(".")
    at = doc
    for key in parents:
        at = at[int(key)] if isinstance(at, list) else at[key]
    at[int(last) if isinstance(at, list) else last] = value
    return doc


MALFORMED = [("sessions", [1, 2]), ("sessions.0.rounds", "abc"), ("sessions.0.rounds", [1]),
             ("sessions.0.rounds.0.bursts", [1]), ("sessions.0.rounds.0.bursts.torch.chunk", "x"), ("plan", "x"),
             ("contenders", "x"), ("schema_version", "x"), ("sessions.0.rounds.0.bursts.torch.times", [0.1, "x"]),
             ("sessions.0.rounds.0.bursts.torch.chunk.load", ["x"]), ("plan.rounds", 0), ("sessions.0.status", 3)]


@pytest.mark.parametrize(("field", "value"), MALFORMED, ids=[f"{f}={v!r}" for f, v in MALFORMED])
def test_a_malformed_paired_json_is_one_line_naming_the_field(field, value, run, capsys):
    out, run_id = run
    path = paired_path(out, run_id)
    path.write_text(json.dumps(_set(json.loads(path.read_text()), field, value)))
    code, _, err = harness(capsys, "report", run_id, "--out", out)  # before: AttributeError, TypeError, ...
    one_line(code, err, "paired.json' is invalid at field", "delete it to time again")
    with pytest.raises(UsageError, match="is invalid at field"):
        paired.load(path)
    code, stdout, err = harness(capsys, "status", run_id, "--out", out)  # status reads it too: says so, no traceback
    assert code == 0 and "paired timing: unreadable" in stdout and "Traceback" not in err, stdout + err


# --- JSON nested 100,000 deep, in every file a report or a sweep reads ----------------------------------------------
@pytest.mark.parametrize("name", ["torch.json", "spec.json", "paired.json"])
def test_deep_nesting_in_a_run_file_is_one_line(name, run, capsys):
    out, run_id = run
    (out / "runs" / run_id / name).write_bytes(DEEP)
    code, _, err = harness(capsys, "report", run_id, "--out", out)  # before: RecursionError
    one_line(code, err, name, "not valid JSON (nested too deeply)")


def test_deep_nesting_in_a_sweep_manifest_is_one_line(tmp_path, capsys):
    sweep_id = "20260101-000000-sweep-abcd"
    directory = tmp_path / "out" / "sweeps" / sweep_id
    directory.mkdir(parents=True)
    (directory / "sweep.json").write_bytes(DEEP)
    code, _, err = harness(capsys, "status", sweep_id, "--out", tmp_path / "out")
    one_line(code, err, "sweep.json", "nested too deeply")


def test_a_number_of_hundreds_of_digits_is_one_line(run, capsys):
    out, run_id = run
    path = out / "runs" / run_id / "torch.json"
    path.write_text(path.read_text().replace('"seed": 1337', '"seed": 1' + "0" * 400, 1))
    code, _, err = harness(capsys, "report", run_id, "--out", out)  # before: OverflowError where it met a float
    one_line(code, err, "torch.json", "a whole number of 401 digits")


def test_a_step_past_int64_is_one_line(run, capsys):
    out, run_id = run
    path = out / "runs" / run_id / "torch.json"
    rec = json.loads(path.read_text())
    rec["steps"]["step"][0] = 10**19  # 20 digits: numpy's int64 overflowed on it
    path.write_text(json.dumps(rec))
    code, _, err = harness(capsys, "report", run_id, "--out", out)
    one_line(code, err, "torch.json", "a whole number of 20 digits")


# --- values that pass the schema, then meet a float -------------------------------------------------------------------
def test_losses_of_1e308_give_a_report_not_a_traceback(run, capsys):
    out, run_id = run
    path = out / "runs" / run_id / "torch.json"
    rec = json.loads(path.read_text())
    rec["steps"]["loss"] = [1e308] * len(rec["steps"]["loss"])
    for e in rec["evals"]:
        e["train_loss"] = e["val_loss"] = 1e308
    path.write_text(json.dumps(rec))
    code, _, err = harness(capsys, "report", run_id, "--out", out)  # before: OverflowError in the figures
    assert code == 0 and "Traceback" not in err, err
    page = next(out.glob(f"{run_id}*.html")).read_text()
    assert "<svg" in page


@pytest.mark.parametrize(("field", "value"), [("contention", "x"), ("tokens_per_s", "fast"),
                                              ("contention", {"contended_fraction": "x"}),
                                              ("contention", {"load_range": ["x"]})])
def test_a_timing_of_the_wrong_type_is_one_line(field, value, run, capsys):
    out, run_id = run
    path = out / "runs" / run_id / "torch.json"
    rec = json.loads(path.read_text())
    rec["timings"][field] = value
    path.write_text(json.dumps(rec))
    code, _, err = harness(capsys, "report", run_id, "--out", out)  # before: AttributeError in results.costs
    one_line(code, err, "torch.json' is invalid at field 'timings/")


def test_a_contention_summary_with_nulls_gives_a_report(run, capsys):
    """null is a valid value of every contention figure (not measured); the cost table must not format it."""
    out, run_id = run
    path = out / "runs" / run_id / "torch.json"
    rec = json.loads(path.read_text())
    rec["timings"]["contention"] = {"evidence": "schedstat", "wait_fraction_median": 0.1, "wait_fraction_max": None,
                                    "load_range": [1.0, None]}
    path.write_text(json.dumps(rec))
    code, _, err = harness(capsys, "report", run_id, "--out", out)  # before: TypeError formatting None
    assert code == 0 and "Traceback" not in err, err
    page = next(out.glob(f"{run_id}*.html")).read_text()
    assert "10.0% / —" in page and "1 – —" in page


# --- run records have a cap from their spec; the report is linear in their size ---------------------------------------
def test_a_record_bigger_than_its_run_can_write_is_refused_unparsed(run, capsys):
    out, run_id = run
    spec = json.loads((out / "runs" / run_id / "spec.json").read_text())
    path = out / "runs" / run_id / "torch.json"
    rec = json.loads(path.read_text())
    rec["evals"] = [{"step": i, "train_loss": 1.0, "val_loss": 1.0, "time_s": 0.1} for i in range(200_000)]
    rec["text"] = {"samples": ["x" * store.record.RECORD_BASE_BYTES]}  # a 120-step run writes nothing like this
    path.write_text(json.dumps(rec))
    assert path.stat().st_size > store.record.record_cap(store.RunSpec.from_dict(spec))
    code, _, err = harness(capsys, "report", run_id, "--out", out)
    one_line(code, err, "torch.json", "no run writes so much")


def test_matching_two_records_evaluations_is_linear():
    """100,000 evaluations each: the old search of one record's evaluations per evaluation of the other made 5e9
    comparisons (many minutes); by step it is one pass (well under a second)."""
    from harness.config.load import load_config
    from harness.report.analysis import compare_pair
    from harness.store.curves import Curves, Eval

    def rec(name: str) -> store.RunRecord:
        n = 100_000
        evals = [Eval(i, 1.0, 1.0 + (name == "numpy") * 0.01) for i in range(n)]
        curves = Curves(step=list(range(n)), loss=[1.0] * n, time_s=[0.01] * n, evals=evals)
        return store.RunRecord(run_id="r", backend=name, config=load_config("small"), curves=curves)

    with deadline(30):
        cmp = compare_pair(rec("torch"), rec("numpy"))
    assert cmp.eval_step == 99_999 and cmp.val_b - cmp.val_a == pytest.approx(0.01)


# --- a paired timing left "running" by a process that is gone reads "interrupted" -------------------------------------
def _running(path: Path) -> None:
    doc = json.loads(path.read_text())
    doc["status"] = "running"
    doc["sessions"][-1].update(status="running", host=socket.gethostname())
    path.write_text(json.dumps(doc))


def test_a_session_whose_coordinator_is_gone_reads_interrupted(run, capsys):
    out, run_id = run
    path = paired_path(out, run_id)
    _running(path)  # what a SIGKILL of `harness` or a full disk during paired timing leaves behind
    doc = paired.load(path)
    assert doc.status == "interrupted" and doc.sessions[-1].status == "interrupted"
    assert "interrupted (its process is gone)" in paired.status_text(doc)
    assert json.loads(path.read_text())["status"] == "running"  # a reader writes nothing
    code, stdout, err = harness(capsys, "status", run_id, "--out", out)
    assert code == 0 and "its process is gone" in stdout, stdout + err


def test_a_session_whose_coordinator_holds_the_lock_is_still_running(run):
    from harness.store import RecordLock

    out, run_id = run
    path = paired_path(out, run_id)
    _running(path)
    with RecordLock(path):  # a live coordinator (here: this process) holds the record
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(1) as pool:  # another process reads it, as `harness status`
            status = pool.apply(_status_of, (str(path),))
    assert status == "running"


def _status_of(path: str) -> str:
    return paired.load(Path(path)).sessions[-1].status


# --- a busy machine is said at the start, and no disturbed speed goes unmarked ----------------------------------------
class Machine:
    """A stand-in for contention.Probe: other processes keep `others` of `ncpu` CPUs busy."""

    def __init__(self, others: float, ncpu: int = 2):
        self.others, self.ncpu, self.t = others, ncpu, 0.0

    def snapshot(self) -> contention.Snapshot:
        self.t += 1.0
        return contention.Snapshot(wall=self.t, cpu=0.0, machine=(self.others * self.t, 0.0, self.ncpu * self.t),
                                   ncpu=self.ncpu)


def test_oversubscription_is_said_at_the_start_in_one_line(monkeypatch):
    from harness.run import processes

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    line = processes.busy_machine_line(None, Machine(others=1.8))
    assert line is not None and "pass --threads 1" in line and "2 threads (its default)" in line
    assert "\n" not in line
    assert processes.busy_machine_line(None, Machine(others=0.0)) is None  # a quiet machine: nothing said
    assert processes.busy_machine_line(1, Machine(others=0.6)) is None  # one thread fits the idle CPU
    assert "--threads" not in (processes.busy_machine_line(1, Machine(others=2.0)) or "--threads")


def test_a_mostly_disturbed_speed_is_marked_on_the_console_and_in_the_index(run, capsys):
    from harness.cli.run import finish
    from harness.report import write_index, write_report

    out, run_id = run
    path = out / "runs" / run_id / "torch.json"
    rec = json.loads(path.read_text())
    rec["timings"]["contention"] = {"evidence": "schedstat", "mostly_disturbed": True, "contended_fraction": 1.0,
                                    "steady_steps": 110, "disturbed_steps": 110}
    path.write_text(json.dumps(rec))
    finish(store.RunPaths(out, run_id), {"torch": 0, "numpy": 0})
    err = capsys.readouterr().err
    torch_line = next(x for x in err.splitlines() if x.strip().startswith("torch:"))
    numpy_line = next(x for x in err.splitlines() if x.strip().startswith("numpy:"))
    assert "tokens/s (mostly disturbed, 100% of steps: the machine was busy" in torch_line, torch_line
    assert "tokens/s ->" in numpy_line, numpy_line  # an undisturbed speed: no mark
    page = write_report(out, [run_id]).read_text()
    assert "mostly disturbed, 100% of steps" in page  # the summary table's tokens/s cell
    index = write_index(out).read_text()
    assert "mostly disturbed, 100% of steps" in index


# --- a sweep axis of the wrong type is named in words -----------------------------------------------------------------
def test_a_sweep_value_of_the_wrong_type_is_named_in_words(tmp_path, capsys):
    toml = tmp_path / "sweep.toml"
    toml.write_text('sizes = ["small"]\nbackends = ["numpy"]\n[fields]\nlearning_rate = [[0.1]]\n')
    code, _, err = harness(capsys, "sweep", toml, "--out", tmp_path / "out")
    line = one_line(code, err, "fields.learning_rate: [0.1] is not a number, a string or true/false")
    assert "<class" not in line


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-p", "no:xdist", "-o", "addopts="]))
