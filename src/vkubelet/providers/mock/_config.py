"""The mock provider's config file: the Go reference mock's format, plus options of our own.

    {"vk-mock-0": {"cpu": "8", "memory": "32Gi", "pods": "10000",
                   "startDelay": 0.5, "failureRatio": 0.0, "podCIDR": "10.244.0.0/16",
                   "stateFile": "/var/lib/vkubelet/mock-0.json", "pingFailFile": "/tmp/sick"}}

`cpu`, `memory`, `pods`, `others` and `providerID` are the reference's. `stateFile` makes the fake
backend outlive the agent (pods survive an agent restart, as they would on a real backend).
`pingFailFile` makes the provider unhealthy while that file exists.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any

from msgspec import Meta, field

from ..._fields import Section, check_quantities, decode, read_file
from ...sdk import ConfigError


class MockConfig(Section):
    cpu: str = "20"
    memory: str = "100Gi"
    pods: str = "110"
    others: Annotated[dict[str, str], Meta(description="an object")] = field(default_factory=dict)
    provider_id: str | None = field(default=None, name="providerID")
    # Seconds; a ratio: bool is not a number here, `failureRatio: true` is a mistake, not 100 %.
    start_delay: Annotated[float, Meta(ge=0, description="seconds >= 0")] = 0.0
    failure_ratio: Annotated[float, Meta(ge=0, le=1, description="a number in [0, 1]")] = 0.0
    pod_cidr: str = field(default="10.244.0.0/16", name="podCIDR")
    state_file: Path | None = None
    ping_fail_file: Path | None = None

    @classmethod
    def load(cls, path: Path | None, node_name: str) -> MockConfig:
        """Read the entry for `node_name`; without a file, the reference's defaults."""
        if path is None:
            return cls()
        where = str(path)
        data = read_file(path, "JSON")
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected an object keyed by node name")
        if node_name not in data:
            raise ConfigError(
                f"{where}: no entry for node {node_name!r} (entries: {', '.join(data) or 'none'})"
            )
        entry = data[node_name]
        if isinstance(entry, dict):  # a bare number is a quantity too (`pods: 110` in Helm values)
            entry = {k: _text(v) if k in ("cpu", "memory", "pods") else v for k, v in entry.items()}
            if isinstance(entry.get("others"), dict):
                entry["others"] = {k: _text(v) for k, v in entry["others"].items()}
        config = decode(entry, cls, where, at=node_name, what="an object")
        check_quantities(
            {"cpu": config.cpu, "memory": config.memory, "pods": config.pods}, where, node_name
        )
        check_quantities(config.others, where, f"{node_name}.others")
        try:
            ipaddress.ip_network(config.pod_cidr)
        except ValueError as e:
            raise ConfigError(f"{where}: {node_name}.podCIDR: {e}") from None
        return config


def _text(value: Any) -> Any:
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
