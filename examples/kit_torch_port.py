#!/usr/bin/env python3
"""A nanoGPT port checked from outside with the conformance kit: reads a kit, runs the model, writes results.

This script is written as a stranger to the harness would write it: it imports only numpy and torch (nothing from
the harness or its models) and learns everything from the kit's manifest.json and NPZ files. It follows nanoGPT's
conventions where the manifest's config asks for them: tied embeddings (one tensor used twice; autograd sums both
gradients), exact GELU, no biases, and the learning rate of each step computed by nanoGPT's own get_lr formula from
warmup_steps, decay_steps and min_lr (not read from the kit: the check then tests the port's schedule too), and
dropout on the attention probabilities when the kit has their masks (attn_dropout).

    harness kit export --out kit/ --size small --steps 5
    python examples/kit_torch_port.py kit/ kit-results.npz --dtype float32
    harness kit check kit/ kit-results.npz

`--plant BUG` plants one known bug, to see the check name it (see PLANTS).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

PLANTS = {
    "attn-scale": "attention scores not scaled by 1/sqrt(head size)",
    "ln-eps": "LayerNorm eps 1e-3 instead of 1e-5",
    "mask-wide": "causal mask one too wide (key t + 1 visible to query t)",
    "gelu-exact": "exact (erf) GELU where the tanh form is expected",
    "pos-shift": "position embedding shifted by one (position t reads wpe[t-1])",
    "tied": "lm_head tied to the token embedding (logits = ln_f @ wte^T + lm_head.bias)",
    "no-lm-bias": "no lm_head bias (invisible at step 0: the bias starts at zero)",
    "no-decay-emb": "no weight decay on the embeddings wte, wpe (minGPT's convention)",
    "aliased": "the optimizer state saved by reference (every opt/<k> array is the final state)",
    "adam-t-stops": "AdamW's step counter stops advancing after step 3",
    "clip-per-param": "gradient clipping per parameter instead of by the global norm",
    "masks-off-by-one": "step k trains with the dropout masks of step k + 1 (the training loop only)",
    "float64-file": "computes in float32 but writes float64 arrays",
    "no-bias-correction": "AdamW without the bias corrections 1 - beta^t",
    "decay-1d": "weight decay on every parameter, also biases and LayerNorm weights",
    "clip-0.5": "gradient clipping at global norm 0.5 instead of the manifest's grad_clip",
    "eps-1e-6": "AdamW eps 1e-6 instead of the manifest's",
    "beta2-0.99": "AdamW beta2 0.99 instead of the manifest's",
    "coupled-decay": "L2 decay added to the gradient (Adam) instead of decoupled (AdamW)",
    "dropout-on-attn-probs": "dropout on the attention probabilities (torch's own) instead of after c_proj",
    "dropout-scale-p": "kept values scaled by 1/p instead of 1/(1-p)",
    "dropout-before-proj": "the attention dropout mask applied before the output projection c_proj",
    "attn-drop-after-v": "attention dropout applied after the value product (y = (att @ v) * mask, cut to y's shape)",
    "attn-drop-unscaled": "attention dropout not rescaled by 1/(1-p) (att * mask @ v)",
    "attn-drop-missing": "attention dropout missing (the attention masks are read but not applied)",
    "masks-transposed": "every dropout mask transposed (the attention masks' query and key swapped, the others mask.T)",
    "masks-previous-step": "step k uses the masks of step k - 1 (masks[k - 1]: step 0 gets the last step's)",
    "tie-no-sum": "tied embeddings whose gradient comes from the embedding use only (the output layer's is dropped)",
    "gelu-tanh": "tanh GELU where the manifest asks for the exact form",
    "warmup-off-by-one": "the warm-up counts steps from 1: step k gets nanoGPT's get_lr(k + 1)",
    "cosine-to-zero": "the cosine decays to 0 instead of min_lr",
    "lr-slightly-off": "every learning rate 0.05 % too high (the updates stay within the optimizer's tolerance)",
}


def get_lr(c: dict, it: int, plant: str | None = None) -> float:
    """nanoGPT's get_lr(it) (train.py) from the manifest's config: linear warm-up, cosine to min_lr, min_lr after."""
    lr, warmup, min_lr = c["learning_rate"], c.get("warmup_steps", 0), c.get("min_lr", 0.0)
    if plant == "lr-slightly-off":
        return get_lr(c, it) * 1.0005
    if plant == "warmup-off-by-one":
        it += 1
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if c.get("lr_schedule", "constant") == "constant":
        return lr
    if plant == "cosine-to-zero":
        min_lr = 0.0
    if it > c["decay_steps"]:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / (c["decay_steps"] - warmup)))
    return min_lr + coeff * (lr - min_lr)


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


class Port:
    """nanoGPT as plain tensor code: parameters in a dict under the kit's (PyTorch) names and shapes."""

    def __init__(self, manifest: dict, weights: dict[str, np.ndarray], dtype: torch.dtype, plant: str | None):
        self.c = manifest["config"]
        self.dtype, self.plant = dtype, plant
        self.p = {n: torch.tensor(weights[n], dtype=dtype).requires_grad_(True) for n in manifest["parameters"]}

    def drop(self, x: torch.Tensor, mask: np.ndarray | None) -> torch.Tensor:
        if mask is None:
            return x
        keep = torch.from_numpy(np.asarray(mask)).to(x.dtype)
        p = self.c["dropout"]
        return x * keep / (p if self.plant == "dropout-scale-p" else 1 - p)  # inverted dropout

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ self.p[name + ".weight"].T
        return y + self.p[name + ".bias"] if name + ".bias" in self.p else y  # bias = false: none

    def layernorm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        eps = 1e-3 if self.plant == "ln-eps" else 1e-5
        return F.layer_norm(x, (x.shape[-1],), self.p[name + ".weight"], self.p.get(name + ".bias"), eps=eps)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """lm_head; tied embeddings (nanoGPT's wte.weight = lm_head.weight): the token table is the weight."""
        if not self.c.get("tie_embeddings"):
            return self.linear(x, "lm_head")
        w = self.p["wte.weight"].detach() if self.plant == "tie-no-sum" else self.p["wte.weight"]
        y = x @ w.T
        return y + self.p["lm_head.bias"] if "lm_head.bias" in self.p else y

    def attention(self, x: torch.Tensor, i: int, masks: dict | None, step: int, taps: dict) -> torch.Tensor:
        B, T, C = x.shape
        H = self.c["n_head"]
        q, k, v = self.linear(x, f"h.{i}.attn.c_attn").split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        scale = 1.0 if self.plant == "attn-scale" else 1.0 / math.sqrt(C // H)
        scores = (q @ k.transpose(-2, -1)) * scale
        future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=2 if self.plant == "mask-wide" else 1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        taps.update({f"h.{i}.attn.q": q, f"h.{i}.attn.k": k, f"h.{i}.attn.v": v, f"h.{i}.attn.probs": probs})
        # nanoGPT's attn_dropout (the config's attn_dropout): the kit then has a (B, H, T, T) mask per block
        keep = None if masks is None else masks.get(f"h.{i}.attn.probs")
        after_v = keep is not None and self.plant == "attn-drop-after-v"
        if keep is not None and self.plant == "attn-drop-unscaled":
            probs = probs * torch.from_numpy(np.asarray(keep)).to(probs.dtype)
        elif self.plant not in ("attn-drop-missing", "attn-drop-after-v", "attn-drop-unscaled"):
            probs = self.drop(probs, keep)
        mask = None if masks is None else masks.get(f"h.{i}.attn")
        if self.plant == "dropout-on-attn-probs" and mask is not None:
            g = torch.Generator().manual_seed(step)
            keep = (torch.rand(probs.shape, generator=g) >= self.c["dropout"]).to(probs.dtype)
            probs, mask = probs * keep / (1 - self.c["dropout"]), None
        y = probs @ v
        if after_v:
            y = self.drop(y, np.asarray(keep)[..., :v.shape[-1]])
        y = y.transpose(1, 2).reshape(B, T, C)
        taps[f"h.{i}.attn.y"] = y
        if self.plant == "dropout-before-proj":
            return self.linear(self.drop(y, mask), f"h.{i}.attn.c_proj")
        taps[f"h.{i}.attn.proj"] = out = self.linear(y, f"h.{i}.attn.c_proj")
        return self.drop(out, mask)

    def logits(self, idx: np.ndarray, masks: dict | None = None, step: int = 0,
               taps: dict | None = None) -> torch.Tensor:
        """Logits (B, T, V); `taps` is filled with the manifest's activation taps (taps.names)."""
        taps = {} if taps is None else taps
        x_ids = torch.from_numpy(np.asarray(idx, dtype=np.int64))
        T = x_ids.shape[1]
        pos = torch.arange(T) - 1 if self.plant == "pos-shift" else torch.arange(T)  # -1: wpe's last row
        taps["emb"] = x = self.p["wte.weight"][x_ids] + self.p["wpe.weight"][pos]
        x = self.drop(x, None if masks is None else masks.get("emb"))
        for i in range(self.c["n_layer"]):
            taps[f"h.{i}.ln_1"] = h = self.layernorm(x, f"h.{i}.ln_1")
            taps[f"h.{i}.res1"] = x = x + self.attention(h, i, masks, step, taps)
            taps[f"h.{i}.ln_2"] = h = self.layernorm(x, f"h.{i}.ln_2")
            taps[f"h.{i}.mlp.fc"] = h = self.linear(h, f"h.{i}.mlp.c_fc")
            exact = (self.c.get("gelu", "tanh") == "exact" and self.plant != "gelu-tanh") or self.plant == "gelu-exact"
            taps[f"h.{i}.mlp.act"] = h = F.gelu(h, approximate="none" if exact else "tanh")
            taps[f"h.{i}.mlp.proj"] = h = self.linear(h, f"h.{i}.mlp.c_proj")
            taps[f"h.{i}.res2"] = x = x + self.drop(h, None if masks is None else masks.get(f"h.{i}.mlp"))
        taps["ln_f"] = h = self.layernorm(x, "ln_f")
        if self.plant == "tied":  # ties lm_head to wte although the kit's model is untied
            taps["logits"] = out = h @ self.p["wte.weight"].T + self.p["lm_head.bias"]
        elif self.plant == "no-lm-bias":
            taps["logits"] = out = h @ self.p["lm_head.weight"].T
        else:
            taps["logits"] = out = self.head(h)
        return out

    def loss(self, x: np.ndarray, y: np.ndarray, masks: dict | None = None, step: int = 0) -> torch.Tensor:
        logits = self.logits(x, masks, step)
        targets = torch.from_numpy(np.asarray(y, dtype=np.int64)).reshape(-1)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)  # mean over all B*T positions

    def gradients(self, x: np.ndarray, y: np.ndarray, masks: dict | None, step: int) -> tuple[float, dict]:
        for t in self.p.values():
            t.grad = None
        loss = self.loss(x, y, masks, step)
        loss.backward()
        # a parameter the forward pass does not use (a planted missing bias) gets a zero gradient
        return float(loss.detach()), {n: t.grad.detach().clone() if t.grad is not None else torch.zeros_like(t)
                                      for n, t in self.p.items()}


