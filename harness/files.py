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
import operator
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


READ_BLOCK = 16 * 2**20  # the most a bounded read asks of the file at once


def read_bounded(f: BinaryIO, limit: int) -> bytes:
    """At most `limit` bytes of open file `f`, read in blocks: what is allocated follows what the file holds, never
    the limit (a cap of terabytes on a file of kilobytes allocates kilobytes)."""
    parts: list[bytes] = []
    left = limit
    while left > 0:
        part = f.read(min(left, READ_BLOCK))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def read_regular(path: str | os.PathLike, what: str, fix: str, max_bytes: int | None = None,
                 too_big: str = "") -> bytes:
    """The bytes of regular file `path` (at most `max_bytes`); UsageError naming what the path is otherwise."""
    with open_regular(path, what, fix, max_bytes, too_big) as f:
        try:
            blob = f.read() if max_bytes is None else read_bounded(f, max_bytes + 1)
        except OSError as exc:
            raise _os_error(exc, Path(path), what, fix) from None
    if max_bytes is not None and len(blob) > max_bytes:  # it grew after the check
        raise UsageError(f"{what} {str(path)!r} is more than the {max_bytes:,} bytes it can be; {too_big or fix}")
    return blob


MAX_DIGITS = 18  # no whole number the harness writes has more digits (a seed, a count, a byte size): each fits int64


def _whole_number(text: str) -> int:
    """A JSON integer; a ValueError past `MAX_DIGITS` digits: no count the harness writes is that long, and such a
    number would overflow wherever it meets a float."""
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"a whole number of {len(text.lstrip('-')):,} digits, more than any the harness writes")
    return int(text)


def parse_json(blob: bytes, path: str | os.PathLike, what: str, fix: str) -> Any:
    """`blob` parsed as JSON; UsageError in one line when it is not: not UTF-8, not JSON, a whole number past
    `MAX_DIGITS` digits (a ValueError), or nested deeper than the parser's recursion allows (`[[[[...` 100,000 deep:
    RecursionError, or MemoryError), never a traceback."""
    try:
        return json.loads(blob.decode("utf-8"), parse_int=_whole_number)
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


def lock_held(path: str | os.PathLike) -> bool | None:
    """Whether a process holds an `fcntl.flock` on file `path` now, from the kernel's table (/proc/locks, matched on
    the file's device and inode; nothing is locked or opened, so a holder is never disturbed): False when `path`
    does not exist, None when this system has no such table."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    key = f" {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    return any(key in line for line in table.splitlines())


def pid_alive(pid_file: str | os.PathLike) -> bool:
    """Whether the process whose id is the first line of `pid_file` (a lock file's) exists; False when the file
    is missing, not a small regular file or holds no id."""
    try:
        text = read_regular(pid_file, "lock file", "", 64).decode("ascii", "replace").strip()
        os.kill(int(text.split()[0]), 0)
    except (UsageError, ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


def check_version(doc: dict, path: str | os.PathLike, version: int, oldest: int | None = None) -> None:
    """The one schema-version check of every record kind the harness reads back (run record, spec, paired timing,
    sweep manifest, parity record): a record of another version is refused in one line, never read in an old format
    (llm.c's way: "re-run it"), unless the kind still reads it (`oldest`..`version`: the run record reads the
    previous release's). A `schema_version` that is not a whole number is left to the record's JSON schema, which
    names the field; a record without one predates versioning (schema 0)."""
    found = doc.get("schema_version", 0)
    if isinstance(found, bool) or not isinstance(found, int) or (oldest or version) <= found <= version:
        return
    if found < version:
        raise UsageError(f"{str(path)!r} was written by an older nanogpt-parity (schema {found}); re-run it")
    raise UsageError(f"{str(path)!r} was written by a newer nanogpt-parity (schema {found}, this one reads "
                     f"{version}); upgrade nanogpt-parity")


# --- checking what was read ----------------------------------------------------------------------------------------
def validate(doc: Any, schema: dict, path: str | os.PathLike, fix: str) -> None:
    """`doc` against JSON schema `schema` (Draft 2020-12): UsageError in one line naming the field and the problem
    that best explains the failure (jsonschema's `best_match`)."""
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    if error is not None:
        field = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        message = error.message if len(error.message) < 160 else error.message[:157] + "..."
        raise UsageError(f"{str(path)!r} is invalid at field {field!r}: {message}; {fix}")


# Long lists (a record's steps, a paired timing's step times) are type-checked here, not item by item by jsonschema
# (about 60 µs an item: a minute for a record of a million steps): `check_types` is a few C-level passes.
_WORDS = {int: "a whole number", float: "a number", type(None): "null", list: "a list", dict: "an object",
          str: "a string", bool: "true/false"}


def type_words(kinds: tuple[type, ...] | type) -> str:
    """'a whole number', 'a number or null', ... : the types of `kinds` as a person says them (never `<class ...>`)."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    names = list(dict.fromkeys(_WORDS.get(k, k.__name__) for k in kinds))
    if "a number" in names and "a whole number" in names:
        names.remove("a whole number")
    return " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"


def short_json(value: Any, width: int = 40) -> str:
    """`value` as JSON, cut to `width` characters (for a message naming a bad value)."""
    text = json.dumps(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def check_types(values: list, path: str | os.PathLike, where: str, fix: str, kinds: tuple[type, ...]) -> None:
    """UsageError naming the first of `values` whose type is not in `kinds` (exact types: true is no number);
    `where` is the field with `{}` for the item's index."""
    if set(map(type, values)) <= set(kinds):
        return
    i = next(i for i, v in enumerate(values) if type(v) not in kinds)
    raise UsageError(f"{str(path)!r} is invalid at field {where.format(i)!r}: {short_json(values[i])} is not "
                     f"{type_words(kinds)}; {fix}")


def column(rows: list, key: str, path: str | os.PathLike, where: str, fix: str, kinds: tuple[type, ...],
           optional: bool = False) -> list:
    """The values of `key` in every object of `rows` (`where`: the list's field), each of a type in `kinds`
    (UsageError naming the first item that is not, or that lacks `key` unless `optional`); C loops, not a Python
    loop over the rows."""
    if optional:
        values = [r.get(key) for r in rows]
    else:
        try:
            values = list(map(operator.itemgetter(key), rows))
        except KeyError:
            i = next(i for i, r in enumerate(rows) if key not in r)
            raise UsageError(f"{str(path)!r} is invalid at field '{where}/{i}': {key!r} is a required property; "
                             f"{fix}") from None
    check_types(values, path, f"{where}/{{}}/{key}", fix, kinds + ((type(None),) if optional else ()))
    return values
