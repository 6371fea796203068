"""The sample text the harness ships: `--data sample`, a generated play in Tiny Shakespeare's 65-symbol alphabet, so
that a first run, the README's commands and the test suite need no network and no file of one's own.

It is made here, not stored: a seeded word-level Markov chain over a fixed lexicon, laid out as a play (speaker
names in capitals, a colon, verse lines, blank lines), 250,000 characters, written once into the user cache
(`sample_path`). So that

- its alphabet is exactly Tiny Shakespeare's 65 symbols (a model sized for one fits the other);
- a character model has something to learn at every scale: spelling (a few hundred words), word order (each word
  has a handful of likely successors), layout (speakers, line lengths, punctuation);
- the bytes are identical on every machine and Python version: only `random.Random(seed).random()` (the Mersenne
  Twister's documented, stable stream) and integer arithmetic decide anything, and SAMPLE_SHA256 pins them.

Loss levels measured on it (`harness run --size small --steps 600 --eval-interval 50 --data sample`, torch, CPU,
seed 1337): unigram entropy 3.40 nats; validation loss 4.18 at step 0, 2.54 at 50, 2.43 at 100, 2.35 at 300, 2.31
at 600 (Tiny Shakespeare's text is harder: small reaches about 2.0 there). It is not Tiny Shakespeare: a figure
measured on it is never compared with one measured on Tiny Shakespeare (every record names its data's sha256).
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
from pathlib import Path

from harness.store.writes import atomic_write_bytes

NAME = "sample"  # `--data sample`, `HARNESS_DATA=sample`
SAMPLE_SHA256 = "aede7edccbdb5826e85d8f10d62e916ec01269e9d6bc1e81d8f8af9800ba3dd8"  # make_sample()'s UTF-8 bytes
N_CHARS = 250_000  # large enough for every preset's batch (large: 64 x 256 = 16,384 characters) in both splits
SEED = 20261124
ALPHABET = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # Tiny Shakespeare's 65 symbols

_WORDS = """
the and to of a my in you that is not with it be your his this but for me have he as thou so will what by him
all do no we are shall thee her our if on they thy lord good now or more from then would king was here let at
sir which come there make love how them one well man like their say know an upon than may must too when go such
hath did see us should am out speak yet were these death life time day night heart blood hand eyes father mother
son brother sister queen duke prince lady noble gentle sweet fair true dead old young great little poor
honour grace power crown sword peace war field house world heaven earth soul mind tongue word name friend enemy
citizen senator soldier servant master mistress gods fortune nature truth faith fear hope grief joy tears
give take bring keep hear tell think bear stand fall die live pray swear fight call stay leave follow answer
marry kill break weep laugh sleep wake rise strike seek find lose hold turn send
never ever still again away forth indeed perhaps nay yea alas farewell welcome
against before after within without between under above through
quick strange proud wise foolish honest false cruel kind bold
rome england france york lancaster verona padua mantua
""".split()

_SPEAKERS = ("KING RICHARD", "QUEEN MARGARET", "FIRST CITIZEN", "SECOND CITIZEN", "MENENIUS", "CORIOLANUS",
             "GLOUCESTER", "BUCKINGHAM", "ROMEO", "JULIET", "NURSE", "FRIAR LAURENCE", "PROSPERO", "MIRANDA",
             "DUKE VINCENTIO", "ISABELLA", "LUCIO", "PETRUCHIO", "KATHARINA", "BAPTISTA", "HERMIONE", "LEONTES",
             "WARWICK", "CLARENCE", "YORK", "NORTHUMBERLAND", "BOLINGBROKE", "JOHN OF GAUNT", "VOLUMNIA",
             "SICINIUS", "BRUTUS", "ESCALUS", "TYBALT", "MERCUTIO", "BENVOLIO", "CAMILLO", "PAULINA", "ANTONIO",
             "QUEEN ELIZABETH", "LADY ANNE", "HASTINGS", "JACK CADE", "ZOUCH", "VAUX", "OXFORD", "XANTIPPE")
_RARE = ("$", "&", "3", "zounds", "quoth", "jest", "vex", "zeal", "quarrel", "jewel", "oxen", "xerxes")


class _Stream:
    """Draws from `random.Random(seed).random()` only, with integer arithmetic: the same on every machine."""

    def __init__(self, seed: int):
        self._random = random.Random(seed).random

    def below(self, n: int) -> int:
        return min(int(self._random() * n), n - 1)

    def weighted(self, cumulative: list[int]) -> int:
        """Index i with probability proportional to cumulative[i] - cumulative[i - 1]."""
        r = self.below(cumulative[-1])
        lo, hi = 0, len(cumulative) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if cumulative[mid] > r:
                hi = mid
            else:
                lo = mid + 1
        return lo


def make_sample(n_chars: int = N_CHARS, seed: int = SEED) -> str:
    """The sample text: exactly `n_chars` characters, every one of the 65 symbols present."""
    s = _Stream(seed)
    words = _WORDS + list(_RARE[3:])
    # each word gets 6 likely successors, Zipf-weighted (8, 4, 2, 2, 1, 1), plus a small chance of any word
    successors = [[s.below(len(words)) for _ in range(6)] for _ in words]
    zipf = [8, 12, 14, 16, 17, 18]
    parts: list[str] = []
    size = 0
    previous = s.below(len(words))
    while size < n_chars:
        speaker = _SPEAKERS[s.below(len(_SPEAKERS))]
        lines = [f"{speaker}:"]
        for _ in range(1 + s.below(4)):
            line: list[str] = []
            n_words = 4 + s.below(7)
            for k in range(n_words):
                if s.below(20) == 0:
                    previous = s.below(len(words))
                else:
                    previous = successors[previous][s.weighted(zipf)]
                word = words[previous]
                if not line or s.below(40) == 0:
                    word = word.capitalize()
                if s.below(12) == 0 and k < n_words - 1:
                    word += ",;:-"[s.below(4)]
                elif s.below(300) == 0:
                    word = f"{word} {_RARE[s.below(3)]}"
                elif s.below(150) == 0:
                    word = f"{word}'s"
                line.append(word)
            lines.append(" ".join(line) + ".?!,;"[s.weighted([6, 8, 9, 11, 12])])
        block = "\n".join(lines) + "\n\n"
        parts.append(block)
        size += len(block)
    text = "".join(parts)[:n_chars]
    missing = sorted(set(ALPHABET) - set(text))
    if missing:  # a rare symbol the stream never drew: append it, so the vocabulary is always the 65
        text = text[: n_chars - len(missing) - 1] + "".join(missing) + "\n"
    return text


def sample_path(folder: Path | None = None) -> Path:
    """The sample text as a file (what a run reads and records): written once into `folder` (default: the user
    cache, else the temporary directory where that cannot be written), atomically, and written again where its bytes
    are not SAMPLE_SHA256's."""
    if folder is None:
        from harness.environment import cache_dir

        try:
            return sample_path(cache_dir())
        except OSError:  # a read-only home: the temporary directory, one per user
            return sample_path(Path(tempfile.gettempdir()) / f"nanogpt-parity-{os.getuid()}")
    path = Path(folder) / f"{NAME}-{SAMPLE_SHA256[:16]}.txt"
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == SAMPLE_SHA256:
        return path
    atomic_write_bytes(path, make_sample().encode("utf-8"))
    return path
