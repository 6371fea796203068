"""`<run>/parity.json`: what `harness parity` ran (config, steps, dtypes, tolerances and where each came from, how
each worker exited) and its verdict (harness.parity.record builds it, docs/parity.md describes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.config.fields import Config
from harness.store.paths import RunPaths
from harness.store.spec import DataInfo, stored_config
from harness.store.stored import Stored, read_document, typed
from harness.store.writes import atomic_write_json

SCHEMA = "nanogpt-parity/parity-record"
SCHEMA_VERSION = 1
# about 250 KB for medium at 50 steps, growing with the optimizer steps compared, whose probes
# harness.parity.record.PROBE_BUDGET (1 GiB of states) bounds: its tables stay far below
MAX_PARITY_BYTES = 64 * 2**20

# What the readers take from the record, typed; the rest is what `harness parity` wrote for a person to read.
PARITY_JSON_SCHEMA: dict = {
    "type": "object",
    "required": ["schema"],
    "properties": {
        "schema": {"const": SCHEMA}, "schema_version": {"type": "integer"},
        "verdict": {"type": ["string", "null"]}, "failures": {"type": ["array", "null"]},
        "checks": {"type": ["array", "null"], "items": {"type": "object"}},
        "steps": {"type": ["integer", "null"]}, "dropout": {"type": ["number", "null"]},
        "precision_pair": {"type": ["string", "null"]}, "dtypes": {"type": ["object", "null"]},
        "tolerance_source": {"type": ["object", "null"]},
    },
}
_EMPTY = ("devices", "dtypes", "tolerance_source", "failures")  # null in a hand-written record: read as empty


@dataclass(kw_only=True)
class ParityCheck(Stored):
    """One row of the verdict (harness.parity.result.ParityResult.rows): a check at one depth, its value against
    its tolerance, where it first broke and where it is worst, "ok" or "FAIL"."""

    depth: str | None = None
    check: str = ""
    value: float | None = None
    tolerance: float | None = None
    first_broken: str = ""
    worst: str = ""
    result: str | None = None


@dataclass(kw_only=True)
class ParityRecord(Stored):
    """One `harness parity` run: what was compared and how (`verdict` "pass", "fail", or "error" when nothing could
    be compared, the FAIL or ERROR lines in `failures`); `results` is harness.parity.result.ParityResult's JSON."""

    OMIT_NONE = ("checks", "blind_spots", "backend_info")

    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    run_id: str | None = None
    created_at: str | None = None
    config: Config | None = None
    config_name: str | None = None
    steps: int | None = None
    seed: int | None = None
    dropout: float | None = None
    opt_steps: int | None = None
    opt_reference: str | None = None
    threads: int | None = None
    device: str | None = None
    devices: dict[str, str] = field(default_factory=dict)
    backends: list[str] = field(default_factory=list)
    dtypes: dict[str, str] = field(default_factory=dict)
    precision_pair: str | None = None
    tolerances: dict[str, float] = field(default_factory=dict)  # harness.parity.tolerances.Tolerances
    tolerance_source: dict[str, str] = field(default_factory=dict)
    data: DataInfo | None = None
    worker_exit_codes: dict[str, int] = field(default_factory=dict)
    files: dict[str, dict[str, str]] = field(default_factory=dict)
    verdict: str | None = None
    failures: list[str] = field(default_factory=list)
    results: dict[str, Any] | None = None
    checks: list[ParityCheck] | None = None
    blind_spots: dict[str, str] | None = None
    backend_info: dict[str, dict[str, Any]] | None = None

    @property
    def passed(self) -> bool | None:
        """The overall verdict: "pass" is True, "fail" and "error" are False; None when it says nothing."""
        verdict = self.verdict.lower() if isinstance(self.verdict, str) else None
        if verdict in ("pass", "passed", "fail", "failed", "error"):
            return verdict in ("pass", "passed")
        return None

    @property
    def compared_nothing(self) -> bool:
        """Whether nothing was compared (verdict "error": a worker crashed or was never started)."""
        return isinstance(self.verdict, str) and self.verdict.lower() == "error"

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ParityRecord:
        config = doc.get("config")
        if isinstance(config, dict):
            doc = dict(doc, config=stored_config(config, "parity.json"))
        return super().from_dict({k: v for k, v in doc.items() if v is not None or k not in _EMPTY})

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.config is not None:
            out["config"] = self.config.to_dict()
        return out

    @classmethod
    def load(cls, path: Path) -> ParityRecord:
        """A parity.json: UsageError in one line when it is unreadable, not one, of another schema version, or
        not of the shape its readers take from it."""
        fix = "run `harness parity` again"
        doc = read_document(Path(path), SCHEMA, "parity record", fix, MAX_PARITY_BYTES, SCHEMA_VERSION,
                            PARITY_JSON_SCHEMA)
        return typed(cls, doc, path, fix)

    def dump(self, paths: RunPaths) -> None:
        """Write parity.json (atomically)."""
        atomic_write_json(paths.parity, self.to_dict())
