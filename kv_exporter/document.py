"""Strict JSON documents described once: annotated dataclasses give both the reader and the JSON Schema.

A document's fields are a frozen dataclass's fields; their types and `Annotated` markers (`Range`, `NotBlank`,
`Doc`) are the whole description. `decode` turns decoded JSON into the dataclass or raises `DocumentError` with a
stable reason code; `json_schema` writes the same rules as JSON Schema 2020-12 for other readers. Fields declared
with `init=False` (and a `Derived` marker) are computed from the others: written to the document, and on reading
checked against what the dataclass computes (reason `inconsistent`). What a schema cannot say (duplicates, limits)
stays with the caller, by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, TypeVar, Union

from kv_exporter.printable import DETAIL_MAX_CHARS, printable

# Integers in a document must survive any JSON reader exactly.
MAX_SAFE_INT = 2**53 - 1
# Strings: a name or label value at most NAME_MAX_CHARS, a `Prose` field at most PROSE_MAX_CHARS. Together with the
# series cap they bound what one document can add to a scrape page.
NAME_MAX_CHARS = 256
PROSE_MAX_CHARS = 1024
# What no string in a document may hold: C0/C1 control characters and DEL (a terminal or a page would act on them),
# and lone surrogates (JSON's "\ud800" escapes decode to them; they cannot be encoded as UTF-8 at all).
_FORBIDDEN_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")

T = TypeVar("T")


@dataclass(frozen=True)
class Range:
    """The values a number may take (integers are also capped at MAX_SAFE_INT)."""

    minimum: int
    maximum: int = MAX_SAFE_INT


@dataclass(frozen=True)
class Since:
    """The document version that added the field: documents of older versions do not have it (it takes its default)."""

    version: int


@dataclass(frozen=True)
class NotBlank:
    """A string with at least one non-space character."""


@dataclass(frozen=True)
class Prose:
    """A string of explanation (PROSE_MAX_CHARS), not a name (NAME_MAX_CHARS)."""


@dataclass(frozen=True)
class VersionField:
    """The field that holds the document's version: a version's schema admits exactly that version there."""


@dataclass(frozen=True)
class Choice:
    """A string from a fixed list that is not an enum of ours; `explain` says what is wrong with another value."""

    values: tuple[str, ...]
    explain: Callable[[str], str]


@dataclass(frozen=True)
class Derived:
    """On an `init=False` field: what it is computed from, for the message when a document disagrees."""

    source: str


@dataclass(frozen=True)
class Doc:
    """A description carried into the JSON Schema."""

    text: str


# Every `DocumentError.reason` this module and the dataclasses' own checks give: metric label values, exported at 0
# before the first one happens (tests/unit/test_reasons.py finds every reason in the source and checks it is here).
DOCUMENT_ERROR_REASONS = (
    "wrong_type",
    "missing_field",
    "unknown_field",
    "out_of_range",
    "inconsistent",
    "invalid_value",
    "unknown_enum",
    "invalid_string",
    "too_long",
)


class DocumentError(ValueError):
    """A document that does not match its description: `reason` is a stable code, `detail` says where and why (what
    it quotes of the document made printable and short: it reaches pages, logs and terminals)."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = printable(detail, DETAIL_MAX_CHARS)
        super().__init__(f"{reason}: {self.detail}")


