"""Text quality of a trained backend: harness-driven decoding, corpus BLEU and chrF with sacrebleu.

Decoding belongs to the harness, not the backend: a backend only returns next-token logits, and the harness
samples with its own seeded RNG from a float64 softmax by inverse CDF. Identical weights therefore give identical
text in every backend, and the text of two frameworks differs only where their logits differ.

The protocol (fixed, the same for every backend and every size; docs/usage.md, "Text quality"):

- Prompts: ``N_PROMPTS`` = 40 windows of ``PROMPT_CHARS`` = 64 characters at evenly spaced offsets of the
  validation split (the first at offset 0, the last ending ``CONTINUATION_CHARS`` before the split's end).
- Each prompt is continued for ``CONTINUATION_CHARS`` = 128 characters at ``TEMPERATURE`` = 0.8 (nanoGPT's
  sampling temperature); the context fed to the model is the last ``block_size`` characters. The 40 prompts are
  decoded together, as one batch, so generation tokens/s counts 40 x 128 = 5,120 characters.
- References are the true 128 characters that follow each prompt in the validation text.
- Scores: sacrebleu corpus BLEU (13a word tokenisation, exponential smoothing) and chrF (character 6-grams,
  beta 2), one segment per prompt with whitespace runs (newlines included) collapsed to one space, each with a
  95 % bootstrap confidence interval (``BOOTSTRAP`` = 1000 resamples, sacrebleu's seed 12345) and sacrebleu's
  signature. chrF is the more informative score for a character-level model: word 3- and 4-grams of a small
  model's text rarely match, so BLEU stays near zero until the model spells whole words.
- Samples: one prompt (the first ``PROMPT_CHARS`` characters of the validation split) continued for
  ``SAMPLE_CHARS`` = 200 characters at each temperature of ``SAMPLE_TEMPERATURES`` = 1.5, 1.0, 0.8, 0.5, 0.1 and
  greedy (argmax), all rows in one batch.
- Randomness: the uniform draws come from ``numpy.random.PCG64([seed, 3])`` (seed = the run's ``--seed``), drawn
  up front as an (n_new, rows) array, so every backend consumes exactly the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from harness.backends.base import Backend
from harness.config.fields import Config
from harness.core.data import Corpus
from harness.store.record import Continuation, TextProtocol, TextQuality, TextSample

N_PROMPTS = 40
PROMPT_CHARS = 64
CONTINUATION_CHARS = 128
TEMPERATURE = 0.8
SAMPLE_TEMPERATURES: tuple[float | None, ...] = (1.5, 1.0, 0.8, 0.5, 0.1, None)  # None = greedy
SAMPLE_CHARS = 200
BOOTSTRAP = 1000  # sacrebleu bootstrap resamples for the 95 % confidence intervals
RNG_STREAM = 3  # PCG64([seed, RNG_STREAM]): the sampling stream (0, 1, 2 are the batch and eval streams)

Temperature = float | None


def sample_next(logits: np.ndarray, temperature: Temperature | Sequence[Temperature],
                uniforms: np.ndarray) -> np.ndarray:
    """Next token per row of (N, V) `logits`, given one uniform draw in [0, 1) per row.

    `temperature` is one value for every row or one per row; None means greedy (argmax, the uniform is unused).
    Otherwise p = softmax(logits / temperature) in float64 and the token is the first index whose cumulative
    probability exceeds the uniform (inverse CDF).
    """
    logits = np.asarray(logits, dtype=np.float64)
    n, vocab = logits.shape
    temps = list(temperature) if isinstance(temperature, (Sequence, np.ndarray)) else [temperature] * n
    if len(temps) != n:
        raise ValueError(f"{len(temps)} temperatures for {n} rows")
    out = logits.argmax(axis=-1)
    sampled = np.array([t is not None for t in temps])
    if sampled.any():
        t = np.array([x for x in temps if x is not None], dtype=np.float64)[:, None]
        if (t <= 0).any():
            raise ValueError("temperatures must be positive (None for greedy)")
        z = logits[sampled] / t
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        cdf = np.cumsum(p, axis=-1)
        cdf /= cdf[:, -1:]
        u = np.asarray(uniforms, dtype=np.float64)[sampled]
        out[sampled] = np.minimum((cdf <= u[:, None]).sum(axis=-1), vocab - 1)
    return out


def uniform_draws(seed: int, n_new: int, rows: int) -> np.ndarray:
    """The (n_new, rows) uniforms every backend's generation consumes: PCG64([seed, 3]), drawn up front."""
    return np.random.Generator(np.random.PCG64([seed, RNG_STREAM])).random((n_new, rows))


