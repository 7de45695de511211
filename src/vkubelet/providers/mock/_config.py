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
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..._fields import reject_unknown
from ...sdk.quantity import parse_quantity

_KNOWN_KEYS = {
    "cpu",
    "memory",
    "pods",
    "others",
    "providerID",
    "startDelay",
    "failureRatio",
    "podCIDR",
    "stateFile",
    "pingFailFile",
}


class ConfigError(ValueError):
    """A bad provider config; the message names the file and the field."""


@dataclass(frozen=True)
class MockConfig:
    cpu: str = "20"
    memory: str = "100Gi"
    pods: str = "110"
    others: dict[str, str] = field(default_factory=dict)
    provider_id: str | None = None
    start_delay: float = 0.0
    failure_ratio: float = 0.0
    pod_cidr: str = "10.244.0.0/16"
    state_file: Path | None = None
    ping_fail_file: Path | None = None

    @classmethod
    def load(cls, path: Path | None, node_name: str) -> MockConfig:
        """Read the entry for `node_name`; without a file, the reference's defaults."""
        if path is None:
            return cls()
        where = str(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{where}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected an object keyed by node name")
        if node_name not in data:
            raise ConfigError(
                f"{where}: no entry for node {node_name!r} (entries: {', '.join(data) or 'none'})"
            )
        entry = data[node_name]
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: {node_name}: expected an object")
        reject_unknown(
            entry, _KNOWN_KEYS, node_name, lambda at, why: ConfigError(f"{where}: {at}: {why}")
        )
        for name in ("cpu", "memory", "pods"):
            if name in entry:
                _check_quantity(where, f"{node_name}.{name}", entry[name])
        others = entry.get("others") or {}
        if not isinstance(others, dict):
            raise ConfigError(f"{where}: {node_name}.others: expected an object")
        for name, value in others.items():
            _check_quantity(where, f"{node_name}.others.{name}", value)
        for name in ("providerID", "stateFile", "pingFailFile", "podCIDR"):
            if name in entry and not isinstance(entry[name], str):
                raise ConfigError(f"{where}: {node_name}.{name}: expected a string")
        ratio = entry.get("failureRatio", 0.0)
        # bool is an int in Python; `failureRatio: true` is a mistake, not 100 %.
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
            raise ConfigError(f"{where}: {node_name}.failureRatio: expected a number in [0, 1]")
        delay = entry.get("startDelay", 0.0)
        if isinstance(delay, bool) or not isinstance(delay, int | float) or delay < 0:
            raise ConfigError(f"{where}: {node_name}.startDelay: expected seconds >= 0")
        cidr = entry.get("podCIDR", cls.pod_cidr)
        try:
            ipaddress.ip_network(cidr)
        except ValueError as e:
            raise ConfigError(f"{where}: {node_name}.podCIDR: {e}") from None
        return cls(
            cpu=str(entry.get("cpu", cls.cpu)),
            memory=str(entry.get("memory", cls.memory)),
            pods=str(entry.get("pods", cls.pods)),
            others={k: str(v) for k, v in others.items()},
            provider_id=entry.get("providerID"),
            start_delay=float(delay),
            failure_ratio=float(ratio),
            pod_cidr=cidr,
            state_file=Path(entry["stateFile"]) if entry.get("stateFile") else None,
            ping_fail_file=Path(entry["pingFailFile"]) if entry.get("pingFailFile") else None,
        )


def _check_quantity(where: str, name: str, value: object) -> None:
    try:
        parse_quantity(str(value))
    except ValueError:
        raise ConfigError(f"{where}: {name}: {value!r} is not a Kubernetes quantity") from None