@dataclass(frozen=True)
class _Field:
    name: str
    kind: Any  # the type without Annotated and without None
    optional: bool
    markers: tuple[object, ...]
    derived: bool
    # What `_value` does with a value, worked out once: the type tests it made per value were most of the time a
    # manifest took to read (108 ms for 256 declarations; 2,000 such files took minutes on a first scrape).
    shape: str = dataclasses.field(init=False, compare=False)
    range: Range = dataclasses.field(init=False, compare=False)
    text_limit: int = dataclasses.field(init=False, compare=False)
    not_blank: bool = dataclasses.field(init=False, compare=False)
    choice: Choice | None = dataclasses.field(init=False, compare=False)
    _by_marker: dict[type, object] = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        by_marker: dict[type, object] = {}
        for m in self.markers:
            for kind in type(m).__mro__:
                by_marker.setdefault(kind, m)
        object.__setattr__(self, "_by_marker", by_marker)
        object.__setattr__(self, "shape", _shape(self.kind))
        object.__setattr__(self, "range", self.marker(Range) or Range(0))
        object.__setattr__(self, "text_limit", PROSE_MAX_CHARS if self.marker(Prose) else NAME_MAX_CHARS)
        object.__setattr__(self, "not_blank", self.marker(NotBlank) is not None)
        object.__setattr__(self, "choice", self.marker(Choice))

    def marker(self, kind: type[T]) -> T | None:
        return typing.cast("T | None", self._by_marker.get(kind))


def _shape(kind: Any) -> str:
    if dataclasses.is_dataclass(kind):
        return "object"
    if typing.get_origin(kind) is tuple:
        return "array"
    if kind in (bool, int, float):
        return str(kind.__name__)
    if typing.get_origin(kind) is Literal and not isinstance(typing.get_args(kind)[0], str):
        return "literal"
    return "str" if kind is str else "text"


_described: dict[type, tuple[_Field, ...]] = {}


# `field(metadata=NOT_IN_DOCUMENT)`: an attribute the reader fills in, never read from or written to a document.
NOT_IN_DOCUMENT: Mapping[str, bool] = {"document": False}


def _fields(cls: type) -> tuple[_Field, ...]:
    """The description of `cls`'s fields, worked out once per class (type hints are costly to evaluate)."""
    described = _described.get(cls)
    if described is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        fields = [f for f in dataclasses.fields(cls) if f.metadata.get("document", True)]
        described = _described[cls] = tuple(_describe(f.name, hints[f.name], not f.init) for f in fields)
    return described


def _describe(name: str, hint: Any, derived: bool) -> _Field:
    """Peel `Annotated[...]` and `... | None` off a hint, in whichever order they are nested."""
    markers: list[object] = []
    optional = False
    while True:
        if typing.get_origin(hint) is typing.Annotated:
            hint, *extra = typing.get_args(hint)
            markers.extend(extra)
        elif typing.get_origin(hint) in (Union, types.UnionType) and type(None) in typing.get_args(hint):
            (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
            optional = True
        else:
            return _Field(name, hint, optional, tuple(markers), derived)


@functools.cache
def serialised_fields(cls: type, version: int | None = None) -> tuple[str, ...]:
    """The field names a document of `cls` holds, in order (at `version`, or every field)."""
    return tuple(f.name for f in _in_version(cls, version))


@functools.cache
def _in_version(cls: type, version: int | None) -> tuple[_Field, ...]:
    return tuple(f for f in _fields(cls) if version is None or _since(f) <= version)


def _since(f: _Field) -> int:
    marker = f.marker(Since)
    return 0 if marker is None else marker.version


# -- writing ----------------------------------------------------------------------------------------------------


def encode(value: Any) -> Any:
    """A dataclass as its document: plain JSON values, enum members as their values, reader-only fields left out."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return {f.name: encode(getattr(value, f.name)) for f in fields if f.metadata.get("document", True)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [encode(item) for item in value]
    return value


# -- reading ----------------------------------------------------------------------------------------------------


def decode(cls: type[T], doc: object, where: str = "", version: int | None = None) -> T:
    """`doc` (decoded JSON) as `cls`, as documents of `version` spell it (None: the newest);
    raises DocumentError naming the field by its path below `where`."""
    name = where or cls.__name__.lower()
    obj = _object(doc, name, cls, version)
    fields = _in_version(typing.cast(type, cls), version)
    values = {f.name: _value(f, obj[f.name], _child(where, f.name), version) for f in fields}
    try:
        result = cls(**{f.name: values[f.name] for f in fields if not f.derived})
    except DocumentError as exc:  # a rule across fields, checked by the dataclass itself
        raise DocumentError(exc.reason, f"{name}: {exc.detail}") from None
    except ValueError as exc:
        raise DocumentError("invalid_value", f"{name}: {exc}") from None
    for f in fields:
        if f.derived and values[f.name] != getattr(result, f.name):
            source = f.marker(Derived)
            detail = (
                f"{_child(where, f.name)} = {values[f.name]!r}, but {source.source if source else 'the other fields'}"
            )
            raise DocumentError("inconsistent", f"{detail} give {getattr(result, f.name)!r}")
    return result


def _child(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _object(doc: object, where: str, cls: type, version: int | None) -> Mapping[str, Any]:
    if not isinstance(doc, dict):
        raise DocumentError("wrong_type", f"{where} must be an object, got {type(doc).__name__}")
    names = serialised_fields(cls, version)
    missing = [name for name in names if name not in doc]
    if missing:
        raise DocumentError("missing_field", f"{where} lacks {', '.join(missing)}")
    unknown = sorted(set(doc) - set(names))
    if unknown:
        raise DocumentError("unknown_field", f"{where} has unknown field(s) {', '.join(unknown)}")
    return doc


def _value(f: _Field, value: object, where: str, version: int | None) -> Any:
    if value is None and f.optional:
        return None
    kind, shape = f.kind, f.shape
    if shape == "object":
        return decode(typing.cast(type, kind), value, where, version)
    if shape == "array":
        item = _item(kind)
        if not isinstance(value, list):
            raise DocumentError("wrong_type", f"{where} must be an array, got {type(value).__name__}")
        return tuple(decode(item, element, f"{where}[{i}]", version) for i, element in enumerate(value))
    if shape == "bool":
        if not isinstance(value, bool):
            raise DocumentError("wrong_type", f"{where} must be true or false, got {type(value).__name__}")
        return value
    if shape == "int":
        return _integer(f, value, where)
    if shape == "float":
        return _number(f, value, where)
    if shape == "literal":
        if isinstance(value, bool) or value not in typing.get_args(kind):
            raise DocumentError("invalid_value", f"{where} = {value!r}; expected {typing.get_args(kind)}")
        return value
    text = _text(f, value, where)
    choice = f.choice
    if choice is not None and text not in choice.values:
        raise DocumentError("invalid_value", f"{where}: {choice.explain(text)}")
    if shape == "str":
        return text
    allowed = _allowed(kind, version)
    if text not in allowed:
        raise DocumentError("unknown_enum", f"{where} = {text!r}; expected one of {', '.join(map(str, allowed))}")
    return kind(text) if isinstance(kind, type) and issubclass(kind, Enum) else text


@functools.cache
def _item(kind: Any) -> Any:
    (item,) = [arg for arg in typing.get_args(kind) if arg is not Ellipsis]
    return item


def _integer(f: _Field, value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DocumentError("wrong_type", f"{where} must be an integer, got {type(value).__name__}")
    bounds = _range(f)
    if not bounds.minimum <= value <= bounds.maximum:
        raise DocumentError("out_of_range", f"{where} = {value} outside [{bounds.minimum}, {_bound(bounds.maximum)}]")
    return value


def _number(f: _Field, value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DocumentError("wrong_type", f"{where} must be a number, got {type(value).__name__}")
    bounds = _range(f)
    if not math.isfinite(value) or not bounds.minimum <= value <= bounds.maximum:
        limits = f"[{bounds.minimum}, {_bound(bounds.maximum)}]"
        raise DocumentError("out_of_range", f"{where} = {value} must be finite and within {limits}")
    return float(value)


def _text(f: _Field, value: object, where: str) -> str:
    if not isinstance(value, str):
        raise DocumentError("wrong_type", f"{where} must be a string, got {type(value).__name__}")
    return check_text(value, where, f.text_limit, f.not_blank)


def check_text(value: str, where: str, limit: int = NAME_MAX_CHARS, not_blank: bool = False) -> str:
    """`value` if a document may hold it where `where` is: at most `limit` characters, no control character or lone
    surrogate, and not blank if `not_blank`; else DocumentError. (Also the rule for what an engine page's labels
    may bring in: only what a manifest could say can match a manifest.)"""
    if len(value) > limit:
        raise DocumentError("too_long", f"{where} has {len(value)} characters; at most {limit}")
    forbidden = _FORBIDDEN_CHARACTERS.search(value)
    if forbidden:
        code = f"U+{ord(forbidden.group()):04X}"
        raise DocumentError(
            "invalid_string", f"{where} holds {code} at {forbidden.start()}: no control characters or lone surrogates"
        )
    if not_blank and not value.strip():
        raise DocumentError("invalid_value", f"{where} must not be blank")
    return value


def _range(f: _Field) -> Range:
    return f.range


def _bound(maximum: int) -> str:
    return "2**53-1" if maximum == MAX_SAFE_INT else str(maximum)


@functools.cache
def _allowed(kind: Any, version: int | None) -> tuple[object, ...]:
    """The values of a Literal, or of an enum at `version` (None: every version): a member its `__since__`
    (value -> version) dates later is not one yet."""
    if typing.get_origin(kind) is Literal:
        return typing.get_args(kind)
    since: dict[str, int] = getattr(kind, "__since__", {})
    return tuple(member.value for member in kind if version is None or since.get(member.value, 0) <= version)


# -- the JSON Schema --------------------------------------------------------------------------------------------


def json_schema(cls: type, version: int, *, schema_id: str, title: str, description: str) -> dict[str, Any]:
    """The JSON Schema 2020-12 of documents of `cls` at `version`."""
    header = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": schema_id, "title": title}
    return {**header, "description": description, **_object_schema(cls, version)}


def _object_schema(cls: type, version: int) -> dict[str, Any]:
    """An object of `cls`, plus what its `json_schema_rules()` classmethod (if any) says of rules across fields."""
    fields = _in_version(cls, version)
    rules = getattr(cls, "json_schema_rules", None)
    return {
        "type": "object",
        "additionalProperties": False,
        "required": [f.name for f in fields],
        "properties": {f.name: _field_schema(f, version) for f in fields},
        **(rules() if rules is not None else {}),
    }


def _string_schema(f: _Field) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "maxLength": PROSE_MAX_CHARS if f.marker(Prose) else NAME_MAX_CHARS}
    # Lone surrogates cannot be said in a JSON Schema pattern (ECMA 262 sees UTF-16); the reader refuses them.
    no_controls = "^[^\\u0000-\\u001f\\u007f-\\u009f]*$"
    if f.marker(NotBlank):
        return {**schema, "allOf": [{"pattern": no_controls}, {"pattern": r"\S"}]}
    return {**schema, "pattern": no_controls}


def _field_schema(f: _Field, version: int) -> dict[str, Any]:
    schema = _kind_schema(f, version)
    doc = f.marker(Doc)
    if f.optional:
        schema = {"anyOf": [schema, {"type": "null"}]}
    if doc is not None:
        schema["description"] = doc.text
    return schema


def _kind_schema(f: _Field, version: int) -> dict[str, Any]:
    if f.marker(VersionField):
        return {"const": version}
    kind = f.kind
    if dataclasses.is_dataclass(kind):
        return _object_schema(typing.cast(type, kind), version)
    if typing.get_origin(kind) is tuple:
        (item,) = [arg for arg in typing.get_args(kind) if arg is not Ellipsis]
        return {"type": "array", "items": _object_schema(item, version)}
    if kind is bool:
        return {"type": "boolean"}
    bounds = _range(f)
    if kind is int:
        return {"type": "integer", "minimum": bounds.minimum, "maximum": bounds.maximum}
    if kind is float:
        number = {"type": "number", "minimum": bounds.minimum}
        return number if bounds.maximum == MAX_SAFE_INT else {**number, "maximum": bounds.maximum}
    choice = f.marker(Choice)
    if choice is not None:
        return {"enum": list(choice.values)}
    if kind is str:
        return _string_schema(f)
    allowed = list(_allowed(kind, version))
    return {"const": allowed[0]} if len(allowed) == 1 else {"enum": allowed}
