"""Contention evidence and the rule that judges it: fake /proc trees, fake clocks and a stub NVML, no timing.

Each test plants the evidence (a thread's run-queue wait, the hypervisor's steal, another process on the GPU) and
checks what the rule makes of it, down to which steps leave the steady-state figures.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

from harness.backends.declaration import Declaration
from harness.run.loop import Curves, LoopOptions, train
from harness.store.contention import truncate_chunks
from harness.timing import contention
from harness.timing.contention import Probe, Sampler, Snapshot, chunk, judge
from harness.timing.steady import summarize_times


# --- a fake /proc -------------------------------------------------------------------------------------------------
class FakeProc:
    """A /proc tree the test writes: per-thread schedstat (exec ns, wait ns), /proc/stat, loadavg, PSI."""

    def __init__(self, root: Path, ncpu: int = 2):
        self.root, self.ncpu = root, ncpu
        (root / "self" / "task").mkdir(parents=True)
        (root / "pressure").mkdir()
        self.set(threads={"100": (0, 0)}, busy=0, idle=0, steal=0, load=0.5, psi_us=0)

    def set(self, threads: dict[str, tuple[float, float]], busy: int, idle: int, steal: int, load: float,
            psi_us: int) -> None:
        """threads: {tid: (exec s, wait s)}; busy/idle/steal in clock ticks (1/100 s) summed over every CPU."""
        task = self.root / "self" / "task"
        for old in task.iterdir():
            (old / "schedstat").unlink()
            old.rmdir()
        for tid, (e, w) in threads.items():
            (task / tid).mkdir()
            (task / tid / "schedstat").write_text(f"{round(e * 1e9)} {round(w * 1e9)} 7\n")
        cpus = "".join(f"cpu{i} 1 0 1 1 0 0 0 0 0 0\n" for i in range(self.ncpu))
        (self.root / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 {steal} 0 0\n{cpus}intr 1\n")
        (self.root / "loadavg").write_text(f"{load:.2f} 0.40 0.30 1/100 1234\n")
        (self.root / "pressure" / "cpu").write_text(
            f"some avg10=0.00 avg60=0.00 avg300=0.00 total={psi_us}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


class Clock:
    """A clock that returns what the test sets."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def test_probe_reads_every_field_of_a_fake_proc(proc: FakeProc):
    wall, cpu = Clock(10.0), Clock(3.0)
    proc.set(threads={"100": (2.5, 0.25), "101": (0.5, 0.05)}, busy=700, idle=300, steal=20, load=1.75,
             psi_us=4_000_000)
    snap = Probe(proc.root, clock=wall, cpu_clock=cpu, clk_tck=100).snapshot()
    assert (snap.wall, snap.cpu, snap.threads, snap.ncpu, snap.load1) == (10.0, 3.0, 2, 2, 1.75)
    assert snap.tasks == {"100": (2.5, 0.25), "101": (0.5, 0.05)}
    assert snap.machine == pytest.approx((7.0, 0.2, 10.2))  # busy, steal, total (busy + idle + steal) seconds
    assert snap.psi_some_s == pytest.approx(4.0)


def test_missing_proc_files_give_none_not_an_error(tmp_path: Path):
    snap = Probe(tmp_path / "nothing", clock=Clock(1.0), cpu_clock=Clock(0.5)).snapshot()
    assert snap.tasks is None and snap.machine is None and snap.load1 is None and snap.psi_some_s is None
    c = chunk(snap, snap, 0, 3)
    assert c["wait_s"] is None and contention.wait_fraction(c) is None and judge(c) == []
    assert contention.evidence([c]) == "none" and contention.disturbed_steps([c], 3) is None


def _snap(wall: float, cpu: float, tasks: dict, machine=(0.0, 0.0, 0.0), gpu=None) -> Snapshot:
    return Snapshot(wall=wall, cpu=cpu, threads=len(tasks), tasks=tasks, machine=machine, ncpu=2, load1=1.0, gpu=gpu)


