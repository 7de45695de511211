"""STUB (vmmigrate's branch): the VirtualMachine controller package is vmcrd's; on merge, take
vmcrd's `__init__.py`."""
