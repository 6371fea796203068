"""Size presets and user configs: one TOML file per size, read and validated here, used by every backend."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from harness.errors import UsageError

SIZES = ("small", "medium", "large")
SCHEMES = ("epochs", "random")


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
        """sha256 of the canonical JSON of every field: two runs with one hash ran the same hyper-parameters."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def validate(self) -> None:
        """Raise UsageError naming the first invalid field and what would be valid."""
        where = f"config {self.name!r}"
        for key in ("n_embd", "block_size", "n_layer", "n_head", "d_hidden", "batch_size",
                    "epochs", "eval_interval", "eval_batches"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"{where}: {key} must be a positive integer, got {value!r}")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps <= 0):
            raise UsageError(f"{where}: steps must be a positive integer, got {self.steps!r}")
        if self.target_val_loss is not None and (
                not isinstance(self.target_val_loss, (int, float)) or isinstance(self.target_val_loss, bool)
                or not math.isfinite(self.target_val_loss) or self.target_val_loss <= 0):
            raise UsageError(f"{where}: target_val_loss must be a positive number, got {self.target_val_loss!r}")
        if self.n_embd % self.n_head:
            raise UsageError(f"{where}: n_head={self.n_head} does not divide n_embd={self.n_embd}; "
                             "choose a head count that divides the embedding width")
        for key in ("dropout", "learning_rate", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise UsageError(f"{where}: {key} must be a finite number, got {value!r}")
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
            raise UsageError(f"{where}: scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")


_SECTIONS = {
    "model": ("n_embd", "block_size", "n_layer", "n_head", "d_hidden", "dropout"),
    "train": ("batch_size", "learning_rate", "epochs", "scheme", "weight_decay", "beta1", "beta2", "eps",
              "grad_clip"),
    "eval": ("interval", "batches"),
}
_OPTIONAL = {"eval": ("target_val_loss",)}  # keys a TOML may leave out (read into the field of the same name)


def _from_mapping(doc: dict, source: str) -> Config:
    fields: dict[str, object] = {"name": doc.get("name", Path(source).stem)}
    unknown = set(doc) - {"name", *_SECTIONS}
    if unknown:
        raise UsageError(f"{source}: unknown top-level key(s) {', '.join(sorted(unknown))}; "
                         f"expected name and the sections [{'], ['.join(_SECTIONS)}]")
    for section, keys in _SECTIONS.items():
        table = doc.get(section)
        if not isinstance(table, dict):
            raise UsageError(f"{source}: missing section [{section}]; copy one from `harness sizes --toml small`")
        extra = set(table) - set(keys) - set(_OPTIONAL.get(section, ()))
        if extra:
            raise UsageError(f"{source}: unknown key(s) {', '.join(sorted(extra))} in [{section}]; "
                             f"allowed: {', '.join((*keys, *_OPTIONAL.get(section, ())))}")
        for key in keys:
            if key not in table:
                raise UsageError(f"{source}: missing {key} in [{section}]; "
                                 "copy the full preset from `harness sizes --toml small`")
            fields[key if section != "eval" else f"eval_{key}"] = table[key]
        fields.update({key: table[key] for key in _OPTIONAL.get(section, ()) if key in table})
    config = Config(**fields)  # type: ignore[arg-type]
    config.validate()
    return config


def preset_path(size: str) -> Path:
    """The packaged TOML file of a size preset."""
    if size not in SIZES:
        raise UsageError(f"unknown size {size!r}; choose one of {', '.join(SIZES)} or pass --config FILE")
    return Path(str(resources.files("harness.configs").joinpath(f"{size}.toml")))


def load_config(size: str | None = None, path: str | Path | None = None) -> Config:
    """Load a size preset by name, or a user's TOML file (which wins)."""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"config file {str(path)!r} does not exist; pass the path of a TOML file")
        try:
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path}: not valid TOML ({exc}); fix the syntax or start from "
                             "`harness sizes --toml small`") from None
        return _from_mapping(doc, str(path))
    source = preset_path(size or "small")
    return _from_mapping(tomllib.loads(source.read_text(encoding="utf-8")), str(source))
