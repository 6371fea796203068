"""Which device each backend runs on, and what a backend changes in parity mode.

`harness parity --device` takes `DEVICE` (every backend) or `NAME=DEVICE` (one backend), repeatable, so a CUDA torch
can be compared with the NumPy oracle on the CPU: `--device torch=cuda`. A backend that is not named runs on the
plain `--device` if one was given, else on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.errors import UsageError

DEVICES = ("cpu", "cuda")
DEFAULT_DEVICE = "cpu"


def parse_devices(values: Sequence[str] | str | None, backends: Sequence[str]) -> tuple[str, dict[str, str]]:
    """(the common device, {backend: device} for every backend) from `--device` values; UsageError when bad.

    `values` are the repeated `--device` arguments: `DEVICE` at most once, `NAME=DEVICE` at most once per backend,
    NAME one of `backends`, DEVICE one of cpu, cuda.
    """
    if values is None:
        values = []
    elif isinstance(values, str):
        values = [values]
    common: str | None = None
    named: dict[str, str] = {}
    for value in values:
        name, sep, device = str(value).partition("=")
        if not sep:
            name, device = "", name
        name, device = name.strip(), device.strip()
        if device not in DEVICES:
            raise UsageError(f"--device {value!r}: unknown device {device!r}; use cpu or cuda, for one backend "
                             "NAME=DEVICE (e.g. --device torch=cuda)")
        if sep and not name:
            raise UsageError(f"--device {value!r}: no backend name before '='; e.g. --device torch=cuda")
        if not sep:
            if common is not None and common != device:
                raise UsageError(f"--device given twice without a backend name ({common}, {device}); pass one, "
                                 "and NAME=DEVICE for a single backend")
            common = device
            continue
        if name not in backends:
            raise UsageError(f"--device {value!r}: {name!r} is not one of the backends compared "
                             f"({', '.join(backends)})")
        if name in named and named[name] != device:
            raise UsageError(f"--device names {name} twice ({named[name]}, {device}); name each backend once")
        named[name] = device
    base = common or DEFAULT_DEVICE
    return base, {b: named.get(b, base) for b in backends}


def parity_options(name: str) -> dict:
    """Constructor options backend `name` takes in parity mode (its class's PARITY_OPTIONS; torch: the
    single-tensor AdamW and, on CUDA, the math attention kernel)."""
    from harness.backends import backend_class

    try:
        cls = backend_class(name)
    except Exception:  # an unavailable backend: preflight reports it
        return {}
    return dict(getattr(cls, "PARITY_OPTIONS", {}))