class AdamW:
    """PyTorch's AdamW written out (decoupled decay on >= 2-D parameters as nanoGPT, or on Linear weights only for
    the manifest's decay "mingpt"), with the plants."""

    def __init__(self, params: dict[str, torch.Tensor], c: dict, plant: str | None):
        self.wd, self.plant = c["weight_decay"], plant
        self.mingpt = c.get("decay") == "mingpt"
        self.b1 = c["beta1"]
        self.b2 = 0.99 if plant == "beta2-0.99" else c["beta2"]
        self.eps = 1e-6 if plant == "eps-1e-6" else c["eps"]
        self.m = {n: torch.zeros_like(p) for n, p in params.items()}
        self.v = {n: torch.zeros_like(p) for n, p in params.items()}
        self.t = 0

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], lr: float) -> None:
        self.t = min(self.t + 1, 3) if self.plant == "adam-t-stops" else self.t + 1
        if self.plant == "no-bias-correction":
            step_size, bc2_sqrt = lr, 1.0
        else:
            step_size, bc2_sqrt = lr / (1 - self.b1 ** self.t), (1 - self.b2 ** self.t) ** 0.5
        for n, p in params.items():
            g, m, v = grads[n], self.m[n], self.v[n]
            embedding = n in ("wte.weight", "wpe.weight")
            decays = ((p.ndim >= 2 and not (self.mingpt and embedding)) or self.plant == "decay-1d") and not (
                self.plant == "no-decay-emb" and embedding)
            if decays and self.plant == "coupled-decay":
                g = g + self.wd * p
            elif decays:
                p.mul_(1 - lr * self.wd)
            m.lerp_(g, 1 - self.b1)
            v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            p.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(self.eps), value=-step_size)


