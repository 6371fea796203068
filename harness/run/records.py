"""The one owner of on-disk run state: file names, statuses, schemas, atomic writes, the run-directory lock.

A run directory `<out>/runs/<run_id>/` holds (names spelled once, in `RunPaths`):

- `spec.json`: what was asked for (config, seed, data provenance, backends);
- per backend `<backend>.json` (the RunRecord), `<backend>.steps.csv`, `<backend>.evals.csv`, with
  `--checkpoint-every` `<backend>.ckpt.npz`, in parity mode `<backend>.probe.npz`;
- `parity.json` (from `harness parity`), `paired.json` (the paired timing of two or more backends, from
  `harness run`: harness.run.paired_timing) and `.lock` (the run-directory lock, see `RunLock`).

The corpus a run trains on is kept once per `--out`, content-addressed, in `<out>/data/<sha256>.txt`: the
workers read that copy (checked against its sha256), never the user's file again.

Every file is written to a hidden `.<name>.<random>.tmp` and renamed, so a kill at any moment leaves the old
file or the new one, whole. Stale temporary files (left by a kill) are removed by the next lock holder.

JSON never holds bare `NaN`/`Infinity` (not JSON for most readers): a non-finite number is written as `null`.
In a RunRecord that happens only in the loss curves (`steps.loss`, `evals[*].train_loss/val_loss`), where
`load_record` turns `null` back into `nan` for Python readers.
"""

from __future__ import annotations

import contextlib
import csv
import enum
import errno
import fcntl
import hashlib
import io
import json
import math
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.config.fields import NAME_RE
from harness.errors import UsageError
from harness.files import check_types, check_version, column, validate
from harness.timing.contention import check_chunks

SCHEMA = "nanogpt-parity/run-record"
# 2: vocabulary and text normalisation in `data`; null for non-finite numbers
# 3: contention evidence: `chunks` (per chunk of steps: wall and CPU time, run-queue wait, machine load, GPU state)
#    and `timings.contention`; steady-state figures from the undisturbed steps (`timings.disturbed_steps`);
#    `resumed_from_step`, the step each resume continued from (one entry per resume; absent in a record that was
#    never resumed). A record of another version is refused (harness.files.check_version: re-run it).
SCHEMA_VERSION = 3
SPEC_SCHEMA = "nanogpt-parity/run-spec"
SPEC_SCHEMA_VERSION = 1
_UMASK = os.umask(0)
os.umask(_UMASK)

# A run id is a name, never a path: <UTC time>-<config name>-<hex>, but any name of these characters is accepted.
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")
# A sweep id likewise: <UTC time>-<sweep name>-<hex> (harness.sweep.manifest.new_sweep_id).
SWEEP_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
RUNS, SWEEPS = "runs", "sweeps"  # the folders of --out that hold run and sweep directories


class Status(str, enum.Enum):
    """A record's `status`. A failure is stored as "failed: <reason>" (the reason also in `failure`)."""

    QUEUED = "queued"  # submitted to an executor, not started
    RUNNING = "running"
    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    FAILED = "failed"

    @classmethod
    def of(cls, status: str) -> Status:
        """The Status of a stored status string ("failed: ..." is FAILED)."""
        return cls.FAILED if str(status).startswith("failed") else cls(status)

    def text(self, reason: str | None = None) -> str:
        """The stored string: the value, or "failed: <reason>"."""
        return f"failed: {reason}" if self is Status.FAILED and reason else self.value


def is_failed(status: str) -> bool:
    return str(status).startswith("failed")


def check_run_id(run_id: str) -> str:
    """A run id must be a plain name (no `/`, `..`, NUL): anything else could write outside --out."""
    if run_id == "":
        raise UsageError("the run id is empty (an unset shell variable?); pass a run id, a directory name from "
                         "<out>/runs")
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id) or ".." in run_id:
        raise UsageError(f"{run_id!r} is not a run id (a name from <out>/runs, not a path); pass the directory "
                         "name only, and --out for where the runs are")
    return run_id


