"""What a backend declares about itself: its `declaration`, a Declaration, read by everything above the backends.

The command line's help, the parent's preflight (harness.run.plan), the memory estimate, parity's dtype choice,
sweeps, the benchmarks, the reports' colours and `harness doctor` read a backend's capabilities from here, never from
its name, so that a backend added from outside the harness (docs/backends.md) is treated as the shipped ones are.
This module imports no framework: a declaration is plain data on the backend's class (or on its import-free options
class, as torch's TorchOptions), and its hooks are "module:attribute" strings imported only where they run.

The vocabularies below are the harness's own (the command line offers exactly these values); a backend declares a
subset, and anything else is refused (`Declaration.problems`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from harness.config.fields import OPTION_NAMES

DTYPES = ("float32", "float64")  # `--dtype`
DEVICES = ("cpu", "cuda")  # `--device`
PRECISIONS = ("fp32", "tf32", "bf16")  # `--precision`: matmul precision on a CUDA GPU
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # `--compile MODE` (torch.compile's modes)

# What a backend may support beyond the plain model: the config's model and optimizer options (a config that sets
# one to other than its default is refused for a backend that does not declare it), and constructor options.
OPTIONS: dict[str, str] = {
    **{name: f"the config option {name} (harness.config.fields)" for name in OPTION_NAMES},
    "cuda_graphs": "--cuda-graphs: the constructor takes cuda_graphs=True (the whole step captured as a CUDA graph)",
    "parity": "`harness parity` constructs it with parity=True (its most reproducible kernels and optimizer)",
}

# The optional methods a backend may have; the harness calls one only where the declaration lists it.
METHODS: dict[str, str] = {
    "gradients": "gradients(x, y, masks=None): the step-0 gradients `harness parity` compares (parity needs it)",
    "taps": "taps(x, masks=None): the activation taps of parity's depth 0 (without it parity starts at the logits)",
    "warm_up": "warm_up(x, y) and the attribute needs_warm_up: a one-off compile before step 0, recorded as compile_s",
    "device_clock": "device_clock(): markers on an asynchronous device's stream, so steps are timed without a sync",
    "fetch_losses": "fetch_losses(losses): start copying device losses to the host; returns a function that waits",
    "check_installed": "classmethod check_installed(device): what `--backend all` asks (refuse where something would "
                       "first be downloaded); else check_available",
    "check_device": "check_device(device) on a constructed instance: options that need the device (a GPU's "
                    "capability), checked by the parent before anything is written",
    "parts": "`harness bench parts` times its model part by part, with the part runner its `part_runner` names",
}

NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")  # a backend's name: file names (`<name>.json`), lists (`a,b`)
RESERVED = ("all",)  # `--backend all`
HOOK_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # "module:attribute"
COLOR_RE = re.compile(r"^#[0-9a-fA-F]{6}$")


@dataclass(frozen=True)
class Declaration:
    """One backend's capabilities: what the parent may ask of it without importing its framework.

    `dtypes`: the float types it computes in, its default first. `devices`, `precisions` (`--precision` values;
    none: it takes no precision option) and `compile_modes` (`--compile MODE`; none: no compile option) are subsets
    of the harness's vocabularies above. `options` and `methods`: subsets of OPTIONS and METHODS. `needs`: the extra
    or tool it needs beyond the harness ("" for nothing), `install`: the one line that installs it, `cuda_install`:
    the one line that makes `--device cuda` work where `install` does not (numpy: CuPy; jax: its CUDA plugin); each
    the one place for that hint (doctor, the errors and the README quote it). `color`: its colour in the reports
    ("" for one from the reports' palette). `own_process`: the overhead benchmark always measures it in a fresh
    process (state fixed for a process's life: juliacall before torch, JAX's float64 switch). `bare_loop`:
    "module:Class" of its hand-written floor for the overhead benchmark (harness.backends.base.BareLoop; "" for the
    generic loop over `train_step`). `part_runner`: "module:Class" of its part runner for `harness bench parts`
    (harness.backends.parts.PartRunner; needed with the method `parts`). `doctor`: "module:function" giving its rows
    of `harness doctor` (component, status, fix)."""

    name: str
    dtypes: tuple[str, ...]
    devices: tuple[str, ...] = ("cpu",)
    precisions: tuple[str, ...] = ()
    compile_modes: tuple[str, ...] = ()
    options: frozenset[str] = field(default_factory=frozenset)
    methods: frozenset[str] = field(default_factory=frozenset)
    needs: str = ""
    install: str = ""
    cuda_install: str = ""
    color: str = ""
    own_process: bool = False
    bare_loop: str = ""
    part_runner: str = ""
    doctor: str = ""

    @property
    def default_dtype(self) -> str:
        """The dtype it computes in unless `--dtype` says otherwise."""
        return self.dtypes[0]

    def replace(self, **changes: object) -> Declaration:
        """A copy with `changes` (a backend derived from another declares what differs)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def problems(self) -> list[str]:
        """What is wrong with this declaration, one phrase each (empty when it is sound)."""
        out = []
        if not isinstance(self.name, str) or not NAME_RE.match(self.name) or self.name in RESERVED:
            out.append(f"its name {self.name!r} is not a backend name (lower-case letters, digits and _, starting "
                       f"with a letter, at most 32; not {', '.join(RESERVED)})")
        for what, values, allowed in (("dtypes", self.dtypes, DTYPES), ("devices", self.devices, DEVICES),
                                      ("precisions", self.precisions, PRECISIONS),
                                      ("compile_modes", self.compile_modes, COMPILE_MODES),
                                      ("options", self.options, tuple(OPTIONS)),
                                      ("methods", self.methods, tuple(METHODS))):
            out += _subset_problems(what, values, allowed)
        if isinstance(self.dtypes, tuple) and not self.dtypes:
            out.append("it declares no dtype")
        if isinstance(self.devices, tuple) and "cpu" not in self.devices:
            out.append("its devices leave out cpu (every backend runs on the CPU)")
        for what in ("needs", "install", "cuda_install"):
            value = getattr(self, what)
            if not isinstance(value, str) or "\n" in value or len(value) > 300:
                out.append(f"its {what} is not one line of text")
        if not isinstance(self.color, str) or (self.color and not COLOR_RE.match(self.color)):
            out.append(f"its color {self.color!r} is not \"\" or #rrggbb")
        for what in ("bare_loop", "part_runner", "doctor"):
            value = getattr(self, what)
            if not isinstance(value, str) or (value and not HOOK_RE.match(value)):
                out.append(f"its {what} {value!r} is not \"\" or \"module:attribute\"")
        if isinstance(self.methods, frozenset) and "parts" in self.methods and not self.part_runner:
            out.append("it declares the method parts but no part_runner (\"module:Class\" of its part runner)")
        if not isinstance(self.own_process, bool):
            out.append("its own_process is not true or false")
        return out


def _subset_problems(what: str, values: object, allowed: tuple[str, ...]) -> list[str]:
    """The phrase saying `values` is not a tuple (or, for sets, a frozenset) of names from `allowed`."""
    kind = frozenset if what in ("options", "methods") else tuple
    if not isinstance(values, kind) or not all(isinstance(v, str) for v in values):
        return [f"its {what} is not a {kind.__name__} of names"]
    unknown = [v for v in values if v not in allowed]
    if unknown:
        return [f"its {what} hold {', '.join(map(repr, sorted(unknown)))}, not among {', '.join(allowed)}"]
    if kind is tuple and len(set(values)) != len(values):
        return [f"its {what} name a value twice"]
    return []


def listing(names: list[str]) -> str:
    """"a", "a and b", "a, b and c": backends named in a sentence ("no backend" for none)."""
    if not names:
        return "no backend"
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
