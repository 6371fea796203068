"""`harness bench parts`: the parts and their FLOPs, every backend's parts against the oracle, the analysis and its
diagnosis on synthetic rounds, the record and its page, bad input, the kernel-count plumbing, one real run of the
command, and planted slowdowns named first in the diagnosis (no timing assertion beyond a 20x slowdown's name).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, tree

from harness.backends import parts as registry
from harness.backends.numpy_parts import NumpyParts, reference
from harness.bench import parts as bench_parts
from harness.bench.parts_analysis import diagnose, format_table, rounds_used, summary
from harness.bench.parts_page import notes, write_page
from harness.cli import bench_parts as bench_parts_cli
from harness.cli.main import main
from harness.config.load import load_config
from harness.core.costs import flops_per_token, part_flops
from harness.core.data import BatchStream
from harness.core.parts import OPTIMIZER, REST, STEP, item, items, part_names, parts, select
from harness.core.weights import init_weights
from harness.errors import UsageError
from harness.models import numpy_gpt
from harness.store.parts import PartsBurst, PartsReady, PartsRecord, PartsRound, record_path

TESTS = Path(__file__).resolve().parent


def tiny(path: Path, **changes: object):
    (path / "tiny.toml").write_text(TINY)
    config = load_config(path=path / "tiny.toml")
    return config.replace(**changes) if changes else config


def step0(config, corpus, seed: int = 3):
    weights = init_weights(config, corpus.vocab_size, seed)
    x, y = BatchStream(corpus.train, config.block_size, config.batch_size, seed, config.scheme).batch(0)
    return weights, x, y


# --- the parts and their cost --------------------------------------------------------------------------------------
@pytest.mark.parametrize("size,changes", [("small", {}), ("medium", {}), ("nanogpt-cpu", {}),
                                          ("medium", {"bias": False, "lm_head_bias": False, "tie_embeddings": True})])
def test_part_flops_add_up_to_flops_per_token(size: str, changes: dict) -> None:
    config = load_config(size).replace(**changes)
    flops = part_flops(config, 65)
    assert list(flops) == part_names(config.n_layer)
    assert sum(f["forward"] + f["backward"] for f in flops.values()) == flops_per_token(config, 65)
    assert all(f["backward"] == 2 * f["forward"] for f in flops.values())
    assert flops["h.0.attn.probs"]["forward"] == flops["h.0.attn.y"]["forward"] == 2 * config.block_size * \
        config.n_embd  # the two attention products, no parameters
    assert flops["h.0.mlp.act"]["forward"] == flops["h.0.res1"]["forward"] == 0


def test_parts_follow_the_taps_and_the_options() -> None:
    config = load_config("medium")
    every = parts(config, 65)
    assert [p.name for p in every] == part_names(2) and len(every) == 1 + 11 * 2 + 3
    by = {p.name: p for p in every}
    assert by["h.1.ln_1"].inputs == ("h.0.res2",) and by["h.0.res1"].inputs == ("emb", "h.0.attn.proj")
    assert by["h.0.attn.qkv"].outputs == ("h.0.attn.q", "h.0.attn.k", "h.0.attn.v")
    assert by["emb"].dropout == "emb" and by["h.0.attn.y"].dropout is None  # attention dropout off in the preset
    assert by["h.0.attn.proj"].dropout == "h.0.attn" and by["h.1.mlp.proj"].dropout == "h.1.mlp"
    tied = parts(config.replace(tie_embeddings=True, bias=False, attn_dropout=True), 65)
    assert {p.name: p for p in tied}["logits"].params == ("wte.weight", "lm_head.bias")
    assert {p.name: p for p in tied}["h.0.ln_1"].params == ("h.0.ln_1.weight",)
    assert {p.name: p for p in tied}["h.0.attn.y"].dropout == "h.0.attn.probs"
    keys = items(["emb", "h.0.ln_1"])
    assert keys == ["emb/forward", "h.0.ln_1/forward", "h.0.ln_1/backward", "emb/backward", OPTIMIZER, STEP]


def test_select_reads_names_kinds_and_refuses_unknown_ones() -> None:
    assert select(None, 2) == part_names(2)
    assert select(["attn.probs", "logits"], 2) == ["h.0.attn.probs", "h.1.attn.probs", "logits"]
    assert select(["h.*.mlp.act", "h.1.ln_2"], 2) == ["h.0.mlp.act", "h.1.ln_2", "h.1.mlp.act"]
    for bad in ("attn.softmax", "h.2.ln_1", "h.x.ln_1", "optimizer"):
        with pytest.raises(UsageError, match="unknown part"):
            select([bad], 2)


# --- every runner times the same computation -----------------------------------------------------------------------
@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": True, "bias": False, "gelu": "exact"}])
def test_reference_is_the_oracles_taps_and_gradients(tmp_path: Path, corpus, changes: dict) -> None:
    config = tiny(tmp_path, n_layer=2, **changes)
    weights, x, y = step0(config, corpus)
    ref = reference(config, weights, corpus.vocab_size, x, y)
    params = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    taps: dict = {}
    numpy_gpt.gpt_forward(params, x, config, taps=taps)
    for name, value in taps.items():
        np.testing.assert_array_equal(ref.acts[name], value, err_msg=name)
    loss, grads = numpy_gpt.loss_and_gradients(params, x, y, config)
    assert float(ref.acts["loss"]) == float(loss) and set(ref.params) == set(grads)
    for name, g in grads.items():
        np.testing.assert_array_equal(ref.params[name], g, err_msg=name)


def check_runner(runner, config, corpus, names=None) -> None:
    """`runner`'s forwards give the reference's activations and its backwards the gradients the reference's parts
    hand to their inputs and parameters (float64, dropout off; a tied table: its two parts' gradients add up to the
    reference's), and every item runs."""
    weights, x, y = step0(config, corpus)
    ref = reference(config, weights, corpus.vocab_size, x, y)
    names = names or part_names(config.n_layer)
    runner.setup(config, weights, corpus.vocab_size, "cpu", 3, [(x, y)], ref, names)
    assert list(runner.items) == items(names)
    tied = []
    for part in (p for p in parts(config, corpus.vocab_size) if p.name in names):
        outs = runner.items[item(part.name, "forward")].call()
        outs = outs[0] if runner.name == "numpy" else outs
        for name, out in zip(part.outputs, outs, strict=True):
            np.testing.assert_allclose(as_numpy(out), ref.acts[name], rtol=1e-9, atol=1e-12, err_msg=part.name)
        back = runner.items[item(part.name, "backward")].call()
        floats = [i for i in part.inputs if ref.acts[i].dtype.kind == "f"]
        if runner.name == "torch":
            dins, dparams = back[:len(floats)], dict(zip(part.params, back[len(floats):], strict=True))
        else:  # jax: the pullback's (inputs, parameters); numpy: (one per input, None for the token ids, parameters)
            dins, dparams = [d for d in back[0] if d is not None], back[1]
        for name, d in zip(floats, dins, strict=True):
            np.testing.assert_allclose(as_numpy(d), ref.branch[(part.name, name)], rtol=1e-9, atol=1e-12,
                                       err_msg=f"{part.name} d{name}")
        assert set(dparams) == set(part.params), part.name
        for name in part.params:
            if config.tie_embeddings and name == "wte.weight":
                tied.append(as_numpy(dparams[name]))
            else:
                np.testing.assert_allclose(as_numpy(dparams[name]), ref.params[name], rtol=1e-9, atol=1e-12,
                                           err_msg=f"{part.name} {name}")
    if tied:  # the embedding's share and the head's
        assert len(tied) == 2
        np.testing.assert_allclose(tied[0] + tied[1], ref.params["wte.weight"], rtol=1e-9, atol=1e-12)
    calls, passes, step_samples = runner.calibrate(0.001)
    assert set(calls) == set(runner.items) and passes >= 3 and min(calls.values()) >= 1
    assert passes * step_samples >= 9  # the step, longest, gets more tries at a clean timing
    times = runner.burst(calls, 1, 2)
    assert set(times) == set(runner.items) and all(t > 0 for t in times.values())


def as_numpy(a) -> np.ndarray:
    return a.detach().numpy() if hasattr(a, "detach") else np.asarray(a)


def test_calls_queued_on_the_host_clock_are_waited_for_once_and_on_a_device_clock_not() -> None:
    waits = []

    class Queued(registry.PartRunner):  # an asynchronous device timed on the host, its clock named in other words
        sync_each_call, clock = False, "time.perf_counter after a wait for the queue"

    for device_clock in (False, True):
        runner = Queued()
        runner.device_clock = device_clock
        runner.items = {"x/forward": registry.Item(lambda: 1, waits.append)}
        runner.timed("x/forward", 5)
    assert waits == [1]  # the host clock's reading waits for the last call; a device clock's does not


def test_numpy_parts_are_the_oracles(tmp_path: Path, corpus) -> None:
    check_runner(NumpyParts(), tiny(tmp_path, dropout=0.0, n_layer=2), corpus)


def test_torch_parts_are_autograd_of_the_model(tmp_path: Path, corpus) -> None:
    pytest.importorskip("torch")
    from harness.backends.torch_parts import TorchParts

    check_runner(TorchParts(dtype="float64"), tiny(tmp_path, dropout=0.0, tie_embeddings=True), corpus)


def test_jax_parts_are_jitted_forwards_and_pullbacks(tmp_path: Path, corpus) -> None:
    """What each part computes, forward and pullback, is the oracle's. XLA's optimizations are off while the parts
    compile (half of the test's time, and no part of what is tested: the optimized step is held to the oracle by
    the jax backend's own parity tests)."""
    jax = pytest.importorskip("jax")
    from harness.backends.jax_parts import JaxParts

    runner = JaxParts(dtype="float64")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        check_runner(runner, tiny(tmp_path, dropout=0.0), corpus)
    finally:
        jax.config.update("jax_disable_most_optimizations", False)
    assert runner.compile_s and runner.compile_s > 0


def test_torch_counts_what_a_part_launches_with_the_profiler(tmp_path: Path, corpus) -> None:
    """The kernel-count plumbing on the CPU (its operators); on CUDA the same call counts kernels."""
    pytest.importorskip("torch")
    from torch.autograd import DeviceType

    from harness.backends.torch_parts import TorchParts, count_launches

    runner = TorchParts()
    config = tiny(tmp_path, dropout=0.0)
    weights, x, y = step0(config, corpus)
    runner.setup(config, weights, corpus.vocab_size, "cpu", 3, [(x, y)],
                 reference(config, weights, corpus.vocab_size, x, y), ["h.0.ln_1", "h.0.mlp.act"])
    assert runner.launches("h.0.ln_1/forward") == {"ops": 1}  # aten::layer_norm
    assert runner.launches("h.0.mlp.act/backward") == {"ops": 1}  # aten::gelu_backward, under autograd's engine

    class Event:
        def __init__(self, device_type, us):
            self.device_type, self.us, self.name, self.cpu_parent = device_type, us, "kernel", None
            self.time_range = type("R", (), {"elapsed_us": lambda _: us})()

    events = [Event(DeviceType.CUDA, 3.0), Event(DeviceType.CUDA, 5.0), Event(DeviceType.CPU, 40.0)]
    assert count_launches(events, cuda=True) == {"kernels": 2, "kernel_us": 8.0}


def without_parts(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Backend `name` declares no part runner (as a backend from outside that has none)."""
    from harness.backends import options_class

    cls = options_class(name)
    decl = cls.declaration
    monkeypatch.setattr(cls, "declaration", decl.replace(methods=decl.methods - {"parts"}, part_runner=""))


def test_a_backend_without_a_part_runner_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Support comes from the declarations: the method `parts` and the part runner it names."""
    from harness.backends import declaration

    assert registry.runner_class("numpy") is NumpyParts
    assert declaration("numpy").replace(part_runner="").problems() == [
        'it declares the method parts but no part_runner ("module:Class" of its part runner)']
    without_parts(monkeypatch, "numpy")
    assert registry.supports("torch") and not registry.supports("numpy")
    with pytest.raises(UsageError, match="'numpy' cannot time its parts"):
        registry.check_supported(["torch", "numpy"])


# --- the analysis, on synthetic rounds -----------------------------------------------------------------------------
QUIET = {"step": 0, "n": 1, "wall_s": 0.2, "cpu_s": 0.2, "exec_s": 0.2, "wait_s": 0.0}
BUSY = {**QUIET, "wait_s": 0.1}  # waited a third of the time: disturbed


def synthetic(tmp_path: Path, corpus, times: dict[str, dict[str, float]], n_rounds: int = 8, noise: float = 0.02,
              disturbed: tuple[int, ...] = (), seed: int = 0) -> PartsRecord:
    """A record of two or more contenders whose item times are `times[name][item]` (missing items: 1 ms), each
    burst multiplied by 1 + noise * N(0, 1) and each item by another such factor; the step is the sum of the items
    times `times[name]["x"]`."""
    config = tiny(tmp_path, n_layer=2)
    names = part_names(2)
    contenders = [{"name": n, "backend": n, "device": "cpu", "options": {}} for n in times]
    record, _ = bench_parts.new_record(config, corpus, contenders, names, 5, 1, {"backends": list(times)})
    rng = np.random.default_rng(seed)
    for r in range(n_rounds):
        bursts = {}
        for n, own in times.items():
            drift = 1 + noise * rng.standard_normal()  # the machine's speed in this burst
            t = {k: own.get(k, 1e-3) * drift * (1 + noise * rng.standard_normal()) for k in record.items if k != STEP}
            t[STEP] = sum(t.values()) * own.get("x", 1.0)
            bursts[n] = PartsBurst(times=t, chunk=BUSY if r in disturbed else QUIET)
        record.rounds.append(PartsRound(order=list(times), bursts=bursts))
    record.contenders[0].ready = PartsReady(setup_s=1.0, calls={k: 1 for k in record.items}, passes=3,
                                            clock="host clock")
    return record


class AlwaysBusy:
    """A timed process whose every burst is disturbed (what a machine busy throughout gives)."""

    def __init__(self, name: str, items_: list[str]) -> None:
        self.name, self.items, self.bursts = name, items_, 0

    def send(self, message: dict) -> None:
        self.bursts += "burst" in message

    def receive(self, timeout: float) -> dict:
        return {"times": {k: 1e-3 for k in self.items}, "chunk": BUSY}


def test_the_rounds_stop_once_no_verdict_can_come(tmp_path: Path, corpus, capsys) -> None:
    record, _ = bench_parts.new_record(tiny(tmp_path, n_layer=1), corpus, [
        {"name": n, "backend": n, "device": "cpu", "options": {}} for n in ("torch", "numpy")], part_names(1), 10, 1,
        {})
    record.plan.gap_s = 0.0  # no pause between bursts: no process here to let fall asleep
    children = [AlwaysBusy(n, record.items) for n in ("torch", "numpy")]
    path = tmp_path / "parts.json"
    assert bench_parts._rounds(path, record, children, True) == 0
    # 10 wanted, 40 at most, 5 needed for a verdict: after 36 disturbed rounds even 4 more could not make it
    assert len(record.rounds) == 36 and [c.bursts for c in children] == [36, 36]
    assert record.stopped == "stopped after 36 of at most 40 rounds: 0 undisturbed, and even 4 more could not make " \
        "the 5 a verdict needs"
    assert record.stopped in capsys.readouterr().err
    record.status = "incomplete"
    record.dump(path)
    assert PartsRecord.load(path).stopped == record.stopped
    assert f"rounds {record.stopped}" in notes(record, summary(record))  # beside the table and on the page


def test_a_slow_part_is_named_first_with_its_direction(tmp_path: Path, corpus) -> None:
    record = synthetic(tmp_path, corpus, {"torch": {}, "jax": {"h.0.attn.probs/backward": 9e-3,
                                                               "h.1.attn.probs/backward": 9e-3,
                                                               OPTIMIZER: 8e-3}})
    pair = diagnose(record, "torch", "jax", rounds_used(record).used)
    assert pair["slow"] == "jax" and pair["conclusive"] and pair["ratio"] > 1.2
    assert [n["row"] for n in pair["named"][:2]] == ["h.*.attn.probs/backward", OPTIMIZER]
    assert math.isclose(pair["named"][0]["share"], 16 / 23, rel_tol=0.1)  # under 80 %: the next one is named
    assert pair["line"].startswith(f"jax {pair['ratio']:.3g}× slower than torch [")
    assert re.search(r": 7\d% of the difference is h\.\*\.attn\.probs backward \(\+1[56]\.\d ms \[\+1[56]\.\d+, "
                     r"\+1[56]\.\d+\]\), [23]\d% optimizer \(\+[67]\.\d+ ms \[", pair["line"]), pair["line"]


def test_a_part_whose_interval_includes_no_difference_is_never_named(tmp_path: Path, corpus) -> None:
    # numpy's emb forward is slower on average but noisy: its interval spans 0; its backward is slower, steadily
    record = synthetic(tmp_path, corpus, {"torch": {}, "numpy": {"emb/backward": 20e-3}}, noise=0.01)
    rng = np.random.default_rng(1)
    for rnd in record.rounds:
        rnd.bursts["numpy"].times["emb/forward"] = 1e-3 + 6e-3 * rng.standard_normal()
    pair = diagnose(record, "torch", "numpy", rounds_used(record).used)
    rows = [n["row"] for n in pair["named"]]
    assert rows[0] == "emb/backward" and "emb/forward" not in rows and "emb forward" not in pair["line"]


def test_no_clear_difference_names_only_conclusive_parts(tmp_path: Path, corpus) -> None:
    record = synthetic(tmp_path, corpus, {"a": {}, "b": {}}, noise=0.05)
    pair = diagnose(record, "a", "b", rounds_used(record).used)
    assert not pair["conclusive"] and "no clear difference in the whole step" in pair["line"] and not pair["named"]


def test_disturbed_rounds_are_left_out_and_counted(tmp_path: Path, corpus) -> None:
    record = synthetic(tmp_path, corpus, {"torch": {}, "numpy": {"loss/forward": 5e-3}}, n_rounds=8,
                       disturbed=(1, 4))
    used = rounds_used(record)
    assert (used.total, used.clean, used.disturbed, used.usable, len(used.used)) == (8, 6, 2, True, 6)
    s = summary(record)
    assert s["rounds"] == {"total": 8, "clean": 6, "disturbed": 2, "usable": True, "used": 6}
    busy = synthetic(tmp_path, corpus, {"torch": {}, "numpy": {"loss/forward": 5e-3}}, n_rounds=6,
                     disturbed=(0, 1, 2, 3, 4))
    s = summary(busy)
    assert not s["rounds"]["usable"] and s["rounds"]["used"] == 6
    assert s["pairs"][0]["line"].startswith("no verdict, most rounds were disturbed")


def test_parts_and_the_overhead_add_up_to_the_step(tmp_path: Path, corpus) -> None:
    # jax: the step is 70 % of its parts (fusion: a negative row); numpy: 105 % (a positive one)
    record = synthetic(tmp_path, corpus, {"torch": {}, "jax": {"x": 0.7}, "numpy": {"x": 1.05}})
    n_items = len(record.items) - 1  # every item but the step, each planted at 1 ms
    for per_block in (False, True):
        s = summary(record, per_block)
        for name, x in (("torch", 1.0), ("jax", 0.7), ("numpy", 1.05)):
            # the planted overhead: the step is x times the items' sum; within 2 % of the step, about twice the
            # standard error of a median of 8 bursts whose speed drifts by 2 %
            planted = (x - 1) * n_items * 1e-3
            assert abs(s["tables"][name][REST]["median_s"] - planted) < 0.02 * x * n_items * 1e-3, name
        assert s["rest_share"]["jax"] < -0.3 and 0 < s["rest_share"]["numpy"] < 0.1
        rows = s["rows"]
        assert rows[-2:] == [REST, STEP] and OPTIMIZER in rows
        assert ("h.*.ln_1/forward" in rows) is not per_block and ("h.1.ln_1/forward" in rows) is per_block
        for table in s["tables"].values():
            for row, v in table.items():
                assert v["median_s"] == v["median_s"] and (row == REST or v["lo_s"] <= v["median_s"] <= v["hi_s"])
    text = format_table(record, summary(record))
    assert "fusion and framework overhead" in text and "×torch [95% CI]" in text and "h.*.attn.probs bwd" in text


def test_flops_per_second_and_launch_bound_parts(tmp_path: Path, corpus) -> None:
    record = synthetic(tmp_path, corpus, {"jax": {}, "torch": {"h.0.ln_1/forward": 5e-3, "h.1.ln_1/forward": 5e-3}})
    record.contenders[1].ready = PartsReady(launches={
        "h.0.ln_1/forward": {"kernels": 4, "kernel_us": 10.0}, "h.1.ln_1/forward": {"kernels": 4, "kernel_us": 10.0},
        "h.0.mlp.fc/forward": {"kernels": 1, "kernel_us": 900.0}, "h.1.mlp.fc/forward": {"kernels": 1,
                                                                                       "kernel_us": 900.0}})
    s = summary(record)
    t = s["tables"]["torch"]
    assert t["h.*.ln_1/forward"]["launches"] == {"kernels": 8, "kernel_us": 20.0, "launch_bound": True,
                                                 "busy": pytest.approx(0.002, rel=0.1)}
    assert not t["h.*.mlp.fc/forward"]["launches"]["launch_bound"]  # 1.8 ms of kernels in 2 ms
    assert "of the difference is h.*.ln_1 forward (+" in s["pairs"][0]["line"]
    assert "launch-bound: 8 kernels, GPU busy 0%" in s["pairs"][0]["line"]
    fc = record.flops["h.0.mlp.fc"]["forward"] * 2 * record.tokens_per_step
    assert t["h.*.mlp.fc/forward"]["flops_per_s"] == pytest.approx(fc / t["h.*.mlp.fc/forward"]["median_s"])
    assert t["h.*.mlp.act/forward"]["flops_per_s"] is None  # elementwise: no FLOPs in the model of the cost


# --- the record and its page ---------------------------------------------------------------------------------------
def test_the_record_round_trips_and_bad_records_are_one_line(tmp_path: Path, corpus) -> None:
    record = synthetic(tmp_path, corpus, {"torch": {}, "numpy": {}})
    path = record_path(tmp_path, record.id)
    record.dump(path)
    assert PartsRecord.load(path) == record
    doc = json.loads(path.read_text())
    for change, field in ((lambda d: d["rounds"][0]["bursts"]["torch"]["times"].update({"x/forward": 1.0}),
                           "rounds/0/bursts/torch/times"),
                          (lambda d: d["rounds"][1]["bursts"]["numpy"]["times"].update({STEP: "fast"}), "rounds/1"),
                          (lambda d: d["plan"].update(rounds=0), "plan/rounds"),
                          (lambda d: d["rounds"][0]["bursts"].update(flux={"times": {}, "chunk": QUIET}),
                           "rounds/0/bursts/flux")):
        bad = json.loads(json.dumps(doc))
        change(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(UsageError, match=field.split("/")[0]) as exc:
            PartsRecord.load(path)
        assert "\n" not in str(exc.value)


def test_the_page_and_harness_report_id(tmp_path: Path, corpus, capsys: pytest.CaptureFixture) -> None:
    record = synthetic(tmp_path, corpus, {"torch": {}, "jax": {"h.0.attn.probs/backward": 9e-3}})
    path = record_path(tmp_path, record.id)
    record.dump(path)
    page = write_page(record, tmp_path).read_text()
    assert "<svg" in page and "of the difference is h.*.attn.probs backward" in page and "<script" not in page
    page_path = path.with_suffix(".html")
    page_path.unlink()
    assert bench_parts_cli.report(record, tmp_path, False) == 0  # the command's result for people: on stdout
    out, err = capsys.readouterr()
    assert "diagnosis: jax" in out and out.splitlines()[-1] == f"bench parts: {path}" and str(page_path) in err
    page_path.unlink()
    assert main(["report", record.id, "--out", str(tmp_path)]) == 0
    assert page_path.is_file() and str(page_path) in capsys.readouterr().out
    assert main(["report", "parts-20990101-000000-abcdef", "--out", str(tmp_path)]) == 2
    assert "no parts record" in capsys.readouterr().err


# --- the command ---------------------------------------------------------------------------------------------------
def run_bench(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["bench", "parts", *argv])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    cases = [(["--parts", "attn.softmax"], "--parts: unknown part 'attn.softmax'"),
             (["--parts", "h.5.ln_1"], "unknown part 'h.5.ln_1'"),
             (["--device", "cuda", "--backend", "torch"], "cuda"),
             (["--backend", "torch,torch"], "twice"),
             (["--rounds", "0"], "must be 1 to")]
    for argv, words in cases:
        code, _, err = run_bench(capsys, *argv, "--out", str(out))
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    without_parts(monkeypatch, "numpy")
    code, _, err = run_bench(capsys, "--backend", "torch,numpy", "--out", str(out))
    assert code == 2 and "'numpy' cannot time its parts" in err and len(err.strip().splitlines()) == 1
    assert not out.exists(), tree(out)


def test_bench_parts_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
                                ) -> None:
    """The command as a user runs it, on a tiny config with short bursts: exit 0, a record with every part of every
    backend, forward and backward, each with a median and an interval, parts + overhead = step, the page."""
    pytest.importorskip("torch")
    monkeypatch.setenv("HARNESS_PAIRED_BURST_S", "0.02")
    monkeypatch.setattr("harness.progress.watched", lambda stream=None: True)  # as on a terminal
    (tmp_path / "tiny.toml").write_text(TINY)
    code, out, err = run_bench(capsys, "--config", str(tmp_path / "tiny.toml"), "--backend", "torch,numpy",
                               "--rounds", "2", "--threads", "1", "--json", "--out", str(tmp_path))
    assert code == 0, err
    (path,) = (tmp_path / "bench").glob("parts-*.json")
    result = json.loads(out)  # --json: one object on stdout, the table on stderr
    assert result["command"] == "bench parts" and result["record"] == str(path) and result["id"] == path.stem
    assert result["page"] == str(path.with_suffix(".html")) and [p["line"] for p in result["pairs"]] and \
        all(set(p) == {"slow", "fast", "ratio", "lo", "hi", "conclusive", "line"} for p in result["pairs"])
    record = PartsRecord.load(path)
    assert record.status in ("completed", "incomplete") and record.all_parts and len(record.rounds) >= 2
    s = summary(record)
    for name in ("torch", "numpy"):
        table = s["tables"][name]
        for part in part_names(1):
            for direction in ("forward", "backward"):
                v = table[f"{part.replace('h.0.', 'h.*.')}/{direction}"]
                assert v["median_s"] > 0 and v["lo_s"] is not None and v["hi_s"] is not None
        ready = record.contender(name).ready
        assert ready.passes >= 3 and set(ready.calls) == set(record.items)
    assert "fusion and framework overhead" in err and "diagnosis: " in err and "step" in err
    assert "\rparts: round 1 of at most " in err and " elapsed, " in err  # the progress line of every long work
    assert path.with_suffix(".html").is_file()


# --- planted slowdowns ---------------------------------------------------------------------------------------------
def plant_env(tmp_path: Path, plant: str) -> dict:
    """The environment of a timed process that carries slowdown `plant` (tests/plants.py, through sitecustomize)."""
    import plants

    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(plants.SITECUSTOMIZE)
    path = os.pathsep.join([str(site), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "HARNESS_TEST_PLANT": plant}


@pytest.mark.parametrize("plant,names", [("numpy-softmax-loop", None), ("torch-activation-copies", None),
                                         ("jax-gelu-backward-loop", ["mlp.fc", "mlp.act"])])
def test_a_planted_slowdown_is_named_first(tmp_path: Path, corpus, monkeypatch: pytest.MonkeyPatch, plant: str,
                                           names: list[str] | None) -> None:
    """The same backend twice, one process carrying the slowdown: the diagnosis names its part and direction first."""
    import plants

    backend, part, direction, _, _ = plants.SLOWDOWNS[plant]
    pytest.importorskip({"numpy": "numpy", "torch": "torch", "jax": "jax"}[backend])
    monkeypatch.setenv("HARNESS_PAIRED_BURST_S", "0.05")
    config = tiny(tmp_path)
    # XLA's compile of the step is most of a JAX process's set-up here, and not what is tested: both processes
    # compile alike with its optimizations off (the plant's loop stays a loop either way)
    fast = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"} if backend == "jax" else {}
    contenders = [{"name": backend, "backend": backend, "device": "cpu", "options": {}, "env": fast},
                  {"name": f"{backend}+plant", "backend": backend, "device": "cpu", "options": {},
                   "env": {**plant_env(tmp_path, plant), **fast}}]
    record, jobs = bench_parts.new_record(config, corpus, contenders, select(names, 1), 3, 1, {})
    record = bench_parts.run(record_path(tmp_path, record.id), record, jobs, threads=1, progress=False)
    assert record.status in ("completed", "incomplete"), record.failure
    pair = summary(record)["pairs"][0]
    assert pair["slow"] == f"{backend}+plant" and pair["conclusive"], pair["line"]
    assert pair["named"][0]["row"] == f"{part}/{direction}", pair["line"]
