"""Reliability: no data lost, no two owners of a run, bad input refused before anything is created, corrupt
records named, run ids that are names, and where every record came from; each case written as the attack.

Timing-dependent cases use the worker's HARNESS_TEST_PAUSE_AT hook (see harness/run/worker.py), so every signal
lands at a named point instead of "after about two seconds". Validation cases call the CLI in-process (fast);
anything about processes runs the real CLI in a fresh interpreter.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import store
from harness.errors import UsageError
from tests.conftest import (
    TINY,
    as_version_3,
    children,
    copy_run,
    data_path,
    harness_in_process,
    in_own_mounts,
    needs_mounts,
    one_line_error,
    record_doc,
    run_cli,
    tree,
)

NUMPY = ["--backend", "numpy", "--quiet", "--no-text", "--no-report"]


# --- helpers ------------------------------------------------------------------------------------------------------
harness = harness_in_process


def only_run(out: Path) -> Path:
    (run,) = list((out / "runs").iterdir())
    return run


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    full = dict(os.environ, HARNESS_DATA=str(data_path()), PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "harness.cli", *args], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def state(pid: int) -> str | None:
    """The /proc state letter (R, S, T, Z, ...), None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def record_of(run: Path, backend: str = "numpy") -> dict:
    return record_doc(run / f"{backend}.json")


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, config_file) -> Path:
    """A completed numpy run (20 steps, checkpoint at 10): copy it before changing it."""
    out = tmp_path_factory.mktemp("done")
    result = run_cli("run", "--config", str(config_file), "--steps", "20", "--checkpoint-every", "10",
                     "--out", str(out), *NUMPY)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{only_run(out).name}\n"  # `ID=$(harness run ... --quiet)`: the id alone on stdout
    return only_run(out)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, config_file) -> Path:
    """A numpy run of 60 steps hard-killed while writing its second checkpoint (the first, at 20, is whole)."""
    out = tmp_path_factory.mktemp("killed")
    result = run_cli("run", "--config", str(config_file), "--steps", "60", "--checkpoint-every", "20",
                     "--out", str(out), *NUMPY, env={"HARNESS_TEST_PAUSE_AT": "mid-checkpoint:kill:2"})
    assert result.returncode == 1, result.stderr
    return only_run(out)


# --- data loss ----------------------------------------------------------------------------------------------------
def test_sigterm_early_in_resume_keeps_the_record(tmp_path, killed_run):
    out, run = copy_run(killed_run, tmp_path)
    files = {p.name: p.read_bytes() for p in run.iterdir() if not p.name.startswith(".")}
    result = run_cli("resume", run.name, "--out", str(out), "--quiet", "--no-report",
                     env={"HARNESS_TEST_PAUSE_AT": "before-record:term"})
    assert result.returncode == 130, result.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir() if not p.name.startswith(".")} == files
    result = run_cli("resume", run.name, "--out", str(out), "--quiet", "--no-report")
    assert result.returncode == 0, result.stderr
    assert record_of(run)["status"] == "completed" and len(record_of(run)["steps"]["loss"]) == 60


def _float16_parameters(ckpt: Path) -> None:
    import numpy as np

    with np.load(ckpt) as f:
        state = {k: f[k].astype(np.float16) if k.startswith("param/") else f[k] for k in f.files}
    np.savez(ckpt, **state)


# what a resume says of each damage: an unreadable file, and one that reads but is no checkpoint of this run (float16
# parameters were resumed and completed, exit 0, before checkpoints were validated); an empty file, and every other
# damage, are refused by the same reader in process (tests/test_binary_files.py)
CHECKPOINT_DAMAGE = {
    "truncated": (lambda ckpt: ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2]),
                  "not a readable .npz archive"),
    "float16 parameters": (_float16_parameters, "numpy.ckpt.npz': array 'param/wte.weight' is float16 (65, 16), "
                                                "expected float64 (65, 16); delete numpy.ckpt.npz to restart numpy "
                                                "from step 0"),
}