@dataclass(frozen=True)
class RunPaths:
    """Every file of one run directory, named once."""

    out: Path
    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    @classmethod
    def of_dir(cls, directory: Path) -> RunPaths:
        """The RunPaths of an existing run directory `<out>/runs/<run_id>`."""
        directory = Path(directory)
        return cls(directory.parent.parent, directory.name)

    @staticmethod
    def root(out: Path) -> Path:
        """`<out>/runs`, where every run directory lives."""
        return Path(out) / RUNS

    @property
    def dir(self) -> Path:
        return self.root(self.out) / self.run_id

    @property
    def spec(self) -> Path:
        return self.dir / "spec.json"

    @property
    def parity(self) -> Path:
        """The parity record of `harness parity` (harness.parity.record.SCHEMA)."""
        return self.dir / "parity.json"

    @property
    def lock(self) -> Path:
        return self.dir / ".lock"

    @property
    def paired_timing(self) -> Path:
        """The paired-timing record of a run with two or more backends (harness.run.paired_timing)."""
        return self.dir / "paired.json"

    def record(self, backend: str) -> Path:
        return self.dir / f"{backend}.json"

    def record_files(self) -> list[Path]:
        """The backend records in the directory (`<backend>.json`), whichever backends wrote them, sorted."""
        others = {self.spec.name, self.parity.name, self.paired_timing.name}
        return [p for p in sorted(self.dir.glob("*.json")) if p.name not in others and not p.name.startswith(".")]

    def steps_csv(self, backend: str) -> Path:
        return self.dir / f"{backend}.steps.csv"

    def evals_csv(self, backend: str) -> Path:
        return self.dir / f"{backend}.evals.csv"

    def checkpoint(self, backend: str) -> Path:
        return self.dir / f"{backend}.ckpt.npz"

    def probe(self, backend: str) -> Path:
        return self.dir / f"{backend}.probe.npz"

    def corpus(self, sha256: str) -> Path:
        """The content-addressed copy of the corpus the run trains on (shared by every run in --out)."""
        return corpus_copy(self.out, sha256)


@dataclass(frozen=True)
class SweepPaths:
    """Every file of one sweep directory `<out>/sweeps/<sweep_id>/`, named once (the sweep's runs are ordinary run
    directories: RunPaths)."""

    out: Path
    sweep_id: str

    def __post_init__(self) -> None:
        if not isinstance(self.sweep_id, str) or not re.match(SWEEP_ID_RE, self.sweep_id) or ".." in self.sweep_id:
            raise UsageError(f"{self.sweep_id!r} is not a sweep id; pass one from `ls {self.root(self.out)}`")

    @staticmethod
    def root(out: Path) -> Path:
        """`<out>/sweeps`, where every sweep directory lives."""
        return Path(out) / SWEEPS

    @classmethod
    def under(cls, out: Path) -> list[SweepPaths]:
        """Every sweep directory under `<out>/sweeps` (a folder whose name is no sweep id is none), by id."""
        root = cls.root(out)
        names = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        return [cls(Path(out), n) for n in names if re.match(SWEEP_ID_RE, n) and ".." not in n]

    @property
    def dir(self) -> Path:
        return self.root(self.out) / self.sweep_id

    @property
    def manifest(self) -> Path:
        """The sweep manifest (harness.sweep.manifest)."""
        return self.dir / "sweep.json"

    @property
    def slurm(self) -> Path:
        """submitit's folder: job scripts, pickles and logs of the SLURM executor."""
        return self.dir / "slurm"

    def paired(self, index: int) -> Path:
        """The record of the sweep's paired-timing entry `index` (harness.run.paired_timing)."""
        return self.dir / "paired" / f"{int(index)}.json"


def corpus_copy(out: Path, sha256: str) -> Path:
    return Path(out) / "data" / f"{sha256}.txt"


def run_dir(out: Path, run_id: str) -> Path:
    """`<out>/runs/<run_id>`, with the run id checked to be a name."""
    return RunPaths(Path(out), run_id).dir


