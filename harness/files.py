"""Reading the user's input files: only regular files, opened so that nothing can block, read within a bound.

A path the user names (`--config`, `--data`, a kit's files, a results file, a run record) may exist and still not
be a file one can read to the end: a directory, a named pipe (reading it blocks until some writer comes), a
character device (`/dev/zero` never ends, `/dev/stdin` is whatever the terminal or pipe gives). Every such path is
refused here in one line that says what it is, before anything is read. `open_regular` opens with O_NONBLOCK and
checks the opened file itself (fstat), so a path swapped for a FIFO between the check and the open cannot block
either.

`read_json` is the one door for every JSON file the harness reads back (run records and specs, paired timing,
parity records, sweep and kit manifests): a regular file of at most its kind's cap, parsed with every way a parse
can fail (not UTF-8, not JSON, a number past Python's digit limit, nesting too deep for the parser) turned into one
line. docs/untrusted-input.md lists each file with its cap and its schema.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from harness.errors import UsageError

KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file of `st_mode` is, in words ("a directory", "a named pipe (FIFO)", ...)."""
    for test, words in KINDS:
        if test(mode):
            return words
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def _missing(path: Path, what: str, fix: str) -> UsageError:
    if os.path.islink(path):
        return UsageError(f"{what} {str(path)!r} is a dangling symlink (its target {os.readlink(path)!r} does not "
                          f"exist); {fix}")
    return UsageError(f"{what} {str(path)!r} does not exist; {fix}")


def _os_error(exc: OSError, path: Path, what: str, fix: str) -> UsageError:
    if exc.errno == errno.ENOENT:
        return _missing(path, what, fix)
    if exc.errno == errno.ELOOP:
        return UsageError(f"{what} {str(path)!r} is a symlink loop; {fix}")
    if exc.errno == errno.ENOTDIR:
        return UsageError(f"{what} {str(path)!r} does not exist (a part of the path is a file, not a directory); "
                          f"{fix}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return UsageError(f"{what} {str(path)!r} cannot be read (permission denied); check its permissions or {fix}")
    return UsageError(f"{what} {str(path)!r} cannot be read ({exc.strerror or exc}); {fix}")


def _refuse(mode: int, path: Path, what: str, fix: str) -> UsageError:
    return UsageError(f"{what} {str(path)!r} is {kind_of(mode)}, not a regular file; {fix}")


def _too_big(size: int, path: Path, what: str, max_bytes: int, fix: str) -> UsageError:
    return UsageError(f"{what} {str(path)!r} is {size:,} bytes, more than the {max_bytes:,} it can be; {fix}")


def check_regular(path: str | os.PathLike, what: str, fix: str, max_bytes: int | None = None,
                  too_big: str = "") -> Path:
    """`path` if it is a regular file (symlinks followed) of at most `max_bytes`; else UsageError saying what it is,
    and `fix` (`too_big` when it is too big). A `stat` only: nothing is opened."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise _os_error(exc, path, what, fix) from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(st.st_mode, path, what, fix)
    if max_bytes is not None and st.st_size > max_bytes:
        raise _too_big(st.st_size, path, what, max_bytes, too_big or fix)
    return path


def open_regular(path: str | os.PathLike, what: str, fix: str, max_bytes: int | None = None,
                 too_big: str = "") -> BinaryIO:
    """`path` opened for binary reading, checked to be a regular file of at most `max_bytes` (UsageError else).

    Opened with O_NONBLOCK (a FIFO put there after any check cannot block the open), then checked on the open file
    descriptor itself, then switched back to blocking reads.
    """
    path = check_regular(path, what, fix)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise _os_error(exc, path, what, fix) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(st.st_mode, path, what, fix)
        if max_bytes is not None and st.st_size > max_bytes:
            raise _too_big(st.st_size, path, what, max_bytes, too_big or fix)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, what: str, fix: str, max_bytes: int | None = None,
                 too_big: str = "") -> bytes:
    """The bytes of regular file `path` (at most `max_bytes`); UsageError naming what the path is otherwise."""
    with open_regular(path, what, fix, max_bytes, too_big) as f:
        try:
            blob = f.read() if max_bytes is None else f.read(max_bytes + 1)
        except OSError as exc:
            raise _os_error(exc, Path(path), what, fix) from None
    if max_bytes is not None and len(blob) > max_bytes:  # it grew after the check
        raise UsageError(f"{what} {str(path)!r} is more than the {max_bytes:,} bytes it can be; {too_big or fix}")
    return blob


def parse_json(blob: bytes, path: str | os.PathLike, what: str, fix: str) -> Any:
    """`blob` parsed as JSON; UsageError in one line when it is not: not UTF-8, not JSON, a number past Python's
    integer digit limit (a ValueError), or nested deeper than the parser's recursion allows (`[[[[...` 100,000
    deep: RecursionError, or MemoryError), never a traceback."""
    try:
        return json.loads(blob.decode("utf-8"))
    except RecursionError:
        reason = "nested too deeply"
    except MemoryError:
        reason = "too large to parse"
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        reason = str(exc) or type(exc).__name__
        reason = reason if len(reason) <= 120 else reason[:117] + "..."
    raise UsageError(f"{what} {str(path)!r} is corrupt, not valid JSON ({reason}); {fix}")


def read_json(path: str | os.PathLike, what: str, fix: str, max_bytes: int, too_big: str = "") -> Any:
    """The JSON document in regular file `path` of at most `max_bytes` (UsageError in one line otherwise: what the
    path is, its size, or why it does not parse). Every JSON file the harness reads back comes through here."""
    return parse_json(read_regular(path, what, fix, max_bytes, too_big), path, what, fix)


def check_version(doc: dict, path: str | os.PathLike, version: int) -> None:
    """The one schema-version check of every record kind the harness reads back (run record, spec, paired timing,
    sweep manifest, parity record): a record of another version is refused in one line, never read in an old format
    (llm.c's way: "re-run it"). A `schema_version` that is not a whole number is left to the record's JSON schema,
    which names the field; a record without one predates versioning (schema 0)."""
    found = doc.get("schema_version", 0)
    if isinstance(found, bool) or not isinstance(found, int) or found == version:
        return
    if found < version:
        raise UsageError(f"{str(path)!r} was written by an older nanogpt-parity (schema {found}); re-run it")
    raise UsageError(f"{str(path)!r} was written by a newer nanogpt-parity (schema {found}, this one reads "
                     f"{version}); upgrade nanogpt-parity")
