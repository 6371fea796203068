"""The run machinery: plan and memory preflight, the worker and its supervision, the training loop, the probe, text
metrics, the records, the child processes (how they start and their side of it), and the paired timing that ends a
run (its coordinator and its timed process)."""
