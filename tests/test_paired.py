"""Paired timing: the statistics of planted rounds, and a real two-backend run that records it and resumes it.

The planted records give every figure by hand (geometric means, t intervals, coefficients of variation); the real
run checks the mechanism (processes alive at once, alternating bursts, the record, resume appending), never a
speed: the suite may run on a busy machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import run_cli

from harness import paired, stats

QUIET = {"step": 0, "n": 5, "wall_s": 0.25, "cpu_s": 0.25, "exec_s": 0.25, "wait_s": 0.0}
BUSY = dict(QUIET, exec_s=0.15, wait_s=0.1, cpu_s=0.15)


def planted(ratios: list[float], disturbed: tuple[int, ...] = (), sessions: int = 1, rounds: int = 10) -> dict:
    """A paired-timing record whose round r has torch steps of 10 ms and numpy steps of 10 ms x ratios[r]."""
    doc = paired.new_doc([{"name": "torch", "backend": "torch"}, {"name": "numpy", "backend": "numpy"}], "small",
                         1337, rounds)
    per = len(ratios) // sessions
    for s in range(sessions):
        session = {"status": "completed", "rounds": []}
        for i in range(s * per, (s + 1) * per):
            chunk = BUSY if i in disturbed else QUIET
            session["rounds"].append({"order": ["torch", "numpy"] if i % 2 == 0 else ["numpy", "torch"], "bursts": {
                "torch": {"times": [0.010, 0.011, 0.009], "chunk": chunk},
                "numpy": {"times": [0.010 * ratios[i]] * 3, "chunk": QUIET}}})
        doc["sessions"].append(session)
    return doc


def test_one_session_ratio_interval_and_cv_by_hand():
    ratios = [1.30, 1.25, 1.35, 1.28, 1.32]
    doc = planted(ratios, rounds=5)
    s = paired.pair_summary(doc, "numpy", "torch")  # time ratio numpy / torch = the planted ratios
    logs = [math.log(r) for r in ratios]
    m = sum(logs) / 5
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 4)
    half = stats.t_quantile(0.975, 4) * sd / math.sqrt(5)
    assert s["ratio"] == pytest.approx(math.exp(m))
    assert s["lo"] == pytest.approx(math.exp(m - half)) and s["hi"] == pytest.approx(math.exp(m + half))
    mean = sum(ratios) / 5
    assert s["cv"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in ratios) / 4) / mean)
    assert (s["rounds"], s["clean_rounds"], s["usable"], s["level"]) == (5, 5, True, "rounds")
    w = paired.speed_words(s)  # numpy's steps take longer: torch is the faster one, named first
    assert w["fast"] == "torch" and w["x"] == pytest.approx(math.exp(m)) and w["conclusive"]
    assert w["text"].startswith(f"torch is {math.exp(m):.3g}× faster than numpy [")
    flipped = paired.speed_words(paired.pair_summary(doc, "torch", "numpy"))  # the same words either way round
    assert flipped["text"] == w["text"]


def test_disturbed_rounds_leave_the_ratio_and_too_many_make_it_unusable():
    ratios = [1.3] * 10 + [3.0] * 4  # the disturbed rounds carry a wild ratio
    doc = planted(ratios, disturbed=tuple(range(10, 14)))
    s = paired.pair_summary(doc, "numpy", "torch")
    assert s["ratio"] == pytest.approx(1.3) and s["disturbed_rounds"] == 4 and s["usable"]
    assert paired.clean_rounds(doc) == 10 and paired.complete(doc)
    busy = planted([1.3, 3.0, 3.0, 3.0, 3.0], disturbed=(1, 2, 3, 4))  # 1 undisturbed of 5, 10 wanted
    b = paired.pair_summary(busy, "numpy", "torch")
    assert not b["usable"] and b["ratio"] > 1.3  # from every round, marked: no verdict may rest on it
    assert not paired.complete(busy)


def test_an_interval_that_includes_one_is_not_conclusive():
    s = paired.pair_summary(planted([0.9, 1.1, 1.0, 1.05, 0.95], rounds=5), "numpy", "torch")
    assert s["lo"] < 1 < s["hi"] and not paired.speed_words(s)["conclusive"]


def test_sessions_combine_across_sessions_not_rounds():
    doc = planted([1.2] * 5 + [1.4] * 5, sessions=2, rounds=5)
    s = paired.pair_summary(doc, "numpy", "torch")
    assert s["level"] == "sessions" and s["n"] == 2
    assert s["ratio"] == pytest.approx(math.sqrt(1.2 * 1.4))
    per_seed = [paired.pair_summary(planted([r] * 5, rounds=5), "numpy", "torch") for r in (1.2, 1.3, 1.4)]
    c = paired.combine(per_seed)
    logs = [math.log(r) for r in (1.2, 1.3, 1.4)]
    ci = stats.mean_ci(logs)
    assert c["seeds"] == 3 and c["ratio"] == pytest.approx(math.exp(ci.estimate))
    assert c["lo"] == pytest.approx(math.exp(ci.lo)) and c["hi"] == pytest.approx(math.exp(ci.hi))
    assert c["cv"] == pytest.approx(0.1 / 1.3, rel=1e-6)  # sample sd of 1.2, 1.3, 1.4 (0.1) over their mean
    busy = dict(per_seed[0], usable=False)
    dropped = paired.combine([busy, per_seed[1], per_seed[2]])
    assert dropped["seeds"] == 2 and dropped["seeds_dropped"] == 1 and dropped["usable"]


def test_a_run_of_two_backends_times_them_side_by_side_and_resume_adds_a_session(tmp_path: Path, tiny_config):
    out = tmp_path / "out"
    common = ["--config", str(tiny_config()), "--steps", "20", "--backend", "torch", "--backend", "numpy",
              "--no-text", "--quiet", "--threads", "1", "--out", str(out)]
    result = run_cli("run", *common, "--paired-rounds", "2", "--no-report")
    assert result.returncode == 0, result.stderr
    (run,) = (out / "runs").iterdir()
    doc = json.loads((run / "paired.json").read_text())
    assert doc["schema"] == paired.SCHEMA and [c["name"] for c in doc["contenders"]] == ["torch", "numpy"]
    (session,) = doc["sessions"]
    assert session["status"] in ("completed", "incomplete") and set(session["ready"]) == {"torch", "numpy"}
    pids = {session["ready"][n]["pid"] for n in ("torch", "numpy")}
    assert len(pids) == 2  # two timing processes, alive at once (each told the other's pid)
    rounds = session["rounds"]
    assert 2 <= len(rounds) <= 8 and [r["order"] for r in rounds[:2]] == [["torch", "numpy"], ["numpy", "torch"]]
    for r in rounds:
        for name, burst in r["bursts"].items():
            assert len(burst["times"]) >= paired.MIN_BURST and burst["chunk"]["n"] == len(burst["times"]), name
    starts = [r["bursts"]["torch"]["start"] for r in rounds]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)  # the batches go on, never repeated
    assert "paired timing:" in result.stderr and "faster than" in result.stderr
    before = len(rounds)
    # resume: a record that holds its rounds gets no new session; one that lacks them gets one, appended
    res = run_cli("run", "--resume", run.name, "--out", str(out), "--quiet", "--no-report", "--paired-rounds", "3")
    assert res.returncode == 0, res.stderr
    again = json.loads((run / "paired.json").read_text())
    assert len(again["sessions"]) == 2 and again["sessions"][0]["rounds"] == rounds  # never replaced by less
    assert len(paired.rounds_of(again)) > before
    from harness.report import write_report

    page = write_report(out, [run.name]).read_text()
    assert "paired timing: torch and numpy alive at once" in page and "Contention:" in page


def test_a_paired_record_follows_its_cells_to_their_new_runs(tmp_path: Path) -> None:
    """A sweep cell whose run directory was removed (a failed submission, a full disk) gets a new run on resume; its
    block's paired-timing record must then name the new run (else the timing fails and the report finds no verdict),
    and keep every session it holds."""
    from test_report import make_sweep

    from harness import paired
    from harness.sweep import manifest as mf

    out = tmp_path / "out"
    sweep_id = make_sweep(out, seeds=1)
    m = mf.Manifest.load(out, sweep_id)
    (entry,) = m.doc["paired"]
    before = paired.load(out / entry["path"])
    sessions = before["sessions"]
    cell = m.cells[entry["members"][1]]
    from test_report import make_run

    cell["run_id"] = make_run(out, backends=(cell["backend"],), text=False)  # the cell's new run
    mf.ensure_paired_doc(out, entry, m.cells, None)
    after = paired.load(out / entry["path"])
    moved = next(c for c in after["contenders"] if c["cell"] == cell["index"])
    assert moved["run_id"] == cell["run_id"] and moved["run_dir"].endswith(cell["run_id"])
    assert after["sessions"] == sessions  # nothing measured is lost
    paired.check_contenders(after, out / entry["path"])  # the coordinator accepts it
