"""Text-quality protocol: harness-driven decoding, prompts and references, BLEU/chrF, against independent truths."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from harness.config.load import load_config
from harness.core.data import Corpus
from harness.run import text as run_text
from harness.store.record import TextQuality

ALPHABET = tuple(sorted(set(" \nabcdefghijklmnopqrstuvwxyz.,")))


@functools.cache
def random_corpus(n_chars: int = 30_000, seed: int = 0) -> Corpus:
    """A random text (words of 1-8 letters, spaces, newlines): every 64-character context occurs once."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=n)) for n in rng.integers(1, 9, size=4000)]
    seps = [" ", " ", " ", ", ", ".\n"]
    picks = rng.integers(0, len(words), size=n_chars // 2)
    gaps = rng.integers(0, len(seps), size=n_chars // 2)
    text = "".join(words[w] + seps[g] for w, g in zip(picks, gaps))[:n_chars]
    index = {c: i for i, c in enumerate(ALPHABET)}
    ids = np.array([index[c] for c in text], dtype=np.int64)
    n_train = int(len(ids) * 0.9)
    return Corpus(path="<random>", sha256="0" * 64, chars=ALPHABET, train=ids[:n_train], val=ids[n_train:])


class OracleBackend:
    """Logits that put (almost) all mass on the character that truly follows the context in the text."""

    name = "oracle"

    def __init__(self, corpus: Corpus, margin: float = 60.0):
        self.text = corpus.decode(corpus.val)
        self.corpus, self.margin = corpus, margin

    def logits(self, x: np.ndarray, last_only: bool = False) -> np.ndarray:
        out = np.zeros((x.shape[0], x.shape[1], self.corpus.vocab_size))
        for row, ids in enumerate(x):
            context = self.corpus.decode(ids)
            at = self.text.find(context)
            assert at >= 0 and self.text.find(context, at + 1) < 0, "context not unique"
            out[row, -1, self.corpus.val[at + len(context)]] = self.margin
        return out


class UniformBackend:
    """Equal logits everywhere, as float32 or float64."""

    name = "uniform"

    def __init__(self, vocab: int, dtype: type = np.float64, value: float = 0.0):
        self.vocab, self.dtype, self.value = vocab, dtype, value

    def logits(self, x: np.ndarray, last_only: bool = False) -> np.ndarray:
        return np.full((x.shape[0], x.shape[1], self.vocab), self.value, dtype=self.dtype)


# --- sample_next ---------------------------------------------------------------------------------------------------
def test_inverse_cdf_hand_computed() -> None:
    """p = (0.1, 0.2, 0.3, 0.4): cdf (0.1, 0.3, 0.6, 1.0); the token is the first whose cdf exceeds u."""
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]] * 6))
    u = np.array([0.0, 0.05, 0.25, 0.59, 0.61, 0.999])
    assert run_text.sample_next(logits, 1.0, u).tolist() == [0, 0, 1, 2, 3, 3]


def test_temperature_sharpens_by_hand() -> None:
    """T = 0.5 squares the probabilities: (1, 4, 9, 16)/30, cdf (1/30, 5/30, 14/30, 1)."""
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]] * 4))
    u = np.array([0.02, 0.1, 0.4, 0.5])
    assert run_text.sample_next(logits, 0.5, u).tolist() == [0, 1, 2, 3]


def test_greedy_is_argmax_and_per_row_temperatures() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(5, 11))
    u = rng.random(5)
    assert run_text.sample_next(logits, None, u).tolist() == logits.argmax(axis=1).tolist()
    mixed = run_text.sample_next(logits, [None, 1.0, None, 0.5, 2.0], u)
    assert mixed[0] == logits[0].argmax() and mixed[2] == logits[2].argmax()
    for row, t in ((1, 1.0), (3, 0.5), (4, 2.0)):
        assert mixed[row] == run_text.sample_next(logits[row:row + 1], t, u[row:row + 1])[0]


def test_zero_probability_token_never_drawn() -> None:
    """A token whose probability underflows to 0 is never sampled, even for u = 0."""
    logits = np.array([[-1e4, 0.0, 0.0]])
    assert run_text.sample_next(logits, 0.1, np.array([0.0]))[0] == 1


# --- generation ------------------------------------------------------------------------------------------------------
def test_uniform_logits_follow_the_published_uniform_stream() -> None:
    """Uniform logits: token = floor(u * V), with u from PCG64([seed, 3]) drawn as an (n_new, rows) array."""
    vocab, rows, n_new, seed = 13, 4, 25, 99
    prompts = np.zeros((rows, 5), dtype=np.int64)
    out = run_text.generate(UniformBackend(vocab), prompts, n_new, block_size=8, temperature=1.0, seed=seed)
    u = np.random.Generator(np.random.PCG64([seed, 3])).random((n_new, rows))
    assert out.tolist() == np.floor(u * vocab).astype(int).T.tolist()


