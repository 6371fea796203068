#!/usr/bin/env python3
"""Measure the JAX backend's AdamW against the NumPy oracle at parity's re-synchronised optimizer depth, two ways:

- "hand-written": the backend as it is (harness.models.jax_gpt.adamw: torch.optim.AdamW's formula, its scalars in
  float64 on the host; clipping as torch.nn.utils.clip_grad_norm_);
- "optax": the same jitted step with optax instead: optax.chain(optax.clip_by_global_norm(grad_clip),
  optax.inject_hyperparams(optax.adamw)(..., mask=the decay rule)), the learning rate injected per step, the state
  mapped from the backend's (m -> mu, v -> nu, t -> count).

For each size, seed, dropout and precision pair the NumPy oracle trains as the reference and the JAX backend
re-synchronises every step from it, exactly as `harness parity` does (harness.run.probe.run, the worker's code);
harness.parity.compare grades it with the command's default tolerances. One JSON line per run: the verdict and
the worst optimizer-step deviation. docs/parity.md ("JAX") has the results.

    python tools/jax_optimizers.py --sizes small,medium --seeds 1337,1 --steps 50 --dropout 0,0.2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # as `harness parity --threads 1` (its default)


def use_optax(backend: Any) -> None:
    """Replace the backend's jitted training step by the optax one (the `prepare` hook of probe.run)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from harness.core.masks import mask_shapes
    from harness.core.weights import decays
    from harness.models import jax_gpt

    config = backend.config
    mask = {n: decays(n, tuple(p.shape), config.decay) for n, p in backend.state[0].items()}
    tx = optax.chain(optax.clip_by_global_norm(config.grad_clip) if config.grad_clip > 0 else optax.identity(),
                     optax.inject_hyperparams(optax.adamw)(learning_rate=config.learning_rate, b1=config.beta1,
                                                           b2=config.beta2, eps=config.eps,
                                                           weight_decay=config.weight_decay, mask=mask))

    def step(state: Any, x: Any, y: Any, scalars: Any, dropout: Any) -> Any:
        p, m, v = state
        lr, t = scalars[0], scalars[1].astype(jnp.int32)  # see `scalars` below: (lr, t, 0)
        # the chain's state: (clip's, inject_hyperparams' (count, hyperparams, ..., inner_state = (adam's, decay's,
        # lr's))); the backend's moments and step count go into adam's, the step's rate into the hyperparameters
        clip, inject = tx.init(p)
        adam = inject.inner_state[0]._replace(count=t - 1, mu=m, nu=v)
        opt = (clip, inject._replace(count=t - 1, hyperparams={**inject.hyperparams, "learning_rate": lr},
                                     inner_state=(adam, *inject.inner_state[1:])))
        masks = dropout if isinstance(dropout, dict) else jax_gpt.draw_masks(jax.random.fold_in(*dropout),
                                                                             mask_shapes(config), config.dropout)
        value, grads = jax.value_and_grad(jax_gpt.loss)(p, x, y, config, masks)
        updates, opt = tx.update(grads, opt, p)
        p = optax.apply_updates(p, updates)
        adam = opt[1].inner_state[0]
        return (p, adam.mu, adam.nu), value

    backend._step = jax.jit(step, donate_argnums=0)
    backend._scalars = lambda lr, t: np.asarray([lr, t, 0.0], dtype=backend.dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small")
    ap.add_argument("--seeds", default="1337")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--dropout", default="0")
    ap.add_argument("--dtypes", default="float32,float64", help="the JAX backend's dtypes (the oracle: float64)")
    ap.add_argument("--data", default=os.environ.get("HARNESS_DATA"))
    args = ap.parse_args()

    from harness.backends.jax_backend import JaxBackend
    from harness.backends.numpy_backend import NumpyBackend
    from harness.config.load import load_config
    from harness.core.data import load_corpus
    from harness.parity import compare
    from harness.parity.tolerances import default_tolerances, precision_pair
    from harness.run import probe

    corpus = load_corpus(args.data)
    dtypes = args.dtypes.split(",")
    if "float64" in dtypes:  # before any JAX array: float32 runs then keep float32 by their explicit dtypes
        from harness.backends.jax_backend import import_jax

        import_jax("cpu", "float64")
    for size in args.sizes.split(","):
        for dropout in (float(d) for d in args.dropout.split(",")):
            config = load_config(size).replace(dropout=dropout, steps=args.steps)
            for seed in (int(s) for s in args.seeds.split(",")):
                ref, ref_losses = probe.run(NumpyBackend(dtype="float64"), config, corpus, seed)
                for dtype in dtypes:
                    for variant, prepare in (("hand-written", None), ("optax", use_optax)):
                        other, losses = probe.run(JaxBackend(dtype=dtype, parity=True), config, corpus, seed,
                                                  reference=ref, reference_name="numpy", prepare=prepare)
                        pair = precision_pair(dtype, "float64")
                        r = compare.compare(other, ref, losses, ref_losses, default_tolerances(pair, size),
                                            backends=("jax", "numpy"), config=config)
                        print(json.dumps({"size": size, "seed": seed, "dropout": dropout, "steps": args.steps,
                                          "pair": pair, "adamw": variant, "passed": r.passed,
                                          "failures": r.failures, "opt": r.worst_opt_rel_err,
                                          "opt_where": r.worst_opt, "tolerance": r.tolerances.opt}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