def test_chunk_deltas_and_threads_that_come_and_go():
    a = _snap(0.0, 1.0, {"1": (1.0, 0.1), "2": (0.5, 0.0), "gone": (9.0, 9.0)}, machine=(10.0, 0.0, 20.0))
    b = _snap(0.5, 1.45, {"1": (1.4, 0.15), "2": (0.55, 0.0), "new": (0.02, 0.01)}, machine=(11.0, 0.05, 21.0))
    c = chunk(a, b, first_step=40, steps=12)
    assert (c["step"], c["n"]) == (40, 12)
    assert c["wall_s"] == pytest.approx(0.5) and c["cpu_s"] == pytest.approx(0.45)
    # exec: 0.4 + 0.05 + 0.02 (a new thread counts from zero; one that ended contributes nothing)
    assert c["exec_s"] == pytest.approx(0.47) and c["wait_s"] == pytest.approx(0.06)
    assert c["busy_s"] == pytest.approx(1.0) and c["steal_s"] == pytest.approx(0.05)
    assert c["others_cpu_s"] == pytest.approx(1.0 - 0.45)
    assert contention.wait_fraction(c) == pytest.approx(0.06 / 0.53)


@pytest.mark.parametrize("wait, steal, gpu, disturbed", [
    (0.0, 0.0, None, False),
    (0.09, 0.0, None, False),  # just under WAIT_MAX: the noise of a shared but undisturbing machine
    (0.11, 0.0, None, True),
    (0.40, 0.0, None, True),  # two busy loops on two cores beside a one-thread worker: ~0.35-0.40 measured
    (0.0, 0.2, None, True),  # the hypervisor took a fifth of the machine
    (0.0, 0.0, {"others": 1, "reasons": 0x4}, True),  # another compute process on the GPU
    (0.0, 0.0, {"others": 0, "reasons": 0x4 | 0x1}, False),  # power cap and idle: a GPU's normal state
    (0.0, 0.0, {"others": 0, "reasons": 0x40}, True),  # hardware thermal slowdown
    (0.0, 0.0, {"others": None, "reasons": None}, False),  # NVML refused both: no evidence, no verdict
])
def test_the_rule(wait: float, steal: float, gpu: dict | None, disturbed: bool):
    c = {"step": 0, "n": 10, "wall_s": 1.0, "cpu_s": 1.0 - wait, "exec_s": 1.0 - wait, "wait_s": wait,
         "steal_s": steal, "total_s": 1.0, "gpu": [gpu, gpu] if gpu else None}
    assert bool(judge(c)) is disturbed, judge(c)


def test_steps_inherit_their_chunks_verdict_and_figures_drop_them():
    quiet = {"wall_s": 1.0, "cpu_s": 1.0, "exec_s": 1.0, "wait_s": 0.0}
    busy = dict(quiet, exec_s=0.6, wait_s=0.4, cpu_s=0.6)
    chunks = [dict(quiet, step=0, n=20), dict(busy, step=20, n=30), dict(quiet, step=50, n=50)]
    flags = contention.disturbed_steps(chunks, 100)
    assert flags[:20].sum() == 0 and flags[20:50].all() and flags[50:].sum() == 0
    times = [0.010] * 100
    times[25:45] = [0.050] * 20  # the disturbed chunk's steps are slow
    summary = summarize_times(times, 1000, warmup=10, disturbed=flags)
    assert summary["steady_steps_all"] == 90 and summary["disturbed_steps"] == 30 and summary["steady_steps"] == 60
    assert summary["step_median_s"] == pytest.approx(0.010) and summary["step_p90_s"] == pytest.approx(0.010)
    assert summary["figures_from"] == "undisturbed steps"
    plain = summarize_times(times, 1000, warmup=10)  # without the evidence the slow steps count
    assert plain["step_p90_s"] == pytest.approx(0.050) and "disturbed_steps" not in plain
    c = contention.summarize(chunks, 100, 10)
    assert c.contended_fraction == pytest.approx(30 / 90) and not c.mostly_disturbed
    assert c.disturbed_chunks == 1 and c.reasons == {"cpu wait": 1} and c.evidence == "schedstat"
    assert c.rule["wait_max"] == contention.WAIT_MAX and c.cpu_per_wall == pytest.approx(1.0)
    assert "33% of 90 steady steps disturbed (cpu wait)" in contention.sentence(c)