def test_identical_logits_give_identical_text_across_dtypes() -> None:
    """Two 'backends' with the same logits (float32 and float64) decode the same text at every temperature."""
    prompts = np.arange(12, dtype=np.int64).reshape(3, 4) % 7
    for t in (1.5, 0.8, None):
        a = run_text.generate(UniformBackend(7, np.float32, 0.25), prompts, 30, 16, t, seed=5)
        b = run_text.generate(UniformBackend(7, np.float64, 0.25), prompts, 30, 16, t, seed=5)
        assert a.tolist() == b.tolist()


def test_prompts_and_references_come_from_the_validation_text() -> None:
    corpus = random_corpus()
    prompts, refs = run_text.prompt_set(corpus)
    n_val, P, L = len(corpus.val), run_text.PROMPT_CHARS, run_text.CONTINUATION_CHARS
    text = corpus.decode(corpus.val)
    assert prompts.shape == (run_text.N_PROMPTS, P)
    assert corpus.decode(prompts[0]) == text[:P] and refs[0] == text[P:P + L]
    assert corpus.decode(prompts[-1]) + refs[-1] == text[n_val - P - L:]  # the last window ends the split
    for p, r in zip(prompts, refs):
        assert len(r) == L and corpus.decode(p) + r in text


@pytest.fixture(scope="module")
def oracle_quality() -> TextQuality:
    corpus = random_corpus()
    config = load_config("small")
    return run_text.text_quality(OracleBackend(corpus), corpus, config, seed=1337)


def test_oracle_scores_100(oracle_quality: TextQuality) -> None:
    """A backend that always predicts the true next character reproduces the references: BLEU = chrF = 100."""
    q = oracle_quality
    assert q.bleu == pytest.approx(100.0) and q.chrf == pytest.approx(100.0)
    assert all(c.hypothesis == c.reference for c in q.continuations)
    assert "tok:13a" in q.bleu_signature and "nc:6" in q.chrf_signature
    assert q.bleu_ci == pytest.approx(0.0) and q.chrf_ci == pytest.approx(0.0)


def test_text_quality_record_shape(oracle_quality: TextQuality) -> None:
    q = oracle_quality
    p = q.protocol
    assert (p.n_prompts, p.prompt_chars, p.continuation_chars, p.temperature) == (
        run_text.N_PROMPTS, run_text.PROMPT_CHARS, run_text.CONTINUATION_CHARS, run_text.TEMPERATURE)
    assert q.generation_tokens == run_text.N_PROMPTS * run_text.CONTINUATION_CHARS
    assert q.generation_tokens_per_s == pytest.approx(q.generation_tokens / q.generation_s)
    assert [s.temperature for s in q.samples] == [1.5, 1.0, 0.8, 0.5, 0.1, None]
    assert all(len(s.text) == run_text.SAMPLE_CHARS for s in q.samples)
    # the oracle is certain, so every temperature continues the sample prompt with the true text
    corpus = random_corpus()
    truth = corpus.decode(corpus.val[run_text.PROMPT_CHARS:run_text.PROMPT_CHARS + run_text.SAMPLE_CHARS])
    assert all(s.text == truth for s in q.samples)
    # as the record holds it: every key of the JSON the report reads
    doc = q.to_dict()
    assert set(doc) >= {"protocol", "bleu", "bleu_ci", "bleu_signature", "chrf", "chrf_ci", "chrf_signature",
                        "generation_s", "generation_tokens", "generation_tokens_per_s", "sample_prompt", "samples",
                        "continuations"}
    assert set(doc["continuations"][0]) == {"prompt", "reference", "hypothesis"}


def test_score_text_against_sacrebleu_directly() -> None:
    """Whitespace runs become one space per segment; the scores are sacrebleu's corpus scores of those lines."""
    from sacrebleu.metrics import BLEU, CHRF

    hyps = ["the cat\nsat on  the mat", "a dog ran far away"]
    refs = ["the cat sat on the mat", "the dog ran away"]
    got = run_text.score_text(hyps, refs, bootstrap=0)
    lines = ["the cat sat on the mat", "a dog ran far away"]
    assert got["bleu"] == pytest.approx(BLEU().corpus_score(lines, [refs]).score)
    assert got["chrf"] == pytest.approx(CHRF().corpus_score(lines, [refs]).score)
    assert got["bleu_ci"] is None
