"""What a newcomer reads first holds: every command in README.md's code blocks parses with the parser that will run
it (the harness's, gpu_check's, pip's extras), and runs offline as written unless its block says what it needs
(network, Julia, an NVIDIA GPU, a SLURM cluster); the install hints are the backends' declarations' own; no tracker
numbers; the advice in pyproject.toml works.

`python tests/test_docs.py` runs every README command that needs nothing beyond the project (in the directory it is
started from: a fresh clone, offline) and prints each one's exit status and wall time.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# what a command may need beyond the project's own files, as its comment (or the comment line before it) says
NEEDS = re.compile(r"\bneeds (network|Julia|an NVIDIA GPU|a SLURM cluster)\b")
# the harness commands that read a text to train on: offline, each names its data (`--data sample` or a file)
TRAINS = {"run", "parity", "sweep", "bench overhead", "bench noise", "kit export"}


def trains(argv: list[str]) -> bool:
    """Whether `argv` is a harness command that reads a text to train on."""
    words = [w for w in argv[1:3] if not w.startswith("-")]
    return argv[0] == "harness" and bool(words) and (words[0] in TRAINS or " ".join(words) in TRAINS)


@dataclass
class Command:
    """One command of a README code block: its words, what it needs (None: nothing beyond the project), its line."""

    argv: list[str]
    env: dict[str, str]
    needs: str | None
    line: str


def readme_commands(text: str) -> list[Command]:
    """Every command in the ```bash blocks of `text`: a trailing `# ...` comment, or a comment line just before it,
    that says "needs network|Julia|an NVIDIA GPU|a SLURM cluster" marks what it needs."""
    found = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        pending = None
        for raw in block.replace("\\\n", " ").splitlines():
            code, _, comment = raw.partition(" #") if not raw.lstrip().startswith("#") else ("", "", raw)
            mark = NEEDS.search(comment)
            words = shlex.split(code)
            if not words:
                pending = mark[1] if mark else pending
                continue
            env = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            found.append(Command(words, env, mark[1] if mark else pending, raw.strip()))
            pending = None
    return found


COMMANDS = readme_commands(README.read_text(encoding="utf-8"))


def test_the_readme_has_commands():
    assert len(COMMANDS) >= 10 and {c.argv[0] for c in COMMANDS} >= {"pip", "harness", "pytest", "python"}


@pytest.mark.parametrize("command", COMMANDS, ids=[c.line[:60] for c in COMMANDS])
def test_every_readme_command_parses(command: Command, capsys: pytest.CaptureFixture):
    """With the parser that will run it, in this process: the harness's, gpu_check's; pip's extras exist."""
    argv = command.argv
    if argv[0] == "harness":
        from harness.cli.main import build_parser

        build_parser().parse_args(argv[1:])  # a usage error is SystemExit: the test fails
    elif argv[:2] == ["python", "tools/gpu_check.py"]:
        from gpucheck import cli

        cli.build_parser().parse_args(cli.join_mode(argv[2:]))
    elif argv[:2] == ["pip", "install"]:
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib

        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for word in argv[2:]:
            named = re.fullmatch(r"\.\[([\w,]+)\]", word)
            assert named is None or set(named[1].split(",")) <= set(extras), word
    elif argv[0] == "pytest":
        assert argv[1:] in ([], ["-m", "slow"]), argv
    else:
        pytest.fail(f"README command {command.line!r}: this test cannot check it; teach it how")
    assert capsys.readouterr().err == ""


def test_a_readme_command_runs_offline_or_says_what_it_needs():
    """Offline with the project's files only: a command that trains names its data in the block itself (`--data`;
    the default would download Tiny Shakespeare), pip and the GPU check on a GPU say what they need."""
    problems = []
    for c in COMMANDS:
        if c.needs:
            continue
        if trains(c.argv) and "--data" not in c.argv:
            problems.append(f"{c.line}: name the data (--data sample), or say what it needs")
        if c.argv[0] == "pip" or (c.argv[:2] == ["python", "tools/gpu_check.py"]
                                  and not {"--plan", "--dry-run"} & set(c.argv)):
            problems.append(f"{c.line}: say what it needs (e.g. `# needs network`)")
    assert problems == []


def test_the_offline_rule_finds_a_command_that_would_download():
    """The check above can fail: the README of an earlier release had the first run without --data."""
    old = "```bash\nharness run --size small --backend torch,numpy --steps 300   # train both\n```\n"
    (command,) = readme_commands(old)
    assert command.needs is None and trains(command.argv) and "--data" not in command.argv
    marked = readme_commands("```bash\n# needs an NVIDIA GPU:\nHARNESS_DATA=x python tools/gpu_check.py --out o\n"
                             "harness doctor   # anywhere\n```\n")
    assert [c.needs for c in marked] == ["an NVIDIA GPU", None] and marked[0].env == {"HARNESS_DATA": "x"}


def test_the_readme_quotes_each_install_hint_of_the_declarations():
    """One install hint per optional part, the same everywhere: the README quotes each declaration's `install` and
    `cuda_install` line as it is, and names no other CuPy or JAX-plugin install."""
    from harness.backends import declarations

    text = " ".join(README.read_text(encoding="utf-8").split())
    hints = {h for d in declarations().values() for h in (d.cuda_install,) if h}
    missing = [h for h in hints if f"`{h}`" not in text and h.split(" (")[0] not in text]
    assert missing == []
    for doc in (README, ROOT / "docs" / "usage.md"):
        lines = " ".join(doc.read_text(encoding="utf-8").split())
        for install in re.findall(r"`(pip install [^`]*(?:cupy|jax\[cuda)[^`]*)`", lines):
            assert install in hints, f"{doc.name}: `{install}` is not a declaration's hint ({hints})"


