"""`harness kit export`: the exact inputs and the float64 oracle's exact answers, as NPZ files and manifest.json.

The oracle is the NumPy reference backend (harness/models/numpy_gpt.py) in float64, driven through the same Backend
protocol as in `harness parity`: the step-0 probe on the first batch, then `steps` training steps (forward with the
harness's dropout masks, backward, global-norm clipping, AdamW), with the backend's state_dict after each step.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import UsageError
from harness.units import utc_now

SCHEMA = "nanogpt-parity/kit"


SCHEMA_VERSION = 1


MANIFEST = "manifest.json"


FILES = ("weights.npz", "batches.npz", "masks.npz", "expected.npz")


MAX_STEPS = 1000


KINDS = ("param", "adam_m", "adam_v")


def opt_key(k: int, kind: str, name: str) -> str:
    """The name of parameter `name`'s `kind` (param, adam_m, adam_v) after k optimizer steps (k = 1..N)."""
    return f"opt/{k}/{kind}/{name}"


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An uncompressed NPZ (readable by NPZ.jl, cnpy, npyz and numpy alike), C-ordered arrays."""
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v, order="C") for k, v in arrays.items()})  # ascontiguousarray makes () (1,)
    return buf.getvalue()


def sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


UNFINISHED = ".export-unfinished"  # in KIT_DIR from before the first file is written until the manifest is in place


def _ours(name: str) -> bool:
    """A file `harness kit export` writes into KIT_DIR (a kit file, the manifest, their temporary files, the marker)."""
    names = (*FILES, MANIFEST)
    return name == UNFINISHED or name in names or any(
        name.startswith(f".{n}.") and name.endswith(".tmp") for n in names)


def _remove_unfinished(out: Path) -> None:
    for path in out.iterdir():
        if _ours(path.name):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def check_out(out: Path) -> None:
    """KIT_DIR must be a new or empty directory, or one an interrupted export left (then its files are removed)."""
    if out.exists() and not out.is_dir():
        from harness.files import kind_of

        raise UsageError(f"the kit directory {str(out)!r} is {kind_of(out.stat().st_mode)}; pass a new or empty "
                         "directory for the kit")
    if out.is_dir():
        names = [p.name for p in out.iterdir()]
        if UNFINISHED in names and all(_ours(n) for n in names):
            print(f"kit: removing the unfinished kit an interrupted export left in {str(out)!r}", file=sys.stderr)
            _remove_unfinished(out)
        elif names:
            raise UsageError(f"the kit directory {str(out)!r} is not empty; pass a new directory (a kit is never "
                             "written over another)")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"the kit directory {str(out)!r}: its parent {str(parent)!r} does not exist; create it "
                         "first")


def write_kit(out: Path, blobs: dict[str, bytes], manifest: bytes) -> None:
    """Write the kit files, then manifest.json last. A failure (a full disk, Ctrl-C) removes what was written, and
    the marker file left by a kill lets the next export into the same KIT_DIR start again."""
    from harness.store import atomic_write_bytes, os_error_message

    created = not out.exists()
    out.mkdir(exist_ok=True)
    marker = out / UNFINISHED
    try:
        marker.touch()
        for name, blob in blobs.items():
            atomic_write_bytes(out / name, blob)
        atomic_write_bytes(out / MANIFEST, manifest)
    except BaseException as exc:
        _remove_unfinished(out)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        if isinstance(exc, OSError):
            raise UsageError(os_error_message(exc, f"cannot write the kit into {str(out)!r}")
                             + " (nothing of it was left)") from None
        raise
    marker.unlink()


def compute(config: Any, corpus: Any, seed: int, steps: int, progress: bool = True
            ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """The kit's arrays by file ({file: {key: array}}) and facts for the manifest; the oracle in float64."""
    from harness.backends import ORACLE, create_backend
    from harness.core.data import BatchStream
    from harness.core.masks import dropout_masks
    from harness.core.schedule import learning_rates
    from harness.core.taps import PREFIX, tap_masks, tap_rows
    from harness.core.weights import init_weights, param_shapes

    shapes = param_shapes(config, corpus.vocab_size)
    weights = init_weights(config, corpus.vocab_size, seed)
    stream = BatchStream(corpus.train, config.block_size, config.batch_size, seed, config.scheme)
    batches = [stream.batch(k) for k in range(steps)]
    lrs = learning_rates(config, steps)  # the harness's schedule: what every backend gets, and the port reads
    oracle = create_backend(ORACLE, dtype="float64")
    dropout = config.dropout > 0
    masks = [dropout_masks(config, seed, k) for k in range(steps)] if dropout else []  # parity's masks exactly
    oracle.setup(config, weights, corpus.vocab_size, "cpu", seed)

    def say(text: str) -> None:
        if progress:
            print(f"  {text}", file=sys.stderr, flush=True)

    x0, y0 = batches[0]
    say(f"oracle ({ORACLE}, float64): step-0 logits and gradients")
    expected: dict[str, np.ndarray] = {"logits": np.asarray(oracle.logits(x0), dtype=np.float64),
                                       "logits_loss": np.array(oracle.eval_loss(x0, y0), dtype=np.float64)}
    # the activation taps on the first rows of x[0], as the parity probe's tap/ (harness/core/taps.py): dropout off,
    # except at the attention probabilities of a model with attention dropout (the step-0 masks, tap_masks)
    rows = x0[:tap_rows(config)]
    with_masks = tap_masks(config, masks[0] if masks else None)
    taps = oracle.taps(rows, masks=with_masks) if with_masks else oracle.taps(rows)
    expected.update({PREFIX + k: np.asarray(v, dtype=np.float64) for k, v in taps.items()})
    grads = oracle.gradients(x0, y0)  # dropout off, as the parity probe's grad/
    expected.update({f"grad/{n}": np.asarray(grads[n], dtype=np.float64) for n in shapes})
    if dropout:  # and under the step-0 masks, as the parity probe's dropout_grad/
        grads = oracle.gradients(x0, y0, masks=masks[0])
        expected.update({f"dropout_grad/{n}": np.asarray(grads[n], dtype=np.float64) for n in shapes})
    losses = []
    for k, (x, y) in enumerate(batches):
        if dropout:
            loss = oracle.train_step(x, y, lrs[k], masks=masks[k])
        else:
            loss = oracle.train_step(x, y, lrs[k])
        losses.append(float(loss))
        state = oracle.state_dict()
        for kind in KINDS:
            for n in shapes:
                expected[opt_key(k + 1, kind, n)] = np.asarray(state[f"{kind}/{n}"], dtype=np.float64)
        say(f"oracle step {k + 1}/{steps}: loss {losses[-1]:.6f}")
    expected["loss"] = np.asarray(losses, dtype=np.float64)
    bad = [k for k, v in expected.items() if not np.isfinite(v).all()]
    if bad:
        raise UsageError(f"the oracle produced non-finite values ({bad[0]}); choose another config or seed")
    files: dict[str, dict[str, np.ndarray]] = {
        "weights.npz": dict(weights),
        "batches.npz": {"x": np.stack([b[0] for b in batches]).astype(np.int64),
                        "y": np.stack([b[1] for b in batches]).astype(np.int64),
                        "lr": np.asarray(lrs, dtype=np.float64)},
        "expected.npz": expected,
    }
    if dropout:
        files["masks.npz"] = {key: np.stack([m[key] for m in masks]) for key in masks[0]}
    facts = {"shapes": shapes, "vocab_size": corpus.vocab_size}
    return files, facts


