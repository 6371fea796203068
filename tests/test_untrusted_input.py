"""Files the harness did not write itself, read as an attacker or an accident would shape them.

Each test is the attack or the accident: markup in the names of a record reaching a report page (the browser half
is in test_browser.py), a kit manifest pointing outside the kit or of the wrong shape, an .npz declaring gigabytes,
a FIFO or a device where a file belongs, a big-endian or pickled results file, a --page path that is a directory,
a full disk under `kit export`, a backend that crashes in `harness parity`. The answer is always one line naming
the problem and the fix, exit status 2 (or the documented status), nothing written, nothing blocked, nothing run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from conftest import data_path, run_cli

from harness import store
from harness.cli.main import main
from harness.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
SCRIPT = 'x"><script>document.title="PWNED"</script>'


def one_line(code: int, err: str, *fragments: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def harness(capsys: pytest.CaptureFixture, *args: object) -> tuple[int, str, str]:
    with deadline(30):
        code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (not hang) where a read blocks: a FIFO opened for reading waits for a writer forever."""
    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# --- nothing a record holds can inject markup into a page ----------------------------------------------------------
class Elements(HTMLParser):
    """Every start tag with its attributes, as a browser's tokenizer splits them."""

    def __init__(self, html: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, dict(attrs)))


def test_a_figure_title_cannot_close_its_attribute() -> None:
    from harness.report import figures

    fig, _ = figures.plt.subplots()
    svg = str(figures.to_svg(fig, SCRIPT))
    tags = Elements(svg).tags
    assert not [t for t, _ in tags if t == "script"]
    assert tags[0][0] == "svg" and tags[0][1]["aria-label"] == SCRIPT  # shown as written, as an attribute


def test_a_dollar_in_a_name_is_drawn_not_parsed_as_mathtext(tmp_path: Path) -> None:
    """matplotlib reads `$...$` as mathtext and raises on a malformed formula: a name is drawn as written."""
    from test_report import make_run

    from harness.report import analysis, figures

    out = tmp_path / "out"
    view = analysis.load_view(store.RunPaths(out, make_run(out, steps=40)))
    for i, rec in enumerate(view.records):  # names as a record from elsewhere could hold them (past the schema)
        rec.backend = ["a$\\frac{$b", "c$^$d"][i]
    view.spec.label = "x$_$y"
    for fig in (figures.loss_figure(view), figures.cost_figure(view), figures.scaling_figure([view]),
                figures.deviation_figure(analysis.pairs(view))):
        assert fig is not None and "$" in str(fig)


@pytest.mark.parametrize("field, value", [("config/name", SCRIPT), ("backend", "torch<script>"),
                                          ("run_id", 'r"><img src=x>'), ("config/name", "a$b")])
def test_a_record_with_markup_in_a_name_is_refused_by_the_report(tmp_path: Path, field: str, value: str) -> None:
    """Names are checked against the patterns they were made with (store.record.RECORD_JSON_SCHEMA), not rendered."""
    from test_report import make_run

    from harness.report import write_report

    out = tmp_path / "out"
    run_id = make_run(out, steps=40)
    path = out / "runs" / run_id / "numpy.json"
    rec = json.loads(path.read_text())
    if field == "config/name":
        rec["config"]["name"] = value
    else:
        rec[field] = value
    path.write_text(json.dumps(rec))
    with pytest.raises(UsageError, match=f"numpy.json' is invalid at field '{field}'"):
        write_report(out, [run_id])
    assert not list(out.glob("*.html"))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A real one-cell sweep (numpy, two steps), run through the CLI."""
    out = tmp_path_factory.mktemp("sweep") / "out"
    proc = run_cli("sweep", "--backends", "numpy", "--seeds", "1", "--steps", "2", "--eval-interval", "1",
                   "--set", "n_embd=16", "--no-text", "--no-report", "--quiet", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    (sweep_dir,) = (out / "sweeps").iterdir()
    return out, sweep_dir.name


def plant_in_sweep(out: Path, sweep_id: str, name: str) -> None:
    """The attack: a cell's record whose config name is markup."""
    for path in (out / "runs").glob("*/numpy.json"):
        rec = json.loads(path.read_text())
        rec["config"]["name"] = name
        path.write_text(json.dumps(rec))