def test_numpy_on_cuda_without_a_gpu_says_there_is_none(monkeypatch: pytest.MonkeyPatch):
    """No GPU here: the error says so, rather than asking for CuPy (or torch's CUDA build, or JAX's plugin); with a GPU
    but no CuPy, the declaration's line."""
    import builtins

    from harness import environment
    from harness.backends import BackendUnavailable, backend_class, jax_options, numpy_backend
    from harness.backends.base import NO_GPU

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy":
            raise ImportError("no cupy")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    monkeypatch.setattr(numpy_backend, "READY_CHECK_IN_CHILD", False)
    for seen, words in ((False, "there is no NVIDIA GPU here"), (True, numpy_backend.DECLARATION.cuda_install)):
        monkeypatch.setattr(environment, "gpu_seen", lambda seen=seen: seen)
        with pytest.raises(BackendUnavailable) as exc:
            numpy_backend.NumpyBackend.check_available("cuda")
        assert words in str(exc.value) and "needs CuPy" in str(exc.value), str(exc.value)
        for name, hint in (("torch", "install its CUDA build"), ("jax", "jax[cuda12]")):
            if not jax_options.installed(name):
                continue
            with pytest.raises(BackendUnavailable) as exc:  # every backend says the same where there is no GPU
                backend_class(name).check_available("cuda")
            assert (seen or NO_GPU in str(exc.value)) and (hint in str(exc.value)) == seen, str(exc.value)


# --- no tracker numbers -------------------------------------------------------------------------------------------
TRACKER = re.compile(r"\bissues? ?#?\d|\bissue\d|\btest_\d+_|(?<![a-z])round[-_]?\d\b|reliability round \d|"
                     r"\bitems? \d", re.I)


def tracked_text_files() -> list[Path]:
    done = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    suffixes = {".py", ".md", ".toml", ".jl", ".txt", ".sh", ".cfg", ".json", ".yml", ".yaml", ".html", ".j2", ""}
    return [ROOT / f for f in done.stdout.splitlines() if Path(f).suffix in suffixes and (ROOT / f).is_file()]


def test_no_tracker_numbers_anywhere():
    """Users read the docs and the help, not the tracker: no "issue 12", "round 4" or test_12_ in any file."""
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}" for p in tracked_text_files()
             for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if TRACKER.search(line) and p.name != "test_docs.py"]
    assert found == []


def test_the_tracker_pattern_finds_what_it_must():
    for text in ("(issue 21)", "Issue 29 item 6", "def test_10_empty_id", "reliability round 4", "round-4",
                 "test_reliability_round4",
                 "# --- item 2: markup"):
        assert TRACKER.search(text), text
    for text in ("the issue is", "4 rounds", "around 4", "round 1: runner then bare", "test_one_line",
                 "the items of a list"):
        assert not TRACKER.search(text), text


MD_NAME = r"(?<![\w/.-])((?:[a-z][\w-]*/)*[A-Za-z][\w-]*\.md)\b"  # docs/usage.md, README.md; not OUT/summary.md


def test_every_markdown_file_a_file_names_exists():
    """A doc or a comment that cites a project file `NAME.md` cites one that exists (the presets cited a DESIGN.md
    that is not in the project). Placeholders (OUT/summary.md, what gpu_check writes) aside."""
    names = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.md") if ".git" not in p.parts}
    bases = {Path(n).name for n in names} | {"summary.md"}
    missing = {f"{p.relative_to(ROOT)}: {name}" for p in tracked_text_files() if p.name != "test_docs.py"
               for name in re.findall(MD_NAME, p.read_text(errors="replace"))
               if name not in names and Path(name).name not in bases}
    assert sorted(missing) == []


def test_the_single_process_advice_in_pyproject_works():
    """pyproject.toml says how to run the suite in one process; that command must run (collect) as written."""
    comment = (ROOT / "pyproject.toml").read_text()
    advice = re.search(r"`pytest ([^`]*)` runs it in this one process", comment)
    assert advice, "pyproject.toml no longer says how to run the suite in one process"
    done = subprocess.run([sys.executable, "-m", "pytest", *shlex.split(advice[1]), "--collect-only", "-q",
                           "tests/test_docs.py::test_the_readme_has_commands"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-500:] + done.stderr[-500:]


# --- `python tests/test_docs.py`: the README's commands, run ----------------------------------------------------
def run_offline() -> int:
    """Run every README command that needs nothing beyond the project, here; print each one's status and time."""
    import os

    worst = 0
    for c in COMMANDS:
        if c.needs:
            print(f"skipped (needs {c.needs}): {c.line}", flush=True)
            continue
        start = time.monotonic()
        load = os.getloadavg()[0]
        done = subprocess.run(c.argv, env={**os.environ, **c.env}, capture_output=True, text=True)
        took = time.monotonic() - start
        print(f"exit {done.returncode} in {took:.1f} s (load {load:.1f}): {c.line}", flush=True)
        if done.returncode:  # the last lines of each stream (pytest's summary is on stdout)
            tail = done.stdout.strip().splitlines()[-5:] + done.stderr.strip().splitlines()[-3:]
            print("  " + "\n  ".join(tail), flush=True)
            worst = max(worst, done.returncode)
    return worst


if __name__ == "__main__":
    sys.exit(run_offline())
