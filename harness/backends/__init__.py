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

# name -> "module:Class" of a class with the backend's option checks (its constructor, check_available,
# check_device) that imports no framework, where the backend's own module would: what the parent's preflight uses
# (harness.run.plan.preflight). Elsewhere the backend class itself.
OPTIONS: dict[str, str] = {
    "torch": "harness.backends.torch_options:TorchOptions",
}

# torch.compile's modes, as `--compile MODE` takes them (here, not in torch_backend: the CLI reads them without
# importing torch)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")

__all__ = ["COMPILE_MODES", "OPTIONS", "REGISTRY", "Backend", "BackendUnavailable", "backend_class", "check_names",
           "create_backend", "options_class"]


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


def options_class(name: str) -> type:
    """The class that checks backend `name`'s options and device in the parent (OPTIONS), importing no framework
    where it can: TorchOptions for torch, the backend class for the others."""
    check_names([name])
    module, cls = OPTIONS.get(name, REGISTRY[name]).split(":")
    return getattr(importlib.import_module(module), cls)


def create_backend(name: str, **options: object) -> Backend:
    """Instantiate backend `name` with its options (e.g. dtype="float64")."""
    return backend_class(name)(**options)
