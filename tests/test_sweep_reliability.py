"""Sweeps and runs that stay reliable and safe: no shell command through SLURM settings, cells counted before anything
is built, workers that stop with their sweep, damaged manifests named, SLURM settings checked up front, empty ids
refused, one line naming the right fix, states a person can act on.

Each test failed on the code before its fix. What needs a real SLURM cluster (the
injection payload that must not run there, sbatch's own refusals, job arrays, an element cancelled and resumed) is in
test_sweep_slurm.py. Validation cases call the CLI in this process (fast); anything about processes runs the real
CLI in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness import store
from harness.errors import UsageError
from harness.run import plan as run_plan
from tests.conftest import (
    children,
    data_path,
    harness_in_process,
    in_own_mounts,
    needs_mounts,
    one_line_error,
    run_cli,
    tree,
)

PAYLOAD = "requeue\ntouch PWNED\n#SBATCH --comment=b"  # the attack: a newline ends the #SBATCH line


# --- helpers ------------------------------------------------------------------------------------------------------
harness = harness_in_process


@pytest.fixture(scope="module")
def done_sweep(tmp_path_factory, config_file) -> Path:
    """A completed local sweep of one numpy cell (its --out): copy it before changing it."""
    out = tmp_path_factory.mktemp("sweep") / "out"
    result = run_cli("sweep", "--configs", str(config_file), "--backends", "numpy", "--steps", "2", "--no-text",
                     "--no-report", "--quiet", "--out", str(out))
    assert result.returncode == 0, result.stderr
    (sweep,) = (out / "sweeps").iterdir()
    assert result.stdout == f"{sweep.name}\n"  # `ID=$(harness sweep ... --quiet)`: the id alone on stdout
    return out


def test_status_lists_a_sweep_as_one_row_with_its_cells_under_it(done_sweep, capsys):
    """`harness status` with no id: the sweep, its cells' states counted, and not its cells' runs one by one."""
    from harness.cli.main import main

    assert main(["status", "--out", str(done_sweep), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["recent"]
    assert row["kind"] == "sweep" and row["state"] == "1 cell: 1 completed" and row["backends"] == "numpy"


def copy_sweep(out: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of a sweep's --out: (out, its sweep.json)."""
    mine = tmp_path / "out"
    shutil.copytree(out, mine)
    (path,) = (mine / "sweeps").glob("*/sweep.json")
    return mine, path


