"""How the harness writes a quantity for people and a time for records: one byte formatter, one timestamp, one
duration, one text table.

Below every layer (like harness.errors), so that the run's memory refusal, the reports, the records and every table a
command prints share them.
"""

from __future__ import annotations

import math
import textwrap
import time
from collections.abc import Collection, Sequence

TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # UTC, ISO 8601: every `*_at` field of every record
DASH = "—"  # what a table shows for a figure it does not have


def utc_now() -> str:
    """The current UTC time as every record writes it ("2026-01-31T12:00:00Z")."""
    return time.strftime(TIMESTAMP_FORMAT, time.gmtime())


def fmt_bytes(b: float | None) -> str:
    """'345.6 MiB', '1.23 GiB', '12.5 TiB' (binary units from MiB up; a dash for None or a non-finite value)."""
    if b is None or (isinstance(b, float) and not math.isfinite(b)):
        return DASH
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b / 2**20:.4g} MiB"


def fmt_duration(seconds: float | None) -> str:
    """'0:07', '12:34', '1:02:03' (a dash for None or a non-finite value): elapsed and expected times for people."""
    if seconds is None or not math.isfinite(seconds):
        return DASH
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


TABLE_GAP = "  "  # between two columns of a text table
CELL_MAX = 48  # a column (but the last) wider than this wraps its long cells within it


def text_table(header: Sequence[str], rows: Sequence[Sequence[object]], right: Collection[int] = (),
               width: int | None = None) -> str:
    """Rows under a header and a rule, in columns that line up: every cell of a column starts (or, for the columns in
    `right`, ends) where its header does. A column but the last is at most CELL_MAX wide, the last at most what is
    left of `width` (at least 24; when None, the terminal's width, or no limit where stdout is no terminal). A longer
    cell wraps within its column, its continuation lines indented to the column (a single word longer than the last
    column is left whole)."""
    if width is None:  # a terminal's width; in a file or a pipe the last column never wraps
        import shutil
        import sys

        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else 1 << 16
    texts = [[str(c) for c in header], *[["" if c is None else str(c) for c in row] for row in rows]]
    n = len(header)
    widths = [max(len(r[i]) for r in texts) for i in range(n)]
    widths[:-1] = [min(w, max(CELL_MAX, len(header[i]))) for i, w in enumerate(widths[:-1])]
    left = width - sum(widths[:-1]) - len(TABLE_GAP) * (n - 1)
    widths[-1] = min(widths[-1], max(24, len(header[-1]), left))
    lines = []
    for k, row in enumerate(texts):
        # a word longer than its column is broken, but in the last column, where it disturbs no column after it
        cells = [textwrap.wrap(c, w, break_on_hyphens=False, break_long_words=i < n - 1) or [""]
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        for j in range(max(len(c) for c in cells)):
            parts = [(c[j] if j < len(c) else "") for c in cells]
            line = TABLE_GAP.join(p.rjust(w) if i in right else p.ljust(w)
                                  for i, (p, w) in enumerate(zip(parts, widths, strict=True)))
            lines.append(line.rstrip())
        if k == 0:
            lines.append(TABLE_GAP.join("-" * w for w in widths))
    return "\n".join(lines)


def dict_table(rows: Sequence[dict], right: Collection[str] = ()) -> str:
    """`text_table` of rows given as dicts: the keys (in order of first appearance) are the header, a missing key an
    empty cell; the columns named in `right` right-aligned."""
    header = list(dict.fromkeys(k for row in rows for k in row))
    return text_table(header, [[row.get(k, "") for k in header] for row in rows],
                      right={i for i, k in enumerate(header) if k in right})
