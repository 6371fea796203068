"""Reading an `.npz` file within bounds: the binary sibling of `harness.files.read_json`, the one door for every
binary file the harness reads back (checkpoints, parity probes, a kit's files, a port's results).

An `.npz` is a zip archive of `.npy` files. `read_npz` reads one as untrusted input:

- a regular file only (`harness.files.open_regular`: non-blocking, so a FIFO cannot hang the read; a device,
  `/dev/zero` or a symlink to it, is refused) of at most a cap of its kind; a plain `.npy`, a pickle or anything but
  a zip archive is refused by its first bytes, and an archive declaring more than `MAX_MEMBERS` members by its
  end-of-central-directory record, before the directory is parsed;
- only the arrays asked for are opened (`only`): nothing under another name is inflated, whatever it declares;
- each array's `.npy` header is read alone (numpy reads at most 10,000 bytes of it; inflating it costs a few KiB,
  whatever the member declares), and before any of its data: its shape and dtype against what the caller expects
  (`Want`: exact shapes or free axes, dtypes or kinds; or a `Check` of the caller's own), its shape x itemsize
  against the per-array cap, and the zip member's uncompressed size (from the central directory) equal to the
  header plus that: so an 8 TB array header on a tiny file, or a zip bomb, is refused by what it declares; every
  required array must be present, and none the caller does not know;
- no pickles: object and structured dtypes are refused in words of our own;
- the data read with a bounded stream: exactly the declared bytes into an array allocated for them, so a member
  that holds more than it declares inflates no further (and fails its CRC).

Every problem is one line (`UsageError`, exit status 2) naming the file, the array and the fix. Arrays come back as
NumPy arrays in this machine's byte order. docs/untrusted-input.md lists each binary file with its caps and checks.
"""

from __future__ import annotations

import lzma
import math
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from harness.errors import UsageError
from harness.files import open_regular
from harness.units import fmt_bytes

MAX_MEMBERS = 100_000  # no file the harness writes or reads holds more arrays
MEMBER_OVERHEAD = 16 * 2**10  # a member's zip headers and .npy header (numpy reads headers of at most 10,000 bytes)
CHUNK = 16 * 2**20  # the data is read in pieces of at most this many bytes
# what a damaged archive or member raises while it is read, besides BadZipFile: a damaged deflate stream (zlib.error),
# an unsupported compression method (NotImplementedError), an encrypted member (RuntimeError), a short read
ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, lzma.LZMAError, EOFError, OSError, ValueError,
              NotImplementedError, RuntimeError, struct.error)

Check = Callable[[str, tuple[int, ...], np.dtype], None]  # raises UsageError when an array's header is not wanted
KIND_WORDS = {"integer": "iu", "float": "f", "bool": "b", "text": "U"}
KIND_ITEMSIZE = {"integer": 8, "float": 8, "bool": 1}  # the widest item of each kind (text has none)


@dataclass(frozen=True)
class Want:
    """What one array of a file must be: its `shape` (None: any; an axis of None: any length), its dtype (`dtype`:
    names such as "float32" or kinds "integer", "float", "bool", "text"; empty: any numeric), at most `max_bytes`
    (needed where the shape has free axes), and whether it must be there."""

    shape: tuple[int | None, ...] | None = None
    dtype: tuple[str, ...] = ()
    max_bytes: int | None = None
    required: bool = True

    def limit(self, default: int) -> int:
        """The most bytes the array may hold: its exact size where its shape and dtype say it, else `max_bytes`."""
        exact = self.exact_bytes()
        return exact if exact is not None else (self.max_bytes if self.max_bytes is not None else default)

    def exact_bytes(self) -> int | None:
        sizes = [KIND_ITEMSIZE.get(d) if d in KIND_WORDS else np.dtype(d).itemsize for d in self.dtype]
        if self.shape is None or None in self.shape or not sizes or None in sizes:
            return None
        return math.prod(self.shape) * max(sizes)

    def words(self) -> str:
        """'float32 (65, 16)', 'an integer ()', 'float32 or float64 (any shape)': what the messages say."""
        names = [("an integer" if d == "integer" else f"a {d}" if d in KIND_WORDS else d) for d in self.dtype]
        kind = " or ".join(names) or "a number"
        if self.shape is None:
            return f"{kind} of any shape"
        return f"{kind} {_shape_words(self.shape)}"

    def problem(self, shape: tuple[int, ...], dtype: np.dtype) -> str | None:
        """Why an array of `shape` and `dtype` is not what is wanted, in words; None when it is."""
        native = dtype.newbyteorder("=")
        ok_dtype = (any(native.kind in KIND_WORDS[d] if d in KIND_WORDS else native == np.dtype(d) for d in self.dtype)
                    if self.dtype else native.kind in "biuf")
        ok_shape = self.shape is None or (len(shape) == len(self.shape) and all(
            w is None or w == n for w, n in zip(self.shape, shape)))
        if ok_dtype and ok_shape:
            return None
        return f"is {describe_dtype(dtype)} {_shape_words(shape)}, expected {self.words()}"