@pytest.mark.parametrize("damage", list(CHECKPOINT_DAMAGE))
def test_bad_checkpoint_is_one_line_and_changes_nothing(tmp_path, killed_run, damage):
    out, run = copy_run(killed_run, tmp_path)
    change, words = CHECKPOINT_DAMAGE[damage]
    change(run / "numpy.ckpt.npz")
    files = {p.name: p.read_bytes() for p in run.iterdir() if not p.name.startswith(".")}  # but the lock's pid
    result = run_cli("resume", run.name, "--out", str(out), "--quiet", "--no-report")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "numpy.ckpt.npz" in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and words in errors[0], result.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir() if not p.name.startswith(".")} == files


def test_record_behind_checkpoint_resumes(tmp_path, config_file):
    """Killed between the checkpoint rename and the record write (the kill tests do this at every point)."""
    out = tmp_path / "out"
    result = run_cli("run", "--config", str(config_file), "--steps", "30", "--checkpoint-every", "10",
                     "--out", str(out), *NUMPY, env={"HARNESS_TEST_PAUSE_AT": "after-checkpoint:kill:2"})
    run = only_run(out)
    assert result.returncode == 1 and len(record_of(run)["steps"]["loss"]) == 10  # the checkpoint is at 20
    result = run_cli("resume", run.name, "--out", str(out), "--quiet", "--no-report")
    assert result.returncode == 0, result.stderr
    assert record_of(run)["steps"]["step"] == list(range(30))


# --- run ids are names ----------------------------------------------------------------------------------------------
def test_run_id_is_a_name_never_a_path(tmp_path, capsys, done_run):
    out = tmp_path / "out"
    before = tree(tmp_path)
    for args in (["report", str(done_run), "--out", out], ["report", f"../../x/runs/{done_run.name}", "--out", out],
                 ["report", "a/../b", "--out", out],
                 ["resume", str(done_run), "--out", out], ["status", "../x", "--out", out]):
        code, err = harness(capsys, *args)
        one_line_error(code, err, "is not a run id")
    assert tree(tmp_path) == before


# --- harness status|report|resume ID: a run id or a sweep id ---------------------------------------------------------
def test_an_id_names_a_run_or_a_sweep_and_never_both(tmp_path, capsys, done_run):
    out, run = copy_run(done_run, tmp_path)
    for verb in ("status", "report", "resume"):
        code, err = harness(capsys, verb, "20990101-000000-nope-0000", "--out", out)
        one_line_error(code, err, "no run or sweep '20990101-000000-nope-0000'", "--out")
    (out / "sweeps" / run.name).mkdir(parents=True)
    before = tree(out)
    for verb in ("status", "report", "resume"):
        code, err = harness(capsys, verb, run.name, "--out", out)
        one_line_error(code, err, f"'{run.name}' names both a run", "rename one")
    assert tree(out) == before
    (out / "sweeps" / run.name).rmdir()
    code, err = harness(capsys, "resume", run.name, "--out", out, "--jobs", "2")
    one_line_error(code, err, "--jobs applies to a sweep")


def test_status_of_a_run_says_each_backend_s_state_and_step(tmp_path, capsys, done_run, killed_run):
    from harness.cli.main import main

    def status(run: Path) -> str:
        assert main(["status", run.name, "--out", str(run.parent.parent)]) == 0
        return capsys.readouterr().out

    text = status(done_run)
    assert f"run {done_run.name}" in text and "numpy" in text and "completed" in text and "20/20" in text
    assert "harness resume" not in text
    out, run = copy_run(killed_run, tmp_path)
    assert "failed: killed by SIGKILL" in status(run)
    record = json.loads((run / "numpy.json").read_text())
    (run / "numpy.json").write_text(json.dumps(dict(record, status="running")))  # its process died unannounced
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    text = status(run)
    assert "interrupted (its process is gone)" in text and f"harness resume {run.name}" in text, text
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # it reads only


# --- concurrency and liveness -------------------------------------------------------------------------------------
def test_a_running_run_is_locked(tmp_path, config_file):
    out = tmp_path / "out"
    proc = start("run", "--config", str(config_file), "--steps", "20", "--out", str(out), *NUMPY,
                 env={"HARNESS_TEST_PAUSE_AT": "after-record:sleep"})
    try:
        wait_for(lambda: (out / "runs").is_dir() and any((out / "runs").glob("*/numpy.json")))
        run = only_run(out)
        result = run_cli("resume", run.name, "--out", str(out), "--quiet", "--no-report")
        assert result.returncode == 2 and "being written by another process" in result.stderr, result.stderr
        result = run_cli("status", run.name, "--out", str(out))  # the lock is held: the run is running
        assert result.returncode == 0 and "being written now" in result.stdout, result.stdout
        assert re.search(r"numpy\s+running", result.stdout), result.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    assert record_of(run)["status"] == "interrupted"


