"""--out means --out: a symbolic link inside it (its folders runs/, data/, sweeps/, bench/, or a run id's directory)
is refused in one line, exit status 2, before anything is written there or where it points. torch.compile's caches
are in the user cache directory (tests/test_run_reliability.py), never in --out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import harness_in_process, one_line_error, run_cli, tree

TRAIN = ["--steps", "2", "--backend", "numpy", "--no-text", "--no-report", "--quiet"]
COMMANDS = {
    # the folder of --out that is a link: a command that writes into it
    "runs": ["run", *TRAIN],
    "data": ["run", *TRAIN],
    "sweeps": ["sweep", "--seeds", "1", *TRAIN],
    "bench": ["bench", "overhead", "--backend", "numpy", "--size", "small", "--timed-steps", "1", "--warmup", "0",
              "--repeats", "1", "--quiet"],
}


@pytest.mark.parametrize("folder", list(COMMANDS))
def test_a_linked_folder_of_out_is_refused_and_nothing_is_written(tmp_path, capsys, config_file, folder):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / folder).symlink_to(elsewhere, target_is_directory=True)
    before = tree(out)
    args = COMMANDS[folder]
    if args[0] != "bench":
        args = [*args, "--config", config_file]
    code, err = harness_in_process(capsys, *args, "--out", out)
    one_line_error(code, err, f"{folder}' is a symbolic link", "writes only inside --out")
    assert tree(elsewhere) == [] and tree(out) == before


def test_a_linked_run_directory_is_refused_and_nothing_is_written(tmp_path, capsys, config_file):
    """An interrupted run moved elsewhere, a link to it left in runs/: resume (and status, report) refuse it; the run
    where the link points is not touched."""
    out = tmp_path / "out"
    result = run_cli("run", "--config", str(config_file), "--steps", "20", "--checkpoint-every", "10",
                     "--backend", "numpy", "--no-text", "--no-report", "--quiet", "--out", str(out),
                     env={"HARNESS_TEST_PAUSE_AT": "after-checkpoint:kill"})
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    (run,) = (out / "runs").iterdir()
    moved = tmp_path / "elsewhere" / run.name
    moved.parent.mkdir()
    run.rename(moved)
    run.symlink_to(moved, target_is_directory=True)
    before = {p: p.read_bytes() for p in moved.iterdir() if p.is_file()}
    listing = tree(out)
    for args in (["resume", run.name, "--quiet", "--no-report"], ["status", run.name], ["report", run.name]):
        code, err = harness_in_process(capsys, *args, "--out", out)
        one_line_error(code, err, f"{run.name}' is a symbolic link", "writes only inside --out")
    assert {p: p.read_bytes() for p in moved.iterdir() if p.is_file()} == before and tree(out) == listing
    from harness.cli import main

    assert main.main(["status", "--json", "--out", str(out)]) == 0  # listed as unreadable, saying why, not read
    (row,) = json.loads(capsys.readouterr().out)["recent"]
    assert row["state"] == "unreadable" and "symbolic link" in row["verdict"] and row["size"] == "?", row


def test_compile_caches_are_in_the_user_cache_or_where_the_user_put_them(tmp_path: Path, monkeypatch):
    """A compiling child's Inductor and Triton caches: under the harness's cache directory (HARNESS_CACHE here),
    beside JAX's, never under a run's --out; a place the user chose is kept."""
    from harness.run import processes

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    env = processes.child_env(None, compiles=True)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "cache" / "torchinductor").resolve())
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert "TORCHINDUCTOR_CACHE_DIR" not in processes.child_env(None)  # a child that compiles nothing: untouched


def test_a_linked_lock_file_is_refused_and_where_it_points_is_untouched(tmp_path, capsys, config_file):
    """A `.lock` in a run directory that is a link to a file outside --out: resume refuses it in one line (its last)
    and never truncates or writes the file it points to."""
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    victim.write_text("precious\n")
    code, _ = harness_in_process(capsys, "run", *TRAIN, "--config", config_file, "--out", out)
    assert code == 0
    (run,) = (out / "runs").iterdir()
    (run / ".lock").unlink(missing_ok=True)
    (run / ".lock").symlink_to(victim)
    code, err = harness_in_process(capsys, "resume", run.name, "--quiet", "--no-report", "--out", out)
    assert victim.read_text() == "precious\n"
    one_line_error(code, err.strip().splitlines()[-1], ".lock' is a symbolic link", "writes only inside --out")


def test_a_linked_record_lock_is_refused_and_where_it_points_is_untouched(tmp_path):
    from harness.errors import UsageError
    from harness.store import RecordLock
    from harness.store.lock import record_lock_path

    record, victim = tmp_path / "paired.json", tmp_path.parent / f"{tmp_path.name}-victim.txt"
    victim.write_text("precious\n")
    record_lock_path(record).symlink_to(victim)
    try:
        with pytest.raises(UsageError, match="is a symbolic link") as refused, RecordLock(record):
            pass
    finally:
        assert victim.read_text() == "precious\n"
    assert "\n" not in str(refused.value)
