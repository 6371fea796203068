"""The typed store (harness/store): every record kind read and written back unchanged, statuses with their reasons,
and no record read by string key outside the store."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from harness import store
from harness.errors import UsageError
from harness.store.record import RunRecord, Status

ROOT = Path(__file__).resolve().parent.parent / "harness"


def _as_written(doc: object) -> object:
    """`doc` as JSON holds it: nan as null (the store writes non-finite numbers so)."""
    return json.loads(json.dumps(doc).replace("NaN", "null"))


def test_every_record_kind_reads_and_writes_back_unchanged(tmp_path: Path) -> None:
    """A run's spec and records, a parity record, a paired timing and a sweep manifest as the harness writes them:
    `load` then `to_dict` gives the same JSON, key for key and in the same order (a record read and written again
    never knows less, and never more than it held)."""
    from test_paired import planted
    from test_report import make_run, make_sweep, parity_record

    from harness.store.paired import PairedRecord
    from harness.store.parity import ParityRecord
    from harness.store.sweep import SweepManifest

    run_id = make_run(tmp_path, statuses={"numpy": "interrupted"})
    paths = store.RunPaths(tmp_path, run_id)
    parity = parity_record(paths.dir, ("torch", "numpy"))
    store.atomic_write_json(paths.parity, parity)
    planted([1.5] * 10).dump(paths.paired_timing)
    sweep = store.SweepPaths(tmp_path, make_sweep(tmp_path, seeds=1))
    loaded = [(paths.spec, store.RunSpec.load(paths)), (paths.parity, ParityRecord.load(paths.parity)),
              (paths.paired_timing, PairedRecord.load(paths.paired_timing)),
              (sweep.manifest, SweepManifest.read(sweep))]
    loaded += [(paths.record(b), RunRecord.load(paths.record(b), b)) for b in ("torch", "numpy")]
    for path, obj in loaded:
        on_disk = json.loads(path.read_text())
        again = _as_written(obj.to_dict())
        assert again == on_disk and list(again) == list(on_disk), path.name
    # a record written before the first step (empty curves, as a worker killed then leaves it) likewise
    doc = dict(json.loads(paths.record("torch").read_text()), steps={"step": [], "loss": [], "time_s": []},
               evals=[], chunks=[])
    assert RunRecord.from_dict(doc).to_dict() == doc


def test_a_status_is_a_field_with_its_reason_beside_it(tmp_path: Path) -> None:
    """In memory a failed record is Status.FAILED with `failure` its reason; on disk the status keeps its spelling
    "failed: <reason>" beside "failure" (readers of earlier files read it unchanged). A record that has only the
    spelling (written by hand) gets its reason from it; nothing outside the store takes the string apart."""
    from test_report import make_run

    run_id = make_run(tmp_path, statuses={"numpy": "failed: RuntimeError: boom"})
    path = store.RunPaths(tmp_path, run_id).record("numpy")
    rec = RunRecord.load(path)
    assert rec.status is Status.FAILED and rec.failure == "RuntimeError: boom"
    assert rec.status_text == "failed: RuntimeError: boom"
    rec.fail("killed by SIGKILL")
    doc = rec.to_dict()
    assert doc["status"] == "failed: killed by SIGKILL" and doc["failure"] == "killed by SIGKILL"
    assert Status.of("completed") is Status.COMPLETED and Status.COMPLETED.stored("ignored") == "completed"


def test_the_spec_parity_field_is_a_typed_value_or_nothing(tmp_path: Path) -> None:
    """`parity` is None for an ordinary run (stored as false, as before), ParityOptions for `harness parity` (true,
    from a hand-written spec, is parity with its defaults)."""
    from test_report import make_run

    paths = store.RunPaths(tmp_path, make_run(tmp_path))
    assert store.RunSpec.load(paths).parity is None
    doc = json.loads(paths.spec.read_text())
    for stored, expected in ((True, store.ParityOptions()), ({"opt_steps": 3, "reference": "torch"},
                                                             store.ParityOptions(opt_steps=3, reference="torch"))):
        store.atomic_write_json(paths.spec, dict(doc, parity=stored))
        spec = store.RunSpec.load(paths)
        assert spec.parity == expected
        assert spec.to_dict()["parity"] == (stored if stored is not True else {})
    assert store.RunSpec.from_dict(dict(doc, parity=False)).to_dict()["parity"] is False


def test_non_finite_losses_come_back_as_nan_and_a_record_is_no_dict(tmp_path: Path) -> None:
    """A loss written as null (non-finite) reads as nan in the curves; a record has attributes, not keys: a string-key
    read of a record fails loudly wherever it would be tried."""
    from test_report import make_run

    path = store.RunPaths(tmp_path, make_run(tmp_path, backends=("torch",))).record("torch")
    doc = json.loads(path.read_text())
    doc["steps"]["loss"][2] = None
    path.write_text(json.dumps(doc))
    rec = RunRecord.load(path)
    assert math.isnan(rec.curves.loss[2]) and rec.to_dict()["steps"]["loss"][2] != rec.to_dict()["steps"]["loss"][2]
    assert json.loads(store.json_bytes(rec.to_dict()))["steps"]["loss"][2] is None
    with pytest.raises(TypeError):
        rec["status"]  # type: ignore[index]


def test_a_damaged_record_is_one_line(tmp_path: Path) -> None:
    """A document its schema lets through but whose shape does not fit the type is a UsageError naming the file."""
    from test_report import make_run

    paths = store.RunPaths(tmp_path, make_run(tmp_path, backends=("torch",)))
    doc = json.loads(paths.record("torch").read_text())
    paths.record("torch").write_text(json.dumps(dict(doc, memory={"peak_bytes": -1})))
    with pytest.raises(UsageError, match=r"torch.json' is invalid at field 'memory/peak_bytes'"):
        RunRecord.load(paths.record("torch"))
    paths.record("torch").write_text(json.dumps(dict(doc, text={"samples": "x"})))
    with pytest.raises(UsageError, match=r"torch.json' is invalid"):
        RunRecord.load(paths.record("torch"))


# Outside the store, JSON is parsed only for what is no record (each with why); records are read through the store,
# which gives typed objects (no keys to read). A new json.loads / read_json of a record elsewhere fails here.
JSON_READERS = {
    "files.py": "the one gate every JSON file goes through (read_json, parse_json), the store's included",
    "kit/schema.py": "the kit's manifest (its own schema, harness.kit.schema)",
    "backends/flux.py": "Julia's own metadata files",
    "backends/numpy_backend.py": "a random generator's state inside a checkpoint",
    "run/checkpoint.py": "the contention chunks and a JSON RNG state inside a checkpoint (checkpoint.read)",
    "run/timed.py": "the paired timing's protocol messages on its stdin",
    "run/paired_timing.py": "the paired timing's protocol messages from a timed process",
    "bench/overhead.py": "a bench child's job and its result (read as the store's OverheadResult)",
}
PARSERS = {"read_json", "parse_json", "load", "loads", "read_document"}


def test_no_record_is_read_by_string_key_outside_the_store() -> None:
    """Outside harness/store no module parses JSON but the files of JSON_READERS, run/records.py is gone, and no
    record is read through its JSON form (`to_dict()[...]`, `extra[...]`). Planted bug: a module that reads a run
    record with json.loads and takes its "status" by key fails here."""
    assert not (ROOT / "run" / "records.py").exists()
    found: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("store/"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "harness.run" and \
                    any(a.name == "records" for a in node.names):
                found.setdefault(rel, []).append(f"{node.lineno}: imports harness.run.records")
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
                owner = node.func.value.id if isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) else ""
                if name in PARSERS and (owner in ("json", "files") or isinstance(node.func, ast.Name)) and \
                        rel not in JSON_READERS:
                    found.setdefault(rel, []).append(f"{node.lineno}: parses JSON ({name})")
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                value = node.value
                through = (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and
                           value.func.attr == "to_dict") or (isinstance(value, ast.Attribute) and value.attr == "extra")
                if through:
                    found.setdefault(rel, []).append(f"{node.lineno}: reads a record through its JSON form")
    assert not found, found
    assert set(JSON_READERS) <= {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")}, "a stale entry"


def test_the_store_imports_nothing_above_it() -> None:
    """The store sits right above the config (docs/development.md, "The tree"): of the harness it may import only
    itself, files.py, errors.py and the Config type; an allowlist, so a new import of a layer above is refused."""
    allowed = ("harness.store", "harness.files", "harness.errors", "harness.config.fields")
    for path in (ROOT / "store").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if name == "harness" or name.startswith("harness."):
                    assert name.startswith(allowed), (path.name, name)
