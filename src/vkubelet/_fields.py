"""The check every configuration loader makes first: no field it does not know. A misspelt key
is an error naming the file and the field, never a setting silently ignored."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any


def reject_unknown(
    raw: Mapping[Any, Any],
    known: Collection[str],
    at: str,
    fail: Callable[[str, str], Exception],
) -> None:
    """Raise `fail(field path, problem)` for the first key of `raw` (the mapping at field path
    `at`, "" for the top of the file) that is not in `known`."""
    unknown = sorted(set(map(str, raw)) - set(known))
    if unknown:
        path = f"{at}.{unknown[0]}" if at else unknown[0]
        raise fail(path, f"unknown field (known: {', '.join(sorted(known))})")
