"""The run machinery: plan and memory preflight, the worker and its supervision, the training loop, the probe, text
metrics, the records, and the paired timing that ends a run."""
