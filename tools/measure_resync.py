#!/usr/bin/env python3
"""Measure what correct backends deviate by at the re-synchronised depths, to set their default tolerances.

For each size, seed and dropout: the NumPy oracle (float64, and float32 for the float32/float32 pair) trains as the
reference, torch (float32 and float64) re-synchronises every optimizer step from it, exactly as `harness parity` does
(harness.run.probe.run is the worker's code, one thread), and harness.parity.compare.compare grades them. One JSON line
per run on stdout: the worst tap, optimizer-step and step-loss deviations and where they are. docs/parity.md has the
results and the rule that turns them into tolerances.

    python tools/measure_resync.py --sizes small,medium --seeds 1337,1,2 --steps 50 [--dropout 0,0.2]
    python tools/measure_resync.py --sizes medium --set tie_embeddings=true --set gelu=exact --set bias=false \
        --set lm_head_bias=false          # an option set, as `harness parity --set` and `harness kit export --set`
"""

from __future__ import annotations

import argparse
import json
import os
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # as `harness parity --threads 1` (its default)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small")
    ap.add_argument("--seeds", default="1337")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--dropout", default="0")
    ap.add_argument("--set", action="append", metavar="NAME=VALUE", help="a model or schedule option (repeatable)")
    ap.add_argument("--pairs", default="float32/float64,float64/float64,float32/float32",
                    help="torch's dtype / the oracle's, comma-separated")
    ap.add_argument("--data", default=os.environ.get("HARNESS_DATA"))
    args = ap.parse_args()

    import torch

    from harness.backends.numpy_backend import NumpyBackend
    from harness.backends.torch_backend import TorchBackend
    from harness.config.load import load_config
    from harness.config.nanogpt import parse_sets
    from harness.core.data import load_corpus
    from harness.parity.compare import compare
    from harness.parity.tolerances import default_tolerances, precision_pair
    from harness.run import probe

    torch.set_num_threads(1)
    corpus = load_corpus(args.data)
    for size in args.sizes.split(","):
        for dropout in (float(d) for d in args.dropout.split(",")):
            config = load_config(size, None, parse_sets(args.set)).replace(dropout=dropout, steps=args.steps)
            for seed in (int(s) for s in args.seeds.split(",")):
                refs = {}
                for torch_dtype, numpy_dtype in (p.split("/") for p in args.pairs.split(",")):
                    if numpy_dtype not in refs:
                        refs[numpy_dtype] = probe.run(NumpyBackend(dtype=numpy_dtype), config, corpus, seed)
                    ref, ref_losses = refs[numpy_dtype]
                    other, losses = probe.run(TorchBackend(dtype=torch_dtype, parity=True), config, corpus, seed,
                                              reference=ref, reference_name="numpy")
                    pair = precision_pair(torch_dtype, numpy_dtype)
                    r = compare(other, ref, losses, ref_losses, default_tolerances(pair, None if args.set else size),
                                backends=("torch", "numpy"), config=config)  # as the command
                    dev = r.step_loss_abs_dev
                    print(json.dumps({
                        "size": size, "set": args.set or [], "seed": seed, "dropout": dropout, "steps": args.steps,
                        "pair": pair,
                        "passed": r.passed, "failures": r.failures,
                        "taps": r.taps_rel_err[r.worst_tap] if r.worst_tap else None, "taps_where": r.worst_tap,
                        "logits": r.logits_max_abs, "grad": r.worst_grad_rel_err,
                        "opt": r.worst_opt_rel_err, "opt_where": r.worst_opt,
                        "step_loss": max(dev) if dev else None,
                        "step_loss_step": dev.index(max(dev)) + 1 if dev else None,
                        "loss": r.loss_max_abs_dev, "loss_step": r.loss_peak_step,
                    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
