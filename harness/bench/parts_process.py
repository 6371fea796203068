"""The timed process of `harness bench parts`: one backend's part runner (harness/backends/parts.py) set up on the
step-0 activations, warmed up (a JIT compiled), calibrated, then timed in the bursts its coordinator
(harness.bench.parts) asks for: `python -m harness --worker parts JOB_JSON`.

The protocol is harness.run.timed's: JSON lines on stdin (`{"burst": round}`, `{"quit": true}`) and, prefixed with
its MARK, on stdout (`ready` once calibrated, then per burst the seconds per call of every item and the burst's
contention chunk). A burst times every item, `calls[item]` calls in a row, in the order of
harness.core.parts.items, in passes (harness.backends.parts.PartRunner); it ends with the device's work finished.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.errors import UsageError
from harness.run.timed import message, messages, reply

BATCHES = 4  # the whole step cycles through the first few batches of the stream (as a run's first steps)


@dataclass
class PartsJob:
    """What a timed process needs (JSON-able): the backend and its options, the device, the config, the corpus and
    seed (weights, batches), the parts to time and the seconds a burst should take."""

    name: str
    backend: str
    options: dict
    device: str
    config: dict
    data: str
    seed: int
    parts: list[str]
    burst_s: float
    profile: bool = False  # count what each item launches (torch.profiler; the command asks on CUDA)
    env: dict = field(default_factory=dict)  # extra environment of the process (tests plant slowdowns with it)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def prepare(job: PartsJob) -> tuple[Any, dict]:
    """The runner of `job` set up, warmed up and calibrated, and its `ready` message."""
    from harness.backends.numpy_parts import reference
    from harness.backends.parts import runner_class
    from harness.config.fields import Config
    from harness.core.data import BatchStream, load_corpus
    from harness.core.weights import init_weights

    config = Config(**job.config)
    corpus = load_corpus(job.data)
    weights = init_weights(config, corpus.vocab_size, job.seed)
    stream = BatchStream(corpus.train, config.block_size, config.batch_size, job.seed, config.scheme)
    batches = [stream.batch(k) for k in range(BATCHES)]
    t0 = time.perf_counter()
    ref = reference(config, weights, corpus.vocab_size, *batches[0])
    reference_s = time.perf_counter() - t0
    runner = runner_class(job.backend)(**job.options)
    t0 = time.perf_counter()
    runner.setup(config, weights, corpus.vocab_size, job.device, job.seed, batches, ref, job.parts)
    setup_s = time.perf_counter() - t0
    warmup_s = runner.warm_up()
    t0 = time.perf_counter()
    calls, passes, step_samples = runner.calibrate(job.burst_s)
    calibrate_s = time.perf_counter() - t0
    launches = {key: runner.launches(key) for key in runner.items} if job.profile else {}
    return runner, {"ready": True, "setup_s": setup_s, "compile_s": runner.compile_s, "reference_s": reference_s,
                    "warmup_s": warmup_s, "calibrate_s": calibrate_s, "calls": calls,
                    "passes": passes, "step_samples": step_samples, "sample_s": runner.sample_s,
                    "launches": {k: v for k, v in launches.items() if v is not None}, "clock": runner.clock,
                    "sync_each_call": runner.sync_each_call, "backend_info": runner.describe(), "pid": os.getpid()}


def burst(runner: Any, ready: dict, probe: Any) -> dict:
    """Every item timed (seconds per call: the fastest of the burst's passes), between two readings of the
    machine."""
    from harness.timing import contention

    a = probe.snapshot()
    times = runner.burst(ready["calls"], ready["passes"], ready["step_samples"])
    b = probe.snapshot()
    return {"times": times, "chunk": contention.chunk(a, b, 0, ready["passes"])}


def serve(job: PartsJob) -> int:
    """The timed process of one contender: prepare, say ready, then time the bursts asked for until told to quit."""
    from harness.timing import contention

    runner, ready = prepare(job)
    probe, _ = contention.default_probe(job.device)
    ready["gpu_evidence"] = probe.gpu is not None
    reply(ready)
    for msg in messages():
        if msg.get("quit"):
            break
        if "siblings" in msg:
            if probe.gpu is not None:
                probe.gpu.siblings = set(msg["siblings"])
                probe.gpu.tree_root = msg.get("coordinator")
            continue
        reply(burst(runner, ready, probe))
    return 0


def main(argv: list[str]) -> int:
    """`JOB_JSON`: serve one contender until the coordinator says quit (SIGTERM: exit 130)."""
    if len(argv) != 1:
        print("usage: python -m harness --worker parts JOB_JSON", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    try:
        return serve(PartsJob(**message(argv[0])))
    except UsageError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
