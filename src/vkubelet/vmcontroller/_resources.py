"""The lightkube classes of the three custom resources (the CRDs are in `crds/`)."""

from lightkube.generic_resource import create_namespaced_resource

__all__ = ["VirtualMachine", "VirtualMachineBackup", "VirtualMachineMigration"]

VirtualMachine = create_namespaced_resource(
    "vkubelet.io", "v1alpha1", "VirtualMachine", "virtualmachines"
)
VirtualMachineBackup = create_namespaced_resource(
    "vkubelet.io", "v1alpha1", "VirtualMachineBackup", "virtualmachinebackups"
)
VirtualMachineMigration = create_namespaced_resource(
    "vkubelet.io", "v1alpha1", "VirtualMachineMigration", "virtualmachinemigrations"
)
