"""`$(VAR)` expansion follows Kubernetes' rules (third_party/forked/golang/expansion), not the
shell's: the cases below are the semantics Kubernetes' own expansion tests pin down."""

from __future__ import annotations

import pytest

from vkubelet.node.resolve import expand, expand_command_and_args, resolve_env

from .fakes import ALLOCATABLE, FakeSources, configmap, pod

SCOPE = {"VAR_A": "A", "VAR_B": "B", "VAR_C": "C", "VAR_REF": "$(VAR_A)", "VAR_EMPTY": ""}

CASES = [
    # (what it shows, input, expected)
    ("whole string", "$(VAR_A)", "A"),
    ("repeated reference", "$(VAR_A)-$(VAR_A)", "A-A"),
    ("at the beginning", "$(VAR_A)-1", "A-1"),
    ("in the middle", "___$(VAR_B)___", "___B___"),
    ("at the end", "___$(VAR_C)", "___C"),
    ("compound", "$(VAR_A)_$(VAR_B)_$(VAR_C)", "A_B_C"),
    ("escape then expand", "$$(VAR_B)_$(VAR_A)", "$(VAR_B)_A"),
    ("two escapes", "$$(VAR_A)_$$(VAR_B)", "$(VAR_A)_$(VAR_B)"),
    ("escaped bare operator", "f000-$$VAR_A", "f000-$VAR_A"),
    ("backslash is not an escape", "foo\\$(VAR_C)bar", "foo\\Cbar"),
    ("double backslash is not an escape", "foo\\\\$(VAR_C)bar", "foo\\\\Cbar"),
    ("many backslashes", "foo\\\\\\\\$(VAR_A)bar", "foo\\\\\\\\Abar"),
    ("no nesting", "$(VAR_A$(VAR_B))", "$(VAR_A$(VAR_B))"),
    ("no nesting, unbalanced", "$(VAR_A$(VAR_B)", "$(VAR_A$(VAR_B)"),
    ("values are not re-expanded", "$(VAR_REF)", "$(VAR_A)"),
    ("values are not re-expanded, twice", "%%$(VAR_REF)--$(VAR_REF)%%", "%%$(VAR_A)--$(VAR_A)%%"),
    ("empty variable", "foo$(VAR_EMPTY)bar", "foobar"),
    ("unterminated reference", "foo$(VAR_Awhoops!", "foo$(VAR_Awhoops!"),
    ("parentheses without operator", "f00__(VAR_A)__", "f00__(VAR_A)__"),
    ("shell special variables pass through", "$?_boo_$!", "$?_boo_$!"),
    ("bare operator is not a reference", "$VAR_A", "$VAR_A"),
    ("unknown variable is kept", "$(VAR_DNE)", "$(VAR_DNE)"),
    ("even operators, unknown variable", "$$$$$$(BIG_MONEY)", "$$$(BIG_MONEY)"),
    ("even operators, known variable", "$$$$$$(VAR_A)", "$$$(VAR_A)"),
    ("odd operators, unknown variable", "$$$$$$$(GOOD_ODDS)", "$$$$(GOOD_ODDS)"),
    ("odd operators, known variable", "$$$$$$$(VAR_A)", "$$$A"),
    ("missing opening parenthesis", "$VAR_A)", "$VAR_A)"),
    ("shell braces are not syntax", "${VAR_A}", "${VAR_A}"),
    ("trailing incomplete reference kept", "$(VAR_B)_______$(A", "B_______$(A"),
    ("trailing opener kept", "$(VAR_C)_______$(", "C_______$("),
    ("operator at the very end kept", "$(VAR_A)foobarzab$", "Afoobarzab$"),
    ("shell-escaped incomplete reference", "foo-\\$(VAR_A", "foo-\\$(VAR_A"),
    ("many openers in the middle", "--$($($($($--", "--$($($($($--"),
    ("many openers at the beginning", "$($($($($--foo$(", "$($($($($--foo$("),
    ("many openers at the end", "foo0--$($($($(", "foo0--$($($($("),
    ("escapes inside a name are not escapes", "$(foo$$var)", "$(foo$$var)"),
    ("newline untouched", "\n", "\n"),
    ("empty name is a normal unknown reference", "$()", "$()"),
    ("non-ASCII after the operator is kept whole", "$ü-$(VAR_A)", "$ü-A"),
]


@pytest.mark.parametrize(("value", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_expansion_matches_kubernetes_semantics(value: str, expected: str) -> None:
    assert expand(value, SCOPE) == expected


@pytest.mark.parametrize(("value", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_expansion_is_the_same_when_variables_are_split_across_scopes(
    value: str, expected: str
) -> None:
    first = {"VAR_A": "A", "VAR_EMPTY": ""}
    second = {"VAR_B": "B", "VAR_C": "C", "VAR_REF": "$(VAR_A)"}
    assert expand(value, first, second) == expected


def test_earlier_scope_wins_over_later_scope() -> None:
    assert expand("$(X)", {"X": "container"}, {"X": "service"}) == "container"


def test_references_see_only_variables_defined_before_them() -> None:
    container = {
        "name": "app",
        "env": [
            {"name": "FOO", "value": "bar"},
            {"name": "ZOO", "value": "$(FOO)-1"},
            {"name": "BLU", "value": "$(ZOO)-2"},
            {"name": "EARLY", "value": "$(LATE)"},
            {"name": "LATE", "value": "late"},
        ],
    }
    result = resolve_env(pod(), container, FakeSources(), node_allocatable=ALLOCATABLE)
    env = result.as_dict()
    assert (env["ZOO"], env["BLU"]) == ("bar-1", "bar-1-2")
    assert env["EARLY"] == "$(LATE)"


def test_env_from_variables_can_be_referenced_but_value_from_results_are_not_expanded() -> None:
    sources = FakeSources(objects=[configmap("cfg", {"HOST": "db", "RAW": "$(HOST)"})])
    container = {
        "name": "app",
        "envFrom": [{"configMapRef": {"name": "cfg"}}],
        "env": [
            {"name": "URL", "value": "postgres://$(HOST):5432"},
            {"name": "COPY", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "RAW"}}},
        ],
    }
    env = resolve_env(pod(), container, sources, node_allocatable=ALLOCATABLE).as_dict()
    assert env["URL"] == "postgres://db:5432"
    assert env["COPY"] == "$(HOST)"
    assert env["RAW"] == "$(HOST)"


def test_command_and_args_are_expanded_against_the_final_environment() -> None:
    container = {
        "name": "app",
        "command": ["/bin/server", "--port=$(PORT)"],
        "args": ["$(MISSING)", "$$(PORT)"],
    }
    command, args = expand_command_and_args(container, [("PORT", "8080")])
    assert command == ["/bin/server", "--port=8080"]
    assert args == ["$(MISSING)", "$(PORT)"]