def _dropout_text(config: Any) -> str:
    """The manifest's training.dropout: where the masks of masks.npz act, and how."""
    from harness.core.masks import attention_sites

    if config.dropout == 0:
        return "none (dropout 0)"
    text = ("inverted: x * mask / (1 - p) with masks[k] at step k; on the embedding sum (emb), after each block's "
            "attention output projection (h.i.attn) and MLP output projection (h.i.mlp), before the residual add")
    if attention_sites(config):
        text += ("; and on each block's attention probabilities (h.i.attn.probs, mask (B, H, T_query, T_key)): "
                 "att = softmax(masked scores); att = att * mask / (1 - p); y = att @ v, as nanoGPT's attn_dropout")
    return text


def build_manifest(config: Any, size: str | None, corpus: Any, seed: int, steps: int,
                   files: dict[str, dict[str, np.ndarray]], blobs: dict[str, bytes]) -> dict[str, Any]:
    """manifest.json: what the kit holds, how every array is laid out, and how it will be graded."""
    from harness import __version__
    from harness.backends import ORACLE
    from harness.config.fields import MODEL_OPTIONS
    from harness.core import schedule
    from harness.core.taps import MEANING, PREFIX, kind, tap_mask_sites, tap_names, tap_rows
    from harness.core.weights import decays, param_shapes
    from harness.kit.layout import describe
    from harness.parity.tolerances import tolerances_for

    shapes = param_shapes(config, corpus.vocab_size)
    gelu = {"tanh": "tanh GELU 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))",
            "exact": "exact GELU x Phi(x) = 0.5 x (1 + erf(x / sqrt(2))) (torch nn.GELU(), nanoGPT's)"}[config.gelu]
    head = ("tied lm_head: logits = h @ wte.weight.T (no lm_head.weight; the gradient of wte.weight is the sum of "
            "both uses)" if config.tie_embeddings else "untied lm_head")
    head += " with bias" if config.lm_head_bias else " without bias"
    decayed = [n for n, shape in shapes.items() if decays(n, shape, config.decay)]
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "created_at": utc_now(),
        "harness_version": __version__,
        "size": size, "config": config.to_dict(), "seed": seed, "steps": steps,
        "vocabulary": "".join(corpus.chars), "vocab_size": corpus.vocab_size,
        "data": {"file": Path(corpus.path).name, "sha256": corpus.sha256, "n_chars": corpus.n_chars,
                 "split": "first 90% train (the batches come from it), last 10% validation"},
        "expected_dtype": "float64", "oracle": f"{ORACLE} backend (harness/models/numpy_gpt.py), float64, CPU",
        "parameters": {n: list(s) for n, s in shapes.items()},
        "taps": {"rows": tap_rows(config), "names": tap_names(config.n_layer),
                 "taken_on": f"x[0][:{tap_rows(config)}] (the first rows of step 0's batch), the initial weights, "
                             + ("dropout off except on the attention probabilities: there the step-0 masks apply "
                                f"(masks[0] of the sites in taps.masks, their first {tap_rows(config)} rows), so "
                                "attn.probs is before the dropout and attn.y = (attn.probs * mask / (1 - p)) @ v"
                                if tap_mask_sites(config) else "dropout off"),
                 "masks": tap_mask_sites(config),
                 "meaning": {name: MEANING[kind(name)] for name in tap_names(config.n_layer)},
                 "layouts": "shapes, axes and Flux layouts: files.expected.npz.arrays[\"tap/<name>\"]",
                 "prefix": PREFIX},
        "model": ("token + learned position embedding, dropout, n_layer pre-LayerNorm blocks x + drop(attn(ln_1(x))),"
                  " x + drop(mlp(ln_2(x))); causal attention with one fused qkv Linear (rows q, k, v; head h owns "
                  "features h*D..(h+1)*D-1), scores scaled by 1/sqrt(D), "
                  + ("dropout on the attention probabilities (after the softmax, before the product with v; "
                     "nanoGPT's attn_dropout)" if config.attn_dropout else "no dropout on the attention probabilities")
                  + f"; MLP Linear -> {gelu} -> Linear; final LayerNorm (eps 1e-5, biased variance); {head}; "
                  + ("biases in every Linear and LayerNorm of the blocks and ln_f" if config.bias else
                     "no biases in the blocks' Linears and LayerNorms nor in ln_f (nanoGPT's bias = False)")
                  + "; loss = mean cross-entropy over all B*T positions"),
        "model_options": {**{k: getattr(config, k) for k in MODEL_OPTIONS}, "mlp_hidden": config.d_hidden},
        "training": {
            "learning_rate": config.learning_rate, "schedule": schedule.describe(config),
            "lr_schedule": config.lr_schedule, "warmup_steps": config.warmup_steps,
            "decay_steps": config.decay_steps, "min_lr": config.min_lr,
            "learning_rates": [float(v) for v in files["batches.npz"]["lr"]],
            "decay": config.decay, "decayed_parameters": decayed,
            "clip": "global L2 norm over all gradients; coef = min(1, grad_clip / (norm + 1e-6)) multiplies every "
                    "gradient (torch.nn.utils.clip_grad_norm_); grad_clip 0 disables",
            "adamw": "PyTorch AdamW: p *= 1 - lr*weight_decay (decoupled, only the decayed_parameters: "
                     + ("every parameter with >= 2 dimensions, embeddings included, as nanoGPT" if config.decay ==
                        "nanogpt" else "Linear weights only, not embeddings, biases or LayerNorm weights, as minGPT")
                     + "); m = beta1 m + (1-beta1) g; v = beta2 v + (1-beta2) g^2; "
                     "p -= lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps), t = 1, 2, ...; lr = "
                     "learning_rates[k] (batches.npz lr[k]) at step k",
            "dropout": _dropout_text(config),
        },
        "definitions": _definitions(config),
        "results": _results(config),
        "tolerances": {dt: asdict(tolerances_for(f"{dt}/float64" if dt == "float32" else "float64/float64", config)[0])
                       for dt in ("float32", "float64")},
        "files": {name: {"sha256": sha256(blobs[name]), "bytes": len(blobs[name]),
                         "arrays": {k: {"dtype": str(v.dtype), **describe(name[:-4], k, v.shape)}
                                    for k, v in arrays.items()}}
                  for name, arrays in files.items()},
    }


