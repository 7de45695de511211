"""The inventory as a fleet of nodes: one node per device, following the file's edits."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from ...sdk import ConfigError, FleetNode
from ...sdk.provider import EventSink
from ._inventory import DeviceConfig, Inventory, load_inventory
from ._provider import DeviceProvider

log = logging.getLogger(__name__)

__all__ = ["SshFleet"]

_POLL_INTERVAL = 2.0  # seconds between two looks at the inventory file


class SshFleet:
    """Implements `NodeFleet`: the inventory file is polled for changes (a stat every
    `_POLL_INTERVAL` seconds, cheap and portable across editors that replace files)."""

    def __init__(self, path: Path, inventory: Inventory, *, events: EventSink | None) -> None:
        self.path = path
        self.events = events  # probe events of the devices' pods
        self.inventory = inventory
        self._members_by_name: dict[str, tuple[DeviceConfig, FleetNode]] = {}

    def _members(self) -> list[FleetNode]:
        """The same `FleetNode` for an unchanged device; a new one (and a new provider, which
        adopts the pods already on the device) for a changed device."""
        wanted = {d.name: d for d in self.inventory.devices}
        for name in list(self._members_by_name):
            config, _ = self._members_by_name[name]
            if wanted.get(name) != config:
                del self._members_by_name[name]
        members = []
        for device in self.inventory.devices:
            if device.name not in self._members_by_name:
                provider = DeviceProvider(device, events=self.events)
                provider.start()
                member = FleetNode(
                    name=device.name,
                    provider=provider,
                    labels=dict(device.labels),
                    taints=device.taint_list(),
                )
                self._members_by_name[device.name] = (device, member)
            members.append(self._members_by_name[device.name][1])
        return members

    async def watch_nodes(self) -> AsyncIterator[Sequence[FleetNode]]:
        yield self._members()
        stamp = _stamp(self.path)
        while True:
            await asyncio.sleep(_POLL_INTERVAL)
            current = _stamp(self.path)
            if current == stamp:
                continue
            stamp = current
            try:
                inventory = load_inventory(self.path)
            except ConfigError as e:
                log.error("inventory not reloaded, the devices stay as they were: %s", e)
                continue
            if inventory == self.inventory:
                continue
            before = {d.name for d in self.inventory.devices}
            after = {d.name for d in inventory.devices}
            log.info(
                "inventory reloaded: %d devices (added: %s; removed: %s)",
                len(after),
                ", ".join(sorted(after - before)) or "none",
                ", ".join(sorted(before - after)) or "none",
            )
            self.inventory = inventory
            yield self._members()


def _stamp(path: Path) -> tuple[float, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime, st.st_size, st.st_ino)
