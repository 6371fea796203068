"""The PyTorch nanoGPT of docs/design.md, after karpathy/nanoGPT's model.py.

By default biases on, an untied lm_head with a bias, tanh GELU and dropout at three sites (the harness's original
model); the options `bias`, `lm_head_bias`, `tie_embeddings`, `gelu="exact"` and `attn_dropout` give nanoGPT's own
(bias=False, no lm_head bias, tied, nn.GELU(), dropout on the attention probabilities too), with nanoGPT's operations
in nanoGPT's order (docs/nanogpt.md has the bitwise comparison).

Parameter names equal the harness's canonical names (harness/core/weights.py), so canonical weights load with
`load_state_dict` and gradients come back under the same names without any mapping.

`forward(idx, targets, masks)` takes optional dropout keep-masks drawn by the harness (harness/core/masks.py), so that
two backends drop the same activations in `harness parity --dropout P`; without them, nn.Dropout's own RNG, and at
the attention probabilities SDPA's `dropout_p` (its fused kernels; with a given mask the probabilities are written
out, as nanoGPT's non-flash path).
`forward(..., taps=dict)` fills the dict with the named intermediate activations of harness/core/taps.py (parity's
depth 0).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Dropout(nn.Dropout):
    """nn.Dropout, or with a given keep-mask (True = keep) inverted dropout x * mask / (1 - p), in any mode."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:
            return super().forward(x)
        return x * mask / (1 - self.p)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool = True, attn_dropout: bool = False):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # fused q, k, v: rows [q; k; v]
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        # nanoGPT's attn_dropout, on the attention probabilities (p = 0: the option is off, docs/design.md)
        self.attn_dropout = Dropout(dropout if attn_dropout else 0.0)
        self.resid_dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                taps: dict[str, torch.Tensor] | None = None,
                probs_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.heads(x)
        probs = None
        if probs_mask is None:
            # softmax(q k^T / sqrt(hs) + causal mask), dropped while training, then @ v: one fused kernel (flash on
            # CUDA, also in bf16 with dropout), as nanoGPT
            p = self.attn_dropout.p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            # the harness's keep-mask (parity): the same operations written out, so the given mask is the one applied
            probs = self.probabilities(q, k)
            y = self.attn_dropout(probs, probs_mask) @ v
        if taps is not None:
            # SDPA does not return its probabilities: the same softmax, written out, for the tap (before dropout).
            # A bug in the SDPA call alone (its scale, its mask) leaves these right and y wrong: parity checks each
            # side's attn.y against its own attn.probs @ attn.v (harness.parity.diagnose.attention_self_error) and
            # names that call.
            taps.update({"attn.q": q, "attn.k": k, "attn.v": v,
                         "attn.probs": self.probabilities(q, k) if probs is None else probs})
        y = self.merge(y)
        out = self.c_proj(y)
        if taps is not None:
            taps.update({"attn.y": y, "attn.proj": out})
        return self.resid_dropout(out, mask)  # after the output projection, before the residual add

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the fused c_attn, heads split: (B, T, C) -> (B, nh, T, hs), head h owns features h*hs:(h+1)*hs."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        return tuple(t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))

    @staticmethod
    def merge(y: torch.Tensor) -> torch.Tensor:
        """(B, nh, T, hs) -> (B, T, C): the heads side by side again."""
        B, nh, T, hs = y.shape
        return y.transpose(1, 2).contiguous().view(B, T, nh * hs)

    @staticmethod
    def probabilities(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(hs)) over the keys, future keys masked: (B, nh, T, T), query t against key s."""
        T = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        return scores.masked_fill(future, float("-inf")).softmax(dim=-1)


class MLP(nn.Module):
    def __init__(self, n_embd: int, d_hidden: int, dropout: float, bias: bool = True, gelu: str = "tanh"):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, d_hidden, bias=bias)
        self.c_proj = nn.Linear(d_hidden, n_embd, bias=bias)
        self.dropout = Dropout(dropout)
        # "tanh" (NNlib's default `gelu` is the tanh form too) or "exact" x * Phi(x), nanoGPT's nn.GELU()
        self.approximate = {"tanh": "tanh", "exact": "none"}[gelu]

    def act(self, h: torch.Tensor) -> torch.Tensor:
        """GELU in the config's form."""
        return F.gelu(h, approximate=self.approximate)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                taps: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        h = self.c_fc(x)
        a = self.act(h)
        out = self.c_proj(a)
        if taps is not None:
            taps.update({"mlp.fc": h, "mlp.act": a, "mlp.proj": out})
        return self.dropout(out, mask)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, d_hidden: int, dropout: float, bias: bool = True,
                 gelu: str = "tanh", attn_dropout: bool = False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, attn_dropout)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5, bias=bias)
        self.mlp = MLP(n_embd, d_hidden, dropout, bias, gelu)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                mlp_mask: torch.Tensor | None = None, taps: dict[str, torch.Tensor] | None = None,
                probs_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, attn_mask, taps, probs_mask)  # pre-LayerNorm residual blocks
        if taps is not None:
            taps.update({"ln_1": h, "res1": x})
        h = self.ln_2(x)
        x = x + self.mlp(h, mlp_mask, taps)
        if taps is not None:
            taps.update({"ln_2": h, "res2": x})
        return x


class GPT(nn.Module):
    """Token + position embedding, n_layer blocks, final LayerNorm, lm_head (untied with a bias by default)."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, n_layer: int, n_head: int,
                 d_hidden: int, dropout: float, bias: bool = True, lm_head_bias: bool = True,
                 tie_embeddings: bool = False, gelu: str = "tanh", attn_dropout: bool = False):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, d_hidden, dropout, bias, gelu, attn_dropout)
                               for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=lm_head_bias)
        if tie_embeddings:  # one Parameter in both places, as nanoGPT: autograd sums the gradients of both uses
            self.wte.weight = self.lm_head.weight
        # Weights are never initialised here: the harness hands every backend the same canonical arrays.

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                masks: dict[str, torch.Tensor] | None = None,
                taps: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        masks = masks or {}  # keep-masks by site (harness.core.masks); absent: nn.Dropout's own, SDPA's dropout_p
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        if taps is not None:
            taps["emb"] = x
        x = self.drop(x, masks.get("emb"))
        for i, block in enumerate(self.h):
            own = None if taps is None else {}
            x = block(x, masks.get(f"h.{i}.attn"), masks.get(f"h.{i}.mlp"), own, masks.get(f"h.{i}.attn.probs"))
            if taps is not None:
                taps.update({f"h.{i}.{name}": value for name, value in own.items()})
        h = self.ln_f(x)
        logits = self.lm_head(h)
        if taps is not None:
            taps.update({"ln_f": h, "logits": logits})
        if targets is None:
            return logits, None
        # mean cross-entropy over all B*T positions
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
