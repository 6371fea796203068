"""The timed process of a paired timing: one contender (a backend of a run directory) set up, warmed up, then timed
in the bursts its coordinator (harness.run.paired_timing) asks for: `python -m harness --worker timed RUN_DIR BACKEND
WARMUP_S`.

The protocol is JSON lines on stdin (from the coordinator: `{"siblings": [pid, ...], "coordinator": pid}`,
`{"burst": n, "start": k}`, `{"quit": true}`) and on stdout, prefixed with MARK (to the coordinator: `ready` once
warmed up, then per burst its step times and its contention chunk); anything else the backend prints on stdout is
passed on. Steps are timed exactly as `harness run` times them (harness.run.loop.train) on the run's own batches,
continuing after the warm-up. A burst ends with the device synchronised (`backend.synchronize()`) before its
closing reading and its reply, so no work of it is still queued on a GPU when the coordinator starts the next
contender: two contenders never run on the device at once, and the siblings and the coordinator are not contention
in the GPU evidence (harness.timing.contention.NvmlProbe).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from harness.errors import UsageError

MARK = "@harness-paired "  # protocol lines on the timing process's stdout start with this (others are passed on)


WARMUP_STEPS, WARMUP_S, WARMUP_MAX = 10, 1.0, 400  # warm-up: at least 10 steps and 1 s, at most 400 steps


def reply(msg: dict) -> None:
    """Send protocol message `msg` to the coordinator (one line on stdout, prefixed with MARK)."""
    sys.stdout.write(MARK + json.dumps(msg) + "\n")
    sys.stdout.flush()


def message(text: str) -> dict:
    """A protocol message from the coordinator (one JSON object: a line on stdin, or a job on the command line)."""
    msg = json.loads(text)
    if not isinstance(msg, dict):
        raise ValueError(f"a protocol message is a JSON object, not {type(msg).__name__}")
    return msg


def messages(stream: IO[str] | None = None) -> Iterator[dict]:
    """The coordinator's messages on `stream` (default stdin), one per line, until it closes."""
    for line in stream if stream is not None else sys.stdin:
        yield message(line)


def serve(run_dir: Path, backend_name: str, warmup_s: float = WARMUP_S) -> int:
    """The timing process of one contender: set up, warm up, then run the bursts the coordinator asks for."""
    import numpy as np

    from harness.run.loop import LoopOptions, train, warm_up
    from harness.run.worker import Worker
    from harness.store import RunPaths
    from harness.store.curves import Curves
    from harness.store.paired import Ready
    from harness.timing import contention

    worker = Worker(RunPaths.of_dir(Path(run_dir)), backend_name)  # the run's inputs, its backend set up
    backend, setup_s = worker.backend, worker.setup_s
    stream, config = worker.inputs.stream, worker.config
    compile_s = warm_up(backend, stream, 0)
    step, t0, last = 0, time.perf_counter(), []
    while step < WARMUP_STEPS or (time.perf_counter() - t0 < warmup_s and step < WARMUP_MAX):
        cv = Curves()
        train(backend, config, stream, {}, cv, step + 5, LoopOptions(start_step=step, progress=False))
        step, last = step + 5, cv.time_s
    probe, _ = contention.default_probe(worker.device)
    reply(Ready(setup_s=setup_s, compile_s=compile_s, warmup_steps=step, warmup_s=time.perf_counter() - t0,
                 step_s=float(np.median(last)), next_step=step, backend_info=backend.describe(), pid=os.getpid(),
                 gpu_evidence=probe.gpu is not None).to_dict())
    for msg in messages():
        if msg.get("quit"):
            break
        if "siblings" in msg:
            if probe.gpu is not None:
                probe.gpu.siblings = set(msg["siblings"])
                probe.gpu.tree_root = msg.get("coordinator")
            continue
        start, n = int(msg["start"]), int(msg["burst"])
        cv = Curves()
        a = probe.snapshot()
        outcome = train(backend, config, stream, {}, cv, start + n, LoopOptions(start_step=start, progress=False))
        backend.synchronize()  # nothing of this burst left on the device when the next contender starts
        b = probe.snapshot()
        if outcome.status != "completed":
            raise RuntimeError(f"{backend_name}: a timing burst did not complete: {outcome.text}")
        reply({"start": start, "times": cv.time_s, "chunk": contention.chunk(a, b, start, n)})
    return 0


def main(argv: list[str]) -> int:
    """`RUN_DIR BACKEND [WARMUP_S]`: serve one contender until the coordinator says quit (SIGTERM: exit 130)."""
    if len(argv) not in (2, 3):
        print("usage: python -m harness --worker timed RUN_DIR BACKEND [WARMUP_S]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    try:
        return serve(Path(argv[0]), argv[1], float(argv[2]) if len(argv) == 3 else WARMUP_S)
    except UsageError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
