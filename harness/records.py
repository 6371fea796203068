"""RunRecord files: versioned JSON plus CSV curves, always written to a temporary file and renamed.

A run directory `<out>/runs/<run_id>/` holds `spec.json` (what was asked for) and, per backend,
`<backend>.json` (the RunRecord), `<backend>.steps.csv`, `<backend>.evals.csv` and, when checkpointing,
`<backend>.ckpt.npz`. The report reads nothing else.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import UsageError

SCHEMA = "nanogpt-parity/run-record"
SCHEMA_VERSION = 1
_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_bytes(path: Path, blob: bytes) -> None:
    """Write `blob` to `path` so that a reader (or a kill at any moment) sees the old file or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; records and reports are ordinary files
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, allow_nan=True) + "\n").encode())


def atomic_write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    atomic_write_bytes(path, buf.getvalue().encode())


def atomic_write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def sha256_of_arrays(arrays: list[np.ndarray]) -> str:
    """sha256 over the bytes of a sequence of arrays."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def new_run_id(out: Path, label: str) -> str:
    """A fresh, unique run id: UTC time, the size label and a random suffix; its directory is created here."""
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    while True:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{label}-{secrets.token_hex(2)}"
        try:
            (runs / run_id).mkdir()  # exclusive: never reuse another run's directory
            return run_id
        except FileExistsError:
            continue


def run_dir(out: Path, run_id: str) -> Path:
    return Path(out) / "runs" / run_id


def check_writable(out: Path) -> None:
    """Fail early, before any work, when the output directory cannot be created or written."""
    out = Path(out)
    probe_dir = out
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise UsageError(f"--out {str(out)!r}: {str(probe_dir)!r} is not a directory; choose another --out")
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise UsageError(f"--out {str(out)!r} is not writable; choose a directory you can write to")


def is_failed(status: str) -> bool:
    return status.startswith("failed")


def load_record(path: Path) -> dict:
    """Read and check one RunRecord; a missing or corrupt file is a UsageError naming it."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"run record {str(path)!r} does not exist; list runs with `ls <out>/runs`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"run record {str(path)!r} is corrupt ({exc}); rerun or delete that run") from None
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        raise UsageError(f"{str(path)!r} is not a nanogpt-parity run record; pass a run id from <out>/runs")
    if record.get("schema_version", 0) > SCHEMA_VERSION:
        raise UsageError(f"{str(path)!r} has schema version {record['schema_version']} but this harness reads "
                         f"<= {SCHEMA_VERSION}; upgrade nanogpt-parity")
    for key in ("run_id", "backend", "status", "config", "steps", "evals"):
        if key not in record:
            raise UsageError(f"run record {str(path)!r} is corrupt (no {key!r}); rerun or delete that run")
    return record


def load_run(out: Path, run_id: str) -> tuple[dict, list[dict]]:
    """The spec and the backend records of run `run_id` under `out`."""
    directory = run_dir(out, run_id)
    if not directory.is_dir():
        raise UsageError(f"no run {run_id!r} under {str(Path(out) / 'runs')!r}; pass an existing run id "
                         "(and the same --out as the run)")
    spec_path = directory / "spec.json"
    try:
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"run {run_id!r} has no spec.json; it is not a complete run directory") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{str(spec_path)!r} is corrupt ({exc}); rerun or delete that run") from None
    records = [load_record(directory / f"{b}.json") for b in spec.get("backends", [])
               if (directory / f"{b}.json").exists()]
    return spec, records