def edit(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


# --- no shell command through SLURM settings ------------------------------------------------------------------------
@pytest.mark.parametrize("where, fragment", [
    ("toml-name", "control character '\\n'"),
    ("flag-name", "control character '\\n'"),
    ("flag-value", "control character '\\n'"),
    ("toml-partition", "control character '\\n'"),
    ("flag-bad-name", "is not an sbatch option name"),
    ("flag-managed", "--array-parallelism"),
    ("toml-not-a-list", "must be a list"),
])
def test_sbatch_injection_is_refused_up_front(tmp_path, capsys, monkeypatch, config_file, where, fragment):
    """The payload never reaches a job script: one line, exit 2, nothing written, no PWNED (checked before the
    cluster is even asked, so this holds with or without SLURM here; test_sweep_slurm.py runs it on a cluster)."""
    monkeypatch.chdir(tmp_path)
    args = ["sweep", "--configs", config_file, "--backends", "numpy", "--steps", "2", "--no-text", "--executor",
            "slurm", "--out", tmp_path / "out"]
    spec = tmp_path / "grid.toml"
    if where == "toml-name":
        spec.write_text(f"[slurm]\nsbatch = [{json.dumps(PAYLOAD)}]\n")
    elif where == "toml-partition":
        spec.write_text('[slurm]\npartition = "debug\\ntouch PWNED #"\n')
    elif where == "toml-not-a-list":
        spec.write_text('[slurm]\nsbatch = "account=x"\n')
    extra = {"flag-name": ["--sbatch", PAYLOAD], "flag-value": ["--sbatch", "comment=x\ntouch PWNED #"],
             "flag-bad-name": ["--sbatch", "Comment;touch=1"], "flag-managed": ["--sbatch", "array=0-5"]}
    code, err = harness(capsys, *args, *([spec] if spec.exists() else []), *extra.get(where, []))
    one_line_error(code, err, fragment)
    assert tree(tmp_path) == sorted(str(p) for p in [spec] if p.exists())  # no --out, no PWNED


def test_stored_sweep_json_with_injected_settings_is_refused(tmp_path, capsys, done_sweep):
    """A sweep.json whose executor settings fail validation is refused on load (--resume, --status, --report)."""
    out, path = copy_sweep(done_sweep, tmp_path)

    def inject(doc: dict) -> None:
        doc["executor"] = {"kind": "slurm", "jobs": 1, "slurm": {"sbatch": [PAYLOAD]}}
        doc["cells"][0].update(status="pending", run_id=None)

    edit(path, inject)
    before = tree(tmp_path)
    for verb in ("resume", "status", "report"):
        code, err = harness(capsys, verb, path.parent.name, "--out", out)
        one_line_error(code, err, "sweep.json", "'executor'", "control character")
    assert tree(tmp_path) == before


def test_stored_sweep_name_with_a_newline_is_refused(tmp_path, capsys, monkeypatch, done_sweep):
    """The sweep's name goes into the job script (#SBATCH --job-name=harness-NAME): a stored sweep.json whose
    spec.name holds a newline would have the job run `touch PWNED` (in the submission directory, here tmp_path).
    The manifest's schema refuses it on load, before the cluster is asked: one line, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    out, path = copy_sweep(done_sweep, tmp_path)

    def inject(doc: dict) -> None:
        doc["spec"]["name"] = "x\ntouch PWNED\n#"
        doc["executor"] = {"kind": "slurm", "jobs": 1, "slurm": {"partition": "debug", "time_min": 2}}
        doc["cells"][0].update(status="pending", run_id=None)

    edit(path, inject)
    before = tree(tmp_path)
    for verb in ("resume", "status", "report"):
        code, err = harness(capsys, verb, path.parent.name, "--out", out)
        one_line_error(code, err, "sweep.json", "spec/name")
    assert tree(tmp_path) == before and not (tmp_path / "PWNED").exists()


def test_a_job_name_with_a_newline_never_reaches_a_job_script(tmp_path, monkeypatch):
    """Defence in depth: the SLURM executor itself refuses a job name that is not one line of plain text. No cluster
    needed: submitit's SlurmExecutor (which writes the script) only looks for `srun` on PATH, so a stub stands in
    for it, as in test 9."""
    from harness.sweep.slurm import SlurmExecutor

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_ / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(UsageError, match="control character"):
        SlurmExecutor(tmp_path / "slurm", partition="debug", job_name="harness-x\ntouch PWNED\n#")
    assert "--job-name=harness-ok" in SlurmExecutor(tmp_path / "slurm", job_name="harness-ok").script(1)


# --- cells are counted before anything is built ---------------------------------------------------------------------
CHILD = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))  # the old code built 2**40 seeds: 23 GB
from harness.cli.main import main
t = time.perf_counter()
try:
    code = main(sys.argv[1:])
except MemoryError:
    code = "MemoryError"
print(f"code={code} seconds={time.perf_counter() - t:.3f}")
"""


@pytest.mark.parametrize("how", ["flag 2**40 seeds", "toml 10**9 seeds", "grid of 10**8 cells"])
def test_huge_sweeps_are_refused_at_once(tmp_path, config_file, how):
    """Each sweep is too big to list under the child's 6 GB address-space limit (10**8 cells or more), so a refusal
    with exit status 2 (not a MemoryError) shows that the cells were counted, never built; no clock is read."""
    spec = tmp_path / "grid.toml"
    args = ["sweep", "--configs", str(config_file), "--backends", "numpy", "--steps", "2", "--out", str(tmp_path / "o")]
    if how == "flag 2**40 seeds":
        args += ["--seeds", "1099511627776", "--yes"]
    elif how == "toml 10**9 seeds":
        spec.write_text("seeds = 1000000000\n")
        args += [str(spec), "--yes"]
    else:
        values = ", ".join(f"{0.0001 * (i + 1):.4f}" for i in range(10_000))
        spec.write_text(f"[fields]\nlearning_rate = [{values}]\nweight_decay = [{values}]\n")
        args += [str(spec), "--yes"]
    env = dict(os.environ, HARNESS_DATA=str(data_path()))
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env, timeout=120)
    assert "code=2 " in done.stdout and "Traceback" not in done.stderr, (done.stdout, done.stderr[-2000:])
    assert "cells" in done.stderr or "seeds" in done.stderr, done.stderr
    assert not (tmp_path / "o").exists()


