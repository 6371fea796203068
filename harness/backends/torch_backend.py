"""The PyTorch backend: harness.models.torch_gpt.GPT driven through the Backend protocol.

Three ways to run a training step: eager (the default: one kernel launch per operation, as nanoGPT), `--compile
[MODE]` (torch.compile of the model, MODE default, reduce-overhead or max-autotune, compiled before step 0) and, on
CUDA, `--cuda-graphs`: the whole step (forward, backward, clipping, AdamW) captured once as a CUDA graph and
replayed with one launch (harness.backends.torch_step; docs/benchmarks.md says why this and not reduce-overhead).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from harness.backends.torch_options import TorchOptions, check_precision
from harness.backends.torch_step import CudaGraphCapture, PinnedBatches, StaticStep
from harness.config.fields import Config
from harness.core.weights import decays
from harness.environment import cpu_model, peak_rss_bytes
from harness.models.torch_gpt import GPT

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A batch as int64 on `device`: the copy every training step makes (runner and bench floor alike).

    On CUDA the host tensor is pinned first, so the host-to-device copy is asynchronous (non_blocking) and overlaps
    with the work already queued.
    """
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def build_model(config: Config, weights: dict[str, np.ndarray], vocab_size: int) -> GPT:
    """harness.models.torch_gpt.GPT of `config` (its model options) holding the canonical `weights` (float32, CPU).

    Tied embeddings: state_dict() lists the one shared matrix under both names, so it is loaded under both."""
    model = GPT(vocab_size, config.block_size, config.n_embd, config.n_layer, config.n_head, config.d_hidden,
                config.dropout, bias=config.bias, lm_head_bias=config.lm_head_bias,
                tie_embeddings=config.tie_embeddings, gelu=config.gelu, attn_dropout=config.attn_dropout)
    state = {k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}
    if config.tie_embeddings and "wte.weight" in state:
        state["lm_head.weight"] = state["wte.weight"]
    model.load_state_dict(state, strict=True)
    return model


