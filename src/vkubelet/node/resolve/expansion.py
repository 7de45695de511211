"""`$(VAR)` expansion, Kubernetes' rules (third_party/forked/golang/expansion)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .jsonvalues import seq, text
from .sources import JSON


def expand(value: str, *scopes: Mapping[str, str]) -> str:
    """Expand `$(NAME)` references in `value`, looking NAME up in each scope in turn.

    Kubernetes' rules, which are not the shell's: `$$` is a literal `$`; an unknown or
    unterminated reference is kept verbatim; `$` followed by anything else is kept with that
    character; there is no nesting and no `${}`; the result is not expanded again.
    """
    out: list[str] = []
    start = i = 0
    while i < len(value):
        if value[i] != "$" or i + 1 == len(value):
            i += 1
            continue
        out.append(value[start:i])
        after = value[i + 1]
        if after == "$":
            out.append("$")
            i += 2
        elif after == "(":
            close = value.find(")", i + 2)
            if close < 0:
                out.append("$(")
                i += 2
            else:
                out.append(_lookup(value[i + 2 : close], scopes))
                i = close + 1
        else:
            out.append("$" + after)
            i += 2
        start = i
    out.append(value[start:])
    return "".join(out)


def _lookup(name: str, scopes: Sequence[Mapping[str, str]]) -> str:
    for scope in scopes:
        if name in scope:
            return scope[name]
    return f"$({name})"


def expand_command_and_args(
    container: JSON, env: Sequence[tuple[str, str]]
) -> tuple[list[str], list[str]]:
    """The container's `command` and `args` with `$(VAR)` expanded against its final env.

    The kubelet does this too (ExpandContainerCommandAndArgs), so a provider that runs the
    command itself must use these, not the raw spec.
    """
    scope = dict(env)
    command = [expand(text(part), scope) for part in seq(container.get("command"))]
    args = [expand(text(part), scope) for part in seq(container.get("args"))]
    return command, args
