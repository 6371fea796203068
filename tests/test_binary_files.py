"""Every binary file the harness reads back (checkpoints, parity probes, a kit's files) goes through one bounded
reader (harness.npz), each kind checked against what its run expects. Each test is an attack: a checkpoint, a probe
or a kit tampered with, a FIFO or a device where a file belongs, an 8 TB array header on a tiny file, a zip bomb.
The answer is one line (exit status 2; a probe: "backend X's probe is unreadable", exit 3), never a traceback, a
hang, an inflated bomb or a run continued from a state that is not the run's.

Most attacks are in-process calls of the reader on crafted files; one `harness parity` runs its workers for real (a
resume refusing a tampered checkpoint end to end is in tests/test_run_reliability.py, on its interrupted run).
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import struct
import zipfile
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from test_untrusted_input import deadline

from harness.errors import UsageError
from harness.npz import MAX_MEMBERS, Want, read_npz
from tests.conftest import data_path

FIX = "the fix"


# --- crafting files -------------------------------------------------------------------------------------------------
def npy(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asanyarray(value), allow_pickle=True)
    return buf.getvalue()


def npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def deflated(parts: list[tuple[bytes, int]]) -> bytes:
    """A raw deflate stream of each (bytes, times) in turn, without ever holding the inflated whole: each piece is
    compressed once, ends on a full flush (so that it stands alone) and is repeated `times`."""
    out = []
    for blob, times in parts:
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        out.append((c.compress(blob) + c.flush(zlib.Z_FULL_FLUSH)) * times)
    out.append(zlib.compressobj(9, zlib.DEFLATED, -15).flush())  # the final, empty block
    return b"".join(out)


Member = tuple[str, bytes, int, int, int]  # name, data as stored, method, uncompressed size declared, CRC-32


def zip_bytes(members: list[Member]) -> bytes:
    """A zip archive written by hand, each member as it says (its sizes and CRC may lie)."""
    body, central = b"", b""
    for name, data, method, size, crc in members:
        raw = name.encode()
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, 0x21, crc, len(data), size,
                               len(raw), 0, 0, 0, 0, 0, len(body)) + raw
        body += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0x21, crc, len(data), size, len(raw), 0)
        body += raw + data
    return body + central + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central),
                                        len(body), 0)


def stored(name: str, blob: bytes) -> Member:
    return name, blob, zipfile.ZIP_STORED, len(blob), zlib.crc32(blob)


def bomb(name: str, gigabytes: float = 3.4) -> Member:
    """A member declaring `gigabytes` of uint8 that a few MB of deflate inflate to: an .npy header, then zeros (its
    CRC is of nothing: a reader would find out only after inflating it all)."""
    n = int(gigabytes * 1e9) // 2**20 * 2**20
    head = npy_header((n,), "|u1")
    return name, deflated([(head, 1), (b"\0" * 2**20, n // 2**20)]), zipfile.ZIP_DEFLATED, len(head) + n, 0


def savez(path: Path, arrays: dict[str, np.ndarray], extra: list[Member] = ()) -> Path:
    path.write_bytes(zip_bytes([stored(k + ".npy", npy(v)) for k, v in arrays.items()] + list(extra)))
    return path


class Opened:
    """Records the members a reader opens (zipfile.ZipFile.open)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.names: list[str] = []
        real = zipfile.ZipFile.open

        def spy(zf, name, *args, **kwargs):
            self.names.append(name if isinstance(name, str) else name.filename)
            return real(zf, name, *args, **kwargs)
        monkeypatch.setattr(zipfile.ZipFile, "open", spy)


