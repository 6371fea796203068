"""What the harness stores, in one typed home: where it lives, how it is written and locked, and what it holds.

- `paths`: `RunPaths` and `SweepPaths`, the one form of a location (made where an id or a directory enters, then
  passed down), and the ids;
- `writes`, `lock`: every file written whole (temporary file, fsync, rename), the run-directory lock and the
  paired-timing record's lock;
- `stored`: `Stored`, a JSON object as a dataclass (pyperf's `Benchmark`/`Run` model: `load` through the bounded,
  schema-checked reader of harness.files, `dump` atomic, attributes instead of keys);
- the records: `spec` (spec.json: `RunSpec`), `record` (`<backend>.json`: `RunRecord` and its parts), `curves`
  (its `Curves`: the per-step columns, evaluations and chunks, in their own files beside the record),
  `contention` (the stored contention evidence), `parity` (parity.json: `ParityRecord`), `paired` (paired.json:
  `PairedRecord`), `sweep` (sweep.json: `SweepManifest`, `SweepCell`, `PairedEntry`), `bench` (the records of
  `harness bench overhead` and `harness bench noise`) and `parts` (`PartsRecord`, the record of `harness bench
  parts`).

Below everything that runs, times or reports (docs/development.md, "The tree"): it imports only harness.files,
harness.errors and the Config type.
"""

from harness.store.curves import Curves, Eval
from harness.store.lock import LOCK_FD_ENV, RecordLock, RunLock
from harness.store.paths import RUN_ID_RE, SWEEP_ID_RE, RunPaths, SweepPaths, check_run_id, check_sweep_id
from harness.store.record import RunRecord, Status, Timings, compare_fingerprints, load_run
from harness.store.spec import DataInfo, ParityOptions, RunSpec
from harness.store.writes import (
    atomic_write_all,
    atomic_write_bytes,
    atomic_write_json,
    check_writable,
    json_bytes,
    os_error_message,
)

__all__ = ["LOCK_FD_ENV", "RUN_ID_RE", "SWEEP_ID_RE", "Curves", "DataInfo", "Eval", "ParityOptions", "RecordLock",
           "RunLock", "RunPaths", "RunRecord", "RunSpec", "Status", "SweepPaths", "Timings", "atomic_write_all",
           "atomic_write_bytes", "atomic_write_json", "check_run_id", "check_sweep_id", "check_writable",
           "compare_fingerprints", "json_bytes", "load_run", "os_error_message"]