def test_count_is_the_number_of_cells(tmp_path):
    from harness.sweep.spec import build_spec, count_cells, expand

    spec = build_spec({"sizes": ["small", "medium"], "backends": ["torch", "numpy"], "seeds": 2,
                       "precision": ["fp32", "tf32"], "dtype": ["float32", "float64"],
                       "fields": {"learning_rate": [0.003, 0.01, 0.03]}}, tmp_path)
    assert count_cells(spec) == len(expand(spec)) == 2 * 3 * 2 * 2 * (2 + 1)


# --- --jobs N workers stop with the sweep; memory counts every concurrent worker ------------------------------------
SLOW_START = """
import os, time
try:
    cmd = open("/proc/self/cmdline", "rb").read()
except OSError:
    cmd = b""
if b"--worker\x00train" in cmd:  # a worker slow to start: the sweep dies before its first line (prctl at spawn)
    time.sleep(20)
"""


def test_parallel_workers_stop_when_the_sweep_dies_at_their_start(tmp_path, config_file):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_START)
    env = dict(os.environ, HARNESS_DATA=str(data_path()), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "sweep", "--configs", str(config_file),
                             "--backends", "numpy", "--seeds", "2", "--steps", "20", "--jobs", "2", "--no-text",
                             "--quiet", "--out", str(tmp_path / "out")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the workers never started"
            workers = children(proc.pid)
            time.sleep(0.05)
        proc.kill()  # the sweep dies while both workers are still starting up
        proc.wait()
        deadline = time.monotonic() + 5  # far less than the 20 s they would otherwise spend starting
        alive = workers
        while alive and time.monotonic() < deadline:
            alive = [w for w in workers if _state(w) not in (None, "Z")]
            time.sleep(0.05)
        assert not alive, "a worker outlived the sweep that started it"
    finally:
        proc.kill()
        for pid in workers:
            if _state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGKILL)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_memory_preflight_counts_every_concurrent_worker(tmp_path, capsys, monkeypatch, config_file, corpus):
    from harness.config.load import load_config

    plan = run_plan.Plan(config=load_config(path=config_file).replace(steps=2), corpus=corpus, backends=["numpy"])
    one = run_plan.memory_need(plan)[0]
    monkeypatch.setattr(run_plan, "machine_memory", lambda: (4 * one, int(1.5 * one)))  # one worker fits, two do not
    args = ["sweep", "--configs", config_file, "--backends", "numpy", "--seeds", "2", "--steps", "2", "--no-text",
            "--no-report", "--quiet", "--out", tmp_path / "out"]
    code, err = harness(capsys, *args, "--jobs", "2")
    one_line_error(code, err, "2 cells at once (--jobs 2)", "smaller --jobs")
    assert not (tmp_path / "out").exists()
    assert harness(capsys, *args, "--jobs", "1")[0] == 0  # one at a time fits