def test_a_mostly_disturbed_run_is_marked_and_says_so():
    busy = {"wall_s": 1.0, "cpu_s": 0.6, "exec_s": 0.6, "wait_s": 0.4}
    chunks = [dict(busy, step=0, n=80), {"step": 80, "n": 20, "wall_s": 1.0, "cpu_s": 1.0, "exec_s": 1.0,
                                         "wait_s": 0.0}]
    c = contention.summarize(chunks, 100, 10)
    assert c.mostly_disturbed and c.contended_fraction == pytest.approx(70 / 90)
    assert "kept out of speed verdicts" in contention.sentence(c)
    everything = summarize_times([0.01] * 100, 1000, warmup=10, disturbed=[True] * 100)
    assert everything["figures_from"] == "all steady steps (none undisturbed)" and everything["steady_steps"] == 90


def test_summarize_counts_each_kind_of_reason_under_its_stored_name_judging_each_chunk_once(monkeypatch):
    """The `reasons` keys are in records on disk (and the reports read them): "cpu wait", "steal",
    "gpu: other process", "gpu slowdown". Two different GPU states at a chunk's ends are two reasons."""
    every = {"step": 0, "n": 10, "wall_s": 1.0, "cpu_s": 0.6, "exec_s": 0.6, "wait_s": 0.4, "steal_s": 0.2,
             "total_s": 1.0, "gpu": [{"others": 1, "reasons": 0x40}, {"others": 2, "reasons": 0x40}]}
    quiet = {"step": 10, "n": 10, "wall_s": 1.0, "cpu_s": 1.0, "exec_s": 1.0, "wait_s": 0.0}
    assert judge(every) == ["waited for a CPU 40% of the time", "hypervisor steal 20%",
                            "1 other compute process(es) on the GPU", "GPU hw_thermal_slowdown",
                            "2 other compute process(es) on the GPU"]
    calls = []
    real = contention.reasons
    monkeypatch.setattr(contention, "reasons", lambda c: calls.append(c) or real(c))
    c = contention.summarize([every, quiet], 20, 0)
    assert c.reasons == {"cpu wait": 1, "steal": 1, "gpu: other process": 2, "gpu slowdown": 1}
    assert c.disturbed_chunks == 1 and c.disturbed_steps == 10 and len(calls) == 2


def test_truncate_chunks_keeps_the_evidence_of_a_straddling_chunk():
    chunks = [{"step": 0, "n": 10}, {"step": 10, "n": 10}, {"step": 20, "n": 5}]
    assert truncate_chunks(chunks, 15) == [{"step": 0, "n": 10}, {"step": 10, "n": 5}]
    assert truncate_chunks(chunks, 10) == [{"step": 0, "n": 10}]
    assert truncate_chunks(chunks, 25) == chunks and truncate_chunks(chunks, 0) == []


def test_sampler_cuts_chunks_by_the_clock_and_around_evaluations(proc: FakeProc):
    wall, cpu = Clock(0.0), Clock(0.0)
    s = Sampler(Probe(proc.root, clock=wall, cpu_clock=cpu), chunk_s=0.5)
    s.open(0)
    for step in range(1, 11):  # 0.125 s per step: a chunk is due every 4 steps
        wall.t += 0.125
        s.tick(step)
    assert [(c["step"], c["n"]) for c in s.chunks] == [(0, 4), (4, 4)]
    s.close(10)  # an evaluation at step 10: the open chunk ends there
    s.close(10)  # closing twice changes nothing
    s.open(10)
    s.close(10)  # a chunk with no step is dropped
    assert [(c["step"], c["n"]) for c in s.chunks] == [(0, 4), (4, 4), (8, 2)]
    assert [c["wall_s"] for c in s.chunks] == [0.5, 0.5, 0.25]


