"""Write fixture.txt: what the NumPy float64 oracle (harness/models/numpy_gpt.py) computes on a tiny model.

NanoGPTFlux's `Pkg.test()` (runtests.jl) reads it as an outside reference: logits, loss and gradients at fixed
weights (dropout off, and with given dropout keep-masks), two full training steps (forward and backward with the
masks, global-norm clipping that is active, AdamW with weight decay on the parameters harness/weights.py decays)
with the parameters and AdamW moments after each, and the oracle's AdamW alone on fixed arrays for three steps.
An options case (`options.` config lines, `options/` names) repeats logits, loss, gradients and two training steps on
a one-layer model with nanoGPT's options: tied embeddings, exact GELU, no biases, no lm_head bias, and the learning
rates of a cosine schedule with warm-up (harness.schedule). An attention-dropout case (`attn.` config lines, `attn/`
names) gives the loss and gradients of a one-layer model with `attn_dropout` under masks that include the attention
probabilities' (`attn/mask/h.0.attn.probs`, NNlib's (key, query, head, batch) layout), and the parameters after two
training steps with them.

Run from the repository root (tests/test_flux_fixture.py checks the committed file is what this writes):

    python julia/NanoGPTFlux/test/make_fixture.py

Format (plain text, read with Julia's standard library only): `#` comment lines; `config KEY VALUE` (Int, Float64
or String); `scalar NAME VALUE`; `array NAME DIMS...` followed by one line of the values in column-major
(Julia) order. Arrays are in the Flux layout (harness/backends/flux_layout.py): embeddings (d, rows), Dense
weights (out, in), tokens (T, B) 1-based, logits (V, T, B), masks (C, T, B) as 0/1, attention masks (T, T, H, B).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from harness.backends.flux_layout import logits_to_flux, masks_to_flux, to_flux, tokens_to_flux  # noqa: E402
from harness.config.load import load_config  # noqa: E402
from harness.core.schedule import learning_rates  # noqa: E402
from harness.core.weights import decays, init_weights  # noqa: E402
from harness.models import numpy_gpt  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "fixture.txt"
VOCAB, T, B = 5, 6, 2
LRS = (1e-2, 5e-3)  # learning rates of training steps 1 and 2
ADAMW_LRS = (1e-2, 5e-3, 2e-3)
DIGITS = 13  # significant digits written: the Float64 comparisons in runtests.jl use rtol 1e-9 or looser


def tiny_config():
    """The fixture's model: 2 layers, 2 heads of size 2, dropout 0.25 (so 1 - p is exact in Float32)."""
    return load_config("small").replace(
        name="fixture", n_embd=4, n_head=2, n_layer=2, block_size=T, d_hidden=8, dropout=0.25, batch_size=B,
        weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-6, grad_clip=0.05)


def tiny_weights(config) -> dict[str, np.ndarray]:
    """GPT-2 initial weights plus noise (so LayerNorm gains and biases are not constants), float32 values."""
    w = init_weights(config, VOCAB, seed=3)
    rng = np.random.default_rng(5)
    return {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in w.items()}


def tiny_masks(config) -> dict[str, np.ndarray]:
    """Keep-masks of the shared-mask contract (harness/masks.py): bool (B, T, C) per site."""
    rng = np.random.default_rng(7)
    sites = ["emb"] + [f"h.{i}.{site}" for i in range(config.n_layer) for site in ("attn", "mlp")]
    return {k: rng.random((B, T, config.n_embd)) >= config.dropout for k in sites}


def _f64(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.array(v, dtype=np.float64) for k, v in arrays.items()}