def test_memory_preflight_counts_the_paired_timing_s_contenders(tmp_path, capsys, monkeypatch, config_file,
                                                                   corpus):
    """A paired timing holds both backends of a block at once: their memory together must fit, before anything
    is written; without paired timing the same sweep runs."""
    from harness.config.load import load_config

    plan = run_plan.Plan(config=load_config(path=config_file).replace(steps=2), corpus=corpus, backends=["numpy"])
    one = run_plan.memory_need(plan)[0]
    monkeypatch.setattr(run_plan, "machine_memory", lambda: (4 * one, int(1.5 * one)))  # one worker fits, two do not
    args = ["sweep", "--configs", config_file, "--backends", "numpy,torch", "--dtype", "float64", "--seeds", "1",
            "--steps", "2", "--no-text", "--no-report", "--quiet", "--out", tmp_path / "out"]
    code, err = harness(capsys, *args)
    one_line_error(code, err, "the paired timing of", "--paired-rounds 0")
    assert not (tmp_path / "out").exists()
    assert harness(capsys, *args, "--paired-rounds", "0")[0] == 0


# --- a damaged sweep.json is one line naming the field --------------------------------------------------------------
DAMAGE = {
    "cells as strings": (lambda d: d.update(cells=["a", "b"]), "is not of type 'object'"),
    "cell without key": (lambda d: d["cells"][0].pop("key"), "cells/0"),
    "cell without backend": (lambda d: d["cells"][0].pop("backend"), "cells/0"),
    "no executor": (lambda d: d.pop("executor"), "'executor' is a required property"),
    "schema_version a string": (lambda d: d.update(schema_version="1"), "schema_version"),
    "an older harness's manifest": (lambda d: d.update(schema_version=0), "older nanogpt-parity (schema 0); re-run it"),
    "no data": (lambda d: d.pop("data"), "'data' is a required property"),
    "no spec": (lambda d: d.pop("spec"), "'spec' is a required property"),
    "pending cell with an unknown config key": (
        lambda d: (d["cells"][0].update(status="pending", run_id=None), d["cells"][0]["config"].update(bogus=1)),
        "bogus"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_sweep_json_is_one_line(tmp_path, capsys, done_sweep, case):
    damage, fragment = DAMAGE[case]
    out, path = copy_sweep(done_sweep, tmp_path)
    edit(path, damage)
    before = tree(tmp_path)
    for verb in ("status", "resume", "report"):
        code, err = harness(capsys, verb, path.parent.name, "--out", out)
        one_line_error(code, err, "sweep.json", fragment)
    assert tree(tmp_path) == before


def with_a_paired_entry(doc: dict) -> None:
    """The one-numpy-cell sweep as a block of two backends (a torch cell beside it, not run) with its paired entry."""
    from harness.store.sweep import SweepCell
    from harness.sweep import manifest as mf

    torch_cell = dict(doc["cells"][0], index=1, backend="torch", run_id=None, status="pending", job_ids=[],
                      key=doc["cells"][0]["key"].replace("numpy", "torch"))
    doc["cells"].append(torch_cell)
    cells = [SweepCell.from_dict(c) for c in doc["cells"]]
    doc["paired"] = [e.to_dict() for e in mf.paired_entries(doc["sweep_id"], cells, 3)]


PAIRED_DAMAGE = {
    "a member twice": (lambda e, d: e.update(members=[0, 0]), "name a cell twice"),
    "a member out of range": (lambda e, d: e.update(members=[0, 7]), "a cell this sweep does not have"),
    "one member": (lambda e, d: e.update(members=[0]), "paired/0/members"),
    "members of two blocks": (lambda e, d: d["cells"][1].update(seed=7), "not the cells of one block"),
    "one backend": (lambda e, d: d["cells"][1].update(backend="numpy"), "two or more distinct backends"),
    "index not its place": (lambda e, d: e.update(index=3, path=e["path"].replace("0.json", "3.json")),
                            "its index 3 is not its place"),
    "path elsewhere": (lambda e, d: e.update(path=e["path"].replace("0.json", "1.json")), "its path"),
}


@pytest.mark.parametrize("case", list(PAIRED_DAMAGE))
def test_damaged_paired_entry_is_one_line(tmp_path, capsys, done_sweep, case):
    """A stored paired entry whose members are not one block's distinct cells is refused on load (it reached
    harness.run.paired_timing.new_doc, whose ValueError was a traceback on --resume)."""
    damage, fragment = PAIRED_DAMAGE[case]
    out, path = copy_sweep(done_sweep, tmp_path)
    edit(path, with_a_paired_entry)
    assert harness(capsys, "status", path.parent.name, "--out", out)[0] == 0  # undamaged, it loads
    edit(path, lambda d: damage(d["paired"][0], d))
    before = tree(tmp_path)
    for verb in ("status", "resume", "report"):
        code, err = harness(capsys, verb, path.parent.name, "--out", out)
        one_line_error(code, err, "sweep.json", "paired/0", fragment)
    assert tree(tmp_path) == before


def test_a_paired_entry_s_fields_come_from_its_member_cells(tmp_path, done_sweep):
    """Key, label, seed, device and dtype of a stored paired entry are its cells', whatever the stored copy says."""
    from harness.sweep import manifest as mf

    out, path = copy_sweep(done_sweep, tmp_path)
    edit(path, with_a_paired_entry)
    edit(path, lambda d: d["paired"][0].update(key='x"><script>', label="other", seed=5, device="cuda",
                                                dtype="float32"))
    (entry,) = mf.Manifest.load(out, path.parent.name).paired
    assert (entry.key, entry.label, entry.seed, entry.device, entry.dtype) == \
        ("tiny/cpu/seed=1337/paired", "tiny", 1337, "cpu", None)


def test_a_named_pipe_at_sweep_json_does_not_hang_status(tmp_path, done_sweep):
    """sweep.json is read as a regular file only: a FIFO there is one line, at once (it blocked --status for ever)."""
    out, path = copy_sweep(done_sweep, tmp_path)
    path.unlink()
    os.mkfifo(path)
    proc = run_cli("status", path.parent.name, "--out", str(out), timeout=60)
    one_line_error(proc.returncode, proc.stderr, "sweep.json", "named pipe")


# --- squeue silent: no job is taken for gone -------------------------------------------------------------------------
def test_a_silent_squeue_never_makes_a_queued_job_look_gone(tmp_path, capsys, monkeypatch, done_sweep):
    """squeue failing (None) is not "no job alive": --resume submits nothing and says to retry (one line, exit 2,
    nothing written); --status shows the stored queued/running states and says squeue did not answer."""
    import harness.sweep.slurm as slurm

    out, path = copy_sweep(done_sweep, tmp_path)

    def queued(doc: dict) -> None:
        with_a_paired_entry(doc)
        doc["executor"] = {"kind": "slurm", "jobs": 1, "slurm": {"partition": "debug"}}
        doc["cells"][0].update(status="queued", run_id=None, job_ids=["4242_0"])
        doc["cells"][1].update(status="queued", job_ids=["4242_1"])
        doc["paired"][0].update(status="running", job_ids=["4243"])

    edit(path, queued)
    submitted = []
    monkeypatch.setattr(slurm, "check_cluster", lambda partition: None)
    monkeypatch.setattr(slurm, "job_states", lambda job_ids: None)
    monkeypatch.setattr(slurm.SlurmExecutor, "check_submission", lambda self, *a, **k: None)
    monkeypatch.setattr(slurm.SlurmExecutor, "submit", lambda self, out, cells, dependency=None: submitted.append(
        cells) or [f"9{i}" for i in range(len(cells))])
    before = tree(tmp_path)
    code, err = harness(capsys, "resume", path.parent.name, "--out", out)
    one_line_error(code, err, "squeue did not answer", "retry")
    assert submitted == [] and tree(tmp_path) == before
    from harness.sweep import manifest as mf
    from harness.sweep.state import print_status

    m = mf.Manifest.load(out, path.parent.name)
    assert print_status(m) == {"queued": 2}  # not "pending": cell 0 has no record yet, its job may run
    assert m.paired[0].status == "running"  # not "pending" (no record yet) nor "interrupted"
    assert "squeue did not answer" in capsys.readouterr().err


# --- every SLURM field checked up front -------------------------------------------------------------------------------
@pytest.mark.parametrize("toml, flags, fragment", [
    ("slurm = 5\n", [], "[slurm] must be a table"),
    ('[slurm]\ntime_min = "1h"\n', [], "time_min must be a positive whole number of minutes"),
    ("[slurm]\ngpus_per_job = -1\n", [], "gpus_per_job must be a positive whole number"),
    ("[slurm]\ncpus_per_job = 0\n", [], "cpus_per_job must be a positive whole number"),
    ("[slurm]\narray_parallelism = 1.5\n", [], "array_parallelism must be a positive whole number"),
    ("[slurm]\nqueue = \"x\"\n", [], "unknown key(s) in [slurm]: 'queue'"),
    ('jobs = "2"\n', [], "jobs must be a positive whole number"),
    ("", ["--mem-gb", "inf"], "mem_gb must be a finite number"),
    ("", ["--mem-gb", "nan"], "mem_gb must be a finite number"),
    ("", ["--mem-gb", "0.0001"], "at least 1/1024"),
])
def test_slurm_settings_are_checked_up_front(tmp_path, capsys, monkeypatch, config_file, toml, flags, fragment):
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "grid.toml"
    spec.write_text(toml)
    code, err = harness(capsys, "sweep", spec, "--configs", config_file, "--steps", "2", "--executor", "slurm",
                        "--out", tmp_path / "out", *flags)
    one_line_error(code, err, fragment)
    assert not (tmp_path / "out").exists()


FAKE_SBATCH = """#!/bin/sh
# sbatch that accepts --test-only and refuses the real submission, as a cluster over its job limit does
for a in "$@"; do [ "$a" = --test-only ] && { echo "sbatch: Job 1 to start at now" >&2; exit 0; }; done
echo "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit)" >&2
exit 1
"""


def test_rejected_submission_is_one_line_and_leaves_no_half_made_sweep(tmp_path, config_file):
    """sbatch refusing the array after every check passed: one line with sbatch's reason, and nothing left under
    --out (no manifest, no run directories, no corpus copy). A fake SLURM on PATH: no cluster needed."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    tools = {"sbatch": FAKE_SBATCH, "sinfo": "#!/bin/sh\necho 'debug*'\n", "squeue": "#!/bin/sh\nexit 0\n",
             "srun": "#!/bin/sh\nexit 0\n", "scontrol": "#!/bin/sh\necho 'MaxArraySize = 1001'\n"}
    for name, text in tools.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    out = tmp_path / "out"
    result = run_cli("sweep", "--configs", str(config_file), "--backends", "numpy", "--seeds", "3", "--steps", "2",
                     "--executor", "slurm", "--out", str(out), env={"PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"})
    lines = [line for line in result.stderr.splitlines() if line.startswith("harness: error")]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "job submit limit" in lines[0] and "sbatch refused the job array of 3 cell(s)" in lines[0]
    assert not out.exists(), tree(out)


# --- an empty id is an error, never new work -------------------------------------------------------------------------
@pytest.mark.parametrize("args", [["resume", ""], ["status", ""], ["report", ""]])
def test_empty_id_is_an_error(tmp_path, capsys, monkeypatch, config_file, args):
    monkeypatch.chdir(tmp_path)
    what = (["--configs", config_file, "--backends", "numpy"] if args[0] == "sweep" else
            ["--config", config_file, "--backend", "numpy"] if args[0] == "run" else [])  # short, should work start
    steps = ["--steps", "2", "--no-text"] if args[0] in ("run", "sweep") else []
    code, err = harness(capsys, *args, *what, *steps, "--out", tmp_path / "out")
    one_line_error(code, err, "is empty")
    assert tree(tmp_path) == []


# --- one line, naming the right fix, never silently different -------------------------------------------------------
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_steps_refused_for_memory_names_steps(tmp_path, capsys, config_file, command):
    target = ["--config", config_file, "--backend", "numpy"] if command == "run" else \
        ["--configs", config_file, "--backends", "numpy"]
    code, err = harness(capsys, command, *target, "--steps", str(10**12), "--no-text", "--out", tmp_path / "out")
    one_line_error(code, err, "needs about", "mostly curves", "--steps")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("toml, flags, fragment", [
    ("", ["--backends", "numpy", "--precision", "bf16"], "precision applies to torch and flux only"),
    ('seeds = "3"\n', [], "seeds = '3'"),
    ("seeds = 3.5\n", [], "seeds = 3.5"),
])
def test_sweep_refuses_what_run_refuses(tmp_path, capsys, monkeypatch, config_file, toml, flags, fragment):
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "grid.toml"
    spec.write_text(toml)
    code, err = harness(capsys, "sweep", spec, "--configs", config_file, "--steps", "2", "--no-text",
                        "--out", tmp_path / "out", *flags)
    one_line_error(code, err, fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change", [{"backend_options": {"dtype": "float16"}}, {"backend": "mxnet"}])
def test_resume_writes_no_spec_for_a_cell_it_rejects(tmp_path, capsys, done_sweep, change):
    out, path = copy_sweep(done_sweep, tmp_path)

    def add_cell(doc: dict) -> None:
        cell = dict(doc["cells"][0], index=1, key="extra", run_id=None, status="pending", attempts=0, job_ids=[])
        cell.update(change)
        doc["cells"].append(cell)

    edit(path, add_cell)
    before = tree(tmp_path)
    code, err = harness(capsys, "resume", path.parent.name, "--out", out)
    one_line_error(code, err)
    assert "float16" in err or "mxnet" in err
    assert tree(tmp_path) == before  # no run directory for a cell the worker would refuse


@needs_mounts
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_disk_full_while_training_prints_one_error_line(tmp_path, config_file, command):
    """The worker says the disk is full; the parent, failing to write the report (run) or the manifest (sweep) for
    the same reason, does not say it a second time."""
    full = tmp_path / "full"
    full.mkdir()
    what = f"run --config {config_file} --backend numpy" if command == "run" else \
        f"sweep --configs {config_file} --backends numpy --seeds 3"
    r = in_own_mounts(textwrap.dedent(f"""\
        mount -t tmpfs -o size=2m tmpfs {full}
        HARNESS_TEST_PAUSE_AT=after-record:sleep HARNESS_TEST_PAUSE_S=2 {sys.executable} -m harness.cli {what} \\
            --steps 3000 --checkpoint-every 100 --quiet --no-text --out {full}/out &
        pid=$!
        while ! ls {full}/out/runs/*/numpy.json >/dev/null 2>&1; do sleep 0.1; done
        dd if=/dev/zero of={full}/fill bs=64k 2>/dev/null
        wait $pid; echo rc=$?
        """))
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower() and "OSError" not in line]
    assert "rc=2" in r.stdout and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert len(errors) == 1 and "No space left on device" in errors[0], r.stderr
    assert ("no report" if command == "run" else "stopped: the disk is full") in r.stderr, r.stderr


@needs_mounts
def test_disk_full_while_a_sweep_prepares_leaves_no_stray_run_directory(tmp_path, config_file):
    """The disk fills while the cells' run directories are made: one line, and no run directory that no manifest
    lists (a new sweep that never started a cell leaves nothing)."""
    full = tmp_path / "full"
    full.mkdir()
    py = f"{sys.executable} -m harness.cli"
    r = in_own_mounts(f"mount -t tmpfs -o size=360k tmpfs {full}; {py} sweep --configs {config_file} --backends "
                       f"numpy --seeds 40 --steps 2 --no-text --quiet --out {full}/out; echo rc=$?; "
                       f"ls -A {full}/out/runs 2>/dev/null; echo manifests:; cat {full}/out/sweeps/*/sweep.json "
                       "2>/dev/null")
    assert "rc=2" in r.stdout and "No space left on device" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len([x for x in r.stderr.splitlines() if x.startswith("harness: error")]) == 1, r.stderr
    listing, _, manifest = r.stdout.partition("rc=2")[2].partition("manifests:")
    listed = set(manifest.split('"run_id": "')[1:]) if manifest.strip() else set()
    assert not listing.split() or set(listing.split()) <= {x.split('"')[0] for x in listed}, r.stdout


# --- states a person can act on ------------------------------------------------------------------------------------
def test_failed_cells_name_the_resume_command_and_resumes_record_their_step(tmp_path, config_file):
    out = tmp_path / "out"
    common = ["--configs", str(config_file), "--backends", "numpy", "--seeds", "2", "--steps", "30",
              "--checkpoint-every", "10", "--no-text", "--no-report", "--quiet", "--out", str(out)]
    first = run_cli("sweep", *common, env={"HARNESS_TEST_PAUSE_AT": "after-checkpoint:kill:2"})  # each dies at 20
    (path,) = (out / "sweeps").glob("*/sweep.json")
    sweep_id = path.parent.name
    assert first.returncode == 1, first.stderr
    assert f"2 failed: run them again (each from its last checkpoint) with `harness resume {sweep_id} " \
           f"--out {out}`" in first.stderr
    again = run_cli("resume", sweep_id, "--out", str(out), "--no-report", "--quiet")
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("numpy: resuming from step 20 of 30 (checkpoint numpy.ckpt.npz)") == 2, again.stderr
    for cell in json.loads(path.read_text())["cells"]:
        rec = store.RunRecord.load(out / "runs" / cell["run_id"] / "numpy.json")
        assert rec.status is store.Status.COMPLETED and rec.resumed_from_step == [20]


def test_every_resume_of_a_run_is_recorded_and_old_records_are_refused(tmp_path, config_file):
    out = tmp_path / "out"
    args = ["--out", str(out), "--quiet", "--no-report"]
    first = run_cli("run", "--config", str(config_file), "--steps", "60", "--checkpoint-every", "20", "--backend",
                    "numpy", "--no-text", *args, env={"HARNESS_TEST_PAUSE_AT": "after-checkpoint:kill"})
    assert first.returncode == 1, first.stderr
    (run,) = (out / "runs").iterdir()
    second = run_cli("resume", run.name, *args, env={"HARNESS_TEST_PAUSE_AT": "after-checkpoint:kill"})
    assert second.returncode == 1 and "resuming from step 20" in second.stderr, second.stderr
    third = run_cli("resume", run.name, *args)
    assert third.returncode == 0 and "resuming from step 40" in third.stderr, third.stderr
    assert "resumed from step 20, then 40" in third.stderr
    rec = store.RunRecord.load(run / "numpy.json")
    assert rec.resumed_from_step == [20, 40] and rec.schema_version == store.record.SCHEMA_VERSION == 4
    report = run_cli("report", run.name, "--out", str(out))
    assert report.returncode == 0 and "resumed from step" in (out / f"{run.name}.html").read_text()
    edit(run / "numpy.json", lambda d: d.update(resumed_from_step=["x"]))
    with pytest.raises(UsageError, match="resumed_from_step/0"):
        store.RunRecord.load(run / "numpy.json")
    edit(run / "numpy.json", lambda d: (d.update(schema_version=2), d.pop("resumed_from_step")))
    with pytest.raises(UsageError, match=r"older nanogpt-parity \(schema 2\); re-run it"):  # never read as version 2
        store.RunRecord.load(run / "numpy.json")


def test_an_out_path_with_a_newline_never_reaches_a_job_script(tmp_path: Path) -> None:
    """On SLURM the --out path is written into the job script (#SBATCH --output, the worker's command line): a newline
    in it would end the #SBATCH line and run the rest as a shell command. Refused up front, nothing written."""
    out = tmp_path / "a\ntouch PWNED\n#" / "out"
    proc = run_cli("sweep", "--backend", "numpy", "--steps", "2", "--executor", "slurm", "--partition", "debug",
                   "--out", str(out), cwd=tmp_path)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "--out holds the control character" in lines[0], proc.stderr
    assert not (tmp_path / "PWNED").exists() and sorted(tmp_path.iterdir()) == []
