"""tools/gpu_check.py, the budgeted, resumable GPU check: its dry run on the CPU (what CI runs: killed midway, then
continued within a budget and to the end, from the checkout and from another directory), its plan for a lent H100,
its judges, nanoGPT's data written without prepare.py, and its refusals of bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import data_path
from gpucheck import cli, judges, nanogpt, plan, runner, summary

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

# nanoGPT's train.py as far as the check needs it: it reads its data as nanoGPT does (np.memmap of uint16 ids,
# meta.pkl's vocab_size), prints nanoGPT's evaluation and iteration lines, saves a checkpoint, and fails compiled
FAKE_TRAIN = """import os, pickle, sys
import numpy as np
data_dir = os.path.join("data", "shakespeare_char")
meta = pickle.load(open(os.path.join(data_dir, "meta.pkl"), "rb"))
for split in ("train", "val"):
    ids = np.memmap(os.path.join(data_dir, split + ".bin"), dtype=np.uint16, mode="r")
    assert len(ids) > 100 and int(ids.max()) < meta["vocab_size"], split
for i in range(4):
    if i % 3 == 0:
        print(f"step {i}: train loss {4.2 - i / 10:.4f}, val loss {4.3 - i / 10:.4f}")
    print(f"iter {i}: loss {4.2 - i / 10:.4f}, time {100.0 if i == 0 else 10.0 + i:.2f}ms, mfu -100.00%")
