"""The profiler check's child (`gpu_check.py --profile MODE`): torch.profiler's table of the harness's step."""

from __future__ import annotations

import sys
import time

from gpucheck.plan import RECIPE, ROOT


def profile(mode: str, device: str, dry: bool, steps: int = 20) -> int:
    """Print torch.profiler's table of where the harness's training step spends its time: the torch backend on the
    recipe's model (tiny in a dry run) in `mode` (eager or cuda-graphs; bf16 on a GPU), after its warm-up, `steps`
    steps with the runner's per-step work (batch, rate) as harness.run.loop does it."""
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch

    from harness.backends.torch_backend import TorchBackend
    from harness.config.load import load_config
    from harness.core.weights import init_weights

    config = load_config(RECIPE)
    if dry:
        config, steps = config.replace(batch_size=2, n_layer=1, block_size=32, n_embd=48, d_hidden=192), 3
    vocab = 65
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, vocab, (config.batch_size, config.block_size)),
                rng.integers(0, vocab, (config.batch_size, config.block_size))) for _ in range(steps + 3)]
    backend = TorchBackend(precision="fp32" if dry else "bf16", cuda_graphs=mode == "cuda-graphs")
    backend.setup(config, init_weights(config, vocab, 1337), vocab, device, 1337)
    backend.warm_up(*batches[0])
    for x, y in batches[:3]:
        backend.train_step(x, y, config.learning_rate)
    backend.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        losses = [backend.train_step(x, y, config.learning_rate) for x, y in batches[3:]]
        backend.synchronize()
    wall = time.perf_counter() - t0
    sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25))
    values = backend.losses_to_floats(losses)
    print(f"profile: {mode} on {device}, {steps} steps, {wall / steps * 1e3:.3f} ms/step under the profiler, "
          f"last loss {values[-1]:.4f}")
    return 0
