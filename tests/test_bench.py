"""`harness bench`: functional tests only (no timing assertions; timings are checked by `harness bench --check`).

The command runs on the small preset with 2-3 steps and writes JSON with every field; the hand-written torch loop
(the floor) computes exactly what the runner-driven torch backend computes; bad input exits 2 with one line and
writes nothing; --check turns a missed target into exit 1 naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from harness.backends import torch_bare
from harness.backends.torch_bare import BareTorch
from harness.bench import overhead as bench_overhead
from harness.cli.main import main
from harness.config.load import load_config
from harness.core.data import BatchStream, load_corpus
from harness.core.weights import init_weights
from harness.store import bench as bench_record
from harness.store.bench import (
    DuringHogs,
    HarnessOnly,
    LoopTiming,
    NoiseCell,
    NoiseOptions,
    NoiseRecord,
    OverheadResult,
    PairedLeg,
    RunLeg,
    StreamTiming,
    SweepLeg,
)
from harness.store.record import Memory

torch = pytest.importorskip("torch")

SEED = 7


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a small shared machine extra threads only spin (the tests time nothing)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic corpus long enough for the small preset (no download)."""
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "mind"]
    text = "\n".join(" ".join(rng.choice(words, size=12)) for _ in range(600)) + "\n"
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


