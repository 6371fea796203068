"""How the harness writes a quantity for people and a time for records: one byte formatter, one timestamp.

Below every layer (like harness.errors), so that the run's memory refusal, the reports and the records share them.
"""

from __future__ import annotations

import math
import time

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
