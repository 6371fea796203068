"""Backend registry: names to lazily imported classes, so that importing the harness imports no framework.

The shipped backends are REGISTRY's; an installed distribution adds more through the entry-point group
`harness.backends` (`name = "module:Class"`, docs/backends.md), read once and only when a name outside REGISTRY is
asked for (or every backend is: `--backend all`, `harness doctor`, the help). Every backend declares what it can do
(harness.backends.declaration.Declaration); the code above this package reads the declarations, never a name.
"""

from __future__ import annotations

import importlib
from typing import Any

from harness.backends.base import Backend, BackendUnavailable
from harness.backends.declaration import COMPILE_MODES, DEVICES, NAME_RE, RESERVED, Declaration, listing
from harness.errors import UsageError

# name -> "module:Class". The module is imported only when that backend is used (in its worker process).
REGISTRY: dict[str, str] = {
    "torch": "harness.backends.torch_backend:TorchBackend",
    "numpy": "harness.backends.numpy_backend:NumpyBackend",
    "flux": "harness.backends.flux:FluxBackend",
    "jax": "harness.backends.jax_backend:JaxBackend",
}

# name -> "module:Class" of a class with the backend's declaration and option checks (its constructor,
# check_available, check_device) that imports no framework, where the backend's own module would: what the parent
# reads (harness.run.plan.preflight, the help, the doctor). Elsewhere the backend class itself.
OPTIONS: dict[str, str] = {
    "torch": "harness.backends.torch_options:TorchOptions",
}

# The user-facing defaults and aliases that name backends, in this one place: `--backend` (run, bench, sweep)
# defaults to torch; `--both` is torch and flux; parity compares torch with the NumPy oracle unless told otherwise.
# ORACLE is the framework-free float64 reference: the conformance kit's answers, and parity's reference side.
DEFAULT_BACKEND = "torch"
BOTH = ("torch", "flux")
ORACLE = "numpy"
PARITY_DEFAULT = (DEFAULT_BACKEND, ORACLE)

GROUP = "harness.backends"  # the entry-point group of backends from outside

__all__ = ["BOTH", "COMPILE_MODES", "DEFAULT_BACKEND", "GROUP", "OPTIONS", "ORACLE", "PARITY_DEFAULT", "REGISTRY",
           "Backend", "BackendUnavailable", "Declaration", "PluginRefused", "backend_class", "check_backend",
           "check_names", "create_backend", "declaration", "declarations", "declared", "names", "options_class",
           "plugins", "refusals", "taking"]

# The methods every backend has (harness.backends.base.Backend), and check_available, a classmethod
PROTOCOL = ("setup", "train_step", "losses_to_floats", "synchronize", "eval_loss", "logits", "parameters", "memory",
            "describe", "state_dict", "load_state_dict", "check_available")


class PluginRefused(UsageError):
    """A backend from outside that cannot be used: it failed to import or declares nonsense (one line, exit 2)."""


# --- the backends from outside, read once ---------------------------------------------------------------------
_found: tuple[dict[str, Any], dict[str, str]] | None = None  # (name -> entry point, name -> why refused)
_classes: dict[str, type] = {}  # plugins loaded and checked
_refused_on_load: dict[str, str] = {}


