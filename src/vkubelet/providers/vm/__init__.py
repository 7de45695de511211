"""The VM provider: each pod is a QEMU virtual machine (docs/vm-provider.md).

`vkubelet run --provider vm --provider-config vm.yaml`. The modules: `_config` (the config
file), `_spec` (a pod read as a machine), `_provider` (the kubelet's side: pull, boot, restart,
stop, adopt), `_verbs` (exec, attach, port-forward), `_stats` (kubectl top), `_console` (serial
console to CRI logs), `_backend` (what the provider needs from the runtime, as protocols) and
`_runtime` (that runtime on QEMU, the image store and the pod network: `_machine`, `_qmp`,
`_qga`, `_net`, `_accel`, `_seed`, `_translate`, `_store`, `_disks`, `_cloudinit`). A config
with `hosts` is a fleet of libvirt hosts, one node each (`_fleet`, volumes in `_pool`).
"""

from __future__ import annotations

from ...sdk import ProviderContext
from ._config import ConfigError, VMConfig, load_config
from ._fleet import VMFleet, load_fleet
from ._provider import ACCELERATOR_CONDITION, VMProvider
from ._provider import create as create_node

__all__ = [
    "ACCELERATOR_CONDITION",
    "ConfigError",
    "VMConfig",
    "VMFleet",
    "VMProvider",
    "create",
    "load_config",
    "load_fleet",
]


def create(context: ProviderContext) -> VMProvider | VMFleet:
    """Entry point (`vkubelet.providers`: vm): one node, or one node per host of a fleet (a
    config with `hosts`)."""
    if context.config_path is not None and (hosts := load_fleet(context.config_path)):
        return VMFleet(hosts, host_ip=context.internal_ip, events=context.events)
    return create_node(context)