def fixture() -> tuple[dict[str, object], dict[str, float], dict[str, np.ndarray]]:
    """(config lines, scalars, arrays in the Flux layout) computed by the float64 oracle."""
    config = tiny_config()
    weights = tiny_weights(config)
    rng = np.random.default_rng(11)
    x = rng.integers(0, VOCAB, size=(B, T))
    y = rng.integers(0, VOCAB, size=(B, T))
    masks = tiny_masks(config)
    decayed = [name for name, w in weights.items() if decays(name, w.shape)]
    cfg: dict[str, object] = {
        "vocab_size": VOCAB, "n_embd": config.n_embd, "n_head": config.n_head, "n_layer": config.n_layer,
        "block_size": config.block_size, "d_hidden": config.d_hidden, "dropout": config.dropout,
        "weight_decay": config.weight_decay, "beta1": config.beta1, "beta2": config.beta2, "eps": config.eps,
        "grad_clip": config.grad_clip, "decay": ",".join(decayed),
    }
    scalars: dict[str, float] = {"lr_1": LRS[0], "lr_2": LRS[1]}
    arrays: dict[str, np.ndarray] = {"x": tokens_to_flux(x), "y": tokens_to_flux(y)}
    arrays.update({f"param/{k}": v for k, v in to_flux(weights).items()})
    arrays.update({f"mask/{k}": v for k, v in masks_to_flux(masks).items()})

    params = _f64(weights)
    logits, _ = numpy_gpt.gpt_forward(params, x, config)
    arrays["logits"] = logits_to_flux(logits).astype(np.float64)
    loss, grads = numpy_gpt.loss_and_gradients(params, x, y, config)
    scalars["loss"] = float(loss)
    arrays.update({f"grad/{k}": v for k, v in _flux64(grads).items()})
    loss, grads = numpy_gpt.loss_and_gradients(params, x, y, config, masks=masks)
    scalars["loss_masked"] = float(loss)
    arrays.update({f"grad_masked/{k}": v for k, v in _flux64(grads).items()})

    # two training steps as the numpy backend takes them, with the masks
    opt = numpy_gpt.AdamW(params, betas=(config.beta1, config.beta2), eps=config.eps,
                          weight_decay=config.weight_decay)
    for step, lr in enumerate(LRS, start=1):
        loss, grads = numpy_gpt.loss_and_gradients(params, x, y, config, masks=masks)
        total = float(numpy_gpt.clip_grad_norm(grads, config.grad_clip))
        if total <= config.grad_clip:
            raise AssertionError(f"step {step}: gradient norm {total} does not exceed grad_clip: clipping untested")
        opt.step(params, grads, lr)
        scalars[f"loss_step_{step}"] = float(loss)
        for kind, values in (("param", params), ("adam_m", opt.m), ("adam_v", opt.v)):
            arrays.update({f"step{step}/{kind}/{k}": v for k, v in _flux64(values).items()})

    arrays.update(adamw_case())
    options_case(x, y, masks, cfg, scalars, arrays)
    attention_case(x, y, masks, cfg, scalars, arrays)
    return cfg, scalars, arrays


def options_config():
    """The options case's model: nanoGPT's options on one layer, a cosine schedule whose first two rates differ."""
    return tiny_config().replace(n_layer=1, tie_embeddings=True, gelu="exact", bias=False, lm_head_bias=False,
                                 lr_schedule="cosine", warmup_steps=1, decay_steps=3, min_lr=1e-3)


def options_case(x: np.ndarray, y: np.ndarray, masks: dict[str, np.ndarray], cfg: dict[str, object],
                 scalars: dict[str, float], arrays: dict[str, np.ndarray]) -> None:
    """Add the options case: its config lines, logits, loss, gradients and two training steps (masks, clipping,
    AdamW with the schedule's rates); the parameters after step 1, and parameters and moments after step 2."""
    config = options_config()
    weights = tiny_weights(config)
    masks = {k: m for k, m in masks.items() if k in ("emb", "h.0.attn", "h.0.mlp")}
    decayed = [name for name, w in weights.items() if decays(name, w.shape, config.decay)]
    cfg.update({"options.n_layer": config.n_layer, "options.tie_embeddings": "true", "options.gelu": config.gelu,
                "options.bias": "false", "options.lm_head_bias": "false", "options.decay": ",".join(decayed)})
    lrs = learning_rates(config, 2)
    scalars.update({"options/lr_1": lrs[0], "options/lr_2": lrs[1]})
    arrays.update({f"options/param/{k}": v for k, v in to_flux(weights).items()})
    params = _f64(weights)
    logits, _ = numpy_gpt.gpt_forward(params, x, config)
    arrays["options/logits"] = logits_to_flux(logits).astype(np.float64)
    loss, grads = numpy_gpt.loss_and_gradients(params, x, y, config)
    scalars["options/loss"] = float(loss)
    arrays.update({f"options/grad/{k}": v for k, v in _flux64(grads).items()})
    opt = numpy_gpt.AdamW(params, betas=(config.beta1, config.beta2), eps=config.eps,
                          weight_decay=config.weight_decay, decay=config.decay)
    for step, lr in enumerate(lrs, start=1):
        loss, grads = numpy_gpt.loss_and_gradients(params, x, y, config, masks=masks)
        numpy_gpt.clip_grad_norm(grads, config.grad_clip)
        opt.step(params, grads, lr)
        scalars[f"options/loss_step_{step}"] = float(loss)
        kinds = (("param", params),) if step == 1 else (("param", params), ("adam_m", opt.m), ("adam_v", opt.v))
        for kind, values in kinds:
            arrays.update({f"options/step{step}/{kind}/{k}": v for k, v in _flux64(values).items()})


def attention_config():
    """The attention-dropout case's model: the main model on one layer, with dropout on the attention probabilities."""
    return tiny_config().replace(n_layer=1, attn_dropout=True)