# --- writing ------------------------------------------------------------------------------------------------------
def _finite(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None (JSON null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, np.floating):
        return _finite(float(obj))
    return obj


def _synced_temp(path: Path, blob: bytes) -> str:
    """A temporary file beside `path` holding `blob`, with an ordinary file's mode, synced to disk; its name. Should
    anything fail (a full disk), it is removed again."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; records and reports are ordinary files
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def atomic_write_bytes(path: Path, blob: bytes, before_rename: Callable[[], None] | None = None) -> None:
    """Write `blob` to `path` so that a reader (or a kill at any moment) sees the old file or the new one, whole.

    `before_rename` runs once the temporary file is complete (a test hook: a kill there must change nothing).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _synced_temp(path, blob)
    try:
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_all(files: list[tuple[Path, bytes]]) -> None:
    """Write several files, each atomically (old or new, whole), and all new contents before the first is replaced:
    every temporary file is written and synced first, then they are renamed in the order given. So a full disk or a
    failed write replaces none of them; only a kill (or a failed rename) between two renames leaves the earlier
    files new and the later ones old, which is why the order matters (put the file that says "done" last)."""
    done: list[str] = []
    try:
        for path, blob in files:
            done.append(_synced_temp(path, blob))
        for tmp, (path, _) in zip(done, files):
            os.replace(tmp, path)
    except BaseException:
        for tmp in done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


def json_bytes(obj: Any) -> bytes:
    """Strict JSON (non-finite numbers as null), one space indent."""
    return (json.dumps(_finite(obj), indent=1, allow_nan=False) + "\n").encode()


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json_bytes(obj))


def csv_bytes(header: list[str], rows: list[list[Any]]) -> bytes:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue().encode()


def atomic_write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    atomic_write_bytes(path, csv_bytes(header, rows))


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def atomic_write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    atomic_write_bytes(path, npz_bytes(arrays))


def clean_stale_tmp(directory: Path) -> list[str]:
    """Remove the `.<name>.<random>.tmp` files a kill left in `directory`; only a lock holder may call this."""
    removed = []
    for path in Path(directory).glob(".*.tmp"):
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path.name)
    return removed


