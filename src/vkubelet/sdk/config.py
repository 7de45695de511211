"""What the agent's configuration and the providers' share: one error type for a bad setting, and
the taint syntax (`kubectl taint`'s), so that a misconfigured node reads the same whichever file
or flag it came from. Here, below the node agent, because providers raise and parse them too."""

from __future__ import annotations

__all__ = ["ConfigError", "parse_taint"]

_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}


class ConfigError(ValueError):
    pass


def parse_taint(text: str) -> dict[str, str]:
    """`key=value:Effect` or `key:Effect`, as kubectl taint writes them."""
    spec, sep, effect = text.rpartition(":")
    if not sep or effect not in _EFFECTS:
        raise ConfigError(
            f"taint {text!r}: expected key[=value]:Effect with Effect one of {sorted(_EFFECTS)}"
        )
    key, _, value = spec.partition("=")
    if not key:
        raise ConfigError(f"taint {text!r}: empty key")
    taint = {"key": key, "effect": effect}
    if value:
        taint["value"] = value
    return taint
