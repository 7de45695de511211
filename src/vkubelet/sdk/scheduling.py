"""The scheduler's required-placement rules on plain API dicts: node-selector terms and taint
tolerations, as kube-scheduler's NodeAffinity and TaintToleration plugins judge them.

Both the cluster provider (will a pod fit some lower node?) and the VM controller (does a
running VM's node still match its template?) must agree with the real scheduler, so the rules
live once, here, on dicts — the shape both read from watches — rather than on lightkube models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["requirement_holds", "term_matches", "tolerates"]


def requirement_holds(expression: Mapping[str, Any], values_of: Mapping[str, str]) -> bool:
    """One `matchExpressions`/`matchFields` requirement against a node's labels (or fields)."""
    key, operator = str(expression.get("key")), expression.get("operator")
    values = [str(v) for v in expression.get("values") or []]
    present, value = key in values_of, values_of.get(key, "")
    if operator == "In":
        return present and value in values
    if operator == "NotIn":
        return not present or value not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and values:
        try:
            number, bound = int(value), int(values[0])
        except ValueError:
            return False
        return number > bound if operator == "Gt" else number < bound
    return False


def term_matches(term: Mapping[str, Any], labels: Mapping[str, str], name: str) -> bool:
    """A node selector term: every requirement holds (an empty term matches nothing, as in
    Kubernetes); `matchFields` knows `metadata.name` only, as the API does."""
    expressions, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not expressions and not fields:
        return False
    return all(requirement_holds(e, labels) for e in expressions) and all(
        requirement_holds(f, {"metadata.name": name}) for f in fields
    )


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """Whether one toleration covers the taint (an empty effect or key with Exists: all)."""
    effect = toleration.get("effect")
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key")
    if toleration.get("operator") == "Exists":
        return not key or key == taint.get("key")
    return key == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or "")