def test_lock_dies_with_its_holder(tmp_path):
    paths = store.RunPaths(tmp_path, "r1")
    paths.dir.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from harness import store; "
                               f"store.RunLock(store.RunPaths({str(tmp_path)!r}, 'r1')).acquire(); "
                               "print('held', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UsageError, match=rf"being written by another process \(pid {holder.pid}\)"):
        store.RunLock(paths).acquire()
    holder.kill()
    holder.wait()
    store.RunLock(paths).acquire().release()  # the kernel dropped the lock with its holder


def test_worker_orphaned_at_spawn_stops(tmp_path, config_file):
    out = tmp_path / "out"
    proc = start("run", "--config", str(config_file), "--steps", "20", "--out", str(out), *NUMPY,
                 env={"HARNESS_TEST_PAUSE_AT": "start:sleep"})
    wait_for(lambda: bool(children(proc.pid)))
    (worker,) = children(proc.pid)
    time.sleep(0.5)
    proc.kill()
    proc.wait()
    wait_for(lambda: state(worker) in (None, "Z"), timeout=20)  # PR_SET_PDEATHSIG was set before its imports


@pytest.mark.parametrize("how", ["stop", "hang"])
def test_stopped_or_wedged_worker_is_escalated(tmp_path, config_file, how):
    out = tmp_path / "out"
    proc = start("run", "--config", str(config_file), "--steps", "20", "--out", str(out), *NUMPY,
                 env={"HARNESS_TEST_PAUSE_AT": f"after-record:{how}", "HARNESS_KILL_GRACE_S": "1"})
    try:
        wait_for(lambda: (out / "runs").is_dir() and any((out / "runs").glob("*/numpy.json")))
        (worker,) = children(proc.pid)
        if how == "stop":
            wait_for(lambda: state(worker) == "T")
        else:
            time.sleep(0.5)  # inside the hang, SIGTERM blocked
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    rec = record_of(only_run(out))
    assert rec["status"] == "interrupted", rec["status"]
    if how == "hang":  # it never answered SIGTERM: SIGKILL after the grace period, and the record says so
        assert rec["signal"] == "SIGKILL" and "did not stop" in stderr and "SIGKILL" in rec["error"]


def test_worker_killed_by_a_signal_is_marked(tmp_path, config_file):
    out = tmp_path / "out"
    result = run_cli("run", "--config", str(config_file), "--steps", "20", "--out", str(out), *NUMPY,
                     env={"HARNESS_TEST_PAUSE_AT": "after-record:kill"})
    assert result.returncode == 1 and "killed by SIGKILL" in result.stderr
    rec = record_of(only_run(out))
    assert rec["status"] == "failed: killed by SIGKILL" and rec["signal"] == "SIGKILL"
    from harness.report.analysis import ERROR, status_of

    assert status_of(store.RunRecord.from_dict(rec))[0] == ERROR  # the report no longer says "running"


@pytest.mark.parametrize("point", ["final-persist", "end"])
def test_sigterm_at_the_end_keeps_completed(tmp_path, config_file, point):
    out = tmp_path / "out"
    result = run_cli("run", "--config", str(config_file), "--steps", "20", "--out", str(out), *NUMPY,
                     env={"HARNESS_TEST_PAUSE_AT": f"{point}:term"})
    assert result.returncode == 0, result.stderr
    assert record_of(only_run(out))["status"] == "completed"


