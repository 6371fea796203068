"""The GPU check behind `python tools/gpu_check.py`: a budgeted, resumable run of everything a GPU has to prove.

- `plan`: the checks in their priority order (tiers), each with its command, judge, the parts it needs and its
  estimated time on an H100 (the table `ESTIMATES`, from docs/benchmarks.md's figures);
- `judges`: how each check's outcome is judged from its exit status and its records;
- `preflight`: what the machine has (GPU, CUDA, torch, CuPy, JAX's plugin, NVML, a C compiler, the data, a nanoGPT
  checkout, the harness's own dependencies) and what each missing part skips;
- `nanogpt`: nanoGPT's `data/shakespeare_char` files written from the harness's data file (no `requests`, no
  internet) and nanoGPT's own `train.py` as a check;
- `schedule`: which checks fit the budget, call after call; `summary`: `summary.json`/`summary.md`, written
  atomically after every check and read back to resume;
- `runner`: running one check in a process of its own (no CUDA context in this process), the loop, the signals;
- `cli`: the options, their validation (one line, exit 2) and `main`; `profile`: the torch.profiler table child.

A script in tools/, not a harness verb: it checks the harness (and runs nanoGPT beside it), it is not a measurement
users make of their own models; docs/benchmarks.md, "The GPU check", says how to run it on a lent GPU.
"""
