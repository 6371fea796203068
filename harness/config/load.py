"""The one front door to a run's config: a preset by name, a TOML file, or a nanoGPT config `.py`, then `--set`.

Kept apart from harness.config.fields (the Config type and its TOML presets) and harness.config.nanogpt (nanoGPT's
configuration language, translated into a Config) so that both stay below it and neither imports the other's caller.
"""

from __future__ import annotations

from pathlib import Path

from harness.config import nanogpt
from harness.config.fields import Config
from harness.config.presets import read_preset, read_toml


def load_config(size: str | None = None, path: str | Path | None = None,
                overrides: dict[str, object] | None = None) -> Config:
    """Load a preset by name, or a config file (which wins): TOML, or a nanoGPT config `.py` (read, never run:
    harness.config.nanogpt); then `overrides` (`--set`: field names, or nanoGPT's names) on top."""
    if path is not None and Path(path).suffix == ".py":
        return nanogpt.load(Path(path), overrides or {})
    config = read_toml(path) if path is not None else read_preset(size or "small")
    return nanogpt.apply_overrides(config, overrides) if overrides else config
