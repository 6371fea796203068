"""Text quality of a trained backend: harness-driven decoding, corpus BLEU and chrF with sacrebleu.

Decoding belongs to the harness, not the backend: a backend only returns next-token logits, and the harness
samples with its own seeded RNG from a float64 softmax by inverse CDF. Identical weights therefore give identical
text in every backend, and the text of two frameworks differs only where their logits differ.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from harness.backends.base import Backend
from harness.config import Config
from harness.data import Corpus

# The protocol's defaults (README, "Text quality"): N prompts of P characters at evenly spaced offsets of the
# validation split, each continued for L characters at temperature TEMPERATURE; references are the true text.
N_PROMPTS = 20
PROMPT_CHARS = 32
CONTINUATION_CHARS = 100
TEMPERATURE = 0.8
SAMPLE_TEMPERATURES: tuple[float | None, ...] = (1.5, 1.0, 0.8, 0.5, 0.1, None)  # None = greedy
SAMPLE_CHARS = 200


def sample_next(logits: np.ndarray, temperature: float | None, uniforms: np.ndarray) -> np.ndarray:
    """Next token per row from (N, V) logits: argmax when temperature is None, else inverse-CDF sampling."""
    logits = logits.astype(np.float64)
    if temperature is None:
        return logits.argmax(axis=-1)
    z = logits / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    cdf = np.cumsum(p, axis=-1)
    cdf /= cdf[:, -1:]
    # first index whose cumulative probability exceeds the uniform draw
    return np.minimum((cdf < uniforms[:, None]).sum(axis=-1), logits.shape[-1] - 1)


def generate(backend: Backend, prompts: np.ndarray, n_new: int, block_size: int, temperature: float | None,
             seed: int) -> np.ndarray:
    """Continue each row of `prompts` (N, P) by `n_new` tokens; returns (N, n_new). Uniform draws come from `seed`."""
    rng = np.random.Generator(np.random.PCG64([seed, 3]))
    uniforms = rng.random((n_new, prompts.shape[0]))  # drawn up front: the same for every backend
    ids = prompts.astype(np.int64)
    for i in range(n_new):
        context = ids[:, -block_size:]
        next_ids = sample_next(backend.logits(context)[:, -1, :], temperature, uniforms[i])
        ids = np.concatenate([ids, next_ids[:, None]], axis=1)
    return ids[:, prompts.shape[1]:]


def prompt_set(corpus: Corpus, n_prompts: int = N_PROMPTS, prompt_chars: int = PROMPT_CHARS,
               continuation_chars: int = CONTINUATION_CHARS) -> tuple[np.ndarray, list[str]]:
    """Prompts at evenly spaced offsets of the validation split and their true continuations (references)."""
    span = prompt_chars + continuation_chars
    last = len(corpus.val) - span
    offsets = np.linspace(0, max(last, 0), n_prompts).astype(np.int64)
    prompts = np.stack([corpus.val[o:o + prompt_chars] for o in offsets])
    references = [corpus.decode(corpus.val[o + prompt_chars:o + span]) for o in offsets]
    return prompts, references


def one_line(text: str) -> str:
    """sacrebleu scores one segment per line, so each continuation becomes one line."""
    return " ".join(text.split())


def text_quality(backend: Backend, corpus: Corpus, config: Config, seed: int) -> dict[str, Any]:
    """BLEU and chrF of prompted continuations against the true text, plus samples at several temperatures."""
    from sacrebleu.metrics import BLEU, CHRF

    prompts, references = prompt_set(corpus)
    t0 = time.perf_counter()
    continuations = generate(backend, prompts, CONTINUATION_CHARS, config.block_size, TEMPERATURE, seed)
    gen_s = time.perf_counter() - t0
    hypotheses = [corpus.decode(row) for row in continuations]
    bleu, chrf = BLEU(), CHRF()
    hyp_lines, ref_lines = [one_line(h) for h in hypotheses], [one_line(r) for r in references]
    bleu_score = bleu.corpus_score(hyp_lines, [ref_lines])
    chrf_score = chrf.corpus_score(hyp_lines, [ref_lines])
    start = corpus.val[:PROMPT_CHARS][None, :]
    samples = []
    for temperature in SAMPLE_TEMPERATURES:
        ids = generate(backend, start, SAMPLE_CHARS, config.block_size, temperature, seed)[0]
        samples.append({"temperature": temperature, "text": corpus.decode(ids)})
    return {
        "protocol": {"n_prompts": len(prompts), "prompt_chars": PROMPT_CHARS,
                     "continuation_chars": CONTINUATION_CHARS, "temperature": TEMPERATURE, "seed": seed},
        "bleu": bleu_score.score, "bleu_signature": str(bleu.get_signature()),
        "chrf": chrf_score.score, "chrf_signature": str(chrf.get_signature()),
        "generation_tokens_per_s": len(prompts) * CONTINUATION_CHARS / gen_s if gen_s > 0 else None,
        "generation_s": gen_s,
        "sample_prompt": corpus.decode(start[0]),
        "samples": samples,
        "continuations": [{"prompt": corpus.decode(p), "reference": r, "hypothesis": h}
                          for p, r, h in zip(prompts, references, hypotheses)],
    }
