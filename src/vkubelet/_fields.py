"""One way to read a configuration file: its sections are declared as `Section` structs and
`decode` checks a file's content against them. A misspelt key or a value of the wrong kind is an
error naming the file and the field (`agent.yaml: nodes[1].kubeletPort: expected an integer in
0..65535`), never a setting silently ignored nor a traceback. What a type cannot say (a quantity,
a CIDR, a taint) each loader checks after decoding, with the same message shape."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import yaml
from msgspec import inspect

from .sdk.config import ConfigError
from .sdk.quantity import parse_quantity

__all__ = [
    "FilePath",
    "PositiveInt",
    "PositiveNumber",
    "Section",
    "check_quantities",
    "decode",
    "read_file",
]

T = TypeVar("T")

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
PositiveNumber = Annotated[float, msgspec.Meta(gt=0)]
FilePath = Annotated[str, msgspec.Meta(min_length=1, description="a path")]


class Section(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """A mapping in a configuration file: camelCase keys, and none it does not declare. A
    field's `Meta(description=...)` is what its errors say is expected, when the type alone
    would say it badly."""


def read_file(path: Path, language: str = "YAML") -> Any:
    """The parsed content of a YAML (or JSON) file; a missing or unparsable one is a ConfigError."""
    try:
        text = path.read_text()
        return json.loads(text) if language == "JSON" else yaml.safe_load(text)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (ValueError, yaml.YAMLError) as e:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{path}: not valid {language}: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e}") from None


# msgspec's "<problem> - at `$.a.b[0]`" (or "- at `key` in `$.a`" for a mapping's key)
_ERROR = re.compile(r"(?P<problem>.*?)(?: - at `(?:key` in `)?\$(?P<path>[^`]*)`)?", re.DOTALL)
_STEP = re.compile(r"\.([^.\[]+)|\[([^\]]+)\]")


def decode(raw: Any, schema: type[T], where: str, *, at: str = "", what: str = "") -> T:
    """`raw` (the parsed file, or its part at field path `at`) as a `schema`. `what` says what the
    whole is when it is not even a mapping (default: the schema's description)."""
    try:
        return msgspec.convert(raw, schema, strict=True, dec_hook=_custom)
    except msgspec.ValidationError as e:
        found = _ERROR.fullmatch(str(e))
        assert found is not None  # the pattern matches any text
        steps = [(name or index) for name, index in _STEP.findall(found["path"] or "")]
        field, problem = _explain(found["problem"], inspect.type_info(schema), steps, what)
        field = ".".join(p for p in (at, field) if p).replace(".[", "[")
        raise ConfigError(
            f"{where}: {field}: {problem}" if field else f"{where}: {problem}"
        ) from None


def check_quantities(values: Mapping[str, str], where: str, at: str) -> None:
    """Each of `values` (the mapping at field path `at`) is a Kubernetes quantity."""
    for name, value in values.items():
        try:
            parse_quantity(value)
        except ValueError:
            raise ConfigError(
                f"{where}: {at}.{name}: {value!r} is not a Kubernetes quantity"
            ) from None


def _custom(kind: type, value: Any) -> Any:
    """The type msgspec does not know: a path."""
    if kind is Path and isinstance(value, str) and value:
        return Path(value)
    raise TypeError(f"not a {kind.__name__}")  # said as "expected ..." by _explain


def _explain(problem: str, kind: Any, steps: list[str], what: str) -> tuple[str, str]:
    """The field path and the problem, in the words of the schema rather than of msgspec."""
    path = ""
    for step in steps:
        bare = _bare(kind)
        if isinstance(bare, inspect.StructType):
            kind = next(f.type for f in bare.fields if f.encode_name == step)
            path += f".{step}"
        elif isinstance(_bare(_item(bare)), inspect.StructType):  # an entry of a list of sections
            kind = _item(bare)
            path += f"[{step}]"
        else:  # a bad entry of a list or mapping of plain values: the list or mapping is bad
            break
    path = path.lstrip(".")
    named = re.fullmatch(r"Object (contains unknown|missing required) field `(.+)`", problem)
    if named:
        section = _bare(kind)
        assert isinstance(section, inspect.StructType)
        field = next((f for f in section.fields if f.encode_name == named[2]), None)
        path = f"{path}.{named[2]}".lstrip(".")
        if field is None:
            known = ", ".join(sorted(f.encode_name for f in section.fields))
            return path, f"unknown field (known: {known})"
        return path, f"required ({_describe(field.type)})"
    expected = (what if not path and what else "") or _describe(kind)
    enum = re.fullmatch(r"Invalid enum value (.+)", problem)
    return path, f"expected {expected}" + (f" (got {enum[1]})" if enum else "")


def _bare(kind: Any) -> Any:
    """The type itself, without its description or its `| None`."""
    if isinstance(kind, inspect.UnionType):
        types = [k for k in kind.types if not isinstance(k, inspect.NoneType)]
        kind = types[0] if len(types) == 1 else kind
    return _bare(kind.type) if isinstance(kind, inspect.Metadata) else kind


def _item(kind: Any) -> Any:
    if isinstance(kind, inspect.ListType | inspect.SetType | inspect.VarTupleType):
        return kind.item_type
    return kind.value_type if isinstance(kind, inspect.DictType) else None


def _describe(kind: Any) -> str:
    """What a value of this type is, as the error's "expected ..." says it."""
    if isinstance(kind, inspect.Metadata):
        return str((kind.extra_json_schema or {}).get("description") or _describe(kind.type))
    if isinstance(kind, inspect.IntType | inspect.FloatType):
        noun = "integer" if isinstance(kind, inspect.IntType) else "number"
        if kind.gt == 0:
            return f"a positive {noun}"
        article = "an" if noun == "integer" else "a"
        if kind.ge is not None and kind.le is not None:
            return f"{article} {noun} in {kind.ge:g}..{kind.le:g}"
        return f"{article} {noun}" + (f" >= {kind.ge:g}" if kind.ge is not None else "")
    if isinstance(kind, inspect.UnionType):
        return " or ".join(_describe(k) for k in kind.types if not isinstance(k, inspect.NoneType))
    if isinstance(kind, inspect.StructType):
        return f"a mapping ({', '.join(f.encode_name for f in kind.fields)})"
    if isinstance(kind, inspect.DictType):
        return (
            "a mapping of strings" if isinstance(kind.value_type, inspect.StrType) else "a mapping"
        )
    if isinstance(kind, inspect.LiteralType):
        return "one of " + ", ".join(map(str, kind.values))
    if isinstance(kind, inspect.CustomType):
        return "a path"
    if isinstance(kind, inspect.StrType):
        return "a non-empty string" if kind.min_length else "a string"
    return "true or false" if isinstance(kind, inspect.BoolType) else "a list"
