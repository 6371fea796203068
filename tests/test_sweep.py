"""`harness sweep`: spec parsing, bad input, interval statistics, a local sweep end to end, Ctrl-C and --resume."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import data_path, record_doc, run_cli

from harness.errors import UsageError
from harness.sweep.spec import DEFAULT_SEED, build_spec, expand, parse_seed_flag, parse_seeds, parse_set
from harness.timing import stats

# --- statistics ------------------------------------------------------------------------------------------------------
# Two-sided 95 % critical values t_{0.975, df} from the printed Student-t table (NIST/SEMATECH e-Handbook 1.3.6.7.2)
T_TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
           15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 100: 1.984}


def test_t_quantile_matches_the_printed_table():
    for df, value in T_TABLE.items():
        assert stats.t_quantile(0.975, df) == pytest.approx(value, abs=6e-4), df
    assert stats.t_quantile(0.995, 5) == pytest.approx(4.032, abs=6e-4)
    assert stats.t_quantile(0.025, 4) == pytest.approx(-2.776, abs=6e-4)
    assert stats.t_quantile(0.975, 10_000) == pytest.approx(1.960, abs=1e-3)  # tends to the normal quantile


@pytest.mark.parametrize("n", [5, 21, 101])
def test_exact_median_interval_is_the_resampled_bootstraps_limit(n: int) -> None:
    """On odd n every resample's median is one of the values, so both intervals are order statistics: the data are a
    permutation of 0..n-1, a value its rank. The resampled bootstrap's tail estimate errs by about
    sqrt(p(1-p)/n_boot) in probability; where the bootstrap's distribution of the median (P(median <= x_(k)) =
    P(Binomial(n, k/n) >= ceil(n/2)), computed here with scipy.stats) steps across the 2.5 % and 97.5 % tails more
    than 3 such errors away from either tail (the seed is fixed: no chance at each run), the resampled bound is that
    rank, all but surely, and so must be the exact one."""
    from scipy.stats import binom

    data = np.random.default_rng(n).permutation(n).astype(float)
    n_boot = stats.RESAMPLED_MAX // n  # the most the resampled bootstrap draws
    cdf = binom.sf((n + 1) // 2 - 1, n, np.arange(1, n + 1) / n)  # P(median <= the value of rank k), k = 1..n
    for tail in (0.025, 0.975):
        assert np.min(np.abs(cdf - tail)) > 3 * math.sqrt(tail * (1 - tail) / n_boot), (n, tail)  # no tie to break
    resampled = stats.median_ci(data, n_boot=n_boot)
    exact = stats.exact_median_ci(data)
    assert exact == resampled, (exact, resampled)
    assert exact == [float(np.argmax(cdf >= 0.025)), float(np.argmax(cdf >= 0.975))]  # the first rank past each tail


def test_mean_ci_and_paired_intervals_by_hand():
    values = [2.0, 2.5, 3.0, 4.5]
    m, s = sum(values) / 4, math.sqrt(sum((v - 3.0) ** 2 for v in values) / 3)
    ci = stats.mean_ci(values)
    half = 3.182 * s / 2  # t_{0.975,3} * s / sqrt(4)
    assert (ci.estimate, ci.n) == (m, 4)
    assert ci.lo == pytest.approx(m - half, abs=1e-3) and ci.hi == pytest.approx(m + half, abs=1e-3)
    single = stats.mean_ci([1.5])
    assert single.lo is None and single.hi is None and "no interval" in single.fmt()
    # ratios: geometric mean, interval from the t interval of the log ratios
    a, b = [2.0, 2.2, 1.9], [1.0, 1.0, 1.0]
    logs = [math.log(x) for x in a]
    lm, ls = sum(logs) / 3, math.sqrt(sum((v - sum(logs) / 3) ** 2 for v in logs) / 2)
    r = stats.paired_ratio(a, b)
    assert r.estimate == pytest.approx(math.exp(lm))
    assert r.lo == pytest.approx(math.exp(lm - 4.303 * ls / math.sqrt(3)), rel=1e-3)
    assert r.hi == pytest.approx(math.exp(lm + 4.303 * ls / math.sqrt(3)), rel=1e-3)
    d = stats.paired_difference([3.0, 4.0, 5.0], [1.0, 1.0, 1.0])
    assert d.estimate == pytest.approx(3.0) and d.lo == pytest.approx(3.0 - 4.303 / math.sqrt(3), abs=1e-3)
    k, c = stats.loglog_fit([1, 10, 100], [2, 20 ** 1, 200])
    assert k == pytest.approx(1.0) and c == pytest.approx(2.0)


# --- spec ------------------------------------------------------------------------------------------------------------
def test_spec_cross_product_and_scaling(tmp_path: Path):
    spec = build_spec({"sizes": ["small"], "backends": ["torch", "numpy"], "seeds": 2, "steps": 5,
                       "fields": {"n_embd": [16, 32], "learning_rate": [0.003, 0.01]}, "precision": ["fp32", "tf32"]},
                      tmp_path)
    cells = expand(spec)
    # torch: 2 precisions; numpy ignores precision: (2 + 1) backends-options x 2 n_embd x 2 lr x 2 seeds
    assert len(cells) == 3 * 2 * 2 * 2
    assert len({c.key for c in cells}) == len(cells)
    assert {c.seed for c in cells} == {DEFAULT_SEED, DEFAULT_SEED + 1}
    wide = [c for c in cells if c.overrides["n_embd"] == 32]
    assert {c.config.d_hidden for c in wide} == {128}  # the preset's 4x ratio follows n_embd
    assert all(c.config.steps == 5 for c in cells)
    assert cells[0].config.name == "small-n_embd16-learning_rate0.003"
    assert list(parse_seeds(parse_seed_flag("3"))) == [1337, 1338, 1339]
    assert parse_seeds(parse_seed_flag("4,7")) == [4, 7] and parse_seeds([5]) == [5]
    assert parse_set(["learning_rate=0.003,0.01", "scheme=random"]) == {"learning_rate": [0.003, 0.01],
                                                                       "scheme": ["random"]}


@pytest.mark.parametrize("doc, match", [
    ({"backends": []}, "empty"),
    ({"fields": {"colour": [1, 2]}}, "unknown config field 'colour'"),
    ({"fields": {"steps": [1, 2]}}, "top level"),
    ({"fields": {"n_head": [3]}}, "n_head=3 does not divide"),
    ({"fields": {"dropout": [0.1, 1.5]}}, "dropout must be in"),
    ({"sizes": ["huge"]}, "unknown size"),
    ({"seeds": 0}, "positive"),
    ({"seeds": [1, 1]}, "twice"),
    ({"steps": 5, "epochs": 2}, "both steps and epochs"),
    ({"name": "a b"}, "sweep name"),
])
def test_spec_rejects(doc: dict, match: str, tmp_path: Path):
    with pytest.raises(UsageError, match=match):
        expand(build_spec(doc, tmp_path))


# --- command line: bad input ----------------------------------------------------------------------------------------
def _one_line_exit_2(proc: subprocess.CompletedProcess, needle: str, out: Path) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists(), "bad input must write nothing"


@pytest.mark.parametrize("args, needle", [
    (["--backends", "torch,mxnet"], "unknown backend 'mxnet'"),
    (["--set", "n_head=3"], "does not divide"),
    (["--set", "colour=1"], "unknown config field"),
    (["--set", "learning_rate"], "NAME=V1,V2"),
    (["--axis", "colour=1,2"], "unknown config field"),
    (["--axis", "learning_rate=0.1", "--set", "learning_rate=0.2"], "both given"),
    (["--device", "flux=cuda"], "not one of the backends"),
    (["--device", "torch=cuda", "--axis", "device=cpu,cuda"], "exclude each other"),
    (["--seeds", "x"], "--seeds"),
    (["--seeds", "301"], "--yes"),
    (["--executor", "slurm", "--partition", "debug"], "sbatch"),
])
def test_bad_input_is_one_line_and_writes_nothing(args: list[str], needle: str, tmp_path: Path, tiny_config):
    out = tmp_path / "out"
    env = {"PATH": str(tmp_path)} if "slurm" in args else None  # no sbatch anywhere on PATH
    proc = run_cli("sweep", "--configs", str(tiny_config()), "--steps", "2", "--out", str(out), *args, env=env)
    _one_line_exit_2(proc, needle, out)


def sweep_spec(*argv: str) -> tuple:
    """The spec and the cells of `harness sweep ARGV` (parsed and expanded only)."""
    from harness.cli.main import build_parser
    from harness.cli.sweep import spec_from_args

    spec, _ = spec_from_args(build_parser().parse_args(["sweep", *argv]))
    return spec, expand(spec)


def test_axis_and_the_one_value_options(tmp_path: Path):
    """--axis NAME=V1,V2 is an axis (a config field, or device, precision, dtype); --set NAME=VALUE, --dropout,
    --device, --precision and --dtype hold one value for every cell, and a list in them is an error that names the
    --axis to write instead."""
    spec, cells = sweep_spec("--axis", "learning_rate=0.003,0.01", "--set", "n_layer=2", "--backend", "torch,numpy")
    assert spec.fields == {"learning_rate": [0.003, 0.01], "n_layer": [2]} and len(cells) == 4
    assert {c.config.n_layer for c in cells} == {2}
    axes = sweep_spec("--axis", "device=cpu,cuda", "--axis", "precision=fp32,tf32", "--axis", "dtype=float32")[0]
    assert (axes.devices, axes.precision, axes.dtype) == (["cpu", "cuda"], ["fp32", "tf32"], ["float32"])
    one = sweep_spec("--device", "cuda", "--precision", "tf32")[0]
    assert (one.devices, one.precision) == (["cuda"], ["tf32"])
    with pytest.raises(UsageError, match=re.escape("--axis learning_rate=0.003,0.01")):
        sweep_spec("--set", "learning_rate=0.003,0.01")
    with pytest.raises(UsageError, match=re.escape("--axis device=cpu,cuda")):
        sweep_spec("--device", "cpu,cuda")
    with pytest.raises(SystemExit):  # not one of fp32, tf32, bf16: argparse's one line
        sweep_spec("--precision", "fp32,tf32")


def test_device_name_equals_device_puts_one_backend_elsewhere():
    """--device NAME=DEVICE, as in run, parity and bench: that backend's cells on DEVICE, the others on the plain
    --device (cpu); such cells are never paired with the others (a paired timing holds one device)."""
    spec, cells = sweep_spec("--backend", "torch,numpy", "--device", "torch=cuda", "--seeds", "2")
    assert spec.devices == ["cpu"] and spec.backend_devices == {"torch": "cuda"}
    assert {(c.backend, c.device) for c in cells} == {("torch", "cuda"), ("numpy", "cpu")}
    from harness.sweep import manifest as mf
    from harness.sweep.plans import cell_doc

    assert mf.paired_entries("ID", [cell_doc(c, spec) for c in cells], 3) == []
    same = sweep_spec("--backend", "torch,numpy", "--device", "cpu", "--device", "torch=cpu")[0]
    assert same.backend_devices == {}


def test_bad_sweep_file(tmp_path: Path):
    out = tmp_path / "out"
    spec = tmp_path / "grid.toml"
    spec.write_text('sizes = ["small"]\ncolours = ["red"]\n')
    _one_line_exit_2(run_cli("sweep", str(spec), "--out", str(out)), "unknown key(s) colours", out)
    spec.write_text('sizes = ["small"]\n[fields]\nlearning_rate = []\n')
    _one_line_exit_2(run_cli("sweep", str(spec), "--out", str(out)), "empty", out)


# --- a local sweep end to end ---------------------------------------------------------------------------------------
def _manifest(out: Path) -> dict:
    (path,) = (out / "sweeps").glob("*/sweep.json")
    return json.loads(path.read_text())


def test_local_sweep_end_to_end(tmp_path: Path, tiny_config):
    """Two backends x two seeds on a tiny config: records, manifest, CSV, intervals in the report, time to target."""
    from harness.report.results import load_runs

    out = tmp_path / "out"
    spec = tmp_path / "grid.toml"
    spec.write_text(f'configs = ["{tiny_config(interval=10)}"]\nbackends = ["torch", "numpy"]\nseeds = 2\n'
                    'steps = 30\ntext = false\npaired_rounds = 3\n[fields]\ntarget_val_loss = [3.3]\n')
    proc = run_cli("sweep", str(spec), "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "4 cells (2 groups x 2 seeds)" in proc.stderr
    doc = _manifest(out)
    assert [c["status"] for c in doc["cells"]] == ["completed"] * 4
    assert all(c["attempts"] == 1 and c["run_id"] for c in doc["cells"])
    df = load_runs(out, sweep_id=doc["sweep_id"])
    assert len(df) == 4 and set(df["backend"]) == {"torch", "numpy"} and (df["status"] == "completed").all()
    csv = pd.read_csv(out / f"sweep-{doc['sweep_id']}.csv")
    assert list(csv.columns) == list(df.columns) and len(csv) == 4
    # identical weights and batches, dropout 0: the backends agree per seed
    for seed, g in df.groupby("seed"):
        assert g["final_val_loss"].max() - g["final_val_loss"].min() < 1e-4, seed
    # time to target from the record equals the sum of the step times before the evaluation that reached it
    for _, r in df.iterrows():
        rec = record_doc(out / "runs" / r["run_id"] / f"{r['backend']}.json")
        ttt = rec["time_to_target"]
        first = next(e for e in rec["evals"] if e["val_loss"] <= 3.3)
        assert ttt["reached"] and ttt["step"] == first["step"] == r["target_step"]
        assert ttt["train_s"] == pytest.approx(sum(t for s, t in zip(rec["steps"]["step"], rec["steps"]["time_s"])
                                                   if s < first["step"]))
    # the report's interval for torch's final val loss, recomputed from the CSV by hand
    torch = csv[csv["backend"] == "torch"]["final_val_loss"].to_numpy()
    half = T_TABLE[1] * torch.std(ddof=1) / math.sqrt(2)
    page = (out / f"sweep-{doc['sweep_id']}.html").read_text()
    shown = re.search(rf"{torch.mean():.4f} \[([0-9.]+), ([0-9.]+)\]", page)
    assert shown, "the torch group's final val loss interval is not in the report"
    assert float(shown.group(1)) == pytest.approx(torch.mean() - half, abs=2e-4)  # the table's t has 3 decimals
    assert float(shown.group(2)) == pytest.approx(torch.mean() + half, abs=2e-4)
    # speed: from the paired timing of each seed's block (torch and numpy alive at once), one verdict naming it.
    # Each entry ran once, in one session that ended by itself (never failed or interrupted): completed as soon as
    # it had its 3 undisturbed rounds, or incomplete (other load on the machine disturbs rounds) after all of its
    # 3 x 4 rounds, or before them where the rounds left could no longer give a verdict (`stopped` says so); the
    # entry says what its record says
    assert len(doc["paired"]) == 2 and sorted(e["seed"] for e in doc["paired"]) == sorted({c["seed"] for c in
                                                                                            doc["cells"]})
    for e in doc["paired"]:
        rec = json.loads((out / e["path"]).read_text())
        assert {c["run_id"] for c in rec["contenders"]} == {c["run_id"] for c in doc["cells"]
                                                            if c["seed"] == e["seed"]}
        (session,) = rec["sessions"]
        assert e["attempts"] == 1 and e["status"] == session["status"] == rec["status"], (e, session["status"])
        assert session["status"] == "completed" or (session["status"] == "incomplete" and (
            len(session["rounds"]) == 3 * 4 or "a verdict needs" in session.get("stopped", ""))), session
        assert all(set(r["bursts"]) == {"torch", "numpy"} for r in session["rounds"])
    assert "tiny-target_val_loss3.3 on cpu, dtypes torch float32, numpy float64: torch vs numpy" in page
    assert "faster than" in page
    assert "Convention: a difference is written first − second" in page
    index = (out / "index.html").read_text()
    assert f"sweep-{doc['sweep_id']}.html" in index and f"sweep {doc['sweep_id']}" in index
    assert not any(c["run_id"] in index for c in doc["cells"])  # one row for the sweep, none per cell
    status = run_cli("status", doc["sweep_id"], "--out", str(out))
    assert status.returncode == 0 and "4 completed" in status.stdout
    again = run_cli("resume", doc["sweep_id"], "--out", str(out), "--no-report")
    assert again.returncode == 0 and "0 of 4 cells to run" in again.stderr  # nothing runs twice
    report = run_cli("report", doc["sweep_id"], "--out", str(out))
    assert report.returncode == 0 and f"sweep-{doc['sweep_id']}.html" in report.stdout, report.stderr
    both = run_cli("report", doc["sweep_id"], doc["cells"][0]["run_id"], "--out", str(out))
    assert both.returncode == 2 and "its report stands alone" in both.stderr, both.stderr


def _wait_for(predicate, timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _record(out: Path, cell: dict) -> dict | None:
    if not cell.get("run_id"):
        return None
    path = out / "runs" / cell["run_id"] / f"{cell['backend']}.json"
    try:
        return record_doc(path)
    except (OSError, UsageError):
        return None


def test_ctrl_c_then_resume_continues_from_the_checkpoint(tmp_path: Path, tiny_config):
    """Ctrl-C mid-cell: that cell is interrupted, the next never starts; --resume finishes both, each once."""
    out = tmp_path / "out"
    env = dict(os.environ, HARNESS_DATA=str(data_path()), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "harness.cli", "sweep", "--configs", str(tiny_config(interval=1000)),
           "--backends", "numpy", "--seeds", "2", "--steps", "4000", "--checkpoint-every", "100", "--no-text",
           "--quiet", "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def checkpointed() -> bool:
            try:
                rec = _record(out, _manifest(out)["cells"][0])
            except (ValueError, OSError):
                return False
            return bool(rec and (rec.get("checkpoint") or {}).get("step", 0) >= 200)

        _wait_for(checkpointed, what="the first cell's checkpoint")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    doc = _manifest(out)
    first, second = doc["cells"]
    assert (first["status"], second["status"]) == ("interrupted", "pending"), err
    before = _record(out, first)
    assert before["status"] == "interrupted"
    ckpt = before["checkpoint"]["step"]
    assert 0 < ckpt < 4000
    res = run_cli("resume", doc["sweep_id"], "--out", str(out), "--no-report", "--quiet")
    assert res.returncode == 0, res.stderr
    assert "2 of 2 cells to run" in res.stderr
    doc = _manifest(out)
    assert [c["status"] for c in doc["cells"]] == ["completed", "completed"]
    assert [c["attempts"] for c in doc["cells"]] == [2, 1]
    after = _record(out, doc["cells"][0])
    assert after["resumed_at"] and len(after["steps"]["loss"]) == 4000
    # resumed from the checkpoint, not from step 0: the steps before it keep their first-attempt timings
    assert after["steps"]["time_s"][:ckpt] == before["steps"]["time_s"][:ckpt]
    assert after["steps"]["loss"][:ckpt] == before["steps"]["loss"][:ckpt]


# --- time to target and cost formulas ---------------------------------------------------------------------------------
def test_time_to_target_first_crossing_or_never():
    from harness.config.load import load_config
    from harness.core.costs import time_to_target
    from harness.report.tables import fmt_target
    from harness.store import Curves, Eval, RunRecord

    evals = [Eval(0, 4.1, 4.0, 0.5), Eval(2, 3.0, 2.9, 0.5), Eval(4, 2.6, 2.5, 0.5), Eval(6, 2.5, 2.4, 0.5)]
    steps, times = list(range(6)), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    hit = time_to_target(2.5, evals, steps, times)
    assert hit.to_dict() == {"target_val_loss": 2.5, "reached": True, "step": 4, "val_loss": 2.5, "train_s": 10.0,
                             "train_eval_s": 11.5}
    miss = time_to_target(2.0, evals, steps, times)
    assert miss.reached is False and miss.step is None and miss.train_s is None
    assert time_to_target(None, evals, steps, times) is None
    config = load_config("small")
    assert fmt_target(RunRecord(run_id="r", backend="numpy", config=config, time_to_target=hit)) == \
        "10 s (step 4; target 2.5)"
    assert fmt_target(RunRecord(run_id="r", backend="numpy", config=config, time_to_target=miss)) == \
        "not reached (target 2)"
    # a record without the field (its worker did not finish): computed from its curves and the config's target
    old = RunRecord(run_id="r", backend="numpy", config=config.replace(target_val_loss=2.5),
                    curves=Curves(step=steps, loss=[1.0] * 6, time_s=times, evals=evals))
    assert "step 4" in fmt_target(old)


def test_models_do_not_import_the_layers_above_them():
    """harness.models is the oracle: of the harness it may use only the shared facts below it (the config, the
    parameter shapes, the tap names) and itself; an allowlist, so a new module above it is refused too."""
    import ast

    allowed = ("harness.config.fields", "harness.core.weights", "harness.core.taps", "harness.models", "harness.errors")
    root = Path(__file__).resolve().parent.parent / "harness" / "models"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" if node.module == "harness" else node.module or ""
                         for a in node.names]
            else:
                continue
            for name in names:
                if name == "harness" or name.startswith("harness."):
                    assert name.startswith(allowed), (path.name, name)


def test_the_harness_has_no_import_circle():
    """Layers point one way: no chain of imports (lazy ones inside functions included) leads from a module of the
    harness back to itself. A package (report, sweep, kit, backends, models) counts as one unit, so a report module
    that reads sweep manifests and a sweep module that writes reports would be a circle too."""
    import ast

    root = Path(__file__).resolve().parent.parent / "harness"
    units = {p.stem for p in root.glob("*.py") if p.stem != "__init__"} | {
        p.parent.name for p in root.glob("*/__init__.py")}

    def unit(name: str) -> str | None:
        parts = name.split(".")
        return parts[1] if len(parts) > 1 and parts[0] == "harness" and parts[1] in units else None

    edges: dict[str, set[str]] = {u: set() for u in units}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).parts
        me = rel[0] if len(rel) > 1 else path.stem
        if me == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [f"{node.module}.{a.name}" if node.module == "harness" else node.module or ""
                         for a in node.names]
            else:
                continue
            edges[me] |= {u for u in map(unit, names) if u and u != me}
    assert edges["cli"] and edges["sweep"], "the import graph was not read"
    state: dict[str, int] = {}

    def visit(u: str, chain: list[str]) -> None:
        state[u] = 1
        for v in sorted(edges[u]):
            assert state.get(v) != 1, "import circle: " + " -> ".join([*chain[chain.index(v):], v])
            if v not in state:
                visit(v, [*chain, v])
        state[u] = 2

    for u in sorted(units):
        if u not in state:
            visit(u, [u])


def test_parallel_cells_are_marked_contended(tmp_path: Path, tiny_config):
    out = tmp_path / "out"
    proc = run_cli("sweep", "--configs", str(tiny_config()), "--backends", "numpy", "--seeds", "2", "--steps", "20",
                   "--jobs", "2", "--no-text", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "2 at a time on this machine (timings contended)" in proc.stderr
    doc = _manifest(out)
    assert [c["status"] for c in doc["cells"]] == ["completed"] * 2 and all(c["contended"] for c in doc["cells"])
    from harness.report.results import load_runs

    assert load_runs(out)["contended"].all()
    assert "timings are contended" in (out / f"sweep-{doc['sweep_id']}.html").read_text()


def test_scaling_fit_and_crossover_on_known_power_laws():
    """step time = c x^k exactly: the fit returns k, and the crossing of the two lines is where they are equal."""
    from harness.report.sweep import comparisons, scaling

    x = np.array([1e3, 1e4, 1e5, 1e6])
    rows = []
    for backend, c, k in (("torch", 1e-6, 0.5), ("numpy", 1e-8, 1.0)):
        for i, xi in enumerate(x):
            t = c * xi ** k
            rows.append({"status": "completed", "backend": backend, "device": "cpu", "label": f"s{i}", "seed": 1,
                         "flops_per_token": xi, "step_median_s": t, "tokens_per_s": 1000 / t,
                         "final_val_loss": 2.0, "contended": False})
    sc = scaling(pd.DataFrame(rows))
    assert sc["fits"]["torch (cpu)"]["step"][0] == pytest.approx(0.5)
    assert sc["fits"]["numpy (cpu)"]["rate"][0] == pytest.approx(-1.0)
    (line,) = sc["crossings"]
    assert "cross at 1e+04 FLOPs per token, inside" in line  # 1e-6 x^0.5 = 1e-8 x  <=>  x = 1e4
    assert "below it numpy (cpu) is faster, above it torch (cpu)" in line
    (small,) = [c for c in comparisons(pd.DataFrame(rows)) if c["label"] == "s0"]
    assert small["training"].estimate == pytest.approx(3.1622776601683795e-05 / 1e-5)  # torch/numpy step time at 1e3
    assert small["speed"] is None and small["level"] == "neutral"  # separate runs: information, never a verdict
    assert small["sentence"].startswith("s0 on cpu: speed not compared: no paired timing of torch and numpy")


def test_geometric_mean_interval_by_hand_and_never_below_zero():
    """Times are skewed: the log-scale interval of (1, 1, 10) ms stays positive, where the arithmetic one does not."""
    values = [1e-3, 1e-3, 10e-3]
    arith = stats.mean_ci(values)
    assert arith.lo < 0  # the reason for the log scale
    g = stats.geometric_mean_ci(values)
    logs = [math.log(v) for v in values]
    lm, ls = sum(logs) / 3, (sum((x - sum(logs) / 3) ** 2 for x in logs) / 2) ** 0.5
    assert g.estimate == pytest.approx(math.exp(lm))
    assert g.lo == pytest.approx(math.exp(lm - 4.303 * ls / math.sqrt(3)), rel=1e-3) and g.lo > 0
    assert g.hi == pytest.approx(math.exp(lm + 4.303 * ls / math.sqrt(3)), rel=1e-3)


def test_slurm_memory_request_is_whole_megabytes(tmp_path):
    """--mem-gb 1.5 reaches sbatch as --mem=1536M (sbatch refuses "--mem=1.5")."""
    from harness.sweep.slurm import SlurmExecutor

    assert SlurmExecutor(tmp_path, mem_gb=1.5).params["mem"] == "1536M"
    assert SlurmExecutor(tmp_path, mem_gb=2).params["mem"] == "2048M"
    assert "mem" not in SlurmExecutor(tmp_path).params