def clip_(grads: dict[str, torch.Tensor], max_norm: float, plant: str | None = None) -> None:
    """Global-norm clipping as torch.nn.utils.clip_grad_norm_."""
    if max_norm <= 0:
        return
    if plant == "clip-per-param":
        for g in grads.values():
            g.mul_(torch.clamp(max_norm / (g.norm() + 1e-6), max=1.0))
        return
    total = torch.stack([g.norm() for g in grads.values()]).norm()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads.values():
        g.mul_(coef)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kit", type=Path)
    ap.add_argument("out", type=Path, help="results .npz to write")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--plant", choices=sorted(PLANTS), help="plant one known bug")
    ap.add_argument("--depths", default="taps,logits,gradients,optimizer,loss",
                    help="which depths to write (comma-separated subset)")
    args = ap.parse_args()
    depths = set(args.depths.split(","))
    torch.set_num_threads(1)

    manifest = json.loads((args.kit / "manifest.json").read_text())
    c = manifest["config"]
    batches = load_npz(args.kit / "batches.npz")
    all_masks = load_npz(args.kit / "masks.npz") if c["dropout"] > 0 else None
    x, y = batches["x"], batches["y"]  # (steps, B, T), 0-based ids

    def masks(k: int) -> dict | None:
        if all_masks is None:
            return None
        if args.plant == "masks-previous-step":
            k -= 1  # step 0: index -1, the last step's masks
        out = {key: v[k] for key, v in all_masks.items()}
        if args.plant == "masks-transposed":
            out = {key: m.swapaxes(-1, -2) if m.ndim == 4 else m.T if m.T.shape == m.shape else m
                   for key, m in out.items()}
        return out

    compute = "float32" if args.plant == "float64-file" else args.dtype  # that plant computes in float32 always
    model = Port(manifest, load_npz(args.kit / "weights.npz"), getattr(torch, compute), args.plant)
    out: dict[str, np.ndarray] = {}
    rows = manifest["taps"]["rows"]
    # the activation taps on the first rows of x[0]: dropout off, except at the sites the manifest names (the
    # attention probabilities with attn_dropout), whose step-0 masks apply there
    step0 = masks(0) or {}
    tap_masks = {site: step0[site][:rows] for site in manifest["taps"].get("masks", [])} or None
    with torch.no_grad():
        logits = model.logits(x[0])  # dropout off
        taps: dict[str, torch.Tensor] = {}
        model.logits(x[0][:rows], masks=tap_masks, taps=taps)
    if "logits" in depths:
        out["logits"] = logits.numpy()
    if "taps" in depths:
        out.update({f"tap/{name}": taps[name].numpy() for name in manifest["taps"]["names"] if name in taps})
    if "gradients" in depths:  # step-0 gradients, dropout off, no clipping
        _, grads = model.gradients(x[0], y[0], None, 0)
        out.update({f"grad/{n}": g.numpy() for n, g in grads.items()})
        if all_masks is not None:  # and with the step-0 dropout masks
            _, grads = model.gradients(x[0], y[0], masks(0), 0)
            out.update({f"dropout_grad/{n}": g.numpy() for n, g in grads.items()})
    opt = AdamW(model.p, c, args.plant)
    max_norm = 0.5 if args.plant == "clip-0.5" else c["grad_clip"]
    losses = []
    copy = (lambda t: t.detach()) if args.plant == "aliased" else (lambda t: t.detach().clone())
    for k in range(manifest["steps"]):
        shift = 1 if args.plant == "masks-off-by-one" and k + 1 < manifest["steps"] else 0
        loss, grads = model.gradients(x[k], y[k], masks(k + shift), k)
        losses.append(loss)
        clip_(grads, max_norm, args.plant)
        opt.step(model.p, grads, get_lr(c, k, args.plant))
        if "optimizer" in depths:
            for n, p in model.p.items():
                out[f"opt/{k + 1}/param/{n}"] = copy(p).numpy()
                out[f"opt/{k + 1}/adam_m/{n}"] = copy(opt.m[n]).numpy()
                out[f"opt/{k + 1}/adam_v/{n}"] = copy(opt.v[n]).numpy()
    if "loss" in depths:
        out["loss"] = np.asarray(losses, dtype=compute)
    if args.plant == "float64-file":
        out = {k: v.astype(np.float64) for k, v in out.items()}
    np.savez(args.out, **out)
    print(f"wrote {args.out}: {len(out)} arrays ({args.dtype}{', plant ' + args.plant if args.plant else ''})")


if __name__ == "__main__":
    main()
