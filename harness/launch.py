"""The parent side of `harness run`: validate everything, write the spec, run one worker per backend, compare.

Nothing is written until every input has been checked, so bad input leaves no files behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import records
from harness.backends import BackendUnavailable, backend_class, check_names
from harness.config import Config
from harness.data import Corpus, check_fits
from harness.errors import UsageError

SPEC_SCHEMA = "nanogpt-parity/run-spec"


@dataclass
class Plan:
    """One `harness run` for one config: what to train, with which backends, where to write."""

    config: Config
    corpus: Corpus
    backends: list[str]
    device: str = "cpu"
    seed: int = 1337
    out: Path = Path("reports")
    backend_options: dict[str, dict] = field(default_factory=dict)
    checkpoint_every: int = 0
    text: bool = True
    parity: bool = False
    progress: bool = True
    threads: int | None = None
    devices: dict[str, str] = field(default_factory=dict)  # per-backend devices (parity); others use `device`

    def device_of(self, backend: str) -> str:
        """The device backend `backend` runs on."""
        return self.devices.get(backend, self.device)


def preflight(plan: Plan) -> None:
    """Every check that can fail before training, so that a failure writes nothing."""
    check_names(plan.backends)
    if len(set(plan.backends)) != len(plan.backends):
        raise UsageError(f"backend listed twice in {', '.join(plan.backends)}; name each backend once")
    for device in {plan.device, *plan.devices.values()}:
        if device not in ("cpu", "cuda"):
            raise UsageError(f"unknown device {device!r}; use cpu or cuda")
    check_fits(plan.corpus, plan.config.block_size, plan.config.batch_size)
    records.check_writable(plan.out)
    for name in plan.backends:
        cls = backend_class(name)
        try:
            cls.check_available(plan.device_of(name))
            instance = cls(**plan.backend_options.get(name, {}))  # validates options (dtype, precision)
            if hasattr(instance, "check_device"):
                instance.check_device(plan.device_of(name))  # options that need a device (--precision bf16)
        except BackendUnavailable as exc:
            raise UsageError(str(exc)) from None


def write_spec(plan: Plan) -> str:
    """Create the run directory and its spec.json; returns the run id."""
    run_id = records.new_run_id(plan.out, plan.config.name)
    spec = {
        "schema": SPEC_SCHEMA, "run_id": run_id, "label": plan.config.name,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": plan.config.to_dict(), "seed": plan.seed, "device": plan.device,
        "devices": {name: plan.device_of(name) for name in plan.backends},
        "data": {"path": plan.corpus.path, "sha256": plan.corpus.sha256},
        "backends": plan.backends, "backend_options": plan.backend_options,
        "checkpoint_every": plan.checkpoint_every, "text": plan.text, "parity": plan.parity,
        "threads": plan.threads,
    }
    records.atomic_write_json(records.run_dir(plan.out, run_id) / "spec.json", spec)
    return run_id


def thread_env(threads: int | None) -> dict[str, str]:
    """Environment that caps the CPU threads of every framework (torch/OpenMP, OpenBLAS, MKL, Julia)."""
    if not threads:
        return {}
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "MKL_NUM_THREADS": n, "JULIA_NUM_THREADS": n}


def run_worker(directory: Path, backend: str, resume: bool = False, progress: bool = True,
               threads: int | None = None) -> int:
    """Run one backend's worker process to its end; Ctrl-C / SIGTERM here are forwarded to it once."""
    cmd = [sys.executable, "-m", "harness.worker", str(directory), backend]
    cmd += ["--resume"] if resume else []
    cmd += [] if progress else ["--no-progress"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **thread_env(threads))
    # Its own session: a terminal Ctrl-C reaches only us, and we forward exactly one signal, so the worker's
    # clean shutdown (saving the record) is not itself interrupted by a second copy of the same Ctrl-C.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    previous = signal.signal(signal.SIGTERM, lambda s, f: proc.send_signal(signal.SIGTERM))
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:
                proc.send_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)


def compare_fingerprints(recs: list[dict]) -> list[str]:
    """Problems that would make a comparison unfair: different data, weights, batches or config."""
    problems = []
    if len(recs) < 2:
        return problems
    ref = recs[0]
    for rec in recs[1:]:
        if rec["data"]["sha256"] != ref["data"]["sha256"]:
            problems.append(f"{rec['backend']} read different data than {ref['backend']}")
        if rec["config_hash"] != ref["config_hash"]:
            problems.append(f"{rec['backend']} ran a different config than {ref['backend']}")
        for key in ("weights", "batches", "eval_batches"):
            if rec["fingerprints"][key] != ref["fingerprints"][key]:
                problems.append(f"{rec['backend']} got different {key} than {ref['backend']}")
    return problems


def execute(directory: Path, backends: list[str], resume: bool = False, progress: bool = True,
            threads: int | None = None) -> dict[str, int]:
    """Run the workers one after another (never at once: they would share cores and skew each other's times)."""
    codes: dict[str, int] = {}
    for i, name in enumerate(backends, 1):
        path = directory / f"{name}.json"
        if resume and path.exists():
            try:
                if records.load_record(path)["status"] == "completed":
                    codes[name] = 0
                    continue
            except UsageError:
                pass
        print(f"[{i}/{len(backends)}] {name}: training in its own process", file=sys.stderr, flush=True)
        codes[name] = code = run_worker(directory, name, resume=resume, progress=progress, threads=threads)
        if code == 130:  # interrupted: do not start the next backend
            break
    return codes


def load_spec(out: Path, run_id: str) -> dict:
    path = records.run_dir(out, run_id) / "spec.json"
    if not path.is_file():
        raise UsageError(f"no run {run_id!r} under {str(Path(out) / 'runs')!r}; pass an existing run id "
                         "and the --out it was written to")
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is corrupt ({exc}); that run cannot be resumed") from None
    if spec.get("schema") != SPEC_SCHEMA:
        raise UsageError(f"{path} is not a nanogpt-parity run spec; that run cannot be resumed")
    return spec