def sha256_of_arrays(arrays: list[np.ndarray]) -> str:
    """sha256 over the bytes of a sequence of arrays."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def new_run_id(out: Path, label: str) -> str:
    """A fresh, unique run id: UTC time, the config name and a random suffix; its directory is created here."""
    runs = RunPaths.root(out)
    runs.mkdir(parents=True, exist_ok=True)
    while True:
        run_id = check_run_id(f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{label}-{secrets.token_hex(2)}")
        try:
            (runs / run_id).mkdir()  # exclusive: never reuse another run's directory
            return run_id
        except FileExistsError:
            continue


# --- paths --------------------------------------------------------------------------------------------------------
def os_error_message(exc: OSError, what: str) -> str:
    """One line for an OSError: what failed, on which file, why, and what to do."""
    where = f" {str(exc.filename)!r}" if exc.filename else ""
    fix = {errno.ENOSPC: "free some disk space or choose another --out",
           errno.EDQUOT: "free some disk space or choose another --out",
           errno.EROFS: "the file system is read-only; choose another --out",
           errno.EACCES: "check the permissions or choose another --out",
           errno.EPERM: "check the permissions or choose another --out",
           errno.ENAMETOOLONG: "use shorter names (at most 255 characters per path component)",
           errno.ELOOP: "a symlink points to itself (a loop); fix or remove it",
           errno.EISDIR: "a directory is where a file should be; move it away",
           errno.ENOTDIR: "a file is where a directory should be; move it away"}.get(exc.errno, "check the path")
    return f"{what}{where}: {exc.strerror or exc}; {fix}"


def check_writable(out: Path) -> None:
    """Fail early, before any work, when the output directory cannot be created or written into.

    Catches: an empty --out, a path component over 255 bytes, a symlink loop, a dangling symlink, a file where a
    directory must be (`<out>`, `<out>/runs`, `<out>/data`), a directory where `<out>/index.html` must be written,
    and a directory that is not writable (or on a read-only file system).
    """
    if str(out) == "":
        raise UsageError("--out is empty; pass a directory, e.g. --out reports")
    out = Path(out)
    for part in out.parts:
        if len(os.fsencode(part)) > 255:
            raise UsageError(f"--out: the path component {part[:40]!r}... is {len(os.fsencode(part))} bytes; "
                             "a file name can be at most 255, choose a shorter --out")
    probe = out
    try:
        while True:
            if probe.is_symlink() and not probe.exists():
                try:
                    probe.stat()
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        raise UsageError(f"--out {str(out)!r}: {str(probe)!r} is a symlink loop; fix or remove "
                                         "it, or choose another --out") from None
                raise UsageError(f"--out {str(out)!r}: {str(probe)!r} is a dangling symlink (its target "
                                 f"{os.readlink(probe)!r} does not exist); create the target or choose another "
                                 "--out")
            if probe.exists() or probe == probe.parent:
                break
            probe = probe.parent
    except OSError as exc:
        raise UsageError(os_error_message(exc, f"--out {str(out)!r}")) from None
    if not probe.is_dir():
        raise UsageError(f"--out {str(out)!r}: {str(probe)!r} is not a directory; choose another --out")
    if probe == out:
        for name in (RUNS, "data"):
            if (out / name).exists() and not (out / name).is_dir():
                raise UsageError(f"--out {str(out)!r}: {str(out / name)!r} is a file but must be a directory; "
                                 "move it away or choose another --out")
        if (out / "index.html").is_dir():
            raise UsageError(f"--out {str(out)!r}: {str(out / 'index.html')!r} is a directory but the index page "
                             "is written there; move it away or choose another --out")
    if _read_only_fs(probe):
        raise UsageError(f"--out {str(out)!r} is on a read-only file system; choose another --out")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"--out {str(out)!r} is not writable; choose a directory you can write to")


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


# --- the run-directory lock ---------------------------------------------------------------------------------------
LOCK_FD_ENV = "HARNESS_RUN_LOCK_FD"  # a lock inherited from the parent (same open file: the same lock)


class RunLock:
    """An exclusive `fcntl.flock` on `<run>/.lock`, held while a process writes the run directory.

    The kernel drops it when the last process holding the open file exits, however it exits (SIGKILL included),
    so a lock is never stale. The parent passes its open lock file to the worker (`fd`), so a worker keeps the
    directory locked even if the parent dies; another `harness resume` of the same run is refused.
    """

    def __init__(self, paths: RunPaths, fd: int | None = None):
        self.paths, self.fd = paths, fd

    def acquire(self) -> RunLock:
        inherited = self.fd is not None
        try:
            if not inherited:
                self.fd = os.open(self.paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666 & ~_UMASK)
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self.fd)
            self.fd = None
            raise UsageError(f"run {self.paths.run_id} is being written by another process{holder}; wait for it "
                             "to finish (or stop it) before resuming") from None
        except OSError as exc:
            raise UsageError(os_error_message(exc, f"cannot lock run {self.paths.run_id}")) from None
        if not inherited:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        clean_stale_tmp(self.paths.dir)
        return self

    def _holder(self) -> str:
        try:
            pid = self.paths.lock.read_text().strip()
        except OSError:
            return ""
        return f" (pid {pid})" if pid.isdigit() else ""

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# --- schemas ------------------------------------------------------------------------------------------------------
_NUM = {"type": ["number", "null"]}  # null: a non-finite value (NaN or infinity)
_SECONDS = {"type": ["number", "null"], "minimum": 0}
_COUNT = {"type": ["integer", "null"], "minimum": 0}
# Names that reach file names and HTML pages are checked against the patterns they were made with: a record edited
# to hold markup or a path in a name is refused where it is read, not shown.
NAME_PATTERN = {"type": "string", "pattern": NAME_RE.pattern}
BACKEND_PATTERN = {"type": "string", "pattern": r"^[a-z][a-z0-9_]{0,31}$"}
RUN_ID_PATTERN = {"type": "string", "pattern": RUN_ID_RE.pattern}
_CONFIG = {"type": "object", "required": ["name", "n_embd", "block_size", "n_layer", "n_head", "d_hidden"],
           "properties": {"name": NAME_PATTERN}}

SPEC_JSON_SCHEMA: dict = {
    "type": "object",
    "required": ["schema", "run_id", "config", "seed", "device", "data", "backends", "backend_options"],
    "properties": {
        "schema": {"const": SPEC_SCHEMA},
        "schema_version": {"type": "integer"},
        "run_id": RUN_ID_PATTERN,
        "label": NAME_PATTERN,
        "config": _CONFIG,
        "seed": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},
        "device": {"enum": ["cpu", "cuda"]},
        "data": {"type": "object", "required": ["path", "sha256"],
                 "properties": {"path": {"type": "string"}, "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                                "n_chars": {"type": "integer", "minimum": 0}, "vocab": {"type": "string"},
                                "bom_stripped": {"type": "boolean"},
                                "line_endings": {"enum": ["normalised", "kept"]}}},
        "backends": {"type": "array", "minItems": 1, "items": BACKEND_PATTERN},
        "backend_options": {"type": "object", "additionalProperties": {"type": "object"}},
        "checkpoint_every": {"type": ["integer", "null"], "minimum": 0},
        "text": {"type": "boolean"}, "parity": {"type": ["boolean", "object"]},  # object: parity options
        "threads": {"type": ["integer", "null"], "minimum": 1},
        "paired_rounds": {"type": ["integer", "null"], "minimum": 0},
    },
}

# `timings.contention` (harness.timing.contention.summarize): the fields a report reads, typed
CONTENTION_JSON_SCHEMA: dict = {
    "type": ["object", "null"],
    "properties": {"evidence": {"type": "string"}, "chunks": _COUNT, "steady_steps": _COUNT,
                   "disturbed_steps": _COUNT, "contended_fraction": {"type": ["number", "null"], "minimum": 0,
                                                                     "maximum": 1},
                   "mostly_disturbed": {"type": "boolean"}, "disturbed_chunks": _COUNT,
                   "reasons": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
                   "cpu_per_wall": _NUM, "wait_fraction_median": _NUM, "wait_fraction_max": _NUM,
                   "steal_fraction_max": _NUM, "others_cpus_median": _NUM,
                   "load_range": {"type": ["array", "null"], "items": _NUM, "minItems": 2, "maxItems": 2},
                   "threads_max": _COUNT, "ncpu": _COUNT, "gpu_evidence": {"type": "string"}},
}

# `timings` (harness.run.worker: steady-state figures, harness.timing.steady.summarize_times, and the run's times)
TIMINGS_JSON_SCHEMA: dict = {
    "type": "object",
    "properties": {**{k: _SECONDS for k in ("setup_s", "first_step_s", "compile_s", "step_median_s", "step_p10_s",
                                            "step_p90_s", "step_iqr_s", "step_mean_s", "train_s", "eval_s",
                                            "wall_s")},
                   "tokens_per_s": _SECONDS, "achieved_flops": _SECONDS,
                   **{k: _COUNT for k in ("warmup_steps", "steady_steps", "steady_steps_all", "disturbed_steps")},
                   "figures_from": {"type": "string"}, "contention": CONTENTION_JSON_SCHEMA},
}

# The per-step and per-evaluation lists are checked by `check_columns`, not item by item here: jsonschema takes
# about 60 µs per item, a minute for a record of a million steps; `ITEMS` gives their types.
RECORD_JSON_SCHEMA: dict = {
    "type": "object",
    "required": ["schema", "run_id", "backend", "status", "config", "steps", "evals"],
    "properties": {
        "schema": {"const": SCHEMA},
        "schema_version": {"type": "integer"},
        "run_id": RUN_ID_PATTERN,
        "backend": BACKEND_PATTERN,
        "status": {"type": "string", "pattern": "^(queued|running|completed|interrupted|failed(: .*)?)$"},
        "config": _CONFIG,
        "seed": {"type": "integer"},
        "total_steps": {"type": "integer", "minimum": 0},
        "tokens_per_step": {"type": ["integer", "null"], "minimum": 0},
        "n_params": _COUNT, "n_params_non_embedding": _COUNT, "flops_per_token": _COUNT,
        "steps": {"type": "object", "required": ["step", "loss", "time_s"],
                  "properties": {"step": {"type": "array"}, "loss": {"type": "array"}, "time_s": {"type": "array"}}},
        "evals": {"type": "array"},
        "timings": TIMINGS_JSON_SCHEMA,
        "memory": {"type": "object", "properties": {"peak_bytes": _COUNT, "kind": {"type": ["string", "null"]}}},
        "fingerprints": {"type": "object"}, "data": {"type": "object"},
        "checkpoint": {"type": ["object", "null"]},
        "text": {"type": ["object", "null"], "properties": {"chrf": _NUM, "bleu": _NUM}},
        "chunks": {"type": "array"},
        "resumed_from_step": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
}

# The types of the list items `check_columns` checks: the per-step lists (one number per step) and each evaluation's
# fields; the chunks' are harness.timing.contention's (`check_chunks`).
_INT, _FLOAT = (int,), (int, float, type(None))
ITEMS: dict[str, dict[str, tuple[type, ...]]] = {
    "steps": {"step": _INT, "loss": _FLOAT, "time_s": _FLOAT},
    "evals": {"step": _INT, "train_loss": _FLOAT, "val_loss": _FLOAT, "time_s": _FLOAT},
}


def check_columns(record: dict, path: Path, fix: str) -> None:
    """The items of a record's per-step, evaluation and chunk lists (`ITEMS`, harness.timing.contention's chunk
    types): linear in the record's size, a few C-level passes over each list."""
    steps = record["steps"]
    for key, kinds in ITEMS["steps"].items():
        check_types(steps[key], path, f"steps/{key}/{{}}", fix, kinds)
    evals = record["evals"]
    check_types(evals, path, "evals/{}", fix, (dict,))
    for key, kinds in ITEMS["evals"].items():
        column(evals, key, path, "evals", fix, kinds, optional=key == "time_s")
    check_chunks(record.get("chunks") or [], path, "chunks", fix)
    if (np.asarray(_nan(steps["time_s"]), dtype=np.float64) < 0).any():
        raise UsageError(f"{str(path)!r} is invalid at field 'steps/time_s': a step time is negative; {fix}")


