"""Benchmarks of the harness itself: its overhead per step, and whether a speed verdict survives other work on the
machine."""
