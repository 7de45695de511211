"""Typed views of untrusted JSON: the input is whatever the API (or a hostile client) sent."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

from .sources import JSON, SourceReadError


def obj(value: Any) -> JSON:
    """`value` if it is a JSON object, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def seq(value: Any) -> Sequence[Any]:
    """`value` if it is a JSON array, else an empty one."""
    return value if isinstance(value, list | tuple) else ()


def text(value: Any) -> str:
    """`value` if it is a string, else the empty string (what Go's zero value would be)."""
    return value if isinstance(value, str) else ""


def string_map(value: Any) -> dict[str, str]:
    """A `map[string]string` field (labels, ConfigMap data); non-string values are dropped."""
    return {k: v for k, v in obj(value).items() if isinstance(k, str) and isinstance(v, str)}


def decode_base64_map(value: Any) -> dict[str, bytes]:
    """A `map[string][]byte` field (Secret data, ConfigMap binaryData) as the API encodes it.

    Raises `SourceReadError`: an object that does not decode was not read correctly.
    """
    decoded: dict[str, bytes] = {}
    for key, encoded in obj(value).items():
        if not isinstance(key, str) or not isinstance(encoded, str):
            raise SourceReadError(f"key {key!r}: value is not a base64 string")
        try:
            decoded[key] = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as err:
            raise SourceReadError(f"key {key!r}: invalid base64: {err}") from err
    return decoded


def utf8_bytes(value: str) -> bytes:
    """`value` as UTF-8, lone surrogates becoming U+FFFD as Go's JSON decoder would make them
    (Python's decoder keeps them, and `str.encode` would then fail on hostile input)."""
    return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode()


def bytes_to_env(value: bytes) -> str:
    """Secret bytes as a variable value, byte for byte (Go's `string(b)` keeps invalid UTF-8).

    Invalid UTF-8 survives as surrogate escapes: `value.encode("utf-8", "surrogateescape")`
    gives the original bytes back.
    """
    return value.decode("utf-8", "surrogateescape")
