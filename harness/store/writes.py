"""Every file the harness writes, written whole: to a hidden `.<name>.<random>.tmp` beside it, synced, then renamed,
so a reader (or a kill at any moment) sees the old file or the new one. Stale temporary files (left by a kill) are
removed by the next holder of the run-directory lock (harness.store.lock.RunLock).

JSON never holds bare `NaN`/`Infinity` (not JSON for most readers): a non-finite number is written as `null`. In a
run record that happens only in the loss curves, where the store's readers turn `null` back into `nan`.

Also here: the one-line message of a file-system error (`os_error_message`) and the check that --out can be
written before any work starts (`check_writable`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import UsageError
from harness.store.paths import BENCH, DATA, RUNS, SWEEPS, inside

UMASK = os.umask(0)
os.umask(UMASK)


def _finite(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None (JSON null), tuples as lists, NumPy scalars as Python's."""
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _synced_temp(path: Path, blob: bytes) -> str:
    """A temporary file beside `path` holding `blob`, with an ordinary file's mode, synced to disk; its name. Should
    anything fail (a full disk), it is removed again."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~UMASK)  # mkstemp makes 0600; records and reports are ordinary files
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


def json_line(obj: Any) -> bytes:
    """Strict JSON on one line (non-finite numbers as null), with its newline: a row of a JSON-lines file."""
    return (json.dumps(_finite(obj), separators=(",", ":"), allow_nan=False) + "\n").encode()


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json_bytes(obj))


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

    Catches: an empty --out, a path component over 255 bytes, a symlink loop, a dangling symlink, a symbolic link
    among the folders of --out (`runs`, `sweeps`, `bench`, `data`: harness.store.paths.inside), a file where a
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
        for name in (RUNS, SWEEPS, BENCH, DATA):
            inside(out, name)  # no symbolic link among the folders of --out (harness.store.paths)
        for name in (RUNS, DATA):
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
