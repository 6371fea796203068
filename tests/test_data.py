"""The corpus, the batch stream and the evaluation batches, checked against the raw text."""

from __future__ import annotations

import hashlib
import http.server
import threading
from functools import partial

import numpy as np
import pytest
from conftest import CORPUS_SHA256

from harness.core import data as core_data
from harness.core.data import BatchStream, eval_batches, load_corpus
from harness.errors import UsageError


def test_test_corpus_is_the_same_everywhere(corpus, data):
    """The generated corpus is byte-identical on every machine (conftest pins its sha256), in the 65-symbol alphabet
    of Tiny Shakespeare, and split 90/10 like any corpus."""
    from corpus import ALPHABET, N_CHARS

    raw = data.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == CORPUS_SHA256 == corpus.sha256
    assert corpus.n_chars == N_CHARS and corpus.vocab == ALPHABET
    assert (len(corpus.train), len(corpus.val)) == (225_000, 25_000)  # 90/10
    text = raw.decode()
    assert corpus.decode(corpus.train[:200]) == text[:200]
    assert corpus.decode(corpus.val[:100]) == text[225_000:225_100]
    assert np.array_equal(corpus.encode(text[:500]), corpus.train[:500])


def test_tiny_shakespeare_facts(shakespeare):
    """The real Tiny Shakespeare where this machine has it (HARNESS_DATA or the user cache): its published facts."""
    corpus = load_corpus(shakespeare)
    if corpus.sha256 != core_data.TINY_SHAKESPEARE_SHA256:  # the project corpus stood in: its own facts are above
        assert corpus.vocab_size == 65
        return
    assert corpus.n_chars == 1_115_394 and corpus.vocab_size == 65
    assert (len(corpus.train), len(corpus.val)) == (1_003_854, 111_540)  # 90/10
    text = shakespeare.read_text()
    assert corpus.decode(corpus.val[:100]) == text[1_003_854:1_003_954]


@pytest.mark.parametrize("scheme", ["epochs", "random"])
def test_batches_deterministic_and_shifted(corpus, data, scheme):
    text = data.read_text()
    a = BatchStream(corpus.train, 64, 16, seed=7, scheme=scheme)
    b = BatchStream(corpus.train, 64, 16, seed=7, scheme=scheme)
    other = BatchStream(corpus.train, 64, 16, seed=8, scheme=scheme)
    for step in (0, 1, 5, 979, 980, 3000):
        xa, ya = a.batch(step)
        xb, yb = b.batch(step)
        assert xa.shape == ya.shape == (16, 64) and xa.dtype == np.int64
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
        assert not np.array_equal(xa, other.batch(step)[0])
        # targets are the inputs shifted by one character of the real text
        assert np.array_equal(ya[:, :-1], xa[:, 1:])
        for row_x, row_y in zip(xa[:3], ya[:3]):
            s = corpus.decode(row_x)
            start = text.find(s)
            assert start >= 0 and text[start + 1:start + 65] == corpus.decode(row_y)
    assert a.fingerprint() == b.fingerprint() != other.fingerprint()


def test_epochs_visit_every_window_once(corpus):
    T, B = 64, 16
    s = BatchStream(corpus.train, T, B, seed=3, scheme="epochs")
    n_windows = (len(corpus.train) - 1) // T
    n = s.batches_per_epoch
    assert n == n_windows // B
    aligned = {corpus.train[i * T:(i + 1) * T].tobytes() for i in range(n_windows)}
    seen = [s.batch(k)[0][i].tobytes() for k in range(n) for i in range(B)]
    # non-overlapping windows at multiples of T, none repeated inside an epoch
    assert len(set(seen)) == len(seen) == n * B and set(seen) <= aligned
    # the next epoch is a different order of the same windows
    assert not np.array_equal(s.batch(n)[0], s.batch(0)[0])