def test_a_chunk_boundary_reads_the_machine_once(proc: FakeProc):
    """On the training loop's path the reading that ends a chunk also starts the next: 10 boundaries, 10 readings
    (plus the opening and closing ones), and the chunks tile the time with no gap."""
    wall, cpu = Clock(0.0), Clock(0.0)
    reads = []

    class Counting(Probe):
        def snapshot(self) -> Snapshot:
            reads.append(wall.t)
            return super().snapshot()

    s = Sampler(Counting(proc.root, clock=wall, cpu_clock=cpu), chunk_s=10 * DT)
    s.open(0)
    for step in range(1, 101):
        wall.t += DT
        s.tick(step)
    s.close(100)
    assert len(reads) == 1 + 10 + 1  # open, one per boundary (at steps 10, 20, ..., 100), close
    assert [(c["step"], c["n"]) for c in s.chunks] == [(10 * i, 10) for i in range(10)]
    assert sum(c["wall_s"] for c in s.chunks) == 100 * DT


DT = 1 / 64  # a fake step's seconds (a binary fraction: sums of them are exact)


class TickingBackend:
    """A backend whose step advances a fake clock and, from step 30 to 59, makes another thread of the machine
    hold our CPU (the fake /proc's run-queue wait grows as fast as our exec time)."""

    name = "ticking"
    declaration = Declaration(name="ticking", dtypes=("float32",))

    def __init__(self, proc: FakeProc, wall: Clock, cpu: Clock):
        self.proc, self.wall, self.cpu, self.step = proc, wall, cpu, 0
        self.exec, self.wait = 0.0, 0.0

    def train_step(self, x, y, lr):
        busy = 30 <= self.step < 65
        self.wall.t += DT
        self.cpu.t += DT / 2 if busy else DT
        self.exec += DT / 2 if busy else DT
        self.wait += DT / 2 if busy else 0.0
        self.proc.set(threads={"100": (self.exec, self.wait)}, busy=0, idle=0, steal=0, load=1.0, psi_us=0)
        self.step += 1
        return 1.0

    def losses_to_floats(self, losses):
        return [float(v) for v in losses]

    def synchronize(self):
        pass

    def eval_loss(self, x, y):
        return 1.0


def test_the_training_loop_records_chunks_and_the_worker_summary_drops_the_disturbed_steps(proc: FakeProc):
    from harness.config.load import load_config
    from harness.timing.steady import steady_start

    config = load_config("small").replace(steps=100, eval_interval=50)
    wall, cpu = Clock(0.0), Clock(0.0)
    backend = TickingBackend(proc, wall, cpu)

    class Stream:
        def batch(self, step):
            return np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64)

    cv = Curves()
    # 15 steps per chunk: 50 is no multiple of 15, so only the evaluation at step 50 can put a boundary there
    sampler = Sampler(Probe(proc.root, clock=wall, cpu_clock=cpu), chunk_s=15 * DT)
    out = train(backend, config, Stream(), {"val": [(np.zeros(1), np.zeros(1))]}, cv, 100,
                LoopOptions(progress=False, sampler=sampler))
    assert out.status == "completed" and len(cv.loss) == 100
    spans = [(c["step"], c["n"]) for c in cv.chunks]
    assert sum(n for _, n in spans) == 100 and spans[0] == (0, 15)
    assert not any(s < 50 < s + n for s, n in spans)  # the evaluation at step 50 ends a chunk
    assert spans == [(0, 15), (15, 15), (30, 15), (45, 5), (50, 15), (65, 15), (80, 15), (95, 5)]
    flags = contention.disturbed_steps(cv.chunks, 100)  # steps 30..64 were busy: exactly their chunks
    assert flags[30:65].all() and not flags[:30].any() and not flags[65:].any()
    summary = contention.summarize(cv.chunks, 100, steady_start(100))
    assert summary.disturbed_steps == 35 and summary.contended_fraction == pytest.approx(35 / 90)


