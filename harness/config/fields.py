"""Size presets and user configs: one TOML file per size, read and validated here, used by every backend.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover
    pass
from harness.errors import UsageError

SCHEMES = ("epochs", "random")


GELUS = ("tanh", "exact")  # GELU forms: the tanh approximation, or exact x * Phi(x) with erf (nanoGPT's nn.GELU())


DECAYS = ("nanogpt", "mingpt")  # weight-decay conventions (harness.core.weights.decays)


LR_SCHEDULES = ("constant", "cosine")  # harness.core.schedule.learning_rate: nanoGPT's get_lr


# The fields added after records existed (their defaults, in Config, mean the original model and optimizer: see
# OPTION_DEFAULTS below the class): the model options, read from a TOML's [model], and the optimizer's, from [train]
MODEL_OPTIONS = ("tie_embeddings", "gelu", "bias", "lm_head_bias", "attn_dropout")


TRAIN_OPTIONS = ("decay", "lr_schedule", "warmup_steps", "decay_steps", "min_lr")


OPTION_NAMES = MODEL_OPTIONS + TRAIN_OPTIONS


SEED_MAX = 2**32 - 1  # every RNG the harness seeds (NumPy PCG64 seed sequences, torch) takes [0, 2**32 - 1]


# a config name becomes part of run ids, file names and page titles: a short plain name, never a path
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


# The largest whole number a config field may hold: 2**53 is exact in a float64 (JSON readers, the reports'
# JavaScript), and products of a few such fields (the memory estimate) stay far inside a float's range.
MAX_INT = 2**53


def short(value: object, limit: int = 60) -> str:
    """repr(value) cut to about `limit` characters (reprlib-style, '...' in the middle): an error message stays one
    short line however long the value (a config file may hold a string of a megabyte)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    half = (limit - 3) // 2
    return f"{text[:half]}...{text[-half:]}"


def check_seed(seed: object, option: str = "--seed") -> int:
    """A seed must be a whole number in [0, 2**32 - 1]."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= SEED_MAX:
        raise UsageError(f"{option} {short(seed)} is out of range; pass a whole number from 0 to {SEED_MAX}")
    return seed


def seed_arg(text: str) -> int:
    """argparse type of --seed: a whole number in [0, 2**32 - 1]."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: a seed is a whole number from 0 to {SEED_MAX}")
    return value