def test_sweep_page_holds_no_markup_from_a_record(sweep: tuple[Path, str], tmp_path: Path) -> None:
    from harness.report.sweep import write_sweep_report

    out = tmp_path / "out"
    shutil.copytree(sweep[0], out)
    plant_in_sweep(out, sweep[1], SCRIPT)
    page = write_sweep_report(out, sweep[1]).read_text()
    assert not [t for t, _ in Elements(page).tags if t == "script"]
    assert "PWNED" not in page.replace("&#34;PWNED&#34;", "")  # at most shown as text, never as markup


# --- a kit reads only its own files --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kit") / "kit"
    assert main(["kit", "export", "--data", str(data_path()), "--steps", "1", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def good(kit: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A results file holding the oracle's own answers (passes in float64)."""
    path = tmp_path_factory.mktemp("good") / "results.npz"
    with np.load(kit / "expected.npz") as f:
        np.savez(path, **{k: f[k] for k in f.files if k != "logits_loss"})
    return path


def tampered(kit: Path, tmp_path: Path, change) -> Path:
    bad = tmp_path / "kit"
    shutil.copytree(kit, bad, symlinks=True)
    manifest = json.loads((bad / "manifest.json").read_text())
    change(manifest, bad)
    (bad / "manifest.json").write_text(json.dumps(manifest))
    return bad


def _outside(kit: Path, tmp_path: Path) -> Path:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(kit / "batches.npz", outside / "batches.npz")  # the very bytes and sha256 the manifest expects
    return outside / "batches.npz"


@pytest.mark.parametrize("how", ["absolute", "dotdot", "separator", "symlink out"])
def test_kit_files_stay_inside_the_kit(how: str, kit: Path, good: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture) -> None:
    outside = _outside(kit, tmp_path)

    def change(m: dict, bad: Path) -> None:
        entry = m["files"].pop("batches.npz")
        if how == "absolute":
            m["files"][str(outside)] = entry
        elif how == "dotdot":
            m["files"][os.path.relpath(outside, bad)] = entry
        elif how == "separator":
            (bad / "sub").mkdir()
            shutil.copy(outside, bad / "sub" / "batches.npz")
            m["files"]["sub/batches.npz"] = entry
        else:
            m["files"]["batches.npz"] = entry
            (bad / "batches.npz").unlink()
            (bad / "batches.npz").symlink_to(outside)

    bad = tampered(kit, tmp_path, change)
    code, out, err = harness(capsys, "kit", "check", bad, good)
    line = one_line(code, err, "export the kit again")
    assert ("outside the kit directory" in line) if how == "symlink out" else ("not a plain .npz file name" in line)
    assert out == "" and not (good.parent / "results.check.json").exists()


# --- a manifest of the wrong shape is one line naming the field --------------------------------------------------
MANIFESTS = {
    "files a list": (lambda m: m.update(files=list(m["files"])), "'files' is a list, expected an object"),
    "files entry a string": (lambda m: m["files"].update({"weights.npz": "abc"}), "'files/weights.npz' is a string"),
    "parameters missing": (lambda m: m.pop("parameters"), "'parameters' is missing"),
    "parameters an int": (lambda m: m.update(parameters=3), "'parameters' is a whole number"),
    "steps missing": (lambda m: m.pop("steps"), "'steps' is missing"),
    "steps a string": (lambda m: m.update(steps="3"), "'steps' is a string, expected an integer"),
    "config missing": (lambda m: m.pop("config"), "'config' is missing"),
    "config a list": (lambda m: m.update(config=[]), "'config' is a list"),
    "size a list": (lambda m: m.update(size=["small"]), "'size' is [\"small\"], expected \"small\""),
    "tolerances a string": (lambda m: m.update(tolerances="tight"), "'tolerances' is a string"),
    "weights.npz not listed": (lambda m: m["files"].pop("weights.npz"), "'files/weights.npz' is missing"),
}


@pytest.mark.parametrize("variant", list(MANIFESTS))
def test_malformed_manifest_names_the_field(variant: str, kit: Path, good: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    change, fragment = MANIFESTS[variant]
    bad = tampered(kit, tmp_path, lambda m, _: change(m))
    code, out, err = harness(capsys, "kit", "check", bad, good)
    one_line(code, err, "kit manifest", fragment, "export the kit again with `harness kit export`")
    assert out == ""


def test_the_exported_manifest_is_what_its_schema_describes(kit: Path) -> None:
    """Every field `kit export` writes is declared in harness.kit.schema.FIELDS (a new field must be added there)."""
    import jsonschema

    from harness.kit.schema import MANIFEST_SCHEMA

    manifest = json.loads((kit / "manifest.json").read_text())
    jsonschema.Draft202012Validator(MANIFEST_SCHEMA).validate(manifest)
    assert set(manifest) <= set(MANIFEST_SCHEMA["properties"]) and MANIFEST_SCHEMA["additionalProperties"] is False


# --- every read is bounded ------------------------------------------------------------------------------------------
def bomb_npz(path: Path, key: str, shape: tuple[int, ...], chunk: int = 1 << 20) -> None:
    """An .npz whose one member declares `shape` (float64) and inflates to that many bytes, written in a few MB:
    the deflate stream of one zero chunk after a full flush is the same bytes every time, so it is repeated."""
    hdr = io.BytesIO()
    np.lib.format.write_array_header_1_0(hdr, {"descr": "<f8", "fortran_order": False, "shape": shape})
    header = hdr.getvalue()
    nbytes = int(np.prod(shape)) * 8
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(header) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(bytes(chunk)) + c.flush(zlib.Z_FULL_FLUSH)
    n, rest = divmod(nbytes, chunk)
    tail = c.compress(bytes(rest)) + c.flush(zlib.Z_FINISH)
    size, comp, name = len(header) + nbytes, len(head) + n * len(block) + len(tail), f"{key}.npy".encode()
    with open(path, "wb") as f:  # a zip with one deflated member (its CRC is never reached by a bounded reader)
        f.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0, 0, comp, size, len(name), 0) + name + head)
        for _ in range(n):
            f.write(block)
        f.write(tail)
        at = f.tell()
        f.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0, 0, comp, size, len(name), 0, 0,
                            0, 0, 0, 0) + name)
        f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, f.tell() - at, at, 0))


