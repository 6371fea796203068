"""The torch backend's options and the checks on them, importable without torch.

`harness run`, `parity`, `sweep` and `bench` check every backend's options in the parent before anything is written
(harness.run.plan.preflight). For torch that check needs no tensor: the dtype, precision and step-mode names, what
they need of the device, and whether CUDA is there. Keeping them here, apart from `harness.backends.torch_backend`
(which imports torch at once), spares the parent the import of torch (about 1.5 s of CPU per command) and keeps
torch's CUDA runtime out of the process that may coordinate a paired timing next. `TorchBackend` inherits these
checks, so they are written once. torch itself is imported only for a question only torch can answer (is there a
CUDA GPU, the capability where nvidia-smi cannot tell).
"""

from __future__ import annotations

from typing import ClassVar

from harness.backends.base import BackendUnavailable, cuda_fix
from harness.backends.declaration import COMPILE_MODES, Declaration
from harness.config.fields import OPTION_NAMES
from harness.environment import gpu_capability, gpu_seen
from harness.errors import UsageError

DTYPE_NAMES = ("float32", "float64")
PRECISIONS = ("fp32", "tf32", "bf16")
INSTALL = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu (or a CUDA build for "
           "--device cuda; README, Install)")
CUDA_INSTALL = "pip install torch==2.13.0 (PyPI's Linux wheel is the CUDA build)"  # the declaration's cuda_install
DECLARATION = Declaration(
    name="torch", dtypes=DTYPE_NAMES, devices=("cpu", "cuda"), precisions=PRECISIONS, compile_modes=COMPILE_MODES,
    options=frozenset({*OPTION_NAMES, "cuda_graphs", "parity"}),
    methods=frozenset({"gradients", "taps", "warm_up", "device_clock", "fetch_losses", "check_device", "parts"}),
    needs="PyTorch", install=INSTALL, cuda_install=CUDA_INSTALL, color="#d9480f",
    bare_loop="harness.backends.torch_bare:BareTorch", part_runner="harness.backends.torch_parts:TorchParts",
    doctor="harness.backends.torch_options:doctor_rows")
MIN_CAPABILITY = {"tf32": (8, 0), "bf16": (8, 0)}  # TF32 tensor cores and fast bf16 arrived with Ampere (sm80)


def compile_mode(value: object) -> str | None:
    """The torch.compile mode of the `compile` option: None (eager) for False/None; "default" for True (`--compile`
    alone, and records written before modes existed); else one of COMPILE_MODES (UsageError otherwise)."""
    if value is None or value is False:
        return None
    if value is True:
        return "default"
    if value not in COMPILE_MODES:
        raise UsageError(f"torch backend: --compile {value!r}: choose one of {', '.join(COMPILE_MODES)}")
    return str(value)


def check_precision(precision: str, device: str, capability: tuple[int, int] | None = None) -> None:
    """UsageError unless `precision` can run on `device`: tf32/bf16 need a CUDA GPU of compute capability 8.0+.
    `capability`: the GPU's, when the caller knows it (else torch is asked: in a worker, which holds a CUDA context
    anyway)."""
    need = MIN_CAPABILITY.get(precision)
    if need is None:
        return
    if device != "cuda":
        raise UsageError(f"torch backend: --precision {precision} needs a CUDA GPU (Ampere or newer); on the "
                         f"{device} use --precision fp32")
    if capability is None:
        import torch

        capability = torch.cuda.get_device_capability(0)
    cap = tuple(capability)
    if cap < need:
        raise UsageError(f"torch backend: --precision {precision} needs compute capability "
                         f"{need[0]}.{need[1]}+ (Ampere or newer), this GPU has {cap[0]}.{cap[1]}; "
                         "use --precision fp32")