def run_bench(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """`harness bench overhead ARGV` in this process: (exit status, stdout, stderr); argparse errors included."""
    try:
        code = main(["bench", "overhead", *argv])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def only_json_path(out: Path) -> Path:
    files = list((out / "bench").glob("bench-*.json"))
    assert len(files) == 1, files
    assert not [p for p in (out / "bench").iterdir() if p.name.endswith(".tmp")]
    return files[0]


def only_json(out: Path) -> dict:
    return json.loads(only_json_path(out).read_text(encoding="utf-8"))


def check_result(result: dict, backend: str) -> None:
    assert result["status"] == "completed"
    assert result["backend"] == backend
    for key in bench_overhead.RESULT_FIELDS:
        assert key in result, key
    for loop in ("runner", "bare"):
        for key in bench_overhead.TIMING_FIELDS:
            assert key in result[loop], (loop, key)
        assert result[loop]["step_ms_median"] > 0 and result[loop]["tokens_per_s"] > 0
        assert result[loop]["step_ms_p90"] >= result[loop]["step_ms_median"]
    assert result["overhead_ratio"] > 0 and len(result["overhead_ratios"]) == result["repeats"]
    assert result["stream"]["batches_per_s"] > 0 and result["stream"]["x_step"] > 0
    assert result["harness_only"]["us_per_step_median"] > 0
    assert result["memory"]["kind"] == "rss" and result["memory"]["peak_bytes"] > 0
    assert result["backend_info"]["device"] == "cpu"
    assert {c["name"] for c in result["checks"]} >= {"stream_x_step"}


def test_bench_writes_every_field(tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run_bench(capsys, "--sizes", "small", "--timed-steps", "3", "--warmup", "1", "--repeats",
                                     "2", "--data", str(text_file), "--out", str(out), "--seed", str(SEED))
    assert code == 0, stderr
    doc = only_json(out)
    assert doc["schema"] == bench_record.SCHEMA and doc["schema_version"] == bench_record.SCHEMA_VERSION
    assert bench_record.OverheadRecord.load(only_json_path(out)).to_dict() == doc  # read back as it was written
    assert doc["options"]["sizes"] == ["small"] and doc["options"]["backends"] == ["torch"]
    env = doc["environment"]
    assert env["torch"] == torch.__version__.split("+")[0] or env["torch"] == torch.__version__
    assert env["device_name"] and env["cpu_count"] and env["python"]
    assert doc["targets"]["stream_x_step_min"] == 50
    [result] = doc["results"]
    check_result(result, "torch")
    assert result["size"] == "small" and result["steps"] == 3 and result["repeats"] == 2
    assert result["first_step_s"] > 0
    assert "overhead" not in {c["name"] for c in result["checks"]}  # small on CPU has no overhead target
    assert "torch" in stdout and "small" in stdout and "overhead" in stdout  # the table
    assert "2 rounds of 3 steps" in stderr and "round 2/2" in stderr  # progress lines


def test_bench_isolated_and_numpy(tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture) -> None:
    """--isolate measures each configuration in a child process (the path flux always takes); numpy uses the
    generic bare loop (backend.train_step over pre-built batches)."""
    pytest.importorskip("harness.backends.numpy_backend")
    out = tmp_path / "out"
    code, _, stderr = run_bench(capsys, "--backends", "torch,numpy", "--sizes", "small", "--timed-steps", "2",
                                "--warmup", "0", "--repeats", "1", "--isolate", "--quiet", "--threads", "1",
                                "--data", str(text_file), "--out", str(out))
    assert code == 0, stderr
    doc = only_json(out)
    assert [r["backend"] for r in doc["results"]] == ["torch", "numpy"]
    for result in doc["results"]:
        check_result(result, result["backend"])
        assert result["isolated"] is True and result["warmup"] == 0 and result["first_step_s"] > 0
        assert result["memory"]["scope"] == "this configuration's process"


def test_threads_caps_each_measured_process(tmp_path: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """--threads means what it means in `harness run`: the CPU threads of each backend process, capped through its
    environment (harness.run.processes.thread_env), so every measurement then runs in a process of its own."""
    from harness.cli import bench
    from harness.cli.main import build_parser

    args = build_parser().parse_args(["bench", "overhead", "--backend", "torch,numpy", "--size", "small", "--threads",
                                      "2", "--data", str(text_file), "--out", str(tmp_path / "out")])
    jobs = bench.plan_jobs(args)
    assert [j.isolated for j in jobs] == [True, True] and {j.threads for j in jobs} == {2}
    seen = {}

    class FakePopen:  # the child every measurement starts (harness.run.processes.spawn), not run
        returncode = 1

        def __init__(self, cmd: list[str], **kwargs: object) -> None:
            seen.update(kwargs["env"], cmd=cmd)  # type: ignore[arg-type]

        def communicate(self) -> tuple[str, None]:
            return "", None

    from harness.run import processes

    monkeypatch.setattr(processes.subprocess, "Popen", FakePopen)
    assert bench_overhead.measure_isolated(jobs[0]).status_text.startswith(
        "failed: child process exited with status 1")
    assert {seen[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")} == {"2"}
    assert seen["cmd"][1:5] == ["-m", "harness", "--worker", "bench"]  # the one child program, the bench kind
    unset = build_parser().parse_args(["bench", "overhead", "--size", "small", "--data", str(text_file), "--out",
                                       str(tmp_path / "out")])
    assert [j.isolated for j in bench.plan_jobs(unset)] == [False]  # without it: in this process, as before


def test_bare_torch_loop_matches_runner(text_file: Path) -> None:
    """(a) and (b) do the same work: with dropout 0 the hand-written loop reproduces the runner's losses and
    parameters on the same batches."""
    from harness.backends.torch_backend import TorchBackend

    config = load_config("small").replace(dropout=0.0)
    corpus = load_corpus(text_file)
    weights = init_weights(config, corpus.vocab_size, SEED)
    stream = BatchStream(corpus.train, config.block_size, config.batch_size, SEED, config.scheme)
    steps = 4

    backend = TorchBackend()
    backend.setup(config, weights, corpus.vocab_size, "cpu", SEED)
    runner = bench_overhead.runner_repeat(backend, config, stream, 0, steps)

    bare = BareTorch(config, weights, corpus.vocab_size, "cpu", SEED)
    floor = bare.repeat([stream.batch(k) for k in range(steps)])

    assert len(runner.losses) == len(floor.losses) == steps
    assert len(runner.step_s) == len(floor.step_s) == steps
    np.testing.assert_allclose(floor.losses, runner.losses, rtol=1e-6, atol=0)
    assert floor.losses[-1] < floor.losses[0]  # it trained
    params = backend.parameters()
    for name, p in bare.model.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), params[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_generic_bare_loop_matches_runner(text_file: Path) -> None:
    """The bare loop for other backends is backend.train_step over the same batches: same losses as the runner."""
    from harness.backends.torch_backend import TorchBackend

    config = load_config("small").replace(dropout=0.0)
    corpus = load_corpus(text_file)
    weights = init_weights(config, corpus.vocab_size, SEED)
    stream = BatchStream(corpus.train, config.block_size, config.batch_size, SEED, config.scheme)
    a, b = TorchBackend(), TorchBackend()
    a.setup(config, weights, corpus.vocab_size, "cpu", SEED)
    b.setup(config, weights, corpus.vocab_size, "cpu", SEED)
    runner = bench_overhead.runner_repeat(a, config, stream, 0, 3)
    floor = bench_overhead.backend_repeat(b, [stream.batch(k) for k in range(3)], config.learning_rate)
    np.testing.assert_allclose(floor.losses, runner.losses, rtol=1e-6, atol=0)


BAD = [
    (["--sizes", "huge"], "unknown size"),
    (["--sizes", "small,,medium"], "empty entry"),
    (["--sizes", "small,small"], "twice"),
    (["--backends", "tensorflow"], "unknown backend"),
    (["--backends", "numpy", "--compile"], "torch backend only"),
    (["--timed-steps", "0"], "--timed-steps"),
    (["--steps", "3"], "unrecognized arguments: --steps"),  # --timed-steps: never silently taken for it
    (["--repeats", "-2"], "--repeats"),
    (["--warmup", "1.5"], "--warmup"),
    (["--device", "tpu"], "--device"),
    (["--precision", "bf16"], "needs a CUDA GPU"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),
]


@pytest.mark.parametrize(("argv", "expected"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture,
                                              argv: list[str], expected: str) -> None:
    out = tmp_path / "out"
    data = [] if "--data" in argv else ["--data", str(text_file)]
    code, stdout, stderr = run_bench(capsys, *argv, *data, "--out", str(out))
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], stderr
    assert "Traceback" not in stderr and not stdout
    assert not out.exists()


def test_floor_and_runner_make_the_same_copy(text_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both loops copy each step's batch to the device inside the timed step, through the same function (pinned,
    non-blocking on CUDA). Planted bug: a floor over tensors built before the loop makes no copies."""
    from harness.backends import torch_backend

    copies: list[tuple] = []
    real = torch_backend.to_device
    monkeypatch.setattr(torch_backend, "to_device", lambda a, device: copies.append(a.shape) or real(a, device))
    config = load_config("small").replace(dropout=0.0)
    corpus = load_corpus(text_file)
    weights = init_weights(config, corpus.vocab_size, SEED)
    stream = BatchStream(corpus.train, config.block_size, config.batch_size, SEED, config.scheme)
    backend = torch_backend.TorchBackend()
    backend.setup(config, weights, corpus.vocab_size, "cpu", SEED)
    bench_overhead.runner_repeat(backend, config, stream, 0, 3)
    runner_copies, copies[:] = list(copies), []
    bare = BareTorch(config, weights, corpus.vocab_size, "cpu", SEED)
    bare.repeat([stream.batch(k) for k in range(3)])
    assert copies == runner_copies == [(config.batch_size, config.block_size)] * 6


def test_warmup_0_reads_memory_after_steps(text_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --warmup 0 memory is read after the first timed runner round and before the bare model exists, and
    compile_s is in the result. Planted bug: reading it right after setup sees no step at all."""
    from harness.backends.torch_backend import TorchBackend

    order: list[str] = []

    class Counting(TorchBackend):
        steps = 0

        def train_step(self, x, y, lr):
            Counting.steps += 1
            return super().train_step(x, y, lr)

        def memory(self):
            order.append(f"memory after {Counting.steps} steps")
            return super().memory()

    class Bare(BareTorch):
        def __init__(self, *a, **kw):
            order.append("bare model")
            super().__init__(*a, **kw)

    monkeypatch.setattr(bench_overhead, "create_backend", lambda name, **opts: Counting(**opts))
    monkeypatch.setattr(torch_bare, "BareTorch", Bare)  # the loop the torch declaration names
    config = load_config("small")
    job = bench_overhead.Job("torch", "small", config.to_dict(), str(text_file), "cpu", SEED, steps=2, warmup=0,
                             repeats=1, progress=False)
    result = bench_overhead.measure(job)
    assert order[:2] == ["memory after 2 steps", "bare model"]
    assert result.compile_s is None and result.first_step_s > 0 and len(result.overhead_ratios) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: --device cuda is valid here")
def test_cuda_without_gpu_exits_2(tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    code, _, stderr = run_bench(capsys, "--device", "cuda", "--data", str(text_file), "--out", str(out))
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1 and "cuda" in stderr.lower()
    assert not out.exists()


def fake_result(size: str, device: str, overhead: float, x_step: float) -> OverheadResult:
    result = OverheadResult(backend="torch", size=size, device=device, overhead_ratio=1 + overhead,
                            stream=StreamTiming(x_step=x_step))
    result.checks = bench_overhead.checks(result)
    return result


def test_targets() -> None:
    """Which targets apply where: overhead 3% on CPU for medium/large only, 1% on CUDA; stream 50x everywhere."""
    assert bench_overhead.misses([fake_result("small", "cpu", 0.20, 60)]) == []
    assert bench_overhead.misses([fake_result("medium", "cpu", 0.02, 60)]) == []
    [miss] = bench_overhead.misses([fake_result("medium", "cpu", 0.04, 60)])
    assert "torch/medium on cpu" in miss and "overhead" in miss and "3%" in miss
    [miss] = bench_overhead.misses([fake_result("large", "cuda", 0.02, 60)])
    assert "1%" in miss
    assert bench_overhead.misses([fake_result("small", "cuda", 0.009, 60)]) == []
    [miss] = bench_overhead.misses([fake_result("small", "cpu", 0.0, 20)])
    assert "batch stream" in miss and "50x" in miss


def test_check_exits_1_naming_the_miss(tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_measure(job: bench_overhead.Job) -> OverheadResult:
        result = fake_result(job.size, job.device, 0.10, 500)
        result.runner = LoopTiming(step_ms_median=1.0, step_ms_p90=1.0, tokens_per_s=1.0)
        result.bare = LoopTiming(step_ms_median=1.0, step_ms_p90=1.0)
        result.overhead_pct, result.stream = 10.0, StreamTiming(x_step=500.0, batches_per_s=1.0)
        result.harness_only, result.memory = HarnessOnly(us_per_step_median=1.0), Memory(kind="rss", peak_bytes=1)
        return result

    monkeypatch.setattr(bench_overhead, "measure", fake_measure)
    args = ["--sizes", "small,medium", "--data", str(text_file), "--out", str(tmp_path / "out")]
    code, _, stderr = run_bench(capsys, *args)
    assert code == 0  # without --check a miss is reported, not fatal
    assert "target missed: torch/medium on cpu: harness overhead +10.0% exceeds 3%" in stderr
    code, _, stderr = run_bench(capsys, *args, "--check")
    assert code == 1
    assert "torch/medium on cpu" in stderr and "torch/small" not in stderr
    assert len(list((tmp_path / "out" / "bench").glob("*.json"))) == 2  # written either way


def test_contention_probe_cost_counts_one_reading_per_chunk() -> None:
    """The sampler reads the machine once per chunk boundary (the reading that ends a chunk starts the next): per
    step that is the tick plus one reading spread over the steps of a chunk (chunk_s / step_s of them)."""
    from harness.timing import contention

    cost = bench_overhead.contention_probe_cost(0.01, "cpu", snapshots=5, ticks=100)
    assert cost.chunk_s == contention.CHUNK_S and cost.snapshot_us > 0
    steps_per_chunk = contention.CHUNK_S / 0.01
    assert cost.per_step_us == pytest.approx(cost.tick_us + cost.snapshot_us / steps_per_chunk)
    assert cost.pct_of_step == pytest.approx(cost.per_step_us / 1e4 * 100)


def test_noise_benchmark_checks_read_both_legs_the_same_way_round():
    """`harness bench --noise` judges its four legs: a ratio stated the other way round is the same ratio, a marked
    run passes the run check, an unmarked slow one fails it; the table prints what the checks use."""
    from harness.bench import noise

    def leg(a: str, b: str, time_ratio: float, hit: int, missed: int = 0) -> SweepLeg:
        cells = [NoiseCell(backend="torch", seed=1337 + i, contended_fraction=0.4 if i < hit else 0.0,
                           mostly_disturbed=False, step_median_s=0.003) for i in range(3)]
        return SweepLeg(
            a=a, b=b, paired=PairedLeg(time_ratio=time_ratio, usable=True, rounds=10, disturbed_rounds=0,
                                       text=f"{a} vs {b}"),
            training=None, cells=cells, disturbed_cells=[c for c in cells if c.contended_fraction],
            report_names_them=hit > 0,
            # during the hogs: `hit` slowed chunks judged disturbed, `missed` slowed ones not, one unslowed chunk
            during_hogs=[DuringHogs(kind="training chunk", backend="torch", median_s=0.006, judged=True)] * hit
            + [DuringHogs(kind="training chunk", backend="torch", median_s=0.006, judged=False)] * missed
            + [DuringHogs(kind="paired burst", backend="torch", median_s=0.0031, judged=False)])

    def run(median: float, frac: float, mostly: bool = False) -> RunLeg:
        return RunLeg(backend="torch", step_median_s=median, steady_steps=290, disturbed_steps=96,
                      contended_fraction=frac, mostly_disturbed=mostly, figures_from="undisturbed steps")

    result = NoiseRecord(options=NoiseOptions(size="small", backends=["torch", "numpy"], seeds=3, steps=200,
                                              run_steps=300, hogs=2, cores=2),
                         sweep_quiet=leg("torch", "numpy", 0.80, 0), sweep_disturbed=leg("numpy", "torch", 1 / 0.82, 2),
                         run_quiet=run(0.0030, 0.0), run_disturbed=run(0.0031, 0.33))
    checks = noise.checks(result)
    assert [c.ok for c in checks] == [True, True, True, True]
    # numpy's time / torch's in both legs (names in alphabetical order), never one leg inverted
    assert checks[0].value == pytest.approx((1 / 0.82) / (1 / 0.80) - 1)
    result.sweep_disturbed = leg("torch", "numpy", 1.0, 2)  # numpy/torch 1.0 against 1.25: outside 15 %
    result.run_disturbed = run(0.0040, 0.33)  # 33 % slower and not marked
    assert [c.ok for c in noise.checks(result)] == [False, True, False, True]
    result.sweep_disturbed = leg("torch", "numpy", 1.0, 2, missed=1)  # a slowed chunk not judged disturbed
    assert [c.ok for c in noise.checks(result)][1] is False
    assert noise.detection(result.sweep_quiet, result.sweep_disturbed) == (3, 2, 4)
    result.sweep_disturbed = leg("torch", "numpy", 1.0, 2)
    result.run_disturbed = run(0.0040, 0.7, mostly=True)  # marked, and saying why: that is what is asked
    result.checks = noise.checks(result)
    assert result.checks[2].ok
    text = noise.format_result(result)
    assert "check: sweep: disturbed paired ratio within 15 % of the quiet one: -20.0 % -> FAIL" in text
    assert "cells disturbed: 2 of 3: torch seed 1337 contended_fraction 0.40" in text
    assert "contended_fraction 0.70; marked mostly disturbed" in text
    assert NoiseRecord.from_dict(json.loads(json.dumps(result.to_dict()))).to_dict() == result.to_dict()


def test_noise_benchmark_refuses_bad_input_before_any_leg(tmp_path, monkeypatch, capsys):
    """Missing data, one backend or a size too big for the text: one line, exit 2, no leg started, nothing written."""
    from harness.cli.main import main

    out = tmp_path / "out"
    monkeypatch.delenv("HARNESS_DATA", raising=False)
    short = tmp_path / "short.txt"
    short.write_text("to be or not to be " * 40)  # 760 characters: fewer than 16 windows of 64 to train on
    for argv, words in ((["--data", str(tmp_path / "nope.txt")], "does not exist"),
                        (["--backend", "torch"], "two backends at one size"),
                        (["--data", str(short)], "too short")):
        args = ["bench", "noise", *([] if "--backend" in argv else ["--backend", "torch,numpy"]), "--size", "small",
                "--out", str(out), *argv]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_noise_benchmark_lines_chunks_up_with_the_hogs():
    """A chunk counts as run during the hogs when at least half of it lies in their calendar window; of those, the
    ones the contention rule judges disturbed are counted apart (the detection's recall)."""
    from harness.bench import noise

    window = [100.0, 110.0]
    assert noise.overlaps(101.0, 2.0, window) and noise.overlaps(109.0, 2.0, window)  # half inside counts
    assert not noise.overlaps(109.5, 2.0, window) and not noise.overlaps(90.0, 5.0, window)
    assert not noise.overlaps(None, 2.0, window) and not noise.overlaps(101.0, 2.0, [])
    busy = {"at": 102.0, "wall_s": 1.0, "exec_s": 0.5, "wait_s": 0.5}  # waited half its runnable time
    idle = {"at": 103.0, "wall_s": 1.0, "exec_s": 1.0, "wait_s": 0.0}
    before = {"at": 50.0, "wall_s": 1.0, "exec_s": 0.5, "wait_s": 0.5}
    items = [("training chunk", "torch", c, [0.002, 0.003]) for c in (busy, idle, before)]
    assert [d.judged for d in noise._during(items, window)] == [True, False]


def test_noise_benchmark_reads_a_real_sweep(tmp_path):
    """sweep_result on a sweep as `harness sweep` leaves it (records, manifest, paired timings): the comparison and,
    with chunks and bursts planted before, during and after the hogs' window, exactly those during it counted, and
    those of them that waited judged disturbed."""
    from test_paired import BUSY, QUIET
    from test_report import make_sweep

    from harness import store
    from harness.bench import noise
    from harness.sweep import manifest as mf
    from harness.timing import paired

    out = tmp_path / "out"
    sweep_id = make_sweep(out, seeds=3)
    m = mf.Manifest.load(out, sweep_id)
    # plant calendar times: hogs from t = 1000 to 1010. Each cell's 120 steps in 4 chunks of 30 steps, 2 s each,
    # starting at 990 (before), 1000 and 1005 (during), 1020 (after); a torch cell's chunk at 1000 waited (disturbed)
    for cell in m.cells:
        path = m.run(cell).record(cell.backend)
        rec = json.loads(path.read_text())
        rec["chunks"] = [dict(BUSY if cell.backend == "torch" and at == 1000.0 else QUIET, step=30 * i, n=30,
                              at=at, wall_s=2.0) for i, at in enumerate((990.0, 1000.0, 1005.0, 1020.0))]
        store.atomic_write_json(path, rec)
    # paired bursts of 0.25 s: round r at 995 + r s, so rounds 5..9 ran during the hogs; torch's burst of round 6 waited
    for entry in m.paired:
        doc = paired.load(entry.record(out))
        for r, rnd in enumerate(paired.rounds_of(doc)):
            for name, burst in rnd.bursts.items():
                burst.chunk = dict(BUSY if (r, name) == (6, "torch") else QUIET, at=995.0 + r)
        doc.dump(entry.record(out))
    result = noise.sweep_result(out, [1000.0, 1010.0])
    assert result.paired.time_ratio and len(result.cells) == 6
    during = result.during_hogs
    chunks = [d for d in during if d.kind == "training chunk"]
    bursts = [d for d in during if d.kind == "paired burst"]
    assert len(chunks) == 6 * 2 and sum(d.judged for d in chunks) == 3  # 3 torch cells, one waited chunk each
    assert len(bursts) == 3 * 5 * 2 and sum(d.judged for d in bursts) == 3  # 3 blocks x 5 rounds x 2 contenders
    assert {d.backend for d in during if d.judged} == {"torch"}
    assert noise.sweep_result(out).during_hogs == []  # no window: nothing ran during it
