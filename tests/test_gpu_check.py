"""tools/gpu_check.py, the one-command GPU check: its dry run on the CPU (what CI runs), and its judges."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check
spec.loader.exec_module(gpu_check)

FAKE_TRAIN = """import sys
for i in range(0, 4):
    print(f"iter {i}: loss {4.2 - i / 10:.4f}, time {100.0 if i == 0 else 10.0 + i:.2f}ms, mfu -100.00%")
sys.exit(int(any(a == "--compile=True" for a in sys.argv)))  # the compiled run fails: a failed check
"""


def fake_nanogpt(where: Path) -> Path:
    """A stand-in for a nanoGPT checkout: train.py prints nanoGPT's iteration lines, prepare.py needs input.txt."""
    (where / "config").mkdir(parents=True)
    (where / "config" / "train_shakespeare_char.py").write_text("")
    (where / "train.py").write_text(FAKE_TRAIN)
    data = where / "data" / "shakespeare_char"
    data.mkdir(parents=True)
    (data / "prepare.py").write_text("open('train.bin', 'wb').write(open('input.txt', 'rb').read()[:100])\n")
    return where


def corpus() -> str:
    data = os.environ.get("HARNESS_DATA")
    if not data or not Path(data).is_file():
        pytest.skip("needs HARNESS_DATA (Tiny Shakespeare): the recipe preset's vocabulary")
    return data


def test_the_dry_run_runs_every_step_on_the_cpu_and_writes_one_summary(tmp_path: Path) -> None:
    """`python tools/gpu_check.py --dry-run` (CI's line): doctor, bench, runs, parity, the paired run, the recipe in
    each mode with its profiler table, nanoGPT beside it, the long recipe (tiny), every CUDA-only mode refused in one
    line; all pass, summary.md and summary.json written, exit 0."""
    out = tmp_path / "out"
    rc = gpu_check.main(["--dry-run", "--out", str(out), "--data", corpus(),
                         "--nanogpt", str(fake_nanogpt(tmp_path / "nanoGPT"))])
    doc = json.loads((out / "summary.json").read_text())
    failed = [(c["name"], c["summary"]) for c in doc["checks"] if c["result"] != "PASS"]
    assert rc == 0 and not failed and doc["dry_run"] is True
    names = {c["name"] for c in doc["checks"]}
    assert {"doctor", "bench-fp32", "bench-cuda-graphs", "run-small-fp32", "run-small-cuda-graphs",
            "parity-small-float64-cpu-oracle", "paired-torch-numpy", "recipe-300-eager", "profile-eager",
            "nanogpt-compile-false", "recipe-5000"} <= names
    table = (out / "summary.md").read_text()
    assert "| bench-fp32 | PASS |" in table and "| recipe-5000 | PASS |" in table
    profile = (out / "checks" / "profile-eager" / "stdout.txt").read_text()
    assert "Self CPU" in profile and "profile: eager on cpu" in profile


def test_a_failed_check_fails_the_run(tmp_path: Path) -> None:
    """Any failed check makes the exit status 1 and reads FAIL in the table (here nanoGPT's compiled run fails)."""
    out = tmp_path / "out"
    args = ["--out", str(out), "--data", corpus(), "--nanogpt", str(fake_nanogpt(tmp_path / "nanoGPT")),
            "--only", "nanogpt"]
    assert gpu_check.main(args) == 1  # the GPU plan: compile False and True
    checks = {c["name"]: c for c in json.loads((out / "summary.json").read_text())["checks"]}
    assert checks["nanogpt-compile-false"]["result"] == "PASS"
    assert checks["nanogpt-compile-false"]["figures"]["ms_per_iter"] == 12.0  # iterations 1..3: 11, 12, 13 ms
    assert checks["nanogpt-compile-true"]["result"] == "FAIL"
    assert "| nanogpt-compile-true | FAIL |" in (out / "summary.md").read_text()


def _outcome(stdout: str = "", stderr: str = "", rc: int = 0, out: Path = Path("/nonexistent")):
    return gpu_check.Outcome(rc, 1.0, out, stdout, stderr)


def test_the_judges() -> None:
    """A paired run on a GPU must give a verdict; a CUDA-only mode on the CPU must be refused in one line."""
    check = gpu_check.Check("x", [], 1)
    line = "  paired timing: torch is 3.29x faster than numpy [3.1, 3.5] (0 undisturbed of 40 rounds; no verdict)"
    assert gpu_check.judge_paired(True)(check, _outcome(line))[0] is False  # and no records: fails anyway
    assert gpu_check.judge_refusal(check, _outcome(stderr="torch backend: --cuda-graphs needs --device cuda\n",
                                                   rc=2))[0]
    assert not gpu_check.judge_refusal(check, _outcome(stderr="Traceback\n  cuda error\n", rc=2))[0]
    assert not gpu_check.judge_refusal(check, _outcome(rc=0))[0]


def test_a_missing_corpus_or_nanogpt_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert gpu_check.main(["--dry-run", "--data", str(tmp_path / "none.txt"), "--out", str(tmp_path / "o")]) == 2
    assert gpu_check.main(["--dry-run", "--data", __file__, "--nanogpt", str(tmp_path), "--out",
                           str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "HARNESS_DATA" in err[0] and "train.py" in err[1] and not (tmp_path / "o").exists()


def test_every_command_of_the_gpu_plan_parses(tmp_path: Path) -> None:
    """The GPU plan cannot run here, but its command lines can be checked: each harness command parses with the
    harness's own parser (a misspelt option would otherwise first fail on the GPU machine), and the plan covers
    every preset in every mode, parity on both oracles, the paired verdict, nanoGPT both ways and the long recipe."""
    from harness.cli.main import build_parser

    args = SimpleNamespace(dry_run=False, nanogpt=tmp_path, data=tmp_path / "d.txt", recipe_mode="--cuda-graphs",
                           recipe_margin=0.03)
    checks = gpu_check.plan(args)
    parser = build_parser()
    for check in checks:
        if check.argv[1:3] == ["-m", "harness"]:
            parsed = parser.parse_args([*check.argv[3:], *([] if check.argv[3] == "doctor" else ["--out", "o"])])
            assert callable(parsed.func), check.name
    names = [c.name for c in checks]
    for mode in ("fp32", "bf16", "cuda-graphs", "reduce-overhead"):
        assert f"bench-{mode}" in names
    for size in ("small", "medium", "large"):
        assert {f"run-{size}-fp32", f"run-{size}-cuda-graphs"} <= set(names)
    assert {"parity-small-float64-cpu-oracle", "parity-large-float32-cupy", "paired-torch-numpy",
            "nanogpt-compile-false", "nanogpt-compile-true", "profile-cuda-graphs", "recipe-5000"} <= set(names)
    bench = next(c for c in checks if c.name == "bench-fp32").argv
    assert "--check" in bench and "cuda" in bench and "small,medium,large" in bench
    assert next(c for c in checks if c.name == "recipe-5000").argv[-4:-3] == ["--cuda-graphs"]
    paired = next(c for c in checks if c.name == "paired-torch-numpy")
    assert paired.judge(paired, _outcome(stderr="paired timing: torch is 3x faster [2.9, 3.1]\n"))[1].startswith(
        "paired timing")
