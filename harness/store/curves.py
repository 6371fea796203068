"""A run record's curves: what training measured step by step (`Curves`), in memory and in its files beside the
record.

In memory (the training loop appends to them) the per-step columns `step`, `loss`, `time_s`, the evaluation points
`evals` and the contention chunks `chunks` are lists. On disk, beside `<backend>.json`, they are three files:

- `<backend>.steps.csv`: `step,loss,time_s`, one row a step (steps 0, 1, 2, ... in order, each once);
- `<backend>.evals.csv`: `step,train_loss,val_loss,time_s`, one row an evaluation (steps increasing);
- `<backend>.chunks.jsonl`: one contention chunk (harness.store.contention) a line.

Numbers are written with `repr`: exact, non-finite ones as `nan`/`inf` in the CSVs and `null` in the JSON lines.
The files only grow, by appending (`append_curves`); the record's JSON says how much of each it vouches for
(`Extents`: rows and bytes) and is rewritten, atomically, after each append. So a reader that reads the record and
then the files reads a whole prefix, whatever a writer does meanwhile; a writer killed between its append and the
record's rename leaves bytes no record vouches for, which readers never read and the next writer cuts off.

Reading costs what was done, never what was planned: `steps_done` reads nothing, `last_eval` the last row, and a
file is read only when one of its columns is touched, block by block, into arrays of 8 bytes a number
(`Curves.on_disk`). A file that holds less than its record vouches for, or rows that are not what the writer writes
(steps missing, repeated or out of order, a negative step time), is a UsageError naming it.
"""

from __future__ import annotations

import array
import io
import math
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np

from harness.errors import UsageError
from harness.files import READ_BLOCK, open_regular, parse_json
from harness.store.contention import check_chunks
from harness.store.paths import RunPaths
from harness.store.stored import Stored
from harness.store.writes import UMASK, atomic_write_all, json_line

FIX = "rerun or delete that run"
STEPS_HEADER = b"step,loss,time_s\n"
EVALS_HEADER = b"step,train_loss,val_loss,time_s\n"
_MIN_ROW = {"steps": len(b"0,0,0\n"), "evals": len(b"0,0,0,0\n"), "chunks": len(b"{}\n")}
_TAIL = 2**16  # bytes read back from a file's end for its last row (a chunk line with GPU states is about 1 KB)


# --- what training measured ----------------------------------------------------------------------------------------
@dataclass
class Eval:
    """One evaluation point: the mean losses over the fixed evaluation batches before training step `step` (after
    `step` updates), and its seconds."""

    step: int
    train_loss: float
    val_loss: float
    time_s: float | None = None

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Eval:
        nan = math.nan
        losses = (doc["train_loss"], doc["val_loss"], doc.get("time_s", nan))
        train, val, time_s = (nan if v is None else v for v in losses)
        return cls(doc["step"], train, val, time_s)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "train_loss": self.train_loss, "val_loss": self.val_loss, "time_s": self.time_s}


class EvalTable(Sequence[Eval]):
    """Evaluation points read from `<backend>.evals.csv`: one (n, 4) float64 array, each row handed out as an `Eval`
    when asked for (a million evaluations hold 32 MB, not a million objects)."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> Eval: ...
    @overload
    def __getitem__(self, i: slice) -> list[Eval]: ...

    def __getitem__(self, i: int | slice) -> Eval | list[Eval]:
        if isinstance(i, slice):
            return [_eval(r) for r in self.rows[i]]
        return _eval(self.rows[i])

    def __iter__(self) -> Iterator[Eval]:
        return map(_eval, self.rows.tolist())


def _eval(row: Sequence[float]) -> Eval:
    step, train, val, time_s = (float(v) for v in row)
    return Eval(int(step), train, val, time_s)


def eval_array(evals: Sequence[Eval]) -> np.ndarray:
    """`evals` as an (n, 4) float64 array (step, train loss, val loss, seconds; an unknown time as nan), without
    making an Eval per row where they were read from a file."""
    if isinstance(evals, EvalTable):
        return evals.rows
    return np.array([(e.step, e.train_loss, e.val_loss, math.nan if e.time_s is None else e.time_s) for e in evals],
                    dtype=np.float64).reshape(-1, 4)


def eval_columns(evals: Sequence[Eval]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, train losses, validation losses) of `evals` as arrays (`eval_array`)."""
    rows = eval_array(evals)
    return rows[:, 0].astype(np.int64), rows[:, 1], rows[:, 2]