os.makedirs("nanogpt-out", exist_ok=True)
open(os.path.join("nanogpt-out", "ckpt.pt"), "wb").write(b"a checkpoint")
sys.exit(int("--compile=True" in sys.argv))
"""


def nanogpt_layout(where: Path) -> Path:
    """A nanoGPT checkout's layout: what train.py runs, and a prepare.py that must never run (it would download
    with `requests`)."""
    for name in nanogpt.FILES:
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text("")
    (where / "train.py").write_text(FAKE_TRAIN)
    prep = where / "data" / "shakespeare_char" / "prepare.py"
    prep.parent.mkdir(parents=True)
    prep.write_text("raise SystemExit('prepare.py ran: it downloads with requests')\n")
    return where


def tool(*args: str, cwd: Path, **popen: object) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, str(TOOL), "--dry-run", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def processes_under(path: Path) -> list[int]:
    """Processes whose working directory is inside `path` (a check's children)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(Path(os.readlink(entry / "cwd"))).startswith(str(path)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def dry(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One dry run in three calls, as a person holding a GPU would make them: (1) from another directory with a
    relative --out, SIGKILLed once its second check has finished; (2) from the checkout, within a budget too small
    for the rest; (3) again from the other directory, to the end."""
    base = tmp_path_factory.mktemp("gpu-check")
    elsewhere, checkout = base / "elsewhere", nanogpt_layout(base / "nanoGPT")
    elsewhere.mkdir()
    out = elsewhere / "gpu-check"
    common = ["--nanogpt", str(checkout), "--data", str(data_path())]
    first = tool("--out", "gpu-check", *common, cwd=elsewhere)
    seen = []
    for line in first.stderr:
        seen.append(line)
        if sum(": PASS in " in ln for ln in seen) == 2:
            first.kill()
            break
    first.wait()
    after_kill = json.loads((out / "summary.json").read_text())
    deadline = time.time() + 5  # shorter than the checks running at the kill: they end by the parent-death signal
    while processes_under(out) and time.time() < deadline:
        time.sleep(0.2)
    orphans = processes_under(out)
    # every check estimated at 30 s (as a slower machine's summary would say): a budget of 40 s then starts one or
    # two of the checks left, however fast this machine is, and passes over the rest
    slow = base / "slow-estimates.json"
    slow.write_text(json.dumps({**after_kill, "checks": [{"name": r["name"], "result": "PASS", "wall_s": 30.0}
                                           for r in after_kill["checks"]]}))
    second = tool("--out", str(out), "--budget", "40", "--estimates", str(slow), *common, cwd=ROOT)
    _, err2 = second.communicate(timeout=600)
    after_budget = json.loads((out / "summary.json").read_text())
    third = tool("--out", "gpu-check", *common, cwd=elsewhere)
    _, err3 = third.communicate(timeout=600)
    return SimpleNamespace(out=out, elsewhere=elsewhere, killed=after_kill, budget=after_budget, rc2=second.returncode,
                           err2=err2, final=json.loads((out / "summary.json").read_text()), rc3=third.returncode,
                           err3=err3, orphans=orphans, first_err="".join(seen))


def results(doc: dict) -> dict[str, dict]:
    return {r["name"]: r for r in doc["checks"]}


def killed_run_left_a_summary(dry: SimpleNamespace) -> None:
    """SIGKILL midway: summary.json (written after every check) has the preflight and the two checks that
    finished; the check that was running is "not run" and its processes died with the tool."""
    rows = results(dry.killed)
    passed = [n for n, r in rows.items() if r["result"] == "PASS"]
    assert len(passed) >= 3 and "preflight" in passed, (passed, dry.first_err)
    assert all(r["result"] in ("PASS", "not run") for r in rows.values())
    assert not dry.orphans, f"processes left running after the kill: {dry.orphans}"


def budget_left_the_rest_and_a_rerun_completed_only_the_rest(dry: SimpleNamespace) -> None:
    """The second call (from the checkout) keeps the first call's results, runs what fits 40 s and lists the rest
    as "not run: budget" (the estimates it is given leave room for one or two); the third runs only what is left,
    and the dry run passes end to end."""
    killed, budget, final = results(dry.killed), results(dry.budget), results(dry.final)
    assert dry.rc2 == 0 and dry.rc3 == 0, dry.err2 + dry.err3
    for name, r in killed.items():
        if r["result"] == "PASS" and name != "preflight":
            assert budget[name] == r and final[name] == r  # kept, not run again
    by_budget = [n for n, r in budget.items() if r["result"] == "not run" and r["summary"].startswith("budget:")]
    ran = [n for n, r in budget.items() if r["call"] == 2 and r["result"] == "PASS" and n != "preflight"]
    assert by_budget and ran, dry.err2
    assert "not run: budget" in dry.err2
    assert all(final[n]["call"] == 2 for n in ran) and all(final[n]["call"] == 3 for n in by_budget)
    assert all(r["result"] == "PASS" for r in final.values()), [(n, r["summary"]) for n, r in final.items()
                                                                 if r["result"] != "PASS"]
    assert dry.final["complete"] and [c["call"] for c in dry.final["calls"]] == [1, 2, 3]
    assert "budget 40 s" in (dry.out / "summary.md").read_text()


def every_tier_ran_and_nothing_was_written_outside_out(dry: SimpleNamespace) -> None:
    """Every tier's checks ran on the CPU (the CUDA-only modes refused in one line), nanoGPT's data written from the
    harness's data file (its prepare.py never ran), its checkpoints deleted, and with a relative --out given in
    another directory everything is under that directory's --out: nothing in the checkout."""
    final = results(dry.final)
    assert {"preflight", "paired-torch-numpy", "sweep-3-seeds", "bench-fp32", "bench-cuda-graphs", "run-small-fp32",
            "run-small-cuda-graphs", "recipe-5000", "nanogpt-5000", "recipe-300-eager", "profile-eager",
            "nanogpt-300-compile-false", "doctor", "parity-small-float64-cpu-oracle"} <= set(final)
    assert {r["tier"] for r in final.values()} == {1, 2, 3, 4, 5, 6, 7}
    runs = final["recipe-5000"]["figures"]["runs"]  # the judges read the records through the store
    assert runs and all(isinstance(r["best_val_loss"], float) and r["best_step"] is not None for r in runs), runs
    sizes = final["bench-fp32"]["figures"]["results"]
    assert sizes and all(isinstance(r["overhead_pct"], float) for r in sizes), sizes
    assert final["nanogpt-5000"]["figures"]["ms_per_iter"] == 12.0  # iterations 1..3: 11, 12, 13 ms
    work = dry.out / "checks" / "nanogpt-5000" / "nanoGPT"
    meta = pickle.loads((work / "data" / "shakespeare_char" / "meta.pkl").read_bytes())
    assert meta["vocab_size"] == len(set(data_path().read_text(encoding="utf-8")))
    assert not (work / "data" / "shakespeare_char" / "prepare.py").exists()
    assert not (work / "nanogpt-out" / "ckpt.pt").exists()
    assert "Self CPU" in (dry.out / "checks" / "profile-eager" / "stdout.txt").read_text()
    assert [p.name for p in dry.elsewhere.iterdir()] == ["gpu-check"] and not (ROOT / "gpu-check").exists()
    assert final["paired-torch-numpy"]["summary"].startswith("paired timing:")
    assert list((dry.out / "checks" / "run-small-fp32").glob("runs/*/torch.json"))


def test_the_dry_run_killed_then_continued_within_a_budget_then_to_the_end(dry: SimpleNamespace) -> None:
    """CI's dry run (one run in three calls, one test: xdist would make a module fixture once per worker)."""
    killed_run_left_a_summary(dry)
    budget_left_the_rest_and_a_rerun_completed_only_the_rest(dry)
    every_tier_ran_and_nothing_was_written_outside_out(dry)


# ------------------------------------------------------------------------------------------ without processes


@pytest.mark.parametrize("attack", ["dev-null", "file", "only-nothing", "negative-jobs", "zero-budget", "bad-mode",
                                    "bad-estimates", "damaged-summary"])
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tmp_path: Path, attack: str,
                                                               capsys: pytest.CaptureFixture) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    out = tmp_path / "out"
    args = {"dev-null": ["--out", "/dev/null"], "file": ["--out", str(a_file)],
            "only-nothing": ["--out", str(out), "--only", "no-such-check"],
            "negative-jobs": ["--out", str(out), "--jobs", "-3"], "zero-budget": ["--out", str(out), "--budget", "0"],
            "bad-mode": ["--out", str(out), "--recipe-mode", "--warp-speed"],
            "bad-estimates": ["--out", str(out), "--estimates", str(a_file)],
            "damaged-summary": ["--out", str(a_file.parent)]}[attack]
    if attack == "damaged-summary":
        (tmp_path / "summary.json").write_text("{not json")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--dry-run", "--data", str(data_path()), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("gpu_check: "), err
    assert "Traceback" not in err[0] and sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_missing_corpus_or_nanogpt_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for args, word in ((["--data", str(tmp_path / "none.txt")], "HARNESS_DATA"),
                       (["--data", __file__, "--nanogpt", str(tmp_path)], "train.py")):
        with pytest.raises(SystemExit) as exc:
            gpu_check.main(["--dry-run", *args, "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and word in err[0]
    assert not (tmp_path / "o").exists()


def test_the_plan_for_two_calls_of_420_s_holds_tiers_1_to_4_first_and_1_to_6_in_two(
        capsys: pytest.CaptureFixture) -> None:
    """`--plan --budget 420` on this CPU: the GPU plan by the H100 estimates; the first call holds every check of
    tiers 1-4, two calls hold tiers 1-6; nothing runs, nothing is written."""
    assert gpu_check.main(["--plan", "--budget", "420", "--out", "/nonexistent/gpu-check"]) == 0
    text = capsys.readouterr().out
    checks = plan.plan(SimpleNamespace(dry_run=False, recipe_mode="eager", recipe_target=1.48))
    printed = {m[1]: int(m[2]) for m in re.finditer(r"^  (\S+) +\d+ s +call (\d+)", text, re.M)}  # as a user reads it
    assert set(printed) == {c.name for c in checks}, text
    assert all(printed[c.name] == 1 for c in checks if c.tier <= 4), text
    assert all(printed[c.name] in (1, 2) for c in checks if c.tier <= 6), text
    calls = {int(m[1]): int(m[2]) for m in re.finditer(r"^call (\d+): about (\d+) s", text, re.M)}
    assert calls and max(calls.values()) <= 420 and "tiers 1, 2, 3, 4, 5" in text, text


def test_only_takes_exact_names_and_prefixes_and_the_recipe_mode_either_spelling() -> None:
    checks = plan.plan(SimpleNamespace(dry_run=False, recipe_mode="eager", recipe_target=1.48))
    chosen, unmatched = plan.select(checks, "recipe-5000")
    assert [c.name for c in chosen] == ["preflight", "recipe-5000"] and not unmatched
    chosen, _ = plan.select(checks, "recipe-300,bench-fp32")
    assert {c.name for c in chosen} == {"preflight", "bench-fp32", "recipe-300-eager", "recipe-300-compile",
                                        "recipe-300-cuda-graphs", "recipe-300-reduce-overhead"}
    assert plan.select(checks, "nothing")[1] == ["nothing"]
    for spelling in (["--recipe-mode", "--cuda-graphs"], ["--recipe-mode=--cuda-graphs"],
                     ["--recipe-mode", "cuda-graphs"]):
        args = cli.build_parser().parse_args(cli.join_mode(spelling))
        assert plan.normalise_mode(args.recipe_mode) == "cuda-graphs"
    assert plan.normalise_mode("--compile reduce-overhead") == "reduce-overhead"
    long = next(c for c in plan.plan(SimpleNamespace(dry_run=False, recipe_mode="cuda-graphs", recipe_target=1.48))
                if c.name == "recipe-5000")
    assert long.argv[-4:] == ["--cuda-graphs", "--no-text", "--no-report", "--quiet"] and "bf16" in long.argv


def test_every_command_of_the_gpu_plan_parses(tmp_path: Path) -> None:
    """The GPU plan cannot run here, but its command lines can be checked with the harness's own parser (a misspelt
    option would otherwise first fail on the GPU machine)."""
    from harness.cli.main import build_parser

    checks = plan.plan(SimpleNamespace(dry_run=False, nanogpt=tmp_path, data=tmp_path / "d.txt",
                                       recipe_mode="eager", recipe_target=1.48))
    parser = build_parser()
    for check in checks:
        if check.argv[1:3] == ["-m", "harness"]:
            parsed = parser.parse_args([*check.argv[3:], *([] if check.argv[3] == "doctor" else ["--out", "o"])])
            assert callable(parsed.func), check.name
    names = [c.name for c in checks]
    assert len(names) == len(set(names))
    for mode in ("fp32", "bf16", "cuda-graphs", "reduce-overhead"):
        assert f"bench-{mode}" in names
    for size in ("small", "medium", "large"):
        assert {f"run-{size}-fp32", f"run-{size}-cuda-graphs"} <= set(names)
    bench = next(c for c in checks if c.name == "bench-fp32").argv
    assert "--check" in bench and "cuda" in bench and "small,medium,large" in bench
    sweep = next(c for c in checks if c.name == "sweep-3-seeds")
    assert sweep.needs == {"harness", "cuda", "cupy"} and "--seeds" in sweep.argv
    assert next(c for c in checks if c.name == "nanogpt-5000").needs == {"cuda", "nanogpt"}


def _outcome(stdout: str = "", stderr: str = "", rc: int = 0, out: Path = Path("/nonexistent")):
    return judges.Outcome(rc, 1.0, out, stdout, stderr)


def test_the_judges_say_what_they_looked_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A paired run on a GPU needs a usable, conclusive verdict; a sweep a green one; the recipe its target; the
    captured small step 4x the eager one; a judge that finds nothing names what and where."""
    assert judges.run(None, _outcome(rc=0, out=tmp_path))[1].startswith(f"no run record under {tmp_path / 'runs'}")
    line = "paired timing: torch is 3.29× faster than numpy [3.1, 3.5] (0 undisturbed of 40 rounds; mostly " \
           "disturbed: no verdict)"
    monkeypatch.setattr(judges, "run", lambda c, o: (True, "torch: completed", {"runs": [{}]}))
    assert judges.paired(True)(None, _outcome(stderr=line))[0] is False
    assert judges.paired(True)(None, _outcome(stderr=line.replace("0 undisturbed", "40 undisturbed")
                                              .replace("; mostly disturbed: no verdict", "")))[0] is True
    assert judges.paired(True)(None, _outcome(stderr="paired timing: numpy is 1.01× faster than torch [0.98, 1.05] "
                                                     "(10 undisturbed of 10 rounds)"))[0] is False
    (tmp_path / "sweeps" / "s1").mkdir(parents=True)
    (tmp_path / "sweeps" / "s1" / "sweep.json").write_text("{}")
    levels = {"cells": 6, "completed": 6, "comparisons": [{"name": "medium on cuda, torch vs numpy",
                                                           "level": "neutral", "label": "speed: torch 3× faster"}]}
    monkeypatch.setattr(judges, "sweep_levels", lambda out, sid: levels)
    assert judges.sweep(True)(None, _outcome(out=tmp_path))[0] is False
    levels["comparisons"][0]["level"] = "ok"
    assert judges.sweep(True)(None, _outcome(out=tmp_path))[0] is True
    monkeypatch.setattr(judges, "run", lambda c, o: (True, "", {"runs": [{"best_val_loss": 1.49, "best_step": 1750}]}))
    assert judges.recipe(1.48)(None, _outcome())[0] is False and judges.recipe(1.5)(None, _outcome())[0] is True
    bench = {"bench-fp32": {"figures": {"results": [{"size": "small", "runner_ms": 2.6}]}},
             "bench-cuda-graphs": {"figures": {"results": [{"size": "small", "runner_ms": 0.5}]}}}
    assert judges.speedup(4.0, "a", "b")(bench)[0] is True
    bench["bench-cuda-graphs"]["figures"]["results"][0]["runner_ms"] = 0.9
    assert judges.speedup(4.0, "a", "b")(bench)[0] is False
    assert judges.refusal(None, _outcome(stderr="torch backend: --cuda-graphs needs --device cuda\n", rc=2))[0]
    assert not judges.refusal(None, _outcome(stderr="Traceback\n  cuda error\n", rc=2))[0]


def test_nanogpt_data_is_written_as_its_prepare_py_writes_it(tmp_path: Path) -> None:
    """The vocabulary is the sorted set of the characters, ids uint16, the first 90 % of the characters train.bin
    and the rest val.bin, meta.pkl {vocab_size, itos, stoi}: decoding the two files gives the text back."""
    text = data_path().read_text(encoding="utf-8")
    meta = nanogpt.prepare_shakespeare_char(text, tmp_path)
    train = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "val.bin", dtype=np.uint16)
    assert len(train) == int(len(text) * 0.9) and len(train) + len(val) == len(text)
    assert (tmp_path / "train.bin").stat().st_size == 2 * len(train)
    stored = pickle.loads((tmp_path / "meta.pkl").read_bytes())
    assert stored == meta and set(stored) == {"vocab_size", "itos", "stoi"}
    assert [stored["itos"][i] for i in range(stored["vocab_size"])] == sorted(set(text))
    assert "".join(stored["itos"][int(i)] for i in np.concatenate([train, val])) == text


def test_a_failed_check_says_why_and_a_stop_leaves_a_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    """A failed check's last lines go to the console and the summary; SIGTERM ends the running check's process
    group and the summary records it as stopped (exit 143)."""
    fails = plan.Check("fails", 7, [sys.executable, "-c", "import sys; print('half'); sys.exit('boom: the reason')"],
                       1.0, 60, judges.exit_status)
    sleeps = plan.Check("sleeps", 7, [sys.executable, "-c", "import time; time.sleep(60)"], 1.0, 60,
                        judges.exit_status)
    pre = plan.Check("preflight", 1, [], 1.0, 60)
    monkeypatch.setattr(runner.pre, "preflight", lambda args, checks: (True, "ok", {"missing": [], "parts": {}}, []))
    args = SimpleNamespace(out=tmp_path, dry_run=True, budget=None, argv=[], data=data_path(), jobs=1,
                           skip_long=False)
    checks = [pre, fails, sleeps]
    signal.setitimer(signal.ITIMER_REAL, 0)
    old = signal.signal(signal.SIGALRM, lambda *a: os.kill(os.getpid(), signal.SIGTERM))
    try:
        signal.setitimer(signal.ITIMER_REAL, 3.0)
        rc = runner.run_all(args, checks, checks, set())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    doc = summary.load(tmp_path, True)
    rows = results(doc)
    assert rc == 143 and doc["calls"][0]["stopped"] == "SIGTERM"
    assert rows["fails"]["result"] == "FAIL" and "boom: the reason" in rows["fails"]["tail"]
    assert rows["sleeps"]["result"] == "not run" and rows["sleeps"]["summary"].startswith("stopped by SIGTERM")
    assert "| boom: the reason" in capsys.readouterr().err
    assert "boom: the reason" in (tmp_path / "summary.md").read_text()
    assert not processes_under(tmp_path / "checks")


def test_a_check_still_running_at_the_end_of_the_budget_is_stopped_and_left_for_the_next_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A check whose estimate fit but which runs past the budget is stopped with its process group at the budget's
    end and recorded "not run" (it runs again in the next call), not as a failure; its time is kept as a lower bound
    for the next plan."""
    slow = plan.Check("slow", 2, [sys.executable, "-c", "import time; time.sleep(60)"], 1.0, 60, judges.exit_status)
    pre = plan.Check("preflight", 1, [], 1.0, 60)
    monkeypatch.setattr(runner.pre, "preflight", lambda args, checks: (True, "ok", {"missing": [], "parts": {}}, []))
    args = SimpleNamespace(out=tmp_path, dry_run=True, budget=5.0, argv=[], data=data_path(), jobs=1, skip_long=False)
    assert runner.run_all(args, [pre, slow], [pre, slow], set()) == 0
    row = results(summary.load(tmp_path, True))["slow"]
    assert row["result"] == "not run" and row["stopped"] and "end of the budget" in row["summary"]
    assert row["wall_s"] < 60  # stopped, not waited for (its child sleeps 60 s)
    assert summary.measured_times(summary.load(tmp_path, True))["slow"] >= row["wall_s"] > 0.5


def tiny_wheel(where: Path) -> Path:
    """A wheel of one module, made here (the test runs offline)."""
    import zipfile

    files = {"gcprobe/__init__.py": "VALUE = 42\n",
             "gcprobe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: gcprobe\nVersion: 1.0\n",
             "gcprobe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                             "Tag: py3-none-any\n"}
    where.mkdir()
    path = where / "gcprobe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        record = "gcprobe-1.0.dist-info/RECORD"
        z.writestr(record, "".join(f"{n},,\n" for n in [*files, record]))
    return path


def test_the_carried_folder_is_prepared_installed_and_used_by_the_check(tmp_path: Path) -> None:
    """tools/gpu_carry.py: `prepare` downloads the wheels with pip (here from a local folder: offline) and copies the
    data file and nanoGPT's files (no .git); `check` installs them with `pip install --no-index --no-deps --target`
    and runs gpu_check.py with them on PYTHONPATH, the data and the checkout from the folder (here its --plan)."""
    carry, wheels = tmp_path / "carry", tiny_wheel(tmp_path / "wheels").parent
    layout = nanogpt_layout(tmp_path / "nanoGPT")
    (layout / ".git").mkdir()
    tool = [sys.executable, str(ROOT / "tools" / "gpu_carry.py"), "--dest", str(carry)]
    done = subprocess.run([*tool, "prepare", "--package", "gcprobe==1.0", "--find-links", str(wheels), "--data",
                           str(data_path()), "--nanogpt", str(layout)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in (carry / "wheels").iterdir()] == ["gcprobe-1.0-py3-none-any.whl"]
    assert (carry / "data" / "tinyshakespeare.txt").read_bytes() == data_path().read_bytes()
    assert (carry / "nanoGPT" / "train.py").is_file() and not (carry / "nanoGPT" / ".git").exists()
    done = subprocess.run([*tool, "check", "--plan", "--budget", "420"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0 and "tier 6" in done.stdout, done.stderr
    probe = subprocess.run([sys.executable, "-c", "import gcprobe; print(gcprobe.VALUE)"], capture_output=True,
                           text=True, env=dict(os.environ, PYTHONPATH=str(carry / "site")))
    assert probe.stdout.strip() == "42"


def test_the_preflight_on_a_gpu_machine_names_each_missing_part_and_what_it_skips(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU paths of the preflight, with a stand-in nvidia-smi (CUDA 13.0) and probe: CUDA torch found; CuPy for
    CUDA 12 not ready on it (its line names the fix for CUDA 13 and the checks it skips); no JAX plugin; the
    preflight passes (optional parts) and fails only when CUDA itself is missing."""
    from gpucheck import preflight

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\nif [ -n "$1" ]; then echo "NVIDIA H100 80GB HBM3, 580.159.04"; else '
                   'echo "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0 |"; fi\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    found = {"missing": {}, "optional_missing": {}, "nvml": {"driver": "580.159.04", "gpus": 1},
             "torch": {"version": "2.11.0+cu130", "cuda": "13.0", "available": True, "device": "NVIDIA H100"}}
    monkeypatch.setattr(preflight, "probe", lambda: dict(found))
    monkeypatch.setattr(preflight, "_version", lambda d: "13.6.0" if d == "cupy-cuda12x" else None)
    from harness.backends import jax_backend, numpy_backend
    from harness.backends.base import BackendUnavailable

    def not_ready(timeout_s: float) -> None:
        raise BackendUnavailable("numpy backend: CuPy cannot run a kernel: libnvrtc.so.12 not found")

    monkeypatch.setattr(numpy_backend, "cupy_ready_in_child", not_ready)
    monkeypatch.setattr(jax_backend, "installed", lambda module: module == "jax")
    checks = plan.plan(SimpleNamespace(dry_run=False, recipe_mode="eager", recipe_target=1.48))
    args = SimpleNamespace(nanogpt=None, data=data_path())
    ok, text, figs, lines = preflight.preflight(args, checks[1:])
    assert text.startswith("missing ")
    cupy = next(ln for ln in lines if "CuPy" in ln)
    assert ok and "CUDA 13.0" in figs["environment"] + figs["parts"]["cuda"]["status"]
    assert cupy.lstrip().startswith("MISSING") and "cupy-cuda12x 13.6.0 not ready on CUDA 13.0" in cupy
    assert "skips paired-torch-numpy, sweep-3-seeds" in cupy and "cupy-cuda13x" in cupy
    assert {"cupy", "jax-cuda", "nanogpt"} <= set(figs["missing"]) and "cuda" not in figs["missing"]
    jax_line = next(ln for ln in lines if "JAX" in ln)
    assert "skips paired-torch-jax" in jax_line and "runs parts-small without jax" in jax_line
    found["torch"] = {"version": "2.13.0+cpu", "cuda": None, "available": False}
    ok, _, figs, lines = preflight.preflight(args, checks[1:])
    assert not ok and "CPU build" in figs["parts"]["cuda"]["status"]


def test_the_parts_check_leaves_jax_out_where_the_preflight_finds_no_plugin() -> None:
    """bench parts (tier 7) runs torch,jax,numpy on the GPU; without JAX's CUDA plugin it runs torch,numpy and its
    row says why jax was left out; without CuPy (the oracle on the GPU) it is skipped."""
    checks = plan.plan(SimpleNamespace(dry_run=False, recipe_mode="eager", recipe_target=1.48))
    parts = next(c for c in checks if c.name == "parts-small")
    assert parts.tier == 7 and parts.needs == {"harness", "cuda", "cupy", "jax-cuda"} and parts.estimate_s == 100
    assert parts.argv[parts.argv.index("--backend") + 1] == "torch,jax,numpy" and "--rounds" in parts.argv
    rows: dict[str, tuple] = {}
    status = {"jax-cuda": {"status": "jax is not installed"}, "cupy": {"status": "not ready"}}
    session = SimpleNamespace(rows={"preflight": {"figures": {"parts": status}}, "parts-small": {"result": "not run"}},
                              args=SimpleNamespace(skip_long=False),
                              set=lambda c, result, text, **kw: rows.__setitem__(c.name, (result, text)))
    (narrowed,) = runner.todo(session, [checks[0], parts], set(), {"jax-cuda"})
    assert narrowed.argv[narrowed.argv.index("--backend") + 1] == "torch,numpy" and narrowed.needs == parts.needs - {
        "jax-cuda"}
    assert narrowed.left_out == "jax left out: needs jax-cuda (jax is not installed)" and not rows
    assert runner.todo(session, [checks[0], parts], set(), {"jax-cuda", "cupy"}) == []
    assert rows["parts-small"][0] == "skipped" and "cupy" in rows["parts-small"][1]


def test_the_parts_judge_reads_the_record_and_its_page(tmp_path: Path, corpus) -> None:
    """The parts check passes on a completed record whose page `harness report ID` rebuilds, every item covered,
    finite steps, torch on CUDA events with kernels counted for every part; each of those missing fails, named."""
    from harness.bench import parts as bench_parts
    from harness.config.load import load_config
    from harness.core.parts import STEP
    from harness.store.parts import PartsBurst, PartsReady, PartsRound, record_path

    config = load_config("small").replace(n_layer=1)
    contenders = [{"name": n, "backend": n, "device": "cuda", "options": {}} for n in ("torch", "numpy")]
    record, _ = bench_parts.new_record(config, corpus, contenders, ["emb", "h.0.mlp.fc"], 2, 1, {})
    quiet = {"step": 0, "n": 1, "wall_s": 0.2, "cpu_s": 0.2, "exec_s": 0.2, "wait_s": 0.0}
    for k in range(3):
        times = {key: 1e-3 * (1 + 0.01 * k) for key in record.items if key != STEP}
        times[STEP] = sum(times.values())
        record.rounds.append(PartsRound(order=["torch", "numpy"], bursts={
            n: PartsBurst(times=dict(times), chunk=quiet) for n in ("torch", "numpy")}))
    for c in record.contenders:
        c.ready = PartsReady(calls={k: 1 for k in record.items}, passes=3, clock="CUDA events around each item's "
                             "calls" if c.backend == "torch" else "host clock", compile_s=None, launches={
                                 k: {"kernels": 2, "kernel_us": 5.0} for k in record.items} if c.backend == "torch"
                             else {})
    record.status = "completed"
    record.dump(record_path(tmp_path, record.id))
    ok, text, facts = judges.parts(None, _outcome(out=tmp_path))  # through the child, as on the GPU machine
    assert ok, text
    assert text.startswith("torch step ") and (tmp_path / "bench" / f"{record.id}.html").is_file()
    for change, words in ((lambda f: f["contenders"][0].update(fewest_kernels=0), "torch: a part launches 0"),
                          (lambda f: f["contenders"][0].update(clock="host clock"), "not CUDA events"),
                          (lambda f: f["contenders"][1].update(step_ms=float("nan")), "numpy's step median"),
                          (lambda f: f["contenders"][1].update(covers=False), "numpy's calls or bursts miss"),
                          (lambda f: f.update(status="incomplete"), "record incomplete"),
                          (lambda f: f.update(report_rc=2), "harness report exit status 2")):
        bad = json.loads(json.dumps(facts))
        change(bad)
        ok, text, _ = judges.parts_verdict(0, bad)
        assert not ok and words in text, text
    assert not judges.parts_verdict(1, facts)[0]
    assert judges.parts(None, _outcome(out=tmp_path / "none"))[1].startswith("no parts record under")
