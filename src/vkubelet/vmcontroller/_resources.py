"""Where the three custom resources live in the API (the CRDs are in `crds/`)."""

from ..kube import Resource

__all__ = ["VirtualMachine", "VirtualMachineBackup", "VirtualMachineMigration"]

VirtualMachine = Resource("vkubelet.io/v1alpha1", "VirtualMachine", "virtualmachines")
VirtualMachineBackup = Resource(
    "vkubelet.io/v1alpha1", "VirtualMachineBackup", "virtualmachinebackups"
)
VirtualMachineMigration = Resource(
    "vkubelet.io/v1alpha1", "VirtualMachineMigration", "virtualmachinemigrations"
)