def refused(fn, *fragments: str) -> str:
    """`fn()` raises a one-line UsageError holding every fragment; its message."""
    with deadline(30), pytest.raises(UsageError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and "allow_pickle" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


SPEC = {"w": Want((2, 3), ("float64",)), "n": Want((), ("integer",)), "free": Want((None,), ("uint8",), 1024)}
GOOD = {"w": np.arange(6.0).reshape(2, 3), "n": np.array(7), "free": np.arange(10, dtype=np.uint8)}


def read(path: Path, spec=SPEC, **kw) -> dict[str, np.ndarray]:
    return read_npz(path, "test file", FIX, spec, max_file_bytes=kw.pop("max_file_bytes", 2**20),
                    max_array_bytes=kw.pop("max_array_bytes", 0), **kw)


# --- the reader -----------------------------------------------------------------------------------------------------
def test_the_reader_gives_what_was_written_in_this_machine_s_byte_order(tmp_path: Path) -> None:
    arrays = dict(GOOD, w=np.asfortranarray(GOOD["w"]).astype(">f8"))
    np.savez_compressed(tmp_path / "a.npz", **arrays)
    got = read(tmp_path / "a.npz")
    assert sorted(got) == sorted(GOOD) and got["w"].dtype == np.float64 and got["w"].dtype.isnative
    assert all(np.array_equal(got[k], GOOD[k]) for k in GOOD)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "directory"])