# --- validation before anything is created ------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["run", "parity", "bench overhead"])
def test_empty_out_refused_everywhere(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    code, err = harness(capsys, *command.split(), "--out", "")
    one_line_error(code, err, "--out is empty")
    assert tree(tmp_path) == []


@pytest.mark.parametrize("command", ["run", "parity", "bench overhead"])
@pytest.mark.parametrize("seed", ["-1", str(2**64), str(2**32)])
def test_seed_range(tmp_path, capsys, command, seed):
    code, err = harness(capsys, *command.split(), "--seed", seed, "--out", tmp_path / "out")
    one_line_error(code, err, "seed", "out of range")
    assert tree(tmp_path) == []


@pytest.mark.parametrize("change", ["n_embd = 16:n_embd = 1000000000", "d_hidden = 32:d_hidden = 1000000000",
                                    "batches = 2:batches = 1000000000", "n_layer = 1:n_layer = 1000000000"])
def test_memory_estimate_refuses(tmp_path, capsys, change):
    old, new = change.split(":")
    path = tmp_path / "big.toml"
    path.write_text(TINY.replace(old, new))
    code, err = harness(capsys, "run", "--config", path, "--steps", "3", "--out", tmp_path / "out", *NUMPY)
    one_line_error(code, err, "needs about", "available of", "--allow-large")
    assert not (tmp_path / "out").exists()


def test_memory_estimate_unit(corpus):
    from harness.config.load import load_config
    from harness.core.weights import count_parameters, param_shapes
    from harness.run import plan as run_plan

    for size in ("small", "large"):
        c = load_config(size)
        assert count_parameters(c, 65) == sum(math.prod(s) for s in param_shapes(c, 65).values())

    small = run_plan.Plan(config=load_config("small"), corpus=corpus, backends=["torch"])
    assert 0 < run_plan.check_memory(small) < 500 * 2**20  # the preset fits easily
    huge = run_plan.Plan(config=load_config("small").replace(n_embd=10**9, n_head=1), corpus=corpus,
                       backends=["torch"], allow_large=True)
    assert run_plan.check_memory(huge) > 10**18  # refused only without the override


@pytest.mark.parametrize("name", ["a/b", "..", "a\\u0000b", "has space", "a&b", "x" * 300, ""])
def test_config_name(tmp_path, capsys, name):
    path = tmp_path / "c.toml"
    path.write_text(TINY.replace('name = "tiny"', f'name = "{name}"'))
    code, err = harness(capsys, "run", "--config", path, "--steps", "3", "--out", tmp_path / "out", *NUMPY)
    one_line_error(code, err, "config name")
    assert not (tmp_path / "out").exists()


def _bad_out(tmp: Path, kind: str) -> Path:
    if kind == "long name":
        return tmp / ("x" * 300) / "out"
    if kind == "symlink loop":
        os.symlink("loop", tmp / "loop")
        return tmp / "loop" / "out"
    if kind == "dangling symlink":
        os.symlink(tmp / "nowhere", tmp / "dangle")
        return tmp / "dangle"
    out = tmp / "out"
    out.mkdir()
    if kind == "runs a file":
        (out / "runs").write_text("x")
    elif kind == "index.html a directory":
        (out / "index.html").mkdir()
    return out


@pytest.mark.parametrize("kind, fragment", [("long name", "255"), ("symlink loop", "symlink loop"),
                                            ("dangling symlink", "dangling symlink"),
                                            ("runs a file", "must be a directory"),
                                            ("index.html a directory", "index.html")])
def test_path_errors(tmp_path, capsys, kind, fragment):
    out = _bad_out(tmp_path, kind)
    before = tree(tmp_path)
    code, err = harness(capsys, "run", "--steps", "3", "--out", out, *NUMPY)
    one_line_error(code, err, fragment)
    assert tree(tmp_path) == before


@needs_mounts
def test_full_disk_and_read_only(tmp_path, config_file, done_run):
    py = f"{sys.executable} -m harness.cli"
    # a full disk when the run is prepared (the corpus copy does not fit): one line, exit 2, no run directory
    full = tmp_path / "full"
    full.mkdir()
    r = in_own_mounts(f"mount -t tmpfs -o size=128k tmpfs {full}; {py} run --config {config_file} --steps 3 "
                       f"--out {full}/out {' '.join(NUMPY)}; echo rc=$?; ls -A {full}/out/runs 2>/dev/null | wc -l")
    assert "rc=2" in r.stdout and "No space left on device" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip().endswith("0")
    # a full disk when the report is written
    r = in_own_mounts(f"mount -t tmpfs -o size=4m tmpfs {full}; cp -r {done_run.parent.parent} {full}/out; "
                       f"dd if=/dev/zero of={full}/fill bs=64k 2>/dev/null || true; "
                       f"{py} report {done_run.name} --out {full}/out; echo rc=$?")
    assert "rc=2" in r.stdout and "No space left" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    # resume on a read-only --out
    out, run = copy_run(done_run, tmp_path)
    r = in_own_mounts(f"mount --bind {out} {out}; mount -o remount,ro,bind {out}; "
                       f"{py} resume {run.name} --out {out} --quiet; echo rc=$?")
    assert "rc=2" in r.stdout and "read-only" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("option", [["--steps", "99"], ["--backend", "torch"], ["--size", "medium"],
                                    ["--seed", "5"], ["--device", "cuda"], ["--data", "other.txt"],
                                    ["--checkpoint-every", "3"], ["--dropout", "0.3"]])
def test_resume_takes_no_option_that_changes_what_the_run_computes(capsys, done_run, option):
    """A run continues as it was started: `harness resume` has no option that would change it (one line pointing at
    its --help, nothing written)."""
    before = tree(done_run.parent.parent)
    code, err = harness(capsys, "resume", done_run.name, "--out", done_run.parent.parent, *option)
    one_line_error(code, err, f"unrecognized arguments: {option[0]}", "`harness resume --help`")
    assert tree(done_run.parent.parent) == before


def test_resume_applies_threads_and_says_so(capsys, done_run):
    code, err = harness(capsys, "resume", done_run.name, "--out", done_run.parent.parent, "--threads", "1",
                        "--no-report", "--quiet")
    assert code == 0 and "using --threads 1" in err


@pytest.mark.parametrize("args, fragment", [(["--backend", "numpy", "--precision", "bf16"], "--precision"),
                                            (["--backend", "numpy", "--compile"], "--compile"),
                                            (["--out", ""], "--out is empty")])
def test_ignored_options_are_refused(tmp_path, capsys, args, fragment, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = harness(capsys, "run", "--steps", "3", *(["--out", tmp_path / "out"] if "--out" not in args else []),
                        *args)
    one_line_error(code, err, fragment)
    assert tree(tmp_path) == []


def test_compile_caches_go_into_the_user_cache(tmp_path, monkeypatch):
    from harness.run import processes

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    env = processes.compile_cache_env()
    assert all(Path(v).is_relative_to((tmp_path / "cache").resolve()) for v in env.values())
    assert set(env) == {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}


# --- corrupt stored data -----------------------------------------------------------------------------------------
def _edit(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


CORRUPT = {
    # name: (damage(run dir), file named, field named)
    "spec a list": (lambda r: (r / "spec.json").write_text("[]"), "spec.json", "top level"),
    "spec not utf-8": (lambda r: (r / "spec.json").write_bytes(b'{"a": "\xff"}'), "spec.json", "utf-8"),
    "spec backend a path": (lambda r: _edit(r / "spec.json", lambda d: d.update(backends=["../../x"])), "spec.json",
                            "backends/0"),
    "spec without backends": (lambda r: _edit(r / "spec.json", lambda d: d.pop("backends")), "spec.json",
                              "(top level)"),
    "spec config not a table": (lambda r: _edit(r / "spec.json", lambda d: d.update(config=3)), "spec.json",
                                "'config'"),
    "spec unknown config key": (lambda r: _edit(r / "spec.json", lambda d: d["config"].update(bogus=1)),
                                "spec.json", "bogus"),
    "schema_version a string": (lambda r: _edit(r / "numpy.json", lambda d: d.update(schema_version="2")),
                                "numpy.json", "schema_version"),
    "an older harness's record": (lambda r: _edit(r / "numpy.json", lambda d: d.update(schema_version=2)),
                                  "numpy.json", "older nanogpt-parity (schema 2); re-run it"),
    "an older harness's spec": (lambda r: _edit(r / "spec.json", lambda d: d.pop("schema_version")), "spec.json",
                                "older nanogpt-parity (schema 0); re-run it"),
    "steps a list": (lambda r: _edit(r / "numpy.json", lambda d: d.update(steps=[])), "numpy.json", "'steps'"),
    "evals malformed": (lambda r: _edit(r / "numpy.json", lambda d: d.update(evals=[{"step": "x"}])),
                        "numpy.json", "'evals'"),
    "config not a table": (lambda r: _edit(r / "numpy.json", lambda d: d.update(config="x")), "numpy.json",
                           "'config'"),
    "backend mismatch": (lambda r: _edit(r / "numpy.json", lambda d: d.update(backend="torch")), "numpy.json",
                         "'backend'"),
    "directory for a record": (lambda r: ((r / "numpy.json").unlink(), (r / "numpy.json").mkdir()), "numpy.json",
                               "is a directory"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_records_are_one_line(tmp_path, capsys, done_run, case):
    damage, file, field = CORRUPT[case]
    out, run = copy_run(done_run, tmp_path)
    damage(run)
    before = tree(out)
    for args in (["report", run.name, "--out", out], ["resume", run.name, "--out", out, "--quiet"]):
        code, err = harness(capsys, *args)
        if case == "spec unknown config key" and args[0] == "report":
            assert code == 0  # the report does not need the config to be runnable
            continue
        one_line_error(code, err, file)
        assert field.lower() in err.lower(), err
    if case != "spec unknown config key":
        assert tree(out) == before


def test_one_bad_run_does_not_break_the_index(tmp_path, capsys, done_run):
    out, good = copy_run(done_run, tmp_path)
    bad = out / "runs" / "20990101-000000-tiny-beef"
    shutil.copytree(good, bad)
    _edit(bad / "spec.json", lambda d: d.update(run_id=bad.name))
    _edit(bad / "numpy.json", lambda d: d.update(run_id=bad.name))
    assert harness(capsys, "report", bad.name, "--out", out)[0] == 0
    _edit(bad / "numpy.json", lambda d: d.update(evals=7))
    code, err = harness(capsys, "report", good.name, "--out", out)
    assert code == 0, err
    index = (out / "index.html").read_text()
    assert good.name in index and "records unavailable" in index and "evals" in index


def test_non_finite_numbers_are_null(tmp_path, done_run):
    path = tmp_path / "r.json"
    store.atomic_write_json(path, {"a": math.nan, "b": [1.0, math.inf, -math.inf]})

    def refuse(name: str) -> None:
        raise ValueError(name)

    assert json.loads(path.read_text(), parse_constant=refuse) == {"a": None, "b": [1.0, None, None]}
    _, run = copy_run(done_run, tmp_path)
    as_version_3(run / "numpy.json")
    _edit(run / "numpy.json", lambda d: d["steps"]["loss"].__setitem__(3, None))
    loaded = store.RunRecord.load(run / "numpy.json")
    assert math.isnan(loaded.curves.loss[3]) and math.isfinite(loaded.curves.loss[2])


def test_and_provenance_worker_reads_the_checked_copy(tmp_path, capsys, config_file):
    """A BOM + CRLF corpus: normalised and recorded; the worker trains on the --out copy, never the user's file;
    stale temp files are cleaned."""
    text = data_path().read_text()[:20000].replace("\n", "\r\n")
    src = tmp_path / "crlf.txt"
    src.write_bytes(b"\xef\xbb\xbf" + text.encode())
    out = tmp_path / "out"
    result = run_cli("run", "--config", str(config_file), "--steps", "20", "--checkpoint-every", "10",
                     "--data", str(src), "--out", str(out), *NUMPY, env={"HARNESS_TEST_PAUSE_AT": "after-record:kill"})
    assert result.returncode == 1
    assert "vocabulary of" in result.stderr and "BOM removed" in result.stderr and "CRLF" in result.stderr
    run = only_run(out)
    spec = json.loads((run / "spec.json").read_text())
    assert spec["data"]["bom_stripped"] is True and spec["data"]["line_endings"] == "normalised"
    assert "\r" not in spec["data"]["vocab"] and "\ufeff" not in spec["data"]["vocab"]
    assert spec["data"]["vocab"] == "".join(sorted(set(text.replace("\r\n", "\n"))))
    assert record_of(run)["data"]["vocab"] == spec["data"]["vocab"]
    src.unlink()  # the user's file is gone: the run still resumes from its checked copy in --out
    (run / ".numpy.json.abcd.tmp").write_text("left by a kill")
    result = run_cli("resume", run.name, "--out", str(out), "--quiet", "--no-report")
    assert result.returncode == 0, result.stderr
    assert not (run / ".numpy.json.abcd.tmp").exists()
    copy = store.paths.corpus_copy(out, spec["data"]["sha256"])
    copy.write_bytes(copy.read_bytes() + b"x")  # a changed copy is refused, not trained on
    _edit(run / "numpy.json", lambda d: d.update(status="interrupted"))
    result = run_cli("resume", run.name, "--out", str(out), "--quiet", "--no-report")
    assert result.returncode == 2 and "changed since the run started" in result.stderr


# --- the executor seam ----------------------------------------------------------------------------------------------
def test_run_backend_is_a_plain_function_under_the_lock(tmp_path, capsys, config_file):
    """`launch.run_backend` trains one backend in this process (what a SLURM job calls); it takes the lock."""
    from harness.config.load import load_config
    from harness.core.data import load_corpus
    from harness.run import plan as run_plan
    from harness.run import supervise

    plan = run_plan.Plan(config=load_config(path=config_file).replace(steps=10), corpus=load_corpus(data_path()),
                       backends=["numpy"], out=tmp_path / "out", text=False, progress=False)
    run_plan.preflight(plan)
    paths = run_plan.write_spec(plan)
    with store.RunLock(paths):  # someone else writes the run: refused, nothing touched
        assert supervise.run_backend(paths, "numpy", progress=False) == 2
        assert "being written by another process" in capsys.readouterr().err
    assert not paths.record("numpy").exists()
    assert supervise.run_backend(paths, "numpy", progress=False) == 0
    rec = store.RunRecord.load(paths.record("numpy"), "numpy")
    assert rec.status is store.Status.COMPLETED and len(rec.curves.loss) == 10
    assert store.Status.of("failed: x") is store.Status.FAILED and store.Status.FAILED.stored("x") == "failed: x"


def test_memory_estimate_against_the_gpu(tmp_path, monkeypatch, corpus):
    """A backend on CUDA is also checked against the GPU's free memory, read from nvidia-smi (a fake one here)."""
    from harness.config.load import load_config
    from harness.run import plan as run_plan

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '81559, 2'\n")  # MiB total, MiB free: 2 MiB free
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert run_plan.gpu_memory() == (81559 * 2**20, 2 * 2**20)
    medium = load_config("medium")
    on_cpu = run_plan.Plan(config=medium, corpus=corpus, backends=["torch"])
    assert run_plan.check_memory(on_cpu) > 0  # host RAM is enough, and the GPU is not asked about
    on_gpu = run_plan.Plan(config=medium, corpus=corpus, backends=["torch"], device="cuda")
    with pytest.raises(UsageError, match=r"of GPU memory .* 2 MiB free of 79.6 GiB.*--allow-large"):
        run_plan.check_memory(on_gpu)
    parity_gpu = run_plan.Plan(config=medium, corpus=corpus, backends=["torch", "numpy"], devices={"torch": "cuda"})
    with pytest.raises(UsageError, match="of GPU memory"):
        run_plan.check_memory(parity_gpu)
    assert run_plan.check_memory(run_plan.Plan(config=medium, corpus=corpus, backends=["torch"], device="cuda",
                                           allow_large=True)) > 0
    smi.write_text("#!/bin/sh\nexit 9\n")  # a broken driver: no GPU figure, no refusal on its account
    assert run_plan.gpu_memory() is None
    assert run_plan.check_memory(on_gpu) > 0


def test_a_checkpoint_of_an_older_harness_is_refused(tmp_path):
    """A checkpoint without the curves (written before they were kept in it) is refused with the fix, not resumed
    from the record's curves."""
    import numpy as np

    from harness.run import checkpoint
    from harness.store import RunPaths

    paths = RunPaths(tmp_path, "r1")
    paths.dir.mkdir(parents=True)
    path = paths.checkpoint("numpy")
    state = {"param/w": np.zeros((2, 2)), "adam_m/w": np.zeros((2, 2)), "adam_v/w": np.zeros((2, 2)),
             "adam_t": np.array(2)}
    np.savez(path, **{"harness/step": np.array(2), **state})
    with pytest.raises(UsageError, match=r"older nanogpt-parity \(no curves in it\); delete numpy.ckpt.npz to "):
        checkpoint.read(paths, "numpy", state, {"w": (2, 2)}, 10)
    curves = {"harness/loss": np.ones(2), "harness/time_s": np.ones(2), "harness/evals": np.zeros((0, 4)),
              "harness/chunks": np.frombuffer(b"[]", dtype=np.uint8)}
    np.savez(path, **{"harness/step": np.array(2), **state, **curves})
    step, got, read = checkpoint.read(paths, "numpy", state, {"w": (2, 2)}, 10)
    assert step == 2 and got.loss == [1.0, 1.0] and sorted(read) == sorted(state)