@dataclass(kw_only=True)
class Extent(Stored):
    """How much of one curves file a record vouches for: its rows and its bytes (the header included)."""

    rows: int = 0
    bytes: int = 0


@dataclass(kw_only=True)
class Extents(Stored):
    """How much of each curves file a record vouches for: its `curves` in JSON."""

    steps: Extent
    evals: Extent
    chunks: Extent


_EXTENT_SCHEMA = {"type": "object", "required": ["rows", "bytes"],
                  "properties": {"rows": {"type": "integer", "minimum": 0}, "bytes": {"type": "integer", "minimum": 0}}}
EXTENTS_JSON_SCHEMA = {"type": "object", "required": ["steps", "evals", "chunks"],
                       "properties": {k: _EXTENT_SCHEMA for k in ("steps", "evals", "chunks")}}
KINDS = ("steps", "evals", "chunks")


class Curves:
    """What training measured so far: per-step losses and times, the evaluation points, and the contention evidence
    of each chunk of steps (harness.timing.contention). `step` may be longer than `loss`: a step whose loss was not
    yet fetched from the device.

    Made in memory (lists, which the training loop appends to), or `on_disk`: read-only, each file read when a column
    of it is first touched (the steps as a `range`, losses and times as `array('d')`, evaluations an `EvalTable`)."""

    def __init__(self, step: Sequence[int] | None = None, loss: Sequence[float] | None = None,
                 time_s: Sequence[float] | None = None, evals: Sequence[Eval] | None = None,
                 chunks: list[dict] | None = None, *, extents: Extents | None = None):
        self._step = [] if step is None else step
        self._loss = [] if loss is None else loss
        self._time_s = [] if time_s is None else time_s
        self._evals = [] if evals is None else evals
        self._chunks = [] if chunks is None else chunks
        self.extents = extents  # what the files hold, for curves read from disk
        self._at: tuple[RunPaths, str] | None = None  # where the files are, while not yet read
        self._unread: set[str] = set()

    @classmethod
    def on_disk(cls, paths: RunPaths, backend: str, extents: Extents) -> Curves:
        """The curves in `paths`' files of `backend`, read when first touched; UsageError now when a file is missing,
        is no regular file or holds fewer bytes than `extents` vouch for."""
        for kind in KINDS:
            _check_size(curves_file(paths, backend, kind), extents_of(extents, kind), kind)
        curves = cls(extents=extents)
        curves._at, curves._unread = (paths, backend), set(KINDS)
        return curves

    def _need(self, kind: str) -> None:
        if kind in self._unread:
            paths, backend = self._at  # type: ignore[misc]
            path, extent = curves_file(paths, backend, kind), extents_of(self.extents, kind)
            if kind == "steps":
                self._step, self._loss, self._time_s = read_steps(path, extent)
            elif kind == "evals":
                self._evals = EvalTable(read_table(path, extent, EVALS_HEADER, "evals"))
                _check_evals(self._evals.rows, path)
            else:
                self._chunks = read_chunks(path, extent)
            self._unread.discard(kind)

    @property
    def step(self) -> Sequence[int]:
        self._need("steps")
        return self._step

    @property
    def loss(self) -> Sequence[float]:
        self._need("steps")
        return self._loss

    @property
    def time_s(self) -> Sequence[float]:
        self._need("steps")
        return self._time_s

    @property
    def evals(self) -> Sequence[Eval]:
        self._need("evals")
        return self._evals

    @property
    def chunks(self) -> list[dict]:
        self._need("chunks")
        return self._chunks

    def stored_at(self, paths: RunPaths, backend: str) -> bool:
        """Whether these are the curves of `backend`'s files in `paths`, as the files hold them."""
        return self._at is not None and self._at[0].dir == paths.dir and self._at[1] == backend

    @property
    def steps_done(self) -> int:
        """Steps whose loss is known (read from the record alone, for curves on disk)."""
        return self.extents.steps.rows if "steps" in self._unread else len(self._loss)

    @property
    def last_eval(self) -> Eval | None:
        """The last evaluation point (for curves on disk: its file's last row, nothing more read)."""
        if "evals" in self._unread:
            paths, backend = self._at  # type: ignore[misc]
            row = last_row(curves_file(paths, backend, "evals"), self.extents.evals)
            return None if row is None else _eval(_parse_rows(row, paths.evals_csv(backend), 4)[0])
        return self._evals[-1] if len(self._evals) else None

    @property
    def chunks_end(self) -> int:
        """The step after the last chunk's (0 without chunks): where the next chunk starts."""
        if "chunks" in self._unread:
            paths, backend = self._at  # type: ignore[misc]
            line = last_row(curves_file(paths, backend, "chunks"), self.extents.chunks)
            last = None if line is None else read_chunk_lines(line, curves_file(paths, backend, "chunks"))[0]
        else:
            last = self._chunks[-1] if self._chunks else None
        return 0 if last is None else last["step"] + last["n"]

    def followed_by(self, tail: Curves) -> Curves:
        """`tail` (what an earlier attempt recorded: the files), followed by what these curves measured beyond it:
        what is recorded is never replaced, and steps trained again add nothing until they pass it."""
        n = tail.steps_done
        last_eval = tail.last_eval.step if tail.last_eval is not None else -1
        covered = max(tail.chunks_end, n)  # evidence of the steps beyond the tail only
        if covered == 0 and last_eval < 0 and len(self.step) == len(self.loss):
            return self  # nothing recorded before (a first attempt): these curves as they are, nothing copied
        keep = range(n, len(self.loss))
        return Curves(step=[*tail.step[:n], *keep], loss=[*tail.loss[:n], *(self.loss[i] for i in keep)],
                      time_s=[*tail.time_s[:n], *(self.time_s[i] for i in keep)],
                      evals=[*tail.evals, *(e for e in self.evals if e.step > last_eval)],
                      chunks=[*tail.chunks, *(c for c in self.chunks if c["step"] >= covered)])

    def to_json(self) -> dict[str, Any]:
        """The `steps`, `evals` and `chunks` of a record of schema version 3, which held them in its JSON."""
        return {"steps": {"step": list(self.step), "loss": list(self.loss), "time_s": list(self.time_s)},
                "evals": [e.to_dict() for e in self.evals], "chunks": list(self.chunks)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Curves:
        """The curves of a record of schema version 3 (checked by harness.store.record.check_columns): null losses
        and times (non-finite when written) come back as nan."""
        steps = doc["steps"]
        return cls(step=list(steps["step"]), loss=nan_for_null(steps["loss"]), time_s=nan_for_null(steps["time_s"]),
                   evals=[Eval.from_dict(e) for e in doc["evals"]], chunks=list(doc.get("chunks") or []))


def nan_for_null(values: list) -> list:
    return [math.nan if v is None else v for v in values]


# --- the files -------------------------------------------------------------------------------------------------------
def curves_file(paths: RunPaths, backend: str, kind: str) -> Path:
    """The file of `kind` ("steps", "evals", "chunks") of `backend`'s curves."""
    return {"steps": paths.steps_csv, "evals": paths.evals_csv, "chunks": paths.chunks_jsonl}[kind](backend)


def extents_of(extents: Extents | None, kind: str) -> Extent:
    return getattr(extents, kind) if extents is not None else Extent()


def _damaged(path: Path, why: str) -> UsageError:
    return UsageError(f"curves file {str(path)!r} is damaged: {why}; {FIX}")


def _check_size(path: Path, extent: Extent, kind: str) -> None:
    """A file that must hold `extent`: there, a regular file, at least that long, and the rows it vouches for can
    fit in its bytes (a record that claims a billion rows in a few bytes is refused before anything is allocated)."""
    if extent.rows * _MIN_ROW[kind] > extent.bytes:
        raise _damaged(path, f"its record vouches for {extent.rows:,} rows in {extent.bytes:,} bytes")
    if extent.bytes == 0:
        return
    try:
        st = os.stat(path)
    except OSError:
        raise _damaged(path, f"it is missing (its record vouches for {extent.rows:,} rows)") from None
    if not stat.S_ISREG(st.st_mode):
        raise _damaged(path, "it is not a regular file")
    if st.st_size < extent.bytes:
        raise _damaged(path, f"it holds {st.st_size:,} bytes, fewer than the {extent.bytes:,} its record vouches for")


def _prefix_blocks(path: Path, extent: Extent, header: bytes) -> Iterator[bytes]:
    """The vouched-for bytes of `path` after its header, in blocks of whole lines."""
    with open_regular(path, "curves file", FIX) as f:
        if os.fstat(f.fileno()).st_size < extent.bytes:
            raise _damaged(path, "it is shorter than its record vouches for")
        head = f.read(len(header)) if header else b""
        if head != header:
            raise _damaged(path, f"its first line is not {header.decode().strip()!r}")
        left, carry = extent.bytes - len(header), b""
        while left > 0:
            block = f.read(min(left, READ_BLOCK))
            if not block:
                raise _damaged(path, "it ended early")
            left -= len(block)
            block = carry + block
            cut = block.rfind(b"\n") + 1
            carry = block[cut:]
            if cut:
                yield block[:cut]
        if carry:
            raise _damaged(path, "its last vouched-for row is cut off")


def _parse_rows(blob: bytes, path: Path, ncols: int) -> np.ndarray:
    """Rows of `ncols` numbers (CSV) as an (n, ncols) float64 array (numpy's strict parser: a wrong count of fields,
    text, a blank line or a comment is an error)."""
    try:
        text = blob.decode("ascii")
        rows = np.loadtxt(io.StringIO(text), delimiter=",", dtype=np.float64, ndmin=2, comments=None)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _damaged(path, str(exc).splitlines()[0][:160]) from None
    if rows.shape[0] != text.count("\n") or (rows.size and rows.shape[1] != ncols):
        raise _damaged(path, f"a row does not hold {ncols} numbers")
    return rows.reshape(-1, ncols)


def read_table(path: Path, extent: Extent, header: bytes, kind: str) -> np.ndarray:
    """The vouched-for rows of a CSV curves file, as an (n, columns) float64 array."""
    ncols = header.count(b",") + 1
    _check_size(path, extent, kind)
    out = np.empty((extent.rows, ncols), dtype=np.float64)
    at = 0
    for block in _prefix_blocks(path, extent, header) if extent.bytes else ():
        rows = _parse_rows(block, path, ncols)
        if at + len(rows) > extent.rows:
            raise _damaged(path, f"it holds more rows than the {extent.rows:,} its record vouches for")
        out[at:at + len(rows)] = rows
        at += len(rows)
    if at != extent.rows:
        raise _damaged(path, f"it holds {at:,} rows, not the {extent.rows:,} its record vouches for")
    return out


def read_steps(path: Path, extent: Extent) -> tuple[range, array.array, array.array]:
    """The steps (0..n-1, checked), losses and step times of a steps file."""
    rows = read_table(path, extent, STEPS_HEADER, "steps")
    n = len(rows)
    wrong = np.flatnonzero(rows[:, 0] != np.arange(n))
    if wrong.size:
        i = int(wrong[0])
        raise _damaged(path, f"row {i + 1} holds step {rows[i, 0]:g} where step {i} belongs (steps missing, "
                             "repeated or out of order)")
    if (rows[:, 2] < 0).any():
        raise _damaged(path, "a step time is negative")
    return range(n), array.array("d", rows[:, 1].tobytes()), array.array("d", rows[:, 2].tobytes())


def _check_evals(rows: np.ndarray, path: Path) -> None:
    steps = rows[:, 0]
    if len(steps) and ((steps < 0).any() or (steps != np.floor(steps)).any() or (np.diff(steps) <= 0).any()):
        raise _damaged(path, "its evaluation steps are not whole numbers increasing from 0 or more")


def read_chunk_lines(blob: bytes, path: Path) -> list[dict]:
    """The chunks of JSON lines `blob` (each parsed by harness.files.parse_json: one line for any way it fails)."""
    return [parse_json(line, path, "curves file", FIX) for line in blob.splitlines()]


def read_chunks(path: Path, extent: Extent) -> list[dict]:
    """The vouched-for chunks of a chunks file, checked as a record's chunks are (check_chunks)."""
    _check_size(path, extent, "chunks")
    chunks = [c for block in (_prefix_blocks(path, extent, b"") if extent.bytes else ())
              for c in read_chunk_lines(block, path)]
    if len(chunks) != extent.rows:
        raise _damaged(path, f"it holds {len(chunks):,} rows, not the {extent.rows:,} its record vouches for")
    check_chunks(chunks, path, "chunks", FIX)
    return chunks


def last_row(path: Path, extent: Extent) -> bytes | None:
    """The last vouched-for row of a curves file (None when it has none), read from its end alone."""
    if not extent.rows:
        return None
    with open_regular(path, "curves file", FIX) as f:
        start = max(0, extent.bytes - _TAIL)
        f.seek(start)
        blob = f.read(extent.bytes - start)
    if len(blob) != extent.bytes - start or not blob.endswith(b"\n"):
        raise _damaged(path, "its last vouched-for row is cut off")
    cut = blob.rfind(b"\n", 0, len(blob) - 1)
    if cut < 0 and start > 0:
        raise _damaged(path, f"its last row is longer than {_TAIL:,} bytes")
    return blob[cut + 1:]


# --- writing ---------------------------------------------------------------------------------------------------------
def steps_rows(step: Sequence[int], loss: Sequence[float], time_s: Sequence[float]) -> bytes:
    return "".join(f"{int(s)},{float(v)!r},{float(t)!r}\n" for s, v, t in zip(step, loss, time_s)).encode()


def evals_rows(evals: Sequence[Eval]) -> bytes:
    nan = math.nan
    return "".join(f"{int(e.step)},{float(e.train_loss)!r},{float(e.val_loss)!r},"
                   f"{float(nan if e.time_s is None else e.time_s)!r}\n" for e in evals).encode()


def chunks_rows(chunks: Sequence[dict]) -> bytes:
    return b"".join(json_line(c) for c in chunks)


def curves_bytes(curves: Curves) -> dict[str, tuple[int, bytes]]:
    """What the three files of `curves` hold, written whole: per kind, (rows, bytes)."""
    n = len(curves.loss)
    return {"steps": (n, STEPS_HEADER + steps_rows(curves.step[:n], curves.loss, curves.time_s[:n])),
            "evals": (len(curves.evals), EVALS_HEADER + evals_rows(curves.evals)),
            "chunks": (len(curves.chunks), chunks_rows(curves.chunks))}


def extents_for(curves: Curves) -> Extents:
    """The extents of `curves` as `write_curves` writes them (curves on disk: theirs)."""
    if curves.extents is not None:
        return curves.extents
    made = curves_bytes(curves)
    return Extents(**{k: Extent(rows=rows, bytes=len(blob)) for k, (rows, blob) in made.items()})


def write_curves(paths: RunPaths, backend: str, curves: Curves) -> Curves:
    """Write the three files of `curves` whole (each atomically, all before the first is renamed: `atomic_write_all`);
    the curves on disk."""
    made = curves_bytes(curves)
    atomic_write_all([(curves_file(paths, backend, k), blob) for k, (_, blob) in made.items()])
    extents = Extents(**{k: Extent(rows=rows, bytes=len(blob)) for k, (rows, blob) in made.items()})
    return Curves.on_disk(paths, backend, extents)


def _append(path: Path, extent: Extent, header: bytes, rows: int, blob: bytes) -> Extent:
    """Append `rows` rows (`blob`) to the file vouched for by `extent`: bytes beyond it (a killed writer's) cut off
    first, the header written first into an empty file, then synced. Never through a symlink (O_NOFOLLOW)."""
    if not rows:
        return extent
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666 & ~UMASK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _damaged(path, "it is not a regular file")
        if st.st_size < extent.bytes:
            raise _damaged(path, f"it holds {st.st_size:,} bytes, fewer than the {extent.bytes:,} its record "
                                 "vouches for")
        if st.st_size > extent.bytes:
            os.ftruncate(fd, extent.bytes)
        blob = (header if extent.bytes == 0 else b"") + blob
        os.lseek(fd, extent.bytes, os.SEEK_SET)
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return Extent(rows=extent.rows + rows, bytes=extent.bytes + len(blob))


def append_curves(paths: RunPaths, backend: str, extents: Extents, steps: tuple[int, Sequence[float],
                  Sequence[float]], evals: Sequence[Eval], chunks: Sequence[dict]) -> Extents:
    """Append to `backend`'s files: the steps from `steps[0]` on (their losses and times), `evals` and `chunks`;
    the extents they hold now (which the record, written next, vouches for)."""
    first, loss, times = steps
    if first != extents.steps.rows:
        raise ValueError(f"steps appended from {first}, but the file holds {extents.steps.rows}")
    return Extents(
        steps=_append(paths.steps_csv(backend), extents.steps, STEPS_HEADER, len(loss),
                      steps_rows(range(first, first + len(loss)), loss, times)),
        evals=_append(paths.evals_csv(backend), extents.evals, EVALS_HEADER, len(evals), evals_rows(evals)),
        chunks=_append(paths.chunks_jsonl(backend), extents.chunks, b"", len(chunks), chunks_rows(chunks)))
