"""Every bad input: one line on stderr naming the problem, exit status 2, no traceback, nothing written."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_TOML, data_path, run_cli

GOOD = TINY_TOML.format(dropout=0.0, lr=0.01, clip=1.0, interval=10)


def toml_with(**replace: str) -> str:
    text = GOOD
    for old, new in replace.items():
        text = text.replace(old, new)
    return text


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*")] if path.exists() else []


CASES = {
    # name: (setup(tmp) -> extra args, expected fragment of the message)
    "unknown size": (lambda t: ["--size", "huge"], "huge"),
    "unknown backend": (lambda t: ["--backend", "mxnet"], "unknown backend 'mxnet'"),
    "malformed toml": (lambda t: ["--config", write(t, "c.toml", "[model\nn_embd=")], "not valid TOML"),
    "incomplete toml": (lambda t: ["--config", write(t, "c.toml", toml_with(**{"n_head = 2\n": ""}))],
                        "missing n_head"),
    "heads do not divide": (lambda t: ["--config", write(t, "c.toml", toml_with(**{"n_head = 2": "n_head = 3"}))],
                            "does not divide"),
    "zero layers": (lambda t: ["--config", write(t, "c.toml", toml_with(**{"n_layer = 1": "n_layer = 0"}))],
                    "n_layer must be a positive integer"),
    "negative lr": (lambda t: ["--config", write(t, "c.toml", toml_with(**{"learning_rate = 0.01":
                                                                          "learning_rate = -1"}))],
                    "learning_rate must be positive"),
    "dropout 1": (lambda t: ["--dropout", "1.0"], "dropout must be in [0, 1)"),
    "missing config": (lambda t: ["--config", str(t / "nope.toml")], "does not exist"),
    "data missing": (lambda t: ["--data", str(t / "nope.txt")], "does not exist"),
    "data empty": (lambda t: ["--data", write(t, "e.txt", "")], "is empty"),
    "data not utf8": (lambda t: ["--data", write(t, "l.txt", b"caf\xe9 " * 500)], "not UTF-8"),
    "data binary": (lambda t: ["--data", write(t, "b.bin", bytes(range(256)) * 10)], "binary"),
    "data directory": (lambda t: ["--data", str(t)], "is a directory"),
    "data too short": (lambda t: ["--data", write(t, "s.txt", "to be or not " * 40)], "too short"),
    "cuda without gpu": (lambda t: ["--device", "cuda"], "cuda"),
    "steps zero": (lambda t: ["--steps", "0"], "must be positive"),
    "steps not a number": (lambda t: ["--steps", "ten"], "not a whole number"),
    "out not writable": (lambda t: ["--out", write(t, "file", "x") + "/sub"], "not a directory"),
    "seed negative": (lambda t: ["--seed", "-1"], "out of range"),
    "seed too large": (lambda t: ["--seed", str(2**64)], "out of range"),
    "config name a path": (lambda t: ["--config", write(t, "c.toml", toml_with(**{'name = "tiny"': 'name = "../x"'}))],
                           "config name"),
    "compile with numpy": (lambda t: ["--backend", "numpy", "--compile"], "--compile applies to the torch"),
}


def minimal_spec(run_id: str) -> dict:
    """A spec.json that passes the schema (the record beside it is what a test breaks)."""
    return {"schema": "nanogpt-parity/run-spec", "schema_version": 1, "run_id": run_id, "label": "small",
            "config": {"name": "small", "n_embd": 16, "block_size": 64, "n_layer": 1, "n_head": 2, "d_hidden": 64},
            "seed": 1, "device": "cpu", "data": {"path": "x.txt", "sha256": "0" * 64}, "backends": ["torch"],
            "backend_options": {}}


def write(tmp: Path, name: str, content: str | bytes) -> str:
    path = tmp / "inputs" / name
    path.parent.mkdir(exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_run(tmp_path, case):
    if case == "cuda without gpu" and shutil.which("nvidia-smi"):
        pytest.skip("a GPU is present")
    setup, fragment = CASES[case]
    extra = setup(tmp_path)
    out = tmp_path / "out"
    out_args = [] if "--out" in extra else ["--out", str(out)]
    result = run_cli("run", "--steps", "3", "--quiet", *out_args, *extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and fragment in lines[0]
    assert files_under(out) == []


def _drop_permission_override() -> None:
    """Run in the child before exec: take away root's power to ignore file permissions (CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH leave the bounding set, so the exec'd CLI never holds them). Unprivileged users lack them
    anyway; this lets the test run, and mean the same, as root (CI and containers run as root)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH (linux/capability.h)
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")


def test_out_read_only(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    env = dict(os.environ, HARNESS_DATA=str(data_path()), PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--steps", "3", "--out", str(ro / "reports")],
                            capture_output=True, text=True, env=env, timeout=120, preexec_fn=_drop_permission_override)
    assert result.returncode == 2 and "not writable" in result.stderr and not (ro / "reports").exists(), result.stderr


def test_report_missing_and_corrupt(tmp_path):
    out = tmp_path / "out"
    result = run_cli("report", "20990101-000000-small-0000", "--out", str(out))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and "no run" in result.stderr
    run = out / "runs" / "20990101-000000-small-0001"
    run.mkdir(parents=True)
    (run / "spec.json").write_text(json.dumps(minimal_spec(run.name)))
    (run / "torch.json").write_text('{"schema": "nanogpt-parity/run-rec')  # truncated
    before = sorted(files_under(out))
    result = run_cli("report", run.name, "--out", str(out))
    assert result.returncode == 2 and "corrupt" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(files_under(out)) == before


def test_unknown_command_is_one_line():
    result = run_cli("trian")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_a_reader_that_leaves_is_not_an_error():
    """`harness sizes | head -1`: the pipe closes early; no 'cannot write: Broken pipe' message, exit 141 (SIGPIPE)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "harness.cli", "sizes"], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr
