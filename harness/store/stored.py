"""The typed form of a stored JSON document: a dataclass whose fields are the document's keys.

pyperf's model (`pyperf/_bench.py`: `Benchmark`, `Run`): every record the harness writes and reads back is an object
with a `load` (the bounded, schema-checked reader of harness.files, then `from_dict`) and a `dump` (`to_dict`, then
an atomic write), and code reads its attributes, never its keys.

`Stored` converts between a dataclass and its JSON object by the fields' type hints: a field typed with another
`Stored` class (alone, optional, in a list or as the values of a dict) is converted with it; anything else is taken
as it is (numbers, strings, lists and dicts of plain values). Keys a class does not know (written by another version
of the harness, or added by hand) are kept in `extra`, so a record read and written again never knows less than
before. A field named in a class's `OMIT_NONE` is left out of the JSON while it is None (a key the harness writes only
sometimes, e.g. `failure` beside a failed status); every other field is always written, None as null. An object read
from JSON is written back as it was read: its keys in their order, a key it lacked left out while the field still
holds its default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from harness.errors import UsageError
from harness.files import check_version, read_json, validate

S = TypeVar("S", bound="Stored")
_NONE = type(None)


@dataclasses.dataclass(kw_only=True)
class Stored:
    """A JSON object as a dataclass (see the module docstring); subclasses are `@dataclass(kw_only=True)`."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ()  # fields left out of the JSON while they are None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls: type[S], doc: dict[str, Any]) -> S:
        """The object of JSON object `doc` (already checked against its schema); unknown keys go to `extra`."""
        if not isinstance(doc, dict):
            raise TypeError(f"{cls.__name__}: {type(doc).__name__} is not a JSON object")
        hints = _hints(cls)
        known = {k: _load(hints[k], v) for k, v in doc.items() if k in hints and k != "extra"}
        obj = cls(**known, extra={k: v for k, v in doc.items() if k not in hints or k == "extra"})
        obj._read_keys = tuple(doc)  # type: ignore[attr-defined]  # written back in this order (`to_dict`)
        return obj

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of this object: its fields in order (`OMIT_NONE` ones only when set), then `extra`; an
        object read from JSON keeps the keys it was read with, in their order."""
        read = getattr(self, "_read_keys", None)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or (value is None and f.name in self.OMIT_NONE) or \
                    (read is not None and f.name not in read and value == _default(f)):
                continue
            out[f.name] = _dump(value)
        out.update((k, v) for k, v in self.extra.items() if k not in out)
        if read:
            out = {**{k: out[k] for k in read if k in out}, **out}
        return out


def _default(f: dataclasses.Field) -> Any:
    """A field's default value (None when it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a Stored class's fields (cached on the class)."""
    cached = cls.__dict__.get("_stored_hints")
    if cached is None:
        hints = typing.get_type_hints(cls)
        cached = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
        cls._stored_hints = cached  # type: ignore[attr-defined]
    return cached


def _stored(hint: Any) -> type[Stored] | None:
    """The Stored class of `hint` (`X`, `X | None`), or None when it is a plain type."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not _NONE]
        hint = args[0] if len(args) == 1 else None
    return hint if isinstance(hint, type) and issubclass(hint, Stored) else None


def _load(hint: Any, value: Any) -> Any:
    """`value` read from JSON as type `hint`: Stored classes (alone, optional, in a list, as dict values)
    converted, anything else as it is."""
    if value is None:
        return None
    cls = _stored(hint)
    if cls is not None:
        return cls.from_dict(value)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next((a for a in typing.get_args(hint) if typing.get_origin(a) in (list, dict)), hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list and args and _stored(args[0]) is not None:
        return [_load(args[0], v) for v in value]
    if origin is dict and len(args) == 2 and _stored(args[1]) is not None:
        return {k: _load(args[1], v) for k, v in value.items()}
    return value


def _dump(value: Any) -> Any:
    """`value` as JSON: Stored objects (alone, in a list, as dict values) as their dicts, anything else as it is."""
    if isinstance(value, Stored):
        return value.to_dict()
    if isinstance(value, list) and value and isinstance(value[0], Stored):
        return [_dump(v) for v in value]
    if isinstance(value, dict) and value and isinstance(next(iter(value.values())), Stored):
        return {k: _dump(v) for k, v in value.items()}
    return value


def read_document(path: Path, kind: str, what: str, fix: str, max_bytes: int, version: int,
                  schema: dict | None = None, too_big: str = "", foreign: str = "", label: str = "",
                  oldest: int | None = None) -> dict[str, Any]:
    """The JSON object in `path`, read within `max_bytes` (harness.files.read_json), of schema `kind` at `version`
    (or from `oldest` on: harness.files.check_version) and valid against JSON schema `schema`: UsageError in one
    line naming the file (and the field) otherwise. `what` names the file in messages ("run record"), `label` the
    kind it is not (default `what`); `foreign` says what to do with a file of another kind (default `fix`, "."
    nothing; "schema": a file that is no JSON object is refused by `schema`, naming its top level)."""
    doc = read_json(path, what, fix, max_bytes, too_big or f"no harness writes so much; {fix}")
    if foreign == "schema" and not isinstance(doc, dict) and schema is not None:
        validate(doc, schema, path, fix)
    if not isinstance(doc, dict) or doc.get("schema") != kind:
        tail = "" if foreign == "." else f"; {fix if foreign in ('', 'schema') else foreign}"
        raise UsageError(f"{str(path)!r} is not a nanogpt-parity {label or what}{tail}")
    check_version(doc, path, version, oldest)
    if schema is not None:
        validate(doc, schema, path, fix)
    return doc


def typed(cls: type[S], doc: dict[str, Any], path: Path, fix: str) -> S:
    """`cls.from_dict(doc)`, a document its schema let through but whose shape still does not fit the type being a
    UsageError naming the file (never a traceback)."""
    try:
        return cls.from_dict(doc)
    except (TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"{str(path)!r} is invalid ({exc}); {fix}") from None