def adamw_groups(model: torch.nn.Module, config: Config) -> list[dict]:
    """AdamW's two groups, as nanoGPT's configure_optimizers: decayed parameters (harness.core.weights.decays with the
    config's convention) and the rest, each in named_parameters() order (a tied matrix once)."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if decays(n, tuple(p.shape), config.decay)],
             "weight_decay": config.weight_decay},
            {"params": [p for n, p in named if not decays(n, tuple(p.shape), config.decay)], "weight_decay": 0.0}]


def adamw_flags(device_type: str, parity: bool, graphs: bool = False) -> dict[str, bool]:
    """AdamW implementation flags: fused on CUDA for speed; in parity mode the single-tensor loop on every device
    (the fused kernel computes the bias corrections in float32 and orders the operations differently from the
    reference it is compared with). With `graphs` (a captured step) on CUDA also `capturable=True`: the step count
    and the bias corrections stay on the device (no host value baked into the graph), and AdamW refuses a capture
    without it."""
    flags = {"fused": False, "foreach": False} if parity else ({"fused": True} if device_type == "cuda" else {})
    if graphs and device_type == "cuda":
        flags["capturable"] = True
    return flags


def attention_kernels(device_type: str, parity: bool) -> list | None:
    """SDPA kernels allowed: None = torch's choice; in parity mode on CUDA the math kernel only (the fp32
    memory-efficient kernel on sm80+ may use 3xTF32 matmuls). On the CPU torch's choice is kept: the parity
    tolerances in docs/parity.md were measured with it."""
    if parity and device_type == "cuda":
        from torch.nn.attention import SDPBackend

        return [SDPBackend.MATH]
    return None


def reset_device_memory(device: torch.device) -> None:
    """Return cached blocks to the driver, then reset the peak counters: in one process (bench) the previous
    configuration's cached blocks would otherwise count in this one's reserved peak."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class CudaEventClock:
    """Step timing with CUDA events on the current stream: recorded without a sync, read after one."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_s(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # complete already after the flush's sync; cheap then
        return start.elapsed_time(end) / 1e3


class TorchBackend(TorchOptions):
    """nanoGPT in PyTorch: SDPA attention (its dropout_p with attention dropout), AdamW with decay on >= 2-D weights,
    global-norm clipping. Its options and their checks are TorchOptions' (harness.backends.torch_options)."""

    def __init__(self, dtype: str = "float32", precision: str = "fp32", compile: bool | str = False,
                 parity: bool = False, cuda_graphs: bool = False):
        super().__init__(dtype, precision, compile, parity, cuda_graphs)
        self.dtype = DTYPES[dtype]
        # built once before step 0 by warm_up() (harness.run.loop.warm_up): torch.compile's graphs, or the captured
        # step (in parity mode the capture waits for the first step, which may bring dropout masks)
        self.needs_warm_up = bool(self.compile) or (self.cuda_graphs and not parity)
        self.step: StaticStep | None = None  # the captured step (--cuda-graphs)
        self.batches: PinnedBatches | None = None  # the eager step's batch staging on CUDA

    # --- setup -------------------------------------------------------------------------------------------------
    def setup(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str,
              seed: int) -> None:
        self.check_available(device)
        self.check_modes(device)
        check_precision(self.precision, device)
        self.config, self.device = config, torch.device(device)
        torch.manual_seed(seed)  # the dropout stream
        # TF32 off unless asked for: parity needs plain fp32 matmuls on Ampere+ GPUs
        torch.backends.cuda.matmul.allow_tf32 = self.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = self.precision == "tf32"
        model = build_model(config, weights, vocab_size)
        self.model = model.to(device=self.device, dtype=self.dtype)
        named = list(self.model.named_parameters())
        graphs = self.cuda_graphs
        # with a captured step the rate is a device tensor the graph reads, refilled before each replay
        lr = StaticStep.make_lr(config.learning_rate, self.dtype, self.device) if graphs else config.learning_rate
        self.optimizer = torch.optim.AdamW(adamw_groups(self.model, config), lr=lr,
                                           betas=(config.beta1, config.beta2),
                                           eps=config.eps, **adamw_flags(self.device.type, self.parity, graphs))
        self._kernels = attention_kernels(self.device.type, self.parity)
        self.forward = torch.compile(self.model, mode=self.compile) if self.compile else self.model
        self._params = [p for _, p in named]  # for clipping: walking the module tree each step costs ~0.1 ms
        self._cuda = self.device.type == "cuda"
        shape = (config.batch_size, config.block_size)
        if graphs:
            self.step = StaticStep(self.model, self.optimizer, self._params, lr, config.grad_clip, shape,
                                   self.device, self._autocast, capture=CudaGraphCapture())
        elif self._cuda:
            self.batches = PinnedBatches(shape, self.device)
        reset_device_memory(self.device)

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return to_device(a, self.device)

    def _batch(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A training batch on the device: through the pinned ring on CUDA (one asynchronous copy of both), as is
        on the CPU. A batch of another shape than the config's (none in the harness) takes the plain copy."""
        if self.batches is not None and tuple(np.shape(x)) == self.batches.shape:
            both = self.batches(x, y)
            return both[0], both[1]
        return self._tensor(x), self._tensor(y)

    def _attention(self) -> contextlib.AbstractContextManager:
        """The SDPA kernel restriction of parity mode on CUDA (math only); nothing otherwise."""
        if self._kernels is None:
            return contextlib.nullcontext()
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(self._kernels)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self._kernels is None and self.precision != "bf16":
            return contextlib.nullcontext()  # the common case: nothing to enter, every step
        stack = contextlib.ExitStack()
        stack.enter_context(self._attention())
        if self.precision == "bf16":
            # a captured step keeps no autocast weight cache across its capture (torch.cuda.graphs asks the same of
            # make_graphed_callables); each weight is cast once per forward anyway, so nothing is cast twice
            stack.enter_context(torch.autocast(device_type=self.device.type, dtype=torch.bfloat16,
                                               cache_enabled=not self.cuda_graphs))
        return stack

    def device_clock(self) -> CudaEventClock | None:
        """CUDA events for the runner's step times (no sync per step); None on the CPU (host clock)."""
        return CudaEventClock() if self._cuda else None

    def warm_up(self, x: np.ndarray, y: np.ndarray) -> bool:
        """With --compile, build the compiled evaluation and training graphs once, before step 0: a no-grad forward
        in eval mode and a forward + backward in train mode on (x, y). With --cuda-graphs, capture the step
        (StaticStep.prepare: warm-up steps undone in place, then the capture). No parameter, optimizer or RNG state
        changes (gradients are dropped, the dropout generators restored). Returns False when there is nothing to
        do."""
        if not self.needs_warm_up:
            return False
        if self.step is not None:
            self.model.train()
            self.step.prepare(x, y, self.config.learning_rate)
            self.synchronize()
            self.needs_warm_up = False
            return True
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self._cuda else None
        tx, ty = self._tensor(x), self._tensor(y)
        with torch.no_grad(), self._autocast():
            self.model.eval()
            self.forward(tx, ty)
        self.model.train()
        with self._autocast():
            _, loss = self.forward(tx, ty)
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        self.synchronize()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, self.device)
        self.needs_warm_up = False
        return True

    # --- training ----------------------------------------------------------------------------------------------
    def _masks(self, masks: dict[str, np.ndarray] | None) -> dict[str, torch.Tensor] | None:
        """The harness's keep-masks as tensors of the model's dtype on its device (None: torch's own dropout)."""
        if masks is None:
            return None
        return {k: torch.from_numpy(np.asarray(m)).to(device=self.device, dtype=self.dtype) for k, m in masks.items()}

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float,
                   masks: dict[str, np.ndarray] | None = None) -> torch.Tensor | float | int:
        """One step. On CUDA the loss stays on the device (no sync per step): a tensor, or with --cuda-graphs the
        step's token (its slot in the captured step's loss ring); on the CPU a float (reading it is free)."""
        if not self.model.training:  # Module.train() walks every submodule: only when eval/logits/gradients left it
            self.model.train()
        if self.step is not None:
            return self.step(x, y, lr, masks)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: the previous one's graph outputs may go
        tx, ty = self._batch(x, y)
        with self._autocast():
            _, loss = self.forward(tx, ty, self._masks(masks))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self._params, self.config.grad_clip)
        self.optimizer.step()
        loss = loss.detach()
        if self.compile == "reduce-overhead":
            loss = loss.clone()  # a CUDA-graph output is overwritten by the next replay
        return loss if self._cuda else float(loss)

    def losses_to_floats(self, losses: list[Any]) -> list[float]:
        if not losses:
            return []
        if self.step is not None and isinstance(losses[0], int):
            return self.step.read(losses)
        if not isinstance(losses[0], torch.Tensor):
            return [float(v) for v in losses]
        return [float(v) for v in torch.stack(losses).double().cpu().tolist()]

    def fetch_losses(self, losses: list[Any]) -> Callable[[], list[float]]:
        """Start fetching `losses` (what train_step returned) without waiting for the device; the function returned
        waits and gives them as floats. The runner calls it a flush later (harness.run.loop.StepTimer), so by then
        the copy has long completed and the GPU never drains its queue for a flush."""
        if self.step is not None and losses and isinstance(losses[0], int):
            return self.step.fetch(losses)
        if not losses or not isinstance(losses[0], torch.Tensor) or not losses[0].is_cuda:
            values = self.losses_to_floats(losses)
            return lambda: values
        device_values = torch.stack(losses)
        host = torch.empty(device_values.shape, dtype=device_values.dtype, pin_memory=True)
        host.copy_(device_values, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def result() -> list[float]:
            done.synchronize()
            return [float(v) for v in host.tolist()]

        return result

    def synchronize(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)

    # --- inspection --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, x: np.ndarray, y: np.ndarray) -> float:
        self.model.eval()
        with self._autocast():
            _, loss = self.forward(self._tensor(x), self._tensor(y))
        return float(loss)

    @torch.no_grad()
    def logits(self, x: np.ndarray, last_only: bool = False) -> np.ndarray:
        """(B, T, V) logits; with `last_only` (B, 1, V), the last position only: generation copies just that to
        the host per token."""
        self.model.eval()
        with self._autocast():
            logits, _ = self.forward(self._tensor(x))
        if last_only:
            logits = logits[:, -1:, :]
        return logits.float().cpu().numpy() if logits.dtype == torch.bfloat16 else logits.cpu().numpy()

    def gradients(self, x: np.ndarray, y: np.ndarray,
                  masks: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        self.model.eval()  # dropout off, unless the harness gives masks
        self.model.zero_grad(set_to_none=True)
        with self._attention():
            _, loss = self.model(self._tensor(x), self._tensor(y), self._masks(masks))
        loss.backward()
        grads = {n: p.grad.detach().cpu().numpy().copy() for n, p in self.model.named_parameters()}
        self.model.zero_grad(set_to_none=True)
        return grads

    @torch.no_grad()
    def taps(self, x: np.ndarray, masks: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The named intermediate activations of the forward pass of `x` (harness/core/taps.py), canonical layout;
        dropout off except at the sites of the harness's `masks` (applied as in `gradients`); the eager model (not
        torch.compile), with parity's attention kernels."""
        self.model.eval()
        taps: dict[str, torch.Tensor] = {}
        with self._attention():
            self.model(self._tensor(x), masks=self._masks(masks), taps=taps)
        return {n: (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy().copy() for n, t in taps.items()}

    def parameters(self) -> dict[str, np.ndarray]:
        return {n: p.detach().cpu().numpy().copy() for n, p in self.model.named_parameters()}

    def memory(self) -> dict[str, Any]:
        if self._cuda:
            return {"kind": "device", "peak_bytes": int(torch.cuda.max_memory_allocated(self.device)),
                    "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(self.device)),
                    "rss_peak_bytes": peak_rss_bytes()}
        return {"kind": "rss", "peak_bytes": peak_rss_bytes()}

    def describe(self) -> dict[str, Any]:
        info = {"framework": "pytorch", "version": torch.__version__, "device": self.device.type,
                "dtype": str(self.dtype).replace("torch.", ""), "precision": self.precision,
                "compile": self.compile or False, "cuda_graphs": self.cuda_graphs,
                "step": ("one CUDA graph per step (forward, backward, clipping, AdamW)" if self.cuda_graphs else
                         f"torch.compile, mode {self.compile}" if self.compile else "eager"),
                "threads": torch.get_num_threads(),
                "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
                "parity_mode": self.parity,
                "adamw": "fused" if self.optimizer.defaults.get("fused") else
                ("foreach" if self.optimizer.defaults.get("foreach") else "single-tensor"),
                "adamw_capturable": bool(self.optimizer.defaults.get("capturable")),
                "sdpa_kernels": [k.name for k in self._kernels] if self._kernels else "torch's choice",
                "step_timing": "cuda events" if self._cuda else "host clock"}
        if self._cuda:
            props = torch.cuda.get_device_properties(self.device)
            info.update(device_name=props.name, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                        device_memory_bytes=props.total_memory)
        else:
            info["device_name"] = cpu_model()
        return info

    # --- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        step = 0
        for n, p in self.model.named_parameters():
            out[f"param/{n}"] = p.detach().cpu().numpy().copy()
            st = self.optimizer.state.get(p)
            if st:
                out[f"adam_m/{n}"] = st["exp_avg"].cpu().numpy().copy()
                out[f"adam_v/{n}"] = st["exp_avg_sq"].cpu().numpy().copy()
                step = int(st["step"])
        out["adam_t"] = np.array(step, dtype=np.int64)
        out["rng/torch"] = torch.get_rng_state().numpy().copy()
        if self._cuda:
            out["rng/cuda"] = torch.cuda.get_rng_state(self.device).numpy().copy()
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore what `state_dict` returned; also a state without RNG (another backend's, harness parity's
        re-synchronised optimizer depth), and at adam_t 0 the optimizer state before any step (no moments)."""
        step = int(state["adam_t"])
        on_device = self.optimizer.defaults.get("fused") or self.optimizer.defaults.get("capturable")
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(torch.from_numpy(np.asarray(state[f"param/{n}"])))
                st = self.optimizer.state.get(p)
                if st:
                    # in place: a captured step (--cuda-graphs) keeps the addresses of these tensors; at adam_t 0
                    # zeros, which is what AdamW's lazy initialisation creates before its first step
                    st["step"].fill_(float(step))
                    for key, part in (("exp_avg", "adam_m/"), ("exp_avg_sq", "adam_v/")):
                        if step == 0:
                            st[key].zero_()
                        else:
                            st[key].copy_(torch.from_numpy(np.asarray(state[part + n])))
                elif step > 0:
                    # torch keeps `step` on the CPU (or the device when fused or capturable)
                    self.optimizer.state[p] = {
                        "step": torch.tensor(float(step), dtype=torch.float32,
                                             device=self.device if on_device else "cpu"),
                        # copies: a float64 array of the same dtype would otherwise be shared, and updated in place
                        "exp_avg": torch.from_numpy(np.asarray(state[f"adam_m/{n}"])).to(p, copy=True),
                        "exp_avg_sq": torch.from_numpy(np.asarray(state[f"adam_v/{n}"])).to(p, copy=True),
                    }
        if "rng/torch" in state:
            torch.set_rng_state(torch.from_numpy(np.asarray(state["rng/torch"])))
        if self._cuda and "rng/cuda" in state:
            torch.cuda.set_rng_state(torch.from_numpy(np.asarray(state["rng/cuda"])), self.device)