Spec = Mapping[str, Want]


def _shape_words(shape: tuple[int | None, ...]) -> str:
    if not shape:
        return "(one number)"
    return "(" + ", ".join("any" if n is None else str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def describe_dtype(dtype: np.dtype) -> str:
    """'float64', or 'float64 (big-endian)': the name a person knows, and the byte order where it is not native."""
    if dtype.isnative or dtype.byteorder == "|":
        return dtype.name if dtype.kind != "U" else f"text ({dtype.str})"
    return f"{dtype.newbyteorder('=').name} ({'big' if dtype.byteorder == '>' else 'little'}-endian)"


def _size(n: int) -> str:
    """'4,096 bytes', '7.28 TiB': a size in the words of its scale."""
    return f"{n:,} bytes" if n < 2**20 else fmt_bytes(n)


def spec_bytes(spec: Spec, default: int) -> int:
    """The most bytes a file holding every array of `spec` can take on disk, uncompressed: each array's limit plus
    its headers (`default`: the limit of an array whose shape does not say)."""
    return sum(w.limit(default) + MEMBER_OVERHEAD for w in spec.values())


def read_npz(path: str | os.PathLike, what: str, fix: str, expect: Spec | Check, *, max_file_bytes: int | None,
             max_array_bytes: int, only: Callable[[str], bool] | None = None, stored_only: bool = False,
             too_big: str = "") -> dict[str, np.ndarray]:
    """The arrays of `.npz` file `path` that `expect` describes (and `only` keeps), every declared size and header
    checked before any data is read (see the module docstring); UsageError in one line naming `what`, the path,
    the array and `fix` otherwise.

    `expect`: a `Spec` (every array the file may hold; a required one missing, or another name, is refused), or a
    `Check` called on each member's name, shape and dtype (it raises for what it does not want; the caller checks
    what is missing). `only`: the names to read (the others are never opened); `stored_only`: members must be
    stored uncompressed (then what is read is at most the file's size)."""
    with open_regular(path, what, fix, max_file_bytes,
                      too_big or f"no file of this kind holds so much; {fix}") as f:
        return read_npz_file(f, Path(path), what, fix, expect, max_array_bytes=max_array_bytes, only=only,
                             stored_only=stored_only)


def read_npz_file(f: BinaryIO, path: Path, what: str, fix: str, expect: Spec | Check, *, max_array_bytes: int,
                  only: Callable[[str], bool] | None = None, stored_only: bool = False) -> dict[str, np.ndarray]:
    """`read_npz` of a regular file already open (`path` names it in messages), read from its start."""
    name = f"{what} {str(path)!r}"
    f.seek(0)
    start = f.read(6)
    if start.startswith(b"\x93NUMPY"):
        raise UsageError(f"{name} is a single .npy array, not an .npz archive; {fix}")
    if not start.startswith(b"PK"):
        kind = "empty" if not start else "a Python pickle" if start.startswith(b"\x80") else "not a zip archive"
        raise UsageError(f"{name} is not a readable .npz archive ({kind}: it does not start with the zip signature; "
                         f"an .npz is a zip of .npy files); {fix}")
    size = os.fstat(f.fileno()).st_size
    declared = _declared_members(f, size)
    if declared is not None and declared > MAX_MEMBERS:
        raise UsageError(f"{name} declares {declared:,} members, more than the {MAX_MEMBERS:,} any .npz the harness "
                         f"reads holds; {fix}")
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as zf:
            return _read_members(zf, name, fix, expect, max_array_bytes, only, stored_only)
    except UsageError:
        raise
    except ZIP_ERRORS as exc:
        raise UsageError(f"{name} is not a readable .npz archive (damaged or truncated: {_first_line(exc)}); {fix}"
                         ) from None


def _first_line(exc: BaseException) -> str:
    text = (str(exc).splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= 120 else text[:117] + "..."


def _declared_members(f: BinaryIO, size: int) -> int | None:
    """How many members the zip archive's end-of-central-directory record declares (zip64 too), read from the file's
    last 64 KiB before zipfile builds an object for each; None when there is no such record (zipfile says why)."""
    tail = min(size, 22 + 65535)
    f.seek(size - tail)
    data = f.read(tail)
    at = data.rfind(b"PK\x05\x06")
    if at < 0 or len(data) < at + 22:
        return None
    entries = int.from_bytes(data[at + 10:at + 12], "little")
    if entries != 0xFFFF or at < 20 or data[at - 20:at - 16] != b"PK\x06\x07":
        return entries
    offset = int.from_bytes(data[at - 12:at - 4], "little")  # the zip64 end-of-central-directory record
    if offset + 56 > size:
        return None
    f.seek(offset)
    record = f.read(56)
    return int.from_bytes(record[32:40], "little") if record[:4] == b"PK\x06\x06" else None


def _spec_check(spec: Spec, name: str, fix: str) -> Check:
    def check(key: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        problem = spec[key].problem(shape, dtype)
        if problem:
            raise UsageError(f"{name}: array {key!r} {problem}; {fix}")
    return check


def _read_members(zf: zipfile.ZipFile, name: str, fix: str, expect: Spec | Check, max_array_bytes: int,
                  only: Callable[[str], bool] | None, stored_only: bool) -> dict[str, np.ndarray]:
    spec = expect if isinstance(expect, Mapping) else None
    check = _spec_check(spec, name, fix) if spec is not None else expect
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise UsageError(f"{name} holds {len(infos):,} members; {fix}")
    chosen: dict[str, zipfile.ZipInfo] = {}
    for info in infos:  # names first: nothing is opened until every member to read has been named
        if not info.filename.endswith(".npy") or info.is_dir():
            raise UsageError(f"{name}: member {info.filename!r} is not an .npy array; {fix}")
        key = info.filename[:-4]
        if only is not None and not only(key):
            continue
        if key in chosen:
            raise UsageError(f"{name} holds array {key!r} twice; {fix}")
        if spec is not None and key not in spec:
            raise UsageError(f"{name} holds array {key!r}, which no such file holds; {fix}")
        chosen[key] = info
    if spec is not None:
        missing = [k for k, w in spec.items() if w.required and k not in chosen and (only is None or only(k))]
        if missing:
            raise UsageError(f"{name} lacks array {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") + f"; {fix}")
    planned = []
    for key, info in chosen.items():  # every header, before any data
        cap = spec[key].limit(max_array_bytes) if spec is not None else max_array_bytes
        planned.append((key, info, *_header(zf, info, key, name, fix, check, cap, stored_only)))
    arrays = {key: _data(zf, info, key, name, fix, *header) for key, info, *header in planned}
    return arrays


def _header(zf: zipfile.ZipFile, info: zipfile.ZipInfo, key: str, name: str, fix: str, check: Check, cap: int,
            stored_only: bool) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """Member `info`'s shape, dtype, order and data size, from its declared sizes and its .npy header alone."""
    if info.flag_bits & 0x1:
        raise UsageError(f"{name}: array {key!r} is encrypted; {fix}")
    if stored_only and info.compress_type != zipfile.ZIP_STORED:
        raise UsageError(f"{name}: array {key!r} is compressed, but these files are written uncompressed; {fix}")
    fmt = np.lib.format  # the header first: its read inflates at most a few KiB, whatever the member declares
    try:
        with zf.open(info) as member:
            version = fmt.read_magic(member)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f".npy format version {version[0]}.{version[1]} (numpy writes 1.0 or 2.0)")
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, fortran, dtype = read(member)
            header_len = member.tell()
    except ZIP_ERRORS as exc:
        raise UsageError(f"{name}: array {key!r} has no readable .npy header ({_first_line(exc)}); {fix}") from None
    if dtype.hasobject:
        raise UsageError(f"{name}: array {key!r} holds Python objects (an object array, stored with pickle), which "
                         f"are never read; {fix}")
    if dtype.fields is not None or dtype.subdtype is not None:
        raise UsageError(f"{name}: array {key!r} has a structured dtype {dtype}, which is never read; {fix}")
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise UsageError(f"{name}: array {key!r} declares the impossible shape {shape}; {fix}")
    check(key, shape, dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > cap:
        raise UsageError(f"{name}: array {key!r} declares shape {shape} of {describe_dtype(dtype)} "
                         f"({_size(nbytes)}), more than the {_size(cap)} it can hold; {fix}")
    if info.file_size != header_len + nbytes:  # so the member declares no more than the cap either
        raise UsageError(f"{name}: array {key!r} declares shape {shape} of {describe_dtype(dtype)} ({nbytes:,} "
                         f"bytes) but its member holds {max(0, info.file_size - header_len):,} bytes of data; {fix}")
    return shape, dtype, bool(fortran), header_len


def _data(zf: zipfile.ZipFile, info: zipfile.ZipInfo, key: str, name: str, fix: str, shape: tuple[int, ...],
          dtype: np.dtype, fortran: bool, header_len: int) -> np.ndarray:
    """The array's data: exactly its declared bytes, read in bounded pieces into an array allocated for them."""
    array = np.empty(shape, dtype=dtype, order="F" if fortran else "C")
    flat = memoryview(array.reshape(-1, order="A").view(np.uint8)) if array.size else memoryview(b"")
    try:
        with zf.open(info) as member:
            member.read(header_len)
            got = 0
            while got < len(flat):
                n = member.readinto(flat[got:got + CHUNK])
                if not n:
                    raise EOFError(f"{got:,} of {len(flat):,} bytes of data")
                got += n
            if member.read(1):
                raise ValueError("more data than its header declares")
    except ZIP_ERRORS as exc:
        raise UsageError(f"{name}: array {key!r} cannot be read ({_first_line(exc)}); {fix}") from None
    if not dtype.isnative and dtype.byteorder != "|":
        array = array.astype(dtype.newbyteorder("="))  # the same numbers in this machine's byte order
    return array
