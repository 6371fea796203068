"""Progress of long work on stderr, as a terminal user expects it: one line saying what is done of what, the time
elapsed and the time expected, rewritten in place (the paired timing, the benchmarks; the training bar is tqdm's).

Shown only where someone watches: `enabled` (off with --quiet) and stderr a terminal. In a log or a pipe it stays
silent, as the training bar does; the lines that say what happened (a cell done, a round count, a result) are
printed apart from it, always. Below every layer (like harness.units), so that run, sweep and bench share it.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

from harness.units import fmt_duration

EVERY_S = 0.5  # the line is rewritten at most this often


def watched(stream: TextIO | None = None) -> bool:
    """Whether `stream` (default stderr) is a terminal someone watches: where progress is shown at all."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed, or no file at all
        return False


def left_s(elapsed_s: float, done: float, total: float) -> float | None:
    """The time the rest is expected to take at the pace so far (None before anything is done)."""
    if done <= 0 or total < done:
        return None
    return elapsed_s / done * (total - done)


class Line:
    """One progress line, "LABEL: TEXT, 0:12 elapsed, EXPECTED", rewritten in place at most every EVERY_S seconds
    (cut to the terminal's width) and cleared by `close`; `say` prints a lasting line above it. Nothing at all unless
    `enabled` and the stream is a terminal."""

    def __init__(self, label: str, enabled: bool = True, stream: TextIO | None = None):
        self.label, self.stream = label, sys.stderr if stream is None else stream
        self.on = enabled and watched(self.stream)
        self.start = time.monotonic()
        self.shown_at = -EVERY_S
        self.width = 0

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def show(self, text: str, expected: str = "", now: bool = False) -> None:
        """Rewrite the line with `text` and what is `expected` ("about 0:20 left"), unless it was rewritten less
        than EVERY_S ago (and not `now`)."""
        if not self.on or (not now and time.monotonic() - self.shown_at < EVERY_S):
            return
        self.shown_at = time.monotonic()
        line = f"{self.label}: {text}, {fmt_duration(self.elapsed_s)} elapsed" + (f", {expected}" if expected else "")
        line = line[:max(20, shutil.get_terminal_size().columns - 1)]  # one row: a wrapped line cannot be rewritten
        self.stream.write("\r" + line + " " * max(0, self.width - len(line)))
        self.stream.flush()
        self.width = len(line)

    def clear(self) -> None:
        """Remove the line (the cursor back at the start of its row)."""
        if self.on and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0

    def say(self, text: str) -> None:
        """A lasting line (printed whether or not progress is shown), above the progress line."""
        self.clear()
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        self.clear()


def expected_rounds(elapsed_s: float, rounds: int, clean: int, wanted: int, left: int) -> str:
    """"about 0:20 left (at most 1:10)" of rounds timed until enough are undisturbed (the paired timing, bench
    parts): the time the `wanted` undisturbed rounds more take at this pace (`clean` of `rounds` undisturbed in
    `elapsed_s`), and the time the `left` rounds of the cap take."""
    per_round = elapsed_s / rounds
    cap = f"at most {fmt_duration(per_round * left)}"
    if not clean:
        return f"{cap} left"
    return f"about {fmt_duration(per_round * min(left, wanted * rounds / clean))} left ({cap})"