# --- NVML through a stub --------------------------------------------------------------------------------------------
class StubNvml(types.SimpleNamespace):
    """The parts of pynvml the probe calls, answering what the test plants."""

    NVML_CLOCK_SM = 1

    def __init__(self, pids=(), reasons=0x4, sm=1980, event_api=True, fail=()):
        super().__init__(pids=list(pids), reasons=reasons, sm=sm, fail=set(fail), inited=False)
        if event_api:
            self.nvmlDeviceGetCurrentClocksEventReasons = self._reasons
        self.nvmlDeviceGetCurrentClocksThrottleReasons = self._reasons

    def nvmlInit(self):  # noqa: N802 (pynvml's names)
        self.inited = True

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802 (pynvml's names)
        return ("index", i)

    def nvmlDeviceGetHandleByUUID(self, uuid):  # noqa: N802 (pynvml's names)
        return ("uuid", uuid)

    def nvmlDeviceGetClockInfo(self, handle, kind):  # noqa: N802 (pynvml's names)
        if "clock" in self.fail:
            raise RuntimeError("Not Supported")
        assert kind == self.NVML_CLOCK_SM
        return self.sm

    def _reasons(self, handle):
        return self.reasons

    def nvmlDeviceGetComputeRunningProcesses(self, handle):  # noqa: N802 (pynvml's names)
        if "procs" in self.fail:
            raise RuntimeError("Insufficient Permissions")
        return [types.SimpleNamespace(pid=p, usedGpuMemory=1) for p in self.pids]


def test_nvml_probe_counts_other_processes_but_not_itself_or_its_siblings(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234,1")
    nvml = StubNvml(pids=[10, 11, 99], reasons=0x4)
    probe = contention.NvmlProbe(nvml, pid=10)
    assert nvml.inited and probe.handle == ("uuid", "GPU-1234")
    assert probe.state() == {"sm_mhz": 1980, "reasons": 0x4, "others": 2, "own_listed": True, "listed": 3,
                             "match": "pid"}
    probe.siblings = {11}  # paired timing: the other contender holds a context on the same GPU, idle
    assert probe.state()["others"] == 1
    hidden = contention.NvmlProbe(StubNvml(pids=[5, 6]), device=0, pid=10)  # a container hides our pid
    assert hidden.state()["others"] == 1 and hidden.state()["own_listed"] is False
    assert hidden.state()["match"] == "count"
    old = contention.NvmlProbe(StubNvml(pids=[10], reasons=0x40, event_api=False), device="0", pid=10)
    assert old.state()["reasons"] == 0x40  # an older nvidia-ml-py: the throttle-reasons name
    refused = contention.NvmlProbe(StubNvml(pids=[10], fail={"clock", "procs"}), device=0, pid=10)
    assert refused.state() == {"sm_mhz": None, "reasons": 0x4, "others": None, "own_listed": None, "listed": None,
                               "match": None}


def _stat(proc: Path, pid: int, ppid: int, comm: str = "python") -> None:
    """/proc/PID/stat with the fields NvmlProbe.parent reads (the command name may hold spaces and parentheses)."""
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 0 0 0 0\n")


def _paired_probe(nvml: StubNvml, proc: Path, pid: int, partners: list[int], coordinator: int) -> contention.NvmlProbe:
    """The probe of a paired timing's timed process as harness.run.timed sets it up from the coordinator's message."""
    probe = contention.NvmlProbe(nvml, device=0, pid=pid, proc=proc)
    probe.siblings, probe.tree_root = {p for p in partners if p != pid}, coordinator
    return probe


def test_paired_partners_on_the_gpu_are_not_contention_and_a_foreign_process_is(tmp_path: Path):
    """A bare machine (NVML's pids are ours): a paired timing's two timed processes (500, 501, children of the
    coordinator 400), a child of one of them holding a context of its own (502, under 501, its command name with
    spaces and parentheses) and the coordinator itself are ours: every burst undisturbed. A training process of
    someone else (900, under 1) disturbs. Planted bugs: matching the siblings only (the coordinator, as when its
    preflight left a CuPy context, or a partner's child count as others: 0 undisturbed rounds of 40, as on the
    H100), or dropping the foreign process."""
    proc = tmp_path / "proc"
    for pid, ppid in ((400, 300), (500, 400), (501, 400), (502, 501), (900, 1)):
        _stat(proc, pid, ppid, "pt_main thread (x)" if pid == 502 else "python")
    nvml = StubNvml(pids=[400, 500, 501, 502], reasons=0x4)
    for me in (500, 501):
        state = _paired_probe(nvml, proc, me, [500, 501], coordinator=400).state()
        assert state["others"] == 0 and state["match"] == "pid" and state["listed"] == 4
        assert judge({"gpu": [state, state]}) == []
    nvml.pids.append(900)
    state = _paired_probe(nvml, proc, 500, [500, 501], coordinator=400).state()
    assert state["others"] == 1 and judge({"gpu": [state, state]}) == ["1 other compute process(es) on the GPU"]
    alone = contention.NvmlProbe(StubNvml(pids=[500, 400]), device=0, pid=500, proc=proc)
    assert alone.state()["others"] == 1  # a training worker (no tree root): a process beside it is another's


def test_paired_partners_in_a_container_are_counted_not_matched(tmp_path: Path):
    """A container with its own pid namespace: NVML lists the host's pids (70001, 70002), none of which we can see,
    so our own pid is not among them: the listed processes beyond this one and its siblings are others'. Partners
    only: undisturbed; a third process: disturbed."""
    nvml = StubNvml(pids=[70001, 70002], reasons=0x4)
    probe = _paired_probe(nvml, tmp_path / "proc", 17, [17, 18], coordinator=12)
    state = probe.state()
    assert state == {"sm_mhz": 1980, "reasons": 0x4, "others": 0, "own_listed": False, "listed": 2,
                     "match": "count"}
    nvml.pids.append(70003)
    assert probe.state()["others"] == 1


def test_nvml_is_optional_and_its_evidence_reaches_the_rule(monkeypatch: pytest.MonkeyPatch, proc: FakeProc):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails
    probe, why = contention.nvml_probe()
    assert probe is None and "nvidia-ml-py" in why
    stub = StubNvml(pids=[4242], reasons=0x4)
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    probe, why = contention.nvml_probe(0)
    assert probe is not None and why == ""
    p = Probe(proc.root, clock=Clock(0.0), cpu_clock=Clock(0.0), gpu=probe)
    a = p.snapshot()
    stub.pids.append(probe.pid)  # our context appears, and another process shows up beside it
    b = p.snapshot()
    c = chunk(a, b, 0, 5)
    assert c["gpu"][1]["others"] == 1 and judge(c) == ["1 other compute process(es) on the GPU"]
    stub.pids, stub.reasons = [probe.pid], 0x4 | 0x20
    assert judge(chunk(p.snapshot(), p.snapshot(), 0, 5)) == ["GPU sw_thermal_slowdown"]


def test_the_evidence_survives_a_kill_and_a_resume_without_gaps_or_overlaps(tmp_path: Path, tiny_config):
    """Killed right after its second checkpoint, resumed: the record's chunks cover every step exactly once."""
    import json

    from conftest import record_doc, run_cli

    from harness import store

    out = tmp_path / "out"
    common = ["--quiet", "--no-report", "--out", str(out)]
    first = run_cli("run", "--config", str(tiny_config(interval=15)), "--steps", "60", "--checkpoint-every", "20",
                    "--backend", "numpy", "--no-text", *common,
                    env={"HARNESS_TEST_PAUSE_AT": "after-checkpoint:kill:2"})
    assert first.returncode != 0
    (run,) = (out / "runs").iterdir()
    assert json.loads((run / "numpy.json").read_text())["status"] != "completed"
    again = run_cli("resume", run.name, *common)
    assert again.returncode == 0, again.stderr
    rec = record_doc(run / "numpy.json")
    assert rec["schema_version"] == store.record.SCHEMA_VERSION and rec["resumed_at"]
    spans = sorted((c["step"], c["n"]) for c in rec["chunks"])
    covered = [s for start, n in spans for s in range(start, start + n)]
    assert covered == list(range(60)), spans  # contiguous, no step twice, none missing
    assert rec["timings"]["contention"]["steady_steps"] == 50 and rec["timings"]["contention"]["evidence"] in (
        "schedstat", "none")