def attention_case(x: np.ndarray, y: np.ndarray, masks: dict[str, np.ndarray], cfg: dict[str, object],
                   scalars: dict[str, float], arrays: dict[str, np.ndarray]) -> None:
    """Add the attention-dropout case: its config lines, its attention keep-mask (drawn here, (B, H, T, T), written in
    NNlib's layout), the loss and gradients under all four sites' masks, and the parameters after two training steps
    with them (clipping, AdamW with decay)."""
    config = attention_config()
    weights = tiny_weights(config)
    rng = np.random.default_rng(17)
    masks = {k: m for k, m in masks.items() if k in ("emb", "h.0.attn", "h.0.mlp")}
    masks["h.0.attn.probs"] = rng.random((B, config.n_head, T, T)) >= config.dropout
    cfg.update({"attn.n_layer": config.n_layer, "attn.attn_dropout": "true",
                "attn.decay": ",".join(n for n, w in weights.items() if decays(n, w.shape))})
    arrays.update({f"attn/param/{k}": v for k, v in to_flux(weights).items()})
    arrays["attn/mask/h.0.attn.probs"] = masks_to_flux({"h.0.attn.probs": masks["h.0.attn.probs"]})["h.0.attn.probs"]
    params = _f64(weights)
    loss, grads = numpy_gpt.loss_and_gradients(params, x, y, config, masks=masks)
    scalars["attn/loss_masked"] = float(loss)
    arrays.update({f"attn/grad_masked/{k}": v for k, v in _flux64(grads).items()})
    opt = numpy_gpt.AdamW(params, betas=(config.beta1, config.beta2), eps=config.eps,
                          weight_decay=config.weight_decay)
    for step, lr in enumerate(LRS, start=1):
        loss, grads = numpy_gpt.loss_and_gradients(params, x, y, config, masks=masks)
        numpy_gpt.clip_grad_norm(grads, config.grad_clip)
        opt.step(params, grads, lr)
        scalars[f"attn/lr_{step}"] = lr
        scalars[f"attn/loss_step_{step}"] = float(loss)
        arrays.update({f"attn/step{step}/param/{k}": v for k, v in _flux64(params).items()})


def _flux64(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Canonical float64 arrays in the Flux layout, still float64 (to_flux is float32: transpose by hand)."""
    return {k: (v.T if k in ("wte.weight", "wpe.weight") else v).astype(np.float64) for k, v in arrays.items()}


def adamw_case() -> dict[str, np.ndarray]:
    """The oracle's AdamW alone, in float64, on fixed arrays for three steps (lr changing, as with adjust!).

    "a" (3, 4) is decayed and "b" (4,) is not (harness.weights.decays); the gradients are of the order of eps,
    so where eps enters the denominator shows, and three steps make the bias corrections matter.
    """
    rng = np.random.default_rng(13)
    params = {"a": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)}
    out = {f"adamw/param0/{k}": v.copy() for k, v in params.items()}
    opt = numpy_gpt.AdamW(params, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    for step, lr in enumerate(ADAMW_LRS, start=1):
        grads = {k: 1e-6 * rng.standard_normal(v.shape) * 10 ** rng.uniform(-1, 1, v.shape)
                 for k, v in params.items()}
        out.update({f"adamw/grad{step}/{k}": v.copy() for k, v in grads.items()})
        opt.step(params, grads, lr)
        for kind, values in (("param", params), ("adam_m", opt.m), ("adam_v", opt.v)):
            out.update({f"adamw/step{step}/{kind}/{k}": v.copy() for k, v in values.items()})
    out["adamw/lr"] = np.array(ADAMW_LRS)
    out["adamw/hyper"] = np.array([0.9, 0.95, 1e-6, 0.1])  # beta1, beta2, eps, weight_decay
    return out


def _number(v: float) -> str:
    return f"{v:.{DIGITS}g}"


def render() -> str:
    """The fixture file's text."""
    cfg, scalars, arrays = fixture()
    lines = ["# NanoGPTFlux test fixture: the NumPy float64 oracle on a tiny model (Flux layout, column-major).",
             "# Generated by julia/NanoGPTFlux/test/make_fixture.py; do not edit (tests/test_flux_fixture.py)."]
    lines += [f"config {k} {v}" for k, v in cfg.items()]
    lines += [f"scalar {k} {_number(v)}" for k, v in scalars.items()]
    for name, a in arrays.items():
        a = np.asarray(a)
        lines.append(" ".join(["array", name, *map(str, a.shape)]))
        flat = a.reshape(-1, order="F")
        if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
            lines.append(" ".join(str(int(v)) for v in flat))
        else:
            lines.append(" ".join(_number(float(v)) for v in flat))
    return "\n".join(lines) + "\n"


def parse(text: str) -> tuple[dict[str, str], dict[str, float], dict[str, np.ndarray]]:
    """The fixture's config lines, scalars and arrays (float64, from the column-major values)."""
    cfg: dict[str, str] = {}
    scalars: dict[str, float] = {}
    arrays: dict[str, np.ndarray] = {}
    lines = iter(text.splitlines())
    for line in lines:
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "config":
            cfg[words[1]] = words[2]
        elif words[0] == "scalar":
            scalars[words[1]] = float(words[2])
        elif words[0] == "array":
            shape = tuple(int(d) for d in words[2:])
            values = np.array([float(v) for v in next(lines).split()])
            arrays[words[1]] = values.reshape(shape, order="F")
        else:
            raise ValueError(f"unknown fixture line {line[:40]!r}")
    return cfg, scalars, arrays


def main() -> None:
    FIXTURE.write_text(render(), encoding="utf-8")
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