_validate = validate  # the one jsonschema check (harness.files.validate), by its old name here


# --- how big a record can be ---------------------------------------------------------------------------------------
# Every JSON file of a run is read within a cap (harness.files.read_json), so a device, a FIFO or a file of gigabytes
# put where a record belongs is refused before it is read. The caps are bytes of JSON as `json_bytes` writes it
# (indent 1), bounded from above item by item, for the steps and evaluations the run's spec lets it have:
MAX_SPEC_BYTES = 16 * 2**20  # config, options, data provenance; the vocabulary: at most 0x110000 symbols x 12 bytes
RECORD_BASE_BYTES = 16 * 2**20  # a record without its lists: the vocabulary again, the text samples, a traceback
STEP_BYTES = 96  # steps.step, .loss, .time_s: three numbers of at most 24 characters, one line each
EVAL_BYTES = 320  # one evaluation: four numbers and their names
CHUNK_BYTES = 4096  # one chunk of contention evidence, GPU states included (about 700 bytes measured); one a step
RECORD_CEILING = 2**30  # the cap of a record whose spec cannot say how many steps its run has
# parity.json (harness.parity.record): about 250 KB for medium at 50 steps, growing with the optimizer steps
# compared, whose probes `harness.parity.record.PROBE_BUDGET` (1 GiB of states) bounds: its tables stay far below
MAX_PARITY_BYTES = 64 * 2**20


