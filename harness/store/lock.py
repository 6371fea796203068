"""The locks of what the harness writes: `RunLock` on a run directory (`<run>/.lock`, held while a process writes the
run) and `RecordLock` on a paired-timing record (`.<record>.lock`, held while a coordinator adds a session).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from harness.errors import UsageError
from harness.store.paths import RunPaths, inside
from harness.store.writes import UMASK, clean_stale_tmp, os_error_message

LOCK_FD_ENV = "HARNESS_RUN_LOCK_FD"  # a lock inherited from the parent (same open file: the same lock)


def open_lock_file(path: Path, mode: int) -> int:
    """The lock file `path`, opened (created) for writing, never through a symbolic link (the pid written into it
    would truncate and overwrite the file it points to): a link is `inside`'s one-line UsageError, any other
    OSError is raised."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            inside(path.parent, path.name)  # names the link when it is one
        raise


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
                self.fd = open_lock_file(self.paths.lock, 0o666 & ~UMASK)
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


def record_lock_path(path: Path) -> Path:
    """The lock file beside paired-timing record `path` (`RecordLock` holds it)."""
    return Path(path).with_name(f".{Path(path).name}.lock")


class RecordLock:
    """An exclusive, non-blocking `fcntl.flock` on `.<record>.lock` beside a paired-timing record, held while a
    coordinator adds a session. Two coordinators of one record (a SLURM job resubmitted while the first still runs)
    would each read the record, extend it and write it whole, dropping the other's rounds; the second is refused
    instead (UsageError). The kernel drops the lock when its holder exits, however it exits: it is never stale.
    (`RunLock` is the same mechanism for a run directory, with its messages and clean-up.)"""

    def __init__(self, path: Path):
        self.path = record_lock_path(path)
        self.record = Path(path)
        self.fd: int | None = None

    def __enter__(self) -> RecordLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = open_lock_file(self.path, 0o666)
        except OSError as exc:
            raise UsageError(os_error_message(exc, f"cannot lock paired-timing record {str(self.record)!r}")
                             ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if not isinstance(exc, BlockingIOError):  # no locks here (some network file systems): say so
                os.close(fd)
                raise UsageError(os_error_message(
                    exc, f"cannot lock paired-timing record {str(self.record)!r}")) from None
            try:
                pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            except OSError:
                pid = ""
            os.close(fd)
            holder = f" (pid {pid})" if pid.isdigit() else ""
            raise UsageError(f"another paired timing holds {str(self.record)!r}{holder}; wait for it to finish (or "
                             "stop it) before timing again") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
