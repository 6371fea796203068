"""Backend registry: names to lazily imported classes, so that importing the harness imports no framework."""

from __future__ import annotations

import importlib

from harness.backends.base import Backend, BackendUnavailable
from harness.errors import UsageError

# name -> "module:Class". The module is imported only when that backend is used (in its worker process).
REGISTRY: dict[str, str] = {
    "torch": "harness.backends.torch_backend:TorchBackend",
    "numpy": "harness.backends.numpy_backend:NumpyBackend",
    "flux": "harness.backends.flux:FluxBackend",
    "jax": "harness.backends.jax_backend:JaxBackend",
}

# torch.compile's modes, as `--compile MODE` takes them (here, not in torch_backend: the CLI reads them without
# importing torch)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")

__all__ = ["COMPILE_MODES", "REGISTRY", "Backend", "BackendUnavailable", "backend_class", "check_names",
           "create_backend"]


def check_names(names: list[str]) -> None:
    """Raise UsageError for an unknown backend name."""
    for name in names:
        if name not in REGISTRY:
            raise UsageError(f"unknown backend {name!r}; choose from {', '.join(REGISTRY)}")


def backend_class(name: str) -> type:
    """Import and return the class of backend `name`."""
    check_names([name])
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def create_backend(name: str, **options: object) -> Backend:
    """Instantiate backend `name` with its options (e.g. dtype="float64")."""
    return backend_class(name)(**options)
