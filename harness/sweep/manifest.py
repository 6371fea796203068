"""The sweep manifest `<out>/sweeps/<sweep_id>/sweep.json`: spec, cells, run ids, executor job ids, status per cell.

The manifest is written only by the `harness sweep` process (atomically, like every record). The status it holds
is a cache: the truth about a cell is its RunRecord (and, on SLURM, whether its job is still queued or running),
and `refresh` reads that again.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

from harness import records
from harness.errors import UsageError

SCHEMA = "nanogpt-parity/sweep"
SCHEMA_VERSION = 1
# cell states: pending (never started), queued / running (an executor holds it), completed, interrupted, failed
DONE = "completed"
RERUNNABLE = ("pending", "interrupted", "failed")


def sweeps_dir(out: Path) -> Path:
    return Path(out) / "sweeps"


def new_sweep_id(out: Path, name: str) -> str:
    """A fresh sweep id (UTC time, the sweep's name, a random suffix); its directory is created here, exclusively."""
    root = sweeps_dir(out)
    root.mkdir(parents=True, exist_ok=True)
    while True:
        sweep_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{name}-{secrets.token_hex(2)}"
        try:
            (root / sweep_id).mkdir()
            return sweep_id
        except FileExistsError:
            continue


class Manifest:
    """The manifest document of one sweep and where it lives."""

    def __init__(self, out: Path, doc: dict):
        self.out, self.doc = Path(out), doc

    @property
    def sweep_id(self) -> str:
        return self.doc["sweep_id"]

    @property
    def dir(self) -> Path:
        return sweeps_dir(self.out) / self.sweep_id

    @property
    def path(self) -> Path:
        return self.dir / "sweep.json"

    @property
    def cells(self) -> list[dict]:
        return self.doc["cells"]

    def save(self) -> None:
        self.doc["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        records.atomic_write_json(self.path, self.doc)

    @classmethod
    def load(cls, out: Path, sweep_id: str) -> Manifest:
        """The manifest of `sweep_id` under `out`; UsageError naming the problem when there is none or it is corrupt."""
        if not sweep_id or "/" in sweep_id or sweep_id in (".", ".."):
            raise UsageError(f"{sweep_id!r} is not a sweep id; pass one from `ls {sweeps_dir(out)}`")
        path = sweeps_dir(out) / sweep_id / "sweep.json"
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UsageError(f"no sweep {sweep_id!r} under {str(sweeps_dir(out))!r}; pass an existing sweep id "
                             "and the --out it was written to") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path} is corrupt ({exc}); that sweep cannot be read") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("cells"), list):
            raise UsageError(f"{path} is not a nanogpt-parity sweep manifest")
        if doc.get("schema_version", 0) > SCHEMA_VERSION:
            raise UsageError(f"{path} has schema version {doc['schema_version']}; upgrade nanogpt-parity")
        return cls(out, doc)


def record_status(out: Path, cell: dict) -> tuple[str, dict | None]:
    """(state, record) of a cell from its RunRecord alone: pending, running, completed, interrupted or failed."""
    if not cell.get("run_id"):
        return "pending", None
    path = records.run_dir(out, cell["run_id"]) / f"{cell['backend']}.json"
    if not path.exists():
        return "pending", None
    try:
        rec = records.load_record(path)
    except UsageError:
        return "failed", None
    status = rec.get("status", "")
    if status == DONE:
        return DONE, rec
    if status == "running":
        return "running", rec
    if records.is_failed(status):
        return "failed", rec
    return "interrupted", rec


def cell_summary(cell: dict, rec: dict | None) -> dict[str, Any]:
    """Progress of a cell for the status table: steps done of total, last validation loss."""
    if rec is None:
        return {"steps": "", "val_loss": ""}
    done = len(rec.get("steps", {}).get("loss", []))
    last = rec["evals"][-1] if rec.get("evals") else None
    return {"steps": f"{done}/{rec.get('total_steps', '?')}",
            "val_loss": f"{last['val_loss']:.4f}" if last else ""}