def huge_header_npz(path: Path, key: str, shape: tuple[int, ...]) -> None:
    """An .npz whose member's header claims `shape` but holds no data."""
    hdr = io.BytesIO()
    np.lib.format.write_array_header_1_0(hdr, {"descr": "<f8", "fortran_order": False, "shape": shape})
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{key}.npy", hdr.getvalue())


# The check in a child with its address space capped at 2 GiB (a regression fails with MemoryError, not by taking
# the machine's memory); the wrapper prints the child's peak resident set in KiB.
MEASURED = """
import resource, subprocess, sys
def cap():
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
p = subprocess.run([sys.executable, "-m", "harness.cli", *sys.argv[1:]], preexec_fn=cap, capture_output=True,
                   text=True, timeout=120)
sys.stdout.write(p.stdout)
sys.stderr.write(p.stderr)
print(f"maxrss={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}")
sys.exit(p.returncode)
"""


@pytest.mark.parametrize("kind", ["3 GiB deflated member", "header claiming (10^6, 10^6)"])
def test_results_declaring_gigabytes_are_refused_before_reading(kind: str, kit: Path, tmp_path: Path) -> None:
    path = tmp_path / "results.npz"
    if kind.startswith("3 GiB"):
        bomb_npz(path, "logits", ((3 << 30) // 8,))
        assert path.stat().st_size < 4e6
    else:
        huge_header_npz(path, "logits", (10**6, 10**6))
    proc = subprocess.run([sys.executable, "-c", MEASURED, "kit", "check", str(kit), str(path)],
                          capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    rss = proc.stdout.rsplit("maxrss=", 1)[1]
    one_line(proc.returncode, proc.stderr, "'logits' has shape", "expected (16, 64, 65)")
    assert int(rss) < 200 * 1024, f"peak RSS {int(rss) / 1024:.0f} MiB"
    assert not (tmp_path / "results.check.json").exists()


def test_a_kit_file_declaring_more_than_its_manifest_is_refused(kit: Path, good: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    """A kit whose file (and sha256) was replaced consistently: the .npy headers must still match the manifest."""
    from harness.kit.export import sha256

    def change(m: dict, bad: Path) -> None:
        huge_header_npz(bad / "batches.npz", "x", (10**6, 10**6))
        blob = (bad / "batches.npz").read_bytes()
        m["files"]["batches.npz"].update(sha256=sha256(blob), bytes=len(blob))

    bad = tampered(kit, tmp_path, change)
    code, _, err = harness(capsys, "kit", "check", bad, good)
    one_line(code, err, "kit file batches.npz: array 'x' is float64 (1000000, 1000000)", "export the kit again")


# --- only regular files are read, and a FIFO never blocks -----------------------------------------------------------
def special(kind: str, tmp_path: Path) -> tuple[str, str]:
    """(path, what the message must call it) of a file that exists but is not a regular file."""
    if kind == "fifo":
        path = tmp_path / f"fifo-{len(list(tmp_path.iterdir()))}"
        os.mkfifo(path)
        return str(path), "is a named pipe (FIFO), not a regular file"
    if kind == "directory":
        return str(tmp_path), "is a directory, not a regular file"
    return {"/dev/zero": "/dev/zero", "/dev/stdin": "/dev/stdin"}[kind], "is a character device, not a regular file"


KINDS = ["/dev/zero", "fifo", "/dev/stdin", "directory"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("option", ["--config", "--data"])
def test_a_path_that_is_no_regular_file_says_what_it_is(option: str, kind: str, tmp_path: Path) -> None:
    """In a child process (stdin /dev/null): before the fix /dev/zero or a FIFO 'did not exist', or blocked."""
    path, words = special(kind, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "kit", "export", option, path, "--steps", "1",
                           "--out", str(tmp_path / "kit")], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL, env=dict(os.environ, HARNESS_DATA=str(data_path())))
    one_line(proc.returncode, proc.stderr, f"{path!r} {words}")
    assert not (tmp_path / "kit").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_results_that_are_no_regular_file_are_refused_at_once(kind: str, kit: Path, tmp_path: Path) -> None:
    path, words = special(kind, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "kit", "check", str(kit), path, "--page",
                           str(tmp_path / "c.html"), "--verdict", str(tmp_path / "c.json")], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    one_line(proc.returncode, proc.stderr, f"results file {path!r} {words}")


def test_a_sweep_file_or_kit_that_is_no_regular_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path, words = special("fifo", tmp_path)
    code, _, err = harness(capsys, "sweep", path, "--out", tmp_path / "out")
    one_line(code, err, f"sweep file {path!r} {words}")
    code, _, err = harness(capsys, "kit", "check", "/dev/zero", path)
    one_line(code, err, "kit '/dev/zero' is a character device, not a directory")
    bad = tmp_path / "kit"
    bad.mkdir()
    os.mkfifo(bad / "manifest.json")
    code, _, err = harness(capsys, "kit", "check", bad, path)
    one_line(code, err, "manifest.json' is a named pipe (FIFO)")


def test_a_fifo_as_a_run_record_does_not_block_the_report(tmp_path: Path) -> None:
    from test_report import make_run

    from harness.report import write_report

    out = tmp_path / "out"
    run_id = make_run(out, steps=40)
    (out / "runs" / run_id / "numpy.json").unlink()
    os.mkfifo(out / "runs" / run_id / "numpy.json")
    with pytest.raises(UsageError, match=r"numpy.json' is a named pipe \(FIFO\), not a regular file"), deadline(30):
        write_report(out, [run_id])


# --- kit check's dtypes, messages and outputs -----------------------------------------------------------------------
def test_big_endian_float64_results_are_graded_as_float64(kit: Path, good: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "be.npz"
    with np.load(good) as f:
        np.savez(path, **{k: f[k].astype(">f8") for k in f.files})
    code, out, err = harness(capsys, "kit", "check", kit, path)
    assert code == 0 and "PASS" in out and "float64 results" in out, out + err
    assert json.loads((tmp_path / "be.check.json").read_text())["dtype"] == "float64"
    np.savez(path, **{"loss": np.zeros(1, dtype=">i8")})
    code, _, err = harness(capsys, "kit", "check", kit, path)
    one_line(code, err, "'loss' has dtype int64 (big-endian); write float32 or float64")


@pytest.mark.parametrize("how", ["object array", "pickle file"])
def test_pickles_are_refused_in_our_words(how: str, kit: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "results.npz"
    if how == "object array":
        np.savez(path, loss=np.array([{"a": 1}], dtype=object))
    else:
        import pickle

        path.write_bytes(pickle.dumps({"loss": [1.0]}))
    code, _, err = harness(capsys, "kit", "check", kit, path)
    line = one_line(code, err)
    assert "allow_pickle" not in line and "pickle=" not in line
    assert ("holds Python objects" in line) if how == "object array" else ("not a readable .npz" in line)


def test_a_page_path_that_is_a_directory_writes_nothing(kit: Path, good: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    results = tmp_path / "results.npz"
    shutil.copy(good, results)
    (tmp_path / "pages").mkdir()
    code, out, err = harness(capsys, "kit", "check", kit, results, "--page", tmp_path / "pages")
    line = one_line(code, err, f"--page {str(tmp_path / 'pages')!r} is a directory, not a file")
    assert ".tmp" not in line and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pages", "results.npz"]
    assert not list((tmp_path / "pages").iterdir())
    code, _, err = harness(capsys, "kit", "check", kit, results, "--verdict", "/dev/null")
    one_line(code, err, "--verdict '/dev/null' is a character device, not a file")


def test_no_verdict_is_written_when_the_page_fails(kit: Path, good: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.kit import page

    def broken(*args: object) -> str:
        raise RuntimeError("the page cannot be rendered")

    results = tmp_path / "results.npz"
    shutil.copy(good, results)
    monkeypatch.setattr(page, "render_html", broken)
    with pytest.raises(RuntimeError):
        main(["kit", "check", str(kit), str(results)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.npz"]  # neither the page nor the verdict


KILL_ON_SECOND_WRITE = """
import os, signal, sys
from harness import store
calls = []
real = store.atomic_write_bytes
def write(path, blob, before_rename=None):
    calls.append(path)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # killed with one kit file written
    return real(path, blob, before_rename)
store.atomic_write_bytes = write
from harness.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_export_killed_midway_does_not_block_the_next(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "kit"
    proc = subprocess.run([sys.executable, "-c", KILL_ON_SECOND_WRITE, "kit", "export", "--data", str(data_path()),
                           "--steps", "1", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (out / "weights.npz").exists() and not (out / "manifest.json").exists()  # an unfinished kit
    code, out_text, err = harness(capsys, "kit", "export", "--data", data_path(), "--steps", "1", "--out", out)
    assert code == 0, err
    assert "removing the unfinished kit" in err and "kit written" in err and out_text == f"{out}\n"
    assert (out / "manifest.json").exists() and not list(out.glob(".*"))


needs_mounts = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare")
                                  or subprocess.run(["unshare", "-m", "true"]).returncode != 0,
                                  reason="needs root and unshare for a private tmpfs")


@needs_mounts
def test_export_on_a_full_disk_leaves_nothing_behind(tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    py = f"{sys.executable} -m harness.cli.main kit export --data {data_path()} --steps 1 --out {full}/kit"
    script = (f"mount -t tmpfs -o size=400k tmpfs {full}; {py}; echo rc=$?; ls -A {full}/kit 2>&1; {py}; "
              f"echo rc=$?; mount -o remount,size=8m {full}; {py}; echo rc=$?; ls -A {full}/kit")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    first, second, third = proc.stdout.split("rc=")[1:4]
    assert first.startswith("2") and "No such file or directory" in first, proc.stdout  # nothing left, not even --out
    assert second.startswith("2") and third.startswith("0"), proc.stdout + proc.stderr
    assert "is not empty" not in proc.stderr and "No space left on device" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("harness: error")]
    assert len(errors) == 2 and all("nothing of it was left" in e for e in errors), errors
    assert "manifest.json" in third


# --- a crashed backend is not a numerical FAIL ----------------------------------------------------------------------
CRASH = """
    # Loaded by every Python process of the test: the numpy backend crashes at its first training step.
    from harness.backends import numpy_backend

    def crash(self, *args, **kwargs):
        raise RuntimeError("planted crash")

    numpy_backend.NumpyBackend.train_step = crash
"""


def test_parity_exit_status_of_a_crashed_backend(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(CRASH))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "parity", "--backends", "numpy,torch", "--steps",
                           "2", "--data", str(data_path()), "--out", str(out), "--quiet"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "ERROR: numpy exited 1, torch not started (it needs numpy's results); nothing compared" in proc.stderr
    (path,) = out.glob("runs/*/parity.json")
    assert json.loads(path.read_text())["verdict"] == "error"


def test_parity_help_lists_every_exit_status(capsys: pytest.CaptureFixture) -> None:
    from harness.parity.record import EXIT_CRASH, EXIT_FAIL, EXIT_PASS, EXIT_USAGE

    assert len({EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_CRASH}) == 4
    with pytest.raises(SystemExit):
        main(["parity", "--help"])
    text = capsys.readouterr().out
    for status, words in ((0, "pass"), (1, "FAIL"), (2, "bad input"), (3, "crashed"), (130, "interrupted")):
        assert f"\n  {status} " in text and words in text.split(f"\n  {status} ", 1)[1].splitlines()[0], text


# --- hostile values in --set and in config files: parsers fed huge integers or deep nesting --------------------
HUGE_INT = "9" * 5000  # past Python's 4300-digit limit on int(str)
DEEP_MINUS = "-" * 100_000 + "1"  # past the Python parser's stack
SETS = {"5000-digit int": HUGE_INT, "100000 minus signs": DEEP_MINUS,
        "int past 2**53": "1" + "0" * 250}  # parses, but overflowed a float in the memory estimate


@pytest.mark.parametrize("command", [["run", "--steps", "1"], ["parity", "--steps", "1"],
                                     ["kit", "export", "--steps", "1"]])
@pytest.mark.parametrize("value", list(SETS.values()), ids=list(SETS))
def test_a_hostile_set_value_is_one_line(command: list[str], value: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    code, _, err = harness(capsys, *command, "--set", f"n_embd={value}", "--data", data_path(), "--out", out)
    line = one_line(code, err, "n_embd")
    assert len(line) < 400, line  # the value is cut in the message, never repeated whole
    assert not out.exists()


HOSTILE_PY = {"5000-digit int": f"n_layer = {HUGE_INT}\n", "minus signs": f"n_layer = {'-' * 500_000}1\n",
              "nested lists": f"n_layer = {'[' * 300_000}{']' * 300_000}\n",
              "a megabyte string": f"n_layer = '{'x' * 900_000}'\n"}


@pytest.mark.parametrize("text", list(HOSTILE_PY.values()), ids=list(HOSTILE_PY))
def test_a_hostile_nanogpt_py_is_one_line(text: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "hostile.py"
    config.write_text(text)
    assert config.stat().st_size < 1 << 20  # under the size bound: the parser itself must hold
    out = tmp_path / "out"
    code, _, err = harness(capsys, "run", "--config", config, "--data", data_path(), "--out", out)
    line = one_line(code, err, str(config))
    assert len(line) < 400, line
    assert not out.exists()


def _small_named(name: str) -> str:
    from harness.config.presets import preset_path

    return preset_path("small").read_text().replace('name = "small"', f"name = '{name}'")


HOSTILE_TOML = {"nested arrays": f"[model]\nn_embd = {'[' * 300_000}{']' * 300_000}\n",
                "5000-digit int": f"[model]\nn_embd = {HUGE_INT}\n",
                "nested inline tables": f"[model]\nn_embd = {'{a=' * 100_000}1{'}' * 100_000}\n",
                "a megabyte name": _small_named("x" * 900_000)}


@pytest.mark.parametrize("text", list(HOSTILE_TOML.values()), ids=list(HOSTILE_TOML))
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_a_hostile_toml_is_one_line(text: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "hostile.toml"
    path.write_text(text)
    out = tmp_path / "out"
    option = "--config" if command == "run" else "--configs"
    code, _, err = harness(capsys, command, option, path, "--data", data_path(), "--out", out)
    line = one_line(code, err, str(path))
    assert len(line) < 400, line
    assert not out.exists()


def test_a_hostile_sweep_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "sweep.toml"
    path.write_text(f"seeds = {'[' * 300_000}{']' * 300_000}\n")
    out = tmp_path / "out"
    code, _, err = harness(capsys, "sweep", path, "--data", data_path(), "--out", out)
    one_line(code, err, str(path), "not valid TOML")
    assert not out.exists()


@pytest.mark.parametrize("text", ["[" * 200_000, f'{{"schema": {HUGE_INT}}}'],
                         ids=["200000 nested [", "5000-digit number"])
def test_a_hostile_manifest_is_one_line(text: str, good: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "manifest.json").write_text(text)
    code, _, err = harness(capsys, "kit", "check", kit, good, "--out", tmp_path / "out")
    one_line(code, err, "manifest.json", "not valid JSON")
    assert not (tmp_path / "out").exists()


def test_kit_export_of_a_model_too_big_for_memory_is_refused_before_computing(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture) -> None:
    """n_embd = 100000 on small: over 1e11 parameters, a terabyte in float64 (more than any test machine has): the
    memory preflight of `harness run` refuses it in one line before the oracle allocates anything."""
    from harness.run.plan import machine_memory

    out = tmp_path / "kit"
    assert 100_000 ** 2 * 12 * 8 > machine_memory()[1]  # the parameters alone, before AdamW and activations
    code, _, err = harness(capsys, "kit", "export", "--set", "n_embd=100000", "--data", data_path(), "--out", out)
    one_line(code, err, "needs about", "--allow-large")
    assert not out.exists()
