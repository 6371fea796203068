"""The PyTorch backend: python_impl.torch_gpt.GPT driven through the Backend protocol."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from harness.backends.base import BackendUnavailable
from harness.config import Config
from harness.environment import cpu_model, peak_rss_bytes
from harness.errors import UsageError
from harness.weights import decays
from python_impl.torch_gpt import GPT

DTYPES = {"float32": torch.float32, "float64": torch.float64}
PRECISIONS = ("fp32", "tf32", "bf16")


class TorchBackend:
    """nanoGPT in PyTorch: SDPA attention, AdamW with decay on >= 2-D weights, global-norm clipping."""

    name = "torch"

    def __init__(self, dtype: str = "float32", precision: str = "fp32", compile: bool = False):
        if dtype not in DTYPES:
            raise UsageError(f"torch backend: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if precision not in PRECISIONS:
            raise UsageError(f"torch backend: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if precision != "fp32" and dtype != "float32":
            raise UsageError("torch backend: --precision tf32/bf16 needs --dtype float32")
        self.dtype, self.precision, self.compile = DTYPES[dtype], precision, compile

    @classmethod
    def check_available(cls, device: str) -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable("torch backend: --device cuda but PyTorch sees no CUDA GPU "
                                     f"(torch {torch.__version__}); use --device cpu or install a CUDA build of torch")
        if device not in ("cpu", "cuda"):
            raise BackendUnavailable(f"torch backend: unknown device {device!r}; use cpu or cuda")

    # --- setup -------------------------------------------------------------------------------------------------
    def setup(self, config: Config, weights: dict[str, np.ndarray], vocab_size: int, device: str,
              seed: int) -> None:
        self.check_available(device)
        self.config, self.device = config, torch.device(device)
        torch.manual_seed(seed)  # the dropout stream
        # TF32 off unless asked for: parity needs plain fp32 matmuls on Ampere+ GPUs
        torch.backends.cuda.matmul.allow_tf32 = self.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = self.precision == "tf32"
        model = GPT(vocab_size, config.block_size, config.n_embd, config.n_layer, config.n_head,
                    config.d_hidden, config.dropout)
        model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}, strict=True)
        self.model = model.to(device=self.device, dtype=self.dtype)
        named = list(self.model.named_parameters())
        groups = [
            {"params": [p for n, p in named if decays(n, tuple(p.shape))], "weight_decay": config.weight_decay},
            {"params": [p for n, p in named if not decays(n, tuple(p.shape))], "weight_decay": 0.0},
        ]
        fused = self.device.type == "cuda"  # one kernel for the whole update on CUDA
        self.optimizer = torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.beta1, config.beta2),
                                           eps=config.eps, fused=fused)
        self.forward = torch.compile(self.model) if self.compile else self.model
        self._params = [p for _, p in named]  # for clipping: walking the module tree each step costs ~0.1 ms
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        if self._cuda:  # pinned host memory lets the copy overlap with queued GPU work
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # --- training ----------------------------------------------------------------------------------------------
    def _masks(self, masks: dict[str, np.ndarray] | None) -> dict[str, torch.Tensor] | None:
        """The harness's keep-masks as tensors of the model's dtype on its device (None: torch's own dropout)."""
        if masks is None:
            return None
        return {k: torch.from_numpy(np.asarray(m)).to(device=self.device, dtype=self.dtype) for k, m in masks.items()}

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float,
                   masks: dict[str, np.ndarray] | None = None) -> torch.Tensor | float:
        if not self.model.training:  # Module.train() walks every submodule: only when eval/logits/gradients left it
            self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self._autocast():
            _, loss = self.forward(self._tensor(x), self._tensor(y), self._masks(masks))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self._params, self.config.grad_clip)
        self.optimizer.step()
        # on CUDA the loss stays on the device (no sync per step); on the CPU reading it is free
        loss = loss.detach()
        return loss if self._cuda else float(loss)

    def losses_to_floats(self, losses: list[Any]) -> list[float]:
        if not losses or not isinstance(losses[0], torch.Tensor):
            return [float(v) for v in losses]
        return [float(v) for v in torch.stack(losses).double().cpu().tolist()]

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
    def logits(self, x: np.ndarray) -> np.ndarray:
        self.model.eval()
        with self._autocast():
            logits, _ = self.forward(self._tensor(x))
        return logits.float().cpu().numpy() if logits.dtype == torch.bfloat16 else logits.cpu().numpy()

    def gradients(self, x: np.ndarray, y: np.ndarray,
                  masks: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        self.model.eval()  # dropout off, unless the harness gives masks
        self.model.zero_grad(set_to_none=True)
        _, loss = self.model(self._tensor(x), self._tensor(y), self._masks(masks))
        loss.backward()
        grads = {n: p.grad.detach().cpu().numpy().copy() for n, p in self.model.named_parameters()}
        self.model.zero_grad(set_to_none=True)
        return grads

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
                "compile": self.compile, "threads": torch.get_num_threads(),
                "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32}
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
        step = int(state["adam_t"])
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(torch.from_numpy(np.asarray(state[f"param/{n}"])))
                if step > 0:
                    # torch keeps `step` on the CPU (or the device when fused)
                    self.optimizer.state[p] = {
                        "step": torch.tensor(float(step), dtype=torch.float32,
                                             device=self.device if self.optimizer.defaults.get("fused") else "cpu"),
                        "exp_avg": torch.from_numpy(np.asarray(state[f"adam_m/{n}"])).to(p),
                        "exp_avg_sq": torch.from_numpy(np.asarray(state[f"adam_v/{n}"])).to(p),
                    }
        torch.set_rng_state(torch.from_numpy(np.asarray(state["rng/torch"])))
        if self._cuda and "rng/cuda" in state:
            torch.cuda.set_rng_state(torch.from_numpy(np.asarray(state["rng/cuda"])), self.device)