def generate(backend: Backend, prompts: np.ndarray, n_new: int, block_size: int,
             temperature: Temperature | Sequence[Temperature], seed: int) -> np.ndarray:
    """Continue each row of `prompts` (N, P) by `n_new` tokens; returns (N, n_new).

    All rows are decoded together (one `backend.logits` call per new token) on the last `block_size` tokens of
    context; only the last position's logits are copied to the host (`logits(..., last_only=True)`).
    `temperature` is one value or one per row (None = greedy); uniforms come from `uniform_draws(seed)`.
    """
    uniforms = uniform_draws(seed, n_new, prompts.shape[0])
    ids = np.asarray(prompts, dtype=np.int64)
    for i in range(n_new):
        context = ids[:, -block_size:]
        next_ids = sample_next(np.asarray(backend.logits(context, last_only=True))[:, -1, :], temperature, uniforms[i])
        ids = np.concatenate([ids, next_ids[:, None]], axis=1)
    return ids[:, prompts.shape[1]:]


def prompt_offsets(n_val: int, n_prompts: int = N_PROMPTS, prompt_chars: int = PROMPT_CHARS,
                   continuation_chars: int = CONTINUATION_CHARS) -> np.ndarray:
    """Evenly spaced start offsets in a validation split of `n_val` characters (first 0, last as late as fits)."""
    last = n_val - (prompt_chars + continuation_chars)
    return np.linspace(0, max(last, 0), n_prompts).astype(np.int64)


def prompt_set(corpus: Corpus, n_prompts: int = N_PROMPTS, prompt_chars: int = PROMPT_CHARS,
               continuation_chars: int = CONTINUATION_CHARS) -> tuple[np.ndarray, list[str]]:
    """Prompts at evenly spaced offsets of the validation split and their true continuations (references).

    A validation split shorter than one prompt plus its continuation gives shorter references (scored as they are).
    """
    offsets = prompt_offsets(len(corpus.val), n_prompts, prompt_chars, continuation_chars)
    prompt_chars = min(prompt_chars, len(corpus.val) - 1)
    prompts = np.stack([corpus.val[o:o + prompt_chars] for o in offsets])
    span = prompt_chars + continuation_chars
    references = [corpus.decode(corpus.val[o + prompt_chars:o + span]) for o in offsets]
    return prompts, references


def one_line(text: str) -> str:
    """sacrebleu scores one segment per line, so each continuation becomes one line (whitespace runs -> one space)."""
    return " ".join(text.split())


def score_text(hypotheses: list[str], references: list[str], bootstrap: int = BOOTSTRAP) -> dict[str, Any]:
    """Corpus BLEU and chrF of `hypotheses` against aligned `references`, with 95 % bootstrap CIs and signatures.

    CIs are half-widths (None when `bootstrap` is 0); sacrebleu's bootstrap uses its fixed seed 12345.
    """
    from sacrebleu.metrics import BLEU, CHRF

    hyp_lines, ref_lines = [one_line(h) for h in hypotheses], [one_line(r) for r in references]
    result: dict[str, Any] = {}
    for key, metric in (("bleu", BLEU()), ("chrf", CHRF())):
        score = metric.corpus_score(hyp_lines, [ref_lines], n_bootstrap=bootstrap or 1)
        result[key] = float(score.score)
        result[f"{key}_ci"] = float(score._ci) if bootstrap > 1 and getattr(score, "_ci", None) is not None else None
        result[f"{key}_signature"] = str(metric.get_signature())
    return result


def text_quality(backend: Backend, corpus: Corpus, config: Config, seed: int) -> TextQuality:
    """BLEU and chrF of prompted continuations against the true text, plus samples at several temperatures.

    The worker's entry point; see the module docstring for the protocol. The result is stored as the RunRecord's
    `text` and holds the protocol, the scores with CIs and signatures, generation time and tokens/s, the samples
    and every (prompt, reference, hypothesis).
    """
    prompts, references = prompt_set(corpus)
    t0 = time.perf_counter()
    continuations = generate(backend, prompts, CONTINUATION_CHARS, config.block_size, TEMPERATURE, seed)
    gen_s = time.perf_counter() - t0
    hypotheses = [corpus.decode(row) for row in continuations]
    scores = score_text(hypotheses, references)
    start = corpus.val[:PROMPT_CHARS]
    rows = np.repeat(start[None, :], len(SAMPLE_TEMPERATURES), axis=0)
    sampled = generate(backend, rows, SAMPLE_CHARS, config.block_size, list(SAMPLE_TEMPERATURES), seed)
    n_tokens = continuations.size
    return TextQuality(
        protocol=TextProtocol(n_prompts=len(prompts), prompt_chars=int(prompts.shape[1]),
                              continuation_chars=CONTINUATION_CHARS, temperature=TEMPERATURE, seed=seed,
                              offsets="evenly spaced over the validation split", bootstrap=BOOTSTRAP,
                              sample_chars=SAMPLE_CHARS, sample_temperatures=list(SAMPLE_TEMPERATURES)),
        **scores,
        generation_s=gen_s,
        generation_tokens=int(n_tokens),
        generation_tokens_per_s=n_tokens / gen_s if gen_s > 0 else None,
        sample_prompt=corpus.decode(start),
        samples=[TextSample(temperature=t, text=corpus.decode(ids)) for t, ids in zip(SAMPLE_TEMPERATURES, sampled)],
        continuations=[Continuation(prompt=corpus.decode(p), reference=r, hypothesis=h)
                       for p, r, h in zip(prompts, references, hypotheses)],
    )
