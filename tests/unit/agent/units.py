"""Reading the systemd units `vkubelet host install` writes, for the unit test of the units and
the integration test that runs the service as written."""

from __future__ import annotations


def unit_settings(text: str, section: str) -> dict[str, str]:
    """`Key=value` lines of one section of a unit (the last one wins, as in systemd)."""
    settings: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("["):
            current = line.strip("[]")
        elif current == section and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            settings[key] = value
    return settings