def test_eval_batches_fixed(corpus):
    a = eval_batches(corpus.val, 64, 16, 5, seed=1)
    b = eval_batches(corpus.val, 64, 16, 5, seed=1)
    assert len(a) == 5 and all(np.array_equal(x1, x2) and np.array_equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    assert all(np.array_equal(y[:, :-1], x[:, 1:]) for x, y in a)


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"abc\x00def" * 100, "looks binary"),
    (b"\xff\xfe\xfa not utf8" * 100, "is not UTF-8"),
])
def test_bad_data_files(tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=message):
        load_corpus(path)


def test_missing_and_directory(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_corpus(tmp_path / "nope.txt")
    with pytest.raises(UsageError, match="is a directory"):
        load_corpus(tmp_path)


def test_too_short_for_a_block(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("hello world " * 30)  # 360 chars: val split 36 < block 64 + 1
    corpus = load_corpus(path)
    with pytest.raises(UsageError, match="too short"):
        core_data.check_fits(corpus, 64, 16)


def test_offline_without_cache_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HARNESS_DATA", raising=False)
    monkeypatch.setattr(core_data, "TINY_SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")  # nothing listens
    with pytest.raises(UsageError) as info:
        load_corpus(None)
    message = str(info.value)
    assert "\n" not in message and "--data" in message and "HARNESS_DATA" in message
    assert not (tmp_path / "cache" / "tinyshakespeare.txt").exists()


def test_download_verifies_and_caches(tmp_path, monkeypatch, data):
    """Serve a file on loopback as if it were Tiny Shakespeare (its checksum patched in): first use downloads and
    verifies, second use reads the cache."""
    monkeypatch.setattr(core_data, "TINY_SHAKESPEARE_SHA256", CORPUS_SHA256)
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "input.txt").write_bytes(data.read_bytes())
    (tmp_path / "www" / "wrong.txt").write_bytes(b"not shakespeare")
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "www"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
        monkeypatch.delenv("HARNESS_DATA", raising=False)
        monkeypatch.setattr(core_data, "TINY_SHAKESPEARE_URL", f"http://127.0.0.1:{port}/wrong.txt")
        with pytest.raises(UsageError, match="wrong sha256"):
            load_corpus(None)
        monkeypatch.setattr(core_data, "TINY_SHAKESPEARE_URL", f"http://127.0.0.1:{port}/input.txt")
        corpus = load_corpus(None)
        assert corpus.sha256 == core_data.TINY_SHAKESPEARE_SHA256
        assert (tmp_path / "cache" / "tinyshakespeare.txt").is_file()
        server.shutdown()
        assert load_corpus(None).sha256 == core_data.TINY_SHAKESPEARE_SHA256  # from the cache, server gone
    finally:
        server.server_close()


def test_bom_is_stripped_and_recorded(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbf" + b"hello world\n" * 50)
    corpus = load_corpus(path)
    assert "\ufeff" not in corpus.chars and corpus.bom_stripped
    assert corpus.decode(corpus.train[:5]) == "hello" and corpus.n_chars == 600
    assert corpus.describe()["bom_stripped"] is True
    assert corpus.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()  # the file as it is on disk
    assert not load_corpus(tmp_path / "bom.txt", blob=b"plain text\n" * 50).bom_stripped


@pytest.mark.parametrize("ending", [b"\r\n", b"\r"])
def test_line_endings_normalised_by_default_or_kept(tmp_path, ending):
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"to be or not" + ending + b"that is it" + ending)
    corpus = load_corpus(path)
    assert "\r" not in corpus.chars and corpus.line_endings == "normalised" and corpus.line_endings_changed == 2
    assert corpus.decode(np.concatenate([corpus.train, corpus.val])) == "to be or not\nthat is it\n"
    kept = load_corpus(path, keep_line_endings=True)
    assert "\r" in kept.chars and kept.line_endings == "kept" and kept.line_endings_changed == 0
    assert kept.describe()["vocab"] == "".join(sorted(set(path.read_bytes().decode())))


def test_vocabulary_is_described(corpus):
    d = corpus.describe()
    assert d["vocab"] == "".join(corpus.chars) and len(d["vocab"]) == d["vocab_size"] == 65
    assert d["line_endings"] == "normalised" and d["line_endings_changed"] == 0 and not d["bom_stripped"]
    assert "vocabulary of 65 symbols" in corpus.summary()