def steps_bound(spec: dict) -> int | None:
    """The most training steps the run of `spec` can have: its config's `steps`, else `epochs` times the batches of
    its corpus (no more than n_chars // (block_size x batch_size) per epoch); None when the spec cannot say."""
    config, data = spec.get("config") or {}, spec.get("data") or {}
    steps, epochs = config.get("steps"), config.get("epochs")
    if isinstance(steps, int) and steps > 0:
        return steps
    try:
        per_epoch = int(data["n_chars"]) // (int(config["block_size"]) * int(config["batch_size"])) + 1
        return int(epochs) * per_epoch
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def record_cap(spec: dict | None) -> int:
    """The most bytes a backend's record of the run of `spec` can hold: `RECORD_BASE_BYTES` plus, per step, its
    numbers and a chunk (a chunk holds one step or more), per evaluation (every `eval_interval` steps, and at the
    first and the last) its numbers; `RECORD_CEILING` when the spec cannot say how many steps there are."""
    steps = steps_bound(spec or {})
    if steps is None:
        return RECORD_CEILING
    interval = (spec.get("config") or {}).get("eval_interval")
    evals = steps // interval + 2 if isinstance(interval, int) and interval > 0 else steps + 2
    return RECORD_BASE_BYTES + steps * (STEP_BYTES + CHUNK_BYTES) + evals * EVAL_BYTES


