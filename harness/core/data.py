"""Character-level corpus, the deterministic batch stream and the fixed evaluation batches.

Produced once by the harness and handed to every backend as NumPy int64 arrays (B, T), 0-based.
This module never imports a framework.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harness.environment import cache_dir
from harness.errors import UsageError

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TRAIN_FRACTION = 0.9


def sha256_bytes(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def sha256_arrays(arrays: list[np.ndarray]) -> str:
    """sha256 over the bytes of a sequence of arrays (the evaluation batches' fingerprint)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def download_tiny_shakespeare(timeout: float = 20.0) -> Path:
    """Return the cached Tiny Shakespeare file, downloading and verifying it on first use."""
    target = cache_dir() / "tinyshakespeare.txt"
    if target.is_file() and sha256_bytes(target.read_bytes()) == TINY_SHAKESPEARE_SHA256:
        return target
    fix = ("download it by hand from " + TINY_SHAKESPEARE_URL + " and pass --data PATH (or set HARNESS_DATA=PATH), "
           "or pass --data sample for the harness's own sample text")
    try:
        with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=timeout) as response:
            blob = response.read()
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UsageError(f"Tiny Shakespeare is not cached and could not be downloaded ({reason}); {fix}") from None
    if sha256_bytes(blob) != TINY_SHAKESPEARE_SHA256:
        raise UsageError(f"the downloaded Tiny Shakespeare has the wrong sha256 (expected "
                         f"{TINY_SHAKESPEARE_SHA256[:12]}...); {fix}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    tmp.write_bytes(blob)
    os.replace(tmp, target)
    return target


def resolve_data_path(data: str | os.PathLike | None) -> Path:
    """--data wins, then HARNESS_DATA, then the cached (downloaded on first use) Tiny Shakespeare; `sample` (in
    either) is the harness's own sample text (harness.core.sample: no network)."""
    from harness.core import sample

    chosen = data if data is not None else os.environ.get("HARNESS_DATA") or None
    if chosen is None:
        return download_tiny_shakespeare()
    path = Path(chosen)
    source = "--data" if data is not None else "HARNESS_DATA"
    if str(chosen) == sample.NAME:
        if os.path.lexists(path):
            raise UsageError(f"{source} {sample.NAME} names the harness's sample text, and ./{sample.NAME} exists "
                             f"too; pass ./{sample.NAME} for the file, or run from another directory")
        try:
            return sample.sample_path()
        except OSError as exc:
            raise UsageError(f"{source} {sample.NAME}: the sample text cannot be written ({exc.strerror}); set "
                             "HARNESS_CACHE to a writable directory") from None
    from harness.files import check_regular

    return check_regular(path, source, "pass the path of a UTF-8 text file"
                         + ("" if data is not None else " or leave it unset to use Tiny Shakespeare"))


@dataclass(frozen=True)
class Corpus:
    """A text, its sorted character vocabulary and its 90/10 train/validation split as token ids."""

    path: str
    sha256: str  # of the file's bytes, as read
    chars: tuple[str, ...]
    train: np.ndarray  # int64 token ids
    val: np.ndarray
    bom_stripped: bool = False  # a leading UTF-8 byte-order mark was removed (it is not text)
    line_endings: str = "normalised"  # "normalised": CRLF and CR became LF; "kept": as in the file
    line_endings_changed: int = 0  # how many CRLF/CR were turned into LF
    raw: bytes = field(default=b"", repr=False, compare=False)  # the file's bytes (copied into the run's --out)

    @property
    def vocab(self) -> str:
        """The vocabulary as one string, in token-id order."""
        return "".join(self.chars)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @property
    def n_chars(self) -> int:
        return len(self.train) + len(self.val)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (every character must be in the vocabulary)."""
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return np.array([index[c] for c in text], dtype=np.int64)
        except KeyError as exc:
            raise UsageError(f"character {exc.args[0]!r} is not in the corpus vocabulary") from None

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def describe(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "n_chars": self.n_chars,
                "vocab_size": self.vocab_size, "vocab": self.vocab, "n_train": len(self.train), "n_val": len(self.val),
                "bom_stripped": self.bom_stripped, "line_endings": self.line_endings,
                "line_endings_changed": self.line_endings_changed}

    def summary(self) -> str:
        """One line for the start of a run: size, vocabulary, what was normalised."""
        notes = []
        if self.bom_stripped:
            notes.append("UTF-8 BOM removed")
        if self.line_endings_changed:
            notes.append(f"{self.line_endings_changed:,} CRLF/CR line endings turned into LF")
        elif self.line_endings == "kept" and ("\r" in self.chars):
            notes.append("CR line endings kept (--keep-line-endings)")
        extra = f" ({'; '.join(notes)})" if notes else ""
        from harness.core.sample import SAMPLE_SHA256

        what = (" (the harness's sample text, a generated play: not Tiny Shakespeare)" if self.sha256 == SAMPLE_SHA256
                else " (Tiny Shakespeare)" if self.sha256 == TINY_SHAKESPEARE_SHA256 else "")
        return (f"data {self.path}{what}: {self.n_chars:,} characters, vocabulary of {self.vocab_size} "
                f"symbols{extra}")


def load_corpus(data: str | os.PathLike | None = None, keep_line_endings: bool = False,
                blob: bytes | None = None) -> Corpus:
    """Read and validate the corpus; errors name the problem and the fix.

    A leading UTF-8 byte-order mark is removed (it would otherwise become a vocabulary symbol) and CRLF and lone CR
    line endings become LF, unless `keep_line_endings`; both are recorded in the Corpus. `blob`: the file's bytes
    already read (a worker reads the run's checked copy and names the original `data` path).
    """
    path = resolve_data_path(data) if blob is None else Path(data)
    if blob is None:
        from harness.files import read_regular

        blob = read_regular(path, "data file", "pass the path of a UTF-8 text file")
    if not blob:
        raise UsageError(f"data file {str(path)!r} is empty; pass a UTF-8 text file with enough text")
    if b"\x00" in blob:
        raise UsageError(f"data file {str(path)!r} looks binary (it contains NUL bytes); pass a UTF-8 text file")
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"data file {str(path)!r} is not UTF-8 (byte {exc.start}); "
                         "convert it with e.g. `iconv -t UTF-8` or pass another file") from None
    bom = text.startswith("\ufeff")
    text = text[1:] if bom else text
    changed = 0
    if not keep_line_endings and "\r" in text:
        changed = text.count("\r")  # each CRLF and each lone CR becomes one LF
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text:
        raise UsageError(f"data file {str(path)!r} holds no text; pass a UTF-8 text file with enough text")
    chars = tuple(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    # np.unique's inverse is the same as a dict lookup but vectorised (1M chars in ~0.1 s)
    codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    uniq, ids = np.unique(codepoints, return_inverse=True)
    assert [chr(c) for c in uniq] == list(chars) and len(index) == len(uniq)
    ids = ids.astype(np.int64)
    n_train = int(len(ids) * TRAIN_FRACTION)
    return Corpus(path=str(path.resolve()), sha256=sha256_bytes(blob), chars=chars,
                  train=ids[:n_train], val=ids[n_train:], bom_stripped=bom, raw=blob,
                  line_endings="kept" if keep_line_endings else "normalised", line_endings_changed=changed)


def check_fits(corpus: Corpus, block_size: int, batch_size: int) -> None:
    """The validation split must hold at least one block (+1 target) and the train split one batch of them."""
    need = block_size + 1
    if len(corpus.val) < need:
        raise UsageError(f"data file is too short: the validation split has {len(corpus.val)} characters but "
                         f"block_size {block_size} needs at least {need}; use a longer text or a smaller block_size")
    if (len(corpus.train) - 1) // block_size < batch_size:
        raise UsageError(f"data file is too short: the train split holds fewer than batch_size={batch_size} "
                         f"windows of {block_size}; use a longer text or smaller batch_size/block_size")


def _windows(ids: np.ndarray, starts: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """x = ids[s : s+T], y = ids[s+1 : s+T+1] for every start s: targets are inputs shifted by one."""
    offsets = starts[:, None] + np.arange(block_size)[None, :]
    return ids[offsets], ids[offsets + 1]


class BatchStream:
    """The training batches, deterministic from (ids, seed, scheme): step k always yields the same (x, y).

    `epochs`: the split is cut into non-overlapping windows of `block_size` (+1 target); each epoch visits them in
    a fresh permutation and drops the last incomplete batch. `random`: every row starts at a uniformly random offset
    (nanoGPT's get_batch). Both are indexable by step, so a resumed run continues exactly where it stopped.
    """

    def __init__(self, ids: np.ndarray, block_size: int, batch_size: int, seed: int, scheme: str = "epochs"):
        self.ids, self.block_size, self.batch_size, self.seed, self.scheme = ids, block_size, batch_size, seed, scheme
        n_windows = (len(ids) - 1) // block_size
        self.batches_per_epoch = n_windows // batch_size
        self._starts = np.arange(n_windows, dtype=np.int64) * block_size
        self._perm_epoch, self._perm = -1, self._starts

    def steps_for_epochs(self, epochs: int) -> int:
        return epochs * self.batches_per_epoch

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The (x, y) of training step `step` (0-based), int64 (B, T)."""
        B, T = self.batch_size, self.block_size
        if self.scheme == "random":
            rng = np.random.Generator(np.random.PCG64([self.seed, 1, step]))
            starts = rng.integers(0, len(self.ids) - T, size=B)
        else:
            epoch, k = divmod(step, self.batches_per_epoch)
            if epoch != self._perm_epoch:  # one permutation per epoch, cached
                rng = np.random.Generator(np.random.PCG64([self.seed, 0, epoch]))
                self._perm, self._perm_epoch = rng.permutation(self._starts), epoch
            starts = self._perm[k * B:(k + 1) * B]
        return _windows(self.ids, starts, T)

    def fingerprint(self, steps: int = 4) -> str:
        """sha256 of the first batches: equal fingerprints mean the backends were fed the same stream."""
        h = hashlib.sha256()
        for step in range(steps):
            for arr in self.batch(step):
                h.update(arr.tobytes())
        return h.hexdigest()


def eval_batches(ids: np.ndarray, block_size: int, batch_size: int, n_batches: int,
                 seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A fixed set of evaluation batches at random offsets, the same for every backend and every eval point."""
    rng = np.random.Generator(np.random.PCG64([seed, 2]))
    starts = rng.integers(0, len(ids) - block_size, size=(n_batches, batch_size))
    return [_windows(ids, s, block_size) for s in starts]
