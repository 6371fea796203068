"""nanoGPT's options, schedule, presets and config files (docs/nanogpt.md).

The options' defaults keep the original model (config hashes pinned from before the options existed; old stored
configs load); the schedule is nanoGPT's get_lr and reaches every train_step; the NumPy oracle's hand-written backward
with tied embeddings, exact GELU and no biases matches finite differences and torch; the torch backend with nanoGPT's
options matches the oracle; the presets, sizes listing, cost formulas and nanoGPT config files (read, never run) do
what they say; and planted bugs in each new part fail parity naming the cause.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import data_path

from harness.backends.declaration import Declaration
from harness.config.fields import OPTION_DEFAULTS, config_from_dict
from harness.config.load import load_config
from harness.config.presets import PRESETS
from harness.core.schedule import effective_rate, learning_rate, learning_rates
from harness.core.weights import count_parameters, decays, init_weights, param_shapes
from harness.errors import UsageError
from harness.parity.compare import compare
from harness.parity.options import diagnose_schedule, diagnose_tying
from harness.parity.tolerances import default_tolerances, precision_pair

torch = pytest.importorskip("torch")

NANOGPT = dict(tie_embeddings=True, gelu="exact", bias=False, lm_head_bias=False)
COSINE = dict(lr_schedule="cosine", warmup_steps=2, decay_steps=6, min_lr=1e-3)


# ------------------------------------------------------------------------------------------ config and schedule


def test_defaults_keep_the_original_model_and_its_hashes() -> None:
    # sha256 of the presets before the options existed (commit 1576ceb): records and sweeps keep comparing equal
    pinned = {"small": "9beb1f22bd21016d10686f937555619d69f16d46140f7627ef0456794f443926",
              "medium": "11f64cbf0e10f9d2823a26dbfb8468e74fcc398cd8677f7227282860aa6ba487",
              "large": "d703f6587f306d40575f70fd07ec2699dde12881d9e856e58a3545e85767e9b2"}
    for size, digest in pinned.items():
        c = load_config(size)
        assert c.config_hash() == digest and c.options() == {}
        old = {k: v for k, v in c.to_dict().items() if k not in OPTION_DEFAULTS}  # a spec.json from before
        assert config_from_dict(old, "spec.json") == c
    tied = load_config("small").replace(tie_embeddings=True)
    assert tied.config_hash() != pinned["small"] and tied.options() == {"tie_embeddings": True}
    assert param_shapes(load_config("large"), 65) == param_shapes(config_from_dict(old, "x"), 65)  # old: large


@pytest.mark.parametrize("change, message", [
    (dict(gelu="erf"), "gelu must be one of tanh, exact"),
    (dict(tie_embeddings="yes"), "tie_embeddings must be true or false"),
    (dict(decay="adam"), "decay must be one of nanogpt, mingpt"),
    (dict(lr_schedule="cosine"), "needs decay_steps"),
    (dict(lr_schedule="cosine", warmup_steps=5, decay_steps=5), "decay_steps must be a whole number > warmup_steps"),
    (dict(min_lr=1e-3), "belong to lr_schedule"),
    (dict(lr_schedule="cosine", decay_steps=9, min_lr=0.5), r"min_lr must be a number in \[0, learning_rate"),
    (dict(warmup_steps=-1), "warmup_steps must be a whole number >= 0"),
])
def test_invalid_options(change: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        load_config("small").replace(**change)


def test_schedule_is_nanogpts_get_lr() -> None:
    c = load_config("nanogpt-cpu")  # lr 1e-3, warm-up 100, cosine to 1e-4 at 2000
    expected = {0: 1e-3 * 1 / 101, 99: 1e-3 * 100 / 101, 100: 1e-3, 1050: 1e-4 + 0.5 * (1e-3 - 1e-4),
                2000: 1e-4, 2001: 1e-4, 5000: 1e-4}
    for step, lr in expected.items():
        assert math.isclose(learning_rate(c, step), lr, rel_tol=1e-12), step
    rates = learning_rates(c, 2001)
    assert all(a > b for a, b in itertools.pairwise(rates[100:2001]))  # strictly decaying
    constant = load_config("small")
    assert set(learning_rates(constant, 5)) == {constant.learning_rate}
    warm = constant.replace(warmup_steps=3)  # warm-up, then constant
    assert learning_rates(warm, 5) == [0.01 * 1 / 4, 0.01 * 2 / 4, 0.01 * 3 / 4, 0.01, 0.01]


def test_the_runner_hands_each_step_its_rate() -> None:
    from harness.core.data import BatchStream, load_corpus
    from harness.run.loop import Curves, LoopOptions, train

    class Recorder:  # the least of the Backend protocol the loop uses
        declaration = Declaration(name="recorder", dtypes=("float32",))
        def __init__(self) -> None:
            self.lrs: list[float] = []

        def train_step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
            self.lrs.append(lr)
            return 1.0

        def losses_to_floats(self, losses: list) -> list[float]:
            return [float(v) for v in losses]

        def synchronize(self) -> None:
            pass

        def eval_loss(self, x: np.ndarray, y: np.ndarray) -> float:
            return 1.0

    c = load_config("small").replace(steps=8, **COSINE)
    corpus = load_corpus(data_path())
    stream = BatchStream(corpus.train, c.block_size, c.batch_size, 1, c.scheme)
    backend = Recorder()
    assert train(backend, c, stream, {}, Curves(), 8, LoopOptions(progress=False)).status == "completed"
    assert backend.lrs == learning_rates(c, 8) and backend.lrs[0] == 0.01 / 3 and backend.lrs[-1] == 1e-3


def test_options_shape_the_parameters_and_the_costs() -> None:
    from harness.core.costs import flops_per_token

    for size in ("small", "medium"):
        for t, b, lb in itertools.product((False, True), repeat=3):
            c = load_config(size).replace(tie_embeddings=t, bias=b, lm_head_bias=lb)
            shapes = param_shapes(c, 65)
            # the closed form (the memory estimate counts absurd sizes too) counts what param_shapes lists
            assert count_parameters(c, 65) == sum(math.prod(s) for s in shapes.values())
            non_embedding = {n: s for n, s in shapes.items() if n != "wpe.weight" and (n != "wte.weight" or t)}
            assert count_parameters(c, 65, embeddings=False) == sum(math.prod(s) for s in non_embedding.values())
            assert ("lm_head.weight" in shapes) != t and ("lm_head.bias" in shapes) == lb
            assert any(n.endswith(".bias") and not n.startswith("lm_head") for n in shapes) == b
    # nanoGPT's CPU recipe: 804,096 parameters (its configure_optimizers: 802,944 decayed + 1,152 not); the
    # non-embedding count keeps the tied wte (nanoGPT's get_num_params subtracts wpe only): 0.80M
    c = load_config("nanogpt-cpu")
    shapes = param_shapes(c, 65)
    assert count_parameters(c, 65) == 804_096 and count_parameters(c, 65, embeddings=False) == 795_904
    assert sum(math.prod(s) for n, s in shapes.items() if decays(n, s, c.decay)) == 802_944
    assert flops_per_token(c, 65) == 6 * 795_904 + 12 * 4 * 128 * 64  # nanoGPT's estimate_mfu: 6N + 12 L H Q T
    mingpt = {n for n, s in shapes.items() if decays(n, s, "mingpt")}
    assert "wte.weight" not in mingpt and "wpe.weight" not in mingpt and "h.0.attn.c_attn.weight" in mingpt


# ------------------------------------------------------------------------------------------ the models


def test_oracle_backward_with_nanogpt_options_matches_finite_differences() -> None:
    from harness.models import numpy_gpt as ng

    ng.use_device("cpu")
    for options in (NANOGPT, dict(NANOGPT, lm_head_bias=True)):
        c = load_config("small").replace(n_embd=8, n_head=2, n_layer=2, d_hidden=12, block_size=6, batch_size=2,
                                         dropout=0.0, **options)
        params = {k: v.astype(np.float64) * 10 for k, v in init_weights(c, 7, 0).items()}  # sharper activations
        rng = np.random.default_rng(0)
        x, y = rng.integers(0, 7, (2, 6)), rng.integers(0, 7, (2, 6))
        _, grads = ng.loss_and_gradients(params, x, y, c)
        assert set(grads) == set(params) == set(param_shapes(c, 7))
        for name, p in params.items():
            num = np.zeros_like(p)
            for i in range(p.size):  # h = 1e-6: the tied matrix x 10 is curved (truncation error 5e-6 at h = 1e-5)
                old = p.flat[i]
                p.flat[i] = old + 1e-6
                up = float(ng.loss_only(params, x, y, c))
                p.flat[i] = old - 1e-6
                num.flat[i] = (up - float(ng.loss_only(params, x, y, c))) / 2e-6
                p.flat[i] = old
            err = np.linalg.norm(grads[name] - num) / max(np.linalg.norm(num), 1e-300)
            assert err < 1e-6, (options, name, err)  # wte.weight: the sum of both uses
    # exact GELU: torch's nn.GELU(), and its derivative
    z = np.linspace(-4, 4, 41)
    out, cache = ng.gelu_erf_forward(z)
    np.testing.assert_allclose(out, torch.nn.functional.gelu(torch.from_numpy(z)).numpy(), rtol=1e-14, atol=1e-16)
    zt = torch.from_numpy(z).requires_grad_(True)
    torch.nn.functional.gelu(zt).sum().backward()
    np.testing.assert_allclose(ng.gelu_erf_backward(np.ones_like(z), cache), zt.grad.numpy(), rtol=1e-13, atol=1e-15)


def test_torch_backend_with_nanogpt_options_matches_the_oracle() -> None:
    from harness.backends.numpy_backend import NumpyBackend
    from harness.backends.torch_backend import TorchBackend

    c = load_config("small").replace(dropout=0.0, **NANOGPT, **COSINE)
    w = init_weights(c, 65, 0)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 65, (4, 64)), rng.integers(0, 65, (4, 64))
    t, n = TorchBackend(dtype="float64"), NumpyBackend()
    t.setup(c, w, 65, "cpu", 0)
    n.setup(c, w, 65, "cpu", 0)
    assert t.model.wte.weight is t.model.lm_head.weight and list(t.parameters()) == list(param_shapes(c, 65))
    assert np.abs(t.logits(x) - n.logits(x)).max() < 1e-14
    gt, gn = t.gradients(x, y), n.gradients(x, y)
    assert all(np.abs(gt[k] - gn[k]).max() <= 1e-13 * np.abs(gn[k]).max() for k in gn)
    for k, lr in enumerate(learning_rates(c, 4)):
        assert abs(t.train_step(x, y, lr) - n.train_step(x, y, lr)) < 1e-13, k
    # a checkpoint of the tied model restores the one shared tensor
    again = TorchBackend(dtype="float64")
    again.setup(c, w, 65, "cpu", 0)
    again.load_state_dict(t.state_dict())
    assert again.model.wte.weight is again.model.lm_head.weight
    assert torch.equal(again.model.lm_head.weight, t.model.wte.weight)


# ------------------------------------------------------------------------------------------ presets and configs


def test_presets_are_listed_and_the_recipes_are_nanogpts(capsys: pytest.CaptureFixture) -> None:
    from harness.cli.main import main

    assert main(["sizes"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in PRESETS) and "cosine to 0.0001" in table
    row = next(line for line in table.splitlines() if line.startswith("attention dropout"))
    assert row.split()[2:] == ["no", "no", "no", "yes", "yes"]  # nanoGPT's recipes drop attention probabilities
    cpu, gpu = load_config("nanogpt-cpu"), load_config("nanogpt-shakespeare-char")
    for c in (cpu, gpu):
        assert c.options() == {**NANOGPT, "attn_dropout": True, "lr_schedule": "cosine", "warmup_steps": 100,
                               "decay_steps": c.steps, "min_lr": 1e-4}
        assert (c.learning_rate, c.beta2, c.weight_decay, c.grad_clip, c.scheme) == (1e-3, 0.99, 0.1, 1.0, "random")
        assert c.d_hidden == 4 * c.n_embd and c.eval_interval == 250
    assert (cpu.n_layer, cpu.n_head, cpu.n_embd, cpu.block_size, cpu.batch_size, cpu.dropout, cpu.steps,
            cpu.eval_batches) == (4, 4, 128, 64, 12, 0.0, 2000, 20)
    assert (gpu.n_layer, gpu.n_head, gpu.n_embd, gpu.block_size, gpu.batch_size, gpu.dropout, gpu.steps,
            gpu.eval_batches, gpu.target_val_loss) == (6, 6, 384, 256, 64, 0.2, 5000, 200, 1.4697)


# A nanoGPT config file in the style of its config/*.py (written for this test): literal assignments and comments.
NANOGPT_FILE = '''"""a character-level model"""
out_dir = 'out-chars'
eval_interval = 250 # often
eval_iters = 200
log_interval = 10
always_save_checkpoint = False
wandb_log = False
dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2
learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100
'''


def test_a_nanogpt_config_file_becomes_the_recipe(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "train_chars.py"
    path.write_text(NANOGPT_FILE)
    c = load_config(path=path)
    assert "not used by the harness: always_save_checkpoint (checkpoints), log_interval" in capsys.readouterr().err
    preset = load_config("nanogpt-shakespeare-char")
    ignore = {"name", "target_val_loss"}
    assert {k: v for k, v in c.to_dict().items() if k not in ignore} == \
        {k: v for k, v in preset.to_dict().items() if k not in ignore}
    # the README's CPU recipe as --set overrides, in nanoGPT's names
    readme = {"eval_iters": 20, "block_size": 64, "batch_size": 12, "n_layer": 4, "n_head": 4, "n_embd": 128,
              "max_iters": 2000, "lr_decay_iters": 2000, "dropout": 0.0, "device": "cpu", "compile": False}
    cpu = load_config(path=path, overrides=readme)
    assert {k: v for k, v in cpu.to_dict().items() if k not in ignore} == \
        {k: v for k, v in load_config("nanogpt-cpu").to_dict().items() if k not in ignore}
    assert load_config(path=path, overrides={"decay_lr": False}).lr_schedule == "constant"
    assert load_config(path=path, overrides={"gelu": "tanh"}).gelu == "tanh"  # a harness field after the file
    # --set on a preset: fields, and nanoGPT's names as aliases
    small = load_config("small", overrides={"tie_embeddings": True, "max_iters": 30, "n_embd": 32})
    assert (small.tie_embeddings, small.steps, small.n_embd, small.d_hidden) == (True, 30, 32, 128)


@pytest.mark.parametrize("text, message", [
    ("import os\nn_layer = 2\n", "only `name = literal` lines are read"),
    ("n_layer = int('2')\n", "n_layer is not given a literal"),
    ("n_layer = 2 if True else 3\n", "n_layer is not given a literal"),
    ("a = b = 2\n", "only `name = literal` lines"),
    ("dataset = 'shakespeare_char'\ngradient_accumulation_steps = 1\nvocab = 65\n",
     "unknown nanoGPT config name(s) vocab"),
    ("dataset = 'shakespeare_char'\n", "gradient_accumulation_steps = 40 (train.py's default) is not supported"),
    ("gradient_accumulation_steps = 1\n", "dataset = 'openwebtext'"),
    ("dataset = 'shakespeare_char'\ngradient_accumulation_steps = 1\nn_layer = 2.5\n", "n_layer = 2.5 is a float"),
    ("n_layer = (\n", "not a Python file of literal assignments"),
])
def test_a_bad_nanogpt_config_file_is_one_line_naming_it(text: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text(text)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(path=path)


def test_cli_refuses_a_config_that_would_run_code(tmp_path: Path) -> None:
    from conftest import run_cli

    evil = tmp_path / "evil.py"
    marker = tmp_path / "ran"
    evil.write_text(f"open({str(marker)!r}, 'w').write('x')\nn_layer = 2\n")
    out = tmp_path / "out"
    proc = run_cli("run", "--config", str(evil), "--out", str(out))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "never run" in proc.stderr
    assert not marker.exists() and not out.exists()
    proc = run_cli("run", "--size", "small", "--set", "gelu=erf", "--out", str(out))
    assert proc.returncode == 2 and "gelu must be one of tanh, exact" in proc.stderr and not out.exists()
    proc = run_cli("run", "--size", "small", "--set", "n_layers=2", "--out", str(out))
    assert proc.returncode == 2 and "--set n_layers: unknown config field" in proc.stderr and not out.exists()


def test_sweep_sets_the_options() -> None:
    from harness.sweep.spec import build_spec, expand, parse_set

    spec = build_spec({"sizes": ["small", "nanogpt-cpu"], "fields": parse_set(["tie_embeddings=true,false",
                                                                             "gelu=tanh,exact"])}, Path("."))
    cells = expand(spec)
    assert len(cells) == 8
    assert {(c.config.tie_embeddings, c.config.gelu) for c in cells} == set(itertools.product((True, False),
                                                                                            ("tanh", "exact")))
    assert len({c.config.config_hash() for c in cells}) == 8


def test_sweep_reads_set_as_run_does() -> None:
    """`harness sweep --set NAME=V1,V2` reads each value as `harness run --set` reads one (False, 1e-3: Python
    literals, as nanoGPT's configurator) and takes nanoGPT's names, with run's d_hidden rule."""
    from harness.config.nanogpt import parse_sets
    from harness.sweep.spec import build_spec, expand, parse_set

    fields = parse_set(["bias=False,True", "n_embd=32"])
    assert fields == {"bias": [False, True], "n_embd": [32]}  # Python's False, not the string "False"
    cells = expand(build_spec({"sizes": ["small"], "fields": fields}, Path(".")))
    assert [c.config.bias for c in cells] == [False, True]
    run = load_config("small", overrides=parse_sets(["bias=False", "n_embd=32"]))
    assert run.d_hidden == 128 and cells[0].config == run.replace(name=cells[0].config.name)  # 4 x n_embd, as run
    fields = parse_set(["lr_decay_iters=300,400", "warmup_iters=10", "eval_iters=3"])
    cells = expand(build_spec({"sizes": ["nanogpt-cpu"], "fields": fields}, Path(".")))
    assert [(c.config.decay_steps, c.config.warmup_steps, c.config.eval_batches) for c in cells] == [
        (300, 10, 3), (400, 10, 3)]
    run = load_config("nanogpt-cpu", overrides=parse_sets(["lr_decay_iters=300", "warmup_iters=10", "eval_iters=3"]))
    assert cells[0].config == run.replace(name=cells[0].config.name)
    (cell,) = expand(build_spec({"sizes": ["nanogpt-cpu"], "fields": parse_set(["decay_lr=False"])}, Path(".")))
    assert (cell.config.lr_schedule, cell.config.warmup_steps, cell.config.decay_steps) == ("constant", 0, None)
    with pytest.raises(UsageError, match="both warmup_iters and warmup_steps"):
        build_spec({"fields": parse_set(["warmup_iters=1", "warmup_steps=2"])}, Path("."))
    with pytest.raises(UsageError, match="top level"):
        build_spec({"fields": parse_set(["max_iters=5"])}, Path("."))


# ------------------------------------------------------------------------------------------ parity: planted bugs

STEPS = 6


def probe_run(backend: object, config: object, plant: object = None) -> tuple[dict[str, np.ndarray], list[float]]:
    """What a parity worker measures, in process: the probe with the state after every step, and the losses."""
    from harness.core.data import BatchStream, load_corpus
    from harness.run.loop import Curves, LoopOptions, train

    corpus = load_corpus(data_path())
    stream = BatchStream(corpus.train, config.block_size, config.batch_size, 1337, config.scheme)
    backend.setup(config, init_weights(config, corpus.vocab_size, 1337), corpus.vocab_size, "cpu", 1337)
    if plant:
        plant(backend)
    x, y = stream.batch(0)
    probe = {"logits": backend.logits(x), "x": x, "y": y}
    probe.update({f"grad/{k}": v for k, v in backend.gradients(x, y).items()})
    probe.update({f"opt/0/param/{k}": v for k, v in backend.parameters().items()})
    probe["lr"] = np.asarray(learning_rates(config, STEPS))  # as the worker: the schedule, and the rates taken
    used: list[float] = []

    def after_step(done: int) -> None:
        state = backend.state_dict()
        probe.update({f"opt/{done}/{k}": v for k, v in state.items() if k.startswith(("param/", "adam_m/", "adam_v/"))})
        part = {kind: {n: probe[f"opt/{step}/{kind}/{n}"] for n in backend.parameters()}
                for kind, step in (("param", done), ("adam_m", done), ("adam_v", done))}
        before = {n: probe[f"opt/{done - 1}/param/{n}"] for n in backend.parameters()}
        used.append(effective_rate(before, part["param"], part["adam_m"], part["adam_v"], done, config))

    curves = Curves()
    options = LoopOptions(progress=False, after_step=after_step)
    assert train(backend, config, stream, {}, curves, STEPS, options).status == "completed"
    probe["lr_used"] = np.asarray(used)
    return probe, curves.loss


def wrong_rate(rate: object) -> object:
    """Plant: the NumPy backend steps with its own (wrong) schedule instead of the harness's rate."""
    def plant(backend: object) -> None:
        step = backend.train_step
        backend.train_step = lambda x, y, lr, **kw: step(x, y, rate(backend.config, backend.optimizer.t), **kw)
    return plant


def no_tied_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: the oracle's tied matrix gets the embedding's gradient only (the output layer's is dropped)."""
    from harness.models import numpy_gpt

    backward = numpy_gpt.gpt_backward

    def gpt_backward(dlogits: np.ndarray, cache: tuple) -> dict:
        grads = backward(dlogits, (*cache[:-1], False))  # computed as if untied: lm_head.weight holds its part
        grads.pop("lm_head.weight")
        return grads

    monkeypatch.setattr(numpy_gpt, "gpt_backward", gpt_backward)


def tanh_gelu(backend: object) -> None:
    """Plant: the NumPy backend computes the tanh GELU whatever the config asks."""
    backend.config = backend.config.replace(gelu="tanh")


PLANTS = {  # planted in the NumPy backend: (how, the dtype pair, the FAIL line, its cause)
    "tying without summing gradients": ("tie", "float32", "FAIL: gradient wte.weight", "likely cause: tied "
                                        "embeddings: only the shared wte.weight gradient differs"),
    "tanh where exact is asked": ("gelu", "float64", "FAIL: logits", "likely cause: GELU form: numpy computes the "
                                  "tanh GELU where the config asks for exact"),
    "warm-up off by one step": (lambda c, t: learning_rate(c, t + 1), "float32", "FAIL: optimizer step 1:",
                                "likely cause: learning-rate schedule: the warm-up is off by one step: it used "
                                "the rate of the next step"),
    "cosine ending at 0 instead of min_lr": (lambda c, t: learning_rate(c.replace(min_lr=0.0), t), "float32",
                                             "FAIL: optimizer step 4:", "likely cause: learning-rate schedule: the "
                                             "cosine decays to 0 instead of min_lr = 0.001"),
}


_CORRECT: dict[str, tuple] = {}  # the correct backends' runs, by torch dtype


@pytest.mark.parametrize("bug", list(PLANTS))
def test_planted_bug_fails_parity_naming_the_cause(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.backends.numpy_backend import NumpyBackend
    from harness.backends.torch_backend import TorchBackend

    how, dtype, line, cause = PLANTS[bug]
    c = load_config("small").replace(dropout=0.0, steps=STEPS, **NANOGPT, **COSINE)
    tol = default_tolerances(precision_pair(dtype, "float64"), None)
    if dtype not in _CORRECT:
        _CORRECT[dtype] = probe_run(TorchBackend(dtype=dtype, parity=True), c), probe_run(NumpyBackend(), c)
    (probe_t, loss_t), (probe_n, loss_n) = _CORRECT[dtype]
    assert compare(probe_t, probe_n, loss_t, loss_n, tol, config=c).passed  # correct backends agree
    if how == "tie":
        no_tied_sum(monkeypatch)
    plant = {"tie": None, "gelu": tanh_gelu}[how] if isinstance(how, str) else wrong_rate(how)
    probe_n, loss_n = probe_run(NumpyBackend(), c, plant)
    result = compare(probe_t, probe_n, loss_t, loss_n, tol, backends=("torch", "numpy"), config=c)
    assert not result.passed
    (first,) = [f for f in result.failures if f.startswith(line)]
    assert cause in first, first
    assert result.failures[0] == first  # the first failure is the planted part, not a consequence
    rates = [f for f in result.failures if f.startswith("FAIL: learning rate of optimizer step")]
    if isinstance(how, str):  # the model, not the rates: every step took the schedule's rate
        assert not rates and result.rate_rel_err["numpy"] < 1e-12, rates
    else:  # the rate check names the backend, the first step that took another rate, and the cause
        (rate,) = rates
        assert f"step {line.split()[3][:-1]}: numpy stepped with" in rate and cause in rate, rate


def test_option_diagnoses_on_synthetic_quantities() -> None:
    """The three diagnosis functions alone: each names its pattern and stays silent otherwise."""
    c = load_config("small").replace(steps=8, **COSINE)
    lr = {k: learning_rate(c, k - 1) for k in range(1, 8)}  # optimizer step k used get_lr(k - 1)
    ahead = {k: (learning_rate(c, k) / lr[k], lr[k] / learning_rate(c, k)) for k in range(1, 4)}
    text = diagnose_schedule(ahead, c, ("torch", "numpy"))
    assert "warm-up is off by one step: it used the rate of the next step" in text
    assert "from optimizer step 1 on numpy stepped with other rates than the schedule (step 1: 0.006667, not " \
           "0.003333" in text
    zero = c.replace(min_lr=0.0)  # now the first backend decays to 0
    to_zero = {k: (lr[k] / learning_rate(zero, k - 1), learning_rate(zero, k - 1) / lr[k]) for k in range(1, 7)}
    assert "the cosine decays to 0 instead of min_lr = 0.001; from optimizer step 4 on torch stepped" in \
        diagnose_schedule(to_zero, c, ("torch", "numpy"))
    assert diagnose_schedule({k: (1.0, 1.0) for k in range(1, 8)}, c) is None  # both follow the schedule
    assert diagnose_schedule({1: (2.0, 0.5)}, load_config("small")) is None  # a plain factor: not a schedule
    rng = np.random.default_rng(0)
    x = np.array([[0, 1, 2]])
    ga = {"wte.weight": rng.standard_normal((5, 3)), "h.0.ln_1.weight": rng.standard_normal(3)}
    head_only = dict(ga, **{"wte.weight": ga["wte.weight"] + np.pad(np.ones((3, 3)), ((0, 2), (0, 0)))})
    assert "the embedding lookup's part is missing" in diagnose_tying(ga, head_only, x, 1e-6)
    assert "the output layer's part is missing" in diagnose_tying(ga, dict(ga, **{"wte.weight": 0 * ga[
        "wte.weight"]}), x, 1e-6)
    untied = dict(ga, **{"lm_head.weight": np.zeros((5, 3))})
    assert diagnose_tying(untied, dict(untied, **{"wte.weight": 0 * ga["wte.weight"]}), x, 1e-6) is None
    both = dict(head_only, **{"h.0.ln_1.weight": 2 * ga["h.0.ln_1.weight"]})
    assert diagnose_tying(ga, both, x, 1e-6) is None  # not only the shared matrix: another cause


# ------------------------------------------------------------------------------------------ the conformance kit

KIT_SETS = ["tie_embeddings=true", "gelu=exact", "bias=false", "lm_head_bias=false", "lr_schedule=cosine",
            "warmup_steps=2", "decay_steps=5", "min_lr=0.001"]


@pytest.fixture(scope="module")
def nanogpt_kit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness.cli.main import main

    out = tmp_path_factory.mktemp("kit") / "kit"
    args = ["kit", "export", "--size", "small", "--steps", "6", "--data", str(data_path()), "--out", str(out)]
    assert main(args + [a for s in KIT_SETS for a in ("--set", s)]) == 0
    return out


def port(kit: Path, out: Path, *args: str) -> Path:
    """examples/kit_torch_port.py in this process (test_kit.py runs it as a separate program)."""
    import runpy
    import sys

    argv = sys.argv
    sys.argv = ["kit_torch_port.py", str(kit), str(out), *args]
    try:
        runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "kit_torch_port.py"),
                       run_name="__main__")
    finally:
        sys.argv = argv
    return out


def test_kit_states_the_options_and_rates_and_a_nanogpt_port_passes(nanogpt_kit: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    import json

    from harness.cli.main import main

    manifest = json.loads((nanogpt_kit / "manifest.json").read_text())
    c = config_from_dict(manifest["config"], "manifest")
    assert manifest["model_options"] == {**NANOGPT, "attn_dropout": False, "mlp_hidden": 64}
    # nanoGPT's get_lr(it) written out for KIT_SETS on small (learning_rate 0.01): warm-up lr * (it + 1) / (2 + 1),
    # then min_lr + 0.5 (1 + cos(pi (it - 2) / (5 - 2))) (lr - min_lr), min_lr at it = lr_decay_iters = 5
    get_lr = [0.01 / 3, 0.02 / 3, 0.01, 0.001 + 0.75 * 0.009, 0.001 + 0.25 * 0.009, 0.001]
    assert c.learning_rate == 0.01 and c.lr_schedule == "cosine"
    assert manifest["training"]["learning_rates"] == pytest.approx(get_lr, rel=1e-12, abs=0)
    assert "lm_head.weight" not in manifest["parameters"] and "wte.weight" in manifest["training"][
        "decayed_parameters"]
    assert "exact GELU" in manifest["model"] and "tied lm_head" in manifest["model"]
    with np.load(nanogpt_kit / "batches.npz") as f:
        assert f["lr"].tolist() == pytest.approx(get_lr, rel=1e-12, abs=0)
    for dtype in ("float32", "float64"):
        results = port(nanogpt_kit, tmp_path / f"{dtype}.npz", "--dtype", dtype)
        capsys.readouterr()
        assert main(["kit", "check", str(nanogpt_kit), str(results)]) == 0, capsys.readouterr().out


KIT_PLANTS = {  # plant in the port: (dtype, what `kit check` must print)
    "tie-no-sum": ("float32", "likely cause: tied embeddings: only the shared wte.weight gradient differs"),
    # the activation taps name it first, at h.0.mlp.act: the oracle follows the config (exact)
    "gelu-tanh": ("float64", "likely cause: GELU form: oracle computes the exact (erf) GELU, port the "
                             "tanh-approximation GELU"),
    "warmup-off-by-one": ("float32", "likely cause: learning-rate schedule: the warm-up is off by one step"),
    "cosine-to-zero": ("float32", "likely cause: learning-rate schedule: the cosine decays to 0 instead of min_lr"),
}


@pytest.mark.parametrize("plant", list(KIT_PLANTS))
def test_kit_names_a_port_that_gets_an_option_wrong(plant: str, nanogpt_kit: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    from harness.cli.main import main

    dtype, text = KIT_PLANTS[plant]
    results = port(nanogpt_kit, tmp_path / "results.npz", "--dtype", dtype, "--plant", plant)
    capsys.readouterr()
    assert main(["kit", "check", str(nanogpt_kit), str(results)]) == 1
    out = capsys.readouterr().out
    assert text in out.split("first broken:", 1)[1], out  # the diagnosis of the first broken depth


def _spec(doc: dict):
    """The RunSpec of a spec.json holding `doc` (a run id and data provenance added)."""
    from harness.store import RunSpec

    return RunSpec.from_dict(dict(doc, run_id="r", data={"path": "data.txt", "sha256": "ab" * 32}))
