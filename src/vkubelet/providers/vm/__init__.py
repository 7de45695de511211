"""The VM provider: each pod is a QEMU virtual machine (docs/vm-provider.md).

`vkubelet run --provider vm --provider-config vm.yaml`. The modules: `_config` (the config
file), `_spec` (a pod read as a machine), `_provider` (the kubelet's side: pull, boot, restart,
stop, adopt), `_verbs` (exec, attach, port-forward), `_stats` (kubectl top), `_console` (serial
console to CRI logs), `_backend` (what the provider needs from the runtime, as protocols) and
`_runtime` (that runtime on QEMU, the image store and the pod network: `_machine`, `_qmp`,
`_qga`, `_net`, `_accel`, `_seed`, `_translate`, `_store`, `_disks`, `_cloudinit`).
"""

from ._config import ConfigError, VMConfig, load_config
from ._provider import ACCELERATOR_CONDITION, VMProvider, create

__all__ = [
    "ACCELERATOR_CONDITION",
    "ConfigError",
    "VMConfig",
    "VMProvider",
    "create",
    "load_config",
]
