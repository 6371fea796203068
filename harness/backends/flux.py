"""The Flux.jl backend: the Julia package NanoGPTFlux driven through juliacall.

juliacall is imported lazily, only when a FluxBackend is set up (in the flux worker, which never imports
torch: juliacall must come first or the process can crash). Everything else here (`check_available`,
`julia_status`) only looks at files, environment variables and, when it must, one short TCP connect: it
never starts Julia, never downloads and never writes.

Where the Julia side comes from:
- `harness/juliapkg.json` lists the registered Julia packages (Flux, NNlib, Optimisers, Zygote,
  OneHotArrays, CUDA, cuDNN) with compat bounds; juliapkg finds it next to the `harness` package.
- NanoGPTFlux itself is a local package: `harness/_julia/NanoGPTFlux` in a wheel, `julia/NanoGPTFlux` in a
  source checkout. Its path differs between the two, so it is not in that file: `register_package()` adds it
  to juliapkg's own project deps file with `juliapkg.add(..., dev=True, path=...)` just before Julia starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from harness.backends.base import NO_GPU, BackendUnavailable
from harness.backends.declaration import Declaration
from harness.backends.flux_layout import (
    from_flux,
    logits_from_flux,
    masks_to_flux,
    taps_from_flux,
    to_flux,
    tokens_to_flux,
)
from harness.config.fields import OPTION_NAMES, Config
from harness.core.weights import decays
from harness.environment import gpu_seen

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PACKAGE = "NanoGPTFlux"
JULIA_DOWNLOAD_HOST = ("julialang-s3.julialang.org", 443)  # juliapkg downloads Julia from here
JULIA_PKG_SERVER = ("pkg.julialang.org", 443)  # Julia's package server (registry and packages)
NETWORK_TIMEOUT_S = 2.0
# On CUDA, GC.gc(false) after every GC_EVERY-th training step: Julia frees GPU arrays only when its GC runs, so
# without it the CUDA pool's peak would count arbitrarily many steps of garbage (see memory()).
GC_EVERY = 1
SETUP_HINT = ("install Julia 1.10+ and set PYTHON_JULIAPKG_EXE=/path/to/julia, "
              "or run `harness setup julia` on a machine with internet")
DECLARATION = Declaration(
    name="flux", dtypes=("float32",), devices=("cpu", "cuda"), precisions=("fp32", "tf32"),
    options=frozenset(OPTION_NAMES), methods=frozenset({"gradients", "taps", "check_installed", "parts"}),
    needs="Julia", install="`harness setup julia`", color="#9c36b5", own_process=True,
    part_runner="harness.backends.flux_parts:FluxParts",
    doctor="harness.backends.flux_setup:doctor_rows")


# --------------------------------------------------------------------------------------------------------------
# Locating things without starting Julia
# --------------------------------------------------------------------------------------------------------------

def package_path() -> Path | None:
    """The NanoGPTFlux package directory: in the installed wheel, else in the source checkout."""
    here = Path(__file__).resolve().parent.parent  # .../harness
    for candidate in (here / "_julia" / PACKAGE, here.parent / "julia" / PACKAGE):
        if (candidate / "Project.toml").is_file():
            return candidate
    return None


def package_uuid(path: Path) -> str:
    """The UUID in NanoGPTFlux's Project.toml (the one source of truth)."""
    with open(path / "Project.toml", "rb") as f:
        return str(tomllib.load(f)["uuid"])