def _origin(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    where = f", from {dist.metadata['Name']} {dist.version}" if dist is not None else ""
    return f"backend plugin {ep.name!r} ({ep.value}{where})"


def _fix(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    return f"fix the plugin or uninstall {dist.metadata['Name']}" if dist is not None else "fix or remove the plugin"


def _scan() -> tuple[dict[str, Any], dict[str, str]]:
    """The entry points of GROUP (importlib.metadata, once per process): usable names, and refused ones with why."""
    global _found
    if _found is None:
        from importlib.metadata import entry_points

        found: dict[str, Any] = {}
        refused: dict[str, str] = {}
        eps = list(entry_points(group=GROUP))
        for ep in eps:
            name, why = ep.name, None
            twins = [e for e in eps if e.name == name]
            if name in REGISTRY:
                why = f"its name clashes with the shipped backend {name!r}; rename it"
            elif not NAME_RE.match(name) or name in RESERVED:
                why = "its name is not a backend name (lower-case letters, digits and _, starting with a letter)"
            elif len(twins) > 1:
                why = f"{len(twins)} installed distributions declare this name; uninstall all but one"
            elif ":" not in ep.value:
                why = 'its entry point is not "module:Class"'
            if why:
                refused[name] = f"{_origin(ep)} is refused: {why}"
            else:
                found[name] = ep
        _found = (found, refused)
    return _found


def reset() -> None:
    """Forget the entry points read and the plugins loaded (tests that install a plugin in this process)."""
    global _found
    _found = None
    _classes.clear()
    _refused_on_load.clear()


def plugins() -> list[str]:
    """The names of the installed backends from outside (not yet loaded: one may still be refused when it is)."""
    return list(_scan()[0])


def refusals() -> dict[str, str]:
    """Backends from outside refused so far, name -> the one line that says why."""
    return {**_scan()[1], **_refused_on_load}


def names(with_plugins: bool = True) -> list[str]:
    """Every backend name: the shipped ones, then (with `with_plugins`) those from outside, in their order."""
    return list(REGISTRY) + ([n for n in plugins() if n not in REGISTRY] if with_plugins else [])


def check_names(wanted: list[str]) -> None:
    """Raise UsageError for an unknown backend name (PluginRefused for a refused plugin, saying why). The entry
    points are read only when a name is not a shipped one."""
    for name in wanted:
        if name in REGISTRY:
            continue
        found, refused = _scan()
        if name in refused:
            raise PluginRefused(refused[name])
        if name not in found:
            raise UsageError(f"unknown backend {name!r}; choose from {', '.join(names())}")


# --- classes and declarations ---------------------------------------------------------------------------------
def _import(target: str) -> Any:
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def backend_class(name: str) -> type:
    """Import and return the class of backend `name` (the public way to get it); a plugin is checked first."""
    check_names([name])
    if name in REGISTRY:
        return _import(REGISTRY[name])
    return _load_plugin(name)


def options_class(name: str) -> type:
    """The class that declares backend `name` and checks its options and device in the parent, importing no framework
    where it can: OPTIONS' (TorchOptions for torch), else the backend class."""
    check_names([name])
    if name in REGISTRY:
        return _import(OPTIONS.get(name, REGISTRY[name]))
    return _load_plugin(name)


def declaration(name: str) -> Declaration:
    """What backend `name` declares (harness.backends.declaration)."""
    return options_class(name).declaration


def declarations(wanted: list[str] | None = None) -> dict[str, Declaration]:
    """name -> declaration of `wanted` (default: every backend), leaving out plugins that are refused (refusals()
    says why) and names no installed backend has (a stored run's plugin since uninstalled)."""
    out = {}
    for name in names() if wanted is None else wanted:
        try:
            out[name] = declaration(name)
        except UsageError:
            continue
    return out


def taking(what: str, wanted: list[str] | None = None) -> list[str]:
    """The backends (of `wanted`, default every one) that take an option: "precision", "compile" (a mode), or one
    of the declaration's options (e.g. "cuda_graphs")."""
    def takes(d: Declaration) -> bool:
        if what == "precision":
            return bool(d.precisions)
        if what == "compile":
            return bool(d.compile_modes)
        return what in d.options

    return [n for n, d in declarations(wanted).items() if takes(d)]


def declared(backend: Any, method: str) -> bool:
    """Whether `backend` (an instance or class) declares the optional method `method`."""
    return method in backend.declaration.methods


def create_backend(name: str, **options: object) -> Backend:
    """Instantiate backend `name` with its options (e.g. dtype="float64")."""
    return backend_class(name)(**options)


def _load_plugin(name: str) -> type:
    """Import plugin `name` and check what it declares, once; PluginRefused (one line) when it cannot be used."""
    if name in _classes:
        return _classes[name]
    if name in _refused_on_load:
        raise PluginRefused(_refused_on_load[name])
    ep = _scan()[0][name]
    try:
        cls = ep.load()
    except Exception as exc:  # ImportError, SyntaxError, an error of its own at import: refused, never a traceback
        text = " ".join(str(exc).split())[:200]
        why = f"it failed to import ({type(exc).__name__}{': ' + text if text else ''})"
    else:
        why = plugin_problem(name, cls)
    if why:
        _refused_on_load[name] = f"{_origin(ep)} is refused: {why}; {_fix(ep)}"
        raise PluginRefused(_refused_on_load[name])
    _classes[name] = cls
    return cls


def plugin_problem(name: str, cls: object) -> str | None:
    """What makes `cls` unusable as backend `name` (not a class, no or a wrong declaration, a protocol method
    missing), in words; None when it can be used."""
    if not isinstance(cls, type):
        return f"it names {type(cls).__name__} {cls!r:.60}, not a class"
    decl = getattr(cls, "declaration", None)
    if not isinstance(decl, Declaration):
        return "its class has no `declaration` (a harness.backends.Declaration)"
    problems = decl.problems()
    if decl.name != name:
        problems.insert(0, f"it declares the name {decl.name!r}, not {name!r}")
    if getattr(cls, "name", None) != name:
        problems.insert(0, f"its class's `name` is {getattr(cls, 'name', None)!r}, not {name!r}")
    missing = [m for m in (*PROTOCOL, *sorted(decl.methods - {"parts"})) if not callable(getattr(cls, m, None))]
    if missing:
        problems.append(f"it has no {', '.join(missing)} (declared or required)")
    return "; ".join(problems) or None


# --- the parent's check of one backend --------------------------------------------------------------------------
def check_backend(name: str, device: str, options: dict, config_options: dict | None = None) -> None:
    """Everything the parent can check about backend `name` before anything is written: its device among its
    declared ones, that it can run there (check_available), its options (its constructor, then what it declares:
    dtype, precision, compile mode, options, the config's options), and options that need the device
    (check_device). UsageError (one line) when it cannot run; no framework is imported (OPTIONS)."""
    cls = options_class(name)
    decl: Declaration = cls.declaration
    if device in DEVICES and device not in decl.devices:
        raise UsageError(f"{name} backend: --device {device} is not one of its devices ({', '.join(decl.devices)}); "
                         f"use --device {decl.devices[0]}")
    try:
        cls.check_available(device)
        instance = cls(**options)  # its own checks of its options (dtype, precision)
        check_declared(decl, options, config_options or {})
        if declared(cls, "check_device"):
            instance.check_device(device)  # options that need a device (--precision bf16)
    except BackendUnavailable as exc:
        raise UsageError(str(exc)) from None
    except Exception as exc:
        if name in REGISTRY or isinstance(exc, UsageError):
            raise
        # a backend from outside whose own checks break: its name and the error, never a traceback
        text = " ".join(str(exc).split())[:200]
        raise UsageError(f"{name} backend: its checks before the run failed ({type(exc).__name__}"
                         f"{': ' + text if text else ''}); fix the backend or leave it out") from None


def check_declared(decl: Declaration, options: dict, config_options: dict) -> None:
    """UsageError when `options` (constructor options) or `config_options` (the config's non-default options) ask for
    what `decl` does not declare."""
    name = decl.name
    dtype = options.get("dtype")
    if dtype is not None and dtype not in decl.dtypes:
        raise UsageError(f"{name} backend: dtype must be one of {', '.join(decl.dtypes)}, got {dtype!r}")
    if options.get("precision") not in (None, *decl.precisions):
        took = f"one of {', '.join(decl.precisions)}" if decl.precisions else "no --precision"
        raise UsageError(f"{name} backend: --precision {options['precision']}: it takes {took}")
    if options.get("compile") and options["compile"] not in (True, *decl.compile_modes):
        raise UsageError(f"{name} backend: --compile {options['compile']}: it takes "
                         + (f"one of {', '.join(decl.compile_modes)}" if decl.compile_modes else "no --compile"))
    for option in ("cuda_graphs", "parity"):
        if options.get(option) and option not in decl.options:
            raise UsageError(f"{name} backend: it does not take {option}")
    unsupported = [k for k in config_options if k not in decl.options]
    if unsupported:
        raise UsageError(f"{name} backend: it does not implement the config option"
                         f"{'s' if len(unsupported) > 1 else ''} {listing(unsupported)}; leave "
                         f"{'them' if len(unsupported) > 1 else 'it'} at the default or use another backend")
