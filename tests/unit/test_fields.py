"""The one config-schema mechanism: whatever is wrong, and however deep, the error names the file
and the field path and says what was expected there, in the schema's words."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
from msgspec import Meta, field

from vkubelet._fields import PositiveInt, Section, decode, read_file
from vkubelet.sdk import ConfigError


class _Inner(Section):
    seconds: Annotated[float, Meta(gt=0, le=60, description="seconds in (0, 60]")] = 1.0


class _Entry(Section):
    name: Annotated[str, Meta(min_length=1)]
    port: Annotated[int, Meta(ge=1, le=65535)] = 22


class _File(Section):
    entries: list[_Entry] = field(default_factory=list)
    inner: _Inner | None = None
    mode: Literal["a", "b"] = "a"
    count: PositiveInt = 1
    names: Annotated[list[str], Meta(description="a list of names")] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "f.yaml: expected the whole"),
        ({"colour": 1}, "f.yaml: colour: unknown field (known: count, entries, inner, "),
        ({"entries": [{}]}, "f.yaml: entries[0].name: required (a non-empty string)"),
        ({"entries": ["x"]}, "f.yaml: entries[0]: expected a mapping (name, port)"),
        (
            {"entries": [{"name": "a", "port": 0}]},
            "f.yaml: entries[0].port: expected an integer in 1..65535",
        ),
        (
            {"entries": [{"name": "a", "port": True}]},
            "f.yaml: entries[0].port: expected an integer",
        ),
        ({"inner": {"seconds": 61}}, "f.yaml: inner.seconds: expected seconds in (0, 60]"),
        ({"inner": {"second": 1}}, "f.yaml: inner.second: unknown field (known: seconds)"),
        ({"mode": "c"}, "f.yaml: mode: expected one of a, b (got 'c')"),
        ({"count": 0}, "f.yaml: count: expected a positive integer"),
        ({"names": [1]}, "f.yaml: names: expected a list of names"),
        ({"labels": {"a": 1}}, "f.yaml: labels: expected a mapping of strings"),
    ],
)
def test_a_bad_value_is_named_by_its_field_path(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        decode(raw, _File, "f.yaml", what="the whole")
    assert str(error.value).startswith(message)


def test_a_part_of_a_file_is_named_below_its_own_path() -> None:
    with pytest.raises(ConfigError, match=r"^f\.yaml: webhook\.inner\.seconds: expected"):
        decode({"inner": {"seconds": 0}}, _File, "f.yaml", at="webhook")
    with pytest.raises(ConfigError, match=r"^f\.yaml: node-0: expected an object$"):
        decode(3, _File, "f.yaml", at="node-0", what="an object")


def test_a_good_file_decodes_with_its_defaults() -> None:
    decoded = decode({"entries": [{"name": "a"}], "inner": {}}, _File, "f.yaml")
    assert decoded.entries == [_Entry(name="a", port=22)]
    assert decoded.inner == _Inner(seconds=1.0)


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.yaml: no such file"):
        read_file(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [")
    with pytest.raises(ConfigError, match=r"broken\.yaml: not valid YAML"):
        read_file(broken)
    with pytest.raises(ConfigError, match=r"broken\.yaml: not valid JSON"):
        read_file(broken, "JSON")