def test_only_regular_files_are_read_and_nothing_blocks(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "x.npz"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(kind)
    words = {"fifo": "a named pipe (FIFO)", "/dev/zero": "a character device", "directory": "a directory"}[kind]
    refused(lambda: read(path), f"{words}, not a regular file", FIX)


@pytest.mark.parametrize("content,words", [
    (b"", "empty"), (npy(np.zeros(3)), "a single .npy array"), (b"\x80\x04K\x01.", "a Python pickle"),
    (b"PK\x03\x04 truncated", "damaged or truncated"), (b"hello", "does not start with the zip signature")])
def test_what_is_no_npz_archive_is_named_in_one_line(content: bytes, words: str, tmp_path: Path) -> None:
    path = tmp_path / "x.npz"
    path.write_bytes(content)
    refused(lambda: read(path), words, FIX)


def test_a_truncated_archive_is_one_line(tmp_path: Path) -> None:
    blob = savez(tmp_path / "a.npz", GOOD).read_bytes()
    for cut in (len(blob) // 3, len(blob) - 10):
        (tmp_path / "cut.npz").write_bytes(blob[:cut])
        refused(lambda: read(tmp_path / "cut.npz"), "test file", FIX)


def test_an_8_tb_array_header_on_a_tiny_file_is_refused_by_what_it_declares(tmp_path: Path) -> None:
    path = tmp_path / "a.npz"
    big = npy_header((2**40,), "|u1") + b"\0" * 64  # 1 TiB of uint8 under a key of free length
    savez(path, {"w": GOOD["w"], "n": GOOD["n"]}, [stored("free.npy", big)])
    assert path.stat().st_size < 2000
    refused(lambda: read(path), "'free' declares shape (1099511627776,) of uint8 (1 TiB), more than the 1,024 "
                                "bytes it can hold")
    savez(path, {"n": GOOD["n"], "free": GOOD["free"]}, [stored("w.npy", npy_header((10**12,)) + b"\0" * 64)])
    refused(lambda: read(path), "array 'w' is float64 (1000000000000,), expected float64 (2, 3)")
    # 4 GB declared by the zip member itself (its uncompressed size) under a wanted name, with a small header
    member = npy(GOOD["free"])
    (tmp_path / "z.npz").write_bytes(zip_bytes([stored("w.npy", npy(GOOD["w"])), stored("n.npy", npy(GOOD["n"])),
                                                ("free.npy", member, zipfile.ZIP_STORED, 4 * 10**9,
                                                 zlib.crc32(member))]))
    refused(lambda: read(tmp_path / "z.npz"), "'free' declares shape (10,) of uint8 (10 bytes) but its member holds "
                                              "3,999,999,872 bytes of data")


def test_a_zip_bomb_under_an_unused_name_is_never_inflated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = savez(tmp_path / "a.npz", GOOD, [bomb("junk.npy")])
    assert path.stat().st_size < 8 * 2**20
    opened = Opened(monkeypatch)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused(lambda: read(path, max_file_bytes=2**24), "holds array 'junk', which no such file holds", FIX)
    got = read(path, max_file_bytes=2**24, only=lambda key: key != "junk")  # refused by its name, or left unread
    assert sorted(got) == sorted(GOOD) and "junk.npy" not in opened.names, opened.names
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200_000


def test_a_zip_bomb_under_a_wanted_name_is_refused_by_its_header(tmp_path: Path) -> None:
    path = savez(tmp_path / "a.npz", {"w": GOOD["w"], "n": GOOD["n"]}, [bomb("free.npy")])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused(lambda: read(path, max_file_bytes=2**24), "'free' declares shape (3399483392,) of uint8 (3.17 GiB), "
                                                      "more than the 1,024 bytes it can hold")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100_000


def test_a_member_that_inflates_beyond_its_declared_size_is_read_no_further(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The zip directory says 138 bytes; the deflate stream goes on for 1 GB: the reader takes what was declared and
    inflates no further, counted at zipfile's decompressor (with a CRC of other bytes, it refuses the member)."""
    blob = npy(GOOD["free"])
    stream = deflated([(blob, 1), (b"\0" * 2**20, 1024)])
    good = [stored("w.npy", npy(GOOD["w"])), stored("n.npy", npy(GOOD["n"]))]
    path = tmp_path / "a.npz"
    inflated = counted_inflation(monkeypatch)
    path.write_bytes(zip_bytes([*good, ("free.npy", stream, zipfile.ZIP_DEFLATED, len(blob), zlib.crc32(blob))]))
    assert np.array_equal(read(path, max_file_bytes=2**24)["free"], GOOD["free"])
    path.write_bytes(zip_bytes([*good, ("free.npy", stream, zipfile.ZIP_DEFLATED, len(blob), 0)]))
    refused(lambda: read(path, max_file_bytes=2**24), "array 'free'", "(Bad CRC-32 for file 'free.npy')")
    assert 0 < sum(inflated) < 2**20, sum(inflated)  # of the 1 GB stream, about what the directory declares


def counted_inflation(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes every zipfile decompressor gives from now on, call by call."""
    inflated: list[int] = []
    real = zipfile._get_decompressor

    class Counting:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def decompress(self, data: bytes, max_length: int = 0) -> bytes:
            out = self.inner.decompress(data, max_length)
            inflated.append(len(out))
            return out

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    monkeypatch.setattr(zipfile, "_get_decompressor", lambda kind: Counting(real(kind)))
    return inflated


def test_an_archive_declaring_millions_of_members_is_refused_before_its_directory_is_read(tmp_path: Path) -> None:
    eocd = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0, 0, 0)
    zip64 = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 10**7, 10**7, 0, 0)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, 0, 1)
    (tmp_path / "a.npz").write_bytes(zip64 + locator + eocd)
    refused(lambda: read(tmp_path / "a.npz"), f"declares 10,000,000 members, more than the {MAX_MEMBERS:,}")


@pytest.mark.parametrize("change,words", [
    (lambda a: a.update(w=np.zeros((3, 2))), "array 'w' is float64 (3, 2), expected float64 (2, 3)"),
    (lambda a: a.update(w=a["w"].astype(np.float16)), "array 'w' is float16 (2, 3), expected float64 (2, 3)"),
    (lambda a: a.update(w=a["w"].astype(np.complex128)), "array 'w' is complex128"),
    (lambda a: a.update(n=np.array(7.0)), "array 'n' is float64 (one number), expected an integer (one number)"),
    (lambda a: a.update(n=np.array("7")), "array 'n' is text (<U1) (one number), expected an integer"),
    (lambda a: a.update(n=np.array([7])), "array 'n' is int64 (1,), expected an integer (one number)"),
    (lambda a: a.update(free=np.array([[1, 2], [3]], dtype=object)), "holds Python objects"),
    (lambda a: a.update(free=np.zeros(2, dtype=[("a", "u1")])), "has a structured dtype"),
    (lambda a: a.pop("w"), "lacks array 'w'"),
    (lambda a: a.update(extra=np.zeros(1)), "holds array 'extra', which no such file holds"),
], ids=["shape", "float16", "complex", "float for an integer", "text", "ragged shape", "objects", "structured",
        "missing", "unknown"])
def test_shapes_and_dtypes_are_checked_against_what_the_reader_expects(change, words: str, tmp_path: Path) -> None:
    arrays = dict(GOOD)
    change(arrays)
    refused(lambda: read(savez(tmp_path / "a.npz", arrays)), words, FIX)


def test_a_member_twice_or_no_npy_member_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.npz").write_bytes(zip_bytes([stored("n.npy", npy(GOOD["n"]))] * 2))
    refused(lambda: read(tmp_path / "a.npz", spec={"n": SPEC["n"]}), "holds array 'n' twice")
    (tmp_path / "b.npz").write_bytes(zip_bytes([stored("n.txt", b"7")]))
    refused(lambda: read(tmp_path / "b.npz", spec={"n": SPEC["n"]}), "member 'n.txt' is not an .npy array")


def test_a_file_over_its_cap_is_refused_by_its_size(tmp_path: Path) -> None:
    path = savez(tmp_path / "a.npz", GOOD)
    refused(lambda: read(path, max_file_bytes=100), "more than the 100 it can be")


# --- checkpoints ----------------------------------------------------------------------------------------------------
CHUNK = {"step": 0, "n": 2, "wall_s": 0.02, "cpu_s": 0.02}  # contention evidence of two steps


@pytest.fixture(scope="module")
def trained(corpus, config_file):
    """A tiny numpy backend after two training steps, its state_dict before any step (the template a resume
    validates against) and the canonical shapes: (backend, template, shapes, contents of a checkpoint at step 2)."""
    from harness.backends import create_backend
    from harness.config.load import load_config
    from harness.core.data import BatchStream
    from harness.core.weights import init_weights
    from harness.run import checkpoint
    from harness.store.curves import Curves, Eval

    config = load_config(path=config_file, overrides={"steps": 20})
    weights = init_weights(config, corpus.vocab_size, 1)
    backend = create_backend("numpy")
    backend.setup(config, weights, corpus.vocab_size, "cpu", 1)
    template = backend.state_dict()
    stream = BatchStream(corpus.train, config.block_size, config.batch_size, 1, config.scheme)
    losses = [float(backend.train_step(*stream.batch(k), 0.01)) for k in range(2)]
    curves = Curves(step=[0, 1], loss=losses, time_s=[0.01, 0.01],
                    evals=[Eval(0, 4.2, 4.2, 0.1)],
                    chunks=[CHUNK])
    state = checkpoint.contents(backend.state_dict(), 2, curves)
    return backend, template, {n: w.shape for n, w in weights.items()}, state


CKPT_FIX = "delete numpy.ckpt.npz to restart numpy from step 0, or start a new run"


def ckpt_path(tmp_path: Path) -> Path:
    """Where numpy's checkpoint of a run under `tmp_path` lies (its run directory made)."""
    from harness.store import RunPaths

    paths = RunPaths(tmp_path, "r1")
    paths.dir.mkdir(parents=True, exist_ok=True)
    return paths.checkpoint("numpy")


def read_ckpt(path: Path, trained, total: int = 20):
    """numpy's checkpoint `path` (made by `ckpt_path`), read back as a resume reads it."""
    from harness.run import checkpoint
    from harness.store import RunPaths

    _, template, shapes, _ = trained
    return checkpoint.read(RunPaths.of_dir(path.parent), "numpy", template, shapes, total)


def test_a_checkpoint_of_the_run_reads_back_whole_and_loads(trained, tmp_path: Path) -> None:
    backend, _, _, state = trained
    np.savez(ckpt_path(tmp_path), **state)
    step, curves, got = read_ckpt(ckpt_path(tmp_path), trained)
    assert step == 2 and len(curves.loss) == 2 and curves.evals[0].step == 0 and curves.chunks[0]["n"] == 2
    assert not any(k.startswith("harness/") for k in got)
    backend.load_state_dict(got)
    assert all(np.array_equal(backend.state_dict()[k], got[k]) for k in got if not k.startswith("rng/"))


def _params(state: dict, make) -> None:
    for k in [k for k in state if k.startswith("param/")]:
        state[k] = make(state[k])


CHECKPOINT_ATTACKS = {
    "params in float16": (lambda s: _params(s, lambda v: v.astype(np.float16)),
                          "'param/wte.weight' is float16 (65, 16), expected float64 (65, 16)"),
    "params in int64": (lambda s: _params(s, lambda v: v.astype(np.int64)), "is int64 (65, 16), expected float64"),
    "params complex": (lambda s: _params(s, lambda v: v.astype(np.complex128)), "is complex128 (65, 16)"),
    "params as scalars": (lambda s: _params(s, lambda v: np.array(0.5)),
                          "is float64 (one number), expected float64 (65, 16)"),
    "a moment missing": (lambda s: s.pop("adam_m/ln_f.weight"), "lacks array 'adam_m/ln_f.weight'"),
    "a negative second moment": (lambda s: s["adam_v/ln_f.weight"].__setitem__(0, -1.0), "negative or NaN second"),
    "the RNG state missing": (lambda s: s.pop("rng/state"), "lacks array 'rng/state'"),
    "an RNG state of garbage": (lambda s: s.update({"rng/state": np.frombuffer(b"[1, 2", np.uint8)}),
                                "'rng/state' is not an RNG state of this backend (not JSON"),
    "an RNG state of another kind": (lambda s: s.update({"rng/state": np.frombuffer(b'{"a": 1}', np.uint8)}),
                                     "'rng/state' is not an RNG state of this backend (its keys differ)"),
    "the step as a float": (lambda s: s.update({"harness/step": np.array(2.0)}),
                            "'harness/step' is float64 (one number), expected an integer"),
    "the step as a string": (lambda s: s.update({"harness/step": np.array("2")}),
                             "'harness/step' is text (<U1) (one number), expected an integer"),
    "the step past the run": (lambda s: s.update({"harness/step": np.array(21)}), "at step 21, outside this run's "
                                                                                  "1..20"),
    "the step 0": (lambda s: s.update({"harness/step": np.array(0)}), "at step 0, outside"),
    "adam_t not the step": (lambda s: s.update(adam_t=np.array(5)), "adam_t is 5, but the checkpoint is at step 2"),
    "adam_t as a float": (lambda s: s.update(adam_t=np.array(2.0)), "'adam_t' is float64 (one number)"),
    "losses of another step": (lambda s: s.update({"harness/loss": np.ones(3)}),
                               "'harness/loss' is float64 (3,), expected float64 (2,)"),
    "a NaN loss": (lambda s: s["harness/loss"].__setitem__(0, np.nan), "'harness/loss' holds a value no run writes"),
    "ragged evaluations": (lambda s: s.update({"harness/evals": np.zeros((1, 3))}),
                           "'harness/evals' is float64 (1, 3), expected float64 (any, 4)"),
    "evaluations as objects": (lambda s: s.update({"harness/evals": np.array([[0, 1.0], [1]], dtype=object)}),
                               "holds Python objects"),
    "an evaluation past the step": (lambda s: s.update({"harness/evals": np.array([[0, 1, 1, 0.1], [9, 1, 1, 0.1]])}),
                                    "not at whole, increasing steps within 0..2"),
    "contention evidence not JSON": (lambda s: s.update({"harness/chunks": np.frombuffer(b"[{", np.uint8)}),
                                     "not valid JSON"),
    "contention evidence past the step": (
        lambda s: s.update({"harness/chunks": np.frombuffer(json.dumps([dict(CHUNK, n=5)]).encode(), np.uint8)}),
        "a chunk ends after the checkpoint's step 2"),
    "an array of another name": (lambda s: s.update(extra=np.zeros(1)), "holds array 'extra'"),
}


@pytest.mark.parametrize("attack", list(CHECKPOINT_ATTACKS))
def test_a_tampered_checkpoint_is_refused_before_use(attack: str, trained, tmp_path: Path) -> None:
    change, words = CHECKPOINT_ATTACKS[attack]
    state = {k: np.array(v) for k, v in trained[3].items()}
    change(state)
    np.savez(ckpt_path(tmp_path), **state)
    refused(lambda: read_ckpt(ckpt_path(tmp_path), trained), "checkpoint", "numpy.ckpt.npz", words, CKPT_FIX)


@pytest.mark.parametrize("kind", ["empty", "plain .npy", "fifo", "/dev/zero", "8 TB header", "zip bomb"])
def test_a_checkpoint_that_is_no_checkpoint_is_refused_unread(kind: str, trained, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = ckpt_path(tmp_path)
    state = dict(trained[3])
    words = {"empty": "is not a readable .npz archive (empty",
             "plain .npy": "is a single .npy array, not an .npz archive",
             "fifo": "is a named pipe (FIFO), not a regular file", "/dev/zero": "is a character device",
             "8 TB header": "'harness/chunks' declares shape (8000000000000,) of uint8 (7.28 TiB), more than",
             "zip bomb": "holds array 'junk', which no such file holds"}[kind]
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "plain .npy":
        np.save(open(path, "wb"), state["param/wte.weight"])
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")
    else:
        state.pop("harness/chunks")
        extra = ([stored("harness/chunks.npy", npy_header((8 * 10**12,), "|u1") + b"[]")] if kind == "8 TB header"
                 else [bomb("junk.npy", gigabytes=1.0)])
        savez(path, state, extra)
    opened = Opened(monkeypatch)
    refused(lambda: read_ckpt(path, trained), words, CKPT_FIX)
    assert "junk.npy" not in opened.names


# --- parity probes --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def probe_run(corpus, config_file):
    """(config, the numpy oracle's probe of 3 steps with dropout and attention dropout, its file's bytes)."""
    from harness.backends import create_backend
    from harness.config.load import load_config
    from harness.run import probe
    from harness.store.writes import npz_bytes

    config = load_config(path=config_file, overrides={"steps": 3, "dropout": 0.1, "attn_dropout": True})
    arrays, _ = probe.run(create_backend("numpy"), config, corpus, 1)
    return config, arrays, npz_bytes(arrays)


def read_probe(path: Path, probe_run, corpus, **kw) -> dict[str, np.ndarray]:
    from harness.run import probe

    return probe.read(path, "numpy", probe_run[0], corpus.vocab_size, 3, 3, **kw)


def test_a_probe_of_the_run_reads_back_whole(probe_run, corpus, tmp_path: Path) -> None:
    (tmp_path / "numpy.probe.npz").write_bytes(probe_run[2])
    got = read_probe(tmp_path / "numpy.probe.npz", probe_run, corpus)
    assert sorted(got) == sorted(probe_run[1]) and any(k.startswith("tap_mask/") for k in got)


PROBE_ATTACKS = {
    "truncated": (lambda p, a, blob: p.write_bytes(blob[:len(blob) // 2]), "not a readable .npz archive"),
    "fifo": (lambda p, a, blob: os.mkfifo(p), "a named pipe (FIFO), not a regular file"),
    "/dev/zero": (lambda p, a, blob: p.symlink_to("/dev/zero"), "a character device, not a regular file"),
    "plain .npy": (lambda p, a, blob: np.save(open(p, "wb"), a["logits"]), "a single .npy array"),
    "8 TB header": (lambda p, a, blob: savez(p, {k: v for k, v in a.items() if k != "logits"},
                                             [stored("logits.npy", npy_header((10**12,)) + b"\0" * 8)]),
                    "'logits' is float64 (1000000000000,), expected float32 or float64 (8, 32, 65)"),
    "wrong shapes": (lambda p, a, blob: np.savez(p, **dict(a, **{"grad/wte.weight": np.zeros((16, 65))})),
                     "'grad/wte.weight' is float64 (16, 65), expected float32 or float64 (65, 16)"),
    "string arrays": (lambda p, a, blob: np.savez(p, **dict(a, logits=np.array(["a", "b"]))),
                      "'logits' is text (<U1) (2,), expected float32 or float64"),
    "a state cut short": (lambda p, a, blob: np.savez(p, **{k: v for k, v in a.items()
                                                           if k != "opt/2/adam_v/ln_f.weight"}),
                          "lacks array 'opt/2/adam_v/ln_f.weight' (a step's state is kept whole)"),
}


@pytest.mark.parametrize("attack", list(PROBE_ATTACKS))
def test_a_broken_probe_is_its_backend_s_crash_not_a_difference(attack: str, probe_run, corpus,
                                                                 tmp_path: Path) -> None:
    from harness.run.probe import ProbeUnreadable

    path = tmp_path / "numpy.probe.npz"
    change, words = PROBE_ATTACKS[attack]
    change(path, probe_run[1], probe_run[2])
    message = refused(lambda: read_probe(path, probe_run, corpus), words)
    assert message.startswith("backend numpy's probe is unreadable: probe ") and "numpy.probe.npz" in message
    with pytest.raises(ProbeUnreadable), deadline(30):
        read_probe(path, probe_run, corpus)


def test_the_re_synchronising_worker_reads_only_the_reference_s_states(probe_run, corpus, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker after the reference reads the reference's probe (harness.run.persist.reference_states) through the
    bounded reader: only its optimizer states, each checked against the run (before: np.load, any shape taken)."""
    from harness.run.persist import reference_states
    from harness.run.probe import OPT_PREFIX, ProbeUnreadable
    from harness.store import RunPaths

    paths = RunPaths(tmp_path, "r1")
    paths.dir.mkdir(parents=True)
    savez(paths.probe("numpy"), probe_run[1], [bomb("tap/junk.npy")])
    opened = Opened(monkeypatch)
    got = reference_states(paths, "numpy", probe_run[0], corpus.vocab_size, 3, 3)
    assert got and all(k.startswith(OPT_PREFIX) for k in got) and "tap/junk.npy" not in opened.names
    assert not any(n.startswith(("logits", "grad/")) for n in opened.names)
    np.savez(paths.probe("numpy"), **dict(probe_run[1], **{"opt/1/param/wte.weight": np.zeros((16, 65))}))
    with pytest.raises(ProbeUnreadable, match=r"^backend numpy's probe is unreadable: probe .*'opt/1/param/wte\.weight"
                                              r"' is float64 \(16, 65\), expected float32 or float64 \(65, 16\)"):
        reference_states(paths, "numpy", probe_run[0], corpus.vocab_size, 3, 3)


def test_a_worker_that_could_not_read_the_reference_s_probe_is_a_crash_of_the_reference(probe_run, corpus,
                                                                                       tmp_path: Path) -> None:
    """The backend after the reference exits 2 (it could not read its input): the parent names the probe."""
    from harness.parity import record as parity_record
    from harness.store import RunPaths

    paths = RunPaths(tmp_path, "r1")
    paths.dir.mkdir(parents=True)
    pp = SimpleNamespace(backends=["numpy", "torch"], steps=3, opt_steps=3,
                         plan=SimpleNamespace(config=probe_run[0], corpus=corpus))
    paths.probe("numpy").write_bytes(probe_run[2])
    assert parity_record.unreadable_probe(pp, paths, {"numpy": 0, "torch": 2}) is None
    paths.probe("numpy").write_bytes(probe_run[2][:1000])
    why = parity_record.unreadable_probe(pp, paths, {"numpy": 0, "torch": 2})
    assert why.startswith("backend numpy's probe is unreadable: probe ") and "not a readable .npz" in why


def test_parity_names_the_reference_s_probe_the_other_backend_could_not_read(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch,
                                                                              capsys: pytest.CaptureFixture) -> None:
    """The reference (numpy) completed, the other (torch) refused its input, exit 2: the reference's probe is
    unreadable, so `harness parity` says so, exit 3 (the reference left no usable result), in parity.json too."""
    from harness.cli.main import main
    from harness.run import supervise

    def execute(paths, backends, **kw):
        paths.probe("numpy").write_bytes(b"PK\x03\x04 cut short")
        return {"numpy": 0, "torch": 2}
    monkeypatch.setattr(supervise, "execute", execute)
    code = main(["parity", "--data", str(data_path()), "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert code == 3 and "ERROR: backend numpy's probe is unreadable: probe " in err, err
    (path,) = tmp_path.glob("runs/*/parity.json")
    doc = json.loads(path.read_text())
    assert doc["verdict"] == "error" and doc["failures"][0].startswith("ERROR: backend numpy's probe is unreadable")


def test_parity_with_a_broken_probe_exits_3_and_says_so_in_parity_json(tmp_path: Path, config_file: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """Both workers run for real and complete; then the other's probe is truncated before the parent reads it:
    "backend torch's probe is unreadable", exit 3, parity.json with verdict error; no FAIL blames the model (before:
    a traceback, and no parity.json). In process (the workers are the real children); the check's page is left to
    the test above, which writes it on the same error path."""
    from harness.cli import parity as cli_parity
    from harness.cli.main import main
    from harness.run import supervise

    real = supervise.execute

    def execute(paths, backends, **kw):
        codes = real(paths, backends, **kw)
        paths.probe("torch").write_bytes(paths.probe("torch").read_bytes()[:500])
        return codes
    monkeypatch.setattr(supervise, "execute", execute)
    monkeypatch.setattr(cli_parity, "_write_page", lambda paths: None)
    code = main(["parity", "--backend", "numpy,torch", "--config", str(config_file), "--steps", "2", "--out",
                 str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "ERROR: backend torch's probe is unreadable: probe " in err and "Traceback" not in err, err
    (record,) = tmp_path.glob("runs/*/parity.json")
    doc = json.loads(record.read_text())
    assert doc["verdict"] == "error" and "backend torch's probe is unreadable" in doc["failures"][0], doc["failures"]
    assert not any(f.startswith("FAIL") for f in doc["failures"])


# --- kits -----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_kit(tmp_path_factory, config_file) -> Path:
    from harness.cli.main import main

    out = tmp_path_factory.mktemp("kit") / "kit"
    assert main(["kit", "export", "--out", str(out), "--data", str(data_path()), "--config", str(config_file),
                 "--steps", "1", "--quiet"]) == 0
    return out


@pytest.mark.parametrize("change,words", [
    (lambda b: b["x"].__setitem__((0, 0, 0), 65), "array 'x' holds token id 65 at index (0, 0, 0), outside the "
                                                   "vocabulary's 0..64"),
    (lambda b: b["y"].__setitem__((0, 1, 2), -1), "array 'y' holds token id -1 at index (0, 1, 2), outside"),
    (lambda b: b["lr"].__setitem__(0, -0.001), "array 'lr' holds the negative learning rate -0.001 at step 0"),
    (lambda b: b["lr"].__setitem__(0, np.inf), "array 'lr' holds inf at index (0,)"),
], ids=["an id past the vocabulary", "a negative id", "a negative rate", "an infinite rate"])
def test_a_kit_whose_batches_are_impossible_is_malformed(change, words: str, small_kit: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    import hashlib

    from harness.cli.main import main
    from harness.kit.export import npz_bytes

    kit = tmp_path / "kit"
    shutil.copytree(small_kit, kit)
    with np.load(kit / "batches.npz") as f:
        batches = {k: f[k].copy() for k in f.files}
    change(batches)
    blob = npz_bytes(batches)
    (kit / "batches.npz").write_bytes(blob)
    manifest = json.loads((kit / "manifest.json").read_text())
    manifest["files"]["batches.npz"].update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    (kit / "manifest.json").write_text(json.dumps(manifest))
    np.savez(tmp_path / "results.npz", loss=np.ones(1))
    code = main(["kit", "check", str(kit), str(tmp_path / "results.npz")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
    assert "kit file batches.npz" in err and words in err and "export the kit again" in err, err