def _definitions(config: Any) -> dict[str, str]:
    """The manifest's `definitions`: what every array of the kit and of a results file means."""
    from harness.core.taps import tap_mask_sites

    return {
        "x, y": "batches.npz: x[k], y[k] are step k's (B, T) inputs and targets, 0-based token ids (a 1-based "
                "language adds 1); y is x shifted by one position",
        "lr": "batches.npz: lr[k] is step k's learning rate (0-based k; nanoGPT's get_lr(k)), as in "
              "training.learning_rates",
        "logits": "step 0: forward of x[0] with the initial weights, dropout off",
        "tap/<name>": "step 0: the named intermediate activations of that forward pass on the first `taps.rows` "
                      "rows of x[0], in forward order (taps.names, taps.meaning)"
                      + ("; with the step-0 masks of the attention probabilities applied (taps.masks: masks[0] of "
                         "those sites, their first taps.rows rows), the other sites' dropout off"
                         if tap_mask_sites(config) else ""),
        "logits_loss": "step 0: mean cross-entropy of those logits against y[0] (dropout off)",
        "grad/<name>": "step 0: gradient of the mean loss on (x[0], y[0]) w.r.t. the initial weights, dropout "
                       "off, no clipping",
        **({"dropout_grad/<name>": "step 0: the same gradient with dropout, masks[0] applied"}
           if config.dropout > 0 else {}),
        "loss": "loss[k]: the training loss of step k (0-based) before its update"
                + (", dropout with masks[k]" if config.dropout > 0 else ""),
        "opt/<k>/param|adam_m|adam_v/<name>": "after k = 1..N full training steps (forward, backward, clip, "
                                              "AdamW): the parameter and AdamW's first and second moments",
    }


