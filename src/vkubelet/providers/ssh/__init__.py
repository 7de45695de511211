"""SSH devices as nodes: machines that cannot run a kubelet run pods as supervised processes.

One virtual node per device of an inventory file (`_inventory`), which is re-read when it
changes. Each device has one multiplexed SSH connection (`_link`); a pod becomes a supervisor
script on the device (`_remote`) that starts its containers' commands as process groups,
restarts them by the pod's restart policy and keeps their states, exit codes and logs in files,
so pods outlive SSH drops and agent restarts. The provider (`_provider`) mirrors those files
into pod statuses and serves logs, exec, attach and port-forward over the same connection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...sdk import ConfigError, ProviderContext
from ._inventory import DeviceConfig, Inventory, load_inventory

if TYPE_CHECKING:
    from ._fleet import SshFleet

__all__ = ["DeviceConfig", "Inventory", "create", "load_inventory"]


def create(context: ProviderContext) -> SshFleet:
    """Entry point (`vkubelet.providers`: ssh): the inventory is `--provider-config`."""
    # Imported here: `vkubelet providers` lists this provider without importing asyncssh.
    from ._fleet import SshFleet

    if context.config_path is None:
        raise ConfigError("the ssh provider needs --provider-config: the inventory of devices")
    inventory = load_inventory(context.config_path)
    return SshFleet(context.config_path, inventory, events=context.events)