def _version_of(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # not installed, or broken metadata: both mean "not usable"
        return None


def _juliapkg_state() -> dict | None:
    """juliapkg's STATE (project, meta and install paths, offline flag); importing it reads env only."""
    if importlib.util.find_spec("juliapkg") is None:
        return None
    try:
        from juliapkg.state import STATE

        return dict(STATE)
    except Exception:  # e.g. PYTHON_JULIAPKG_PROJECT not absolute, or a dependency missing: see juliapkg_problem
        return None


def juliapkg_problem() -> str | None:
    """Why juliapkg's settings cannot be read, in words that name the fix; None when they can (or juliapkg is not
    installed at all, which `unavailable_reason` says first). A module juliapkg imports that is missing (its own
    dependencies tomlkit and semver, when a package manager installed juliapkg alone) is named; anything else is
    juliapkg refusing its PYTHON_JULIAPKG_* variables."""
    if importlib.util.find_spec("juliapkg") is None:
        return None
    try:
        from juliapkg.state import STATE  # noqa: F401 (imported to see whether it can be)
    except ImportError as exc:
        missing = exc.name or str(exc)
        return (f"juliapkg cannot be imported: the module {missing!r} it needs is missing; run `pip install "
                f"{missing}` (or `pip install juliacall`, which installs juliapkg with its dependencies)")
    except Exception as exc:
        return (f"juliapkg cannot read its settings ({type(exc).__name__}: {' '.join(str(exc).split())[:160]}; is "
                "PYTHON_JULIAPKG_PROJECT an absolute path?); fix the PYTHON_JULIAPKG_* variables")
    return None


def _julia_version(exe: str) -> str | None:
    """`julia --version` -> "1.10.4", or None when `exe` is not a working Julia (10 s at most)."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    words = out.strip().split()
    if len(words) >= 3 and words[0].lower() == "julia" and words[1].lower() == "version":
        return words[2]
    return None


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split("-")[0].split("+")[0].split("."):
        if not p.isdigit():
            break
        parts.append(int(p))
    return tuple(parts)


def _juliaup_julia() -> str | None:
    """A Julia installed by juliaup (read from its juliaup.json, as juliapkg does)."""
    depot = os.environ.get("JULIAUP_DEPOT_PATH") or os.path.join(os.path.expanduser("~"), ".julia")
    meta = os.path.join(depot, "juliaup", "juliaup.json")
    try:
        with open(meta, encoding="utf-8") as f:
            installed = json.load(f).get("InstalledVersions", {})
    except (OSError, ValueError):
        return None
    for info in installed.values():
        rel = info.get("BinaryPath") or (os.path.join(info["Path"], "bin", "julia") if "Path" in info else None)
        if rel:
            exe = os.path.abspath(os.path.join(depot, "juliaup", rel))
            if os.path.isfile(exe) and os.access(exe, os.X_OK):
                return exe
    return None


def find_julia() -> tuple[str | None, str | None]:
    """(executable, where it was found) in juliapkg's and juliacall's order, or (None, None)."""
    for var in ("PYTHON_JULIACALL_EXE", "PYTHON_JULIAPKG_EXE"):
        value = os.environ.get(var)
        if value:
            exe = shutil.which(value)
            return (exe, var) if exe else (None, f"{var}={value} (not an executable)")
    state = _juliapkg_state()
    if state is not None:
        try:
            with open(state["meta"], encoding="utf-8") as f:
                exe = json.load(f).get("executable")
            if exe and os.path.isfile(exe):
                return exe, "juliapkg (resolved before)"
        except (OSError, ValueError, KeyError):
            pass
        exe = shutil.which(os.path.join(state["install"], "bin", "julia"))
        if exe:
            return exe, "juliapkg's own install"
    exe = _juliaup_julia()
    if exe:
        return exe, "juliaup"
    exe = shutil.which("julia")
    if exe:
        return exe, "PATH"
    return None, None


def network_reachable(host_port: tuple[str, int], timeout: float = NETWORK_TIMEOUT_S) -> bool:
    """A TCP connect to host:port within `timeout` seconds (DNS included, hence the thread)."""
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection(host_port, timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return bool(result and result[0])


def _manifest_versions(project: str | None) -> dict[str, str]:
    """Versions of the Julia packages that matter here, read from the environment's Manifest.toml."""
    if not project:
        return {}
    path = Path(project) / "Manifest.toml"
    try:
        with open(path, "rb") as f:
            manifest = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    deps = manifest.get("deps", manifest)  # format 2.0 nests under [deps]
    out = {}
    for name in ("PythonCall", "Flux", "NNlib", "Optimisers", "Zygote", "OneHotArrays", "CUDA", "cuDNN",
                 "SpecialFunctions", PACKAGE):
        entries = deps.get(name)
        if isinstance(entries, list) and entries:
            out[name] = str(entries[0].get("version", "dev" if "path" in entries[0] else "?"))
    return out


def _bypass() -> bool:
    """juliacall told to skip juliapkg: PYTHON_JULIACALL_EXE and PYTHON_JULIACALL_PROJECT both set."""
    return bool(os.environ.get("PYTHON_JULIACALL_EXE") and os.environ.get("PYTHON_JULIACALL_PROJECT"))


def _juliapkg_meta() -> dict:
    """juliapkg's record of its last resolve (empty when it never resolved)."""
    state = _juliapkg_state()
    if state is None:
        return {}
    try:
        with open(state["meta"], encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError, KeyError):
        return {}
    return meta if isinstance(meta, dict) else {}


def environment_resolved() -> bool:
    """Whether the Julia environment was installed before (so starting Julia needs no network)."""
    if _bypass():
        return PACKAGE in _manifest_versions(os.environ.get("PYTHON_JULIACALL_PROJECT"))
    return bool(_juliapkg_meta())


def julia_status(probe_network: bool = True) -> dict[str, Any]:
    """What the flux backend would use, found without starting Julia (for `harness doctor`)."""
    status: dict[str, Any] = {
        "juliacall": _version_of("juliacall") if importlib.util.find_spec("juliacall") else None,
        "juliapkg": _version_of("juliapkg") if importlib.util.find_spec("juliapkg") else None,
    }
    exe, source = find_julia()
    status.update(julia_exe=exe, julia_source=source, julia_version=_julia_version(exe) if exe else None)
    bypass = _bypass()
    state = _juliapkg_state()
    project = os.environ.get("PYTHON_JULIACALL_PROJECT") if bypass else (state or {}).get("project")
    meta = {} if bypass else _juliapkg_meta()
    versions = _manifest_versions(project)
    status.update(
        project=project,
        project_from="PYTHON_JULIACALL_PROJECT" if bypass else "juliapkg",
        offline=bool(state and state.get("offline")),
        resolved=environment_resolved(),
        package_registered=any(p.get("name") == PACKAGE for p in meta.get("pkgs", [])) or PACKAGE in versions,
        installed=versions,
        package_path=str(package_path()) if package_path() else None,
        network=None,
    )
    if probe_network and not status["resolved"]:
        host = JULIA_PKG_SERVER if exe else JULIA_DOWNLOAD_HOST
        status["network"] = network_reachable(host)
    return status


def unavailable_reason(device: str = "cpu") -> str | None:
    """One line saying why the flux backend cannot run here and how to fix it, or None. Fast; writes nothing."""
    if device not in ("cpu", "cuda"):
        return f"flux backend: unknown device {device!r}; use cpu or cuda"
    if importlib.util.find_spec("juliacall") is None or importlib.util.find_spec("juliapkg") is None:
        return ("flux backend: the Python package juliacall is not installed; "
                "run `pip install juliacall` (a dependency of nanogpt-parity)")
    if package_path() is None:
        return (f"flux backend: the Julia package {PACKAGE} is missing from this installation "
                "(expected harness/_julia/NanoGPTFlux or julia/NanoGPTFlux); reinstall nanogpt-parity")
    if device == "cuda" and not gpu_seen():  # CUDA.jl decides the rest later
        return f"flux backend: --device cuda but {NO_GPU}"
    if bool(os.environ.get("PYTHON_JULIACALL_EXE")) != bool(os.environ.get("PYTHON_JULIACALL_PROJECT")):
        return ("flux backend: PYTHON_JULIACALL_EXE and PYTHON_JULIACALL_PROJECT must be set together "
                "(juliacall refuses one alone); set both or neither")
    state = _juliapkg_state()
    if state is None and not os.environ.get("PYTHON_JULIACALL_EXE"):
        return f"flux backend: {juliapkg_problem() or 'juliapkg cannot read its settings'}"
    exe, source = find_julia()
    if exe is None and source is not None:  # an override that points nowhere
        return f"flux backend: {source}; point it at a Julia 1.10+ executable or unset it"
    offline = bool(state and state.get("offline"))
    if exe is not None:
        version = _julia_version(exe)
        if version is None:
            return f"flux backend: {exe} (from {source}) is not a working Julia executable; {SETUP_HINT}"
        if _version_tuple(version) < (1, 10) and (offline or not network_reachable(JULIA_DOWNLOAD_HOST)):
            return (f"flux backend: Julia {version} at {exe} is older than 1.10 and there is no network to "
                    f"install a newer one; {SETUP_HINT}")
        if not environment_resolved() and not offline and not network_reachable(JULIA_PKG_SERVER):
            return (f"flux backend: Julia {version} found at {exe} but its packages (Flux, CUDA, ...) are not "
                    "installed and there is no network to install them; run `harness setup julia` on a machine "
                    "with internet (or set PYTHON_JULIAPKG_OFFLINE=yes if they are already in the depot)")
        return None
    if offline:
        return ("flux backend: no Julia found and PYTHON_JULIAPKG_OFFLINE=yes forbids installing one; "
                "install Julia 1.10+ and set PYTHON_JULIAPKG_EXE=/path/to/julia")
    if not network_reachable(JULIA_DOWNLOAD_HOST):
        return f"flux backend: no Julia found and no network to install one; {SETUP_HINT}"
    return None


# --------------------------------------------------------------------------------------------------------------
# Starting Julia
# --------------------------------------------------------------------------------------------------------------

def register_package() -> Path:
    """Make juliapkg develop NanoGPTFlux from where it lies now (rewrites the entry only when it changed)."""
    path = package_path()
    if path is None:
        raise BackendUnavailable(unavailable_reason() or f"flux backend: {PACKAGE} not found")
    if _bypass():
        return path  # juliacall bypasses juliapkg: that project must already develop NanoGPTFlux
    import juliapkg
    from juliapkg.deps import load_cur_deps

    uuid = package_uuid(path)
    wanted = {"uuid": uuid, "dev": True, "path": str(path)}
    current = load_cur_deps().get("packages", {}).get(PACKAGE)
    if current != wanted:
        juliapkg.add(PACKAGE, uuid=uuid, dev=True, path=str(path))
    return path


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


_JL: Any = None


def load_julia() -> Any:
    """Start Julia (juliacall), load NanoGPTFlux and return juliacall's Main. Installs on the first run."""
    global _JL
    if _JL is not None:
        return _JL
    register_package()
    if "juliacall" not in sys.modules and not _bypass():
        try:
            import juliapkg

            if not juliapkg.resolve(dry_run=True):
                print("flux backend: first run: installing and precompiling the Julia packages (Flux, CUDA, ...), "
                      "this takes several minutes; `harness setup julia` does it ahead of time", file=sys.stderr)
        except Exception:  # the import below reports the real problem
            pass
    try:
        from juliacall import Main as jl  # noqa: N813 - juliacall's documented spelling
    except Exception as exc:  # URLError, CalledProcessError, "could not find Julia", ...
        raise BackendUnavailable(f"flux backend: starting Julia failed ({_one_line(exc)}); "
                                 "run `harness setup julia` to see the full log") from exc
    try:
        jl.seval("Base.cumulative_compile_timing(true)")  # count compilation from here on
        jl.seval(f"using {PACKAGE}")
    except Exception as exc:  # juliacall.JuliaError
        raise BackendUnavailable(f"flux backend: `using {PACKAGE}` failed ({_one_line(exc)}); "
                                 "run `harness setup julia` to (re)install the Julia packages") from exc
    _JL = jl
    return jl


def _numpy(value: Any) -> np.ndarray:
    """A juliacall ArrayValue (a CPU Julia Array) as an owned NumPy array."""
    return np.array(value, copy=True)


def _pydict(value: Any) -> dict[str, Any]:
    """A juliacall DictValue as a Python dict with str keys (values as juliacall converted them)."""
    return {str(k): value[k] for k in value}


# --------------------------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------------------------

class FluxBackend:
    """nanoGPT in Flux.jl (Float32 throughout), through juliacall; see julia/NanoGPTFlux."""

    name = "flux"
    declaration: ClassVar[Declaration] = DECLARATION

    def __init__(self, dtype: str = "float32", tf32: bool = False, precision: str | None = None):
        if dtype != "float32":
            raise BackendUnavailable(f"flux backend: only dtype float32 is supported (got {dtype!r}); "
                                     "the NanoGPTFlux model is Float32 throughout, run it with --dtype float32")
        if precision not in (None, "fp32", "tf32"):
            raise BackendUnavailable(f"flux backend: precision must be fp32 or tf32, got {precision!r}")
        self.dtype = dtype
        self.tf32 = bool(tf32) or precision == "tf32"
        self._state: Any = None
        self._mod: Any = None
        self.device = "cpu"

    @classmethod
    def check_available(cls, device: str = "cpu") -> None:
        """Raise BackendUnavailable (one line: what is missing and the fix) within seconds; writes nothing."""
        reason = unavailable_reason(device)
        if reason:
            raise BackendUnavailable(reason)

    @classmethod
    def check_installed(cls, device: str = "cpu") -> None:
        """check_available, and also refuse where Julia or the Flux packages would first be downloaded: what
        `--backend all` asks of a backend (it never starts a download)."""
        if find_julia()[0] is None or not environment_resolved():  # local checks first: no network probe
            raise BackendUnavailable("flux backend: Julia and the Flux packages are not installed here (`harness "
                                     "setup julia` installs them)")
        cls.check_available(device)

    # --- setup -------------------------------------------------------------------------------------------------
    def setup(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str,
              seed: int) -> None:
        self.check_available(device)
        jl = load_julia()
        self._jl, self._mod, self.device = jl, jl.NanoGPTFlux, device
        cfg = self._jdict({
            "vocab_size": int(vocab_size), "n_embd": config.n_embd, "n_head": config.n_head,
            "n_layer": config.n_layer, "block_size": config.block_size, "d_hidden": config.d_hidden,
            "dropout": float(config.dropout), "learning_rate": float(config.learning_rate),
            "weight_decay": float(config.weight_decay), "beta1": float(config.beta1), "beta2": float(config.beta2),
            "eps": float(config.eps), "grad_clip": float(config.grad_clip), "seed": int(seed),
            "device": device, "tf32": self.tf32, "gc_every": GC_EVERY,
            # the model options (harness.config.OPTION_DEFAULTS); which parameters exist follows from them
            "tie_embeddings": bool(config.tie_embeddings), "gelu": config.gelu, "bias": bool(config.bias),
            "lm_head_bias": bool(config.lm_head_bias), "attn_dropout": bool(config.attn_dropout),
            # which parameters AdamW decays: harness/core/weights.py decides, Julia only reads the list
            "decay": ",".join(name for name, w in weights.items()
                              if decays(name, tuple(np.shape(w)), config.decay)),
        })
        try:
            self._state = self._mod.build(cfg, self._jdict(to_flux(weights)))
        except Exception as exc:  # juliacall.JuliaError
            if device == "cuda" and "CUDA.functional" in str(exc):
                raise BackendUnavailable("flux backend: --device cuda but CUDA.jl finds no usable GPU "
                                         "(CUDA.functional() is false); use --device cpu") from exc
            raise

    def _jdict(self, items: dict[str, Any]) -> Any:
        """A Julia Dict{String,Any}; NumPy arrays arrive as zero-copy PyArrays (Julia copies them)."""
        d = self._jl.seval("Dict{String,Any}")()
        for k, v in items.items():
            d[k] = v
        return d

    # --- training ----------------------------------------------------------------------------------------------
    def _masks(self, masks: dict[str, np.ndarray] | None) -> tuple[Any, ...]:
        """() without masks, else (a Julia Dict of the Flux-layout keep-masks,): the optional last argument."""
        return () if masks is None else (self._jdict(masks_to_flux(masks)),)

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float,
                   masks: dict[str, np.ndarray] | None = None) -> float:
        """One step; `masks` (harness.core.masks: bool (B, T, C), at the attention probabilities (B, H, T, T))
        replace the model's own dropout when given."""
        return float(self._mod.train_step_b(self._state, tokens_to_flux(x), tokens_to_flux(y), float(lr),
                                            *self._masks(masks)))

    def losses_to_floats(self, losses: list[Any]) -> list[float]:
        return [float(v) for v in losses]

    def synchronize(self) -> None:
        self._mod.synchronize(self._state)

    # --- inspection --------------------------------------------------------------------------------------------
    def eval_loss(self, x: np.ndarray, y: np.ndarray) -> float:
        return float(self._mod.eval_loss(self._state, tokens_to_flux(x), tokens_to_flux(y)))

    def logits(self, x: np.ndarray, last_only: bool = False) -> np.ndarray:
        out = logits_from_flux(_numpy(self._mod.logits(self._state, tokens_to_flux(x))))
        return out[:, -1:, :] if last_only else out

    def gradients(self, x: np.ndarray, y: np.ndarray,
                  masks: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Gradients, no clipping, no update; dropout off, or exactly the harness's `masks` when given."""
        g = self._mod.gradients(self._state, tokens_to_flux(x), tokens_to_flux(y), *self._masks(masks))
        return from_flux({k: _numpy(v) for k, v in _pydict(g).items()})

    def taps(self, x: np.ndarray, masks: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The named intermediate activations (harness/core/taps.py) of NanoGPTFlux's forward pass, canonical layout;
        dropout off except at the sites of the harness's `masks` (relayed in the Flux layout, as to `gradients`)."""
        t = self._mod.taps(self._state, tokens_to_flux(x), *self._masks(masks))
        return taps_from_flux({k: _numpy(v) for k, v in _pydict(t).items()})

    def parameters(self) -> dict[str, np.ndarray]:
        return from_flux({k: _numpy(v) for k, v in _pydict(self._mod.parameters(self._state)).items()})

    def memory(self) -> dict[str, Any]:
        """CPU: the process's peak RSS. CUDA: the CUDA.jl pool's high-water mark of bytes in use, which counts
        garbage Julia has not collected yet (GC.gc(false) runs after every `gc_every`-th step); the dict says so in
        "peak_bytes_meaning": an upper bound of the live-tensor peak torch's max_memory_allocated reports."""
        from harness.environment import peak_rss_bytes

        if self.device != "cuda":
            return {"kind": "rss", "peak_bytes": peak_rss_bytes()}
        stats = _pydict(self._mod.memory_stats(self._state))
        stats["rss_peak_bytes"] = peak_rss_bytes()
        return stats

    def reset_peak(self) -> None:
        """Reset the device's peak-memory counter (CUDA pool high-water marks)."""
        self._mod.reset_peak_b(self._state)

    def compile_time(self) -> dict[str, float]:
        """Julia's cumulative (re)compilation time in seconds since the bridge started Julia."""
        return {k: float(v) for k, v in _pydict(self._mod.compile_time()).items()}

    def describe(self) -> dict[str, Any]:
        info = _pydict(self._mod.describe(self._state))
        from harness.environment import cpu_model

        info.update(framework="flux", version=info.get("Flux"), device=self.device,
                    device_name=info.get("device") if self.device == "cuda" else cpu_model(),
                    dtype=self.dtype, precision="tf32" if self.tf32 else "fp32",
                    threads=info.get("blas_threads"), juliacall=_version_of("juliacall"))
        return info

    # --- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        out = {f"param/{k}": v for k, v in self.parameters().items()}
        opt = _pydict(self._mod.opt_state(self._state))
        step = int(opt.pop("adam_t"))
        out.update(from_flux({k: _numpy(v) for k, v in opt.items()}))
        out["adam_t"] = np.array(step, dtype=np.int64)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        params = {k[len("param/"):]: v for k, v in state.items() if k.startswith("param/")}
        self._mod.load_parameters_b(self._state, self._jdict(to_flux(params)))
        step = int(np.asarray(state["adam_t"]))
        moments = {k: v for k, v in state.items() if k.startswith(("adam_m/", "adam_v/"))}
        if not moments:
            if step > 0:
                raise ValueError("flux backend: the state has adam_t > 0 but no adam_m/ and adam_v/ arrays")
            params = self.parameters()  # no step taken yet: zero moments
            moments = {f"{kind}/{k}": np.zeros_like(v) for k, v in params.items() for kind in ("adam_m", "adam_v")}
        opt = self._jdict(to_flux(moments))
        opt["adam_t"] = step
        self._mod.load_opt_state_b(self._state, opt)
