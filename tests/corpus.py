"""The project's own test corpus: the harness's sample text (harness.core.sample, `--data sample`), as a file.

The tests must pass in any clone, with no `../shared`, no network and no HARNESS_DATA, so they train on a text the
project makes itself: the generated play of harness/core/sample.py (its docstring says how it is made and the loss
levels measured on it), written here into the temporary directory so that no test fills the user cache.
`python tests/corpus.py PATH` writes it to PATH.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from harness.core.sample import ALPHABET, N_CHARS, sample_path

__all__ = ["ALPHABET", "N_CHARS", "corpus_path", "make_corpus"]


def make_corpus() -> str:
    """The test corpus's text (harness.core.sample.make_sample)."""
    from harness.core.sample import make_sample

    return make_sample()


def corpus_path() -> Path:
    """The corpus as a file (written once per machine and user, atomically; rewritten if altered)."""
    return sample_path(Path(tempfile.gettempdir()) / f"nanogpt-parity-tests-{os.getuid()}")


if __name__ == "__main__":  # `python tests/corpus.py PATH` writes the corpus there
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python tests/corpus.py PATH")
    Path(sys.argv[1]).write_bytes(corpus_path().read_bytes())
    print(sys.argv[1])
