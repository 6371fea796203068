"""The packaged presets (one TOML file per size or nanoGPT recipe, in toml/) and user TOML configs: read as bounded
files and validated into a Config.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
from harness.config.fields import _OPTIONAL, _SECTIONS, Config, short
from harness.errors import UsageError

SIZES = ("small", "medium", "large")  # the harness's own size presets (`--size all`)


RECIPES = ("nanogpt-cpu", "nanogpt-shakespeare-char")  # karpathy/nanoGPT's recipes as presets (docs/nanogpt.md)


PRESETS = SIZES + RECIPES  # every packaged TOML file, one per name


MAX_TOML_BYTES = 1 << 20  # a config or sweep file is a few hundred bytes: anything near this is not one


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
            if key == "epochs" and key not in table and "steps" in table:
                fields["epochs"] = 1  # not used: [train] steps says how long to train
                continue
            if key not in table:
                raise UsageError(f"{source}: missing {key} in [{section}]; "
                                 "copy the full preset from `harness sizes --toml small`")
            fields[key if section != "eval" else f"eval_{key}"] = table[key]
        fields.update({key: table[key] for key in _OPTIONAL.get(section, ()) if key in table})
    config = Config(**fields)  # type: ignore[arg-type]
    try:
        config.validate()
    except UsageError as exc:  # name the file: the message alone may not say where the bad value came from
        raise UsageError(f"{source}: {exc}") from None
    return config


def preset_path(size: str) -> Path:
    """The packaged TOML file of a preset (a size or a nanoGPT recipe)."""
    if size not in PRESETS:
        raise UsageError(f"unknown size {size!r}; choose one of {', '.join(PRESETS)} or pass --config FILE")
    return Path(str(resources.files("harness.config").joinpath("toml", f"{size}.toml")))


def read_toml(path: str | Path) -> Config:
    """A user's TOML config file, read as a bounded regular file and validated."""
    from harness.files import read_regular

    path = Path(path)
    blob = read_regular(path, "config file", "pass the path of a TOML file", MAX_TOML_BYTES,
                        "a config is a short TOML file (see `harness sizes --toml small`)")
    try:
        doc = tomllib.loads(blob.decode("utf-8"))
    # TOMLDecodeError is a ValueError; so is an integer past Python's digit limit; deep nesting of arrays or inline
    # tables runs out of recursion (RecursionError) or memory
    except (UnicodeDecodeError, ValueError, MemoryError, RecursionError) as exc:
        reason = short(str(exc), 120)[1:-1] if str(exc) else type(exc).__name__
        raise UsageError(f"{path}: not valid TOML ({reason}); fix the syntax or start from "
                         "`harness sizes --toml small`") from None
    return _from_mapping(doc, str(path))


def read_preset(size: str) -> Config:
    """A packaged preset (a size or a nanoGPT recipe) by name."""
    source = preset_path(size)
    return _from_mapping(tomllib.loads(source.read_text(encoding="utf-8")), str(source))
