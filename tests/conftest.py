"""Shared fixtures: the corpus (the project's own, tests/corpus.py), a CLI runner, tiny configs."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

# One thread per framework: on a 2-core CI machine two intra-op threads that wait for each other made steps up to
# 85x slower whenever anything else ran (docs/benchmarks.md). Tests check behaviour, not speed.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# Paired timing (harness.run.paired_timing) in short bursts: tests check its mechanism, never a speed.
os.environ.setdefault("HARNESS_PAIRED_BURST_S", "0.02")
# OpenMP threads that sleep instead of spinning between torch's parallel regions: the same numbers, about 15 % less
# CPU per torch worker, which two cores shared by three test processes and their workers feel
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# JAX's persistent compilation cache (the jax backend's default: the user cache directory) in a directory of this
# test process that goes with it: no test reads or fills the user's cache
_JAX_CACHE = tempfile.TemporaryDirectory(prefix="jax-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE.name

ROOT = Path(__file__).resolve().parent.parent
CORPUS_SHA256 = "aede7edccbdb5826e85d8f10d62e916ec01269e9d6bc1e81d8f8af9800ba3dd8"  # tests/corpus.py's bytes


def data_path() -> Path:
    """The corpus every test trains on: the project's own generated play (tests/corpus.py), in any clone, with no
    network and no HARNESS_DATA. Tests that want Tiny Shakespeare ask for the `shakespeare` fixture."""
    from corpus import corpus_path

    return corpus_path()


def shakespeare_path() -> Path | None:
    """Tiny Shakespeare where this machine has it (HARNESS_DATA, else the harness's user cache), else None."""
    from harness.core.data import TINY_SHAKESPEARE_SHA256, sha256_bytes
    from harness.environment import cache_dir

    for candidate in (USER_DATA, cache_dir() / "tinyshakespeare.txt"):
        if candidate and Path(candidate).is_file():
            path = Path(candidate).resolve()
            if sha256_bytes(path.read_bytes()) == TINY_SHAKESPEARE_SHA256:
                return path
    return None


# Every harness command a test runs, in this process or a child, reads the project corpus unless it passes --data;
# the user's own HARNESS_DATA (CI sets it to Tiny Shakespeare) is kept for the `shakespeare` fixture.
USER_DATA = os.environ.get("HARNESS_DATA")
os.environ["HARNESS_DATA"] = str(data_path())


@pytest.fixture(scope="session")
def data() -> Path:
    return data_path()


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    """Tiny Shakespeare from HARNESS_DATA or the user cache, else the project's corpus; the test's report says which
    (a test using it may compare with published Tiny Shakespeare figures only when it got the real text)."""
    path = shakespeare_path()
    print(f"\ncorpus: {'Tiny Shakespeare' if path else 'the project corpus (no Tiny Shakespeare here)'}")
    return path or data_path()


@pytest.fixture(scope="session")
def corpus(data: Path):
    from harness.core.data import load_corpus

    return load_corpus(data)


def run_cli(*args: str, env: dict | None = None, timeout: float = 600, cwd: Path | None = None
            ) -> subprocess.CompletedProcess:
    """Run `harness ARGS` as a user would, in a fresh interpreter, capturing output."""
    full_env = dict(os.environ, HARNESS_DATA=str(data_path()), PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=cwd)


TINY_TOML = """\
name = "tiny"
[model]
n_embd = 16
block_size = 32
n_layer = 1
n_head = 2
d_hidden = 32
dropout = {dropout}
[train]
batch_size = 8
learning_rate = {lr}
epochs = 1
scheme = "epochs"
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.999
eps = 1e-8
grad_clip = {clip}
[eval]
interval = {interval}
batches = 2
"""


TINY = TINY_TOML.format(dropout=0.0, lr=0.01, clip=1.0, interval=10)  # the reliability tests' config


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    """TINY as a file, once per test module."""
    path = tmp_path_factory.mktemp("cfg") / "tiny.toml"
    path.write_text(TINY)
    return path


def tree(path: Path) -> list[str]:
    """Every path under `path`, sorted (to show that a refused command wrote nothing)."""
    return sorted(str(p) for p in path.rglob("*")) if path.exists() else []


@pytest.fixture
def tiny_config(tmp_path: Path):
    """Write a tiny TOML config (fast on 2 cores) with some fields settable; returns a factory."""

    def make(dropout: float = 0.0, lr: float = 0.01, clip: float = 1.0, interval: int = 20,
             name: str = "tiny.toml") -> Path:
        path = tmp_path / name
        path.write_text(TINY_TOML.format(dropout=dropout, lr=lr, clip=clip, interval=interval))
        return path

    return make


def interrupted_run(out: Path, config_file: Path, steps: int, every: int, pause: str) -> Path:
    """The run directory of a numpy run of `steps` steps, a checkpoint every `every`, stopped by the test hook at
    `pause` (harness.run.child: e.g. "after-checkpoint:kill:2")."""
    result = run_cli("run", "--config", str(config_file), "--steps", str(steps), "--checkpoint-every", str(every),
                     "--backend", "numpy", "--no-text", "--no-report", "--quiet", "--out", str(out),
                     env={"HARNESS_TEST_PAUSE_AT": pause})
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    (run,) = (out / "runs").iterdir()
    return run


def copy_run(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of run directory `run` with its --out (and the data copy there): (out, run directory)."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(run.parent.parent, out)
    return out, out / "runs" / run.name


def harness_in_process(capsys, *args: object) -> tuple[int, str]:
    """`harness ARGS` in this process (its workers are still their own processes): (exit status, stderr)."""
    import signal

    from harness.cli import main

    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = main.main([str(a) for a in args])
    except SystemExit as exc:  # argparse
        code = exc.code
    finally:
        signal.signal(signal.SIGTERM, previous)
    return code, capsys.readouterr().err


def one_line_error(code: int, err: str, *fragments: str) -> None:
    """Bad input's contract: exit 2, one line on stderr (blank lines aside), no traceback, every fragment in it."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (the worker runs in its own session)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def record_doc(path: Path) -> dict:
    """A backend's record as one JSON object with its curves in it (`steps`, `evals`, `chunks`, as a record of schema
    version 3 holds them), read by the store's own reader (the curves from their files)."""
    from harness import store
    from harness.store.curves import Curves

    rec = store.RunRecord.load(path)
    version = rec.schema_version
    rec.curves, rec.schema_version = Curves.from_json(rec.curves.to_json()), 3
    return {**json.loads(store.json_bytes(rec.to_dict())), "schema_version": version}


def as_version_3(path: Path) -> dict:
    """Rewrite the record at `path` as a record of schema version 3 (its curves in its JSON, which every reader still
    reads), where a test can edit its curves; the JSON written."""
    doc = {**record_doc(path), "schema_version": 3}
    path.write_text(json.dumps(doc))
    return doc


def check_files(run: Path) -> None:
    """Everything a kill leaves behind parses (a temp file may be left; the next lock holder removes it)."""
    for path in run.iterdir():
        if path.suffix in (".json", ".jsonl"):
            text = path.read_text()
            lines = text.splitlines() if path.suffix == ".jsonl" else [text]
            assert all(isinstance(json.loads(line), dict) for line in lines), path
        elif path.suffix == ".csv":
            rows = list(csv.reader(path.open()))
            assert rows and all(len(r) == len(rows[0]) for r in rows), path
        elif path.suffix == ".npz":
            with np.load(path) as f:
                assert "harness/step" in f.files and len(f["harness/loss"]) == int(f["harness/step"])
        else:
            assert path.name == ".lock" or (path.name.startswith(".") and path.name.endswith(".tmp")), path


def in_own_mounts(script: str) -> subprocess.CompletedProcess:
    """Run a shell script in a private mount namespace (its mounts vanish with it)."""
    env = dict(os.environ, HARNESS_DATA=str(data_path()), PYTHONUNBUFFERED="1")
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env,
                          timeout=300)


needs_mounts = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare")
                                  or subprocess.run(["unshare", "-m", "true"]).returncode != 0,
                                  reason="needs root and unshare for a private tmpfs or read-only mount")