@dataclass(frozen=True)
class Config:
    """Every hyper-parameter of one run. Field names are the TOML keys of their section."""

    name: str
    # [model]
    n_embd: int
    block_size: int
    n_layer: int
    n_head: int
    d_hidden: int
    dropout: float
    # [train]
    batch_size: int
    learning_rate: float
    epochs: int
    scheme: str
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    grad_clip: float
    # [eval]
    eval_interval: int
    eval_batches: int
    # schedule override: when set, train exactly this many steps instead of `epochs` epochs
    steps: int | None = None
    # [eval] target_val_loss (optional): time to target is the training time until the validation loss reaches it
    target_val_loss: float | None = None
    # [model] options (optional; OPTION_DEFAULTS is the original model): lm_head shares wte's matrix; GELU form;
    # biases in every Linear and LayerNorm of the blocks and ln_f (nanoGPT's `bias`); a bias in lm_head; dropout (with
    # probability `dropout`) also on the attention probabilities, nanoGPT's fourth site (its attn_dropout)
    tie_embeddings: bool = False
    gelu: str = "tanh"
    bias: bool = True
    lm_head_bias: bool = True
    attn_dropout: bool = False
    # [train] options: which parameters AdamW decays; the learning-rate schedule (harness.core.schedule)
    decay: str = "nanogpt"
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    decay_steps: int | None = None
    min_lr: float = 0.0

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def replace(self, **changes: object) -> Config:
        """A copy with some fields changed, validated again."""
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of every field: two runs with one hash ran the same hyper-parameters.

        An option at its OPTION_DEFAULTS value is left out (only `options()` are hashed), so a config that uses no
        option hashes as it did before the options existed (records and sweeps keep comparing equal across the
        change)."""
        doc = {k: v for k, v in self.to_dict().items() if k not in OPTION_DEFAULTS}
        doc.update(self.options())
        blob = json.dumps(doc, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def options(self) -> dict[str, object]:
        """The model and optimizer options that differ from the original model (empty: the original)."""
        return {k: getattr(self, k) for k, v in OPTION_DEFAULTS.items() if getattr(self, k) != v}

    def validate(self) -> None:
        """Raise UsageError naming the first invalid field and what would be valid."""
        if not isinstance(self.name, str) or not NAME_RE.match(self.name) or ".." in self.name:
            raise UsageError(f"config name {short(self.name)} is not a plain name (letters, digits, '.', '_', '-'; at "
                             "most 64 characters, no '/', '..' or spaces); set name = \"...\" in the TOML file")
        where = f"config {self.name!r}"
        for key in ("n_embd", "block_size", "n_layer", "n_head", "d_hidden", "batch_size",
                    "epochs", "eval_interval", "eval_batches"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_INT:
                raise UsageError(f"{where}: {key} must be a positive integer (at most 2**53), got {short(value)}")
        if self.steps is not None and (not isinstance(self.steps, int) or isinstance(self.steps, bool)
                                       or not 0 < self.steps <= MAX_INT):
            raise UsageError(f"{where}: steps must be a positive integer (at most 2**53), got {short(self.steps)}")
        if self.target_val_loss is not None and (
                not isinstance(self.target_val_loss, (int, float)) or isinstance(self.target_val_loss, bool)
                or not math.isfinite(self.target_val_loss) or self.target_val_loss <= 0):
            raise UsageError(f"{where}: target_val_loss must be a positive number, got {short(self.target_val_loss)}")
        if self.n_embd % self.n_head:
            raise UsageError(f"{where}: n_head={self.n_head} does not divide n_embd={self.n_embd}; "
                             "choose a head count that divides the embedding width")
        for key in ("dropout", "learning_rate", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise UsageError(f"{where}: {key} must be a finite number, got {short(value)}")
        if not 0 <= self.dropout < 1:
            raise UsageError(f"{where}: dropout must be in [0, 1), got {self.dropout}")
        if self.learning_rate <= 0:
            raise UsageError(f"{where}: learning_rate must be positive, got {self.learning_rate}")
        if self.eps <= 0:
            raise UsageError(f"{where}: eps must be positive, got {self.eps}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise UsageError(f"{where}: weight_decay and grad_clip must be >= 0 (grad_clip 0 disables clipping)")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise UsageError(f"{where}: {key} must be in [0, 1), got {getattr(self, key)}")
        if self.scheme not in SCHEMES:
            raise UsageError(f"{where}: scheme must be one of {', '.join(SCHEMES)}, got {short(self.scheme)}")
        self._validate_options(where)

    def _validate_options(self, where: str) -> None:
        """The model options and the learning-rate schedule (OPTION_DEFAULTS)."""
        for key in ("tie_embeddings", "bias", "lm_head_bias", "attn_dropout"):
            if not isinstance(getattr(self, key), bool):
                raise UsageError(f"{where}: {key} must be true or false, got {short(getattr(self, key))}")
        for key, allowed in (("gelu", GELUS), ("decay", DECAYS), ("lr_schedule", LR_SCHEDULES)):
            if getattr(self, key) not in allowed:
                raise UsageError(f"{where}: {key} must be one of {', '.join(allowed)}, got {short(getattr(self, key))}")
        w, d = self.warmup_steps, self.decay_steps
        if not isinstance(w, int) or isinstance(w, bool) or not 0 <= w <= MAX_INT:
            raise UsageError(f"{where}: warmup_steps must be a whole number >= 0 (at most 2**53), got {short(w)}")
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or not w < d <= MAX_INT):
            raise UsageError(f"{where}: decay_steps must be a whole number > warmup_steps ({w}), at most 2**53, "
                             f"got {short(d)}")
        m = self.min_lr
        if not isinstance(m, (int, float)) or isinstance(m, bool) or not math.isfinite(m) \
                or not 0 <= m <= self.learning_rate:
            raise UsageError(f"{where}: min_lr must be a number in [0, learning_rate = {self.learning_rate:g}], "
                             f"got {short(m)}")
        if self.lr_schedule == "cosine" and d is None:
            raise UsageError(f"{where}: lr_schedule = \"cosine\" needs decay_steps (nanoGPT's lr_decay_iters: the "
                             "step where the cosine reaches min_lr), e.g. decay_steps = 2000")
        if self.lr_schedule == "constant" and (d is not None or m != 0):
            raise UsageError(f"{where}: decay_steps and min_lr belong to lr_schedule = \"cosine\"; with a constant "
                             "learning rate leave them out (warmup_steps may stay)")


# The options' values that mean the original model and optimizer, from Config's own defaults. A stored config without
# them (a record or spec.json written before) has exactly these values; `config_hash` leaves a field at this value
# out, so the hash of every config that does not use an option is what it was before the option existed.
OPTION_DEFAULTS: dict[str, object] = {f.name: f.default for f in dataclasses.fields(Config) if f.name in OPTION_NAMES}


assert len(OPTION_DEFAULTS) == len(OPTION_NAMES), "every option is a Config field with a default"


_SECTIONS = {  # required keys
    "model": ("n_embd", "block_size", "n_layer", "n_head", "d_hidden", "dropout"),
    "train": ("batch_size", "learning_rate", "epochs", "scheme", "weight_decay", "beta1", "beta2", "eps",
              "grad_clip"),
    "eval": ("interval", "batches"),
}


# keys a TOML may leave out (read into the field of the same name); [train] steps (nanoGPT's max_iters) makes
# epochs optional
_OPTIONAL = {"model": MODEL_OPTIONS, "train": ("steps", *TRAIN_OPTIONS), "eval": ("target_val_loss",)}


def config_from_dict(doc: object, source: str) -> Config:
    """A Config from its stored dict (spec.json, a record): unknown, missing or invalid keys are a UsageError."""
    names = [f.name for f in dataclasses.fields(Config)]
    if not isinstance(doc, dict):
        raise UsageError(f"{source}: field 'config' is not a table; that run cannot be used")
    unknown = sorted(set(doc) - set(names))
    optional = {f.name for f in dataclasses.fields(Config) if f.default is not dataclasses.MISSING}
    missing = [n for n in names if n not in doc and n not in optional]
    if unknown or missing:
        what = f"unknown key(s) {', '.join(unknown)}" if unknown else f"missing key(s) {', '.join(missing)}"
        raise UsageError(f"{source}: field 'config' has {what}; that run cannot be used, start a new run")
    config = Config(**doc)
    try:
        config.validate()
    except (UsageError, TypeError) as exc:
        raise UsageError(f"{source}: field 'config' is invalid ({exc})") from None
    return config
