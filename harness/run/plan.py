"""What a run will do, checked before anything is written: the Plan, the memory estimate from the shapes, and spec.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from harness.backends import check_backend, check_names, declaration
from harness.config.fields import Config, check_seed
from harness.core.data import Corpus, check_fits
from harness.core.weights import count_parameters
from harness.environment import nvidia_smi
from harness.errors import UsageError
from harness.store import DataInfo, ParityOptions, RunLock, RunPaths, RunSpec, check_writable, os_error_message
from harness.store.paths import corpus_copy
from harness.store.writes import atomic_write_bytes
from harness.units import fmt_bytes, utc_now


@dataclass
class Plan:
    """One `harness run` for one config: what to train, with which backends, where to write."""

    config: Config
    corpus: Corpus
    backends: list[str]
    device: str = "cpu"
    seed: int = 1337
    out: Path = Path("reports")
    backend_options: dict[str, dict] = field(default_factory=dict)
    checkpoint_every: int = 0
    text: bool = True
    parity: ParityOptions | None = None  # `harness parity` (and the kit's export): the optimizer steps compared
    progress: bool = True
    threads: int | None = None
    allow_large: bool = False  # skip the memory-estimate refusal
    devices: dict[str, str] = field(default_factory=dict)  # per-backend devices (parity); others use `device`
    paired_rounds: int = 0  # undisturbed rounds of paired timing after training (two or more backends); 0: none
    probe_fix: str = "re-synchronise fewer optimizer steps (--opt-steps K)"  # what shrinks the parity probe

    def device_of(self, backend: str) -> str:
        """The device backend `backend` runs on."""
        return self.devices.get(backend, self.device)


# --- memory estimate ------------------------------------------------------------------------------------------
def float_bytes(backend: str, options: dict) -> int:
    """Bytes per float a backend computes in (its dtype option, else the default its declaration names)."""
    dtype = options.get("dtype") or declaration(backend).default_dtype
    return 8 if dtype == "float64" else 4


def estimate_memory(config: Config, corpus: Corpus, bytes_per_float: int = 4) -> dict[str, int]:
    """Bytes one worker needs, from the shapes alone (an estimate from above, not a measurement).

    parameters (+ gradients, + AdamW's two moments, + the float32 initial weights), activations kept for the
    backward pass (per layer: ~12 B*T*C for LayerNorms/qkv/projections/residuals/masks, 2 B*H*T*T attention
    scores and probabilities, and 2 more with attention dropout (the dropped probabilities and their mask), 3 B*T*d_h
    for the MLP; plus 3 B*T*V logits), the corpus ids, the fixed evaluation batches of both splits, and the per-step
    curves.
    """
    c, f = config, bytes_per_float
    B, T, C, L, H, Dh, V = c.batch_size, c.block_size, c.n_embd, c.n_layer, c.n_head, c.d_hidden, corpus.vocab_size
    n_params = count_parameters(c, V)
    attention = (4 if c.attn_dropout and c.dropout > 0 else 2) * B * H * T * T
    per_layer = 12 * B * T * C + attention + 3 * B * T * Dh
    n_train = len(corpus.train)
    steps = c.steps or c.epochs * max(1, ((n_train - 1) // T) // B)
    return {
        "parameters": n_params * (4 * f + 4),
        "activations": (L * per_layer + 4 * B * T * C + 3 * B * T * V) * f,
        "data": corpus.n_chars * 8 * 3 + 2 * c.eval_batches * 2 * B * T * 8,
        "curves": steps * 120,  # three Python floats per step, their CSV and JSON text
    }


def machine_memory() -> tuple[int, int]:
    """(total, available) bytes of RAM (MemTotal, MemAvailable), from /proc/meminfo or sysconf."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        total = int(info["MemTotal"].split()[0]) * 1024
        return total, int(info.get("MemAvailable", info["MemTotal"]).split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def gpu_memory() -> tuple[int, int] | None:
    """(total, free) bytes of the GPU a CUDA worker would use (the first visible one), from `nvidia-smi`; None when
    it cannot tell. Asked of nvidia-smi, not of a framework, so that the parent never creates a CUDA context."""
    values = nvidia_smi("memory.total,memory.free")
    try:
        total_mib, free_mib = (int(v) for v in values or ())
    except ValueError:
        return None
    return total_mib * 2**20, free_mib * 2**20


# what to change when a part of the estimate is the biggest (the fix of the refusal names the option that helps)
MEMORY_FIX = {"parameters": "make the model smaller (n_embd, n_layer, d_hidden)",
              "activations": "make the model or the batch smaller (batch_size, block_size, n_embd, n_layer)",
              "data": "make eval_batches smaller or train on a smaller text",
              "curves": "train fewer steps (a smaller --steps or --epochs)"}  # the parity probe's: Plan.probe_fix


def probe_bytes(config: Config, vocab_size: int, opt_steps: int) -> int:
    """What `harness parity`'s optimizer states take in one worker (harness/run/probe.py): parameters, m and v
    after each of `opt_steps` steps, in float64, in its own probe and, for the backend that re-synchronises, the
    reference's."""
    return 2 * opt_steps * 3 * 8 * count_parameters(config, vocab_size)


def memory_need(plan: Plan) -> tuple[int, dict[str, int]]:
    """(bytes, parts) one worker of `plan` needs: the estimate in the float width of its widest backend (and, in
    parity, its probe's optimizer states)."""
    per_float = max(float_bytes(b, plan.backend_options.get(b, {})) for b in plan.backends)
    parts = estimate_memory(plan.config, plan.corpus, per_float)
    opt_steps = plan.parity.opt_steps if plan.parity is not None else None
    if opt_steps:
        parts["parity probe"] = probe_bytes(plan.config, plan.corpus.vocab_size, opt_steps)
    return sum(parts.values()), parts


def check_memory(plan: Plan) -> int:
    """Refuse (UsageError) a run whose worker would not fit in this machine's memory, or in the GPU's when a backend
    runs on CUDA (parameters, optimizer state and activations live there); returns the estimate."""
    need, parts = memory_need(plan)
    if plan.paired_rounds and len(plan.backends) > 1:  # the paired timing holds every backend's worker at once
        need *= len(plan.backends)
        parts = {k: v * len(plan.backends) for k, v in parts.items()}
    biggest = max(parts, key=parts.get)
    what = plan.probe_fix if biggest == "parity probe" else MEMORY_FIX[biggest]
    fix = f"{what}, or pass --allow-large if you mean it"
    total, available = machine_memory()
    if need > available and not plan.allow_large:
        raise UsageError(f"config {plan.config.name!r} needs about {fmt_bytes(need)} of memory (mostly "
                         f"{biggest}: {fmt_bytes(parts[biggest])}) but this machine has {fmt_bytes(available)} "
                         f"available of {fmt_bytes(total)}; {fix}")
    on_gpu = [b for b in plan.backends if plan.device_of(b) == "cuda"]
    gpu = gpu_memory() if on_gpu and not plan.allow_large else None
    if gpu is not None:
        device_need = parts["parameters"] + parts["activations"]
        if device_need > gpu[1]:
            fix = f"{MEMORY_FIX['parameters' if parts['parameters'] > parts['activations'] else 'activations']}, " \
                  "or pass --allow-large if you mean it"
            raise UsageError(f"config {plan.config.name!r} needs about {fmt_bytes(device_need)} of GPU memory "
                             f"(parameters, AdamW state and activations) but the GPU has {fmt_bytes(gpu[1])} free of "
                             f"{fmt_bytes(gpu[0])}; {fix}")
    return need


# --- before anything is written -------------------------------------------------------------------------------
def preflight(plan: Plan) -> None:
    """Every check that can fail before training, so that a failure writes nothing."""
    check_names(plan.backends)
    if len(set(plan.backends)) != len(plan.backends):
        raise UsageError(f"backend listed twice in {', '.join(plan.backends)}; name each backend once")
    for device in {plan.device, *plan.devices.values()}:
        if device not in ("cpu", "cuda"):
            raise UsageError(f"unknown device {device!r}; use cpu or cuda")
    check_seed(plan.seed)
    plan.config.validate()
    check_fits(plan.corpus, plan.config.block_size, plan.config.batch_size)
    check_writable(plan.out)
    check_memory(plan)
    for name in plan.backends:  # what each declares and checks, never importing a framework (torch: TorchOptions)
        check_backend(name, plan.device_of(name), plan.backend_options.get(name, {}), plan.config.options())


def _copy_corpus(out: Path, corpus: Corpus) -> None:
    """Keep the validated corpus bytes in `<out>/data/<sha256>.txt` (once), for the workers and for resume."""
    target = corpus_copy(out, corpus.sha256)
    if target.is_file() and target.stat().st_size == len(corpus.raw):
        return
    blob = corpus.raw or Path(corpus.path).read_bytes()
    if hashlib.sha256(blob).hexdigest() != corpus.sha256:
        raise UsageError(f"data file {corpus.path!r} changed while the run was being prepared; run again")
    try:
        atomic_write_bytes(target, blob)
    except OSError:
        with contextlib.suppress(OSError):
            target.parent.rmdir()  # only if empty: leave nothing behind
        raise


def write_spec(plan: Plan) -> RunPaths:
    """Copy the corpus, create the run directory and its spec.json; returns the run's paths.

    A file-system error (full disk, read-only, ...) is a UsageError and leaves no run directory behind.
    """
    created: Path | None = None
    try:
        _copy_corpus(plan.out, plan.corpus)
        paths = RunPaths.new(Path(plan.out), plan.config.name)
        created = paths.dir
        c = plan.corpus
        spec = RunSpec(
            run_id=paths.run_id, label=plan.config.name, created_at=utc_now(), config=plan.config, seed=plan.seed,
            device=plan.device, devices={name: plan.device_of(name) for name in plan.backends},
            data=DataInfo(path=c.path, sha256=c.sha256, n_chars=c.n_chars, vocab_size=c.vocab_size, vocab=c.vocab,
                          bom_stripped=c.bom_stripped, line_endings=c.line_endings,
                          line_endings_changed=c.line_endings_changed),
            backends=plan.backends, backend_options=plan.backend_options, checkpoint_every=plan.checkpoint_every,
            text=plan.text, parity=plan.parity, threads=plan.threads, paired_rounds=plan.paired_rounds)
        with RunLock(paths):
            spec.dump(paths)
        return paths
    except OSError as exc:
        if created is not None:
            import shutil

            shutil.rmtree(created, ignore_errors=True)
        raise UsageError(os_error_message(exc, "cannot write the run")) from None

