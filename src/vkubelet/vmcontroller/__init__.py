"""The VirtualMachine controller (issue 13): custom resources for VMs run by the vm provider.

`vkubelet vm install-crds` installs the CRDs, `vkubelet vm-controller` runs the controller (one
active instance by a Lease). See docs/vm-resource.md.
"""

from ._base import (
    MACHINE_ANNOTATION,
    NAME_LABEL,
    POWER_OFF_ANNOTATION,
    ROOT_DISK_SIZE_ANNOTATION,
    Context,
    Reconciler,
    Watched,
)
from ._controller import ControllerConfig, VMController, default_reconcilers, run_controller
from ._crds import crd_yaml, install_crds
from ._import import ImportResult, import_manifest, import_vm, vm_name_for
from ._resources import VirtualMachine, VirtualMachineBackup, VirtualMachineMigration

__all__ = [
    "MACHINE_ANNOTATION",
    "NAME_LABEL",
    "POWER_OFF_ANNOTATION",
    "ROOT_DISK_SIZE_ANNOTATION",
    "Context",
    "ControllerConfig",
    "ImportResult",
    "Reconciler",
    "VMController",
    "VirtualMachine",
    "VirtualMachineBackup",
    "VirtualMachineMigration",
    "Watched",
    "crd_yaml",
    "default_reconcilers",
    "import_manifest",
    "import_vm",
    "install_crds",
    "run_controller",
    "vm_name_for",
]
