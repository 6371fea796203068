"""Reading a kit's or a port's .npz within bounds: every member's header is checked before any data is read.

An .npz is a zip archive of .npy files. Each member's header (magic, version, dtype, shape, order) is read from the
member stream alone, without its data (numpy.lib.format.read_magic and read_array_header_1_0/2_0), and handed to
`check(key, shape, dtype)`, which refuses anything the manifest did not declare. Only when every header has passed
is any array read, so a small file declaring a huge member costs nothing, and the arrays read add up to at most
what the checks allowed. The file must be a regular file (`harness.files`): a FIFO cannot block the read.
Object (pickled) and structured dtypes are refused in words of our own, never numpy's `allow_pickle` advice.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from harness.errors import UsageError
from harness.files import open_regular

MAX_MEMBERS = 100_000
Check = Callable[[str, tuple[int, ...], np.dtype], None]


def describe_dtype(dtype: np.dtype) -> str:
    """'float64', or 'float64 (big-endian)': the name a person knows, and the byte order where it is not native."""
    if dtype.isnative:
        return dtype.name
    return f"{dtype.newbyteorder('=').name} ({'big' if dtype.byteorder == '>' else 'little'}-endian)"


def _header(member: zipfile.ZipExtFile, key: str, what: str, fix: str) -> tuple[tuple[int, ...], np.dtype, int]:
    fmt = np.lib.format
    try:
        version = fmt.read_magic(member)
        if version == (1, 0):
            shape, _, dtype = fmt.read_array_header_1_0(member)
        elif version == (2, 0):
            shape, _, dtype = fmt.read_array_header_2_0(member)
        else:
            raise ValueError(f".npy format version {version[0]}.{version[1]} (write version 1.0 or 2.0)")
    except (ValueError, EOFError, OSError, zipfile.BadZipFile) as exc:
        raise UsageError(f"{what}: array {key!r} has no readable .npy header ({str(exc).splitlines()[0]}); {fix}") \
            from None
    if dtype.hasobject:
        raise UsageError(f"{what}: array {key!r} holds Python objects (an object array, stored with pickle), which "
                         "are never read; write numeric arrays")
    if dtype.fields is not None or dtype.subdtype is not None:
        raise UsageError(f"{what}: array {key!r} has a structured dtype {dtype}; write plain numeric arrays")
    return tuple(int(n) for n in shape), dtype, member.tell()


def read_npz(path: Path, what: str, fix: str, check: Check, max_file_bytes: int | None = None,
             stored_only: bool = False) -> dict[str, np.ndarray]:
    """The arrays of .npz `path`, each header passed through `check` before any array is read.

    Every member must be an .npy array whose declared size equals its size in the archive; `stored_only` also
    requires uncompressed members (a kit's own files: then the memory read is at most the file's size). Arrays come
    back in native byte order. Anything else is a UsageError naming the file and the fix.
    """
    with open_regular(path, what, fix, max_file_bytes,
                      "it is far larger than any results file of this kit; write only the arrays the kit names") as f:
        return read_npz_file(f, path, what, fix, check, stored_only)


def read_npz_file(f: BinaryIO, path: Path, what: str, fix: str, check: Check,
                  stored_only: bool = False) -> dict[str, np.ndarray]:
    """`read_npz` of a file already open (`path` names it in messages), read from its start."""
    f.seek(0)
    start = f.read(6)
    if start.startswith(b"\x93NUMPY"):
        raise UsageError(f"{what} {str(path)!r} is a single .npy array, not an .npz archive; write all arrays "
                         "into one .npz (numpy.savez, NPZ.jl npzwrite with a Dict)")
    if not start.startswith(b"PK"):
        kind = "a Python pickle" if start.startswith(b"\x80") else "not a zip archive"
        raise UsageError(f"{what} {str(path)!r} is not a readable .npz archive ({kind}: it does not start with the "
                         f"zip signature; an .npz is a zip of .npy files); {fix}")
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as zf:
            return _read_members(zf, path, what, fix, check, stored_only)
    except zipfile.BadZipFile as exc:
        raise UsageError(f"{what} {str(path)!r} is not a readable .npz archive (a damaged or truncated zip archive: "
                         f"{exc}); {fix}") from None


def _read_members(zf: zipfile.ZipFile, path: Path, what: str, fix: str, check: Check,
                  stored_only: bool) -> dict[str, np.ndarray]:
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise UsageError(f"{what} {str(path)!r} holds {len(infos):,} members; {fix}")
    seen: dict[str, zipfile.ZipInfo] = {}
    planned = []
    for info in infos:  # every header first: nothing is read until all have passed
        if not info.filename.endswith(".npy") or info.is_dir():
            raise UsageError(f"{what} {str(path)!r}: member {info.filename!r} is not an .npy array; {fix}")
        key = info.filename[:-4]
        if key in seen:
            raise UsageError(f"{what} {str(path)!r} holds array {key!r} twice; write each array once")
        seen[key] = info
        if stored_only and info.compress_type != zipfile.ZIP_STORED:
            raise UsageError(f"{what} {str(path)!r}: array {key!r} is compressed, but `harness kit export` writes "
                             f"them uncompressed; {fix}")
        with zf.open(info) as member:
            shape, dtype, header_len = _header(member, key, f"{what} {str(path)!r}", fix)
        check(key, shape, dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if info.file_size != header_len + nbytes:
            raise UsageError(f"{what} {str(path)!r}: array {key!r} declares shape {shape} of {describe_dtype(dtype)}"
                             f" ({nbytes:,} bytes) but its member holds {max(0, info.file_size - header_len):,} "
                             f"bytes of data; {fix}")
        planned.append((key, info))
    arrays = {}
    for key, info in planned:
        try:
            with zf.open(info) as member:
                value = np.lib.format.read_array(member, allow_pickle=False)
        except (ValueError, EOFError, OSError, zipfile.BadZipFile) as exc:
            raise UsageError(f"{what} {str(path)!r}: array {key!r} cannot be read ({str(exc).splitlines()[0]}); "
                             f"{fix}") from None
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))  # the same numbers in this machine's byte order
        arrays[key] = value
    return arrays
