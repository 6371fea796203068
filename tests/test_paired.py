"""Paired timing: the statistics of planted rounds, and a real two-backend run that records it and resumes it.

The planted records give every figure by hand (geometric means, t intervals, coefficients of variation); the real
run checks the mechanism (processes alive at once, alternating bursts, the record, resume appending), never a
speed: the suite may run on a busy machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import ClassVar

import pytest
from conftest import run_cli

from harness.backends.declaration import Declaration
from harness.run import paired_timing
from harness.store.paired import SCHEMA, Contender, PairedRecord
from harness.timing import paired, stats

QUIET = {"step": 0, "n": 5, "wall_s": 0.25, "cpu_s": 0.25, "exec_s": 0.25, "wait_s": 0.0}
BUSY = dict(QUIET, exec_s=0.15, wait_s=0.1, cpu_s=0.15)


def two_contenders() -> list[Contender]:
    return [Contender(name="torch", backend="torch"), Contender(name="numpy", backend="numpy")]


def planted(ratios: list[float], disturbed: tuple[int, ...] = (), sessions: int = 1, rounds: int = 10
            ) -> PairedRecord:
    """A paired-timing record whose round r has torch steps of 10 ms and numpy steps of 10 ms x ratios[r]."""
    doc = paired_timing.new_doc(two_contenders(), "small", 1337, rounds).to_dict()
    per = len(ratios) // sessions
    for s in range(sessions):
        session = {"status": "completed", "rounds": []}
        for i in range(s * per, (s + 1) * per):
            chunk = BUSY if i in disturbed else QUIET
            session["rounds"].append({"order": ["torch", "numpy"] if i % 2 == 0 else ["numpy", "torch"], "bursts": {
                "torch": {"times": [0.010, 0.011, 0.009], "chunk": chunk},
                "numpy": {"times": [0.010 * ratios[i]] * 3, "chunk": QUIET}}})
        doc["sessions"].append(session)
    return PairedRecord.from_dict(doc)


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
    # by hand: the mean of the logs and its t interval (n = 3 seeds, 2 degrees of freedom)
    logs = [math.log(r) for r in (1.2, 1.3, 1.4)]
    m = sum(logs) / 3
    half = stats.t_quantile(0.975, 2) * math.sqrt(sum((x - m) ** 2 for x in logs) / 2) / math.sqrt(3)
    assert c["seeds"] == 3 and c["ratio"] == pytest.approx(math.exp(m))
    assert c["lo"] == pytest.approx(math.exp(m - half)) and c["hi"] == pytest.approx(math.exp(m + half))
    assert half == pytest.approx(4.302652729749462 * 0.07709437796153266 / math.sqrt(3), rel=1e-9)  # scipy's t, sd
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
    assert doc["schema"] == SCHEMA and [c["name"] for c in doc["contenders"]] == ["torch", "numpy"]
    (session,) = doc["sessions"]
    assert session["status"] in ("completed", "incomplete") and set(session["ready"]) == {"torch", "numpy"}
    pids = {session["ready"][n]["pid"] for n in ("torch", "numpy")}
    assert len(pids) == 2  # two timing processes, alive at once (each told the other's pid)
    rounds = session["rounds"]
    assert 2 <= len(rounds) <= 8 and [r["order"] for r in rounds[:2]] == [["torch", "numpy"], ["numpy", "torch"]]
    for r in rounds:
        for name, burst in r["bursts"].items():
            assert len(burst["times"]) >= paired_timing.MIN_BURST and burst["chunk"]["n"] == len(burst["times"]), name
    starts = [r["bursts"]["torch"]["start"] for r in rounds]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)  # the batches go on, never repeated
    assert "paired timing:" in result.stderr and "faster than" in result.stderr
    before = len(rounds)
    # resume: a record that holds its rounds gets no new session; one that lacks them gets one, appended
    res = run_cli("resume", run.name, "--out", str(out), "--quiet", "--no-report", "--paired-rounds", "3")
    assert res.returncode == 0, res.stderr
    again = json.loads((run / "paired.json").read_text())
    assert len(again["sessions"]) == 2 and again["sessions"][0]["rounds"] == rounds  # never replaced by less
    assert len(paired.rounds_of(PairedRecord.from_dict(again))) > before
    from harness.report import write_report

    page = write_report(out, [run.name]).read_text()
    assert "paired timing: torch and numpy alive at once" in page and "Contention:" in page


def test_a_paired_record_follows_its_cells_to_their_new_runs(tmp_path: Path) -> None:
    """A sweep cell whose run directory was removed (a failed submission, a full disk) gets a new run on resume; its
    block's paired-timing record must then name the new run (else the timing fails and the report finds no verdict),
    and keep every session it holds."""
    from test_report import make_sweep

    from harness.run import paired_timing
    from harness.sweep import manifest as mf
    from harness.timing import paired

    out = tmp_path / "out"
    sweep_id = make_sweep(out, seeds=1)
    m = mf.Manifest.load(out, sweep_id)
    (entry,) = m.paired
    before = paired.load(entry.record(out))
    sessions = before.to_dict()["sessions"]
    cell = m.cells[entry.members[1]]
    from test_report import make_run

    cell.run_id = make_run(out, backends=(cell.backend,), text=False)  # the cell's new run
    mf.ensure_paired_doc(out, entry, m.cells, None)
    after = paired.load(entry.record(out))
    moved = next(c for c in after.contenders if c.cell == cell.index)
    assert moved.run_id == cell.run_id and moved.run_dir.endswith(cell.run_id)
    assert after.to_dict()["sessions"] == sessions  # nothing measured is lost
    paired_timing.check_contenders(after, entry.record(out))  # the coordinator accepts it


class FakeChild:
    """A timing process that answers at once: ready, then one burst per request of 3 steps of 1 ms, its chunk
    quiet except in the rounds listed in `busy` (round index, contender); raises KeyboardInterrupt (Ctrl-C, or
    SIGTERM in `python -m harness --worker paired`) when asked for the burst of round `interrupt_at`."""

    busy: ClassVar[set] = set()
    interrupt_at: ClassVar[int | None] = None
    pids = iter(range(10_000, 20_000))

    def __init__(self, contender: Contender, threads: int | None, warmup_s: float):
        self.name, self.sent, self.bursts = contender.name, [], 0
        self.proc = type("Proc", (), {"pid": next(FakeChild.pids), "poll": lambda proc: 0})()  # quits when asked

    def send(self, msg: dict) -> None:
        self.sent.append(msg)

    def receive(self, timeout: float) -> dict:
        if not self.sent:
            return {"ready": True, "step_s": 0.001, "next_step": 10, "pid": self.proc.pid}
        msg = self.sent[-1]
        r = self.bursts
        self.bursts += 1
        if r == FakeChild.interrupt_at:
            raise KeyboardInterrupt
        chunk = BUSY if (r, self.name) in FakeChild.busy else QUIET
        return {"start": msg["start"], "times": [0.001] * 3, "chunk": dict(chunk, step=msg["start"], n=3)}


@pytest.fixture
def fake_session(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """paired.run with FakeChild timing processes; returns (path, doc, writes, judged): the record's path, a fresh
    record wanting 5 rounds, the times the record was written, the bursts judged."""
    from harness.timing import contention

    monkeypatch.setattr(paired_timing, "Child", FakeChild)
    monkeypatch.setattr(paired_timing, "check_contenders", lambda doc, path: None)
    monkeypatch.setattr(FakeChild, "busy", set())
    monkeypatch.setattr(FakeChild, "interrupt_at", None)
    writes, judged = [], []
    write, judge = PairedRecord.dump, contention.judge
    monkeypatch.setattr(PairedRecord, "dump", lambda doc, p: writes.append(p) or write(doc, p))
    monkeypatch.setattr(contention, "judge", lambda c: judged.append(c) or judge(c))
    doc = paired_timing.new_doc(two_contenders(), "small", 1337, rounds=5)
    return tmp_path / "paired.json", doc, writes, judged


def test_a_session_counts_its_rounds_as_it_goes_and_writes_the_record_every_few_seconds(fake_session, monkeypatch):
    path, doc, writes, judged = fake_session
    monkeypatch.setattr(paired_timing, "PERSIST_EVERY_S", 1e9)  # no periodic write in so short a session
    FakeChild.busy = {(2, "numpy")}  # round 2's second burst waited: 6 rounds for 5 undisturbed ones
    out = paired_timing.run(path, doc, progress=False)
    assert len(judged) == 2 * 6  # every burst judged once (not every burst so far after every round)
    assert len(writes) == 2  # the session's start and its end, not once per round
    (session,) = json.loads(path.read_text())["sessions"]
    assert len(session["rounds"]) == 6 and session["status"] == "completed" and paired.clean_rounds(out) == 5
    monkeypatch.setattr(paired_timing, "PERSIST_EVERY_S", 0.0)  # a long session: written as it goes
    FakeChild.busy = set()
    writes.clear()
    paired_timing.run(path, progress=False, rounds=8)
    assert len(writes) == 1 + 3 + 1 and len(json.loads(path.read_text())["sessions"][1]["rounds"]) == 3


def test_an_interrupted_session_keeps_every_round_it_measured(fake_session, monkeypatch):
    path, doc, writes, _ = fake_session
    monkeypatch.setattr(paired_timing, "PERSIST_EVERY_S", 1e9)  # nothing written between the session's start and end
    FakeChild.interrupt_at = 3  # Ctrl-C (or SIGTERM) during round 3: rounds 0..2 are in
    with pytest.raises(KeyboardInterrupt):
        paired_timing.run(path, doc, progress=False)
    saved = json.loads(path.read_text())
    (session,) = saved["sessions"]
    assert len(session["rounds"]) == 3 and session["status"] == "interrupted" and saved["status"] == "interrupted"
    assert len(writes) == 2  # the last write, on the way out, holds the rounds
    assert session["finished_at"]


def test_no_verdict_is_out_of_reach_only_when_every_round_left_could_not_make_one():
    """A verdict needs half the wanted undisturbed rounds, at least 3 (or all when fewer are wanted): the rounds left
    cannot change "no verdict" only when even all of them undisturbed would not bring the count there."""
    assert paired.needed_for_a_verdict(10) == 5 and paired.needed_for_a_verdict(2) == 2
    assert paired.out_of_reach(0, 4, 10) and not paired.out_of_reach(0, 5, 10)
    assert paired.out_of_reach(3, 1, 10) and not paired.out_of_reach(4, 1, 10)
    assert not paired.out_of_reach(5, 0, 10)  # enough already: nothing is out of reach
    assert paired.out_of_reach(0, 0, 1) and not paired.out_of_reach(0, 1, 1)


def test_a_session_that_can_no_longer_give_a_verdict_stops_early(fake_session, monkeypatch, capsys):
    """Every round disturbed (a machine busy throughout): the session stops once the rounds left of its cap could not
    make the undisturbed rounds a verdict needs, says so, and records why; it never runs to its cap for nothing."""
    path, doc, _, _ = fake_session  # 5 undisturbed rounds wanted, at most 20: a verdict needs 3
    FakeChild.busy = {(r, name) for r in range(100) for name in ("torch", "numpy")}
    out = paired_timing.run(path, doc, progress=False)
    (session,) = out.sessions
    assert len(session.rounds) == 18 and session.status == "incomplete"  # 2 left: 0 + 2 < 3
    assert session.stopped and "even 2 more could not make the 3 a verdict needs" in session.stopped
    assert "no verdict" in capsys.readouterr().err
    assert json.loads(path.read_text())["sessions"][0]["stopped"] == session.stopped  # recorded
    assert not paired.pair_summary(out, "torch", "numpy")["usable"]


def test_a_session_that_may_still_give_a_verdict_goes_on(fake_session):
    """Disturbed until round 17, then quiet: 3 undisturbed rounds are still within reach, and come (4 of them)."""
    path, doc, _, _ = fake_session
    FakeChild.busy = {(r, name) for r in range(16) for name in ("torch", "numpy")}
    (session,) = paired_timing.run(path, doc, progress=False).sessions
    assert session.status == "incomplete" and not session.stopped and len(session.rounds) == 20
    assert paired.pair_summary(paired.load(path), "torch", "numpy")["usable"]  # 5 undisturbed: a verdict


def test_the_paired_timing_shows_its_round_count_cap_and_time_left_on_a_terminal(fake_session, monkeypatch):
    import io

    from harness import progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    path, _, _, _ = fake_session
    FakeChild.busy = {(1, "numpy")}
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    monkeypatch.setenv("COLUMNS", "200")  # the line is cut to the terminal's width
    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr("sys.stderr", stream)
        paired_timing.run(path.with_name(f"{shown}.json"), paired_timing.new_doc(two_contenders(), "s", 1, 5),
                          progress=True)
        text = stream.getvalue()
        assert ("\rpaired timing: round 2 of at most 20, 1 of 5 undisturbed, 0:00 elapsed, about" in text) == shown
        assert ("left (at most" in text) == shown, text
        assert "paired timing: 6 rounds, 5 undisturbed in all" in text  # the lasting lines, terminal or not


def test_a_second_coordinator_of_one_record_is_refused(fake_session, capsys):
    """Two coordinators of one record (a SLURM job resubmitted while the first still runs) would drop each other's
    rounds: while one holds the record, the other exits 2 with one line and writes nothing."""
    path, doc, writes, _ = fake_session
    doc.dump(path)
    before = path.read_bytes()
    writes.clear()
    with paired_timing.RecordLock(path):  # the first coordinator, mid-session
        with pytest.raises(paired_timing.UsageError, match="another paired timing holds"):
            paired_timing.run(path, progress=False)
        assert paired_timing.main([str(path)]) == 2
        err = capsys.readouterr().err
        assert "another paired timing holds" in err and len(err.strip().splitlines()) == 1, err
        assert path.read_bytes() == before and not writes
    assert paired.clean_rounds(paired_timing.run(path, progress=False)) == 5  # released: the next one runs


def test_a_paired_record_of_an_older_harness_is_refused(tmp_path: Path) -> None:
    """One schema-version check: a paired.json of another version is one line naming it, never read."""
    from harness.errors import UsageError

    path = tmp_path / "paired.json"
    path.write_text(json.dumps(dict(planted([1.0] * 10).to_dict(), schema_version=0)))
    with pytest.raises(UsageError, match=r"paired.json' was written by an older nanogpt-parity \(schema 0\); re-run"):
        paired.load(path)
    path.write_text(json.dumps(planted([1.0] * 10).to_dict()))
    assert paired.clean_rounds(paired.load(path)) == 10


def test_a_timed_process_ends_each_burst_synchronised_and_takes_its_partners_as_its_own(monkeypatch, capsys):
    """The timed process (harness.run.timed.serve) with a fake backend on a fake GPU: the coordinator's first message
    makes the partners and the coordinator's process tree ours in the GPU evidence, and every burst ends with the
    device synchronised before its closing reading and its reply, so the next contender never starts while this
    one's work is still queued. Planted bugs: no synchronize (the last event of a burst is its step, or the reading),
    or the coordinator not passed on (tree_root None)."""
    import io
    import sys
    from types import SimpleNamespace

    import numpy as np

    import harness.run.worker as worker_module
    from harness.config.load import load_config
    from harness.core.data import BatchStream
    from harness.run import timed
    from harness.timing import contention

    events: list[str] = []
    config = load_config("small").replace(block_size=8, batch_size=2, eval_interval=10_000)
    ids = np.random.default_rng(0).integers(0, 11, size=2000)

    class FakeBackend:
        name = "fake"
        declaration = Declaration(name="fake", dtypes=("float32",), methods=frozenset({"device_clock"}))

        def train_step(self, x, y, lr):
            events.append("step")
            return 1.0

        def losses_to_floats(self, losses):
            return [float(v) for v in losses]

        def synchronize(self):
            events.append("sync")

        def describe(self):
            return {}

        def device_clock(self):  # an asynchronous device: no sync per step, markers read at the flush
            return SimpleNamespace(mark=lambda: len(events), elapsed_s=lambda a, b: 0.001)

    class FakeWorker:  # harness.run.worker.Worker: the run's inputs and its backend, set up
        def __init__(self, paths, name):
            self.config, self.device, self.seed, self.setup_s = config, "cuda", 1, 0.0
            stream = BatchStream(ids, config.block_size, config.batch_size, 1, config.scheme)
            self.inputs, self.backend = SimpleNamespace(stream=stream), FakeBackend()

    class FakeGpu:
        def __init__(self):
            self.siblings, self.tree_root = set(), None

        def state(self):
            events.append("reading")
            return {"others": 0}

    gpu = FakeGpu()
    probe = contention.Probe(gpu=gpu)
    monkeypatch.setattr(worker_module, "Worker", FakeWorker)
    monkeypatch.setattr(contention, "default_probe", lambda device: (probe, ""))
    monkeypatch.setattr(timed, "WARMUP_STEPS", 5)
    lines = [{"siblings": [71], "coordinator": 70}, {"burst": 4, "start": 5}, {"burst": 3, "start": 9}, {"quit": True}]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(json.dumps(m) + "\n" for m in lines)))
    assert timed.serve(Path("out/runs/unused"), "fake", warmup_s=0.0) == 0
    assert gpu.siblings == {71} and gpu.tree_root == 70
    bursts = "".join("s" if e == "step" else "y" if e == "sync" else "r" for e in events).split("r")
    # after the warm-up: reading, 4 steps, sync, reading; reading, 3 steps, sync, reading
    assert [b for b in bursts if "s" in b][-2:] == ["ssssy", "sssy"], events
    replies = [json.loads(line.split(timed.MARK, 1)[1]) for line in capsys.readouterr().out.splitlines()
               if timed.MARK in line]
    assert [r.get("start") for r in replies[1:]] == [5, 9]
