"""karpathy/nanoGPT's configuration language: its config files, read safely, and its names on `--set`.

nanoGPT configures train.py with Python files of `name = value` lines (config/train_shakespeare_char.py), which its
configurator exec()s, and with `--name=value` overrides. The harness never executes such a file: it parses it with
`ast` and accepts only `name = literal` statements (and comments, a docstring); anything else, a name train.py does
not have or a value the harness cannot honour is a UsageError naming it. What a file leaves out keeps train.py's
default (DEFAULTS), as in train.py; the result becomes a harness Config with nanoGPT's model (tied embeddings, exact
GELU, `bias` in the blocks, no lm_head bias, MLP 4 x n_embd, dropout on the attention probabilities too: model.py's
attn_dropout, always there) and its sampling (random offsets).

`--set NAME=VALUE` overrides work on every config: with a nanoGPT file in nanoGPT's names (before the translation,
as nanoGPT's `--name=value`), otherwise in the harness's field names, where nanoGPT's names are accepted as aliases
(max_iters, lr_decay_iters, warmup_iters, eval_iters, decay_lr).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from harness.config.fields import Config, short
from harness.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# train.py's defaults (nanoGPT 3adf61e, "default config values designed to train a gpt2 (124M) on OpenWebText"):
# what a config file does not set keeps these values, as in train.py. `dtype` depends on the GPU there; it only
# chooses CUDA autocast, which the harness does not take from a config file.
DEFAULTS: dict[str, Any] = {
    "out_dir": "out", "eval_interval": 2000, "log_interval": 1, "eval_iters": 200, "eval_only": False,
    "always_save_checkpoint": True, "init_from": "scratch", "wandb_log": False, "wandb_project": "owt",
    "wandb_run_name": "gpt2", "dataset": "openwebtext", "gradient_accumulation_steps": 5 * 8, "batch_size": 12,
    "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768, "dropout": 0.0, "bias": False,
    "learning_rate": 6e-4, "max_iters": 600000, "weight_decay": 1e-1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0,
    "decay_lr": True, "warmup_iters": 2000, "lr_decay_iters": 600000, "min_lr": 6e-5, "backend": "nccl",
    "device": "cuda", "dtype": "float16", "compile": True,
}
# Names that change nothing the harness computes: output, logging, and the machine (given to the harness by its own
# options). Read and type-checked, then reported as not used.
NOT_USED = {"out_dir": "output", "log_interval": "logging", "always_save_checkpoint": "checkpoints",
            "wandb_log": "logging", "wandb_project": "logging", "wandb_run_name": "logging",
            "backend": "DDP", "device": "--device", "dtype": "--dtype/--precision", "compile": "--compile"}
# Values the harness has no counterpart for: name -> (the value it can run, why).
REQUIRED = {"gradient_accumulation_steps": (1, "the harness takes one batch per optimizer step"),
            "dataset": ("shakespeare_char", "the harness trains character-level models on --data (default Tiny "
                                            "Shakespeare)"),
            "init_from": ("scratch", "the harness starts from its own seeded initial weights"),
            "eval_only": (False, "`harness run` trains")}
# nanoGPT names accepted by `--set` on a harness config, and the harness field each sets.
ALIASES = {"max_iters": "steps", "lr_decay_iters": "decay_steps", "warmup_iters": "warmup_steps",
           "eval_iters": "eval_batches"}
FIELDS = {f.name for f in fields(Config)}


# A `--set` value is a number, a word or a short name (a config name is at most 64 characters): anything longer is
# not one, and a bound keeps the parsers below from being fed megabytes (deep nesting, huge integers).
MAX_SET_CHARS = 256
# What Python's and TOML's parsers raise on hostile text besides their syntax errors: an integer past Python's
# digit limit (ValueError), nesting past the parser's stack (MemoryError) or the recursion limit (RecursionError).
PARSE_ERRORS = (ValueError, MemoryError, RecursionError)


def parse_value(text: str, option: str = "--set") -> Any:
    """A `--set` value: a Python literal (as nanoGPT's configurator reads it: 1e-3, False, 'x'), else TOML's
    spelling (true, false), else the text itself. Text longer than MAX_SET_CHARS, or that makes either parser fail
    other than by a syntax error, is a UsageError naming `option`."""
    if len(text) > MAX_SET_CHARS:
        raise UsageError(f"{option} value {short(text)} is {len(text):,} characters long; a value is a number, "
                         f"true/false or a short name (at most {MAX_SET_CHARS} characters)")
    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError):
        pass  # not a Python literal (or an integer past the digit limit: TOML refuses that below)
    except (MemoryError, RecursionError):
        raise UsageError(f"{option} value {short(text)} is nested too deeply to read; write a number, true/false "
                         "or a name") from None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except PARSE_ERRORS as exc:
        raise UsageError(f"{option} value {short(text)} cannot be read ({short(str(exc), 80)}); write a number, "
                         "true/false or a name") from None


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """`--set NAME=VALUE` (repeatable) -> {NAME: value}, in the order given; UsageError for a malformed item."""
    out: dict[str, Any] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        name = name.strip().removeprefix("--")
        if not sep or not name or not value.strip():
            raise UsageError(f"--set {item!r}: write NAME=VALUE, e.g. --set tie_embeddings=true or "
                             "--set max_iters=2000")
        if name in out:
            raise UsageError(f"--set {name} given twice; give each name once")
        out[name] = parse_value(value.strip(), f"--set {name}")
    return out


def _typed(name: str, value: Any, where: str) -> Any:
    """`value` checked against the type of train.py's default (an int is accepted for a float, as Python would)."""
    want = type(DEFAULTS[name])
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not want:
        raise UsageError(f"{where}: {name} = {short(value)} is a {type(value).__name__}, nanoGPT's {name} is a "
                         f"{want.__name__} (default {DEFAULTS[name]!r})")
    return value


def read_file(path: Path) -> dict[str, Any]:
    """The `name = literal` assignments of a nanoGPT config file, in order (a later one wins, as under exec).

    Never executes the file: anything but a literal assignment to a plain name (imports, calls, expressions,
    f-strings, several targets) is a UsageError naming the line.
    """
    from harness.config.presets import MAX_TOML_BYTES
    from harness.files import read_regular

    blob = read_regular(path, "config file", "pass the path of a TOML file or a nanoGPT config .py", MAX_TOML_BYTES)
    try:
        tree = ast.parse(blob.decode("utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, *PARSE_ERRORS) as exc:  # nesting too deep: MemoryError, RecursionError
        reason = short(str(exc), 80) if str(exc) else type(exc).__name__
        raise UsageError(f"{path}: not a Python file of literal assignments ({reason}); nanoGPT config files hold "
                         "lines like `n_layer = 6`") from None
    values: dict[str, Any] = {}
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            continue  # a docstring
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if not isinstance(target, ast.Name):
            raise UsageError(f"{path}:{node.lineno}: only `name = literal` lines are read (the file is never run); "
                             f"this line is a {type(node).__name__} statement; remove it or pass the value with --set")
        try:
            values[target.id] = ast.literal_eval(node.value)
        except (ValueError, MemoryError, RecursionError):  # not a literal, or one nested past the recursion limit
            raise UsageError(f"{path}:{node.lineno}: {target.id} is not given a literal (a number, string, "
                             "True/False); the file is never run, so write the value itself") from None
    return values


def to_config(values: dict[str, Any], name: str, where: str) -> tuple[Config, list[str]]:
    """A harness Config from nanoGPT's names (over train.py's DEFAULTS) and the names read but not used."""
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise UsageError(f"{where}: unknown nanoGPT config name(s) {', '.join(unknown)}; train.py knows "
                         f"{', '.join(sorted(DEFAULTS))}")
    v = {k: _typed(k, values.get(k, d), where) for k, d in DEFAULTS.items()}
    for key, (wanted, why) in REQUIRED.items():
        if v[key] != wanted:
            given = "" if key in values else " (train.py's default)"
            raise UsageError(f"{where}: {key} = {v[key]!r}{given} is not supported: {why}; set {key} = {wanted!r}")
    decay = v["decay_lr"]
    config = Config(
        name=name, n_embd=v["n_embd"], block_size=v["block_size"], n_layer=v["n_layer"], n_head=v["n_head"],
        d_hidden=4 * v["n_embd"], dropout=v["dropout"], batch_size=v["batch_size"], learning_rate=v["learning_rate"],
        epochs=1, scheme="random", weight_decay=v["weight_decay"], beta1=v["beta1"], beta2=v["beta2"], eps=1e-8,
        grad_clip=v["grad_clip"], eval_interval=v["eval_interval"], eval_batches=v["eval_iters"],
        steps=v["max_iters"], tie_embeddings=True, gelu="exact", bias=v["bias"], lm_head_bias=False, attn_dropout=True,
        decay="nanogpt", lr_schedule="cosine" if decay else "constant",
        warmup_steps=v["warmup_iters"] if decay else 0, decay_steps=v["lr_decay_iters"] if decay else None,
        min_lr=v["min_lr"] if decay else 0.0)
    try:
        config.validate()
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    return config, sorted(k for k in values if k in NOT_USED)


def load(path: Path, overrides: dict[str, Any]) -> Config:
    """A nanoGPT config file plus `--set` overrides (nanoGPT's names first; harness field names, e.g. gelu, on the
    translated config) as a validated Config; prints one line naming what was read but not used."""
    values = read_file(path)
    harness_only = {k: v for k, v in overrides.items() if k not in DEFAULTS}
    bad = sorted(k for k in harness_only if k not in FIELDS)
    if bad:
        raise UsageError(f"--set {', '.join(bad)}: not a nanoGPT config name nor a harness config field; nanoGPT "
                         f"knows {', '.join(sorted(DEFAULTS))}")
    values.update({k: v for k, v in overrides.items() if k in DEFAULTS})
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", path.stem).strip("._-")[:64] or "nanogpt"  # a plain run name
    config, not_used = to_config(values, name, str(path))
    if not_used:
        print(f"nanoGPT config {path.name}: not used by the harness: "
              + ", ".join(f"{k} ({NOT_USED[k]})" for k in not_used), file=sys.stderr)
    return apply_overrides(config, harness_only) if harness_only else config


def apply_overrides(config: Config, overrides: dict[str, Any] | None) -> Config:
    """`config` with `--set` overrides in the harness's field names (nanoGPT's ALIASES and decay_lr accepted).

    As in sweeps, when n_embd changes and d_hidden is not given, d_hidden keeps its ratio to n_embd.
    """
    changes: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if key == "decay_lr":
            if not isinstance(value, bool):
                raise UsageError(f"--set decay_lr={value!r}: write True or False")
            changes["lr_schedule"] = "cosine" if value else "constant"
            if not value:
                changes.update(warmup_steps=0, decay_steps=None, min_lr=0.0)
            continue
        field = ALIASES.get(key, key)
        if field not in FIELDS:
            raise UsageError(f"--set {key}: unknown config field; fields: {', '.join(sorted(FIELDS))} (and nanoGPT's "
                             f"{', '.join(sorted([*ALIASES, 'decay_lr']))})")
        if field in changes:
            raise UsageError(f"--set {key} and its other name both given; give one")
        changes[field] = value
    if "n_embd" in changes and "d_hidden" not in changes and isinstance(changes["n_embd"], int):
        changes["d_hidden"] = max(1, round(config.d_hidden * changes["n_embd"] / config.n_embd))
    try:
        return config.replace(**changes)
    except TypeError as exc:
        raise UsageError(f"--set: {exc}") from None