class TorchOptions:
    """The torch backend's options, checked: what the parent's preflight instantiates, and what TorchBackend is
    built on."""

    name = "torch"
    declaration: ClassVar[Declaration] = DECLARATION

    def __init__(self, dtype: str = "float32", precision: str = "fp32", compile: bool | str = False,
                 parity: bool = False, cuda_graphs: bool = False):
        if dtype not in DTYPE_NAMES:
            raise UsageError(f"torch backend: dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
        if precision not in PRECISIONS:
            raise UsageError(f"torch backend: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if precision != "fp32" and dtype != "float32":
            raise UsageError("torch backend: --precision tf32/bf16 needs --dtype float32")
        self.dtype_name, self.precision, self.compile = dtype, precision, compile_mode(compile)
        if cuda_graphs and self.compile:
            raise UsageError(f"torch backend: --cuda-graphs captures the eager step and does not combine with "
                             f"--compile {self.compile} (torch.compile's own CUDA graphs are --compile "
                             "reduce-overhead); choose one")
        self.cuda_graphs = bool(cuda_graphs)
        self.parity = parity  # `harness parity`: single-tensor AdamW, math attention on CUDA

    def check_modes(self, device: str) -> None:
        """UsageError when the step's mode cannot run on `device`: CUDA graphs replay GPU work only, and
        reduce-overhead is torch.compile's CUDA graphs."""
        if self.cuda_graphs and device != "cuda":
            raise UsageError(f"torch backend: --cuda-graphs needs --device cuda (a CUDA graph replays GPU work); "
                             f"on the {device} drop --cuda-graphs")
        if self.compile == "reduce-overhead" and device != "cuda":
            raise UsageError(f"torch backend: --compile reduce-overhead is torch.compile with CUDA graphs and needs "
                             f"--device cuda; on the {device} use --compile or --compile max-autotune")

    def check_device(self, device: str) -> None:
        """UsageError when this configuration cannot run on `device` (tf32/bf16 on the CPU or before Ampere, CUDA
        graphs off CUDA). Called by the parent before anything is written: the GPU's compute capability comes from
        nvidia-smi, never from torch, so that the parent creates no CUDA context (it may coordinate a paired timing
        next; harness.backends.numpy_backend.cupy_ready_in_child says why that matters); where nvidia-smi cannot
        tell, the worker checks it with torch."""
        self.check_modes(device)
        if device == "cuda" and self.precision in MIN_CAPABILITY:
            capability = gpu_capability()
            if capability is not None:
                check_precision(self.precision, device, capability)
            return
        check_precision(self.precision, device)

    @classmethod
    def check_available(cls, device: str) -> None:
        """BackendUnavailable unless torch is installed and, for `--device cuda`, sees a CUDA GPU."""
        if device not in ("cpu", "cuda"):
            raise BackendUnavailable(f"torch backend: unknown device {device!r}; use cpu or cuda")
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            raise BackendUnavailable(f"torch backend: PyTorch is not installed; {INSTALL}")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise BackendUnavailable(f"torch backend: --device cuda but PyTorch sees no CUDA GPU (torch "
                                         f"{torch.__version__}); " + cuda_fix("use --device cpu, or install its "
                                                                            f"CUDA build: {CUDA_INSTALL}"))


# --- harness doctor -------------------------------------------------------------------------------------------
def torch_row() -> tuple[str, str, str]:
    """torch's version and whether --device cuda can work: a CPU-only build (torch.version.cuda is None) needs a
    CUDA build; a CUDA build that sees no GPU has a driver or device problem."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return ("torch", "missing", INSTALL)
    try:
        import torch

        built = getattr(torch.version, "cuda", None)
        if built is None:
            gpu_here = gpu_seen()
            return ("torch", f"{torch.__version__}, CPU-only build (no CUDA)",
                    f"a GPU is present: for --device cuda {CUDA_INSTALL}" if gpu_here else "")
        if not torch.cuda.is_available():
            return ("torch", f"{torch.__version__}, CUDA {built} build, but no usable GPU",
                    "the driver or the device is the problem: check `nvidia-smi` (a driver recent enough for "
                    f"CUDA {built}) and CUDA_VISIBLE_DEVICES")
        cap = torch.cuda.get_device_capability(0)
        return ("torch", f"{torch.__version__}, CUDA {built}: {torch.cuda.get_device_name(0)} "
                         f"(compute capability {cap[0]}.{cap[1]})",
                "" if tuple(cap) >= (8, 0) else "pre-Ampere GPU: --precision tf32/bf16 are refused, fp32 only")
    except Exception as exc:  # a broken install is reported, not raised
        return ("torch", f"broken ({type(exc).__name__}: {exc})", "reinstall torch")


def compile_row() -> tuple[str, str, str]:
    """What `--compile` needs: torch's Inductor compiles generated C++ (CPU) with a C/C++ compiler, and on CUDA
    Triton, which also builds a small C helper at first use."""
    import os
    import shutil
    from importlib.metadata import version

    compiler = os.environ.get("CXX") or os.environ.get("CC")
    compiler = shutil.which(compiler) if compiler else None
    compiler = compiler or next((p for p in map(shutil.which, ("g++", "c++", "clang++", "gcc", "cc", "clang")) if p),
                                None)
    try:
        triton: str | None = version("triton")
    except Exception:  # not installed, or broken metadata: not usable
        triton = None
    status = f"C compiler: {compiler or 'none'}; triton: {triton or 'not installed'}"
    if compiler is None:
        return ("--compile prerequisites", status, "install a C/C++ compiler (e.g. apt install g++) for torch.compile")
    return ("--compile prerequisites", status,
            "" if triton or not gpu_seen() else "for --compile on CUDA install triton (CUDA torch "
            "wheels bring it)")


def doctor_rows() -> list[tuple[str, str, str]]:
    """The torch backend's rows of `harness doctor`: torch and what --compile needs."""
    return [torch_row(), compile_row()]
