"""Framework implementations of nanoGPT used by the harness backends (PyTorch, and the NumPy reference)."""