def _results(config: Any) -> dict[str, Any]:
    """The manifest's `results`: what a port's results file holds, under which names, in which layout."""
    return {
        "file": "one .npz; any subset of the depths, each complete; float32 or float64 (say which with "
                "`harness kit check --dtype` if the arrays were upcast)",
        "names": {"taps": "tap/<name> (any subset of taps.names)", "logits": "logits",
                  "gradients": "grad/<name>",
                  **({"dropout_gradients": "dropout_grad/<name>"} if config.dropout > 0 else {}),
                  "optimizer": "opt/<k>/param|adam_m|adam_v/<name> (k = 1..K, K <= steps)", "loss": "loss"},
        "shapes": "canonical (as in expected.npz), C order as numpy writes; NPZ.jl's npzwrite writes a Julia "
                  "array of the canonical shape correctly (it records Fortran order)",
        "graded": "each optimizer step k from the port's own state: the oracle takes step k from the port's "
                  "opt/<k-1> (the weights and zero moments for k = 1) and the port's opt/<k> is compared with that; "
                  "expected.npz's opt/<k> are the oracle's own free run, the same at step 1, then apart by the "
                  "rounding that grows over the steps",
    }


def check_memory(config: Any, corpus: Any, seed: int, out: Path, steps: int, allow_large: bool = False) -> None:
    """The memory preflight of `harness run` and `harness parity`, before anything is computed (UsageError when the
    estimate exceeds the machine's memory, unless `allow_large`): the oracle is one float64 NumPy worker, and the
    parameters and AdamW moments after each of the `steps` steps are kept (in the arrays and again in their NPZ
    bytes), as a parity probe keeps them for its optimizer steps."""
    from harness.backends import ORACLE
    from harness.run import plan
    from harness.store import ParityOptions

    plan.check_memory(plan.Plan(config=config, corpus=corpus, backends=[ORACLE], seed=seed, out=out,
                                backend_options={ORACLE: {"dtype": "float64"}},
                                parity=ParityOptions(opt_steps=steps), probe_fix="export fewer steps (--steps N)",
                                allow_large=allow_large))


def export_kit(config: Any, size: str | None, corpus: Any, seed: int, steps: int, out: Path,
               progress: bool = True) -> dict[str, bytes]:
    """Compute the kit with the oracle and write it into `out` (checked by `check_out`), manifest.json last; the
    kit files' bytes by name. `size`: the preset whose measured tolerances the manifest records (None: a config of
    one's own)."""
    files, _ = compute(config, corpus, seed, steps, progress=progress)
    blobs = {name: npz_bytes(arrays) for name, arrays in files.items()}
    manifest = build_manifest(config, size, corpus, seed, steps, files, blobs)
    write_kit(out, blobs, (json.dumps(manifest, indent=1) + "\n").encode())
    return blobs