def _read_json(path: Path, what: str, fix: str, max_bytes: int) -> Any:
    from harness.files import read_json

    # a FIFO or a device put where a record belongs must not block; nothing bigger than a run can write is read
    return read_json(path, what, fix, max_bytes, f"no run writes so much; {fix}")


def load_spec_file(path: Path) -> dict:
    """Read and validate a spec.json; any problem is a UsageError naming the file and the field."""
    fix = "that run cannot be used; delete it or start a new run"
    spec = _read_json(path, "run spec", fix, MAX_SPEC_BYTES)
    if isinstance(spec, dict) and spec.get("schema") != SPEC_SCHEMA:
        raise UsageError(f"{str(path)!r} is not a nanogpt-parity run spec; that run cannot be used")
    if isinstance(spec, dict):
        check_version(spec, path, SPEC_SCHEMA_VERSION)
    _validate(spec, SPEC_JSON_SCHEMA, path, fix)
    if spec["run_id"] != Path(path).parent.name:
        raise UsageError(f"{str(path)!r} is invalid at field 'run_id': {spec['run_id']!r} is not its directory's "
                         f"name; {fix}")
    return spec


def _nan(values: list) -> list:
    return [math.nan if v is None else v for v in values]


def load_record(path: Path, backend: str | None = None, spec: dict | None = None) -> dict:
    """Read and validate one RunRecord; a missing, corrupt or invalid file is a UsageError naming it and the field.

    It is read within the cap of its run (`record_cap` of `spec`; without one, of the spec beside it). Non-finite
    numbers (stored as null) come back as nan in the loss curves.
    """
    fix = "rerun or delete that run"
    if spec is None:
        try:
            spec = load_spec_file(Path(path).parent / "spec.json")
        except UsageError:
            spec = None  # the record alone: the ceiling
    record = _read_json(path, "run record", fix, record_cap(spec))
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        raise UsageError(f"{str(path)!r} is not a nanogpt-parity run record; pass a run id from <out>/runs")
    check_version(record, path, SCHEMA_VERSION)
    _validate(record, RECORD_JSON_SCHEMA, path, fix)
    check_columns(record, path, fix)
    if backend is not None and record["backend"] != backend:
        raise UsageError(f"{str(path)!r} is invalid at field 'backend': {record['backend']!r} in the file of "
                         f"backend {backend!r}; {fix}")
    steps = record["steps"]
    if not len(steps["step"]) >= len(steps["loss"]) <= len(steps["time_s"]):
        raise UsageError(f"{str(path)!r} is invalid at field 'steps': fewer steps or times than losses; {fix}")
    steps["loss"], steps["time_s"] = _nan(steps["loss"]), _nan(steps["time_s"])
    for e in record["evals"]:
        for key in ("train_loss", "val_loss", "time_s"):
            if key in e and e[key] is None:
                e[key] = math.nan
    return record


def load_run(out: Path, run_id: str) -> tuple[dict, list[dict]]:
    """The spec and the backend records of run `run_id` under `out` (UsageError naming what is wrong)."""
    paths = RunPaths(Path(out), check_run_id(run_id))
    if not paths.dir.is_dir():
        raise UsageError(f"no run {run_id!r} under {str(RunPaths.root(out))!r}; pass an existing run id "
                         "(and the same --out as the run)")
    if not paths.spec.exists():
        raise UsageError(f"run {run_id!r} has no spec.json; it is not a complete run directory")
    spec = load_spec_file(paths.spec)
    recs = [load_record(paths.record(b), b, spec) for b in spec["backends"] if os.path.lexists(paths.record(b))]
    return spec, recs


def compare_fingerprints(recs: list[dict]) -> list[str]:
    """Problems that would make a comparison unfair: different data, weights, batches or config."""
    problems = []
    if len(recs) < 2:
        return problems
    ref = recs[0]
    for rec in recs[1:]:
        if rec["data"]["sha256"] != ref["data"]["sha256"]:
            problems.append(f"{rec['backend']} read different data than {ref['backend']}")
        if rec["config_hash"] != ref["config_hash"]:
            problems.append(f"{rec['backend']} ran a different config than {ref['backend']}")
        for key in ("weights", "batches", "eval_batches"):
            if rec["fingerprints"][key] != ref["fingerprints"][key]:
                problems.append(f"{rec['backend']} got different {key} than {ref['backend']}")
    return problems
